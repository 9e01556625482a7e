"""``recsys bench scale``: one DLRM job as its distinct ids grow ×10, in memory and then with spill.

The job is ``jobs/synthetic_small.toml``'s (DLRM, bottom MLP 64-32-16, top 128-64-1, 13
dense columns, row-wise Adagrad at its lr, Adam, dim 16), with its sparse side replaced by
26 single-hot features, one table each, whose id universes have the Criteo Kaggle
cardinalities' proportions scaled to a total of ``N`` distinct ids (a table keeps at least
``min(its Criteo cardinality, 100)`` ids, so the exact total, ``distinct_ids``, is a little
above ``N``). Ids are drawn per table from a bounded Zipf(1.05) law over its universe
(``recsys.io.zipf.zipf_ranks``, seeded by (seed, table)) and hashed as the reader hashes
them. Batch 4096, 2 torch threads, one process: the ``Trainer`` itself, nothing skipped
but the reader.

**What the synthetic source leaves out.** Batches come from ``SyntheticIds``, an in-memory
source with the reader's interface, made before the timed steps: no Parquet decode, no
hashing of raw ids on the reader's thread, no files. Writing 100 M distinct ids as Parquet
would take longer than the whole run and a disk's worth of space, and the reader's cost
per row does not depend on how many distinct ids there are (``recsys bench reader`` and
``bench train`` measure it). What scales with the ids — the key map, the rows, the LRU,
the spill tier, checkpoints — is all here.

**Sizes.** ``N`` grows ×10 (full: 1 M, 10 M, 100 M). Before each size the bench reads the
host's available memory and, from the per-row costs measured at the previous sizes, plans
it: *in memory* (``capacity`` = each table's universe) while the store and its checkpoint
fit in ``memory_budget_fraction`` of it; else *spilled*: ``capacity`` = ``N ×
spill_capacity_fraction`` rows (each table its share) and the Redis spill tier holds the
rest, while Redis, the store and the checkpoint fit; else the run stops there and says why
(``stopped``). A spilled size that does not fit as ×10 is tried at ×5, ×3, ×2 of the
previous size before stopping. ``--quick``: 10 k ids in memory, then 100 k spilled
(``memory_limit_rows`` forces the switch; capacity half the ids), batch 1024, 13 steps each:
the shape of the figures in well under a minute, not the figures (fixed costs swamp the
bytes per row at these sizes). The settings, the plan and the cost model are in
``recsys.bench.scale_plan``.

**One size** runs in a process forked from the bench's (a heap of its own: RSS readings are
its store's, not memory the previous size freed; torch and numba's kernels are loaded once,
in the parent, which runs no torch op) with a Redis the bench starts itself (no
persistence; ``$RECSYS_BENCH_REDIS`` names another one instead; the bench then deletes the
keys it wrote there, by namespace). A size whose process dies (out of memory) ends the run
with what it had (``stopped`` says so):

1. the batches are made, then the trainer is built (the store commits its tables' memory:
   ``store.host.prefault``);
2. *prefill*: every id of the universe is looked up once by training lookups that are then
   withdrawn (``store.cancel``: no gradient), coldest Zipf ranks first, one step each, so
   the store holds exactly ``distinct_ids`` rows (in memory, or the most recent
   ``capacity`` in memory and the rest in Redis, as after a long run); the trainer then
   starts after those steps;
3. ``warmup_chunks × chunk`` untimed steps, ``timed_chunks × chunk`` timed ones: samples/s
   per segment (fetch to fetch, as in ``bench train``), the trainer's step phases, the
   store's counters and the spill tier's clocks at each segment's end;
4. the trainer's final checkpoint (timed: ``checkpoint_s``, and its bytes on disk) and a
   restore of it into the same trainer (``restore_s``: dense state, then every row by key;
   with spill, the tier is cleared and the rows beyond ``capacity`` are spilled again).

**Figures per size.** ``samples_per_s`` (timed rows / seconds; per segment min, median,
max) and ``ratio_to_first``, against the first size of the same run.
``store_resident_bytes_per_row``, the store's RSS per row (target: <= 1.2 x
``payload_bytes_per_row`` = dim × 4 + 4, a float32 row and one float of row-wise Adagrad
state): the resident pages (``mincore``) of every array the store's tables hold after the
prefill (rows, optimizer state, key maps; with spill also the tier's index of spilled keys),
divided by the rows held in memory. ``bytes_per_row``: the process's resident memory after
the prefill minus before the trainer was built, both read after ``malloc_trim`` (the store
keeps freed temporaries for reuse, ``store.host.keep_freed_memory``; they are not rows), over the
same rows: it also holds fixed costs (the store's compiled kernels, ~60 MiB; the dense model
and Adam, the metrics writer, the first lookups' torch allocations), which swamp the small
sizes, so between two in-memory sizes ``marginal_bytes_per_row`` gives the growth per added
row, fixed costs cancelled; the plan sizes memory from these process figures. Next to them
``arrays_bytes_per_row`` (the ``nbytes`` of those arrays, written or not). ``hit_rate``:
looked-up keys that had a row in memory, over the timed steps. Spill: ``spill_reads`` (rows
read from Redis) and ``spill_writes`` (rows written) per step, the cost per row read (time
inside the tier's MGET calls / rows they returned, on the store's worker: the step waits
for it) and per row written (the writer thread's pipelined MSET time / rows; off the
step's path unless the write queue is full, which ``put_wait`` counts), and the longest
timed step against the median (target: no step longer than two medians, i.e. no stall
longer than one step). ``unique_keys_per_step`` feeds the all-to-all estimate of
docs/ARCHITECTURE.md's cost model. No assertions on timings.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import resource
import shutil
import statistics
import tempfile
import threading
import time
import traceback
from pathlib import Path

import numpy as np

from recsys.bench import comparison, with_passive_omp, quiet_fbgemm, versions
from recsys.bench.scale_plan import FULL, QUICK, Settings, _label, _ranks, capacities, cost_model, mem_available
from recsys.bench.scale_plan import plan_size, universes
from recsys.bench.store import CRITEO_CARDINALITIES, _kjt, _rss_bytes, _schema, _table_name
from recsys.bench.store import owned_arrays, resident_bytes
from recsys.bench.train import JOB, PausingSource, _window_phases

REDIS_ENV = "RECSYS_BENCH_REDIS"
"""A Redis URL for the spill tier instead of a redis-server the bench starts itself."""


# --------------------------------------------------------------------------- the data


class SyntheticIds:
    """In-memory batches with the reader's interface (``epoch``, iteration, ``state_dict``,
    ``load_state_dict``, ``close``): Zipf ids over fixed universes, hashed as the reader
    does; random dense columns and labels (the model learns nothing: only the cost counts).
    All batches are made up front (``make``), so the timed steps pay no generation."""

    def __init__(self, batches: list) -> None:
        self.batches = batches
        self.epoch = 0
        self.position = 0

    @classmethod
    def make(cls, s: Settings, unis: list[int], n_dense: int, steps: int) -> "SyntheticIds":
        import torch

        from recsys.features import hashing
        from recsys.io.batch import Batch

        B, T = s.batch, len(unis)
        keys = np.empty((steps, T, B), dtype=np.int64)
        for t, u in enumerate(unis):
            keys[:, t, :] = hashing.hash_int64(_ranks(s, t, u, steps * B), _table_name(t)).reshape(steps, B)
        g = torch.Generator().manual_seed(s.seed)
        batches = [Batch(dense=torch.randn(B, n_dense, generator=g),
                         labels=(torch.rand(B, generator=g) < 0.17).float(), sparse=_kjt(keys[i]))
                   for i in range(steps)]
        return cls(batches)

    def __iter__(self):
        while self.position < len(self.batches):
            self.position += 1
            yield self.batches[self.position - 1]
        self.epoch += 1

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        pass  # a restore is measured, not continued

    def close(self) -> None:
        pass


class _Source(PausingSource):
    """``PausingSource`` over ``SyntheticIds`` (merging states needs no reader)."""

    @staticmethod
    def merge_states(states: list[dict]) -> dict:
        return states[0]


# --------------------------------------------------------------------------- the spill tier's clocks


class SpillClock:
    """Time the spill tiers' Redis reads (``_mget_once``, on the store's worker: the lookups'
    own reads and their read-ahead), ``fetch`` (the whole miss path, in the lookup wait),
    ``prefetch`` (the read-ahead, while the step trains), ``put`` (encode, and waits while
    the write queue is full) and the writer's ``_write`` (pipelined MSET / UNLINK, its own
    thread): instance wrappers, the tier's code untouched."""

    FIELDS = ("mget_s", "mget_rows", "fetch_s", "fetch_calls", "prefetch_s", "put_s", "put_rows", "write_s",
              "write_rows")

    def __init__(self) -> None:
        self.totals = dict.fromkeys(self.FIELDS, 0.0)
        self._lock = threading.Lock()

    def _add(self, **kv) -> None:
        with self._lock:
            for k, v in kv.items():
                self.totals[k] += v

    def wrap(self, tier) -> None:
        mget, fetch, prefetch, put, write = tier._mget_once, tier.fetch, tier.prefetch, tier.put, tier._write

        def timed_mget(keys):
            t0 = time.perf_counter()
            got = mget(keys)
            self._add(mget_s=time.perf_counter() - t0, mget_rows=sum(v is not None for v in got))
            return got

        def timed_prefetch(keys):
            t0 = time.perf_counter()
            n = prefetch(keys)
            self._add(prefetch_s=time.perf_counter() - t0)
            return n

        def timed_fetch(keys, count=True):
            t0 = time.perf_counter()
            out = fetch(keys, count)
            self._add(fetch_s=time.perf_counter() - t0, fetch_calls=1)
            return out

        def timed_put(rows):
            t0 = time.perf_counter()
            put(rows)
            self._add(put_s=time.perf_counter() - t0, put_rows=rows.num_rows)

        def timed_write(batch):
            t0 = time.perf_counter()
            out = write(batch)
            self._add(write_s=time.perf_counter() - t0, write_rows=int(out[0].shape[0]))
            return out

        tier._mget_once, tier.fetch, tier.prefetch = timed_mget, timed_fetch, timed_prefetch
        tier.put, tier._write = timed_put, timed_write

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self.totals)


