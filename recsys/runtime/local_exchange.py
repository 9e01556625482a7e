"""All-to-alls between the ranks of one host through shared memory, instead of gloo's TCP.

gloo moves every collective over loopback TCP and hands it to threads of its own (per group,
a TCP event loop and two workers): CPU every training step pays on top of the store worker's
own share of the calls, taken from cores the step itself needs on a small host (BENCHMARKS.md,
"Trainer": a step's thread CPU through gloo and through shared memory). When every rank of a
group runs on this host, ``LocalExchange`` carries the same messages through files in
``/dev/shm``: a rank copies what it sends into its own outbox, writes a byte to each peer's
FIFO, waits for a byte from each peer, and copies its blocks out of the peers' outboxes.
Nothing else runs in between: no threads, no sockets, two ``memcpy`` per byte moved.

Layout, per rank ``r`` (``W`` ranks; files under ``/dev/shm/recsys-x<token>-``):

    <r>.fifo      the FIFO its peers signal it through: one byte, the sender's rank, per call
    <r>.ctl       int64 [2, 1 + 2W]: per call parity, the outbox's generation, then the
                  byte offset and size of the block for each rank
    <r>.<k>.<g>   outbox of parity k, generation g (a new generation when a call outgrows it)

Calls alternate between two outboxes by parity, which makes one signal a call enough: a
rank writes call c's outbox only after every peer has arrived at call c - 1, so every peer
is done reading call c - 2's, the outbox being overwritten. Signals carry the sender's rank
(a fast peer's next-call byte may arrive before a slow one's byte of this call).

Every file is unlinked as soon as every peer has it open (the FIFOs and control files at
setup, a new outbox one call later), so a killed run leaves at most one outbox behind.
A peer that exits is noticed: at once when no writer of the FIFO is left, else by its pid
at the next one-second poll (ranks in one pid namespace); a call that waits longer than
``timeout_s`` raises.

Used by the store's exchange (``recsys.store.sharded.exchange``), the trainer's per-step control
values and the dense gradients' mean (``recsys.train.distributed``); ``open`` returns None
(gloo stays) for one rank, ranks on several hosts, or no writable ``/dev/shm``.
"""

from __future__ import annotations

import mmap
import os
import secrets
import select
import stat
import time

import numpy as np

__all__ = ["LocalExchange", "SHM_DIR"]

SHM_DIR = "/dev/shm"
_MIN_OUTBOX = 1 << 20
_POLL_MS = 1000


