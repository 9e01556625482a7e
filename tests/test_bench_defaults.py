"""``recsys bench defaults``: the studied keys are removed from each set's job and nothing
else; every candidate trains the same repetitions with their own seeds; the paired figures
are the candidates' own. Training itself is faked in the fast test (the quality bench's
tests run it for real); the quick run through the CLI trains for real (slow)."""

from __future__ import annotations

import json
import tomllib

import numpy as np
import pytest

from recsys import bench
from recsys.bench import defaults, quality
from recsys.config import load_job


def test_bare_job_drops_only_the_studied_keys(tmp_path):
    job = quality.ROOT / "jobs" / "quality_synthetic_small.toml"
    original = tomllib.loads(job.read_text())
    assert "dense_transform" in original["schema"] and "initial_accumulator" in original["store"]
    bare = defaults.bare_job(job, tmp_path)
    data = tomllib.loads(bare.read_text())
    assert "dense_transform" not in data["schema"]
    assert "lr" not in data["store"] and "initial_accumulator" not in data["store"]
    for section in ("schema", "store"):
        original[section] = {k: v for k, v in original[section].items()
                             if f"{section}.{k}" not in defaults.STUDIED}
    assert data == original  # everything else kept, tables and features included
    loaded = load_job(bare)  # and it is a job that loads
    assert loaded.schema.dense_buckets == 32 and loaded.model.wide is True


def test_previous_defaults_are_valid_overrides():
    job = load_job(quality.ROOT / "jobs" / "quality_fair.toml", defaults.overrides_of(defaults.PREVIOUS))
    assert job.schema.dense_transform == "signed_log1p"
    assert job.store.lr == 0.01 and job.store.initial_accumulator == 0.0


def test_measure_pairs_each_candidate_on_the_same_repetitions(tmp_path, monkeypatch):
    monkeypatch.setattr(quality, "DATA", tmp_path / "quality-data")
    monkeypatch.setattr(quality, "RUNS", tmp_path / "runs")
    seen = []

    def fake_train(job_path, seed, run_dir, overrides):
        seen.append((seed, run_dir, tuple(overrides)))
        load_job(job_path, overrides)  # the overrides must make a valid job
        # a made-up AUC: the split's own luck, plus 0.003 for the previous defaults
        return {"auc": 0.7 + 0.01 * seed + (0.003 if "store.lr=0.01" in overrides else 0.0), "log_loss": 0.5}

    monkeypatch.setattr(quality, "train_ours", fake_train)
    result = defaults.measure(quick=False, sets=("fair",), splits=3, threads=1)
    fair = result["sets"]["fair"]
    assert [r["unit"] for r in fair["runs"]] == ["split 0", "split 1", "split 2"]
    assert len(seen) == 6 and [s for s, _, _ in seen] == [0, 0, 1, 1, 2, 2]
    assert all("train.runtime.threads=1" in o for _, _, o in seen)
    d = fair["differences"]["defaults - previous"]
    assert d["mean"] == pytest.approx(-0.003) and d["wins"] == 0 and d["splits"] == 3
    assert fair["auc_mean"]["defaults"] == pytest.approx(0.71)  # splits 0, 1, 2
    diffs = [r["defaults"]["auc"] - r["previous"]["auc"] for r in fair["runs"]]
    assert d["mean"] == pytest.approx(np.mean(diffs))
    (c,) = result["comparisons"]
    assert c["name"] == "fair: eval AUC, defaults vs previous, paired over 3"
    assert c["difference"] == pytest.approx(d["mean"]) and c["interval_95"] == [d["low"], d["high"]]


def test_measure_needs_two_candidates():
    with pytest.raises(ValueError, match="at least two candidates"):
        defaults.measure(quick=True, candidates={"defaults": []})


@pytest.mark.slow
def test_defaults_quick_through_the_cli(tmp_path, monkeypatch):
    monkeypatch.setattr(quality, "DATA", tmp_path / "quality-data")
    monkeypatch.setattr(quality, "RUNS", tmp_path / "runs")
    out = tmp_path / "defaults.json"
    bench.run("defaults", json_out=out, quick=True, data=tmp_path / "tiny")
    saved = json.loads(out.read_text())
    assert set(saved["sets"]) == set(defaults.QUICK_SETS)
    for entry in saved["sets"].values():
        (run,) = entry["runs"]
        assert 0.0 < run["defaults"]["auc"] < 1.0 and 0.0 < run["previous"]["auc"] < 1.0
