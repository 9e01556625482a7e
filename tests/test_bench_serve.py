"""``recsys bench serve --quick`` runs end to end (real redis-server, services, load process);
the JSON holds the comparisons, computed from the measured numbers. No timings asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from recsys.bench.serve_load import zipf_ids


def test_every_round_draws_from_one_popularity_order():
    """Rounds differ in their draws, not in which ids are hot: rank k is the same id for every
    seed, as a service's traffic keeps its hot ids (a per-seed order made each round's hot set
    new to the service's cache, so every round measured a cold cache)."""
    a, b = (zipf_ids(10_000, 50_000, 1.05, seed) for seed in (0, 1))
    assert not np.array_equal(a, b)
    top = [set(np.argsort(-np.bincount(x, minlength=10_000), kind="stable")[:5].tolist()) for x in (a, b)]
    assert top[0] == top[1]
    assert np.array_equal(a, zipf_ids(10_000, 50_000, 1.05, 0))  # a seed repeats its sequence


@pytest.mark.redis
@pytest.mark.multiproc
@pytest.mark.slow  # the quick bench end to end (make test-slow, in CI)
def test_bench_serve_quick(tmp_path):
    out = tmp_path / "serve.json"
    run = subprocess.run([sys.executable, "-m", "recsys.cli", "bench", "serve", "--quick", "--json", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    names = [c["name"] for c in result["comparisons"]]
    assert names == ["service vs raw redis MGET", "embedded vs raw redis MGET", "service JSON vs binary",
                     "service 1 worker vs raw redis MGET", "service: lookups' hot path vs the full app"]
    for c in result["comparisons"]:
        assert c["ours"] > 0 and c["baseline"] > 0 and c["ratio"] == pytest.approx(c["ours"] / c["baseline"])
    assert result["export"]["rows"] == result["setup"]["rows"] == 100_000
    assert 0 <= result["cache_hit_rate"] <= 1
    for target in ("service", "embedded", "raw_redis"):
        lat = result["latency_at_half_max"][target]
        assert 0 < lat["p50_ms"]["median"] <= lat["p99_ms"]["median"]
    assert result["environment"]["cpu"]["cores"] >= 1 and "simd" in result["environment"]["cpu"]
    assert "service vs raw redis MGET" in run.stdout
    paired = [c for c in result["comparisons"] if "median_paired_ratio" in c]
    assert len(paired) == 4  # every ratio of two targets' rounds, its per-round pairs printed too
    for c in paired:
        assert c["spread"][0] <= c["median_paired_ratio"] <= c["spread"][1]
        assert f"{c['median_paired_ratio']:.3f} ({c['spread'][0]:.3f}-{c['spread'][1]:.3f})" in run.stdout
