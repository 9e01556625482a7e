"""The device index as an exact-LRU cache in front of larger host tables
(``store.device.key_map = "device"`` with ``store.device.cache_rows`` below a capacity).

Legend: ``C`` a table's capacity, ``R`` its cache rows (``min(cache_rows, C)``), ``U`` the
step's distinct keys of a table, ``h`` those the host holds, ``n`` those held nowhere
(new), ``d`` the rows the cache demotes to the host.

``DeviceCachedSparse`` composes a ``DeviceSparse`` (``recsys.store.device.keymap``) whose
tables hold ``R`` rows each (the cache) and, for every table with ``C > R``, one host
``EmbeddingTable`` of ``C - R`` rows. The tiers are exclusive (a key's row is in one of
them) and ordered: every cached key is more recent, by (last step, key as uint64), than
every host key of its table. Step ``t + 1``, in two parts::

    asked ahead (``prefetch``: the store's key work for the lookup first in line, after step
    t's forward and while t's push is awaited; else at the start of ``forward``):
    host:   the step's keys deduplicated per table (numpy, ``dedup``: the store runs it
            when the batch is prepared); |U| > R is refused, naming store.device.cache_rows
    device: which of them the cache holds (DeviceSparse.cells_held), after step t's forward
      ──► host: the hit flags                        the step's one blocking read
    host:   the rows the cache demoted at step t arrived (an async copy, done by now) ─►
            EmbeddingTable.write_back: the host inserts them with their last step and,
            when over C - R, evicts its own least recent rows
    host:   the misses it holds (h) ─► EmbeddingTable.pop_rows (row, state, last_seen),
            kept aside until the step (``_Ahead``)
    at the step (after step t's update, which changes rows but no key's place):
    device: the hits' last step set to this step; d = held + h + n - R (when > 0) least
            recent cached keys not touched by the step demoted (DeviceSparse.demote: the
            first untouched entries of the table's order block), their rows, state and
            last step copied to the host asynchronously (delivered at the next step)
      host ──► device: the h popped rows, placed with their state and last step
            (DeviceSparse.admit_rows)
    device: DeviceSparse.forward / update as without a host: every new key finds room, so
            the forward evicts nothing

Why the union is the host store of capacity ``C`` (``EmbeddingTable``'s rule: a step with
more new keys than free rows evicts the ``M + n - C`` smallest by (last_seen, key as
uint64) among the ``M`` held keys it does not touch): after the demotion the cache holds
``R`` keys at most, so the host holds ``M + n - R`` and evicts ``M + n - C``; by the order
of the tiers its keys are the least recent of the union, and the demoted ones are the least
recent of the cache, so the evicted keys are the union's least recent untouched ones. When
``d > C - R`` the host's own keys all go and the oldest ``d - (C - R)`` demoted rows are
dropped at once (counted as evictions). The order is total (keys are distinct), so ties in
the last step are decided by the key, the same way in every tier. The demoted keys are more
recent than every host key, and the keys a step brings into the cache all take its step,
so the order of the tiers holds after every step.

Counters per table: the host store's (``hits``, ``misses``, ``inserts``, ``admitted``,
``rejected``, ``evictions``, ``updated``, ``ignored``, ``rows``, ``rows_in``, ``rows_out``,
equal to one ``EmbeddingTable`` of capacity ``C`` on the same trace) and the cache's
(``cache_hits``, ``cache_misses``, ``cache_evictions``: rows demoted, ``writebacks``: rows
written to the host, ``cached``: rows on the device). ``state_dict`` / ``load_state_dict``
/ ``pop_rows`` / ``peek_rows`` / ``held`` read the union, and its checkpoint is the host
store's id-keyed Arrow rows either way round.

Asked ahead, the look-up's read waits for step t's forward only, and the host's work on
the misses runs while the device runs step t's dense model, as fbgemm's UVM cache
prefetches the next batch. The answer holds while only step t's update runs in between
(the store's schedule runs a lookup's key work first in line and nothing but pushes before
the lookup itself); any read or change of the tables in between (``counters``,
``state_dict``, ``pop_rows``...) first gives the rows back to their hosts (``_settle``) and
the step asks again. A table whose capacity fits in the cache (``C <= R``) has no host
table and is the plain ``DeviceSparse`` table.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import torch

from recsys.features.schema import TableSpec
from recsys.store.config import StoreConfig
from recsys.store.device.cache import CACHE_COUNTERS
from recsys.store.device.keymap import DeviceSparse, _as_keys
from recsys.store.tables import optim
from recsys.store.tables.rowblock import RowBlock
from recsys.store.tables.table import CapacityError, EmbeddingTable, arrow_schema

__all__ = ["DeviceCachedSparse"]

_FIX = "store.device.cache_rows"


class DeviceCachedSparse:
    """Every table of one dim: its ``cache_rows`` most recent rows in one ``DeviceSparse`` on
    ``device``, the others in a host ``EmbeddingTable`` (module doc). ``features`` as
    ``DeviceSparse``'s; ``cache_rows``: the cache's rows per table (default
    ``cfg.device.cache_rows``), or a dict of them by table. Not thread-safe."""

    def __init__(self, tables: dict[str, TableSpec], features: list[tuple[str, str, str]], cfg: StoreConfig,
                 device: torch.device | str, cache_rows: int | dict[str, int] | None = None) -> None:
        R = cfg.device.cache_rows if cache_rows is None else cache_rows
        per = {n: int(R[n] if isinstance(R, dict) else R) for n in tables}
        if any(r <= 0 for r in per.values()):
            raise ValueError(f"DeviceCachedSparse needs cache_rows > 0, found {R}")
        self.cfg, self.device = cfg, torch.device(device)
        self.names = list(tables)
        self.specs = dict(tables)
        self.caps = [s.capacity if s.num_rows is None else min(s.capacity, s.num_rows) for s in tables.values()]
        self.rows = [min(per[n], c) for n, c in zip(self.names, self.caps)]
        cache_specs = {n: TableSpec(dim=s.dim, capacity=r) for (n, s), r in zip(tables.items(), self.rows)}
        self.sparse = DeviceSparse(cache_specs, features, cfg, self.device)
        # the cache's order is kept from the first step (demote reads it): empty, it is sorted
        self.sparse._order_valid = True
        self.dim, self.T, self.F = self.sparse.dim, len(self.names), self.sparse.F
        self.hosts: dict[int, EmbeddingTable] = {
            t: EmbeddingTable(n, TableSpec(dim=self.dim, capacity=c - r), cfg, spill=None)
            for t, (n, c, r) in enumerate(zip(self.names, self.caps, self.rows)) if c > r}
        self._feat_table = np.array([self.names.index(t) for _, t, _ in features], dtype=np.int64)
        self._int_state = [c.name for c in optim.state_columns(cfg.optimizer) if c.dtype != np.float32]
        self._float_state = [(c.name, c.per_dim) for c in optim.state_columns(cfg.optimizer)
                             if c.dtype == np.float32]
        self._held = [0] * self.T  # rows each cached table holds on the device (known without it)
        self._ahead: _Ahead | None = None  # the next step's misses, asked ahead (``prefetch``)
        self._outbox = None  # the demoted rows on their way to the host (delivered by ``_deliver``)
        self._c = {t: dict.fromkeys(CACHE_COUNTERS, 0) for t in self.hosts}
        self._dropped = [0] * self.T  # demoted rows evicted at once (more than the host holds)
        self._io = {"rows_in": [0] * self.T, "rows_out": [0] * self.T}
        self.schemas = {n: arrow_schema(n, self.dim, cfg) for n in self.names}

    # ------------------------------------------------------------------ the step

    def forward(self, keys: torch.Tensor, lengths: torch.Tensor, step: int, weights: torch.Tensor | None = None,
                host_keys=None, host_lengths=None, uniq: dict[int, np.ndarray] | None = None) -> torch.Tensor:
        """Do the cache's work of ``step`` (module doc), then ``DeviceSparse.forward``.
        ``host_keys`` / ``host_lengths``: the same keys and lengths on the host, when the
        caller has them (else they are read from ``keys`` and ``lengths``); ``uniq``: their
        ``dedup``, when the caller did it ahead."""
        step = int(step)
        last = self.sparse._step
        if last is not None and step <= last:
            raise ValueError(f"DeviceSparse: step {step} after step {last}; steps must increase")
        if self.hosts:
            if uniq is None:
                kh = np.asarray(host_keys if host_keys is not None else keys.cpu(), dtype=np.int64)
                lh = np.asarray(host_lengths if host_lengths is not None else lengths.cpu(), dtype=np.int64)
                uniq = self.dedup(kh, lh)
            self._before_forward(uniq, step)
        return self.sparse.forward(keys, lengths, step, weights)

    def dedup(self, keys: np.ndarray, lengths: np.ndarray) -> dict[int, np.ndarray]:
        """Return the distinct keys (sorted) of each table with a host tier in a batch's host
        keys and lengths (feature-major). Reads nothing of the tables: it may run ahead."""
        F = self.F
        if F == 0 or lengths.shape[0] % F:
            raise ValueError(f"lengths has {lengths.shape[0]} entries, not a multiple of the {F} features")
        keys = np.asarray(keys, dtype=np.int64)
        ends = np.cumsum(np.asarray(lengths, dtype=np.int64).reshape(F, -1).sum(1))
        starts = np.concatenate([[0], ends[:-1]])
        parts: dict[int, list] = {t: [] for t in self.hosts}
        for f, t in enumerate(self._feat_table):  # a feature's keys are one slice
            if int(t) in parts:
                parts[int(t)].append(keys[starts[f]:ends[f]])
        return {t: np.unique(np.concatenate(p)) if p else keys[:0] for t, p in parts.items()}

    def prefetch(self, uniq: dict[int, np.ndarray], step: int) -> None:
        """Ask the hosts now for ``step``'s misses (``uniq``: its ``dedup``): the cache
        look-up, its read and the host's rows of the misses, ahead of the step (module doc).
        Valid while nothing but the update of the step before changes the tables; a read or
        change of the rows in between gives the rows back first (``_settle``). Raises, as the
        step would, when the step brings more keys than a table's cache holds."""
        self._settle()
        self._ahead = self._ask(uniq, int(step))

    def _ask(self, uniq: dict[int, np.ndarray], step: int) -> "_Ahead":
        for t, u in uniq.items():
            if u.shape[0] > self.rows[t]:  # raised before anything changes
                raise CapacityError(self.names[t], step, u.shape[0], self.rows[t], holder="its device cache",
                                    fix=_FIX)
        ks = np.concatenate([uniq[t] for t in self.hosts])
        ts = np.concatenate([np.full(uniq[t].shape[0], t, dtype=np.int64) for t in self.hosts])
        kt = _to_device(np.stack([ks, ts]), self.device)  # one upload
        cells = self.sparse.cells_held(kt[0], kt[1])
        hit = cells.cpu().numpy() >= 0  # the step's blocking read (ahead of it: ``prefetch``)
        self._deliver()
        popped, misses, at = [], {}, 0
        for t, host in self.hosts.items():
            u = uniq[t]
            misses[t] = miss = u[~hit[at:at + u.shape[0]]]
            at += u.shape[0]
            rows = host.pop_rows(miss) if miss.shape[0] else None
            if rows is not None and rows.num_rows:
                popped.append((t, rows))
        return _Ahead(step, uniq, cells, misses, popped)

    def _current(self) -> None:
        """Bring the tiers up to date before they are read or changed outside a step: a
        prefetch given back (``_settle``), the demoted rows delivered (``_deliver``)."""
        self._settle()
        self._deliver()

    def _settle(self) -> None:
        """Give a prefetch's rows back to their hosts (with their last_seen: the hosts are as
        before it) and drop it; it is asked again at its step."""
        a, self._ahead = self._ahead, None
        if a is not None:
            for t, rows in a.popped:
                self.hosts[t].insert_rows(rows)

    def _before_forward(self, uniq: dict[int, np.ndarray], step: int) -> None:
        a, self._ahead = self._ahead, None
        if a is not None and a.step != step:  # prefetched for another step: given back
            self._ahead = a
            self._settle()
            a = None
        if a is None:
            a = self._ask(uniq, step)
        uniq, cells, popped = a.uniq, a.cells, a.popped
        over = [0] * self.T
        for t in self.hosts:
            u, miss = uniq[t], a.misses[t]
            over[t] = max(0, self._held[t] + miss.shape[0] - self.rows[t])
            self._held[t] += miss.shape[0] - over[t]
            c = self._c[t]
            c["cache_hits"] += u.shape[0] - miss.shape[0]
            c["cache_misses"] += miss.shape[0]
            c["cache_evictions"] += over[t]
        self.sparse.touch_cells(cells, step)
        if sum(over):
            self._outbox = (_to_host(self.sparse.demote(over, step)), over)
        if popped:
            self._admit(popped)

    def _admit(self, popped: list[tuple[int, pa.Table]]) -> None:
        """Put host rows (Arrow, the host's schema) into the cache with their state and last step."""
        dev, D = self.device, self.dim
        tid = np.concatenate([np.full(r.num_rows, t, dtype=np.int64) for t, r in popped])
        tab = pa.concat_tables([r for _, r in popped])
        ints = _to_device(np.stack([tid, tab.column("key").to_numpy(), tab.column("last_seen").to_numpy()]), dev)
        states = {}
        for c in optim.state_columns(self.cfg.optimizer):
            states[c.name] = _to_device(_matrix(tab, c.name, D) if c.per_dim else tab.column(c.name).to_numpy(), dev)
        self.sparse.admit_rows(ints[0], ints[1], _to_device(_matrix(tab, "embedding", D).astype(np.float32), dev),
                               states, ints[2])

    def _deliver(self) -> None:
        """Give the host the rows the cache demoted (oldest first per table), dropping at once
        the oldest beyond what the host holds (its own rows all go then)."""
        if self._outbox is None:
            return
        (event, tkl, rows, ints), over = self._outbox
        self._outbox = None
        if event is not None:
            event.synchronize()
        tabs, keys, last = tkl.numpy()
        rows = rows.numpy()
        D = self.dim
        at = 0
        for t, host in self.hosts.items():
            d = over[t]
            if not d:
                continue
            sl = slice(at, at + d)
            at += d
            assert (tabs[sl] == t).all()
            states, o = {}, D
            for name, per_dim in self._float_state:
                w = D if per_dim else 1
                states[name] = np.ascontiguousarray(rows[sl, o:o + w] if per_dim else rows[sl, o])
                o += w
            for name in self._int_state:
                states[name] = ints[name].numpy()[sl]
            block = RowBlock(np.ascontiguousarray(keys[sl]), np.ascontiguousarray(rows[sl, :D]), states,
                             np.ascontiguousarray(last[sl]))
            drop = d - host.capacity
            if drop > 0:
                self._dropped[t] += drop
                block = block.take(np.arange(drop, d))
            self._c[t]["writebacks"] += block.num_rows
            host.write_back(block)

    def update(self, step: int) -> None:
        """``DeviceSparse.update``: the optimizer on the step's rows (all in the cache)."""
        self.sparse.update(step)

    def cancel(self, step: int) -> None:
        """``DeviceSparse.cancel``: the update of ``step`` withdrawn (not counted)."""
        self.sparse.cancel(step)

    def flush(self) -> None:
        """Give the host the demoted rows still on their way (one read of the device)."""
        self._deliver()

    # ------------------------------------------------------------------ reads

    def counters(self) -> dict[str, dict[str, int]]:
        """Return each table's counters (module doc); raises the errors the device counted."""
        self._current()
        dc = self.sparse.counters()
        out = {}
        for t, name in enumerate(self.names):
            c = dc[name]
            h = self.hosts[t].counters() if t in self.hosts else None
            o = {"hits": c["hits"], "misses": c["misses"], "inserts": c["inserts"], "admitted": c["misses"],
                 "rejected": 0, "evictions": c["evictions"] + self._dropped[t] + (h["evictions"] if h else 0),
                 "updated": c["updated"], "ignored": 0, "rows": c["rows"] + (h["rows"] if h else 0),
                 "rows_in": self._io["rows_in"][t], "rows_out": self._io["rows_out"][t]}
            if h is not None:
                o.update(self._c[t])
            else:  # the cache is the table
                o.update(cache_hits=c["hits"], cache_misses=c["misses"], cache_evictions=c["evictions"], writebacks=0)
            o["cached"] = c["rows"]
            out[name] = o
        return out

    def peek_rows(self, table: str, keys: np.ndarray) -> np.ndarray:
        """Return float32 [len(keys), D] rows of ``table`` (zeros where absent); changes nothing."""
        keys = _as_keys(keys)
        self._current()
        rows, found = self.sparse.peek_found(table, keys)  # one look-up of the cache
        t = self.names.index(table)
        if t in self.hosts and keys.shape[0]:
            rest = ~found
            if rest.any():
                rows[rest] = self.hosts[t].peek(keys[rest])
        return rows

    def held(self, table: str, keys: np.ndarray) -> np.ndarray:
        """Return bool [len(keys)]: whether each key of ``table`` has a row in either tier."""
        keys = _as_keys(keys)
        self._current()
        found = self.sparse.held(table, keys)
        t = self.names.index(table)
        if t in self.hosts and not found.all():
            rest = np.flatnonzero(~found)
            at_host = np.zeros(rest.shape[0], dtype=bool)
            self.hosts[t].peek(keys[rest], found_out=at_host)
            found[rest] = at_host
        return found

    def state_dict(self) -> dict[str, pa.Table]:
        """Return each table's rows, both tiers, as ``EmbeddingTable.state_dict()`` does."""
        self._current()
        cache = self.sparse.state_dict()
        out = {}
        for t, name in enumerate(self.names):
            out[name] = cache[name] if t not in self.hosts else _sorted(
                pa.concat_tables([cache[name], self.hosts[t].state_dict()]))
        return out

    # ------------------------------------------------------------------ rows in and out

    def pop_rows(self, table: str, keys: np.ndarray) -> pa.Table:
        """Remove the rows of ``keys`` from ``table`` (either tier) and return them (absent keys
        skipped, the others in the order given), as ``EmbeddingTable.pop_rows``."""
        keys = _as_keys(keys)
        self._current()
        t = self.names.index(table)
        got = self.sparse.pop_rows(table, keys)
        if t in self.hosts:
            self._held[t] -= got.num_rows
            rest = keys[~np.isin(keys, got.column("key").to_numpy())]
            got = pa.concat_tables([got, self.hosts[t].pop_rows(rest)])
            k = got.column("key").to_numpy()
            pos = {int(v): i for i, v in enumerate(keys)}
            got = got.take(np.argsort([pos[int(v)] for v in k], kind="stable"))
        self._io["rows_out"][t] += got.num_rows
        return got

    def load_state_dict(self, state: dict[str, pa.Table]) -> None:
        """Merge each table's rows into it, as ``EmbeddingTable.load_state_dict``: present keys
        replaced, and when the table overflows its least recent rows not in the input evicted
        (by last_seen, then key as uint64); then the most recent ``R`` rows go to the cache,
        the others to the host."""
        self._current()
        for name, rows in state.items():
            if name not in self.specs:
                raise ValueError(f"load_state_dict: unknown table {name!r}")
            t = self.names.index(name)
            if t not in self.hosts:
                self.sparse.load_state_dict({name: rows})
            else:
                self._load(t, rows)
            self._io["rows_in"][t] += rows.num_rows

    def _load(self, t: int, rows: pa.Table) -> None:
        name, schema = self.names[t], self.schemas[self.names[t]]
        # every check before either tier changes (the columns, types, nulls, a repeated key, the
        # capacity of both tiers together)
        self.sparse.check_rows(t, rows, capacity=self.caps[t])
        rows = rows.select(schema.names).cast(schema)
        cur = _sorted(pa.concat_tables([self.sparse.state_dict([name])[name], self.hosts[t].state_dict()]))
        cur = cur.filter(pa.array(~np.isin(cur.column("key").to_numpy(), rows.column("key").to_numpy())))
        over = cur.num_rows + rows.num_rows - self.caps[t]
        if over > 0:  # the least recent rows not in the input
            k, s = cur.column("key").to_numpy(), cur.column("last_seen").to_numpy()
            cur = cur.take(np.sort(np.lexsort((k.view(np.uint64), s))[over:]))
            self._dropped[t] += over
        allr = pa.concat_tables([rows, cur])
        k, s = allr.column("key").to_numpy(), allr.column("last_seen").to_numpy()
        o = np.lexsort((k.view(np.uint64), s))
        split = max(0, allr.num_rows - self.rows[t])
        # both tiers emptied (the union's rows are in ``allr``), then filled again
        self.sparse.pop_rows(name, self.sparse.state_dict()[name].column("key").to_numpy())
        host = self.hosts[t]
        host.pop_rows(host.state_dict().column("key").to_numpy())
        self.sparse.load_state_dict({name: allr.take(o[split:])})
        if split:
            host.insert_rows(allr.take(o[:split]))
        self._held[t] = allr.num_rows - split


