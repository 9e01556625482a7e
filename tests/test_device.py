"""The host/device boundary: what stays on the host (sparse ids, the store's key work), what
crosses (dense inputs, labels, rows or their gradients), and the GPU tier of the store.

The CPU tests run everywhere and catch the class of bug that crashed every ``--device cuda``
run (ids handed to the store on the device). The ``cuda``-marked tests run the same paths on
a GPU and skip without one; ``make gpu-check`` runs them on a GPU machine.
Legend: ``D`` dim.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys.store.config import DeviceConfig, StoreConfig
from recsys.store.device.cache import DeviceCache, device_budget_rows
from recsys.store.device.table import DeviceTable
from recsys.store.sharded.store import ShardedEmbeddingStore
from recsys.store.tables.table import EmbeddingTable
from store_data import random_kjts, three_feature_schema, train_pooled
from test_train import JOB, ROOT, overrides

D = 6
CUDA = pytest.mark.cuda


def _cfg(**kw) -> StoreConfig:
    return StoreConfig(**{"optimizer": "rowwise_adagrad", "lr": 0.05, "initial_accumulator": 0.1, **kw})


def _assert_same_rows(a: ShardedEmbeddingStore, b: ShardedEmbeddingStore) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for name in sa:
        assert sa[name].column("key").equals(sb[name].column("key")), name
        x = np.asarray(sa[name].column("embedding").to_pylist(), dtype=np.float64)
        y = np.asarray(sb[name].column("embedding").to_pylist(), dtype=np.float64)
        np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-6, err_msg=name)


# --------------------------------------------------------------------------- on every machine


def test_the_store_refuses_ids_on_a_device_with_a_clear_message():
    store = ShardedEmbeddingStore(three_feature_schema(D, 100), _cfg())
    kjt = random_kjts(1, vocab=20, seed=0)[0]
    moved = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values().to("meta"), lengths=kjt.lengths().to("meta"),
                              stride=kjt.stride())
    try:
        with pytest.raises(ValueError, match=r"sparse ids are on meta.*reads ids on the host.*Batch.to"):
            store.lookup(moved, 0)
        with pytest.raises(ValueError, match="sparse ids are on meta"):
            store.lookup(moved, None, train=False)
        store.lookup(kjt, 0).pooled(3)  # nothing was left half-done: the same step still looks up
    finally:
        store.close()


def test_device_memory_budget_holds_whole_tables_when_they_fit_and_shares_it_otherwise():
    schema = three_feature_schema(D, 1000)
    specs = dict(schema.tables)
    per_row = D * 4 + 4  # float32 row + row-wise Adagrad's one float
    whole = sum(s.capacity for s in specs.values()) * per_row
    assert device_budget_rows(specs, _cfg()) == {}
    fits = device_budget_rows(specs, _cfg(device=DeviceConfig(memory_gb=whole / 2**30)))
    assert fits == {n: s.capacity for n, s in specs.items()}
    half = device_budget_rows(specs, _cfg(device=DeviceConfig(memory_gb=whole / 2 / 2**30)))
    assert all(abs(half[n] - s.capacity // 2) <= 1 for n, s in specs.items())
    assert sum(half[n] for n in specs) * per_row <= whole / 2
    with pytest.raises(ValueError, match="cache_rows .* or memory_gb .* not both"):
        DeviceConfig(memory_gb=1.0, cache_rows=10)
    with pytest.raises(ValueError, match="memory_gb must be a number >= 0"):
        DeviceConfig(memory_gb=-1.0)


def test_a_budget_store_puts_every_table_on_the_device_and_trains_as_the_host_store():
    """``store.device.memory_gb`` that holds every table puts each one whole on the device
    (``DeviceTable``; here the CPU device: the same code as on a GPU), all in one arena, and
    gathers and updates rows where they live, one call over all tables each; nothing
    changes in the numbers."""
    kjts = random_kjts(12, vocab=60, seed=3)
    budget = ShardedEmbeddingStore(three_feature_schema(D, 10_000), _cfg(device=DeviceConfig(memory_gb=0.01)), device="cpu")
    host = ShardedEmbeddingStore(three_feature_schema(D, 10_000), _cfg())
    try:
        assert all(isinstance(t, DeviceTable) and t.rows == 10_000 for t in budget.tables.values())
        assert all(isinstance(t, EmbeddingTable) for t in host.tables.values())
        assert budget._device_rows and not host._device_rows
        arena = budget._arena  # one array for every table's cached rows: one gather and one update a step
        assert arena is not None and arena.w.shape[0] == 2 * 10_000 + 1
        assert {t._w.data_ptr() for t in budget.tables.values()} == {
            arena.w[arena.offsets[n]:].data_ptr() for n in budget.tables}
        for step, (a, b) in enumerate(zip(train_pooled(budget, kjts, D), train_pooled(host, kjts, D))):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"step {step}")
        _assert_same_rows(budget, host)
    finally:
        budget.close()
        host.close()


@pytest.mark.parametrize("kw", [{}, {"min_count": 2}, {"staleness": 1}, {"optimizer": "adam"}],
                         ids=["plain", "admission", "stale", "adam"])
def test_whole_tables_on_the_device_evict_admit_and_train_exactly_as_the_host_store(kw):
    """Tables smaller than the keys they see: the host's key map evicts (LRU), admits
    (``min_count``) and initializes; the device holds the rows at its slots. Step for step
    the pooled rows, the counters and every row at the end equal the host store's, also
    with pushes a step late (their slots checked against evictions since the lookup)."""
    cfg = kw
    kjts = random_kjts(30, vocab=90, seed=5)
    whole = ShardedEmbeddingStore(three_feature_schema(D, 40), _cfg(device=DeviceConfig(cache_rows=40), **cfg), device="cpu",
                                  threaded=True)
    host = ShardedEmbeddingStore(three_feature_schema(D, 40), _cfg(**cfg), threaded=True)
    try:
        assert all(isinstance(t, DeviceTable) for t in whole.tables.values())
        partial = ShardedEmbeddingStore(three_feature_schema(D, 40), _cfg(device=DeviceConfig(cache_rows=39), **cfg), device="cpu")
        assert all(isinstance(t, DeviceCache) for t in partial.tables.values())  # one row short: a cache
        partial.close()
        for step, (a, b) in enumerate(zip(train_pooled(whole, kjts, D), train_pooled(host, kjts, D))):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"step {step}")
        for name in host.tables:
            c, h = whole.tables[name].counters(), host.tables[name].counters()
            assert c["evictions"] > 0 and c["evictions"] == h["evictions"], name
            for k in ("hits", "misses", "inserts", "rejected"):
                assert c[k] == h[k], (name, k)
            # a push a step late finds the keys evicted by the lookup ahead of it, and which
            # lookup ran first is the threads' race (the host store reserves early): the
            # split between updated and ignored may differ then, never the rows
            assert c["updated"] + c["ignored"] == h["updated"] + h["ignored"], name
            if not kw.get("staleness"):
                assert (c["updated"], c["ignored"]) == (h["updated"], h["ignored"]), name
        _assert_same_rows(whole, host)
    finally:
        whole.close()
        host.close()


def test_a_device_table_checkpoints_pops_and_restores_its_device_rows():
    """The device's rows are what a checkpoint, ``pop_rows`` and evaluation see; rows loaded
    into a fresh store reach its device."""
    kjts = random_kjts(8, vocab=30, seed=7)
    a = ShardedEmbeddingStore(three_feature_schema(D, 100), _cfg(device=DeviceConfig(memory_gb=0.01)), device="cpu")
    b = ShardedEmbeddingStore(three_feature_schema(D, 100), _cfg(device=DeviceConfig(memory_gb=0.01)), device="cpu")
    host = ShardedEmbeddingStore(three_feature_schema(D, 100), _cfg())
    try:
        train_pooled(a, kjts, D)
        train_pooled(host, kjts, D)
        _assert_same_rows(a, host)  # state_dict: the device's values, copied back
        b.load_state_dict(a.state_dict())
        keys = np.arange(30)
        for name in a.tables:
            np.testing.assert_array_equal(b.tables[name].peek_tensor(keys).numpy(),
                                          a.tables[name].peek_tensor(keys).numpy())
            found = np.empty(30, dtype=bool)
            rows = a.tables[name].peek(keys, init_missing=True, found_out=found)
            want_found = np.empty(30, dtype=bool)
            want = host.tables[name].peek(keys, init_missing=True, found_out=want_found)
            np.testing.assert_array_equal(found, want_found)
            np.testing.assert_allclose(rows, want, rtol=2e-5, atol=2e-6)
        popped = a.tables["item"].pop_rows(np.array([1, 2, 3]))
        want = host.tables["item"].pop_rows(np.array([1, 2, 3]))
        assert popped.column("key").equals(want.column("key"))
        np.testing.assert_allclose(np.asarray(popped.column("embedding").to_pylist()),
                                   np.asarray(want.column("embedding").to_pylist()), rtol=2e-5, atol=2e-6)
        assert not a.tables["item"].peek(np.array([1]), found_out=np.empty(1, dtype=bool)).any()
    finally:
        for s in (a, b, host):
            s.close()


def test_metrics_read_a_device_loss_once_a_window_with_the_same_figures(tmp_path):
    """A loss kept as a float64 tensor (what the trainer passes on a GPU) gives the float's numbers."""
    from recsys.train.metrics import MetricsLog

    class NoStore:
        staleness = 0

        def counters(self):
            return {}

    losses = [0.6931, 0.52, 0.4133, 0.3999]
    for kind in ("float", "tensor"):
        log = MetricsLog(tmp_path / kind, enabled=True)
        for step, value in enumerate(losses, 1):
            loss32 = torch.tensor(value, dtype=torch.float32)  # the step's loss
            loss = loss32.item() if kind == "float" else loss32.double()
            log.step(step, 0, loss, 256, 1, {"x": 0.001}, NoStore(), 0.1, log_every=2)
        log.close()
    read = lambda kind: [json.loads(line)["loss/train"]  # noqa: E731
                         for line in (tmp_path / kind / "metrics.jsonl").read_text().splitlines()]
    assert read("float") == read("tensor") and len(read("float")) == 2


