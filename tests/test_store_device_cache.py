"""The device cache on CPU: same rows, state and pooled outputs as the host path, for every
optimizer, with evictions from the cache; write-back on eviction and on state_dict.

Only ``device="cpu"`` is exercised here (no GPU on this machine).
Legend: ``U`` keys of a call, ``D`` dim.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from recsys.features.schema import TableSpec
from recsys.store.tables import optim
from recsys.store.config import DeviceConfig, SpillConfig, StoreConfig
from recsys.store.device.cache import DeviceCache, apply_update_torch
from recsys.store.sharded.store import ShardedEmbeddingStore
from recsys.store.tables.table import EmbeddingTable
from store_data import random_kjts, three_feature_schema, train_pooled

D = 6
OPTIMIZERS = ["rowwise_adagrad", "adagrad", "adam", "sgd"]
TOL = dict(rtol=2e-5, atol=2e-6)


def cfg_for(optimizer: str, **kw) -> StoreConfig:
    return StoreConfig(optimizer=optimizer, lr=0.05, weight_decay=0.01, initial_accumulator=0.1, **kw)


def grads_for(keys: np.ndarray, rows: np.ndarray, step: int) -> np.ndarray:
    phase = (keys.astype(np.float64) % 89)[:, None] + np.arange(rows.shape[1]) + step
    return (0.5 * rows + np.sin(phase)).astype(np.float32)


def assert_states_close(a: pa.Table, b: pa.Table) -> None:
    assert a.column_names == b.column_names
    assert a.column("key").equals(b.column("key"))
    assert a.column("last_seen").equals(b.column("last_seen"))
    for name in a.column_names:
        if name in ("key", "last_seen"):
            continue
        x = np.asarray(a.column(name).to_pylist(), dtype=np.float64)
        y = np.asarray(b.column(name).to_pylist(), dtype=np.float64)
        np.testing.assert_allclose(x, y, err_msg=name, **TOL)


# --------------------------------------------------------------------------- the optimizers


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_torch_optimizers_match_the_numba_kernels(optimizer):
    cfg = cfg_for(optimizer)
    rng = np.random.default_rng(0)
    U = 32
    w = rng.normal(size=(U, D)).astype(np.float32)
    cols = optim.state_columns(optimizer)
    state = {}
    for c in cols:
        shape = (U, D) if c.per_dim else (U,)
        state[c.name] = (rng.integers(0, 5, shape) if c.dtype == np.int64 else rng.random(shape)).astype(c.dtype)
    for _ in range(5):  # a few updates in a row, so the state matters
        g = rng.normal(size=(U, D)).astype(np.float32)
        w_t = torch.from_numpy(w.copy())
        s_t = {k: torch.from_numpy(v.copy()) for k, v in state.items()}
        apply_update_torch(cfg, w_t, s_t, torch.from_numpy(g))
        idx = np.arange(U)
        optim.apply_update(cfg, w, idx, state, idx, g)
        np.testing.assert_allclose(w_t.numpy(), w, rtol=1e-6, atol=1e-7)
        for k in state:
            np.testing.assert_allclose(s_t[k].numpy(), state[k], rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- against the host path


@pytest.mark.parametrize("optimizer,dtype,lag", [(o, "float32", 0) for o in OPTIMIZERS]
                         + [("adam", "float16", 0), ("rowwise_adagrad", "float32", 1), ("adam", "float32", 1)])
def test_cache_equals_the_host_path_with_evictions(optimizer, dtype, lag):
    """``lag``: gradients of step t arrive after the lookup of step t + lag (bounded staleness),
    so rows are often evicted from the cache before their gradient: the host applies it."""
    cfg = cfg_for(optimizer, dtype=dtype)
    plain = EmbeddingTable("t", TableSpec(dim=D, capacity=1000), cfg)
    cached = DeviceCache(EmbeddingTable("t", TableSpec(dim=D, capacity=1000), cfg), rows=8, device="cpu")
    rng = np.random.default_rng(1)
    queued = []
    for step in range(30):
        keys = np.unique(rng.integers(0, 24, 8))
        a = plain.lookup(keys, step)
        b = cached.lookup(keys, step)
        np.testing.assert_allclose(b, a, err_msg=f"step {step}", **TOL)
        queued.append((step, keys, grads_for(keys, a, step), grads_for(keys, b, step)))
        while queued and queued[0][0] <= step - lag:
            s, k, ga, gb = queued.pop(0)
            plain.apply_gradients(k, ga, s)
            cached.apply_gradients(k, gb, s)
    for s, k, ga, gb in queued:
        plain.apply_gradients(k, ga, s)
        cached.apply_gradients(k, gb, s)
    assert_states_close(cached.state_dict(), plain.state_dict())
    c = cached.counters()
    assert c["cache_evictions"] > 20 and c["writebacks"] > 20 and c["cache_hits"] > 20
    assert c["updated"] == plain.counters()["updated"]
    host_updates = cached.host.counters()["updated"]
    assert (host_updates > 0) == (lag > 0)
    # peek reads the device copy of cached rows
    keys = np.arange(24)
    np.testing.assert_allclose(cached.peek(keys), plain.peek(keys), **TOL)


def test_write_back_on_eviction_and_on_state_dict():
    cfg = cfg_for("adagrad")
    host = EmbeddingTable("t", TableSpec(dim=D, capacity=100), cfg)
    cache = DeviceCache(host, rows=2, device=torch.device("cpu"))
    k12 = np.array([1, 2])
    initial = cache.lookup(k12, 0)
    cache.apply_gradients(k12, np.ones((2, D), np.float32), 0)
    fresh = cache.peek(k12)
    assert not np.allclose(fresh, initial)
    # while cached, the device copy is authoritative and the host's is stale
    np.testing.assert_array_equal(host.peek(k12), initial)
    assert cache.counters()["writebacks"] == 0
    cache.lookup(np.array([3, 4]), 1)  # evicts 1 and 2 from the cache: written back
    np.testing.assert_array_equal(host.peek(k12), fresh)
    assert cache.counters()["writebacks"] == 2 and cache.counters()["cache_evictions"] == 2
    host_state = {k: v for k, v in zip(host.state_dict().column("key").to_pylist(),
                                       host.state_dict().column("state_sum").to_pylist())}
    g = 1.0 + cfg.weight_decay * initial[0]  # the state came back too
    np.testing.assert_allclose(host_state[1], cfg.initial_accumulator + g * g, rtol=1e-6)
    cache.apply_gradients(np.array([3]), np.ones((1, D), np.float32), 1)
    stale = host.peek(np.array([3]))
    state = cache.state_dict()  # writes the dirty row 3 back (4 is clean: not written)
    assert cache.counters()["writebacks"] == 3
    row3 = np.asarray(state.column("embedding").to_pylist()[2], np.float32)
    assert not np.allclose(row3, stale[0])
    np.testing.assert_array_equal(host.peek(np.array([3]))[0], row3)
    assert cache.cached() == 2  # rows stay cached after a flush, now clean
    cache.flush()
    assert cache.counters()["writebacks"] == 3


def test_calls_larger_than_the_cache_are_refused_without_changes():
    host = EmbeddingTable("t", TableSpec(dim=D, capacity=100), cfg_for("sgd"))
    cache = DeviceCache(host, rows=2, device="cpu")
    with pytest.raises(ValueError, match="store.device.cache_rows"):
        cache.lookup(np.array([1, 2, 3]), 0)
    assert len(host) == 0 and cache.cached() == 0


# --------------------------------------------------------------------------- in the sharded store


@pytest.mark.parametrize("optimizer,staleness", [("rowwise_adagrad", 0), ("adam", 1)])
def test_sharded_store_with_device_cache_matches_without(optimizer, staleness):
    kjts = random_kjts(15, vocab=60, seed=4)
    with_cache = ShardedEmbeddingStore(three_feature_schema(D, 10_000), cfg_for(optimizer, staleness=staleness, device=DeviceConfig(cache_rows=36)),
                                       device="cpu")
    without = ShardedEmbeddingStore(three_feature_schema(D, 10_000), cfg_for(optimizer, staleness=staleness))
    assert isinstance(with_cache.tables["item"], DeviceCache)
    assert isinstance(without.tables["item"], EmbeddingTable)
    for step, (a, b) in enumerate(zip(train_pooled(with_cache, kjts, D), train_pooled(without, kjts, D))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"step {step}")
    sa, sb = with_cache.state_dict(), without.state_dict()
    for name in sa:
        assert_states_close(sa[name], sb[name])
    c = with_cache.counters()["item"]
    assert c["cache_evictions"] > 0 and c["writebacks"] > 0 and c["cache_hits"] > 0
    with_cache.close()
    without.close()


@pytest.mark.redis
def test_cache_over_a_spilling_host_equals_an_unbounded_table(redis_server):
    """All three tiers: device cache (6 rows) ─► host (10 rows) ─► Redis; invisible to training."""
    cfg = cfg_for("adam", spill=SpillConfig(url=redis_server.url, retries=1, backoff_s=0.01))
    tiers = DeviceCache(EmbeddingTable("t", TableSpec(dim=D, capacity=10), cfg), rows=6, device="cpu")
    plain = EmbeddingTable("t", TableSpec(dim=D, capacity=1000), cfg_for("adam"))
    rng = np.random.default_rng(2)
    try:
        for step in range(30):
            keys = np.unique(rng.integers(0, 30, 6))
            a = plain.lookup(keys, step)
            b = tiers.lookup(keys, step)
            np.testing.assert_allclose(b, a, err_msg=f"step {step}", **TOL)
            plain.apply_gradients(keys, grads_for(keys, a, step), step)
            tiers.apply_gradients(keys, grads_for(keys, b, step), step)
        assert_states_close(tiers.state_dict(), plain.state_dict())
        c = tiers.counters()
        assert c["cache_evictions"] > 0 and c["evictions"] > 0 and c["spill_hits"] > 0 and c["writebacks"] > 0
    finally:
        tiers.close()
