"""EmbeddingTable against a plain-dict reference model; init, admission, Arrow state, fp16.

Legend: ``U`` keys of a call, ``D`` dim.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from recsys.features import hashing
from recsys.features.schema import TableSpec
from recsys.store.tables import optim
from recsys.store.config import HostConfig, StoreConfig
from recsys.store.tables.float16 import to_float16, to_float32
from recsys.store.tables.table import COUNTERS, CapacityError, EmbeddingTable, init_vectors

MASK = (1 << 64) - 1
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
UNIVERSE = [0, -1, 1, 2, 5, I64_MAX, I64_MIN, 0x5555555555555555, -12345, 1 << 33]
D = 3


# --------------------------------------------------------------------------- reference model


def ref_update(cfg: StoreConfig, w32: np.ndarray, state: dict, g32: np.ndarray):
    """The documented update of one row as plain numpy float32 (per-row scalars via float64)."""
    f32 = np.float32
    g = g32 + f32(cfg.weight_decay) * w32
    lr, eps = f32(cfg.lr), f32(cfg.eps)
    state = dict(state)
    if cfg.optimizer == "rowwise_adagrad":
        acc = f32(0)
        for x in g:  # sequential, as the kernel sums
            acc = f32(acc + x * x)
        s = f32(state["rowwise_state"] + acc * f32(1.0 / len(g)))
        state["rowwise_state"] = s
        w = w32 - (lr / (np.sqrt(s) + eps)) * g
    elif cfg.optimizer == "adagrad":
        s = state["state_sum"] + g * g
        state["state_sum"] = s
        w = w32 - lr * (g / (np.sqrt(s) + eps))
    elif cfg.optimizer == "adam":
        t = int(state["adam_step"]) + 1
        m = f32(cfg.beta1) * state["exp_avg"] + f32(1 - cfg.beta1) * g
        v = f32(cfg.beta2) * state["exp_avg_sq"] + f32(1 - cfg.beta2) * g * g
        state.update(adam_step=np.int64(t), exp_avg=m, exp_avg_sq=v)
        step_size = f32(cfg.lr / (1 - cfg.beta1**t))
        w = w32 - step_size * (m / (np.sqrt(v) / f32(math.sqrt(1 - cfg.beta2**t)) + eps))
    else:
        w = w32 - lr * g
    return w.astype(np.float32), state


class RefTable:
    """dict key -> [embedding float32 (float16-rounded when stored so), state, last_seen]."""

    def __init__(self, name: str, capacity: int, cfg: StoreConfig):
        self.name, self.capacity, self.cfg = name, capacity, cfg
        self.rows: dict[int, list] = {}
        self.seen: dict[int, int] = {}  # sightings of keys without a row (exact counts)
        self.clock: int | None = None
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.cols = optim.state_columns(cfg.optimizer)

    def _store(self, w32):
        return w32.astype(np.float16).astype(np.float32) if self.cfg.dtype == "float16" else w32

    def _new_state(self):
        out = {}
        for c in self.cols:
            init = optim.initial_state_value(self.cfg, c)
            out[c.name] = np.full(D, init, dtype=c.dtype) if c.per_dim else c.dtype(init)
        return out

    def _make_room(self, n_new: int, protected: set[int]) -> list[int]:
        need = n_new - (self.capacity - len(self.rows))
        if need <= 0:
            return []
        order = sorted((r[2], k & MASK, k) for k, r in self.rows.items() if k not in protected)
        victims = [k for _, _, k in order[:need]]
        self.counters["evictions"] += len(victims)
        return victims

    def lookup(self, keys: list[int], step: int):
        if self.clock is not None and step < self.clock:
            raise ValueError("step went back")
        present = [k for k in keys if k in self.rows]
        missing = [k for k in keys if k not in self.rows]
        admit = [k for k in missing if self.seen.get(k, 0) + 1 >= self.cfg.min_count]
        if len(present) + len(admit) > self.capacity:
            raise ValueError("overflow")
        for k in missing:
            self.seen[k] = min(self.seen.get(k, 0) + 1, self.cfg.min_count)
        victims = self._make_room(len(admit), set(present) | set(admit))
        evicted = {k: self.rows.pop(k) for k in victims}
        bound = self.cfg.init_bound(D)
        for k in admit:
            vec = init_vectors(np.array([k], dtype=np.int64), D, self.name, self.cfg.seed, bound)[0]
            self.rows[k] = [self._store(vec), self._new_state(), step]
        for k in present:
            self.rows[k][2] = step
        self.clock = step
        c = self.counters
        c["hits"] += len(present)
        c["misses"] += len(missing)
        c["admitted"] += len(admit)
        c["inserts"] += len(admit)
        c["rejected"] += len(missing) - len(admit)
        out = np.zeros((len(keys), D), dtype=np.float32)
        for i, k in enumerate(keys):
            if k in self.rows:
                out[i] = self.rows[k][0]
        return out, evicted

    def apply(self, keys: list[int], grads: np.ndarray):
        for k, g in zip(keys, grads):
            if k not in self.rows:
                self.counters["ignored"] += 1
                continue
            self.counters["updated"] += 1
            row = self.rows[k]
            w, row[1] = ref_update(self.cfg, row[0], row[1], g)
            row[0] = self._store(w)

    def pop(self, keys: list[int]):
        out = {}
        for k in keys:
            if k in self.rows and k not in out:
                out[k] = self.rows.pop(k)
        self.counters["rows_out"] += len(out)
        return out

    def insert(self, rows: dict[int, list]):
        new = [k for k in rows if k not in self.rows]
        victims = self._make_room(len(new), set(rows))
        evicted = {k: self.rows.pop(k) for k in victims}
        for k, r in rows.items():
            self.rows[k] = [self._store(r[0].copy()), dict(r[1]), r[2]]
        self.counters["rows_in"] += len(rows)
        return evicted


def as_dict(rows: pa.Table, optimizer: str) -> dict[int, list]:
    """Return {key: [embedding float32, state, last_seen]} of an Arrow rows table."""
    keys = rows.column("key").to_numpy()
    emb = rows.column("embedding").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    dim = rows.schema.field("embedding").type.list_size
    emb = emb.reshape(len(keys), dim).astype(np.float32)
    states = {}
    for c in optim.state_columns(optimizer):
        col = rows.column(c.name).combine_chunks()
        states[c.name] = col.flatten().to_numpy().reshape(len(keys), dim) if c.per_dim else col.to_numpy()
    last = rows.column("last_seen").to_numpy()
    return {
        int(k): [emb[i], {n: v[i] for n, v in states.items()}, int(last[i])] for i, k in enumerate(keys)
    }


def assert_rows_equal(got: dict, want: dict, exact: bool = False):
    assert sorted(got) == sorted(want)
    for k in want:
        g, w = got[k], want[k]
        assert g[2] == w[2], f"last_seen of {k}"
        if exact:
            assert g[0].tobytes() == w[0].tobytes()
        else:
            np.testing.assert_allclose(g[0], w[0], rtol=0, atol=0, err_msg=f"embedding of {k}")
        for name in w[1]:
            np.testing.assert_allclose(g[1][name], w[1][name], rtol=0, atol=0, err_msg=f"{name} of {k}")


# --------------------------------------------------------------------------- property test

key_lists = st.lists(st.sampled_from(UNIVERSE), unique=True, max_size=6)
small_key_lists = st.lists(st.sampled_from(UNIVERSE), unique=True, max_size=3)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("lookup"), key_lists, st.integers(0, 2)),
        st.tuples(st.just("lookup"), small_key_lists, st.integers(0, 2)),
        st.tuples(st.just("lookup"), small_key_lists, st.integers(0, 2)),
        st.tuples(st.just("apply"), key_lists, st.integers(0, 1)),
        st.tuples(st.just("apply"), key_lists, st.integers(0, 1)),
        st.tuples(st.just("pop"), key_lists, st.just(0)),
        st.tuples(st.just("insert"), st.just([]), st.integers(0, 20)),
        st.tuples(st.just("reload"), st.just([]), st.just(0)),
    ),
    max_size=30,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    capacity=st.integers(1, 5),
    optimizer=st.sampled_from(["rowwise_adagrad", "adagrad", "adam", "sgd"]),
    dtype=st.sampled_from(["float32", "float16"]),
    min_count=st.sampled_from([1, 1, 2, 3]),
    weight_decay=st.sampled_from([0.0, 0.1]),
    ops=ops,
    seed=st.integers(0, 3),
)
def test_table_matches_reference(capacity, optimizer, dtype, min_count, weight_decay, ops, seed):
    cfg = StoreConfig(optimizer=optimizer, dtype=dtype, min_count=min_count, weight_decay=weight_decay,
                      lr=0.1, initial_accumulator=0.01, seed=seed)
    spec = TableSpec(dim=D, capacity=capacity)
    evicted_rows: list[pa.Table] = []
    table = EmbeddingTable("t", spec, cfg, on_evict=evicted_rows.append)
    ref = RefTable("t", capacity, cfg)
    stash: list[pa.Table] = []  # rows taken out (popped or evicted), to put back later
    rng = np.random.default_rng(seed)
    step = 0
    for op, keys, arg in ops:
        arr = np.array(keys, dtype=np.int64)
        if op == "lookup":
            step += arg
            before = dict(ref.rows)
            try:
                want, want_evicted = ref.lookup(keys, step)
            except ValueError:
                event("lookup overflow")
                with pytest.raises(ValueError):
                    table.lookup(arr, step)
                step = ref.clock if ref.clock is not None else step
                continue
            if want_evicted:
                event("lookup evicts")
            if ref.counters["rejected"]:
                event("a key was rejected by admission")
            got = table.lookup(arr, step)
            assert got.dtype == np.float32 and got.shape == (len(keys), D)
            np.testing.assert_array_equal(got, want)
            got_evicted = {}
            for t in evicted_rows:
                got_evicted.update(as_dict(t, optimizer))
            assert_rows_equal(got_evicted, {k: [*before[k][:2], before[k][2]] for k in want_evicted}, exact=True)
            stash.extend(evicted_rows)
            evicted_rows.clear()
        elif op == "apply":
            if ref.clock is None:
                with pytest.raises(ValueError, match="before its lookup"):
                    table.apply_gradients(arr, np.zeros((len(keys), D), np.float32), 0)
                continue
            grads = rng.normal(size=(len(keys), D)).astype(np.float32)
            ref.apply(keys, grads)
            table.apply_gradients(arr, grads, ref.clock - arg)
        elif op == "pop":
            want = ref.pop(keys)
            got = table.pop_rows(arr)
            assert_rows_equal(as_dict(got, optimizer), want, exact=True)
            stash.append(got)
        elif op == "insert":
            if not stash:
                continue
            rows = stash[arg % len(stash)]
            want_evicted = ref.insert(as_dict(rows, optimizer))
            table.insert_rows(rows)
            got_evicted = {}
            for t in evicted_rows:
                got_evicted.update(as_dict(t, optimizer))
            assert sorted(got_evicted) == sorted(want_evicted)
            if want_evicted:
                event("insert evicts")
            stash.extend(evicted_rows)
            evicted_rows.clear()
        else:  # save, load into a fresh table, save again: identical content
            saved = table.state_dict()
            fresh = EmbeddingTable("t", spec, cfg, on_evict=evicted_rows.append)
            fresh.load_state_dict(saved)
            fresh.load_admission_state(table.admission_state())
            assert ipc_bytes(fresh.state_dict()) == ipc_bytes(saved)
            table = fresh
            ref.clock = None  # the step clock is the process's, not the checkpoint's
            ref.counters = dict.fromkeys(COUNTERS, 0)
            ref.counters["rows_in"] = saved.num_rows
        assert_rows_equal(as_dict(table.state_dict(), optimizer), ref.rows)
        assert table.counters() == {**ref.counters, "rows": len(ref.rows)}


# --------------------------------------------------------------------------- initial vectors


def init_reference(key: int, dim: int, table: str, seed: int, bound: float) -> list[float]:
    """The documented initial vector, in Python ints and floats."""
    salt = hashing.table_salt(table) ^ hashing.fmix64((seed & MASK) ^ 0xD6E8FEB86659FD93)
    base = hashing.fmix64((key & MASK) ^ salt)
    out = []
    for d in range(dim):
        h = hashing.fmix64((base + (d + 1) * 0x9E3779B97F4A7C15) & MASK)
        out.append(float(np.float32(bound * ((2.0 * (h >> 40) + 1.0) / 2**24 - 1.0))))
    return out


def test_init_vector_follows_the_documented_formula():
    keys = [0, -1, 42, I64_MAX, I64_MIN]
    got = init_vectors(np.array(keys, dtype=np.int64), 5, "item", 7, 0.25)
    for i, k in enumerate(keys):
        assert got[i].tolist() == init_reference(k, 5, "item", 7, 0.25)


def test_init_vector_depends_only_on_seed_table_and_key():
    cfg = StoreConfig(seed=3)
    keys = np.array([11, -5, 0, 99, 1 << 50, 7], dtype=np.int64)
    a = EmbeddingTable("user", TableSpec(dim=8, capacity=100), cfg)
    ra = a.lookup(keys, 0)
    b = EmbeddingTable("user", TableSpec(dim=8, capacity=6), cfg)  # other capacity and order
    rb = np.concatenate([b.lookup(keys[::-1][:3], 0), b.lookup(keys[::-1][3:], 1)])[::-1]
    np.testing.assert_array_equal(ra, rb)
    # other table name, other seed: other vectors
    c = EmbeddingTable("item", TableSpec(dim=8, capacity=100), cfg).lookup(keys, 0)
    d = EmbeddingTable("user", TableSpec(dim=8, capacity=100), StoreConfig(seed=4)).lookup(keys, 0)
    assert not np.isclose(ra, c).any() and not np.isclose(ra, d).any()
    # different keys, different vectors
    assert len({r.tobytes() for r in ra}) == len(keys)


def test_init_vectors_are_uniform_in_bound():
    dim, n = 16, 20_000
    bound = 1 / math.sqrt(dim)
    assert StoreConfig().init_bound(dim) == bound and StoreConfig(init_scale=0.5).init_bound(dim) == 0.5
    v = init_vectors(np.arange(n, dtype=np.int64), dim, "x", 0, bound).reshape(-1)
    assert v.min() > -bound and v.max() < bound
    assert abs(v.mean()) < 0.01 * bound
    assert abs(v.var() - bound**2 / 3) < 0.02 * bound**2 / 3
    hist, _ = np.histogram(v, bins=10, range=(-bound, bound))
    assert np.all(np.abs(hist / v.size - 0.1) < 0.005)  # flat to 5 % per decile
    # columns of one row are not correlated with each other
    rows = v.reshape(n, dim)
    corr = np.corrcoef(rows[:, 0], rows[:, 1])[0, 1]
    assert abs(corr) < 0.03


# --------------------------------------------------------------------------- admission


def test_admission_after_min_count_sightings():
    cfg = StoreConfig(min_count=3, lr=0.5, optimizer="sgd")
    t = EmbeddingTable("t", TableSpec(dim=4, capacity=10), cfg)
    k = np.array([77, 88], dtype=np.int64)
    for step in (0, 1):
        assert (t.lookup(k[:1], step) == 0).all()  # not admitted: the shared zero vector
        t.apply_gradients(k[:1], np.ones((1, 4), np.float32), step)  # ignored
        assert len(t) == 0
    assert (t.peek(k[:1]) == 0).all()
    rows = t.lookup(k, 2)  # third sighting of 77 admits it; 88 is seen once
    np.testing.assert_array_equal(rows[0], init_vectors(k[:1], 4, "t", 0, cfg.init_bound(4))[0])
    assert (rows[1] == 0).all()
    t.apply_gradients(k, np.ones((2, 4), np.float32), 2)
    np.testing.assert_allclose(t.peek(k[:1])[0], rows[0] - 0.5, rtol=1e-6)
    c = t.counters()
    assert c == {**c, "hits": 0, "misses": 4, "admitted": 1, "rejected": 3, "inserts": 1,
                 "updated": 1, "ignored": 3, "rows": 1, "evictions": 0}
    assert t.lookup(k[:1], 3).tolist() == t.peek(k[:1]).tolist() and t.counters()["hits"] == 1
    # the sketch travels with admission_state
    other = EmbeddingTable("t", TableSpec(dim=4, capacity=10), cfg)
    other.load_admission_state(t.admission_state())
    assert (other.lookup(k[1:], 0) == 0).all()  # 88: second sighting
    assert (other.lookup(k[1:], 1) != 0).all()  # third: admitted
    with pytest.raises(ValueError, match="admission state missing"):
        other.load_admission_state(None)
    with pytest.raises(ValueError, match="admission state given"):
        EmbeddingTable("t", TableSpec(dim=4, capacity=10), StoreConfig()).load_admission_state(t.admission_state())


def test_overflow_with_admission_changes_nothing():
    cfg = StoreConfig(min_count=2)
    t = EmbeddingTable("t", TableSpec(dim=2, capacity=2), cfg)
    keys = np.array([1, 2, 3], dtype=np.int64)
    t.lookup(keys, 0)  # counted once each, none admitted
    sketch, counters = t.admission_state(), t.counters()
    with pytest.raises(CapacityError, match="table .t.: the batch of step 1 has 3 distinct ids, more than the 2 rows"):
        t.lookup(keys, 1)  # all three would be admitted: more than capacity
    assert (t.admission_state()["cells"] == sketch["cells"]).all() and t.counters() == counters
    assert t.lookup(keys[:2], 1).any(axis=1).all()  # second sighting: admitted now
    assert t.lookup(keys[2:], 2).any()  # second sighting of 3: admitted, evicting key 1 (LRU tie, smaller)
    assert t.peek(keys[:1]).tolist() == [[0.0, 0.0]] and t.counters()["evictions"] == 1


# --------------------------------------------------------------------------- rows in and out


def ipc_bytes(rows: pa.Table) -> bytes:
    """Return the Arrow IPC stream of ``rows``: equal bytes, equal content (NaNs included)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, rows.schema) as writer:
        writer.write_table(rows.combine_chunks())
    return sink.getvalue().to_pybytes()


