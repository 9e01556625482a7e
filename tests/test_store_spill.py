"""The Redis spill tier against a real redis-server: exact round trips, invisible eviction,
the in-flight buffer, world-size independent keys, and outages (``SpillError``, no re-init).

Legend: ``U`` keys of a call, ``D`` dim.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time

import numpy as np
import pyarrow as pa
import pytest
import redis
import torch

from conftest import wait_until
from recsys.features import hashing
from recsys.testing.harness import RedisServer
from recsys.features.schema import TableSpec
from recsys.store.tables import optim
from recsys.store.config import DeviceConfig, SpillConfig, StoreConfig
from recsys.store.tables.rowblock import RowBlock
from recsys.store.sharded.store import ShardedEmbeddingStore
from recsys.store.spill.tier import SpillError, SpillTier
from recsys.redisio.spill_layout import FORMAT_VERSION, spill_key, value_dtype
from recsys.store.tables.table import EmbeddingTable, init_vectors
from store_data import random_kjts, three_feature_schema, train_pooled

pytestmark = pytest.mark.redis

D = 4
OPTIMIZERS = ["rowwise_adagrad", "adagrad", "adam", "sgd"]


@pytest.fixture
def closing():
    """Collect tables / tiers / clients; close them after the test (outage errors ignored)."""
    items = []
    yield items.append
    for item in reversed(items):
        try:
            item.close()
        except SpillError:
            pass


def cfg_for(url: str = "", spill: dict | None = None, **kw) -> StoreConfig:
    """The tests' store settings; ``spill``: keys of ``[store.spill]`` over the tests' own."""
    tier = SpillConfig(**{"url": url, "namespace": "recsys", "retries": 2, "backoff_s": 0.01, "timeout_s": 2.0,
                          **(spill or {})})
    return StoreConfig(**{"optimizer": "adam", "lr": 0.05, "weight_decay": 0.01, **kw}, spill=tier)


def grads_for(keys: np.ndarray, rows: np.ndarray, step: int) -> np.ndarray:
    """Deterministic gradients that depend on the rows (so a wrong row changes everything after)."""
    phase = (keys.astype(np.float64) % 97)[:, None] + np.arange(rows.shape[1]) + step
    return (0.5 * rows + np.sin(phase)).astype(np.float32)


def batches(steps: int, vocab: int, per_step: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.unique(rng.integers(-vocab // 2, vocab // 2, per_step)) for _ in range(steps)]


def row_map(state: pa.Table) -> dict[int, tuple]:
    """key -> (embedding bytes, state columns..., last_seen) for exact comparisons."""
    out = {}
    cols = [c for c in state.column_names if c != "key"]
    for i, key in enumerate(state.column("key").to_pylist()):
        out[key] = tuple(np.asarray(state.column(c)[i].as_py()).tobytes() for c in cols)
    return out


def raw_client(server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(server.url)


# --------------------------------------------------------------------------- format


def test_key_is_the_same_for_every_world_size_and_rank():
    assert spill_key("recsys", "user", 5) == "recsys:spill:user:0000000000000005"
    assert spill_key("recsys", "user", -1) == "recsys:spill:user:ffffffffffffffff"
    assert spill_key("ns", "item", -(1 << 63)) == "ns:spill:item:8000000000000000"
    # a tier knows nothing about ranks: the names it uses are the key function's
    tier_cfg = cfg_for("redis://127.0.0.1:1/0")
    owned_by_rank_1 = SpillTier("user", D, tier_cfg, owns=lambda k: hashing.owner_of(k, 2) == 1)
    try:
        def names(keys):
            return [bytes(row) for row in owned_by_rank_1._name_chars(keys)]

        keys = np.array([5, -1, 123456789], dtype=np.int64)
        assert names(keys) == [spill_key("recsys", "user", int(k)).encode() for k in keys]
        many = np.random.default_rng(0).integers(-(1 << 63), (1 << 63) - 1, size=1000, dtype=np.int64)
        assert names(many) == [spill_key("recsys", "user", int(k)).encode() for k in many]
        assert names(keys[:0]) == []
        # and back: names that are not this table's keys (another table, not 16 hex digits) are skipped
        junk = [b"recsys:spill:user:zz", b"recsys:spill:user:000000000000000g", b"recsys:spill:usex:0000000000000001"]
        assert owned_by_rank_1._parse_names(junk + names(many)).tolist() == many.tolist()
        assert owned_by_rank_1._parse_names(junk).shape == (0,)
    finally:
        owned_by_rank_1.close()  # never connected: nothing to flush


@pytest.mark.parametrize("optimizer,dtype", [("adam", "float32"), ("rowwise_adagrad", "float16"),
                                             ("adagrad", "float32"), ("sgd", "float16")])
def test_value_is_raw_little_endian_with_a_version_header(optimizer, dtype):
    cfg = cfg_for("redis://127.0.0.1:1/0", optimizer=optimizer, dtype=dtype)
    t = EmbeddingTable("t", TableSpec(dim=D, capacity=8), cfg_for(optimizer=optimizer, dtype=dtype))
    t.lookup(np.array([7, -3]), 4)
    t.apply_gradients(np.array([7, -3]), np.ones((2, D), np.float32), 4)
    block = t._block(np.array([7, -3]), t._map.find(np.array([7, -3])), np.array([4, 4]))
    tier = SpillTier("t", D, cfg)
    try:
        values = tier._encode(block)
        dt = value_dtype(D, cfg)
        assert all(len(v) == dt.itemsize for v in values)
        v = values[1]
        assert v[0] == FORMAT_VERSION
        assert v[1] == (0 if dtype == "float32" else 1)
        assert v[2] == OPTIMIZERS.index(optimizer)
        assert int.from_bytes(v[4:8], "little") == D
        assert int.from_bytes(v[8:16], "little", signed=True) == -3
        assert int.from_bytes(v[16:24], "little", signed=True) == 4
        emb_bytes = D * (4 if dtype == "float32" else 2)
        assert v[24 : 24 + emb_bytes] == block.emb[1].astype("<" + block.emb.dtype.str[1:]).tobytes()
        back = tier._decode(values, block.keys)
        assert back.emb.tobytes() == block.emb.tobytes()
        for name in block.states:
            assert back.states[name].tobytes() == block.states[name].tobytes()
        # a value of another version is refused, naming the key and both formats
        bad = bytes([FORMAT_VERSION + 1]) + v[1:]
        with pytest.raises(SpillError, match=r"format version 2.*reads format version 1"):
            tier._decode([bad], block.keys[1:])
        # among good ones, the bad value is the one named; so is a short value whose bytes a
        # long one makes up for (the values' total is right, their boundaries are not)
        with pytest.raises(SpillError, match=r"0000000000000007 has format version 2"):
            tier._decode([values[1], bytes([FORMAT_VERSION + 1]) + values[0][1:]], block.keys[::-1])
        with pytest.raises(SpillError, match=rf"fffffffffffffffd has format version 1.*\({dt.itemsize - 1} bytes\)"):
            tier._decode([values[0], values[1][:-1], values[1] + b"x"], np.array([7, -3, -3]))
    finally:
        tier.close()


def test_config_validation():
    with pytest.raises(ValueError, match="store.spill.url"):
        SpillConfig(url="http://x")
    with pytest.raises(ValueError, match="queue_rows must be >= batch_rows"):
        SpillConfig(batch_rows=100, queue_rows=10)
    with pytest.raises(ValueError, match="namespace must have no whitespace"):
        SpillConfig(namespace="a b")
    with pytest.raises(ValueError, match="cache_rows must be >= 0"):
        DeviceConfig(cache_rows=-1)
    assert SpillConfig(retries=3, backoff_s=0.1).retry_budget_s() == pytest.approx(0.7)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("optimizer,dtype", [("adam", "float32"), ("rowwise_adagrad", "float16"), ("adagrad", "float32")])
def test_evicted_row_comes_back_bit_identical(redis_server, closing, optimizer, dtype):
    cfg = cfg_for(redis_server.url, optimizer=optimizer, dtype=dtype)
    t = EmbeddingTable("user", TableSpec(dim=D, capacity=2), cfg)
    closing(t)
    k = np.array([42])
    for step in range(3):
        rows = t.lookup(k, step)
        t.apply_gradients(k, grads_for(k, rows, step), step)
    before = row_map(t.state_dict())[42]
    t.lookup(np.array([1, 2]), 3)  # evicts 42
    assert t.counters()["evictions"] == 1
    t.flush()
    r = raw_client(redis_server)
    closing(r)
    name = spill_key("recsys", "user", 42)
    assert r.exists(name) == 1
    assert row_map(t.state_dict())[42] == before  # the spilled row, with its last_seen (2)
    out = t.lookup(np.array([42, 5]), 4)  # back from Redis; 5 is new
    c = t.counters()
    assert (c["spill_hits"], c["spill_misses"], c["inserts"]) == (1, 4, 4)  # 42 restored, 1 2 5 new
    after = row_map(t.state_dict())[42]
    assert after[:-1] == before[:-1]  # embedding and optimizer state: same bits
    assert np.frombuffer(after[-1], np.int64)[0] == 4  # touched by the lookup
    assert np.array_equal(out[0], t.peek(np.array([42]))[0])
    t.flush()
    assert r.exists(name) == 1  # kept (spill.delete_restored is off): stale, unread while 42 is here
    assert t.counters()["spill_unlinks"] == 0


def test_a_restored_rows_kept_copy_is_never_read_and_its_next_eviction_overwrites_it(redis_server, closing):
    """With ``spill.delete_restored`` off, a row back in memory keeps its Redis copy: a
    checkpoint does not read it (garbage there changes nothing), the row's next eviction
    writes its newer state over it, and a row popped from the table takes its copy along."""
    t = EmbeddingTable("user", TableSpec(dim=D, capacity=2), cfg_for(redis_server.url))
    closing(t)
    r = raw_client(redis_server)
    closing(r)
    k = np.array([42])
    name = spill_key("recsys", "user", 42)
    rows = t.lookup(k, 0)
    t.apply_gradients(k, grads_for(k, rows, 0), 0)
    t.lookup(np.array([1, 2]), 1)  # evicts 42
    t.flush()
    rows = t.lookup(k, 2)  # back from Redis, its copy kept
    t.apply_gradients(k, grads_for(k, rows, 2), 2)  # the row moves on; the copy is stale
    newer = row_map(t.state_dict())[42]
    r.set(name, b"not a row")  # were the copy read, the format check would raise
    t.flush()
    assert row_map(t.state_dict())[42] == newer
    t.lookup(np.array([3, 4]), 3)  # evicts 42 again: its newer state replaces the copy
    t.flush()
    assert r.get(name) != b"not a row"
    assert row_map(t.state_dict())[42] == newer
    back = t.lookup(k, 4)
    assert row_map(t.state_dict())[42][:-1] == newer[:-1]
    assert t.counters()["spill_unlinks"] == 0
    popped = t.pop_rows(k)  # the row leaves this table: the copy would outlive it
    assert np.array_equal(np.asarray(popped.column("embedding")[0].as_py(), np.float32), back[0])
    t.flush()
    assert r.exists(name) == 0 and t.counters()["spill_unlinks"] == 1
    hits = t.counters()["spill_hits"]
    t.lookup(k, 5)  # a new row, not the popped one
    assert t.counters()["spill_hits"] == hits
    assert np.array_equal(t.peek(k), init_vectors(k, D, "user", 0, cfg_for().init_bound(D)))


@pytest.mark.parametrize("delete_restored", [False, True])
def test_prefetch_reads_no_copy_of_a_row_the_table_holds(redis_server, closing, delete_restored):
    """The store passes a coming lookup's every key to ``prefetch``; a held row's kept copy
    is stale, and reading it ahead would be wasted round trips."""
    t = EmbeddingTable("u", TableSpec(dim=D, capacity=4), cfg_for(redis_server.url, spill=dict(delete_restored=delete_restored)))
    closing(t)
    a, b = np.arange(4), np.arange(4, 8)
    t.lookup(a, 0)
    t.lookup(b, 1)  # evicts a
    t.lookup(a, 2)  # restores a, evicts b
    t.flush()
    assert t.prefetch(a) == 0
    assert t.prefetch(np.concatenate([a, b])) == 4  # b's rows are spilled: read ahead


@pytest.mark.parametrize("delete_restored", [False, True])
def test_a_popped_rows_copy_is_gone_before_a_new_owner_can_write_it(redis_server, closing, delete_restored):
    """``pop_rows`` deletes the row's Redis copy before it returns: an UNLINK still queued
    then could land after the new owner's write of the same key and lose the row."""
    cfg = cfg_for(redis_server.url, spill=dict(delete_restored=delete_restored))
    a = EmbeddingTable("u", TableSpec(dim=D, capacity=2), cfg)
    b = EmbeddingTable("u", TableSpec(dim=D, capacity=2), cfg)
    closing(a)
    closing(b)
    b.lookup(np.array([100]), 0)  # b's index is built (empty)
    k = np.array([42])
    a.lookup(k, 0)
    a.lookup(np.array([1, 2]), 1)  # evicts 42
    a.flush()
    a.lookup(k, 2)  # 42 back in a's memory
    a.flush()
    gate = threading.Event()
    a.spill._write_gate = lambda: gate.wait(10)  # a's writer is slow
    timer = threading.Timer(0.3, gate.set)
    timer.start()
    try:
        popped = a.pop_rows(k)
        assert a.spill.counters()["spill_pending"] == 0  # written before the row left
    finally:
        gate.set()
        timer.cancel()
    b.insert_rows(popped)  # the new owner
    b.lookup(np.array([200, 201]), 3)  # evicts 100 and 42: b writes 42's newest state
    b.flush()
    a.flush()
    assert np.array_equal(b.peek(k)[0], np.asarray(popped.column("embedding")[0].as_py(), np.float32))


