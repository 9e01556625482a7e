"""The sparse step as device work: one key index and one arena for every table of one dim.

Legend: ``T`` tables, ``F`` features, ``B`` batch, ``N`` keys of a step (repeats included),
``D`` dim, ``S`` the tables' capacities summed, ``W`` ways of a bucket (``WAYS``), ``NB``
buckets, ``X`` the scratch row (``NB·W``).

``DeviceSparse`` takes a step's KeyedJaggedTensor (keys and lengths, feature-major) on the
device and does everything the host store does for it there, in plain torch ops with
shapes that depend only on ``N`` and ``B`` (so the same code runs on the CPU in tests, and
on CUDA without a host sync)::

    forward(keys_N, lengths_FB, step)
      bag and table of each key (cumsum, searchsorted)
      dedup: stable sorts by (table, key as uint64), first-occurrence flags, a cummax
      base = fmix64(key ^ salt(table, seed))   one hash: the buckets and the initial rows
      index: two buckets of W ways per key (bits of ``base``), key and table compared
      per-table counts (one searchsorted over the sorted tables), the per-table arithmetic
        in two small float64 matmuls (exact below 2**53)
      exact LRU: the order array drops touched and evicted cells (a cumsum compaction),
        evicted cells leave the index; the step's keys are appended in key order
      new keys: a cell in the emptier of their two buckets (their rank within the bucket
        among the step's new keys, in (table, key) order), the initial row written there
      rows = arena[cells] (a leaf) ─► one embedding_bag for every feature ─► [B, F·D]
    update(step)        the optimizer (``apply_update_torch``) on the step's rows, in place

Layout (device tensors)::

    index_C2     int64 [NB·W + 1, 2]   per cell: key (its bits with the sign flipped, so
                                       signed order is uint64 order), table (-1: empty)
    w            float32 [NB·W + 1, D] the row of the key in that cell (its slot IS its cell)
    state        the optimizer's columns, beside (``optim.state_columns``)
    last_step    int64 [NB·W + 1]      the step of each cell's last access
    order        int64 [S + 1]         per table a block of its capacity: the cells it holds,
                                       oldest first by (last step, key as uint64), the rest X
    acc          int64 [T, 6]          hits, misses, inserts, evictions, rows held, updated

Every 64-bit value is a key (0 and negative ones too): occupancy is the table column. A
row's slot is its index cell, so the arena has ``NB·W`` rows (the index is at most half
full: about 2·S rows, the price of no slot indirection, no free list and fewer ops a step).
Row ``X`` (past the cells) is the scratch target of every masked write.

Eviction (``recsys.store.tables.keymap``'s rule, exactly): a table that gets more new keys
than free rows evicts the ``n + M - C`` smallest by (last-access step, key as uint64) among
its keys not touched by the step. The order array keeps each table's held cells in that
order, so the victims are the first untouched entries of its block; the step's touched
keys all have the newest step and are appended sorted by key (the dedup's order). The host
skips the order's ops while no table can be full (a bound it keeps without reading the
device: every step adds at most ``N`` keys to a table) and sorts it whole once when that
ends and on ``load_state_dict``.

Errors that only the device sees are counted there and raised by ``counters()``: a step
whose distinct keys in one table exceed its capacity (``CapacityError``: the keys beyond the
capacity got no row and read the scratch row; the table's later contents are not
meaningful), and a bucket pair with no free way (``RuntimeError``; astronomically rare at
load 1/2). Steps must increase from one ``forward`` to the next. Admission
(``min_count > 1``) is refused: it keeps host key work (``DeviceTable``). Every table must
have the same dim, and the dtype must be float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from recsys.features.schema import TableSpec
from recsys.store.config import StoreConfig
from recsys.store.device.cache import apply_update_torch
from recsys.store.tables import optim
from recsys.store.tables.initial import init_salt
from recsys.store.tables.rowblock import fixed_list, int64_column, matrix_column, vector_column
from recsys.store.tables.table import CapacityError, arrow_schema

__all__ = ["DeviceSparse", "fmix64_torch", "init_rows_torch", "WAYS"]

WAYS = 16
"""Ways of a bucket (cells a key may sit in: two buckets of ``WAYS``)."""
LOAD = 0.5
"""The index's largest load (held keys per cell)."""
_MIN = -(1 << 63)
_M31 = (1 << 31) - 1
_M32 = (1 << 32) - 1
_C1 = 0xFF51AFD7ED558CCD - (1 << 64)
_C2 = 0xC4CEB9FE1A85EC53 - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15
_ACC = ("hits", "misses", "inserts", "evictions", "rows", "updated")


