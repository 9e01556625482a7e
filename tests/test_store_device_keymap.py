"""``store.device.key_map = "device"`` in training (``recsys.store.sharded.device_keys``): a
tiny job on the CPU device trains as the host key map does, checkpoints go both ways, and
the jobs it cannot hold are refused in one line at the job check.

The two key maps are both exact LRU with the same initial rows and optimizer; they differ
only in the float rounding of the pooling's sums (``embedding_bag`` against the host's numba
kernel: the same terms, added in another order), so rows are compared within 1e-6 and the
losses within 1e-5 relative, keys, ``last_seen`` and the counters exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from recsys.features.schema import FeatureSpec, TableSpec
from recsys.store.config import DeviceConfig, SpillConfig, StoreConfig
from recsys.store.sharded.device_keys import refusal
from store_data import three_feature_schema
from test_train import build, run

# three tables held below their vocabulary (a batch has at most 256 ids of each): they evict
STEPS = ["train.max_steps=14", "train.checkpoint.every_steps=6", "train.checkpoint.keep_last=5",
         "schema.tables.c3.capacity=300", "schema.tables.c4.capacity=300", "schema.tables.c7.capacity=400"]
DEVICE = ["store.device.memory_gb=1.0", "store.device.key_map='device'"]
HOST = ["store.device.memory_gb=1.0"]  # the same budget: DeviceTables, the host key map


def _records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _steps(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in _records(run_dir) if "event" not in r and "loss/train" in r}


def _final_eval(run_dir: Path) -> dict:
    return [r for r in _records(run_dir) if r.get("event") == "eval"][-1]


def _sparse(run_dir: Path, step: int | None = None) -> dict[str, pa.Table]:
    from recsys.checkpoint import write as ckpt

    root = run_dir / "checkpoints"
    return ckpt.load_sparse(ckpt.latest(root) if step is None else root / f"step-{step:08d}")


def _values(t: pa.Table, col: str) -> np.ndarray:
    c = t.column(col)
    if pa.types.is_fixed_size_list(c.type):
        return np.asarray(c.combine_chunks().flatten(), dtype=np.float64)
    return np.asarray(c.to_numpy(), dtype=np.float64)


def assert_same_rows(a: dict[str, pa.Table], b: dict[str, pa.Table], tol: float = 1e-6) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        x, y = a[name], b[name]
        assert x.column_names == y.column_names and x.schema.metadata == y.schema.metadata, name
        np.testing.assert_array_equal(x.column("key").to_numpy(), y.column("key").to_numpy(), err_msg=name)
        np.testing.assert_array_equal(x.column("last_seen").to_numpy(), y.column("last_seen").to_numpy(),
                                      err_msg=name)
        for col in x.column_names:
            if col not in ("key", "last_seen"):
                np.testing.assert_allclose(_values(x, col), _values(y, col), rtol=tol, atol=tol,
                                           err_msg=f"{name}.{col}")


def assert_same_training(a: Path, b: Path, steps=None) -> None:
    sa, sb = _steps(a), _steps(b)
    steps = sorted(sa) if steps is None else steps
    assert steps and set(steps) <= set(sa) and set(steps) <= set(sb)
    for s in steps:
        np.testing.assert_allclose(sa[s]["loss/train"], sb[s]["loss/train"], rtol=1e-5, err_msg=f"step {s}")
    ea, eb = _final_eval(a), _final_eval(b)
    assert ea["step"] == eb["step"]
    np.testing.assert_allclose(ea["auc"], eb["auc"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(ea["log_loss"], eb["log_loss"], rtol=1e-6)
    assert_same_rows(_sparse(a), _sparse(b))


@pytest.fixture(scope="module")
def full_runs(tiny_data, tmp_path_factory):
    """The same 14-step job with each key map (checkpoints at steps 6, 12 and 14)."""
    root = tmp_path_factory.mktemp("keymap_runs")
    out = {}
    for name, extra in (("host", HOST), ("device", DEVICE)):
        out[name] = root / name
        out[name + "_result"] = run(tiny_data, out[name], *extra, *STEPS)
    return out


def test_device_key_map_trains_as_the_host_key_map(full_runs):
    """Losses, the final eval, the rows (same keys and last_seen) and the logged counters."""
    host, device = full_runs["host"], full_runs["device"]
    assert full_runs["device_result"]["step"] == 14
    assert_same_training(host, device)
    assert_same_rows(_sparse(host, 6), _sparse(device, 6))
    # the counters: a log line reads them while the look-ahead lookup may have run or not
    # (the host store's reader does not wait for it), so compare where both are settled,
    # at the last step (no look-ahead): rows held, evictions over the run
    sh, sd = _steps(host), _steps(device)
    assert sh[14]["store/rows"] == sd[14]["store/rows"]
    evictions = sum(r["store/evictions"] for r in sd.values())
    assert sum(r["store/evictions"] for r in sh.values()) == evictions
    assert evictions > 0  # the small tables evict: LRU order checked, not only inserts


def test_checkpoints_interchange_between_key_maps(tiny_data, tmp_path, full_runs):
    """A checkpoint the device key map wrote resumes with the host's and the other way round,
    each equal to the uninterrupted run."""
    for saved, resumed_with, reference in (("device", HOST, "host"), ("host", DEVICE, "device")):
        target = tmp_path / f"from_{saved}"
        result = run(tiny_data, target, *resumed_with, *STEPS,
                     resume=str(full_runs[saved] / "checkpoints" / "step-00000006"))
        assert result["step"] == 14
        assert sorted(_steps(target)) == list(range(7, 15))
        assert_same_training(full_runs[reference], target, steps=list(range(7, 15)))


def test_the_store_reads_rows_and_counters_through_the_key_map(tiny_data, tmp_path, full_runs):
    """A trainer resumed with the device key map: ``peek_rows``, ``state_dict``, counters and
    a table's ``pop_rows`` read the restored rows."""
    from recsys.store.sharded.device_keys import KeyMapTable

    trainer = build(tiny_data, tmp_path / "peek", *DEVICE, *STEPS,
                    resume=str(full_runs["host"] / "checkpoints" / "step-00000012"))
    try:
        store = trainer.store
        assert all(isinstance(t, KeyMapTable) for t in store.tables.values())
        saved = _sparse(full_runs["host"], 12)
        assert_same_rows(store.state_dict(), saved, tol=0)
        c1 = saved["c1"]
        keys = c1.column("key").to_numpy()
        rows = np.asarray(c1.column("embedding").combine_chunks().flatten()).reshape(-1, 16)
        np.testing.assert_array_equal(store.peek_rows("c1", keys[:5]), rows[:5])
        counters = store.counters()
        assert counters["c1"]["rows"] == c1.num_rows and counters["c1"]["rows_in"] == c1.num_rows
        popped = store.schedule.call(lambda: store.tables["c1"].pop_rows(keys[:3]))
        assert popped.column("key").to_pylist() == keys[:3].tolist()
        assert store.counters()["c1"]["rows"] == c1.num_rows - 3
        np.testing.assert_array_equal(store.peek_rows("c1", keys[:3]), np.zeros((3, 16), dtype=np.float32))
    finally:
        trainer.close()