def test_with_delete_restored_a_restored_rows_copy_is_deleted(redis_server, closing):
    t = EmbeddingTable("user", TableSpec(dim=D, capacity=2), cfg_for(redis_server.url, spill=dict(delete_restored=True)))
    closing(t)
    r = raw_client(redis_server)
    closing(r)
    t.lookup(np.array([42]), 0)
    t.lookup(np.array([1, 2]), 1)  # evicts 42
    t.flush()
    assert r.exists(spill_key("recsys", "user", 42)) == 1
    t.lookup(np.array([42]), 2)
    t.flush()
    assert r.exists(spill_key("recsys", "user", 42)) == 0 and t.counters()["spill_unlinks"] == 1


@pytest.mark.parametrize("optimizer,min_count", [(o, 1) for o in OPTIMIZERS] + [("adam", 2)])
def test_training_with_spill_equals_an_unbounded_table(redis_server, closing, optimizer, min_count):
    """Eviction + spill is invisible: every lookup and the final rows match a table that never evicts."""
    small = EmbeddingTable("item", TableSpec(dim=D, capacity=6),
                           cfg_for(redis_server.url, optimizer=optimizer, min_count=min_count))
    closing(small)
    big = EmbeddingTable("item", TableSpec(dim=D, capacity=1000), cfg_for(optimizer=optimizer, min_count=min_count))
    for step, keys in enumerate(batches(25, vocab=30, per_step=6)):
        a = small.lookup(keys, step)
        b = big.lookup(keys, step)
        assert a.tobytes() == b.tobytes(), f"step {step}"
        small.apply_gradients(keys, grads_for(keys, a, step), step)
        big.apply_gradients(keys, grads_for(keys, b, step), step)
    assert small.state_dict().equals(big.state_dict())
    c = small.counters()
    assert c["evictions"] > 10 and c["spill_hits"] > 10 and c["spill_errors"] == 0
    assert c["rows"] == 6


