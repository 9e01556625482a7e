"""``recsys bench store`` on tiny sizes: the JSON shape, ratios from the measured numbers,
and the facts the figures rest on (same losses on both sides, MIN <= LRU). No timings."""

from __future__ import annotations

import json

import numpy as np
import pytest

from recsys import bench
from recsys.bench import store

TINY = store.Settings(
    batch=64, dim=8, universes=(5, 50, 1000, 20_000), steps=2, warmup_rounds=1, repeats=2,
    mem_capacity=5_000, lru_ids=20_000, lru_universe=10_000, lru_batch=256,
    dist_steps=2, dist_warmup_rounds=1, dist_repeats=1, dist_timeout_s=240,
)


def _brute_min(seq: list[int], capacity: int) -> int:
    """Belady's MIN the slow way: on a miss with a full cache, evict the farthest next use."""
    cache: set[int] = set()
    misses = 0
    for i, k in enumerate(seq):
        if k in cache:
            continue
        misses += 1
        if len(cache) == capacity:
            def next_use(x: int) -> int:
                return next((j for j in range(i + 1, len(seq)) if seq[j] == x), len(seq))

            cache.remove(max(cache, key=next_use))
        cache.add(k)
    return misses


def test_belady_matches_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(200):
        seq = rng.integers(0, int(rng.integers(1, 15)), int(rng.integers(1, 60)))
        cap = int(rng.integers(1, 6))
        assert store.belady_misses(seq, cap) == _brute_min(seq.tolist(), cap)


def test_resident_bytes_counts_the_pages_written_not_the_arrays_size():
    """The store's RSS figure (``bench scale``): pages an array was never written on are not
    memory yet; each buffer counts once, however many views of it a table holds."""
    from recsys.store.host import pages

    # fresh mappings, 2 MiB-aligned: 6 MiB written is three huge pages or 1536 small ones, and
    # the 3 MiB array is one huge page and 256 small ones (or all small), 9 MiB either way (on
    # a kernel without THP, np.zeros: the allocator's header page too)
    big, other = pages.zeros((24 << 20,), np.uint8), pages.zeros((3 << 20,), np.uint8)
    assert store.resident_bytes([big, other]) <= 2 * 4096
    big[: 6 << 20] = 1
    other[:] = 1
    held = [big, big[10:20], other, {"again": other.view(np.int32)}]
    assert store.resident_bytes(held) == pytest.approx(9 << 20, abs=4 * 4096)
    assert sum(store.owned_arrays(held).values()) == big.nbytes + other.nbytes


@pytest.mark.multiproc
@pytest.mark.slow  # the quick bench end to end (make test-slow, in CI)
def test_store_bench_quick_writes_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(store, "QUICK", TINY)
    out = tmp_path / "store.json"
    result = bench.run("store", json_out=out, quick=True)
    saved = json.loads(out.read_text())
    assert saved["target"] == "store" and saved["quick"] is True
    names = [c["name"] for c in saved["comparisons"]]
    assert names == [c["name"] for c in result["comparisons"]] and len(names) == 4
    for c in saved["comparisons"]:
        assert c["ours"] > 0 and c["baseline"] > 0
        assert abs(c["ratio"] - c["ours"] / c["baseline"]) < 1e-9
    assert "ratio" in capsys.readouterr().out

    d = saved["details"]
    step, mem, lru, two = saved["comparisons"]
    # samples/s are the best timed runs' own numbers
    best = {k: min(v) for k, v in d["train_step"]["seconds_per_run"].items()}
    assert step["ours"] == pytest.approx(TINY.steps * TINY.batch / best["ours"])
    assert step["baseline"] == pytest.approx(TINY.steps * TINY.batch / best["baseline"])
    assert all(len(v) == TINY.repeats for v in d["train_step"]["seconds_per_run"].values())
    # both sides trained the same rows the same way: losses agree step by step
    assert d["train_step"]["max_abs_loss_diff"] <= 1e-4 * max(1.0, d["train_step"]["max_abs_loss"])
    assert d["train_step"]["store_evictions"] == 0
    assert d["two_ranks"]["max_abs_loss_diff_2_vs_1"] < 1e-4
    # the all-to-all profile: 4 per step at staleness 0 (counts, keys, rows, gradients)
    a2a = d["two_ranks"]["all_to_all"]
    assert sorted(a2a["kinds"]) == ["counts", "grads", "keys", "rows"]
    for kind, k in a2a["kinds"].items():
        assert k["calls_per_step"] == 1.0, kind
        assert k["kib_sent_per_step_rank0"] > 0 and k["transfer_only_ms_per_call"] > 0, kind
    keys, rows, grads = (a2a["kinds"][k] for k in ("keys", "rows", "grads"))
    # rank 0 gets a row for every key it sent, and sends back a gradient of each row
    assert rows["kib_received_per_step_rank0"] == pytest.approx(keys["kib_sent_per_step_rank0"] / 8 * TINY.dim * 4)
    assert grads["kib_sent_per_step_rank0"] == pytest.approx(rows["kib_received_per_step_rank0"])
    # memory: every array counted, at least the payload
    assert mem["baseline"] == TINY.dim * 4 + 4
    assert mem["ours"] * TINY.mem_capacity == pytest.approx(sum(d["memory"]["arrays_bytes"].values()))
    assert mem["ours"] >= mem["baseline"]
    # MIN is optimal: never more misses than LRU, never fewer than the compulsory ones
    m = d["lru"]
    assert m["compulsory_misses"] <= m["belady_misses"] <= m["lru_misses"]
    assert lru["ours"] == m["lru_misses"] / TINY.lru_ids and lru["baseline"] == m["belady_misses"] / TINY.lru_ids

    settings = saved["settings"]
    for key in ("batch", "dim", "universes", "tables", "threads", "repeats", "dist_repeats", "openmp"):
        assert key in settings
    assert {"torch", "torchrec", "fbgemm_gpu", "numpy", "numba"} <= set(saved["versions"])
