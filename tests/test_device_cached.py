"""``recsys.store.device.cached.DeviceCachedSparse``: the device index as an exact-LRU cache in
front of host tables, on the CPU device.

Checked against one host store of the whole capacity (``EmbeddingTable``, driven with the
same keys, steps and gradients: ``tests/test_device_keymap.HostRef``) after every step of
eviction-heavy traces whose cache is much smaller than the tables: the same keys held (so
the same keys evicted), ``last_seen`` exactly, rows within 1e-6, the same counters;
checkpoints load both ways; a step bigger than the cache is refused in one line; and a
short ``recsys train`` with the cached tier trains as the host key map does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recsys.features.schema import TableSpec
from recsys.store.config import DeviceConfig, StoreConfig
from recsys.store.device.cached import DeviceCachedSparse
from recsys.store.tables.table import CapacityError, COUNTERS
from tests.test_device_keymap import FEATURES, HostRef, assert_states_equal, dev_step, random_batch, three_tables

HOST_COUNTED = tuple(c for c in COUNTERS if c not in ("rows_in", "rows_out")) + ("rows",)


def _cfg(optimizer="rowwise_adagrad", cache_rows=16, **kw) -> StoreConfig:
    return StoreConfig(optimizer=optimizer, lr=0.05, seed=3, device=DeviceConfig(cache_rows=cache_rows), **kw)


def _host_counters(host: HostRef) -> dict:
    return {n: {k: t.counters()[k] for k in HOST_COUNTED} for n, t in host.tables.items()}


def _cached_counters(dc: DeviceCachedSparse) -> dict:
    return {n: {k: c[k] for k in HOST_COUNTED} for n, c in dc.counters().items()}


def _keys(state) -> dict:
    return {n: t.column("key").to_numpy().tolist() for n, t in state.items()}


def _check_step(host: HostRef, dc: DeviceCachedSparse) -> None:
    """The union holds what the host store holds, with the same last_seen, rows and counters."""
    got, ref = dc.state_dict(), host.state_dict()
    assert _keys(got) == _keys(ref)
    assert_states_equal(got, ref)
    assert _cached_counters(dc) == _host_counters(host)


def _run(host, dc, batches, rng, D=4, check_every=1):
    for step, (keys, lengths) in enumerate(batches):
        B = lengths.shape[0] // len(host.features)
        R = rng.standard_normal((B, len(host.features) * D)).astype(np.float32)
        ref = host.step(keys, lengths, step, R)
        got = dev_step(dc, keys, lengths, step, R)
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6)
        if step % check_every == 0:
            _check_step(host, dc)
    _check_step(host, dc)


# --------------------------------------------------------------------------- equal to the host store


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
def test_equal_to_one_host_table_on_an_eviction_heavy_trace(optimizer):
    """Three tables: two much larger than the cache (16 rows), one that fits in it whole; a
    vocabulary over the capacities, so nearly every step demotes, promotes and evicts."""
    cfg = _cfg(optimizer, cache_rows=16)
    tables = three_tables(40, 64, 10)
    host = HostRef(tables, FEATURES, cfg)
    dc = DeviceCachedSparse(tables, FEATURES, cfg, "cpu")
    assert sorted(dc.hosts) == [0, 1]  # user and item have host tables, geo is whole on the device
    rng = np.random.default_rng(7)
    batches = [random_batch(rng, FEATURES, B=4, vocab=110) for _ in range(40)]
    _run(host, dc, batches, rng)
    c = dc.counters()
    assert c["item"]["evictions"] > 20 and c["user"]["evictions"] > 20
    assert c["item"]["cache_evictions"] > 50 and c["item"]["cache_hits"] > 0
    assert c["item"]["cache_misses"] > c["item"]["misses"]  # host hits: rows promoted from the host
    assert c["item"]["cached"] <= 16 and c["item"]["rows"] == 64


def _bags(bags: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    return (np.array([k for b in bags for k in b], dtype=np.int64),
            np.array([len(b) for b in bags], dtype=np.int64))


TIE_FEATURES = [("f", "t", "sum")]
M = np.iinfo(np.int64).min


@pytest.mark.parametrize("capacity,cache_rows", [(14, 6), (8, 6)])
def test_ties_in_the_last_step_are_decided_by_the_key_as_uint64(capacity, cache_rows):
    """Every key of a step shares its last step: which of them the cache demotes and the host
    evicts is decided by the key as uint64 (negative keys after positive ones). With a host
    table smaller than a step's demotion (8 - 6 rows) the oldest demoted rows are dropped."""
    cfg = _cfg("rowwise_adagrad", cache_rows=cache_rows)
    tables = {"t": TableSpec(dim=4, capacity=capacity)}
    host = HostRef(tables, TIE_FEATURES, cfg)
    dc = DeviceCachedSparse(tables, TIE_FEATURES, cfg, "cpu")
    trace = [
        [[-3, -2], [-1, 0], [1, 2]],  # one step's keys, all tied
        [[M, -7], [7, M + 1], [5, 3]],
        [[9, 10], [-9], [-10, 11, 12]],  # evicts from the oldest ties
        [[-1, 2], [7, 100], [-100]],  # host hits among tied keys, new keys
        [[-7, 3], [M], [0, 1, 13]],
        [[-2], [5, 6], [9, -9, -10]],
        [[14, 15, 16], [17, 18], [-3]],
    ]
    rng = np.random.default_rng(0)
    _run(host, dc, [_bags(b) for b in trace], rng)
    assert dc.counters()["t"]["evictions"] > 0


