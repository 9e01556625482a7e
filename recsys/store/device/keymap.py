"""The sparse step as device work: one key index and one arena for every table of one dim.

Legend: ``T`` tables, ``F`` features, ``B`` batch, ``N`` keys of a step (repeats included),
``D`` dim, ``S`` the tables' capacities summed, ``W`` ways of a bucket (``WAYS``), ``NB``
buckets, ``X`` the scratch cell (``NB·(W+1)``).

``DeviceSparse`` takes a step's KeyedJaggedTensor (keys and lengths, feature-major) on the
device and does everything the host store does for it there, in plain torch ops with
shapes that depend only on ``N`` and ``B`` (so the same code runs on the CPU in tests, and
on CUDA without a host sync)::

    forward(keys_N, lengths_FB, step)
      bag and table of each key (cumsum, searchsorted)
      dedup: stable sorts by (table, key as uint64), first-occurrence flags, a cummax
      base = fmix64(key ^ salt(table, seed))   one hash: the buckets and the initial rows
      index: two buckets of W ways per key (base and base >> 32, modulo NB), key and table
        compared; a hit's cell is the smallest matching one (X: none)
      per-table counts (one searchsorted over the sorted tables), the per-table arithmetic
        in two small float64 matmuls and one clamp (exact below 2**53)
      exact LRU: the order array drops touched and evicted cells (a cumsum compaction),
        evicted cells leave the index; the step's keys are appended in key order
      new keys: free ways counted after the evictions; ROUNDS rounds of proposals (each key
        to the emptier of its two buckets first, ties to its first, then to the other), a
        key accepted while its rank among the bucket's keys is below its free ways (the first
        round keeps HEADROOM ways free); the initial row written there
      rows = arena[cells] (a leaf: its first D columns) ─► one embedding_bag ─► [B, F·D]
    update(step)        the optimizer on the step's arena rows, in place, written back once
                        (row-wise Adagrad here; the others by ``apply_update_torch``)

Layout (device tensors)::

    index_C2     int64 [X + W, 2]      per cell: key (its bits with the sign flipped, so
                                       signed order is uint64 order), table (-1: empty)
    arena        float32 [X + 1, D+s]  the row of the key in that cell (its slot IS its
                                       cell), then its float32 state columns (``w`` and
                                       ``state`` are views; int64 state apart)
    last_step    int64 [X + 1]         the step of each cell's last access
    order        int64 [S + 1]         per table a block of its capacity: the cells it holds,
                                       oldest first by (last step, key as uint64), the rest X
    acc          float64 [T, 6]        hits, misses, inserts, evictions, rows held, updated
                                       (counted at the forward; the last columns of ``_l2``,
                                       which the step's matmul writes: exact below 2**53)

Every 64-bit value is a key (0 and negative ones too): occupancy is the table column. A
row's slot is its index cell, so the arena has ``NB·(W+1)`` rows (the index is at most half
full: about 2·S rows, the price of no slot indirection, no free list and fewer ops a step).
A bucket is W ways and a dead cell after them: a new key that finds no free way in either
of its buckets in the rounds goes to the dead cell (way W), which no lookup reads and whose
last step, never written otherwise, marks the failure for ``counters()``. Cell ``X`` (past the buckets) is the
scratch target of every masked write; the index's W - 1 rows past it are read (and their
contents ignored) by the free-way gather of the entries that place no key.

Eviction (``recsys.store.tables.keymap``'s rule, exactly): a table that gets more new keys
than free rows evicts the ``n + M - C`` smallest by (last-access step, key as uint64) among
its keys not touched by the step. The order array keeps each table's held cells in that
order, so the victims are the first untouched entries of its block; the step's touched
keys all have the newest step and are appended sorted by key (the dedup's order). The host
skips the order's ops while no table can be full (a bound it keeps without reading the
device: every step adds at most ``N`` keys to a table) and sorts it whole once when that
ends and on ``load_state_dict``.

Scratch kept between steps (``_buffers``, grown with headroom when ``N`` outgrows it) saves
a concatenation or a fill each step: the sorted (key, table) pairs after a row that matches
no entry (the first-occurrence flags need no prepended True), the per-entry counts after a
zero row (exclusive counts without a prepended zero), the hits' cells after ``X`` (the
last-step fill always touches the scratch cell, so the order's empty entries read as
touched), and the new rows beside their state's initial values (one arena write). None of
them is saved for backward.

Errors that only the device sees are counted there and raised by ``counters()``: a step
whose distinct keys in one table exceed its capacity (``CapacityError``: the keys beyond the
capacity got no row and read the scratch row; the table's later contents are not
meaningful), and a new key refused by both its buckets (``RuntimeError``). The rounds keep
that rare at load 1/2 even when one step brings as many new keys as the index holds (a
table filled in one step, most of it replaced each step: ``tests/test_device_keymap.py``),
but a fixed number of rounds is no guarantee. Steps must increase from one ``forward`` to the next. Admission
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
_STRIDE = WAYS + 1
"""Cells per bucket: its ways and a dead cell (where a key that found no free way goes)."""
ROUNDS = 2
HEADROOM = 4
"""Ways the first round leaves free in a bucket (a step that fills many empty buckets at once
spreads its keys instead of filling them to the last way)."""
"""Rounds of the new keys' proposals to their buckets (``DeviceSparse._assign``)."""
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