def test_transfers_on_the_cpu_copy_nothing_and_wait_for_nothing():
    from recsys.runtime.transfer import Transfers, arrive

    t = torch.arange(4.0)
    moved, event = Transfers("cpu").to_device([t])
    assert moved[0] is t and event is None
    back, event = Transfers("cpu").to_host([t])
    assert back[0] is t and event is None
    arrive([t], None)  # no event: nothing to wait for


def test_train_with_cuda_on_a_machine_without_a_gpu_is_one_line_before_anything_starts(tiny_data, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    run_dir = tmp_path / "run"
    sets = [a for s in overrides(tiny_data) for a in ("--set", s)]
    out = subprocess.run([sys.executable, "-m", "recsys.cli", "train", "--config", str(JOB), "--device", "cuda",
                          "--nproc", "2", "--run-dir", str(run_dir), *sets],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("recsys train: error: train: --device cuda needs a GPU"), lines
    assert not run_dir.exists()  # checked before the run directory or any process


# --------------------------------------------------------------------------- on a GPU


@CUDA
@pytest.mark.parametrize("tier", ["host", "device_cache", "whole_tables"])
def test_a_store_on_the_gpu_trains_as_the_cpu_store(tier):
    """Host rows crossing to the GPU (pinned, side stream), a GPU cache of a quarter of the
    rows with evictions, and whole tables in GPU memory: the CPU store's numbers."""
    kw = {"host": {}, "device_cache": {"device": DeviceConfig(cache_rows=36)},
          "whole_tables": {"device": DeviceConfig(memory_gb=0.01)}}[tier]
    kjts = random_kjts(15, vocab=60, seed=4)
    gpu = ShardedEmbeddingStore(three_feature_schema(D, 10_000), _cfg(**kw), device="cuda", threaded=True)
    cpu = ShardedEmbeddingStore(three_feature_schema(D, 10_000), _cfg())
    try:
        assert gpu._device_rows == (tier != "host")
        for step, (a, b) in enumerate(zip(train_pooled(gpu, kjts, D), train_pooled(cpu, kjts, D))):
            assert a.device.type == "cuda"
            torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-6, msg=f"step {step}")
        _assert_same_rows(gpu, cpu)
        if tier == "device_cache":
            c = gpu.counters()["item"]
            assert c["cache_evictions"] > 0 and c["writebacks"] > 0
    finally:
        gpu.close()
        cpu.close()


def _assert_same_checkpoint(a_run, b_run) -> None:
    """The latest checkpoints of two runs hold the same step, the same rows (keys, weights,
    optimizer state) and the same dense model and optimizer state, bit for bit."""
    from recsys.checkpoint import read as cf

    a, b = cf.latest(a_run / "checkpoints"), cf.latest(b_run / "checkpoints")
    assert cf.load_meta(a)["step"] == cf.load_meta(b)["step"]
    sa, sb = cf.load_sparse(a), cf.load_sparse(b)
    assert sorted(sa) == sorted(sb)
    for name in sa:
        ta, tb = sa[name].sort_by("key"), sb[name].sort_by("key")
        assert ta.num_rows > 0 and ta.equals(tb), name
    da, db = cf.load_dense(a), cf.load_dense(b)

    def same(x, y, where):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and torch.equal(x.cpu(), y.cpu()), where
        elif isinstance(x, dict):
            assert sorted(x, key=str) == sorted(y, key=str), where
            for k in x:
                same(x[k], y[k], f"{where}.{k}")
        elif isinstance(x, (list, tuple)):
            assert len(x) == len(y), where
            for i, (u, v) in enumerate(zip(x, y)):
                same(u, v, f"{where}[{i}]")
        else:
            assert x == y, where

    same(da["model"], db["model"], "model")
    same(da["optimizer"], db["optimizer"], "optimizer")


def _train(data, run_dir, device: str, *extra: str, resume=None) -> dict:
    from recsys.config import load_job
    from recsys.train.loop import Trainer, setup_env

    trainer = Trainer(load_job(JOB, overrides(data, *extra)), run_dir, setup_env(device), resume=resume)
    try:
        return trainer.train()
    finally:
        trainer.close()


@CUDA
@pytest.mark.parametrize("store", ["host", "gpu_tier"])
def test_training_on_the_gpu_evaluates_checkpoints_and_resumes_on_either_device(tiny_data, tmp_path, store):
    """Training with periodic validation and the final evaluation on the GPU, the AUC of the
    CPU run, a GPU checkpoint evaluated on the CPU and on the GPU, and a CPU checkpoint
    resumed on the GPU."""
    from recsys.eval.scoring import evaluate_checkpoint

    extra = ["train.max_steps=12", "train.eval.every=6", "train.log_every=4"]
    if store == "gpu_tier":
        extra.append("store.device.memory_gb=0.5")
    gpu = _train(tiny_data, tmp_path / "gpu", "cuda", *extra)
    cpu = _train(tiny_data, tmp_path / "cpu", "cpu", *extra)
    assert gpu["step"] == cpu["step"] == 12
    assert abs(gpu["auc"] - cpu["auc"]) < 0.01, (gpu, cpu)
    on_cpu = evaluate_checkpoint(tmp_path / "gpu", device="cpu")
    on_gpu = evaluate_checkpoint(tmp_path / "gpu", device="cuda")
    assert abs(on_cpu["auc"] - on_gpu["auc"]) < 1e-4 and abs(on_gpu["auc"] - gpu["auc"]) < 1e-4
    # the CPU checkpoint crosses to the GPU exactly: resumed there with no step left to train,
    # the run saves the same rows and dense state, bit for bit
    crossed = _train(tiny_data, tmp_path / "crossed", "cuda", *extra[:-1], "train.max_steps=12",
                     resume=str(tmp_path / "cpu" / "checkpoints" / "latest"))
    assert crossed["step"] == 12
    _assert_same_checkpoint(tmp_path / "cpu", tmp_path / "crossed")
    resumed = _train(tiny_data, tmp_path / "resumed", "cuda", *extra[:-1], "train.max_steps=16",
                     resume=str(tmp_path / "cpu" / "checkpoints" / "latest"))
    assert resumed["step"] == 16 and 0.5 < resumed["auc"] <= 1.0