def test_the_wide_arm_trains_with_the_device_key_map(tiny_data, tmp_path):
    """``model.wide``: the wide weights' store (dim-1 tables) is a second ``DeviceSparse``."""
    extra = ["train.max_steps=6", "model.wide=true"]
    run(tiny_data, tmp_path / "host", *HOST, *extra)
    run(tiny_data, tmp_path / "device", *DEVICE, *extra)
    assert "c1.wide" in _sparse(tmp_path / "device")
    assert_same_training(tmp_path / "host", tmp_path / "device")


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("extra,match", [
    (["store.staleness=1"], r"store\.staleness = 0"),
    (["store.min_count=2"], r"store\.min_count = 1"),
    (["store.dtype='float16'"], r'store\.dtype = "float32"'),
    (["store.device.memory_gb=0.0"], r"every table whole on the device; 28 do not fit .*store\.device\.memory_gb"),
    (["store.device.memory_gb=0.001"], r"every table whole on the device; \d+ do not fit"),
    (["store.spill.url='redis://localhost:1/0'"], r"no spill tier"),
])
def test_incompatible_jobs_are_refused_in_one_line_at_the_job_check(tiny_data, tmp_path, extra, match):
    from recsys.config import ConfigError
    from recsys.errors import user_message

    with pytest.raises(ConfigError, match=match) as info:
        build(tiny_data, tmp_path / "refused", "store.device.key_map='device'", "store.device.memory_gb=1.0", *extra)
    message = user_message(info.value)
    assert message and "\n" not in message and message.startswith('store.device.key_map = "device" needs ')
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()  # refused before the run started


def test_refusals_the_job_check_cannot_reach_from_a_tiny_job():
    schema = three_feature_schema(4, 100)
    cfg = StoreConfig(device=DeviceConfig(memory_gb=1.0, key_map="device"))
    assert refusal(schema, cfg, 1) is None
    assert "one process, found 2" in refusal(schema, cfg, 2)
    assert "no live publishing" in refusal(schema, cfg, 1, publish=True)
    mixed = schema.replace(tables={**schema.tables, "extra": TableSpec(dim=8, capacity=10)},
                           sparse=[*schema.sparse, FeatureSpec(name="extra")])
    assert "every table of one dim, found [4, 8]" in refusal(mixed, cfg, 1)
    assert refusal(schema, StoreConfig(device=DeviceConfig(memory_gb=1.0)), 2) is None  # the host key map: no check
    spill = StoreConfig(device=DeviceConfig(memory_gb=1.0, key_map="device"), spill=SpillConfig(url="redis://h:1/0"))
    assert "no spill tier" in refusal(schema, spill, 1)
    with pytest.raises(ValueError, match="key_map must be 'host' or 'device'"):
        DeviceConfig(key_map="gpu")