def _trained_table(optimizer="adam", dtype="float32", capacity=64, n=40, on_evict=None):
    cfg = StoreConfig(optimizer=optimizer, dtype=dtype, lr=0.05, weight_decay=0.01)
    t = EmbeddingTable("t", TableSpec(dim=6, capacity=capacity), cfg, on_evict=on_evict)
    rng = np.random.default_rng(0)
    for step in range(5):
        keys = np.unique(rng.integers(-n, n, size=n // 2)).astype(np.int64)
        t.lookup(keys, step)
        t.apply_gradients(keys, rng.normal(size=(len(keys), 6)).astype(np.float32), step)
    return t


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adagrad", "adam", "sgd"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_save_load_save_is_identical(optimizer, dtype):
    t = _trained_table(optimizer, dtype)
    saved = t.state_dict()
    emb_type = pa.float32() if dtype == "float32" else pa.float16()
    assert saved.schema.field("embedding").type == pa.list_(emb_type, 6)
    assert saved.column_names == ["key", "embedding", *[c.name for c in optim.state_columns(optimizer)], "last_seen"]
    assert saved.column("key").to_numpy().tolist() == sorted(saved.column("key").to_numpy().tolist())
    fresh = EmbeddingTable("t", t.spec, t.cfg)
    fresh.load_state_dict(saved)
    again = fresh.state_dict()
    assert again.equals(saved)
    assert ipc_bytes(again) == ipc_bytes(saved)
    # the restored table evolves exactly like the original
    keys = np.array([1, 2, 3, 1000], dtype=np.int64)
    g = np.full((4, 6), 0.3, np.float32)
    for table in (t, fresh):
        table.lookup(keys, 9)
        table.apply_gradients(keys, g, 9)
    assert t.state_dict().equals(fresh.state_dict())


def test_resharding_round_trip_by_owner():
    t = _trained_table()
    saved = t.state_dict()
    shards = []
    for rank in range(3):  # save at world size 1, load at 3, each shard keeps what it owns
        mine = hashing.owner_of(saved.column("key").to_numpy(), 3) == rank
        shard = EmbeddingTable("t", t.spec, t.cfg)
        shard.load_state_dict(saved.filter(pa.array(mine)))
        shards.append(shard)
    assert sum(len(s) for s in shards) == len(t)
    back = EmbeddingTable("t", t.spec, t.cfg)  # and back to one, from chunked, unsorted input
    back.load_state_dict(pa.concat_tables([s.state_dict() for s in reversed(shards)]))
    assert back.state_dict().equals(saved)


def test_load_merges_and_replaces():
    t = _trained_table("rowwise_adagrad")
    saved = t.state_dict()
    other = EmbeddingTable("t", t.spec, t.cfg)
    other.lookup(np.array([10_000, int(saved.column("key")[0].as_py())], dtype=np.int64), 0)
    other.load_state_dict(saved.slice(0, 5))  # sliced input: offsets must be honoured
    other.load_state_dict(saved.slice(5))
    got = other.state_dict()
    assert got.num_rows == saved.num_rows + 1
    assert got.filter(pa.compute.not_equal(got.column("key"), 10_000)).equals(saved)


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
def test_pop_and_insert_are_bit_identical(optimizer):
    t = _trained_table(optimizer)
    before = t.state_dict()
    keys = before.column("key").to_numpy()[::3]
    out = t.pop_rows(np.concatenate([keys, keys[:2], [123456789]]))  # repeats and an absent key
    assert out.column("key").to_numpy().tolist() == keys.tolist()
    assert len(t) == before.num_rows - len(keys)
    assert (t.peek(keys) == 0).all()
    t.apply_gradients(keys, np.ones((len(keys), 6), np.float32), 4)  # ignored: rows are out
    t.insert_rows(out)
    assert t.state_dict().equals(before)


def test_evicted_rows_come_back_bit_identical():
    spilled: list[pa.Table] = []
    t = _trained_table("adagrad", capacity=64, on_evict=spilled.append)
    full = t.state_dict()
    small = EmbeddingTable("t", TableSpec(dim=6, capacity=10), t.cfg, on_evict=spilled.append)
    spilled.clear()
    small.load_state_dict(full.slice(0, 10))
    new_keys = np.array([10**6, 10**6 + 1, 10**6 + 2], dtype=np.int64)
    small.lookup(new_keys, 20)
    assert small.counters()["evictions"] == 3
    out = pa.concat_tables(spilled)
    steps = full.slice(0, 10).column("last_seen").to_numpy()
    keys = full.slice(0, 10).column("key").to_numpy()
    order = sorted(range(10), key=lambda i: (steps[i], int(keys[i]) & MASK))[:3]  # the LRU policy
    assert sorted(out.column("key").to_numpy().tolist()) == sorted(keys[order].tolist())
    want = full.filter(pa.array(np.isin(full.column("key").to_numpy(), out.column("key").to_numpy())))
    assert out.sort_by("key").equals(want)
    # put back after popping the new keys: the table is as it was
    small.pop_rows(new_keys)
    small.insert_rows(out)
    assert small.state_dict().equals(full.slice(0, 10))


def test_peek_changes_nothing():
    t = _trained_table()
    before, counters = t.state_dict(), t.counters()
    keys = np.array([1, 2, 10**9], dtype=np.int64)
    rows = t.peek(keys)
    assert (rows[2] == 0).all()
    assert t.state_dict().equals(before) and t.counters() == counters


def test_fp16_storage_round_trip():
    cfg = StoreConfig(dtype="float16", optimizer="sgd", lr=0.1)
    t = EmbeddingTable("t", TableSpec(dim=8, capacity=100), cfg)
    keys = np.arange(50, dtype=np.int64)
    rows = t.lookup(keys, 0)
    assert rows.dtype == np.float32
    init32 = init_vectors(keys, 8, "t", 0, cfg.init_bound(8))
    np.testing.assert_array_equal(rows, init32.astype(np.float16).astype(np.float32))
    g = np.full((50, 8), 0.25, np.float32)
    t.apply_gradients(keys, g, 0)
    np.testing.assert_array_equal(t.peek(keys), (rows - np.float32(0.025)).astype(np.float16).astype(np.float32))
    saved = t.state_dict()
    assert saved.schema.field("embedding").type == pa.list_(pa.float16(), 8)
    back = EmbeddingTable("t", t.spec, cfg)
    back.load_state_dict(saved)
    assert back.state_dict().equals(saved)
    # float16 rows load into a float32 table exactly, and back (float16 values are float32 values)
    wide = EmbeddingTable("t", t.spec, StoreConfig(optimizer="sgd"))
    wide.load_state_dict(saved)
    np.testing.assert_array_equal(wide.peek(keys), t.peek(keys))
    narrow = EmbeddingTable("t", t.spec, cfg)
    narrow.load_state_dict(wide.state_dict())
    assert narrow.state_dict().equals(saved)


def test_float16_conversions_match_numpy():
    every_half = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).reshape(-1, 1)
    wide = to_float32(every_half)
    want = every_half.astype(np.float32)
    nan = np.isnan(want)
    assert (wide.view(np.uint32)[~nan] == want.view(np.uint32)[~nan]).all()
    assert np.isnan(wide[nan]).all()
    # float32 -> float16: every rounding boundary (each half, +-1 ulp around each midpoint)
    # and random bit patterns, both signs
    mids = (want[~nan & np.isfinite(want)].astype(np.float64)).reshape(-1)
    mids = np.unique(mids)
    between = ((mids[:-1] + mids[1:]) / 2).astype(np.float32).view(np.uint32)
    rng = np.random.default_rng(0)
    bits = np.concatenate([
        between, between - 1, between + 1, mids.astype(np.float32).view(np.uint32),
        rng.integers(0, 1 << 32, size=500_000, dtype=np.uint64).astype(np.uint32),
        np.array([0x477FEFFF, 0x477FF000, 0x477FF001, 0x33000000, 0x33000001, 0x32FFFFFF, 0x7F800000,
                  0x387FFFFF, 0x38800000, 0x7FC00000, 0x7F800001], dtype=np.uint32),
    ])
    bits = np.concatenate([bits, bits | np.uint32(0x80000000)])
    values = bits.view(np.float32).reshape(-1, 1)
    with np.errstate(over="ignore"):
        want = values.astype(np.float16)
    got = to_float16(values)
    nan = np.isnan(want)
    assert (got.view(np.uint16)[~nan] == want.view(np.uint16)[~nan]).all()
    assert np.isnan(got[nan]).all()


# --------------------------------------------------------------------------- errors


def test_errors_name_what_was_expected():
    t = _trained_table("rowwise_adagrad")
    saved = t.state_dict()
    adam = EmbeddingTable("t", t.spec, StoreConfig(optimizer="adam"))
    with pytest.raises(ValueError, match=r"columns .* do not match this table's \(adam, dim 6\)"):
        adam.load_state_dict(saved)
    with pytest.raises(ValueError, match="repeats keys"):
        t.load_state_dict(pa.concat_tables([saved.slice(0, 2), saved.slice(0, 1)]))
    nulls = saved.set_column(0, "key", pa.array([None] * saved.num_rows, pa.int64()))
    with pytest.raises(ValueError, match="column 'key' has .* null"):
        t.load_state_dict(nulls)
    wrong = saved.set_column(
        saved.column_names.index("last_seen"), "last_seen", saved.column("last_seen").cast(pa.int32())
    )
    with pytest.raises(ValueError, match="column 'last_seen' has type int32, expected int64"):
        t.load_state_dict(wrong)
    with pytest.raises(ValueError, match="exceed the capacity"):
        EmbeddingTable("t", TableSpec(dim=6, capacity=3), t.cfg).load_state_dict(saved)
    with pytest.raises(ValueError, match=r"grads must have shape \(2, 6\)"):
        t.apply_gradients(np.array([1, 2]), np.zeros((2, 5), np.float32), 0)
    with pytest.raises(ValueError, match="gradients of step 7 arrive before its lookup"):
        t.apply_gradients(np.array([1]), np.zeros((1, 6), np.float32), 7)
    with pytest.raises(ValueError, match="steps must not decrease"):
        t.lookup(np.array([1]), 0)
    with pytest.raises(TypeError, match="pyarrow.Table"):
        t.insert_rows({"key": [1]})


def test_fixed_size_table_capacity():
    t = EmbeddingTable("small", TableSpec(dim=2, capacity=1000, num_rows=10), StoreConfig())
    assert t.capacity == 10
    t.lookup(hashing.fold(np.arange(100, dtype=np.int64), 10)[:10], 0)
    assert len(t) == 10


# --------------------------------------------------------------------------- config


def test_store_config_checks_and_loads_from_plain_data():
    from recsys.config import ConfigError, from_dict

    cfg = from_dict(StoreConfig, {"optimizer": "adam", "lr": 1, "init_scale": 0.05, "min_count": 3})
    assert cfg.lr == 1.0 and cfg.init_bound(64) == 0.05 and StoreConfig().init_bound(64) == 0.125
    with pytest.raises(ConfigError, match=r"optimizer: expected one of \['rowwise_adagrad'"):
        from_dict(StoreConfig, {"optimizer": "adamw"})
    with pytest.raises(ConfigError, match="unknown key"):
        from_dict(StoreConfig, {"stalenes": 1})
    for bad, match in [
        ({"optimizer": "lamb"}, "optimizer must be one of"),
        ({"dtype": "bfloat16"}, "dtype must be one of"),
        ({"lr": 0.0}, "lr must be"),
        ({"eps": -1.0}, "eps must be"),
        ({"beta1": 1.0}, r"beta1 must be in \[0, 1\)"),
        ({"weight_decay": -0.1}, "weight_decay must be"),
        ({"initial_accumulator": float("nan")}, "initial_accumulator must be"),
        ({"init_scale": -1.0}, "init_scale must be"),
        ({"min_count": 0}, r"min_count must be in \[1, 255\]"),
        ({"min_count": 256}, r"min_count must be in \[1, 255\]"),
    ]:
        with pytest.raises(ValueError, match=match):
            StoreConfig(**bad)



_PREFAULT_PROBE = r"""
import sys
from recsys.features.schema import TableSpec
from recsys.store.config import HostConfig, StoreConfig
from recsys.store.tables.table import EmbeddingTable

def rss():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096

before = rss()
t = EmbeddingTable("t", TableSpec(dim=64, capacity=200_000),
                   StoreConfig(optimizer=sys.argv[1], host=HostConfig(prefault=sys.argv[2] == "1")))
print(rss() - before, t.weights_CD.nbytes + sum(a.nbytes for a in t._state.values()))
"""


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
def test_prefault_commits_the_tables_memory_and_changes_no_row(optimizer):
    """``prefault`` backs the rows and the optimizer state with memory at construction
    (np.zeros of this size is lazily mapped otherwise; measured in fresh interpreters, whose
    heaps hold no freed memory) and leaves every value as it was."""
    import subprocess
    import sys

    growth = {}
    for prefault in ("0", "1"):
        out = subprocess.run([sys.executable, "-c", _PREFAULT_PROBE, optimizer, prefault],
                             capture_output=True, text=True, check=True)
        growth[prefault], committed = (int(x) for x in out.stdout.split())
    assert growth["1"] - growth["0"] >= 0.9 * committed, (growth, committed)
    spec = TableSpec(dim=64, capacity=200_000)
    tables = {p: EmbeddingTable("t", spec, StoreConfig(optimizer=optimizer, host=HostConfig(prefault=p))) for p in (False, True)}
    t = tables[True]
    assert not t.weights_CD.any() and not any(a.any() for a in t._state.values())
    keys = hashing.hash_int64(np.arange(5000), "t")
    grads = np.random.default_rng(0).standard_normal((5000, 64)).astype(np.float32)
    for table in tables.values():
        table.lookup(keys, 0)
        table.apply_gradients(keys, grads, 0)
    np.testing.assert_array_equal(tables[True].peek(keys), tables[False].peek(keys))


def test_gather_kernel_copies_rows_and_zeros_absent_slots():
    from recsys.store.tables.table import _gather_kernel

    rng = np.random.default_rng(4)
    w = rng.standard_normal((50, 16)).astype(np.float32)
    for n in (0, 3, 40):  # shorter and longer than the prefetch distance
        slots = rng.integers(-1, 50, n)
        out = np.full((n, 16), np.nan, dtype=np.float32)
        _gather_kernel(w, slots, out)
        want = np.where((slots >= 0)[:, None], w[np.maximum(slots, 0)], 0.0)
        np.testing.assert_array_equal(out, want)


def test_a_shard_above_the_key_maps_limit_is_refused_by_name():
    from recsys.store.tables.keymap import MAX_CAPACITY

    with pytest.raises(ValueError, match=r"table 'huge': 536870912 rows in one shard, above the 536870911"):
        EmbeddingTable("huge", TableSpec(dim=4, capacity=MAX_CAPACITY + 1), StoreConfig())