def test_gradient_for_a_row_evicted_after_its_lookup_is_applied(redis_server, closing):
    """Pushes may lag lookups: a row evicted before its gradient arrives is brought back."""
    small = EmbeddingTable("t", TableSpec(dim=D, capacity=2), cfg_for(redis_server.url))
    closing(small)
    big = EmbeddingTable("t", TableSpec(dim=D, capacity=100), cfg_for())
    k0, k1 = np.array([1, 2]), np.array([3, 4])
    for t in (small, big):
        rows0 = t.lookup(k0, 0)
        t.lookup(k1, 1)  # evicts 1, 2 from the small table before step 0's push
        t.apply_gradients(k0, grads_for(k0, rows0, 0), 0)
    assert small.counters()["ignored"] == 0
    assert small.state_dict().equals(big.state_dict())


@pytest.mark.parametrize("delete_restored", [False, True])
def test_rows_in_flight_or_pending_are_served_from_the_buffer(redis_server, closing, delete_restored):
    cfg = cfg_for(redis_server.url, spill=dict(delete_restored=delete_restored))
    t = EmbeddingTable("t", TableSpec(dim=D, capacity=2), cfg)
    closing(t)
    ref = EmbeddingTable("t", TableSpec(dim=D, capacity=100), cfg_for())
    entered, release = threading.Event(), threading.Event()

    def gate():
        entered.set()
        release.wait(30)

    t.spill._write_gate = gate
    try:
        steps = [np.array([1, 2]), np.array([3, 4]), np.array([5, 6]), np.array([1, 3])]
        for step, keys in enumerate(steps):
            a, b = t.lookup(keys, step), ref.lookup(keys, step)
            assert a.tobytes() == b.tobytes(), f"step {step}"
            t.apply_gradients(keys, grads_for(keys, a, step), step)
            ref.apply_gradients(keys, grads_for(keys, b, step), step)
            if step == 1:  # 1, 2 were evicted: the writer took them and is held in flight
                assert entered.wait(10), "the writer never took the first batch"
        # step 3 found 1 in flight and 3 pending (evicted at step 2, writer still held)
        c = t.counters()
        assert (c["spill_hits"], c["spill_buffer_hits"], c["spill_misses"]) == (2, 2, 6)  # 6: keys 1-6 when new
    finally:
        release.set()
    t.flush()
    r = raw_client(redis_server)
    closing(r)
    present = {k: r.exists(spill_key("recsys", "t", k)) for k in range(1, 7)}
    if delete_restored:  # 1 was written (in flight) then unlinked; 3 was never written
        assert present == {1: 0, 2: 1, 3: 0, 4: 1, 5: 1, 6: 1}
    else:  # 1 and 3, back in memory, keep the copies written from the buffer (stale, unread)
        assert present == dict.fromkeys(range(1, 7), 1)
    assert t.counters()["spill_unlinks"] == (2 if delete_restored else 0)
    assert t.state_dict().equals(ref.state_dict())  # the rows in memory, not their stale copies