# --------------------------------------------------------------------------- one size (its own process)


def _counters(store) -> dict:
    out: dict[str, int] = {}
    for per_table in store.counters().values():
        for k, v in per_table.items():
            out[k] = out.get(k, 0) + int(v)
    return out


def _trimmed_rss() -> int:
    """Return this process's resident bytes after handing glibc's free heap memory back
    (``malloc_trim``): the store keeps freed temporaries for reuse (``store.host.keep_freed_memory``),
    which would otherwise count as rows."""
    import ctypes
    import ctypes.util

    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return _rss_bytes()


def _redis_used(url: str) -> int:
    from recsys.redisio.client import connect

    return int(connect(url).info("memory")["used_memory"])


def prefill_parts(s: Settings, unis: list[int], capacities: list[int]) -> int:
    """Return the prefill's lookups: about ``prefill_rows`` ids each, and each table's share
    at most half its capacity (a call's ids must fit; the other half keeps recent rows)."""
    return max(1, math.ceil(sum(unis) / s.prefill_rows),
               *(math.ceil(u / (0.5 * c)) for u, c in zip(unis, capacities)))


def _prefill(store, s: Settings, unis: list[int], capacities: list[int]) -> tuple[int, float]:
    """Insert every id of every universe, coldest ranks first, one withdrawn training lookup
    per step; return (steps used, seconds)."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recsys.features import hashing

    parts = prefill_parts(s, unis, capacities)
    T = len(unis)
    t0 = time.perf_counter()
    for j in range(parts):
        cols = []
        for t, u in enumerate(unis):  # ranks [lo, hi): the (parts - j)-th slice from the hot end
            lo, hi = u * (parts - 1 - j) // parts, u * (parts - j) // parts
            cols.append(hashing.hash_int64(np.arange(lo, hi, dtype=np.int64), _table_name(t)))
        width = max(c.shape[0] for c in cols)
        lengths = np.zeros((T, width), dtype=np.int32)
        for t, c in enumerate(cols):
            lengths[t, : c.shape[0]] = 1
        kjt = KeyedJaggedTensor(
            keys=[f"f{t:02d}" for t in range(T)], values=torch.from_numpy(np.concatenate(cols)),
            lengths=torch.from_numpy(lengths.reshape(-1)), stride=width,
            length_per_key=[c.shape[0] for c in cols],
            offset_per_key=np.concatenate([[0], np.cumsum([c.shape[0] for c in cols])]).tolist(),
        )
        store.cancel(store.lookup(kjt, j))
    store.flush()
    for table in store.tables.values():
        table.flush()  # spilled rows written
    return parts, time.perf_counter() - t0


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_size(s: Settings, n: int, spill_fraction: float | None, redis_url: str, work: str) -> dict:
    """Train the job at ``n`` distinct ids (``spill_fraction``: capacity as a share of the
    ids, rest in Redis; None: everything in memory); return its figures (``in_forked_process``)."""
    import torch

    from recsys.config import load_job
    from recsys.train.loop import Trainer, setup_env

    torch.set_num_threads(s.threads)
    unis = universes(n)
    spilled = spill_fraction is not None
    caps = capacities(s, unis, spill_fraction)
    base = load_job(JOB, [f"data.train.batch_size={s.batch}", "data.train.paths=[]", "data.eval.paths=[]",
                          "train.epochs=1", f"train.runtime.threads={s.threads}", f"train.log_every={s.chunk}",
                          "train.eval.every=0", "train.checkpoint.every_steps=0",
                          "train.checkpoint.every_minutes=0.0", "train.progress='none'", "train.schedule.warmup_steps=0",
                          "train.checkpoint.keep_last=1", *([f"store.spill.url='{redis_url}'"] if spilled else [])])
    (dim,) = {t.dim for t in base.schema.tables.values()}
    shape = type("Shape", (), {"dim": dim, "tables": len(unis)})
    schema = dataclasses.replace(_schema(shape, caps), label=base.schema.label, dense=list(base.schema.dense),
                                 dense_transform=base.schema.dense_transform)  # the job's (its data is synthetic)
    run_dir = Path(work) / f"run-{n}"
    t0 = time.perf_counter()
    data = SyntheticIds.make(s, unis, len(schema.dense), s.steps)
    make_s = time.perf_counter() - t0
    sample = data.batches[s.chunk * s.warmup_chunks: s.chunk * s.warmup_chunks + 10]
    T, B = len(unis), s.batch
    unique_per_step = float(np.mean([sum(np.unique(b.sparse.values().numpy()[t * B:(t + 1) * B]).shape[0]
                                         for t in range(T)) for b in sample]))
    redis0 = _redis_used(redis_url) if spilled else 0
    rss0 = _trimmed_rss()
    prefill_steps = math.ceil(prefill_parts(s, unis, caps) / s.chunk) * s.chunk  # metrics windows stay aligned
    job = dataclasses.replace(base, schema=schema, train=dataclasses.replace(
        base.train, max_steps=prefill_steps + s.steps))
    pause_at = {s.chunk * s.warmup_chunks + i * s.chunk for i in range(s.timed_chunks + 1)}
    source = _Source(data, pause_at, on_pause=None)
    t0 = time.perf_counter()
    trainer = Trainer(job, run_dir, setup_env("cpu"), source=source)
    build_s = time.perf_counter() - t0
    rss_built = _rss_bytes()
    store = trainer.store
    clock = SpillClock()
    for table in store.tables.values():
        if getattr(table, "spill", None) is not None:
            clock.wrap(table.spill)
    try:
        _, prefill_s = _prefill(store, s, unis, caps)
        rss1 = _trimmed_rss()
        redis1 = _redis_used(redis_url) if spilled else 0
        after_prefill = _counters(store)
        tables = list(store.tables.values())
        arrays = sum(owned_arrays(tables).values())
        resident = resident_bytes(tables)
        trainer.step = prefill_steps
        snaps: list[dict] = []

        def on_pause(i: int) -> None:
            snaps.append({"batch": i, "counters": _counters(store), "spill": clock.snapshot()})

        source.on_pause = on_pause
        saves: list[float] = []
        save = trainer.save

        def timed_save(lookahead: bool):
            t = time.perf_counter()
            path = save(lookahead)
            saves.append(time.perf_counter() - t)
            return path

        trainer.save = timed_save
        t0 = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - t0
        from recsys.checkpoint import write as ckpt

        path = ckpt.latest(run_dir / "checkpoints")
        ckpt_bytes = _dir_bytes(path)
        rss_before_restore = _rss_bytes()
        t0 = time.perf_counter()
        trainer.restore(path)
        restore_s = time.perf_counter() - t0
        restored = _counters(store)
    finally:
        trainer.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    w0 = s.chunk * s.warmup_chunks
    rows, seconds = source.timed(w0, w0 + s.chunk * s.timed_chunks)
    seg_s = [source.timed(w0 + i * s.chunk, w0 + (i + 1) * s.chunk)[1] for i in range(s.timed_chunks)]
    seg_rate = [s.chunk * s.batch / x for x in seg_s]
    step_ms = [1000 * (source.arrived[i + 1] - source.resumed[i]) for i in range(w0, w0 + s.chunk * s.timed_chunks)]
    first, last = snaps[0], snaps[-1]
    d = {k: last["counters"].get(k, 0) - first["counters"].get(k, 0) for k in last["counters"]}
    sp = {k: last["spill"][k] - first["spill"][k] for k in SpillClock.FIELDS}
    timed_steps = s.chunk * s.timed_chunks
    lookups = d.get("hits", 0) + d.get("misses", 0)
    rows_mem = after_prefill["rows"]
    payload = dim * 4 + 4
    phases = _window_phases(run_dir / "metrics.jsonl", prefill_steps + w0, {}, s.chunk)
    shutil.rmtree(run_dir, ignore_errors=True)
    out = {
        "ids": n,
        "distinct_ids": sum(unis),
        "mode": "spill" if spilled else "memory",
        "dim": dim,
        "capacity_rows": sum(caps),
        "rows_in_memory": rows_mem,
        "rows_spilled": max(0, after_prefill.get("spill_stored", 0)),
        "samples_per_s": rows / seconds,
        "segment_samples_per_s": [round(r, 1) for r in seg_rate],
        "samples_per_s_median": statistics.median(seg_rate),
        "samples_per_s_spread": [min(seg_rate), max(seg_rate)],
        "step_ms_median": statistics.median(step_ms),
        "step_ms_max": max(step_ms),
        "longest_step_over_median": max(step_ms) / statistics.median(step_ms),
        "phase_ms_per_step": phases,
        "hit_rate": d.get("hits", 0) / lookups if lookups else float("nan"),
        "evictions_per_step": d.get("evictions", 0) / timed_steps,
        "payload_bytes_per_row": payload,
        "bytes_per_row": (rss1 - rss0) / rows_mem,
        "bytes_per_row_ratio": (rss1 - rss0) / rows_mem / payload,
        "store_resident_bytes": resident,
        "store_resident_bytes_per_row": resident / rows_mem,
        "store_resident_ratio": resident / rows_mem / payload,
        "arrays_bytes_per_row": arrays / rows_mem,
        "store_rss_bytes": rss1 - rss0,
        "rss_bytes_after_build": rss_built - rss0,
        "peak_rss_bytes": peak,
        "peak_bytes_per_id_over_start": (peak - rss0) / sum(unis),
        "unique_keys_per_step": unique_per_step,
        "prefill_steps": prefill_steps,
        "prefill_s": prefill_s,
        "prefill_ids_per_s": sum(unis) / prefill_s,
        "checkpoint_s": saves[-1] if saves else float("nan"),
        "checkpoint_bytes": ckpt_bytes,
        "checkpoint_bytes_per_id": ckpt_bytes / sum(unis),
        "restore_s": restore_s,
        "rss_bytes_before_restore": rss_before_restore - rss0,
        "rows_after_restore": restored["rows"],
        "seconds": {"make_batches": make_s, "build": build_s, "prefill": prefill_s, "train_incl_checkpoint": train_s,
                    "restore": restore_s},
    }
    if spilled:
        out.update({
            "redis_bytes_per_spilled_row": (redis1 - redis0) / max(1, out["rows_spilled"]),
            "spill_reads_per_step": (d.get("spill_hits", 0) - d.get("spill_buffer_hits", 0)) / timed_steps,
            "spill_buffer_hits_per_step": d.get("spill_buffer_hits", 0) / timed_steps,
            "spill_writes_per_step": d.get("spill_writes", 0) / timed_steps,
            "spill_read_us_per_row": 1e6 * sp["mget_s"] / sp["mget_rows"] if sp["mget_rows"] else float("nan"),
            "spill_prefetch_hits_per_step": d.get("spill_prefetch_hits", 0) / timed_steps,
            "spill_fetch_ms_per_step": 1000 * sp["fetch_s"] / timed_steps,
            "spill_prefetch_ms_per_step": 1000 * sp["prefetch_s"] / timed_steps,
            "spill_write_us_per_row": 1e6 * sp["write_s"] / sp["write_rows"] if sp["write_rows"] else float("nan"),
            "spill_put_ms_per_step": 1000 * sp["put_s"] / timed_steps,
            "spill_clock_timed": sp,
        })
    return out


# --------------------------------------------------------------------------- entry


def _start_redis_for(work: Path):
    """Return (server or None, URL): ``$RECSYS_BENCH_REDIS``, else a redis-server of our own."""
    url = os.environ.get(REDIS_ENV, "")
    if url:
        return None, url
    from recsys.testing.harness import start_redis

    server = start_redis(work / "redis")
    return server.proc, server.url


def _clear_redis(url: str, own: bool, namespace: str) -> None:
    """Delete what a size left in Redis: everything in our own server, else its namespace."""
    from recsys.redisio.client import connect, glob_escape

    client = connect(url, timeout_s=120.0)
    if own:  # freed in the server's background: a synchronous FLUSHALL of 27 M keys outlasts a socket timeout
        client.flushall(asynchronous=True)
        return
    batch = []
    for name in client.scan_iter(match=f"{glob_escape(namespace)}:*", count=10_000):
        batch.append(name)
        if len(batch) >= 10_000:
            client.unlink(*batch)
            batch = []
    if batch:
        client.unlink(*batch)


def measure(quick: bool, data: Path | None = None, settings: Settings | None = None) -> dict:
    """Return the per-size figures and their comparisons (``settings`` overrides the presets)."""
    s = settings if settings is not None else (QUICK if quick else FULL)
    return with_passive_omp(lambda: _measure_all(s))


def _child(conn, fn, args) -> None:
    try:
        payload = ("ok", fn(*args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        payload = ("error", traceback.format_exc())
    conn.send(payload)
    conn.close()
    os._exit(0)  # no interpreter teardown: the store's and torch's threads are done with


def in_forked_process(fn, *args, timeout_s: float):
    """Return ``fn(*args)`` run in a forked child: a heap of its own (its RSS readings are its
    store's, not memory a previous size freed) without importing torch again. A child that
    dies (the kernel's OOM killer) raises ``RuntimeError`` with its exit status."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, fn, args), daemon=True)
    proc.start()
    send.close()
    try:
        if not recv.poll(timeout_s):
            proc.kill()
            raise RuntimeError(f"did not finish in {timeout_s:.0f} s")
        status, value = recv.recv()
    except EOFError:
        proc.join()
        raise RuntimeError(f"the process died (exit status {proc.exitcode}"
                           f"{': killed, most likely out of memory' if proc.exitcode == -9 else ''})") from None
    finally:
        recv.close()
    proc.join()
    if status != "ok":
        raise RuntimeError(value)
    return value


def _warm_kernels(s: Settings, url: str) -> None:
    """Load numba's compiled kernels (hashing, key map, rows, optimizer, spill index) in the
    parent, so no child pays their loading, nor counts their code as its store's memory.
    Numpy only: a torch parallel region before ``fork`` would leave the children's OpenMP
    pool broken."""
    from recsys.features.schema import TableSpec
    from recsys.store.config import SpillConfig, StoreConfig
    from recsys.store.tables.table import EmbeddingTable

    SyntheticIds.make(dataclasses.replace(s, batch=8), universes(1000), 1, 1)
    keys = np.arange(64, dtype=np.int64)
    for cfg in (StoreConfig(), StoreConfig(spill=SpillConfig(url=url))):
        table = EmbeddingTable("warm", TableSpec(dim=16, capacity=32), cfg)
        try:
            for step, part in enumerate((keys[:32], keys[32:], keys[:32])):  # the last one reads spilled rows
                table.lookup(part, step)
                table.apply_gradients(part, np.ones((32, 16), dtype=np.float32), step)
            table.state_dict()
        finally:
            table.close()


def _measure_all(s: Settings) -> dict:
    from recsys.config import load_job
    from recsys.store.config import run_namespace
    import logging

    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)  # torch's notice about its own API
    with quiet_fbgemm():
        from recsys.train import loop  # noqa: F401 - torch, torchrec and the store, imported once for every child

    job_name = load_job(JOB).name
    done: list[dict] = []
    plans: list[dict] = []
    stopped = ""
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="recsys-bench-scale-") as tmp:
        work = Path(tmp)
        server, url = _start_redis_for(work)
        try:
            _warm_kernels(s, url)
            previous = None
            for n in s.sizes:
                available = mem_available()
                plan = plan_size(s, n, previous, done, available)
                plan["available_bytes"] = available
                plans.append(plan)
                if "stopped" in plan:
                    stopped = plan["stopped"]
                    break
                m = plan["ids"]
                print(f"scale: {_label(m)} ids, {'spilled' if plan['spill_fraction'] else 'in memory'} ...",
                      flush=True)
                try:
                    r = in_forked_process(run_size, s, m, plan["spill_fraction"], url, tmp, timeout_s=s.size_timeout_s)
                except RuntimeError as exc:
                    stopped = f"{_label(m)} ids failed: {str(exc).strip().splitlines()[-1]}"
                    plan["error"] = str(exc)
                    break
                finally:
                    shutil.rmtree(work / f"run-{m}", ignore_errors=True)
                    if plan["spill_fraction"] is not None:
                        try:
                            _clear_redis(url, server is not None, run_namespace(work / f"run-{m}", job_name))
                        except Exception as exc:  # noqa: BLE001 - the size's figures are kept; the run stops
                            stopped = f"clearing Redis after {_label(m)} ids failed: {exc!r}"
                done.append(r)
                if stopped:
                    break
                previous = m
                if m < n:  # a smaller spilled size than planned: as far as memory goes
                    stopped = f"{_label(n)} ids did not fit; ran {_label(m)} instead and stopped there"
                    break
        finally:
            if server is not None:
                server.terminate()
                try:
                    server.wait(timeout=120)  # it frees its dataset first
                except Exception:  # noqa: BLE001 - a server that will not stop must not cost the figures
                    server.kill()
                    server.wait(timeout=30)
    return _report(s, done, plans, stopped, url if server is None else "redis-server started by the bench",
                   time.perf_counter() - t_start)