class LocalExchange:
    """One rank's end of a shared-memory exchange among the ``W`` ranks of a process group
    (see module doc). Calls are collective: every rank makes the same calls in the same
    order, from one thread at a time."""

    def __init__(self, prefix: str, rank: int, world_size: int, pids: list[int | None], timeout_s: float) -> None:
        self.prefix, self.rank, self.world_size, self.pids = prefix, rank, world_size, pids
        self.timeout_s = timeout_s
        self.calls = 0
        W = world_size
        self._pending = np.zeros(W, dtype=np.int64)  # signals received ahead, per sender
        # (generation, the mapped bytes): an array over a map keeps the map, which is
        # unmapped once nothing views it
        self._out: list[tuple[int, np.ndarray | None]] = [(0, None), (0, None)]
        self._peer_maps: dict[tuple[int, int], tuple[int, np.ndarray]] = {}
        self._unlink_next: list[str] = []
        self._fifo_w: dict[int, int] = {}
        self._fifo_r = -1
        self._ctl: dict[int, np.ndarray] = {}  # each rank's control words [2, 1 + 2W]
        self._closed = False

    # ------------------------------------------------------------------ setup

    @classmethod
    def open(cls, group, timeout_s: float) -> "LocalExchange | None":
        """Return this rank's end over ``group`` (a gloo group: setup uses its object
        collectives; every rank of it must call), or None where gloo has to stay."""
        import torch.distributed as dist

        W, rank = dist.get_world_size(group), dist.get_rank(group)
        if W < 2:
            return None
        # rank 0 names the files and leaves a probe: a rank that cannot read it shares no
        # /dev/shm with rank 0 (another host or container)
        head = [None]
        if rank == 0:
            head = [_probe()]
        dist.broadcast_object_list(head, src=dist.get_global_rank(group, 0), group=group)
        prefix, nonce = head[0] if head[0] is not None else (None, None)
        ok = prefix is not None and _read_probe(prefix) == nonce
        seen = [None] * W
        dist.all_gather_object(seen, (ok, os.getpid(), _pid_namespace()), group=group)
        if rank == 0 and prefix is not None:
            _unlink(prefix + "probe")
        if not all(s[0] for s in seen):
            return None
        # a peer's pid means something here only in the same pid namespace (containers
        # sharing a /dev/shm may not be): else only EOF and the timeout notice an exit
        same_ns = len({s[2] for s in seen}) == 1 and seen[0][2] is not None
        ex = cls(prefix, rank, W, [s[1] if same_ns else None for s in seen], timeout_s)
        try:
            ex._open_own()
            ok = True
        except OSError:
            ok = False
        verdict = [None] * W
        dist.all_gather_object(verdict, ok, group=group)
        if not all(verdict):
            ex.close()
            return None
        ex._open_peers()
        dist.barrier(group=group)  # every rank holds every FIFO and control file open
        _unlink(ex._path("fifo"))
        _unlink(ex._path("ctl"))
        return ex

    def _path(self, name: str, rank: int | None = None) -> str:
        return f"{self.prefix}{self.rank if rank is None else rank}.{name}"

    def _open_own(self) -> None:
        os.mkfifo(self._path("fifo"), 0o600)
        self._fifo_r = os.open(self._path("fifo"), os.O_RDONLY | os.O_NONBLOCK)
        self._ctl[self.rank] = _map(self._path("ctl"), 2 * (1 + 2 * self.world_size) * 8,
                                    create=True).view(np.int64).reshape(2, -1)  # zeros

    def _open_peers(self) -> None:
        for r in range(self.world_size):
            if r == self.rank:
                continue
            self._fifo_w[r] = os.open(self._path("fifo", r), os.O_WRONLY)
            self._ctl[r] = _map(self._path("ctl", r)).view(np.int64).reshape(2, -1)
        # every writer is open: reads block from now on (and see EOF once all are gone)
        os.set_blocking(self._fifo_r, True)
        self._poll = select.poll()
        self._poll.register(self._fifo_r, select.POLLIN)

    # ------------------------------------------------------------------ calls

    def all_to_all(self, send: np.ndarray, send_sizes) -> tuple[np.ndarray, np.ndarray]:
        """Send ``send[...]``'s consecutive blocks of ``send_sizes[r]`` elements to rank r;
        return (the blocks received, in rank order, concatenated; their sizes)."""
        send = np.ascontiguousarray(send).reshape(-1)
        sizes = np.asarray(send_sizes, dtype=np.int64) * send.itemsize
        offsets = np.zeros(self.world_size, dtype=np.int64)
        np.cumsum(sizes[:-1], out=offsets[1:])
        if int(sizes.sum()) != send.nbytes:
            raise ValueError(f"all_to_all: blocks of {sizes.tolist()} bytes, {send.nbytes} sent")
        parts = self._call(send.view(np.uint8), offsets, sizes)
        recv = np.concatenate(parts).view(send.dtype) if parts else send[:0]
        return recv, np.array([p.nbytes // send.itemsize for p in parts], dtype=np.int64)

    def all_gather(self, send: np.ndarray) -> list[np.ndarray]:
        """Return every rank's ``send`` (same dtype), in rank order (this rank's: ``send``)."""
        send = np.ascontiguousarray(send).reshape(-1)
        W = self.world_size
        parts = self._call(send.view(np.uint8), np.zeros(W, dtype=np.int64), np.full(W, send.nbytes, dtype=np.int64))
        return [p.copy().view(send.dtype) for p in parts]

    def _call(self, data: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> list[np.ndarray]:
        if self._closed:
            raise RuntimeError("the local exchange is closed")
        k = self.calls & 1
        stale, self._unlink_next = self._unlink_next, []  # outboxes made by the call before
        out = self._outbox(k, data.nbytes)
        out[: data.nbytes] = data
        ctl = self._ctl[self.rank]
        ctl[k, 1 : 1 + self.world_size] = offsets
        ctl[k, 1 + self.world_size :] = sizes
        me = bytes([self.rank])
        for r, fd in self._fifo_w.items():
            try:
                os.write(fd, me)
            except BrokenPipeError:
                raise RuntimeError(f"local exchange: {self._who(r)} is gone") from None
        self._wait_all()
        # every peer arrived here, so it is done with the call before: the outboxes that
        # call made are mapped by now and may lose their names
        for path in stale:
            _unlink(path)
        parts = []
        for r in range(self.world_size):
            if r == self.rank:
                parts.append(data[offsets[r] : offsets[r] + sizes[r]])
                continue
            pctl = self._ctl[r]
            gen, off, size = int(pctl[k, 0]), int(pctl[k, 1 + self.rank]), int(pctl[k, 1 + self.world_size + self.rank])
            buf = self._peer_outbox(r, k, gen)
            parts.append(buf[off : off + size])
        self.calls += 1
        return parts  # views: valid until this rank's next call (peers overwrite only after it)

    def _outbox(self, k: int, nbytes: int) -> np.ndarray:
        gen, arr = self._out[k]
        if arr is not None and arr.nbytes >= nbytes:
            return arr
        size = max(_MIN_OUTBOX, int(nbytes * 1.5))
        gen += 1
        path = self._path(f"{k}.{gen}")
        try:
            arr = _map(path, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE, create=True)
        except OSError as e:
            raise RuntimeError(f"local exchange: {SHM_DIR} has no room for an outbox of {size} bytes "
                               f"({e.strerror}); free space there or set train.runtime.local_exchange = false") from None
        self._out[k] = (gen, arr)  # the old outbox lost its name one call after it was made
        self._ctl[self.rank][k, 0] = gen
        self._unlink_next.append(path)  # once every peer has opened it (next call)
        return arr

    def _peer_outbox(self, r: int, k: int, gen: int) -> np.ndarray:
        held = self._peer_maps.get((r, k))
        if held is None or held[0] != gen:
            held = self._peer_maps[(r, k)] = (gen, _map(self._path(f"{k}.{gen}", r), readonly=True))
        return held[1]

    def _wait_all(self) -> None:
        need = self._pending
        deadline = None
        while True:
            missing = [r for r in range(self.world_size) if r != self.rank and need[r] == 0]
            if not missing:
                break
            if not self._poll.poll(_POLL_MS):
                now = time.monotonic()
                deadline = deadline or now + self.timeout_s - _POLL_MS / 1000
                self._check_peers(missing, now > deadline)
                continue
            got = os.read(self._fifo_r, 256)
            if not got:  # no writer of the FIFO is left
                raise self._gone(missing)
            for b in got:
                need[b] += 1
        for r in range(self.world_size):
            if r != self.rank:
                need[r] -= 1

    def _check_peers(self, missing: list[int], timed_out: bool) -> None:
        gone = [r for r in missing if self.pids[r] is not None and not _alive(self.pids[r])]
        if gone:
            raise self._gone(gone)
        if timed_out:
            raise RuntimeError(f"local exchange: rank(s) {missing} did not arrive within {self.timeout_s:g} s")

    def _who(self, r: int) -> str:
        return f"rank {r}" if self.pids[r] is None else f"rank {r} (pid {self.pids[r]})"

    def _gone(self, ranks: list[int]) -> RuntimeError:
        """Return the error for peers that exited; unlink the outboxes they still named."""
        for r in ranks:
            for k, gen in enumerate(self._ctl[r][:, 0].tolist()):
                if gen:
                    _unlink(self._path(f"{k}.{gen}", r))
        who = ", ".join(self._who(r) for r in ranks)
        return RuntimeError(f"local exchange: {who} is gone (exited during a collective call)")

    # ------------------------------------------------------------------ end

    def close(self) -> None:
        """Close the FIFOs, drop the maps (unmapped once nothing views them) and unlink the
        files this rank still names (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for path in self._unlink_next:
            _unlink(path)
        self._unlink_next.clear()
        for k, (gen, _) in enumerate(self._out):
            if gen:
                _unlink(self._path(f"{k}.{gen}"))
        self._out = [(0, None), (0, None)]
        self._peer_maps.clear()
        self._ctl.clear()
        for fd in [self._fifo_r, *self._fifo_w.values()]:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._fifo_r, self._fifo_w = -1, {}
        _unlink(self._path("fifo"))
        _unlink(self._path("ctl"))


def _probe() -> tuple[str, str] | None:
    """Rank 0: return (the files' prefix, the probe's content), or None without a usable /dev/shm."""
    try:
        st = os.stat(SHM_DIR)
        if not stat.S_ISDIR(st.st_mode) or not os.access(SHM_DIR, os.W_OK):
            return None
        prefix = f"{SHM_DIR}/recsys-x{secrets.token_hex(8)}-"
        nonce = secrets.token_hex(8)
        fd = os.open(prefix + "probe", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, nonce.encode())
        finally:
            os.close(fd)
        return prefix, nonce
    except OSError:
        return None


def _read_probe(prefix: str) -> str | None:
    try:
        with open(prefix + "probe") as f:
            return f.read()
    except OSError:
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: signal 0 asks the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def _map(path: str, size: int = 0, create: bool = False, readonly: bool = False) -> np.ndarray:
    """Return the bytes of file ``path`` mapped shared (``create``: a new file of ``size``
    bytes, reserved in full so that a full /dev/shm fails here, not as a SIGBUS later; it is
    unlinked again when that fails)."""
    flags = os.O_RDONLY if readonly else os.O_RDWR
    fd = os.open(path, flags | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            os.posix_fallocate(fd, 0, size)
        prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
        mm = mmap.mmap(fd, size or os.fstat(fd).st_size, prot=prot)
    except OSError:
        if create:
            _unlink(path)
        raise
    finally:
        os.close(fd)
    return np.frombuffer(mm, dtype=np.uint8)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