def test_state_round_trip_beyond_capacity_spills_the_oldest(redis_server, closing):
    src = EmbeddingTable("t", TableSpec(dim=D, capacity=100), cfg_for())
    for step, keys in enumerate(batches(8, vocab=40, per_step=8, seed=3)):
        rows = src.lookup(keys, step)
        src.apply_gradients(keys, grads_for(keys, rows, step), step)
    saved = src.state_dict()
    dst = EmbeddingTable("t", TableSpec(dim=D, capacity=5), cfg_for(redis_server.url))
    closing(dst)
    dst.load_state_dict(saved)
    assert len(dst) == 5
    newest = np.lexsort((saved.column("key").to_numpy().view(np.uint64), saved.column("last_seen").to_numpy()))[-5:]
    kept = dst.state_dict()
    assert kept.equals(saved)
    held = np.sort(dst._map.items()[0])
    assert np.array_equal(held, np.sort(saved.column("key").to_numpy()[newest]))


def trained(capacity: int, url: str = "", steps: int = 8, seed: int = 3, per_step: int = 8, **kw) -> EmbeddingTable:
    t = EmbeddingTable("t", TableSpec(dim=D, capacity=capacity), cfg_for(url, **kw))
    for step, keys in enumerate(batches(steps, vocab=40, per_step=per_step, seed=seed)):
        rows = t.lookup(keys, step)
        t.apply_gradients(keys, grads_for(keys, rows, step), step)
    return t


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_rows_beyond_capacity_replace_held_spilled_and_buffered_copies(redis_server, closing, dtype):
    """``insert_rows`` writes the rows beyond the capacity straight to Redis: a key the
    table holds, one it spilled and one whose older copy waits in the write buffer all end
    with the inserted row, and the newest rows are the ones held."""
    t = trained(5, redis_server.url, steps=16, seed=3, per_step=4, dtype=dtype)
    closing(t)
    saved = trained(100, steps=6, seed=4).state_dict()  # float32 rows: other values, overlapping keys
    keys = saved.column("key").to_numpy()
    order = np.lexsort((keys.view(np.uint64), saved.column("last_seen").to_numpy()))
    beyond = set(keys[order[:-5]].tolist())  # the rows that do not fit
    before = row_map(t.state_dict())
    # an older copy of some of these keys waits in the write buffer while they are inserted:
    # the writer, holding the evicted rows, waits until the insert's flush waits for it (the
    # flush is what keeps that older copy from landing after the inserted rows); without a
    # flush it waits until the insert returned, and the older copy lands last
    taken, release = threading.Event(), threading.Event()

    def gate():
        taken.set()
        release.wait(30)

    flush = t.spill.flush

    def flush_releasing():
        release.set()
        flush()

    t.spill._write_gate = gate
    t.spill.flush = flush_releasing
    held_before = set(t._map.items()[0].tolist())
    new = np.array([1000, 1001], dtype=np.int64)
    try:
        t.lookup(new, 50)  # evicts 2 held rows: buffered, taken by the writer and held there
        assert taken.wait(10), "the writer never took the evicted rows"
        held = set(t._map.items()[0].tolist())
        evicted = held_before - held
        assert len(evicted) == 2 and evicted <= beyond  # their inserted rows go straight to Redis
        assert held & beyond and (set(before) - held) & beyond
        assert t.counters()["spill_pending"] == 2
        evictions = t.counters()["evictions"]
        t.insert_rows(saved)
    finally:
        release.set()
        t.spill._write_gate = None
        del t.spill.flush
    t.flush()
    assert t.counters()["evictions"] - evictions <= 5 < len(beyond)  # the rows beyond went straight to Redis
    ref = EmbeddingTable("t", TableSpec(dim=D, capacity=1000), cfg_for(dtype=dtype))
    ref.load_state_dict(saved)  # the same rounding to float16 as the table's own
    want = {**before, **row_map(ref.state_dict())}
    got = row_map(t.state_dict())
    assert set(got) == set(want) | {1000, 1001}
    assert {k: v for k, v in got.items() if k not in (1000, 1001)} == want
    fresh = EmbeddingTable("t", TableSpec(dim=D, capacity=1000), cfg_for(redis_server.url, dtype=dtype))
    closing(fresh)  # what Redis holds, read by another table
    spilled_now = np.array(sorted(set(got) - set(t._map.items()[0].tolist())), dtype=np.int64)
    assert fresh.peek(spilled_now).tobytes() == t.peek(spilled_now).tobytes()
    assert set(t._map.items()[0].tolist()) == set(keys[order[-5:]].tolist())