def _report(s: Settings, done: list[dict], plans: list[dict], stopped: str, redis: str, seconds: float) -> dict:
    comparisons, notes = [], []
    first = done[0] if done else None
    before = None
    for r in done:
        r["ratio_to_first"] = r["samples_per_s"] / first["samples_per_s"]
        if r["mode"] == "memory" and before is not None:  # the fixed costs (torch, the model, code) cancel
            r["marginal_bytes_per_row"] = ((r["store_rss_bytes"] - before["store_rss_bytes"])
                                           / (r["rows_in_memory"] - before["rows_in_memory"]))
        before = r if r["mode"] == "memory" else before
        label = f"{_label(r['distinct_ids'])} ids ({r['mode']})"
        if r is not first:
            comparisons.append(comparison(
                f"samples/s {label} vs {_label(first['distinct_ids'])}", r["samples_per_s"], first["samples_per_s"],
                "samples/s", target_ratio=0.8 if r["mode"] == "memory" else None,
                segment_spread=[r["samples_per_s_spread"][0] / first["samples_per_s_spread"][1],
                                r["samples_per_s_spread"][1] / first["samples_per_s_spread"][0]]))
        comparisons.append(comparison(f"store bytes/row vs payload {label} (lower better)",
                                      r["store_resident_bytes_per_row"], r["payload_bytes_per_row"], "bytes/row",
                                      target_ratio=1.2))
        if r["mode"] == "spill":
            comparisons.append(comparison(f"longest step vs median {label} (lower better)", r["step_ms_max"],
                                          r["step_ms_median"], "ms", target_ratio=2.0))
    head = (f"{'ids':>8} {'mode':>6} {'in mem':>9} {'spilled':>9} {'samples/s (min-max)':>24} {'vs 1st':>6} "
            f"{'B/row':>6} {'xpay':>5} {'RSS B/row':>9} {'hit':>6} {'spill r/w per step':>18} {'us/row r/w':>11} "
            f"{'ckpt s':>7} {'restore s':>9}")
    notes.append(head)
    for r in done:
        spill = (f"{r['spill_reads_per_step']:.0f}/{r['spill_writes_per_step']:.0f}" if r["mode"] == "spill" else "-")
        cost = (f"{r['spill_read_us_per_row']:.1f}/{r['spill_write_us_per_row']:.1f}" if r["mode"] == "spill"
                else "-")
        lo, hi = r["samples_per_s_spread"]
        notes.append(f"{_label(r['distinct_ids']):>8} {r['mode']:>6} {r['rows_in_memory']:>9} {r['rows_spilled']:>9} "
                     f"{r['samples_per_s']:>9.0f} ({lo:.0f}-{hi:.0f}) {r['ratio_to_first']:>6.3f} "
                     f"{r['store_resident_bytes_per_row']:>6.0f} {r['store_resident_ratio']:>5.2f} "
                     f"{r['bytes_per_row']:>9.0f} {r['hit_rate']:>6.4f} "
                     f"{spill:>18} {cost:>11} {r['checkpoint_s']:>7.2f} {r['restore_s']:>9.2f}")
    notes.append(f"stopped: {stopped}" if stopped else f"stopped: no, every size ran (largest {_label(s.sizes[-1])})")
    return {
        "comparisons": comparisons,
        "notes": notes,
        "sizes": done,
        "plans": plans,
        "stopped": stopped,
        "cost_model_1b": cost_model(s, done) if done else None,
        "settings": {**dataclasses.asdict(s), "steps": s.steps, "job": str(JOB), "redis": redis,
                     "tables": len(CRITEO_CARDINALITIES), "features": len(CRITEO_CARDINALITIES),
                     "source": "SyntheticIds: in-memory batches (no Parquet decode, no raw-id hashing in the timed steps)"},
        "versions": versions(),
        "seconds": seconds,
    }