# --------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("direction", ["cached_to_host", "host_to_cached"])
def test_checkpoints_interchange_with_the_host_store(direction):
    """The union's checkpoint loads into the host store and the host store's into a fresh
    cached tier, exactly; training then continues equal to the uninterrupted run."""
    cfg = _cfg("adam", cache_rows=16)
    tables = three_tables(40, 64, 10)
    rng = np.random.default_rng(11)
    batches = [random_batch(rng, FEATURES, B=4, vocab=110) for _ in range(24)]
    host = HostRef(tables, FEATURES, cfg)
    dc = DeviceCachedSparse(tables, FEATURES, cfg, "cpu")
    _run(host, dc, batches[:12], rng, check_every=100)
    saved = (dc if direction == "cached_to_host" else host).state_dict()
    host2 = HostRef(tables, FEATURES, cfg)
    dc2 = DeviceCachedSparse(tables, FEATURES, cfg, "cpu")
    for name, rows in saved.items():
        host2.tables[name].load_state_dict(rows)
    dc2.load_state_dict(saved)
    assert_states_equal(dc2.state_dict(), saved, tol=0)
    assert_states_equal(host2.state_dict(), saved, tol=0)
    assert dc2.counters()["item"]["cached"] == 16
    R = [rng.standard_normal((4, len(FEATURES) * 4)).astype(np.float32) for _ in batches[12:]]
    for i, (keys, lengths) in enumerate(batches[12:]):
        step = 12 + i
        np.testing.assert_allclose(dev_step(dc2, keys, lengths, step, R[i]), host2.step(keys, lengths, step, R[i]),
                                   rtol=0, atol=1e-6)
        dev_step(dc, keys, lengths, step, R[i])
    assert _keys(dc2.state_dict()) == _keys(host2.state_dict())
    assert_states_equal(dc2.state_dict(), host2.state_dict())
    assert_states_equal(dc2.state_dict(), dc.state_dict())


