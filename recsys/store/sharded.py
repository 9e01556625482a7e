"""The sharded embedding store: rows owned by rank, batch-local lookups, bounded-stale pushes.

Legend: ``B`` rows in the batch, ``F`` features, ``T`` tables, ``U`` unique keys of one
table in the batch, ``D`` table dim, ``W`` world size, ``R`` keys a rank receives.

One training step, seen from rank r (W = 2)::

    batch KJT ──► per table: keys_U = unique(keys of its features), inverse
                     │ owner = owner_of(key, W)  (recsys.hashing)
                     ▼
        all_to_all(keys)   ──►  owner: table.lookup(unique received keys)
        all_to_all(rows)   ◄──  rows of the requested keys
                     │
    rows_UD (leaf tensor, requires_grad) ──► embedding_bag(inverse, offsets) ──► pooled [B, F, D]
                                                   ...model, loss, backward...
    rows_UD.grad ──► all_to_all(grads) ──► owner: sum over requesters / W ──► sparse optimizer

No ``[num_rows, D]`` gradient ever exists: only the batch's unique rows move.

Staleness (deterministic, not racy): with ``staleness = s`` the lookup of step t sees the
pushes of steps ``<= t - s - 1`` and *none* of steps ``t - s .. t - 1``, whatever the
timing. All store mutations run in one sequence (on a worker thread when ``threaded``,
else in the caller), identical on every rank, on the store's own process group, so
collectives never interleave with DDP's. ``s = 0`` is synchronous training.

Costs: one all_to_all for keys, one for rows and one for gradients per step (all tables
in one message each), plus one for the per-table counts.
"""

from __future__ import annotations

import collections
import math
import dataclasses
import queue
import threading
from concurrent.futures import Future
from typing import Callable

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys import hashing
from recsys.schema import Schema, TableSpec
from recsys.store.config import StoreConfig


@dataclasses.dataclass(slots=True)
class _TablePart:
    """One table's share of a lookup: what this rank asked for and what it served."""

    name: str
    feature_idx: list[int]  # positions of the table's features in schema order
    keys_U: np.ndarray  # unique keys this rank needs (int64)
    order_U: np.ndarray  # permutation sorting keys_U by owner rank
    inverse: torch.Tensor  # [sum of bag lengths] index into keys_U, features concatenated
    offsets: torch.Tensor  # [F_t * B + 1] bag offsets into ``inverse``
    weights: torch.Tensor | None  # per-value weights (mean pooling), else None
    owner_sorted: np.ndarray  # owner rank of keys_U[order_U] (non-decreasing)
    # owner side: keys received for this table, deduplicated
    served_U: np.ndarray | None = None
    served_inverse: np.ndarray | None = None


@dataclasses.dataclass(slots=True)
class Lookup:
    """The result of ``lookup``: per-table batch-local rows, ready for pooling and push."""

    step: int | None
    batch_size: int
    parts: list[_TablePart]
    rows: dict[str, torch.Tensor]  # table -> [U, D] leaf tensor (requires_grad when training)
    send_counts: np.ndarray  # [W, T] keys this rank sent to each owner, per table
    recv_counts: np.ndarray  # [W, T] keys this rank received from each requester, per table

    def pooled(self, num_features: int) -> torch.Tensor:
        """Return pooled embeddings [B, F, D] in schema feature order (all dims equal)."""
        dims = {r.shape[1] for r in self.rows.values()}
        if len(dims) != 1:
            raise ValueError(f"pooled() needs one embedding dim across tables, found {sorted(dims)}")
        out: list[torch.Tensor | None] = [None] * num_features
        B = self.batch_size
        for part in self.parts:
            bags = torch.nn.functional.embedding_bag(
                part.inverse,
                self.rows[part.name],
                part.offsets,
                mode="sum",
                per_sample_weights=part.weights,
                include_last_offset=True,
            )  # [F_t * B, D]
            for j, f in enumerate(part.feature_idx):
                out[f] = bags[j * B : (j + 1) * B]
        return torch.stack(out, dim=1)  # type: ignore[arg-type]


