"""``recsys bench scale --quick`` through the CLI: the JSON's shape and the facts its figures
rest on (rows grow with the ids, the spilled size spilled, hit rates are rates, a stored row
costs more than its payload). Never timings."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from recsys.bench import scale_plan as scale

ROOT = Path(__file__).resolve().parents[1]


def test_plan_in_memory_then_spilled_then_stopped():
    s = scale.Settings(sizes=(1_000, 10_000), memory_limit_rows=None)
    mem = [{"mode": "memory", "distinct_ids": 10_000, "bytes_per_row": 200.0, "store_rss_bytes": 2e6,
            "peak_bytes_per_id_over_start": 500.0}]
    assert scale.plan_size(s, 10_000, None, mem, available=1 << 34)["spill_fraction"] is None
    # 545 bytes per spilled id planned (0.1 x 200 in memory + 300 checkpoint + 0.9 x 250 Redis),
    # 500 per id in memory: 10^9 fits neither way in 0.8 x 4e11, 5 x 10^8 spilled does
    spilled = scale.plan_size(s, 10**9, 10**8, mem, available=400 * 10**9)
    assert spilled["spill_fraction"] == s.spill_capacity_fraction and spilled["ids"] == 5 * 10**8
    assert "stopped" in scale.plan_size(s, 10**12, 10**11, mem, available=400 * 10**9)
    forced = dataclasses.replace(s, memory_limit_rows=5_000)
    assert scale.plan_size(forced, 10_000, 1_000, [], available=1 << 34)["spill_fraction"] is not None


def test_universes_and_capacities():
    unis = scale.universes(1_000_000)
    assert len(unis) == 26 and min(unis) >= 3 and abs(sum(unis) - 1_000_000) < 2_000
    s = scale.Settings(batch=1024)
    caps = scale.capacities(s, unis, 0.1)
    assert all(min(u, 2 * s.batch) <= c <= u for u, c in zip(unis, caps))
    assert scale.capacities(s, unis, None) == unis


@pytest.mark.multiproc
@pytest.mark.slow  # the quick bench end to end (make test-slow, in CI)
def test_quick_through_the_cli(tmp_path):
    out = tmp_path / "scale.json"
    proc = subprocess.run([sys.executable, "-m", "recsys.cli", "bench", "scale", "--quick", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "samples/s" in proc.stdout and "stopped:" in proc.stdout
    r = json.loads(out.read_text())
    assert r["target"] == "scale" and r["quick"] is True
    assert r["environment"]["cpu"]["model"] and "simd" in r["environment"]["cpu"]
    sizes = r["sizes"]
    assert [x["mode"] for x in sizes] == ["memory", "spill"]  # --quick: 10 k in memory, 100 k spilled
    ids = [x["distinct_ids"] for x in sizes]
    assert ids == sorted(ids) and ids[1] > 5 * ids[0]
    for x in sizes:
        assert x["rows_in_memory"] + x["rows_spilled"] == x["distinct_ids"]
        assert x["rows_in_memory"] <= x["capacity_rows"]
        assert 0.0 <= x["hit_rate"] <= 1.0
        assert x["bytes_per_row"] > x["payload_bytes_per_row"] == x["dim"] * 4 + 4
        assert x["arrays_bytes_per_row"] > x["payload_bytes_per_row"]
        # the store's resident arrays: more than the payload, less than the process's growth
        assert x["payload_bytes_per_row"] < x["store_resident_bytes_per_row"] < x["bytes_per_row"]
        assert x["samples_per_s"] > 0 and len(x["segment_samples_per_s"]) == 3
        assert x["checkpoint_s"] > 0 and x["restore_s"] > 0 and x["checkpoint_bytes"] > 0
        assert x["rows_after_restore"] == x["rows_in_memory"]
        assert x["unique_keys_per_step"] > 0
        assert {"sparse_lookup_wait", "dense_fwd_bwd", "push_and_optimizer"} <= set(x["phase_ms_per_step"])
    mem, spill = sizes
    assert mem["hit_rate"] == 1.0 and mem["rows_spilled"] == 0  # every id held: nothing to miss
    assert spill["rows_spilled"] > 0 and spill["hit_rate"] < 1.0
    assert spill["spill_reads_per_step"] > 0 and spill["spill_writes_per_step"] > 0
    assert spill["spill_read_us_per_row"] > 0 and spill["spill_write_us_per_row"] > 0
    assert spill["redis_bytes_per_spilled_row"] > 0 and spill["longest_step_over_median"] >= 1.0
    for c in r["comparisons"]:
        assert c["ours"] > 0 and c["baseline"] > 0 and math.isclose(c["ratio"], c["ours"] / c["baseline"])
    assert sizes[0]["ratio_to_first"] == 1.0
    model = r["cost_model_1b"]
    assert model["ids"] == 10**9 and model["nodes"] >= 1 and model["all_to_all_bytes_per_step_per_rank"]