def _signed(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def fmix64_torch(x: torch.Tensor) -> torch.Tensor:
    """murmur3's fmix64 on int64 tensors holding uint64 bits (logical shifts by masking;
    int64 multiplication wraps)."""
    x = x ^ ((x >> 33) & _M31)
    x = x * _C1
    x = x ^ ((x >> 33) & _M31)
    x = x * _C2
    return x ^ ((x >> 33) & _M31)


_GOLD_CACHE: dict = {}


def _gold(dim: int, device) -> torch.Tensor:
    k = (dim, str(device))
    if k not in _GOLD_CACHE:
        _GOLD_CACHE[k] = torch.tensor([_signed((d + 1) * _GOLDEN) for d in range(dim)], dtype=torch.int64,
                                      device=device)
    return _GOLD_CACHE[k]


def _rows_from_base(base: torch.Tensor, dim: int, bound: float) -> torch.Tensor:
    """``recsys.store.tables.initial``'s element formula from each key's base hash."""
    h = fmix64_torch(base.unsqueeze(1) + _gold(dim, base.device))
    # 2k with k = h >>> 40 (24 bits); then 2k + 1 - 2^24 exactly, and one float64 product:
    # bound · ((2k+1)/2^24 - 1) rounds the same real number (a power of two scales exactly)
    v = ((h >> 39) & 0x1FFFFFE) + (1 - (1 << 24))
    return (v.to(torch.float64) * (bound / 16777216.0)).to(torch.float32)


def init_rows_torch(keys: torch.Tensor, dim: int, table: str, seed: int, bound: float) -> torch.Tensor:
    """Return ``init_vectors(keys, dim, table, seed, bound)`` computed with torch ops on
    ``keys``' device (int64), bit for bit."""
    base = fmix64_torch(keys ^ _signed(init_salt(table, seed)))
    return _rows_from_base(base, dim, bound)


@dataclass
class _Step:
    step: int
    rows: torch.Tensor  # the leaf [N, D]
    upd: torch.Tensor  # cell of each sorted entry to update (X: none)
    held_t: torch.Tensor  # rows updated per table


class DeviceSparse:
    """Every table of one dim held whole on ``device``: the sparse step as device work
    (module doc). ``features``: (feature, table, "sum" | "mean") in the KJT's key order."""

    def __init__(self, tables: dict[str, TableSpec], features: list[tuple[str, str, str]], cfg: StoreConfig,
                 device: torch.device | str) -> None:
        if cfg.min_count > 1:
            raise ValueError("DeviceSparse does not do admission (min_count > 1): use the host key map")
        if np.dtype(cfg.dtype) != np.float32:
            raise ValueError(f"DeviceSparse stores float32 rows, not {cfg.dtype}")
        dims = {spec.dim for spec in tables.values()}
        if len(dims) != 1:
            raise ValueError(f"DeviceSparse needs tables of one dim, found {sorted(dims)}")
        self.cfg, self.device = cfg, torch.device(device)
        self.names = list(tables)
        self.specs = dict(tables)
        self.dim = D = dims.pop()
        T = self.T = len(self.names)
        self.caps = [s.capacity if s.num_rows is None else min(s.capacity, s.num_rows) for s in tables.values()]
        self.offs = [0]
        for c in self.caps:
            self.offs.append(self.offs[-1] + c)
        S = self.S = self.offs[-1]
        tix = {n: i for i, n in enumerate(self.names)}
        for f, t, p in features:
            if t not in tix:
                raise ValueError(f"feature {f!r}: unknown table {t!r}")
            if p not in ("sum", "mean"):
                raise ValueError(f"feature {f!r}: pooling must be 'sum' or 'mean', found {p!r}")
        self.features = list(features)
        self.F = len(features)
        self._feat_table = torch.tensor([tix[t] for _, t, _ in features], dtype=torch.int64)
        self._feat_mean = torch.tensor([p == "mean" for _, _, p in features], dtype=torch.bool)
        self._any_mean = bool(self._feat_mean.any())
        self.NB = max(1, math.ceil(S / (LOAD * WAYS)))
        self.X = X = self.NB * WAYS
        dev = self.device
        self.index = torch.zeros((X + 1, 2), dtype=torch.int64, device=dev)
        self.index[:, 1] = -1
        self.last_step = torch.zeros(X + 1, dtype=torch.int64, device=dev)
        self.w = torch.zeros((X + 1, D), dtype=torch.float32, device=dev)
        self._columns = optim.state_columns(cfg.optimizer)
        self.state = {c.name: torch.zeros((X + 1, D) if c.per_dim else (X + 1,),
                                          dtype=torch.float32 if c.dtype == np.float32 else torch.int64, device=dev)
                      for c in self._columns}
        self._state_init = {c.name: optim.initial_state_value(cfg, c) for c in self._columns}
        self.order = torch.full((S + 1,), X, dtype=torch.int64, device=dev)
        self.acc = torch.zeros((T, len(_ACC)), dtype=torch.int64, device=dev)
        self._placed = torch.zeros((), dtype=torch.int64, device=dev)
        self._bound = float(cfg.init_bound(D))
        self._salt = torch.tensor([_signed(init_salt(n, cfg.seed)) ^ _MIN for n in self.names], dtype=torch.int64,
                                  device=dev)
        self._arW = torch.arange(WAYS, dtype=torch.int64, device=dev)
        self._arT1 = torch.arange(T + 1, dtype=torch.int64, device=dev)
        seg = torch.repeat_interleave(torch.arange(T), torch.tensor(self.caps))
        self._seg = seg.to(dev)
        self._static_T = torch.tensor([[self.offs[t], self.caps[t], 1] for t in range(T)], dtype=torch.float64,
                                      device=dev)
        self._M1, self._M2 = self._matrices()
        self._zero2 = torch.zeros((1, 2), dtype=torch.int64, device=dev)
        self._true1 = torch.ones(1, dtype=torch.bool, device=dev)
        self._ar = torch.arange(0, dtype=torch.int64, device=dev)
        self._k = {v: torch.tensor(v, dtype=torch.int64, device=dev) for v in (0, -1, X, S)}
        self._one = torch.tensor(1.0, dtype=torch.float32, device=dev)
        self._bags: dict[int, tuple] = {}
        self._step: int | None = None
        self._pending: _Step | None = None
        self._bound_held = [0] * T  # an upper bound of each table's rows, known without the device
        self._order_valid = False
        self._host = {"rows_in": [0] * T, "rows_out": [0] * T}
        self.schemas = {n: arrow_schema(n, D, cfg) for n in self.names}

    # ------------------------------------------------------------------ static helpers

    def _matrices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-table arithmetic as two integer matrices (used in float64, exact).

        X1 columns: n, hits, new, found_base, new_base, off, C, 1 -> L1: f, avail, n - hits.
        X2 = X1 | L1 | ins, e, ub -> L2: avail, off + kept, found_base, new_base | ub - (n - hits),
        e, off - 1 - e | hits, new, ins, e, ins - e (the accumulators' increments)."""
        n, hits, new, fb, nb, off, C, one = range(8)
        M1 = np.zeros((8, 3))
        M1[C, 0], M1[n, 0] = 1, -1  # f = C - n
        M1[C, 1], M1[hits, 1] = 1, -1  # avail = C - hits
        M1[n, 2], M1[hits, 2] = 1, -1  # n - hits
        f, avail, nh, ins, e, ub = range(8, 14)
        M2 = np.zeros((14, 14))
        cols = [
            {avail: 1},  # 0 avail
            {off: 1, n: 1, hits: -1, e: -1},  # 1 off + kept (kept = n - hits - e)
            {fb: 1},  # 2
            {nb: 1},  # 3
            {ub: 1, nh: -1},  # 4 untouched before this table's block
            {e: 1},  # 5
            {off: 1, one: -1, e: -1},  # 6
            {hits: 1}, {new: 1}, {ins: 1}, {e: 1}, {ins: 1, e: -1},  # 7..11 increments
        ]
        for j, col in enumerate(cols):
            for i, v in col.items():
                M2[i, j] = v
        dev = self.device
        return (torch.tensor(M1, dtype=torch.float64, device=dev),
                torch.tensor(M2[:, :len(cols)], dtype=torch.float64, device=dev))

    def _arange(self, n: int) -> torch.Tensor:
        if self._ar.shape[0] < n:
            self._ar = torch.arange(max(n, 2 * self._ar.shape[0]), dtype=torch.int64, device=self.device)
        return self._ar[:n]

    def _bag_static(self, B: int):
        got = self._bags.get(B)
        if got is None:
            bag_table = self._feat_table.repeat_interleave(B).to(self.device)
            bag_mean = self._feat_mean.repeat_interleave(B).to(self.device)
            got = self._bags[B] = (bag_table, bag_mean)
            if len(self._bags) > 8:
                self._bags.pop(next(iter(self._bags)))
        return got

    # ------------------------------------------------------------------ the step

    def _cells_of(self, kf: torch.Tensor, tid: torch.Tensor):
        """Return (base hash, the cells of the two buckets [n, 2W], bucket·W of each [n, 2])."""
        base = fmix64_torch(kf ^ self._salt.index_select(0, tid))
        # bucket = (32 hash bits) · NB >> 32: low bits for the first, high bits for the second
        bw = ((torch.stack([base, base >> 32], 1) & _M32) * self.NB >> 32) * WAYS
        cells = (bw.unsqueeze(2) + self._arW).view(-1, 2 * WAYS)
        return base, cells, bw

    def forward(self, keys: torch.Tensor, lengths: torch.Tensor, step: int,
                weights: torch.Tensor | None = None) -> torch.Tensor:
        """Return the pooled float32 [B, F·D] (sample-major, features in order) of one
        training step; autograd differentiates it w.r.t. the step's rows (``update``)."""
        step = int(step)
        if self._step is not None and step <= self._step:
            raise ValueError(f"DeviceSparse: step {step} after step {self._step}; steps must increase")
        N, FB = int(keys.shape[0]), int(lengths.shape[0])
        F, T, X, S, W = self.F, self.T, self.X, self.S, WAYS
        if F == 0 or FB % F:
            raise ValueError(f"lengths has {FB} entries, not a multiple of the {F} features")
        B = FB // F
        if N == 0:
            raise ValueError("DeviceSparse: a step without keys")
        evict_ops = self._may_evict(N)
        bag_table, bag_mean = self._bag_static(B)
        ar = self._arange(N)
        k = self._k
        keys = keys.to(self.device)
        lengths = lengths.to(self.device, torch.int64)
        csum = torch.cumsum(lengths, 0)
        bag = torch.searchsorted(csum, ar, right=True)
        tid = bag_table.index_select(0, bag)
        offsets = csum - lengths
        # dedup: by (table, key as uint64)
        kf = keys ^ _MIN
        sk1, p1 = torch.sort(kf, stable=True)
        st, p2 = torch.sort(tid.index_select(0, p1), stable=True)
        perm = p1.index_select(0, p2)
        sk = sk1.index_select(0, p2)
        kt = torch.stack([sk, st], 1)
        first = torch.cat([self._true1, (kt[1:] != kt[:-1]).any(1)])
        rep = torch.where(first, ar, k[0]).cummax(0).values  # sorted position of each group's first
        inv = torch.empty_like(ar).index_put_((perm,), rep)
        # index lookup
        base, cells, bw = self._cells_of(sk, st)
        g = self.index[cells]  # [N, 2W, 2]
        match = (g == kt.unsqueeze(1)).all(2)
        slot = torch.where(match, cells, k[-1]).amax(1)
        found = slot >= 0
        foundf = found & first
        new = first & ~found
        # per-table counts and ranks (the sorted entries are grouped by table)
        q = torch.stack([foundf, new], 1)
        zq = torch.cat([self._zero2, q.cumsum(0)])  # zq[i]: counts before sorted position i
        base_t = zq.index_select(0, torch.searchsorted(st, self._arT1))  # [T+1, 2]
        cnt = base_t[1:] - base_t[:-1]
        x1 = torch.cat([self.acc[:, 4:5], cnt, base_t[:-1]], 1).to(torch.float64)
        x1 = torch.cat([x1, self._static_T], 1)
        l1 = x1 @ self._M1  # f, avail, n - hits
        ins_t = torch.minimum(x1[:, 2], l1[:, 1])
        e_t = (ins_t - l1[:, 0]).clamp(min=0)
        x2 = torch.cat([x1, l1, torch.stack([ins_t, e_t, l1[:, 2].cumsum(0)], 1)], 1)
        l2 = (x2 @ self._M2).to(torch.int64)
        pu = l2[:, 0:4].index_select(0, st)  # avail, off + kept, found base, new base
        rk = zq[:-1] - pu[:, 2:4]  # rank among found / new keys of the entry's table
        hm = torch.where(foundf, slot, k[X])
        self.last_step.index_fill_(0, hm, step)
        if evict_ops:
            self._compact(l2[:, 4:7], step)
        self.acc[:, 0:5] += l2[:, 7:12]
        ins = new & (rk[:, 1] < pu[:, 0])
        # new keys: the emptier bucket, the rank-th empty way among the step's new keys there
        empty = (g[:, :, 1] < 0).view(N, 2, W).sum(2)
        cw = torch.where(empty[:, 1] > empty[:, 0], bw[:, 1], bw[:, 0])
        sv, sp = torch.sort(torch.where(ins, cw, k[X]), stable=True)
        grank = torch.empty_like(ar).index_put_((sp,), ar - torch.searchsorted(sv, sv))
        free = self.index[:, 1][cw.unsqueeze(1) + self._arW] < 0
        way = (free.cumsum(1) <= grank.unsqueeze(1)).sum(1)
        place = ins & (way < W)
        tgt = torch.where(place, cw + way, k[X])
        self._placed += place.sum()
        self.index.index_put_((tgt,), kt)
        self.last_step.index_fill_(0, tgt, step)
        self.w.index_put_((tgt,), _rows_from_base(base, self.dim, self._bound))
        for name, t in self.state.items():
            t.index_fill_(0, tgt, self._state_init[name])
        upd = torch.where(place, tgt, hm)
        if evict_ops:  # append the step's keys (sorted by key) after the table's untouched ones
            held = foundf | place
            pos = torch.where(held, rk[:, 0] + torch.minimum(rk[:, 1], pu[:, 0]) + pu[:, 1], k[S])
            self.order.index_put_((pos,), upd)
        rows = self.w.index_select(0, upd).requires_grad_(True)
        psw = weights.to(self.device, torch.float32) if weights is not None else None
        if self._any_mean:
            scale = torch.where(bag_mean, 1.0 / lengths.clamp(min=1), self._one).index_select(0, bag)
            psw = scale if psw is None else psw * scale
        pooled = torch.nn.functional.embedding_bag(inv, rows, offsets, mode="sum", per_sample_weights=psw)
        self._step = step
        self._pending = _Step(step, rows, upd, cnt.sum(1))
        return pooled.view(F, B, self.dim).transpose(0, 1).reshape(B, F * self.dim)

    def _compact(self, ps: torch.Tensor, step: int) -> None:
        """Drop touched and evicted entries from every table's order block (cumsum
        compaction); evicted cells leave the index. ``ps`` [T, 3]: untouched entries
        before the table's block, evictions, off - 1 - evictions."""
        S, X = self.S, self.X
        order = self.order[:S]
        p = ps.index_select(0, self._seg)
        unt = (self.last_step.index_select(0, order) != step) & (order != X)
        r1 = unt.cumsum(0) - p[:, 0]  # 1-based rank among the block's untouched entries
        ev = unt & (r1 <= p[:, 1])
        keep = unt ^ ev
        new_order = torch.full_like(self.order, X)
        k = self._k
        new_order.index_put_((torch.where(keep, r1 + p[:, 2], k[S]),), order)
        self.index[:, 1].index_fill_(0, torch.where(ev, order, k[X]), -1)
        self.order = new_order

    def _may_evict(self, n: int) -> bool:
        """Whether a table may be full at this step (host bound); sorts the order once when
        that starts."""
        if self._order_valid:
            return True
        grow = [min(c, b + n) for b, c in zip(self._bound_held, self.caps)]
        if all(b + n <= c for b, c in zip(self._bound_held, self.caps)):
            self._bound_held = grow
            return False
        self._rebuild_order()
        return True

    def update(self, step: int) -> None:
        """Apply the optimizer to the rows of ``step`` (the latest ``forward``) with their
        gradients (after ``loss.backward()``), in place."""
        p = self._pending
        if p is None or p.step != int(step):
            raise ValueError(f"DeviceSparse.update: step {step} is not the latest forward's")
        if p.rows.grad is None:
            raise ValueError("DeviceSparse.update: no gradient (call backward first)")
        self._pending = None
        with torch.no_grad():
            w = p.rows.detach()
            st = {name: t.index_select(0, p.upd) for name, t in self.state.items()}
            apply_update_torch(self.cfg, w, st, p.rows.grad)
            self.w.index_put_((p.upd,), w)
            for name, t in self.state.items():
                t.index_put_((p.upd,), st[name])
            self.acc[:, 5] += p.held_t

    # ------------------------------------------------------------------ reads

    def counters(self) -> dict[str, dict[str, int]]:
        """Return each table's counters (hits, misses, inserts, evictions, rows, updated,
        rows_in, rows_out): one device-to-host read. Raises the errors the device counted."""
        flat = torch.cat([self.acc.flatten(), self._placed.view(1)]).cpu().numpy()
        acc = flat[:-1].reshape(self.T, len(_ACC))
        out = {}
        for t, name in enumerate(self.names):
            c = {k: int(acc[t, i]) for i, k in enumerate(_ACC)}
            c["rows_in"], c["rows_out"] = self._host["rows_in"][t], self._host["rows_out"][t]
            out[name] = c
        for t, name in enumerate(self.names):
            dropped = int(acc[t, 1] - acc[t, 2])
            if dropped:
                err = CapacityError(name, self._step or 0, self.caps[t] + 1, self.caps[t])
                err.args = (f"table {name!r}: a batch at or before step {self._step} had more distinct ids than "
                            f"the {self.caps[t]} rows the table holds ({dropped} ids got no row); raise "
                            f"{err.fix} to at least the distinct ids of one batch or lower data.train.batch_size",)
                raise err
        if int(flat[-1]) != int(acc[:, 2].sum()):
            raise RuntimeError(f"DeviceSparse: {int(acc[:, 2].sum() - flat[-1])} new keys found no free way in "
                               "their two buckets; the device index is corrupt (an internal error)")
        return out

    def _lookup(self, table: str, keys: np.ndarray) -> torch.Tensor:
        """Return the cell of each key of ``table`` (-1: absent)."""
        t = self.names.index(table)
        k = _tensor(keys, self.device) ^ _MIN
        tid = torch.full_like(k, t)
        _, cells, _ = self._cells_of(k, tid)
        match = (self.index[cells] == torch.stack([k, tid], 1).unsqueeze(1)).all(2)
        return torch.where(match, cells, -1).amax(1)

    def peek_rows(self, table: str, keys: np.ndarray) -> np.ndarray:
        """Return float32 [len(keys), D] rows of ``table`` (zeros where absent); changes nothing."""
        keys = _as_keys(keys)
        if keys.shape[0] == 0:
            return np.zeros((0, self.dim), dtype=np.float32)
        cells = self._lookup(table, keys)
        rows = self.w.index_select(0, cells.clamp(min=0)) * (cells >= 0).unsqueeze(1)
        return rows.cpu().numpy()

    def _rows(self, cells: torch.Tensor, keys: np.ndarray, schema: pa.Schema) -> pa.Table:
        """Return the Arrow rows of ``cells`` (their keys ``keys``) in ``schema``."""
        emb = self.w.index_select(0, cells).cpu().numpy()
        cols = [pa.array(keys, type=pa.int64()), fixed_list(emb, self.dim)]
        for c in self._columns:
            v = self.state[c.name].index_select(0, cells).cpu().numpy().astype(c.dtype, copy=False)
            cols.append(fixed_list(v, self.dim) if c.per_dim else pa.array(v))
        cols.append(pa.array(self.last_step.index_select(0, cells).cpu().numpy()))
        return pa.Table.from_arrays(cols, schema=schema)

    def _held(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Return (cells, table ids, keys) of every held key (host arrays)."""
        idx = self.index[: self.X].cpu().numpy()
        cells = np.flatnonzero(idx[:, 1] >= 0)
        return cells, idx[cells, 1], idx[cells, 0] ^ np.int64(_MIN)

    def state_dict(self) -> dict[str, pa.Table]:
        """Return each table's rows as ``EmbeddingTable.state_dict()`` does (its schema,
        sorted by key as int64)."""
        cells, tabs, keys = self._held()
        out = {}
        for t, name in enumerate(self.names):
            sel = np.flatnonzero(tabs == t)
            order = sel[np.argsort(keys[sel])]
            out[name] = self._rows(torch.as_tensor(cells[order], device=self.device), keys[order], self.schemas[name])
        return out

    # ------------------------------------------------------------------ rows in and out

    def pop_rows(self, table: str, keys: np.ndarray) -> pa.Table:
        """Remove the rows of ``keys`` from ``table`` and return them (absent keys skipped),
        as ``EmbeddingTable.pop_rows``."""
        keys = _as_keys(keys)
        t = self.names.index(table)
        cells = self._lookup(table, keys).cpu().numpy() if keys.shape[0] else np.zeros(0, dtype=np.int64)
        live = cells >= 0
        c = torch.as_tensor(cells[live], device=self.device)
        out = self._rows(c, keys[live], self.schemas[table])
        self.index[:, 1].index_fill_(0, c, -1)
        self.acc[t, 4] -= int(live.sum())
        self._host["rows_out"][t] += int(live.sum())
        if self._order_valid:
            self._rebuild_order()
        return out

    def load_state_dict(self, state: dict[str, pa.Table]) -> None:
        """Merge each table's rows into it, as ``EmbeddingTable.load_state_dict``: present
        keys replaced, and when the table overflows its least recent rows not in the input
        evicted (by last_seen, then key as uint64)."""
        for name, rows in state.items():
            if name not in self.specs:
                raise ValueError(f"load_state_dict: unknown table {name!r}")
            self._insert(self.names.index(name), rows)
        self._rebuild_order()
        self._bound_held = [c for c in self.caps]

    def _insert(self, t: int, rows: pa.Table) -> None:
        name = self.names[t]
        where = f"table {name!r}: rows to load"
        if not isinstance(rows, pa.Table):
            raise TypeError(f"{where}: expected a pyarrow.Table, found {type(rows).__name__}")
        expected = self.schemas[name].names
        if sorted(rows.column_names) != sorted(expected):
            raise ValueError(f"{where}: columns {rows.column_names} do not match this table's "
                             f"({self.cfg.optimizer}, dim {self.dim}): expected {expected}")
        keys = int64_column(rows, "key", where)
        if np.unique(keys).shape[0] != keys.shape[0]:
            raise ValueError(f"{where}: column 'key' repeats keys")
        if keys.shape[0] > self.caps[t]:
            raise ValueError(f"{where}: {keys.shape[0]} rows exceed the capacity {self.caps[t]}")
        last = int64_column(rows, "last_seen", where)
        emb = matrix_column(rows, "embedding", self.dim, where, (np.float32, np.float16)).astype(np.float32)
        states = {c.name: (matrix_column(rows, c.name, self.dim, where, (c.dtype,)) if c.per_dim
                           else vector_column(rows, c.name, where, c.dtype)) for c in self._columns}
        dev = self.device
        # present keys: replaced in place
        cells = self._lookup(name, keys).cpu().numpy() if keys.shape[0] else np.zeros(0, dtype=np.int64)
        present = cells >= 0
        n_new = int((~present).sum())
        held_cells, tabs, held_keys = self._held()
        mine = tabs == t
        over = int(mine.sum()) + n_new - self.caps[t]
        if over > 0:  # evict the least recent rows not in the input
            hc, hk = held_cells[mine], held_keys[mine]
            keep = ~np.isin(hk, keys)
            hc, hk = hc[keep], hk[keep]
            hl = self.last_step.index_select(0, torch.as_tensor(hc, device=dev)).cpu().numpy()
            victims = hc[np.lexsort((hk.view(np.uint64), hl))[:over]]
            self.index[:, 1].index_fill_(0, torch.as_tensor(victims, device=dev), -1)
            self.acc[t, 3] += over
            self.acc[t, 4] -= over
        if n_new:
            kf = _tensor(keys[~present], dev) ^ _MIN
            tid = torch.full_like(kf, t)
            placed = self._place(kf, tid)
            cells[~present] = placed.cpu().numpy()
            self.index.index_put_((placed,), torch.stack([kf, tid], 1))
            self.acc[t, 4] += n_new
        c = torch.as_tensor(cells, device=dev)
        self.w.index_put_((c,), _tensor(emb, dev))
        for col in self._columns:
            self.state[col.name].index_put_((c,), _tensor(states[col.name], dev))
        self.last_step.index_put_((c,), _tensor(last, dev))
        self._host["rows_in"][t] += keys.shape[0]

    def _place(self, kf: torch.Tensor, tid: torch.Tensor) -> torch.Tensor:
        """Give distinct absent keys cells (the step's rule, all at once); raise on overflow."""
        n = kf.shape[0]
        ar = torch.arange(n, device=self.device)
        _, cells, bw = self._cells_of(kf, tid)
        empty = (self.index[cells][:, :, 1] < 0).view(n, 2, WAYS).sum(2)
        cw = torch.where(empty[:, 1] > empty[:, 0], bw[:, 1], bw[:, 0])
        sv, sp = torch.sort(cw, stable=True)
        grank = torch.empty_like(ar).index_put_((sp,), ar - torch.searchsorted(sv, sv))
        free = self.index[:, 1][cw.unsqueeze(1) + self._arW] < 0
        way = (free.cumsum(1) <= grank.unsqueeze(1)).sum(1)
        if bool((way >= WAYS).any()):
            raise RuntimeError("DeviceSparse: keys found no free way in their two buckets (an internal error)")
        return cw + way

    def _rebuild_order(self) -> None:
        """Sort every table's held cells by (last step, key as uint64) into its order block."""
        cells, tabs, keys = self._held()
        steps = self.last_step.index_select(0, torch.as_tensor(cells, device=self.device)).cpu().numpy()
        o = np.lexsort((keys.view(np.uint64), steps, tabs))
        cells, tabs = cells[o], tabs[o]
        starts = np.searchsorted(tabs, np.arange(self.T))
        pos = np.asarray(self.offs[:-1])[tabs] + np.arange(tabs.shape[0]) - starts[tabs]
        order = np.full(self.S + 1, self.X, dtype=np.int64)
        order[pos] = cells
        self.order = torch.as_tensor(order, device=self.device)
        self._order_valid = True


def _tensor(a: np.ndarray, device) -> torch.Tensor:
    """Return a device copy of the host array ``a`` (which may be read-only, as Arrow's are)."""
    return torch.from_numpy(np.array(a, copy=True)).to(device)


def _as_keys(keys) -> np.ndarray:
    keys = np.ascontiguousarray(keys)
    if keys.dtype == np.uint64:
        return keys.view(np.int64)
    return keys.astype(np.int64, copy=False)