def test_world_size_two_spill_is_found_at_world_size_one(redis_server, closing):
    """Two shards (owner = mix(key) % 2) spill into one namespace; a single shard finds every row."""
    cfg = cfg_for(redis_server.url)
    shards = []
    for rank in range(2):
        owns = (lambda r: lambda keys: hashing.owner_of(keys, 2) == r)(rank)
        t = EmbeddingTable("user", TableSpec(dim=D, capacity=5), cfg, spill=SpillTier("user", D, cfg, owns=owns))
        closing(t)
        shards.append(t)
    keys_all = np.arange(-10, 10, dtype=np.int64)
    owner = hashing.owner_of(keys_all, 2)
    ref = EmbeddingTable("user", TableSpec(dim=D, capacity=100), cfg_for())
    for step in range(8):
        keys = keys_all[(np.arange(20) + step) % 4 == 0]  # 5 keys a step, each key twice
        ref_rows = ref.lookup(keys, step)
        ref.apply_gradients(keys, grads_for(keys, ref_rows, step), step)
        for rank, t in enumerate(shards):
            mine = keys[owner[(keys + 10)] == rank]
            rows = t.lookup(mine, step)
            t.apply_gradients(mine, grads_for(mine, rows, step), step)
    states = [t.state_dict() for t in shards]
    for rank, st in enumerate(states):  # each shard lists only the spilled rows it owns
        assert set(hashing.owner_of(st.column("key").to_numpy(), 2).tolist()) <= {rank}
    merged = pa.concat_tables(states).sort_by("key")
    assert merged.equals(ref.state_dict())
    for t in shards:
        t.flush()
    spilled = sum(t.counters()["evictions"] - t.counters()["spill_hits"] for t in shards)
    held = set(np.concatenate([t._map.items()[0] for t in shards]).tolist())
    spilled = np.array([k for k in keys_all.tolist() if k not in held], dtype=np.int64)
    assert spilled.shape[0] > 0
    one = EmbeddingTable("user", TableSpec(dim=D, capacity=100), cfg)
    closing(one)
    rows = one.lookup(spilled, 10)
    c = one.counters()
    assert (c["spill_hits"], c["inserts"]) == (spilled.shape[0], 0)
    assert rows.tobytes() == ref.peek(spilled).tobytes()