def _xorshift33(x: torch.Tensor) -> torch.Tensor:
    """``x ^ (x >>> 33)`` on int64 holding uint64 bits (the logical shift by masking)."""
    return x ^ ((x >> 33) & _M31)


def fmix64_torch(x: torch.Tensor) -> torch.Tensor:
    """murmur3's fmix64 on int64 tensors holding uint64 bits (logical shifts by masking;
    int64 multiplication wraps)."""
    return _xorshift33(_xorshift33(_xorshift33(x) * _C1) * _C2)


_GOLD_CACHE: dict = {}
_CONST_CACHE: dict = {}


def _consts(device) -> tuple[torch.Tensor, torch.Tensor]:
    """0-d int64 ``MIN`` and ``C2`` on ``device`` (the last multiply of ``_odd_from_base``)."""
    k = str(device)
    if k not in _CONST_CACHE:
        _CONST_CACHE[k] = (torch.tensor(_MIN, dtype=torch.int64, device=device),
                           torch.tensor(_C2, dtype=torch.int64, device=device))
    return _CONST_CACHE[k]


def _gold(dim: int, device) -> torch.Tensor:
    k = (dim, str(device))
    if k not in _GOLD_CACHE:
        _GOLD_CACHE[k] = torch.tensor([_signed((d + 1) * _GOLDEN) for d in range(dim)], dtype=torch.int64,
                                      device=device)
    return _GOLD_CACHE[k]


def _odd_from_base(base: torch.Tensor, dim: int) -> torch.Tensor:
    """Return int64 [.., dim]: ``2k + 1 - 2^24`` for ``k = fmix64(base + gold(d)) >>> 40``.

    fmix64's last step (``h ^ (h >>> 33)``) leaves bits 33..63 as they are, so it is skipped;
    with the top bit flipped, the arithmetic shift gives ``k - 2^23`` signed, and
    ``((y ^ MIN) >> 39) | 1`` is ``2 (k - 2^23) + 1``; flipping the top bit is adding ``MIN``,
    so the last multiply and the flip are one ``addcmul``."""
    x = _xorshift33(_xorshift33(base.unsqueeze(-1) + _gold(dim, base.device)) * _C1)
    min_t, c2_t = _consts(base.device)
    return (torch.addcmul(min_t, x, c2_t) >> 39) | 1  # x·C2 ^ MIN is x·C2 + MIN (mod 2^64)


def _rows_from_base(base: torch.Tensor, dim: int, bound: float) -> torch.Tensor:
    """``recsys.store.tables.initial``'s element formula from each key's base hash."""
    # bound · ((2k+1)/2^24 - 1) = (2k + 1 - 2^24) · (bound / 2^24): one float64 product of an
    # exact integer (a power of two scales exactly), rounded once to float32
    return (_odd_from_base(base, dim).to(torch.float64) * (bound / 16777216.0)).to(torch.float32)


def init_rows_torch(keys: torch.Tensor, dim: int, table: str, seed: int, bound: float) -> torch.Tensor:
    """Return ``init_vectors(keys, dim, table, seed, bound)`` computed with torch ops on
    ``keys``' device (int64), bit for bit."""
    base = fmix64_torch(keys ^ _signed(init_salt(table, seed)))
    return _rows_from_base(base, dim, bound)