@dataclasses.dataclass(slots=True)
class _Ahead:
    """A step's misses asked ahead (``DeviceCachedSparse.prefetch``)."""

    step: int
    uniq: dict  # table -> the step's distinct keys
    cells: torch.Tensor  # each key's cell in the cache (-1: a miss), in ``uniq``'s order
    misses: dict  # table -> the keys the cache lacks
    popped: list  # (table, the host's rows of the misses) taken out of the hosts


def _sorted(t: pa.Table) -> pa.Table:
    return t.take(np.argsort(t.column("key").to_numpy()))


def _matrix(t: pa.Table, col: str, dim: int) -> np.ndarray:
    return np.asarray(t.column(col).combine_chunks().flatten()).reshape(-1, dim)


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A device copy of a host array (pinned and asynchronous on CUDA)."""
    x = torch.from_numpy(np.array(a, copy=True))
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


def _to_host(parts: tuple) -> tuple:
    """Start the copy of ``DeviceSparse.demote``'s tensors to the host: (event or None, the
    host tensors); on CUDA into pinned memory, asynchronously (the event marks its end)."""
    tabs, keys, rows, ints, last = parts
    tkl = torch.stack([tabs, keys, last])  # one copy of the int64 columns
    if tabs.device.type != "cuda":
        return (None, tkl, rows, ints)

    def cp(x):
        out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        out.copy_(x, non_blocking=True)
        return out

    host = (cp(tkl), cp(rows), {k: cp(v) for k, v in ints.items()})
    event = torch.cuda.Event()
    event.record()
    return (event, *host)