def test_peek_held_and_pop_rows_read_both_tiers():
    cfg = _cfg(cache_rows=16)
    tables = three_tables(40, 64, 10)
    host = HostRef(tables, FEATURES, cfg)
    dc = DeviceCachedSparse(tables, FEATURES, cfg, "cpu")
    rng = np.random.default_rng(5)
    _run(host, dc, [random_batch(rng, FEATURES, B=4, vocab=110) for _ in range(10)], rng, check_every=100)
    keys = np.arange(-60, 60, dtype=np.int64)
    ref = host.tables["item"]
    found = np.zeros(keys.shape[0], dtype=bool)
    np.testing.assert_allclose(dc.peek_rows("item", keys), ref.peek(keys, found_out=found), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(dc.held("item", keys), found)
    assert found.sum() > 16  # rows of both tiers
    want = keys[found][::-1][:30]
    a, b = dc.pop_rows("item", want), ref.pop_rows(want)
    assert a.column("key").to_pylist() == b.column("key").to_pylist() == want.tolist()
    assert_states_equal({"item": a}, {"item": b})
    assert not dc.held("item", want).any()
    assert dc.counters()["item"]["rows_out"] == 30
    assert _keys(dc.state_dict()) == _keys(host.state_dict())


# --------------------------------------------------------------------------- refusal


def test_a_step_bigger_than_the_cache_is_refused_in_one_line():
    cfg = _cfg(cache_rows=5)
    tables = {"t": TableSpec(dim=4, capacity=50)}
    dc = DeviceCachedSparse(tables, TIE_FEATURES, cfg, "cpu")
    keys, lengths = _bags([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(CapacityError) as info:
        dc.forward(torch.from_numpy(keys), torch.from_numpy(lengths), 0)
    msg = str(info.value)
    assert "\n" not in msg and "6 distinct ids, more than the 5 rows its device cache holds" in msg
    assert "raise store.device.cache_rows" in msg
    assert dc.counters()["t"]["rows"] == 0  # nothing changed
    keys, lengths = _bags([[1, 2, 3], [4, 5]])
    dev_step(dc, keys, lengths, 0, np.ones((2, 4), dtype=np.float32))
    assert dc.counters()["t"]["rows"] == 5


# --------------------------------------------------------------------------- in training

# tables above the 450 cache rows that see more distinct ids in 10 steps than they hold: they evict
CACHED_STEPS = ["train.max_steps=10", "train.checkpoint.every_steps=5", "train.checkpoint.keep_last=3",
                "schema.tables.c3.capacity=500", "schema.tables.c4.capacity=500", "schema.tables.c7.capacity=480",
                "schema.tables.m1.capacity=1000", "schema.tables.m2.capacity=1000"]
CACHED = ["store.device.cache_rows=450", "store.device.key_map='device'"]


@pytest.fixture(scope="module")
def cached_runs(tiny_data, tmp_path_factory):
    """The same 10-step job with the host key map and with the cached tier (checkpoints at 5, 10)."""
    from test_store_device_keymap import HOST
    from test_train import run

    root = tmp_path_factory.mktemp("cached_runs")
    for name, extra in (("host", HOST), ("cached", CACHED)):
        run(tiny_data, root / name, *extra, *CACHED_STEPS)
    return root


def test_recsys_train_with_the_cached_tier_trains_as_the_host_key_map(tiny_data, tmp_path, cached_runs):
    """``key_map = "device"`` with 450 cache rows a table (more than a batch brings to one),
    most tables larger: the cached tier, not a refusal; losses, the final eval and the rows
    (keys, last_seen) as the host key map's, and evictions in both."""
    from test_store_device_keymap import _steps, assert_same_training
    from test_train import build

    from recsys.store.device.cached import DeviceCachedSparse
    from recsys.store.sharded.device_keys import refusal

    trainer = build(tiny_data, tmp_path / "probe", *CACHED, *CACHED_STEPS)
    try:
        assert refusal(trainer.job.schema, trainer.job.store, 1) is None
        assert isinstance(trainer.store._keys.sparse, DeviceCachedSparse)
    finally:
        trainer.close()
    host, cached = cached_runs / "host", cached_runs / "cached"
    assert_same_training(host, cached)
    sh, sc = _steps(host), _steps(cached)
    assert sh[10]["store/rows"] == sc[10]["store/rows"]
    evictions = sum(r["store/evictions"] for r in sc.values())
    assert evictions > 0 and sum(r["store/evictions"] for r in sh.values()) == evictions


def test_recsys_train_checkpoints_interchange_with_the_host_key_map(tiny_data, tmp_path, cached_runs):
    """The cached tier resumes the host key map's checkpoint and the other way round, each
    equal to the uninterrupted run."""
    from test_store_device_keymap import HOST, _steps, assert_same_training
    from test_train import run

    for saved, resumed_with, reference in (("cached", HOST, "host"), ("host", CACHED, "cached")):
        target = tmp_path / f"from_{saved}"
        result = run(tiny_data, target, *resumed_with, *CACHED_STEPS,
                     resume=str(cached_runs / saved / "checkpoints" / "step-00000005"))
        assert result["step"] == 10 and sorted(_steps(target)) == list(range(6, 11))
        assert_same_training(cached_runs / reference, target, steps=list(range(6, 11)))


def test_refusal_takes_cache_rows_below_a_capacity():
    from store_data import three_feature_schema

    from recsys.store.sharded.device_keys import refusal

    schema = three_feature_schema(4, 1000)
    assert refusal(schema, StoreConfig(device=DeviceConfig(cache_rows=100, key_map="device")), 1) is None
    assert "one process" in refusal(schema, StoreConfig(device=DeviceConfig(cache_rows=100, key_map="device")), 2)
    why = refusal(schema, StoreConfig(device=DeviceConfig(memory_gb=1e-6, key_map="device")), 1)
    assert "every table whole on the device" in why and "store.device.cache_rows" in why


def test_rows_to_load_are_checked_before_either_tier_changes():
    """A repeated key (or any bad column) in rows to load is refused before anything changes,
    as the host store refuses it: the table keeps what it held."""
    import pyarrow as pa

    from tests.test_device_keymap import dev_step

    cfg = _cfg(cache_rows=4)
    tables = {"t": TableSpec(dim=4, capacity=12)}
    dc = DeviceCachedSparse(tables, [("f", "t", "sum")], cfg, "cpu")
    for step, ks in enumerate([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]):
        dev_step(dc, np.array(ks, dtype=np.int64), np.array([4]), step, np.ones((1, 4), np.float32))
    before = dc.state_dict()["t"]
    key1 = before.filter(pa.compute.equal(before.column("key"), 1))
    at = key1.column_names.index("last_seen")
    newer = key1.set_column(at, key1.schema.field(at), pa.array([99], pa.int64()))
    for bad in (pa.concat_tables([before.slice(0, 2), before.slice(0, 1)]), pa.concat_tables([key1, newer])):
        with pytest.raises(ValueError, match="repeats keys"):
            dc.load_state_dict({"t": bad})
        assert dc.state_dict()["t"].equals(before) and dc.counters()["t"]["rows"] == 12


@pytest.mark.parametrize("settle_every", [0, 3])
def test_the_hosts_are_asked_one_step_ahead_and_train_the_same(settle_every):
    """As the store runs it: step t's forward, then step t + 1's misses asked of the hosts
    (``prefetch``: the look-up, its read and the host rows, while step t's backward and update
    are still to come), then t's update, then t + 1's forward with what was asked. Equal to the
    host store after every step; with ``settle_every``, a read of the tables between the
    prefetch and its step gives the rows back, and the step asks again: still equal."""
    cfg = _cfg("rowwise_adagrad", cache_rows=16)
    tables = three_tables(40, 64, 10)
    host = HostRef(tables, FEATURES, cfg)
    dc = DeviceCachedSparse(tables, FEATURES, cfg, "cpu")
    rng = np.random.default_rng(5)
    batches = [random_batch(rng, FEATURES, B=4, vocab=110) for _ in range(30)]
    asked = 0
    for step, (keys, lengths) in enumerate(batches):
        B = lengths.shape[0] // len(FEATURES)
        R = rng.standard_normal((B, len(FEATURES) * 4)).astype(np.float32)
        ref = host.step(keys, lengths, step, R)
        ahead = dc._ahead
        out = dc.forward(torch.from_numpy(keys), torch.from_numpy(lengths), step,
                         uniq=dc.dedup(keys, lengths))
        assert dc._ahead is None
        if step + 1 < len(batches):
            nk, nl = batches[step + 1]
            dc.prefetch(dc.dedup(nk, nl), step + 1)  # after the forward, before the update
            assert dc._ahead is not None and dc._ahead.step == step + 1
            asked += sum(r.num_rows for _, r in dc._ahead.popped)
        (out * torch.from_numpy(R)).sum().backward()
        dc.update(step)
        np.testing.assert_allclose(out.detach().numpy(), ref, rtol=0, atol=1e-6)
        if settle_every and step % settle_every == 0:
            _check_step(host, dc)  # reads the tables: the prefetch is given back
            assert dc._ahead is None
        del ahead
    _check_step(host, dc)
    assert asked > 20  # the hosts' rows of later steps' misses were taken ahead