@dataclass
class _Step:
    step: int
    rows: torch.Tensor  # the leaf [N, D] (a view of ``ext``)
    ext: torch.Tensor  # the arena rows of the step [N, D + float state]
    upd: torch.Tensor  # cell of each sorted entry to update (X: none)
    x2: torch.Tensor  # the per-table arithmetic's inputs (``cancel`` takes its count back)


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
        self._feat_mean = torch.tensor([p == "mean" for _, _, p in features], dtype=torch.float32)
        self._any_mean = bool(self._feat_mean.any())
        self.NB = max(1, math.ceil(S / (LOAD * WAYS)))
        self.X = X = self.NB * _STRIDE
        dev = self.device
        # the index: every bucket's W ways and its dead cell, the scratch cell X, then W - 1
        # rows that only the free-way gather of the entries without a bucket (X + way) reads
        self.index = torch.zeros((X + WAYS, 2), dtype=torch.int64, device=dev)
        self.index[:, 1] = -1
        self.last_step = torch.zeros(X + 1, dtype=torch.int64, device=dev)
        self.last_step[WAYS:X:_STRIDE] = _MIN  # dead cells: a step written there marks a failed insert
        self._columns = optim.state_columns(cfg.optimizer)
        self._state_init = {c.name: optim.initial_state_value(cfg, c) for c in self._columns}
        # the arena: each cell's row and its float32 state columns side by side (one gather, one
        # write per step); int64 state columns apart
        width, views = D, {}
        for c in self._columns:
            if c.dtype == np.float32:
                views[c.name] = (width, c.per_dim)
                width += D if c.per_dim else 1
        self._width = width
        self.arena = torch.zeros((X + 1, width), dtype=torch.float32, device=dev)
        self.w = self.arena[:, :D]
        self.state = {}
        self._int_state = []
        for c in self._columns:
            if c.name in views:
                o, per_dim = views[c.name]
                self.state[c.name] = self.arena[:, o:o + D] if per_dim else self.arena[:, o]
            else:
                self.state[c.name] = torch.zeros((X + 1, D) if c.per_dim else (X + 1,), dtype=torch.int64,
                                                 device=dev)
                self._int_state.append(c.name)
        self._views = views
        self.order = torch.full((S + 1,), X, dtype=torch.int64, device=dev)
        # L2 of the per-table arithmetic (``_matrices``); its last columns are the accumulators
        # (float64: exact below 2**53), so the step's matmul adds the step's counts to them
        self._l2 = torch.zeros((T, 5 + len(_ACC)), dtype=torch.float64, device=dev)
        self.acc = self._l2[:, 5:]
        self._bound = float(cfg.init_bound(D))
        self._scale = torch.tensor(self._bound / 16777216.0, dtype=torch.float64, device=dev)
        self._salt = torch.tensor([_signed(init_salt(n, cfg.seed)) ^ _MIN for n in self.names], dtype=torch.int64,
                                  device=dev)
        self._arW = torch.arange(WAYS, dtype=torch.int64, device=dev)
        self._arT1 = torch.arange(T + 1, dtype=torch.int64, device=dev)
        self._shifts = torch.tensor([0, 32], dtype=torch.int64, device=dev)
        self._tf = torch.tensor([True, False], device=dev)
        seg = torch.repeat_interleave(torch.arange(T), torch.tensor(self.caps))
        self._seg = seg.to(dev)
        self._static_T = torch.tensor([[self.offs[t], self.caps[t], 1] for t in range(T)], dtype=torch.float64,
                                      device=dev)
        self._M1, self._M2 = self._matrices()
        self._ar = torch.arange(0, dtype=torch.int64, device=dev)
        self._bufs_n = -1
        self._k = {v: torch.tensor(v, dtype=torch.int64, device=dev) for v in (0, -1, X, S, 2 * S)}
        self._bags: dict[int, tuple] = {}
        self._step: int | None = None
        self._pending: _Step | None = None
        self._bound_held = [0] * T  # an upper bound of each table's rows, known without the device
        self._order_valid = False
        self._order_base = self._order_spare = None  # the compaction's two buffers (``_compact``)
        self._host = {"rows_in": [0] * T, "rows_out": [0] * T}
        self.schemas = {n: arrow_schema(n, D, cfg) for n in self.names}

    # ------------------------------------------------------------------ static helpers

    def _matrices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-table arithmetic as two integer matrices (used in float64, exact).

        X1 columns: the six accumulators (``_ACC``; n = rows held is the fifth), hits and new
        keys counted to the table's end, found_base, new_base (counted before its start), off,
        C, 1 -> L1: m - f, m, 0, 0, n - h, avail (h hits, m new keys, f = C - n free rows,
        avail = C - h); clamp(L1[0:2], L1[2:4], L1[4:6]) = e, ins. X2 = X1 | L1 | e, ins | ub
        (n - h summed over the tables up to this one) -> L2: avail + new_base, off + kept -
        found_base - new_base (kept = n - h - e) | Q = ub - (n - h) + e, S + off - 1 - Q,
        off + C - 1 - Q | the six accumulators after the step: hits, new, ins, e, ins - e and
        hits + new (rows updated) added. ``forward`` writes L2 into ``_l2``, whose last six
        columns are ``acc``: the step's counts are accumulated by the matmul itself."""
        S, A = self.S, len(_ACC)
        acc = list(range(A))
        n = acc[4]
        he, me, fb, nb, off, C, one = range(A, A + 7)
        X1 = A + 7
        M1 = np.zeros((X1, 6))
        for j, col in enumerate([{me: 1, nb: -1, C: -1, n: 1}, {me: 1, nb: -1}, {}, {},
                                 {n: 1, he: -1, fb: 1}, {C: 1, he: -1, fb: 1}]):
            for i, v in col.items():
                M1[i, j] = v
        _, m, _, _, nh, avail, e, ins, ub = range(X1, X1 + 9)
        q = {ub: 1, nh: -1, e: 1}
        minus_q = {i: -v for i, v in q.items()}
        cols = [
            {avail: 1, nb: 1},  # 0 A: a new key is inserted while its rank + new_base < A
            {off: 1, nh: 1, e: -1, fb: -1, nb: -1},  # 1 P: order position = found + min(new, A) + P
            q,  # 2 Q: an untouched entry is evicted while its count to the block's end is <= Q
            _plus({off: 1, one: S - 1}, minus_q),  # 3 kept at S + off - 1 + (count - Q)
            _plus({off: 1, C: 1, one: -1}, minus_q),  # 4 evicted at off + C - 1 + (count - Q)
            {acc[0]: 1, he: 1, fb: -1}, {acc[1]: 1, m: 1}, {acc[2]: 1, ins: 1}, {acc[3]: 1, e: 1},  # 5.. acc
            {acc[4]: 1, ins: 1, e: -1}, {acc[5]: 1, he: 1, fb: -1, m: 1},  # ..10 (rows held, rows updated)
        ]
        M2 = np.zeros((X1 + 9, len(cols)))
        for j, col in enumerate(cols):
            for i, v in col.items():
                M2[i, j] = v
        dev = self.device
        return torch.tensor(M1, dtype=torch.float64, device=dev), torch.tensor(M2, dtype=torch.float64, device=dev)

    def _arange(self, n: int) -> torch.Tensor:
        if self._ar.shape[0] < n:
            self._ar = torch.arange(max(n + n // 4, 2 * self._ar.shape[0]), dtype=torch.int64, device=self.device)
        return self._ar[:n]

    def _buffers(self, n: int):
        """Return the step's scratch (rebuilt when ``n`` outgrows them): (key and table of the
        sorted entries after a row that matches none, counts before each sorted entry after a
        zero row, hits' cells after the scratch cell, the new rows with their state's initial
        values)."""
        if self._bufs_n < n:
            m = max(n + n // 4, 2 * self._bufs_n)  # room for the next steps' N
            dev = self.device
            kb = torch.zeros((m + 1, 2), dtype=torch.int64, device=dev)
            kb[0, 1] = -2
            hb = torch.full((m + 1,), self.X, dtype=torch.int64, device=dev)
            ib = torch.zeros((m, self._width), dtype=torch.float32, device=dev)
            for name, (o, per_dim) in self._views.items():
                ib[:, o:o + (self.dim if per_dim else 1)] = self._state_init[name]
            self._bufs = (kb, torch.zeros((m + 1, 2), dtype=torch.int64, device=dev), hb, ib)
            self._bufs_n = m
        kb, zb, hb, ib = self._bufs
        return kb[:n + 1], zb[:n + 1], hb[:n + 1], ib[:n]

    def _bag_static(self, B: int):
        got = self._bags.get(B)
        if got is None:
            bag_table = self._feat_table.repeat_interleave(B).to(self.device)
            bag_mean = self._feat_mean.repeat_interleave(B).to(self.device)
            # the bags' offsets with the end of the last (include_last_offset): a leading 0,
            # then the lengths' cumsum written after it each step
            offs = torch.zeros(self.F * B + 1, dtype=torch.int64, device=self.device)
            got = self._bags[B] = (bag_table, bag_mean, 1 - bag_mean, offs)
            if len(self._bags) > 8:
                self._bags.pop(next(iter(self._bags)))
        return got

    # ------------------------------------------------------------------ the step

    def _cells_of(self, kf: torch.Tensor, tid: torch.Tensor):
        """Return (base hash, the cells of the two buckets [n, 2, W])."""
        base = fmix64_torch(kf ^ self._salt.index_select(0, tid))
        # buckets: the hash and its high half (arithmetic shift) modulo NB
        bk = torch.remainder(base.unsqueeze(1) >> self._shifts, self.NB)
        return base, torch.add(self._arW, bk.unsqueeze(2), alpha=_STRIDE)

    def _assign(self, cells: torch.Tensor, free: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """Return the cell of each ``live`` key (distinct keys absent from the index), X for the
        others: ``ROUNDS`` static rounds of proposals to the two buckets (``cells`` [n, 2, W]),
        ``free`` [n, 2, W] their free ways now.

        A key starts at the bucket with more free ways (ties: its first bucket, which is as
        uniform a choice as any, so a tie-break bit would change nothing). In every
        round each key without a way proposes to its bucket; the keys already accepted there
        rank first (sort value: the bucket's first cell), the proposers after them (that cell
        + 1: the buckets' first cells are W + 1 apart), each group in (table, key) order (the
        entries' order, a stable sort); a key whose rank is
        below the bucket's free ways (less ``HEADROOM`` in the first round) is accepted, the others turn to their other bucket for the
        next round. The accepted keys of a bucket hold ranks 0.. below its free ways, so their
        ranks are distinct ways. A key that is refused in every round gets way W, its bucket's
        dead cell (``counters()`` raises)."""
        n, W = cells.shape[0], WAYS
        # [W + 1, 2, n]: the free ways counted up to each way (the last: all of them), then the
        # bucket's first cell (X for the entries that place no key), both buckets side by side;
        # a round's bucket is one where, and its rows are contiguous
        cs = free.cumsum(2)
        cf = torch.cat([cs.permute(2, 1, 0), torch.where(live, cells[:, :, 0].T, self._k[self.X]).unsqueeze(0)], 0)
        side = cs[:, 1, W - 1] > cs[:, 0, W - 1]
        a = self._arange(n + HEADROOM)
        rank = cell = x = None
        for r in range(ROUNDS):
            x = torch.where(side, cf[:, 1], cf[:, 0])  # [W + 1, n]
            cell = x[W]
            v = cell if r == 0 else cell + prop
            sv, sp = torch.sort(v, stable=True)
            start = torch.searchsorted(sv, cell)
            # the first round's ranks count from HEADROOM (so they meet the free ways HEADROOM
            # early); the last round's, which choose the way, from 0
            ar = a[HEADROOM:n + HEADROOM] if r == 0 and r + 1 < ROUNDS else a[:n]
            rank = sv.index_put_((sp,), ar) - start  # sv is spent
            if r + 1 < ROUNDS:
                prop = rank >= x[W - 1]
                side = side ^ prop
        # way: the free ways up to it (counted) exceed the rank; W when none (the dead cell)
        way = (x[:W] <= rank).sum(0)
        return (cell + way).clamp_(max=self.X)

    def forward(self, keys: torch.Tensor, lengths: torch.Tensor, step: int,
                weights: torch.Tensor | None = None) -> torch.Tensor:
        """Return the pooled float32 [B, F·D] (sample-major, features in order) of one
        training step; autograd differentiates it w.r.t. the step's rows (``update``)."""
        step = int(step)
        if self._step is not None and step <= self._step:
            raise ValueError(f"DeviceSparse: step {step} after step {self._step}; steps must increase")
        N, FB = int(keys.shape[0]), int(lengths.shape[0])
        F, X, W, D = self.F, self.X, WAYS, self.dim
        if F == 0 or FB % F:
            raise ValueError(f"lengths has {FB} entries, not a multiple of the {F} features")
        B = FB // F
        if N == 0:
            raise ValueError("DeviceSparse: a step without keys")
        evict_ops = self._may_evict(N)
        bag_table, bag_mean, bag_sum, offsets = self._bag_static(B)
        ar = self._arange(N)
        kb, zb, hb, ib = self._buffers(N)
        k = self._k
        keys = keys.to(self.device)
        lengths = lengths.to(self.device)
        csum = torch.cumsum(lengths, 0, out=offsets[1:])  # int64 whatever the lengths' integer type
        bag = torch.searchsorted(csum, ar, right=True)
        tid = bag_table.index_select(0, bag)
        # dedup: by (table, key as uint64)
        kf = keys ^ _MIN
        sk1, p1 = torch.sort(kf, stable=True)
        st, p2 = torch.sort(tid.index_select(0, p1), stable=True)
        perm = p1.index_select(0, p2)
        sk = sk1.index_select(0, p2)
        kt = torch.stack([sk, st], 1, out=kb[1:])  # kb[0] matches no entry: the first is a first
        first = (kt != kb[:-1]).any(1)
        rep = torch.where(first, ar, k[0]).cummax(0).values  # sorted position of each group's first
        inv = p1.index_put_((perm,), rep)  # p1 is spent: it holds each key's row
        # index lookup
        base, cells = self._cells_of(sk, st)
        cells2 = cells.view(N, 2 * W)
        g = self.index[cells2]  # [N, 2W, 2]
        match = (g == kt.unsqueeze(1)).all(2)
        # the matching cell, or X; hb[0] = X: the fill below touches the scratch cell too
        slot = torch.amin(torch.where(match, cells2, k[X]), 1, out=hb[1:])
        q = ((slot < X).unsqueeze(1) == self._tf) & first.unsqueeze(1)  # found first, new
        foundf, new = q[:, 0], q[:, 1]
        # per-table counts and ranks (the sorted entries are grouped by table)
        torch.cumsum(q, 0, dtype=torch.int64, out=zb[1:])  # zb[i]: counts before sorted position i
        zq = zb[:-1]
        base_t = zb.index_select(0, torch.searchsorted(st, self._arT1))  # [T+1, 2]
        x1 = torch.cat([self.acc, base_t[1:], base_t[:-1], self._static_T], 1)  # float64
        l1 = x1 @ self._M1
        ce = torch.clamp(l1[:, 0:2], l1[:, 2:4], l1[:, 4:6])  # e, ins
        x2 = torch.cat([x1, l1, ce, l1[:, 4].cumsum(0).unsqueeze(1)], 1)
        torch.mm(x2, self._M2, out=self._l2)  # and the accumulators (its last columns) advance
        l2 = self._l2[:, :5].to(torch.int64)
        pu = l2[:, 0:2].index_select(0, st)  # A, P of the entry's table
        self.last_step.index_fill_(0, hb, step)  # found cells (a repeat's too: the same cell)
        if evict_ops:
            self._compact(l2[:, 2:5], step)
        ins = new & (zq[:, 1] < pu[:, 0])
        # new keys: free ways counted after the evictions (a second gather), then the rounds
        free = (self.index[:, 1][cells2] < 0).view(N, 2, W)
        tgt = self._assign(cells, free, ins)
        self.index.index_put_((tgt,), kt)
        self.last_step.index_fill_(0, tgt, step)
        torch.mul(_odd_from_base(base, D), self._scale, out=ib[:, :D])  # the initial rows (float64 product)
        self.arena.index_put_((tgt,), ib)
        for name in self._int_state:
            self.state[name].index_fill_(0, tgt, self._state_init[name])
        upd = torch.where(foundf, slot, tgt)
        if evict_ops:  # append the step's keys (sorted by key) after the table's untouched ones
            pos = torch.minimum(zq[:, 1], pu[:, 0]) + zq[:, 0] + pu[:, 1]
            self.order.index_add_(0, pos, upd - k[X])  # the order holds X there; others add 0
        ext = self.arena.index_select(0, upd)
        rows = (ext[:, :D] if self._width > D else ext).requires_grad_(True)
        psw = weights.to(self.device, torch.float32) if weights is not None else None
        if self._any_mean:
            scale = torch.addcdiv(bag_sum, bag_mean, lengths).index_select(0, bag)  # 1 / length or 1
            psw = scale if psw is None else psw * scale
        pooled = torch.nn.functional.embedding_bag(inv, rows, offsets, mode="sum", per_sample_weights=psw,
                                                 include_last_offset=True)
        self._step = step
        self._pending = _Step(step, rows, ext, upd, x2)
        return pooled.view(F, B, D).transpose(0, 1).reshape(B, F * D)

    def _compact(self, ps: torch.Tensor, step: int) -> None:
        """Drop touched and evicted entries from every table's order block (cumsum
        compaction); evicted cells leave the index. ``ps`` [T, 3]: Q (an untouched entry is
        evicted while its count of untouched entries to its block's end, c, is at most Q),
        S + off - 1 - Q and off + C - 1 - Q (its position, less c, kept or evicted). The
        scatter's target holds two halves: the
        evicted cells land at the end of their table's block in the first, the kept ones at
        its start in the second (the new order)."""
        S = self.S
        order = self.order[:S]
        p = ps.index_select(0, self._seg)
        unt = self.last_step.index_select(0, order) != step  # X was touched: empty entries too
        c = unt.cumsum(0)
        pos = torch.where(unt, c + torch.where(c > p[:, 0], p[:, 1], p[:, 2]), self._k[2 * S])
        new_order = self._order_spare
        if new_order is None:
            new_order = torch.empty((2 * S + 1,), dtype=torch.int64, device=self.device)
        new_order.fill_(self.X)
        new_order.index_put_((pos,), order)
        self.index[:, 1].index_fill_(0, new_order[:S], -1)
        # the buffer the old order lives in is the next compaction's target: two buffers taking
        # turns, not a fresh 2S + 1 each step (which the CPU device pays in page faults)
        self._order_spare, self._order_base = self._order_base, new_order
        self.order = new_order[S:]

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

    def cancel(self, step: int) -> None:
        """Withdraw the update of ``step`` (the latest ``forward``, never to be trained on:
        the trainer's look-ahead when it stops): its rows stay as the forward left them (as the
        host store's lookup leaves its keys), but they are not counted as ``updated``, which
        the forward's matmul counted ahead. Another step: nothing."""
        p = self._pending
        if p is None or p.step != int(step):
            return
        self._pending = None
        with torch.no_grad():  # the counted increment: column "updated" of L2 less its value before
            self.acc[:, 5] -= p.x2 @ self._M2[:, 10] - p.x2[:, 5]

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
            ext, g, D = p.ext, p.rows.grad, self.dim
            w = ext[:, :D]
            if self.cfg.optimizer == "rowwise_adagrad":
                cfg = self.cfg
                lr, eps, wd = (float(np.float32(v)) for v in (cfg.lr, cfg.eps, cfg.weight_decay))
                gd = g.add(w, alpha=wd) if cfg.weight_decay else g
                st = ext[:, D]
                # s += mean_d(g'^2) as one batched dot; w -= lr * g' / (sqrt(s) + eps)
                st.unsqueeze(1).unsqueeze(2).baddbmm_(gd.unsqueeze(1), gd.unsqueeze(2),
                                                      alpha=float(np.float32(1.0 / D)))
                w.addcdiv_(gd, st.sqrt().add_(eps).unsqueeze(1), value=-lr)
                ints = {}
            else:
                ints = {name: self.state[name].index_select(0, p.upd) for name in self._int_state}
                st = {name: (ext[:, o:o + D] if per_dim else ext[:, o]) for name, (o, per_dim) in self._views.items()}
                apply_update_torch(self.cfg, w, {**st, **ints}, g)
            self.arena.index_put_((p.upd,), ext)
            for name, t in ints.items():
                self.state[name].index_put_((p.upd,), t)

    # ------------------------------------------------------------------ reads

    def counters(self) -> dict[str, dict[str, int]]:
        """Return each table's counters (hits, misses, inserts, evictions, rows, updated,
        rows_in, rows_out): one device-to-host read. Raises the errors the device counted."""
        failed = (self.last_step[WAYS:self.X:_STRIDE] != _MIN).sum().view(1)
        flat = torch.cat([self.acc.flatten(), failed]).cpu().numpy()
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
        if int(flat[-1]):
            raise RuntimeError(f"DeviceSparse: new keys found no free way in their two buckets ({int(flat[-1])} "
                               "buckets); the device index is corrupt (an internal error)")
        return out

    def _lookup(self, table: str, keys: np.ndarray) -> torch.Tensor:
        """Return the cell of each key of ``table`` (-1: absent)."""
        t = self.names.index(table)
        k = _tensor(keys, self.device) ^ _MIN
        tid = torch.full_like(k, t)
        _, cells = self._cells_of(k, tid)
        cells = cells.view(-1, 2 * WAYS)
        match = (self.index[cells] == torch.stack([k, tid], 1).unsqueeze(1)).all(2)
        return torch.where(match, cells, -1).amax(1)

    def peek_rows(self, table: str, keys: np.ndarray) -> np.ndarray:
        """Return float32 [len(keys), D] rows of ``table`` (zeros where absent); changes nothing."""
        return self.peek_found(table, keys)[0]

    def peek_found(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Return ``peek_rows`` and ``held`` of ``keys`` from one look-up; changes nothing."""
        keys = _as_keys(keys)
        if keys.shape[0] == 0:
            return np.zeros((0, self.dim), dtype=np.float32), np.zeros(0, dtype=bool)
        cells = self._lookup(table, keys)
        found = cells >= 0
        rows = self.w.index_select(0, cells.clamp(min=0)) * found.unsqueeze(1)
        return rows.cpu().numpy(), found.cpu().numpy()

    def held(self, table: str, keys: np.ndarray) -> np.ndarray:
        """Return bool [len(keys)]: whether each key of ``table`` has a row; changes nothing."""
        keys = _as_keys(keys)
        if keys.shape[0] == 0:
            return np.zeros(0, dtype=bool)
        return (self._lookup(table, keys) >= 0).cpu().numpy()

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
        cells = np.flatnonzero((idx[:, 1] >= 0) & (np.arange(self.X) % _STRIDE != WAYS))  # not the dead cells
        return cells, idx[cells, 1], idx[cells, 0] ^ np.int64(_MIN)

    def state_dict(self, tables: list[str] | None = None) -> dict[str, pa.Table]:
        """Return each table's rows (or ``tables``') as ``EmbeddingTable.state_dict()`` does
        (its schema, sorted by key as int64)."""
        cells, tabs, keys = self._held()
        out = {}
        for t, name in enumerate(self.names):
            if tables is not None and name not in tables:
                continue
            sel = np.flatnonzero(tabs == t)
            order = sel[np.argsort(keys[sel])]
            out[name] = self._rows(torch.as_tensor(cells[order], device=self.device), keys[order], self.schemas[name])
        return out

    # ------------------------------------------------------------------ rows in and out

    def pop_rows(self, table: str, keys: np.ndarray) -> pa.Table:
        """Remove the rows of ``keys`` from ``table`` and return them (absent keys skipped),
        as ``EmbeddingTable.pop_rows``."""
        keys = _as_keys(keys)
        _, first = np.unique(keys, return_index=True)
        keys = keys[np.sort(first)]  # a repeated key once (its first place), as the host's
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
        keys, last, emb, states = self.check_rows(t, rows)
        # present keys: replaced in place
        cells = self._lookup(name, keys).cpu().numpy() if keys.shape[0] else np.zeros(0, dtype=np.int64)
        self._insert_checked(t, keys, last, emb, states, cells)

    def check_rows(self, t: int, rows: pa.Table, capacity: int | None = None):
        """Return table ``t``'s rows to load as (keys, last_seen, embeddings, states) after
        checking them (columns, types, no repeated key, at most ``capacity`` rows: the
        table's); raise naming what is wrong before anything changes."""
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
        cap = self.caps[t] if capacity is None else capacity
        if keys.shape[0] > cap:
            raise ValueError(f"{where}: {keys.shape[0]} rows exceed the capacity {cap}")
        last = int64_column(rows, "last_seen", where)
        emb = matrix_column(rows, "embedding", self.dim, where, (np.float32, np.float16)).astype(np.float32)
        states = {c.name: (matrix_column(rows, c.name, self.dim, where, (c.dtype,)) if c.per_dim
                           else vector_column(rows, c.name, where, c.dtype)) for c in self._columns}
        return keys, last, emb, states

    def _insert_checked(self, t: int, keys, last, emb, states, cells) -> None:
        dev = self.device
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
            cells[~present] = self._place(kf, tid).cpu().numpy()
            self.acc[t, 4] += n_new
        c = torch.as_tensor(cells, device=dev)
        self.w.index_put_((c,), _tensor(emb, dev))
        for col in self._columns:
            self.state[col.name].index_put_((c,), _tensor(states[col.name], dev))
        self.last_step.index_put_((c,), _tensor(last, dev))
        self._host["rows_in"][t] += keys.shape[0]

    def _place(self, kf: torch.Tensor, tid: torch.Tensor) -> torch.Tensor:
        """Give distinct absent keys cells and write them into the index (the step's rounds,
        ``NB`` keys at a time, so each group sees the ways the earlier ones took); return the
        cells; raise when a key finds no free way."""
        n, W = kf.shape[0], WAYS
        out = []
        for s in range(0, n, self.NB):
            k, t = kf[s:s + self.NB], tid[s:s + self.NB]
            m = k.shape[0]
            base, cells = self._cells_of(k, t)
            free = (self.index[:, 1][cells.view(m, 2 * W)] < 0).view(m, 2, W)
            tgt = self._assign(cells, free, torch.ones(m, dtype=torch.bool, device=self.device))
            if bool((tgt % _STRIDE == W).any()):
                raise RuntimeError("DeviceSparse: keys found no free way in their two buckets (an internal error)")
            self.index.index_put_((tgt,), torch.stack([k, t], 1))
            out.append(tgt)
        return torch.cat(out)

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
        if self._order_base is not None:  # the old order's buffer is free now
            self._order_spare, self._order_base = self._order_base, None
        self._order_valid = True

    # ------------------------------------------------------------------ the device cache's calls
    # (``recsys.store.device.cached.DeviceCachedSparse``: this index as the exact-LRU cache of
    # host tables; none of these reads the device)

    def cells_held(self, keys: torch.Tensor, tid: torch.Tensor) -> torch.Tensor:
        """Return the cell of each key (int64 device tensors: keys, tables) (-1: absent)."""
        k = keys ^ _MIN
        _, cells = self._cells_of(k, tid)
        cells = cells.view(-1, 2 * WAYS)
        match = (self.index[cells] == torch.stack([k, tid], 1).unsqueeze(1)).all(2)
        return torch.where(match, cells, -1).amax(1)

    def touch_cells(self, cells: torch.Tensor, step: int) -> None:
        """Set the last step of ``cells`` (held, or -1: skipped) to ``step``, as the forward
        of ``step`` will: the step's keys are then what ``demote`` leaves."""
        self.last_step.index_fill_(0, torch.where(cells >= 0, cells, self._k[self.X]), int(step))

    def demote(self, counts: list[int], step: int) -> tuple[torch.Tensor, ...]:
        """Take out of each table ``t`` its ``counts[t]`` least recent held keys by (last step,
        key as uint64) not touched at ``step`` (``touch_cells``): the first such entries of its
        order block (the order must be valid and hold that many). Return their (table ids,
        keys, arena rows [.., D + float state], {int state: values}, last steps) as device
        tensors, table by table, oldest first; their rows are copied before the cells are
        freed."""
        S, X, dev = self.S, self.X, self.device
        total = int(sum(counts))
        order = self.order[:S]
        valid = (order != X) & (self.last_step.index_select(0, order) != int(step))
        csum = valid.cumsum(0)
        starts = torch.tensor(self.offs[:-1], dtype=torch.int64, device=dev)
        before = torch.where(starts > 0, csum.index_select(0, (starts - 1).clamp(min=0)), self._k[0])
        rank = csum - before.index_select(0, self._seg)  # 1.. among the block's valid entries
        cnt = torch.tensor(counts, dtype=torch.int64, device=dev)
        out_off = torch.tensor(np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64), device=dev)
        sel = valid & (rank <= cnt.index_select(0, self._seg))
        pos = torch.where(sel, out_off.index_select(0, self._seg) + rank - 1, torch.tensor(total, device=dev))
        cells = torch.full((total + 1,), X, dtype=torch.int64, device=dev)
        cells.index_put_((pos,), order)
        cells = cells[:total]
        tabs = self.index[:, 1].index_select(0, cells)
        keys = self.index[:, 0].index_select(0, cells) ^ _MIN
        rows = self.arena.index_select(0, cells)
        ints = {name: self.state[name].index_select(0, cells) for name in self._int_state}
        last = self.last_step.index_select(0, cells)
        self.order.index_put_((torch.where(sel, self._arange(S), self._k[S]),), self._k[X])
        self.index[:, 1].index_fill_(0, cells, -1)
        self.acc[:, 4] -= cnt.to(self.acc.dtype)
        return tabs, keys, rows, ints, last

    def admit_rows(self, tid: torch.Tensor, keys: torch.Tensor, emb: torch.Tensor, states: dict[str, torch.Tensor],
                   last: torch.Tensor) -> None:
        """Give distinct keys absent from the index (tables ``tid``) cells and write their rows,
        optimizer state and last steps (device tensors, the arena's dtypes); their tables must
        have room (no eviction). Not put in the order: the forward of the step touches them (it appends its
        keys). A key that finds no free way goes to its bucket's dead cell, which
        ``counters()`` reports (the forward's check, without a read here)."""
        n, W, dev = int(keys.shape[0]), WAYS, self.device
        if n == 0:
            return
        kf = keys ^ _MIN
        parts = []
        for s in range(0, n, self.NB):  # the groups of ``_place``: each sees the ways the earlier took
            k, t = kf[s:s + self.NB], tid[s:s + self.NB]
            m = k.shape[0]
            _, cells = self._cells_of(k, t)
            free = (self.index[:, 1][cells.view(m, 2 * W)] < 0).view(m, 2, W)
            tgt = self._assign(cells, free, torch.ones(m, dtype=torch.bool, device=dev))
            self.index.index_put_((tgt,), torch.stack([k, t], 1))
            parts.append(tgt)
        c = torch.cat(parts) if len(parts) > 1 else parts[0]
        self.w.index_put_((c,), emb)
        for name, v in states.items():
            self.state[name].index_put_((c,), v)
        self.last_step.index_put_((c,), last)  # a dead cell's step: != _MIN, counted
        self.acc[:, 4].index_add_(0, tid, torch.ones(n, dtype=self.acc.dtype, device=dev))


def _plus(*cols: dict) -> dict:
    """The sum of matrix columns given as {row: coefficient}."""
    out: dict = {}
    for col in cols:
        for i, v in col.items():
            out[i] = out.get(i, 0) + v
    return out


def _tensor(a: np.ndarray, device) -> torch.Tensor:
    """Return a device copy of the host array ``a`` (which may be read-only, as Arrow's are)."""
    return torch.from_numpy(np.array(a, copy=True)).to(device)


def _as_keys(keys) -> np.ndarray:
    keys = np.ascontiguousarray(keys)
    if keys.dtype == np.uint64:
        return keys.view(np.int64)
    return keys.astype(np.int64, copy=False)