class ShardedEmbeddingStore:
    """Return-by-lookup store of every table's rows, sharded over a process group by owner.

    ``group=None`` with no initialized process group means one process owning every row.
    """

    def __init__(
        self,
        schema: Schema,
        cfg: StoreConfig,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        threaded: bool = False,
        table_factory: Callable[[str, TableSpec, StoreConfig], object] | None = None,
    ) -> None:
        self.schema = schema
        self.cfg = cfg
        self.device = torch.device(device)
        if group is None and dist.is_available() and dist.is_initialized():
            # A group of our own: store collectives may run on a worker thread while the
            # trainer's DDP collectives run on the main thread.
            group = dist.new_group(backend="gloo")
        self.group = group
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.table_names = list(schema.tables)
        self.tables = {
            name: self._make_table(table_factory, name, self._shard_spec(spec), cfg)
            for name, spec in schema.tables.items()
        }
        self._features_of = {
            t: [i for i, f in enumerate(schema.sparse) if f.table == t] for t in self.table_names
        }
        self._mean = np.array([f.pooling == "mean" for f in schema.sparse])
        # the schedule
        self.staleness = cfg.staleness
        self._pending_pushes: dict[int, tuple[Lookup, dict[str, torch.Tensor]]] = {}
        self._unpushed: set[int] = set()  # training lookups whose push the caller still owes
        self.visibility: list[tuple[int, int]] = []  # (push step, first lookup step that saw it)
        self._threaded = threaded
        self._ops: queue.Queue | None = None
        self._worker: threading.Thread | None = None
        self._failure: BaseException | None = None
        if threaded:
            self._ops = queue.Queue()
            self._worker = threading.Thread(target=self._work, name="store-worker", daemon=True)
            self._worker.start()

    def _make_table(self, table_factory, name: str, spec: TableSpec, cfg: StoreConfig):
        """Return one table's tiers: ``table_factory``'s table (default: an ``EmbeddingTable``
        spilling to ``cfg.spill_url`` if set, listing only this rank's keys), wrapped in a
        ``DeviceCache`` on ``self.device`` when ``cfg.device_cache_rows > 0``."""
        if table_factory is not None:
            table = table_factory(name, spec, cfg)
        else:
            from recsys.store.table import EmbeddingTable

            spill = None
            if cfg.spill_url:
                from recsys.store.spill import SpillTier

                owns = None
                if self.world_size > 1:
                    world, rank = self.world_size, self.rank
                    owns = lambda keys: hashing.owner_of(keys, world) == rank  # noqa: E731
                spill = SpillTier(name, spec.dim, cfg, owns=owns)
            table = EmbeddingTable(name, spec, cfg, spill=spill)
        if cfg.device_cache_rows > 0:
            from recsys.store.device_cache import DeviceCache

            table = DeviceCache(table, cfg.device_cache_rows, self.device)
        return table

    def _shard_spec(self, spec: TableSpec) -> TableSpec:
        """Return the spec of this rank's shard: its share of the capacity plus hashing slack.

        Ownership is by hash, so a shard's share of any key set fluctuates around 1/W (by
        about sqrt(n/W)); 4 standard deviations of slack keep a table sized for its whole
        vocabulary from evicting just because it is sharded. One shard holds all rows.
        """
        if self.world_size == 1:
            return spec
        share = spec.capacity / self.world_size
        per_shard = min(spec.capacity, math.ceil(share + 4 * math.sqrt(share) + 8))
        return dataclasses.replace(spec, capacity=per_shard)

    # ------------------------------------------------------------------ public API

    def lookup(self, kjt: KeyedJaggedTensor, step: int | None, train: bool = True) -> Lookup:
        """Return the batch's rows per table; ``train`` promises a ``push`` (or ``cancel``).

        An evaluation lookup (``train=False``) reads the rows as they are now: it applies
        no queued push and inserts nothing.
        """
        if train:
            self._check_pushes_before(step)
        return self.submit_lookup(kjt, step, train).result()

    def submit_lookup(self, kjt: KeyedJaggedTensor, step: int | None, train: bool = True) -> Future:
        """Return a future of ``lookup``. Threaded, it runs once the pushes it must see arrive."""
        if train:
            if step is None:
                raise ValueError("a training lookup needs a step")
            if not self._threaded:
                self._check_pushes_before(step)
            if step in self._unpushed:
                raise ValueError(f"step {step} was already looked up for training")
            self._unpushed.add(step)
        return self._submit(("lookup", kjt, step, train))

    def push(self, lookup: Lookup) -> None:
        """Queue the row gradients of ``lookup`` (after backward) for their owners."""
        self._fulfil(lookup)
        grads = {}
        for name, rows in lookup.rows.items():
            g = rows.grad
            grads[name] = torch.zeros(rows.shape) if g is None else g.detach().to("cpu", torch.float32)
        self._submit(("push", lookup.step, (lookup, grads)))

    def cancel(self, lookup: Lookup) -> None:
        """Withdraw the push a training lookup promised (e.g. a look-ahead never trained on)."""
        self._fulfil(lookup)
        self._submit(("push", lookup.step, None))

    def flush(self, through_step: int | None = None) -> None:
        """Apply every queued push of steps ``<= through_step`` (all when None) now."""
        limit = float("inf") if through_step is None else through_step
        missing = sorted(s for s in self._unpushed if s <= limit)
        if missing:
            raise RuntimeError(f"flush through step {through_step}: steps {missing} were looked up but not pushed")
        self._submit(("flush", limit)).result()

    def close(self) -> None:
        """Stop the worker thread; queued pushes are applied first. Then close every table:
        device caches write back, spill tiers flush (the first failure is raised after all
        tables were closed)."""
        if self._worker is not None and self._worker.is_alive():
            self._ops.put(None)
            self._worker.join()
        errors: list[BaseException] = []
        try:
            if self._failure is None:
                self._apply_pushes_through(float("inf"))
        except BaseException as exc:  # noqa: BLE001 - raised below, after the tables closed
            errors.append(exc)
        for table in self.tables.values():
            close = getattr(table, "close", None)
            if close is not None:
                try:
                    close()
                except BaseException as exc:  # noqa: BLE001
                    errors.append(exc)
        if errors:
            raise errors[0]

    def peek_rows(self, table: str, keys: np.ndarray) -> np.ndarray:
        """Return this shard's float32 rows of ``keys`` in ``table`` (zeros where absent)."""
        return self._call(lambda: self.tables[table].peek(np.asarray(keys, dtype=np.int64)))

    def counters(self) -> dict[str, dict[str, int]]:
        """Return this shard's counters per table."""
        return {name: table.counters() for name, table in self.tables.items()}

    def state_dict(self) -> dict[str, pa.Table]:
        """Return this shard's rows per table (``flush`` first for a consistent snapshot)."""
        return self._call(lambda: {name: table.state_dict() for name, table in self.tables.items()})

    def load_state_dict(self, state: dict[str, pa.Table]) -> None:
        """Load rows saved at any world size: this rank keeps the rows it owns."""
        unknown = sorted(set(state) - set(self.tables))
        if unknown:
            raise ValueError(f"state has tables {unknown}; the schema declares {self.table_names}")
        def load() -> None:
            for name, rows in state.items():
                keys = rows.column("key").to_numpy()
                mine = hashing.owner_of(keys, self.world_size) == self.rank
                self.tables[name].load_state_dict(rows.filter(pa.array(mine)))

        self._call(load)

    # ------------------------------------------------------------------ the schedule

    def _visible_through(self, step: int) -> int:
        """Return the last push step the training lookup of ``step`` must see."""
        return step - self.staleness - 1

    def _check_pushes_before(self, step: int) -> None:
        missing = sorted(s for s in self._unpushed if s <= self._visible_through(step))
        if missing:
            raise RuntimeError(
                f"the lookup of step {step} must see the pushes of steps {missing} "
                f"(staleness {self.staleness}), which were not made yet"
            )

    def _fulfil(self, lookup: Lookup) -> None:
        if lookup.step not in self._unpushed:
            raise ValueError(f"step {lookup.step}: no pending training lookup promised this push")
        self._unpushed.discard(lookup.step)

    def _call(self, fn):
        """Return ``fn()`` run in the store's op sequence (after everything queued)."""
        return self._submit(("call", fn)).result()

    def _submit(self, op) -> Future:
        fut: Future = Future()
        if self._threaded:
            if self._failure is not None:
                raise RuntimeError("the store worker failed earlier") from self._failure
            self._ops.put((op, fut))
        else:
            self._run(op, fut)
        return fut

    def _run(self, op, fut: Future) -> None:
        try:
            kind = op[0]
            if kind == "push":
                if op[2] is not None:
                    self._pending_pushes[op[1]] = op[2]
                result = None
            elif kind == "flush":
                self._apply_pushes_through(op[1])
                result = None
            elif kind == "call":
                result = op[1]()
            else:
                _, kjt, step, train = op
                if train:
                    self._apply_pushes_through(self._visible_through(step), step)
                result = self._do_lookup(kjt, step, train)
            fut.set_result(result)
        except BaseException as exc:  # noqa: BLE001 - surfaced through the future
            if self._threaded:
                self._failure = exc
            fut.set_exception(exc)

    def _work(self) -> None:
        """Run ops in arrival order; an op waits until every push it must see has arrived."""
        waiting: collections.deque = collections.deque()
        unpushed: set[int] = set()  # promised by a training lookup, push not arrived yet
        while True:
            item = self._ops.get()
            if item is None:
                break
            op = item[0]
            if op[0] == "push":
                # a push only registers its gradients (applied at a fixed point of the
                # schedule), so it never waits behind the lookups that wait for it
                unpushed.discard(op[1])
                self._run(*item)
            else:
                if op[0] == "lookup" and op[3]:
                    unpushed.add(op[2])
                waiting.append(item)
            while waiting:
                op, fut = waiting[0]
                if op[0] == "lookup" and op[3]:
                    limit = self._visible_through(op[2])
                elif op[0] == "flush":
                    limit = op[1]
                else:
                    limit = float("-inf")
                if any(s <= limit for s in unpushed):
                    break
                waiting.popleft()
                if self._failure is not None:
                    fut.set_exception(RuntimeError("the store worker failed earlier"))
                else:
                    self._run(op, fut)

    def _apply_pushes_through(self, last_step: float, for_lookup: int | None = None) -> None:
        for s in sorted(self._pending_pushes):
            if s > last_step:
                break
            lookup, grads = self._pending_pushes.pop(s)
            self._do_push(lookup, grads)
            self.visibility.append((s, -1 if for_lookup is None else for_lookup))

    # ------------------------------------------------------------------ the work

    def _do_lookup(self, kjt: KeyedJaggedTensor, step: int | None, train: bool) -> Lookup:
        B = kjt.stride()
        lengths = kjt.lengths().to(torch.int64).view(len(self.schema.sparse), B)
        values = kjt.values()
        offs = kjt.offset_per_key()
        parts = []
        for t in self.table_names:
            fidx = self._features_of[t]
            keys_all = torch.cat([values[offs[f] : offs[f + 1]] for f in fidx]).numpy()
            keys_U, inverse = np.unique(keys_all, return_inverse=True)
            owner = hashing.owner_of(keys_U, self.world_size) if self.world_size > 1 else np.zeros(len(keys_U), np.int64)
            order = np.argsort(owner, kind="stable")
            lens = lengths[fidx].reshape(-1)
            offsets = torch.zeros(lens.numel() + 1, dtype=torch.int64)
            torch.cumsum(lens, 0, out=offsets[1:])
            weights = None
            if self._mean[fidx].any():
                per_bag = torch.ones(lens.numel(), dtype=torch.float32)
                for j, f in enumerate(fidx):
                    if self._mean[f]:
                        per_bag[j * B : (j + 1) * B] = 1.0 / lens[j * B : (j + 1) * B].clamp(min=1)
                weights = torch.repeat_interleave(per_bag, lens)
            parts.append(_TablePart(t, fidx, keys_U, order, torch.from_numpy(inverse.astype(np.int64)),
                                    offsets, weights, owner[order]))

        W, T = self.world_size, len(parts)
        send_counts = np.stack([np.bincount(p.owner_sorted, minlength=W) for p in parts], axis=1)  # [W, T]
        recv_counts = self._exchange_counts(send_counts)
        send_keys = self._pack([[p.keys_U[p.order_U][_seg(send_counts[:, i], r)] for i, p in enumerate(parts)] for r in range(W)])
        recv_keys = self._exchange(send_keys, send_counts.sum(1), recv_counts.sum(1), torch.int64)

        # owner side: serve every table's requested keys
        recv_split = _split_rank_table(recv_keys, recv_counts)
        served_rows = []
        for i, p in enumerate(parts):
            asked = np.concatenate([recv_split[r][i] for r in range(W)]) if W > 1 else recv_split[0][i]
            uniq, inv = np.unique(asked, return_inverse=True)
            table = self.tables[p.name]
            rows = table.lookup(uniq, step) if train else table.peek(uniq, init_missing=self.cfg.min_count == 1)
            p.served_U, p.served_inverse = uniq, inv
            served_rows.append(np.asarray(rows, dtype=np.float32)[inv])
        dims = [self.schema.tables[p.name].dim for p in parts]
        send_rows = self._pack(
            [[served_rows[i][_seg(recv_counts[:, i], r)] for i in range(T)] for r in range(W)], flat=True
        )
        recv_rows = self._exchange(
            send_rows,
            (recv_counts * np.array(dims)).sum(1),
            (send_counts * np.array(dims)).sum(1),
            torch.float32,
        )
        rows = {}
        got = _split_rank_table(recv_rows, send_counts * np.array(dims))
        for i, p in enumerate(parts):
            sorted_rows = np.concatenate([got[r][i] for r in range(W)]).reshape(-1, dims[i])
            out = np.empty_like(sorted_rows)
            out[p.order_U] = sorted_rows
            t = torch.from_numpy(out).to(self.device)
            rows[p.name] = t.requires_grad_(train)
        return Lookup(step, B, parts, rows, send_counts, recv_counts)

    def _do_push(self, lookup: Lookup, grads: dict[str, torch.Tensor]) -> None:
        W, parts = self.world_size, lookup.parts
        dims = np.array([self.schema.tables[p.name].dim for p in parts])
        send = self._pack(
            [
                [grads[p.name].numpy()[p.order_U][_seg(lookup.send_counts[:, i], r)] for i, p in enumerate(parts)]
                for r in range(W)
            ],
            flat=True,
        )
        recv = self._exchange(send, (lookup.send_counts * dims).sum(1), (lookup.recv_counts * dims).sum(1), torch.float32)
        got = _split_rank_table(recv, lookup.recv_counts * dims)
        for i, p in enumerate(parts):
            g = np.concatenate([got[r][i] for r in range(W)]).reshape(-1, dims[i])
            summed = torch.zeros((len(p.served_U), dims[i]), dtype=torch.float32)
            summed.index_add_(0, torch.from_numpy(p.served_inverse.astype(np.int64)), torch.from_numpy(g))
            if W > 1:
                summed /= W  # each rank's loss is a mean over its own rows
            self.tables[p.name].apply_gradients(p.served_U, summed.numpy(), lookup.step)

    # ------------------------------------------------------------------ communication

    def _exchange_counts(self, send_counts: np.ndarray) -> np.ndarray:
        if self.world_size == 1:
            return send_counts.copy()
        W, T = send_counts.shape
        out = torch.empty(W * T, dtype=torch.int64)
        dist.all_to_all_single(out, torch.from_numpy(send_counts.reshape(-1).astype(np.int64)), group=self.group)
        return out.numpy().reshape(W, T)

    def _exchange(self, send: np.ndarray, send_sizes: np.ndarray, recv_sizes: np.ndarray, dtype) -> np.ndarray:
        if self.world_size == 1:
            return send
        out = torch.empty(int(recv_sizes.sum()), dtype=dtype)
        dist.all_to_all_single(
            out,
            torch.from_numpy(np.ascontiguousarray(send)).to(dtype),
            output_split_sizes=[int(x) for x in recv_sizes],
            input_split_sizes=[int(x) for x in send_sizes],
            group=self.group,
        )
        return out.numpy()

    @staticmethod
    def _pack(blocks: list[list[np.ndarray]], flat: bool = False) -> np.ndarray:
        pieces = [b.reshape(-1) if flat else b for per_rank in blocks for b in per_rank]
        return np.concatenate(pieces) if pieces else np.empty(0)


def _seg(counts_W: np.ndarray, r: int) -> slice:
    """Return the slice of rank ``r``'s block in a buffer ordered by rank."""
    start = int(counts_W[:r].sum())
    return slice(start, start + int(counts_W[r]))


def _split_rank_table(buf: np.ndarray, sizes_WT: np.ndarray) -> list[list[np.ndarray]]:
    """Return ``buf`` cut into [rank][table] blocks of the given sizes (rank-major order)."""
    ends = np.cumsum(sizes_WT.reshape(-1))
    pieces = np.split(buf, ends[:-1]) if len(ends) else []
    W, T = sizes_WT.shape
    return [pieces[r * T : (r + 1) * T] for r in range(W)]