def test_clear_removes_only_this_tables_rows(redis_server, closing):
    cfg = cfg_for(redis_server.url)
    a = EmbeddingTable("a", TableSpec(dim=D, capacity=1), cfg)
    b = EmbeddingTable("b", TableSpec(dim=D, capacity=1), cfg)
    closing(a)
    closing(b)
    for step in range(3):
        a.lookup(np.array([step]), step)
        b.lookup(np.array([step]), step)
    assert a.spill.clear() == 2
    assert a.spill.rows().num_rows == 0 and b.spill.rows().num_rows == 2


# --------------------------------------------------------------------------- sharded store


@pytest.mark.parametrize("staleness", [0, 1])
def test_sharded_store_with_spill_trains_like_an_unbounded_store(redis_server, closing, staleness):
    spilled = ShardedEmbeddingStore(three_feature_schema(D, 36), cfg_for(redis_server.url, staleness=staleness))
    closing(spilled)
    plain = ShardedEmbeddingStore(three_feature_schema(D, 10_000), cfg_for(staleness=staleness))
    kjts = random_kjts(12, vocab=80, seed=11)
    for a, b in zip(train_pooled(spilled, kjts, D), train_pooled(plain, kjts, D)):
        assert torch.equal(a, b)
    sa, sb = spilled.state_dict(), plain.state_dict()
    for name in sa:
        assert sa[name].equals(sb[name]), name
    c = spilled.counters()["item"]
    assert c["evictions"] > 0 and c["spill_hits"] > 0 and c["ignored"] == 0


# --------------------------------------------------------------------------- outages


def test_redis_stopped_mid_run_raises_spill_error_and_never_reinitializes(redis_server, closing):
    cfg = cfg_for(redis_server.url)
    t = EmbeddingTable("user", TableSpec(dim=D, capacity=4), cfg)
    closing(t)
    ref = EmbeddingTable("user", TableSpec(dim=D, capacity=100), cfg_for())
    plan = batches(30, vocab=16, per_step=4, seed=5)
    stop_at = 12
    spilled_keys: set[int] = set()
    error = None
    for step, keys in enumerate(plan):
        if step == stop_at:
            spilled_keys = set(t.spill.rows().keys.tolist())
            assert spilled_keys, "nothing was spilled before the outage"
            redis_server.stop()
        inserts = t.counters()["inserts"]
        t0 = time.monotonic()
        try:
            rows = t.lookup(keys, step)
        except SpillError as exc:
            error, elapsed = exc, time.monotonic() - t0
            assert t.counters()["inserts"] == inserts  # nothing initialized by the failed call
            break
        expect = ref.lookup(keys, step)
        # every row any lookup returned is the true row: a spilled key never came back re-initialized
        assert rows.tobytes() == expect.tobytes(), f"step {step}"
        t.apply_gradients(keys, grads_for(keys, rows, step), step)
        ref.apply_gradients(keys, grads_for(keys, expect, step), step)
    assert error is not None, "the outage was never noticed"
    assert step >= stop_at
    assert elapsed < cfg.spill.retry_budget_s() + 3 * cfg.spill.timeout_s
    msg = str(error)
    for part in ("'user'", redis_server.url, "3 attempt(s)", "No row was re-initialized", "store.spill.url"):
        assert part in msg, part
    assert "MGET" in msg or "MSET" in msg  # the read of a miss, or a write the next call reported
    # an evaluation read of a spilled key fails the same way instead of returning an init vector
    k = np.array([next(iter(spilled_keys - set(t._map.items()[0].tolist())))])
    with pytest.raises(SpillError):
        t.peek(k, init_missing=True)