def test_the_store_refuses_what_the_key_map_cannot_hold():
    from recsys.errors import UserError
    from recsys.store.sharded.store import ShardedEmbeddingStore

    cfg = StoreConfig(device=DeviceConfig(memory_gb=1e-6, key_map="device"))
    with pytest.raises(UserError, match="every table whole on the device"):
        ShardedEmbeddingStore(three_feature_schema(4, 1000), cfg)
    store = ShardedEmbeddingStore(three_feature_schema(4, 100), StoreConfig(device=DeviceConfig(memory_gb=1.0,
                                                                                                key_map="device")))
    try:
        with pytest.raises(UserError, match="no live publishing"):
            store.attach_publisher(lambda read_rows: None)
    finally:
        store.close()


@pytest.mark.parametrize("key_map", ["host", "device"])
def test_a_cancelled_lookup_is_not_counted_as_updated(key_map):
    """The trainer's look-ahead withdrawn (``store.cancel``): its rows are not counted as
    updated by either key map (the device counts them at its forward and takes them back)."""
    from recsys.store.sharded.store import ShardedEmbeddingStore
    from tests.store_data import random_kjts

    cfg = StoreConfig(device=DeviceConfig(memory_gb=1.0, key_map=key_map))
    store = ShardedEmbeddingStore(three_feature_schema(4, 100), cfg, threaded=False)
    try:
        first, ahead = random_kjts(2, 50, seed=0)
        lk = store.lookup(first, 0)
        lk.pooled().sum().backward()
        store.push(lk)
        store.flush()
        updated = sum(c["updated"] for c in store.counters().values())
        assert updated > 0
        store.cancel(store.lookup(ahead, 1))
        store.flush()
        assert sum(c["updated"] for c in store.counters().values()) == updated
    finally:
        store.close()


@pytest.mark.slow  # ~15 s (make test-slow, in CI); test_device_cached.py checks the prefetch in make test
def test_the_cached_tier_asks_the_host_for_a_steps_misses_while_the_step_before_is_awaited():
    """A threaded store with the cached tier: step t + 1's lookup, submitted while step t's push
    has not arrived, already has its misses' host rows (the schedule's key work ahead,
    ``DeviceKeys.reserve``); once the push arrives it trains as the host key map does."""
    import time

    from recsys.store.device.cached import DeviceCachedSparse
    from recsys.store.sharded.store import ShardedEmbeddingStore
    from tests.store_data import random_kjts

    schema = three_feature_schema(4, 60)
    kjts = random_kjts(8, 150, seed=1)
    cfgs = {"host": StoreConfig(seed=2), "device": StoreConfig(seed=2, device=DeviceConfig(cache_rows=40,
                                                                                            key_map="device"))}
    stores = {km: ShardedEmbeddingStore(schema, cfg, threaded=km == "device") for km, cfg in cfgs.items()}
    try:
        cached = stores["device"]._keys.sparse
        assert isinstance(cached, DeviceCachedSparse)
        for km, store in stores.items():
            lk = store.lookup(kjts[0], 0)
            for t in range(1, len(kjts)):
                (lk.pooled() * (t + 1)).sum().backward()
                if km == "device":
                    nxt = store.submit_lookup(kjts[t], t)  # waits for the push of t - 1
                    deadline = time.monotonic() + 60  # a bound on a broken schedule, not a timing
                    while (cached._ahead is None or cached._ahead.step != t) and time.monotonic() < deadline:
                        time.sleep(0.01)
                    assert cached._ahead is not None and cached._ahead.step == t and not nxt.done()
                    store.push(lk)
                    lk = nxt.result()
                else:
                    store.push(lk)
                    lk = store.lookup(kjts[t], t)
            (lk.pooled()).sum().backward()
            store.push(lk)
            store.flush()
        got, ref = stores["device"].state_dict(), stores["host"].state_dict()
        for name in ref:
            assert got[name].column("key").to_pylist() == ref[name].column("key").to_pylist()
            np.testing.assert_allclose(np.asarray(got[name].column("embedding").combine_chunks().flatten()),
                                       np.asarray(ref[name].column("embedding").combine_chunks().flatten()),
                                       rtol=0, atol=1e-6)
        assert stores["device"].counters()["item"]["evictions"] > 0
    finally:
        for store in stores.values():
            store.close()