def _restart_redis(server: RedisServer) -> subprocess.Popen:
    """Start a redis-server again on the stopped server's port (an outage that ends)."""
    proc = subprocess.Popen(
        [shutil.which("redis-server"), "--port", str(server.port), "--bind", server.host, "--save", "",
         "--appendonly", "no", "--dir", str(server.workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    server.proc = proc  # the fixture stops it
    wait_until(server.ping, 10, "redis-server to answer PING again")
    return proc


def test_failed_background_write_surfaces_and_keeps_the_rows(redis_server, closing):
    cfg = cfg_for(redis_server.url)
    t = EmbeddingTable("user", TableSpec(dim=D, capacity=2), cfg)
    closing(t)
    k = np.array([1, 2])
    rows = t.lookup(k, 0)
    t.apply_gradients(k, grads_for(k, rows, 0), 0)
    before = t.state_dict()
    redis_server.stop()
    # evict 1 and 2 without any Redis read: put rows in
    other = before.set_column(0, "key", pa.array([10, 11], pa.int64()))
    t.insert_rows(other)
    wait_until(lambda: t.spill.write_failed, 10, "the background write to fail")
    with pytest.raises(SpillError, match=r"write \(MSET of 2 rows, UNLINK of 0 keys\).*3 attempt\(s\)"):
        t.lookup(np.array([10, 11]), 1)  # all hits: the failure still surfaces on the next call
    # nothing lost: the rows are still buffered, bit-identical (10 and 11 were never spilled:
    # no tombstones), and a read of 1 or 2 is answered from the buffer
    assert t.counters()["spill_pending"] == 2
    found, block = t.spill.fetch(k, count=False)
    assert found.all()
    assert row_map(t._block_table(block)) == row_map(before)
    with pytest.raises(SpillError):  # the writer tried again and failed again
        t.flush()
    _restart_redis(redis_server)

    def flushed() -> bool:  # raises at most the failures from before the restart
        try:
            t.flush()
        except SpillError:
            return False
        return True

    wait_until(flushed, 20, "the buffered rows to be written after the restart")
    c = t.counters()
    assert (c["spill_pending"], c["spill_writes"], c["spill_unlinks"]) == (0, 2, 0)
    r = raw_client(redis_server)
    closing(r)
    assert r.exists(spill_key("recsys", "user", 1), spill_key("recsys", "user", 2)) == 2


def test_only_keys_redis_or_the_buffer_holds_get_tombstones(redis_server, closing):
    """``forget`` of a key never spilled writes nothing (a restore after a clear inserts millions);
    a key in Redis or still buffered is deleted, so ``fetch`` never returns its stale copy."""
    t = EmbeddingTable("user", TableSpec(dim=D, capacity=2), cfg_for(redis_server.url))
    closing(t)
    tier = t.spill
    k = np.array([1, 2])
    t.apply_gradients(k, grads_for(k, t.lookup(k, 0), 0), 0)
    t.lookup(np.array([3, 4]), 1)  # evicts 1 and 2
    tier.flush()
    assert tier.counters()["spill_stored"] == 2
    gate = threading.Event()
    tier._write_gate = gate.wait  # the writer holds what it takes next
    try:
        t.lookup(np.array([5, 6]), 2)  # evicts 3 and 4: buffered, not in Redis
        wait_until(lambda: len(tier._inflight) == 2, 10, "the writer to take 3 and 4")
        tier.forget(np.array([1, 3, 7, 8]))  # 1: in Redis; 3: buffered; 7, 8: never spilled
        assert tier.counters()["spill_pending"] == 4  # 3 and 4 in flight, tombstones of 1 and 3
    finally:
        gate.set()
    tier.flush()
    c = tier.counters()
    assert (c["spill_unlinks"], c["spill_stored"]) == (2, 2)  # 2 and 4 left
    found, _ = tier.fetch(np.array([1, 2, 3, 4, 7]), count=False)
    assert found.tolist() == [False, True, False, True, False]
    r = raw_client(redis_server)
    closing(r)
    assert sorted(r.keys(b"recsys:spill:user:*")) == sorted(
        spill_key("recsys", "user", i).encode() for i in (2, 4))


def test_a_read_of_many_rows_never_piles_up_replies(redis_server, closing):
    """A checkpoint reads every spilled row in a few calls: commands go out a window at a time
    and each window's replies are read before the next, so Redis never holds more than a
    window of replies for us. Here it may hold 1 MB at most (it drops a client past that);
    sending all 4,000 commands (~10 MB of replies) before reading one was dropped."""
    r = raw_client(redis_server)
    closing(r)
    r.config_set("client-output-buffer-limit", "normal 1mb 1mb 0")
    tier = SpillTier("user", D, cfg_for(redis_server.url, spill=dict(batch_rows=100, retries=0)))
    closing(tier)
    n = 400_000
    keys = np.arange(1, n + 1, dtype=np.int64)
    emb = np.random.default_rng(0).standard_normal((n, D)).astype(np.float32)
    states = {c.name: np.zeros((n, D) if c.per_dim else n, dtype=c.dtype)
              for c in optim.state_columns(tier.cfg.optimizer)}
    tier.put(RowBlock(keys, emb, states, np.zeros(n, dtype=np.int64)))
    tier.flush()
    assert r.dbsize() == n
    block = tier.rows()
    order = np.argsort(block.keys)
    assert block.keys[order].tolist() == keys.tolist()
    assert block.emb[order].tobytes() == emb.tobytes()


# --------------------------------------------------------------------------- read-ahead


def _mget_calls(r: redis.Redis) -> int:
    return int(r.info("commandstats").get("cmdstat_mget", {}).get("calls", 0))


def test_prefetched_rows_are_served_without_a_round_trip_and_never_go_stale(redis_server, closing):
    """``prefetch`` reads a coming fetch's spilled rows ahead; that fetch sends no MGET for them,
    and a key re-spilled after the read-ahead (``put``, then written, or ``write_rows``) is read
    anew, not served from the older read-ahead copy."""
    r = raw_client(redis_server)
    closing(r)
    tier = SpillTier("user", D, cfg_for(redis_server.url))
    closing(tier)
    assert tier.prefetch(np.array([1, 2])) == 0  # no index yet: nothing read ahead
    tier.clear()  # the index is known (empty)
    n = 4
    keys = np.arange(1, n + 1, dtype=np.int64)
    states = {c.name: np.full((n, D) if c.per_dim else n, 0.25, dtype=c.dtype)
              for c in optim.state_columns(tier.cfg.optimizer)}

    def block(ks: np.ndarray, value: float) -> RowBlock:
        sel = ks - 1
        return RowBlock(ks, np.full((ks.shape[0], D), value, dtype=np.float32),
                        {k: v[sel] for k, v in states.items()}, np.zeros(ks.shape[0], dtype=np.int64))

    tier.put(block(keys, 1.0))
    tier.flush()
    assert tier.prefetch(np.array([1, 2, 3, 9])) == 3  # 9 was never spilled: not asked
    calls = _mget_calls(r)
    found, got = tier.fetch(np.array([9, 3, 1, 2]))
    assert _mget_calls(r) == calls, "the fetch read rows Redis had already sent ahead"
    assert found.tolist() == [False, True, True, True]
    assert got.keys.tolist() == [3, 1, 2] and (got.emb == 1.0).all()
    c = tier.counters()
    assert (c["spill_hits"], c["spill_prefetch_hits"], c["spill_misses"]) == (3, 3, 1)
    # read ahead, then key 1 spilled again with a new value and written: the old copy is dropped
    assert tier.prefetch(np.array([1, 2])) == 2
    tier.put(block(np.array([1]), 2.0))
    tier.flush()
    found, got = tier.fetch(np.array([1, 2]))
    assert found.all() and got.emb[:, 0].tolist() == [2.0, 1.0]
    # the same for a row a restore writes straight to Redis (``write_rows``)
    assert tier.prefetch(np.array([1, 2])) == 2
    tier.write_rows(block(np.array([2]), 3.0))
    found, got = tier.fetch(np.array([1, 2]))
    assert found.all() and got.emb[:, 0].tolist() == [2.0, 3.0]
    # what a fetch does not ask for is dropped with it
    assert tier.prefetch(np.array([3, 4])) == 2
    tier.fetch(np.array([3]))
    calls = _mget_calls(r)
    tier.fetch(np.array([4]))
    assert _mget_calls(r) == calls + 1


@pytest.mark.parametrize("cache_rows", [0, 30], ids=["host", "device-cache"])
def test_a_store_reads_spilled_rows_ahead_while_the_step_trains(redis_server, closing, cache_rows):
    """The trainer's order (lookup of t+1 submitted before the push of t): the store's worker
    reads the misses' spilled rows ahead while the push is awaited, and training is exactly
    that of a store that never spills, at staleness 0 and 1; also with a device cache (here
    on the CPU) in front of the spilling host tables."""
    for staleness in (0, 1):
        spilled = ShardedEmbeddingStore(three_feature_schema(D, 36),
                                        cfg_for(redis_server.url, staleness=staleness, device=DeviceConfig(cache_rows=cache_rows),
                                                spill=dict(namespace=f"ahead{staleness}-{cache_rows}")),
                                        device="cpu", threaded=True)
        closing(spilled)
        plain = ShardedEmbeddingStore(three_feature_schema(D, 10_000), cfg_for(staleness=staleness), threaded=True)
        closing(plain)
        kjts = random_kjts(14, vocab=80, seed=5)
        V = torch.linspace(-1, 1, 3 * D).view(1, 3, D)
        outs = []
        for store in (spilled, plain):
            pooled_all = []
            future = store.submit_lookup(kjts[0], 0)
            for step in range(len(kjts)):
                lookup = future.result()
                if step + 1 < len(kjts):  # the next lookup goes in before this step's push
                    future = store.submit_lookup(kjts[step + 1], step + 1)
                pooled = lookup.pooled(3)
                ((pooled * V).sum() / kjts[step].stride() + (pooled**2).sum()).backward()
                store.push(lookup)
                pooled_all.append(pooled.detach())
            store.flush()
            outs.append(pooled_all)
        for step, (a, b) in enumerate(zip(*outs)):
            if cache_rows:  # the device cache's optimizer runs as torch ops: equal to float rounding
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"staleness {staleness}, step {step}")
            else:
                assert torch.equal(a, b), f"staleness {staleness}, step {step}"
        sa, sb = spilled.state_dict(), plain.state_dict()
        for name in sa:
            if not cache_rows:
                assert sa[name].equals(sb[name]), name
            else:  # the same keys, their rows equal to float rounding
                assert sa[name].column("key").to_pylist() == sb[name].column("key").to_pylist(), name
                ea, eb = (np.array(t.column("embedding").to_pylist(), dtype=np.float32) for t in (sa[name], sb[name]))
                np.testing.assert_allclose(ea, eb, rtol=1e-5, atol=1e-6, err_msg=name)
        c = spilled.counters()["item"]
        assert c["spill_hits"] > 0 and c["spill_errors"] == 0
        if staleness == 0:  # each lookup waits for the push before it: its misses were read ahead
            assert c["spill_prefetch_hits"] > 0
