"""``recsys bench quality --quick``: it runs end to end (ours, gradient boosting, logistic
regression on the same splits) and the JSON's summaries and comparisons are computed from
its own runs. Figures are not asserted."""

from __future__ import annotations

import json

import numpy as np
import pytest

from recsys import bench
from recsys.bench import quality


def test_quality_quick_shape(tmp_path, monkeypatch):
    monkeypatch.setattr(quality, "SETS_RUN", ("synthetic", "fair"))
    monkeypatch.setattr(quality, "DATA", tmp_path / "quality-data")
    monkeypatch.setattr(quality, "RUNS", tmp_path / "runs")
    out = tmp_path / "quality.json"
    result = bench.run("quality", json_out=out, quick=True, data=tmp_path / "tiny")
    saved = json.loads(out.read_text())
    assert saved["target"] == "quality" and saved["quick"] is True and saved["seeds"] == [0]
    assert saved["threads"] == quality.QUICK_THREADS == 1
    assert set(saved["sets"]) == {"synthetic", "fair"}
    assert saved["environment"]["cpu"]["model"]
    fair = saved["sets"]["fair"]
    assert fair["rows"] == {"train": 4456, "validation": 955, "eval": 955}  # 70 / 15 / 15 % of 6,366
    for entry in saved["sets"].values():
        for model in ("ours", "gbdt", "logreg"):
            runs = entry[model]["runs"]
            s = entry[model]["summary"]
            assert s["seeds"] == len(runs) == 1
            assert s["auc_mean"] == pytest.approx(np.mean([r["auc"] for r in runs]))
            assert 0.0 < s["auc_mean"] < 1.0 and s["log_loss_mean"] > 0.0
        assert entry["gbdt"]["chosen"] in quality.HGB_GRID_QUICK
        assert entry["logreg"]["chosen"]["C"] in quality.LR_GRID_QUICK
        assert entry["ours"]["runs"][0]["best_step"] is not None  # early stopping kept a checkpoint
    synth = saved["sets"]["synthetic"]
    oracle = json.loads((tmp_path / "tiny" / "oracle.json").read_text())["eval"]
    assert synth["oracle"]["gap"] == pytest.approx(oracle["auc"] - synth["ours"]["summary"]["auc_mean"])
    for c in saved["comparisons"]:
        assert c["ratio"] == pytest.approx(c["ours"] / c["baseline"])
        assert c["difference"] == pytest.approx(c["ours"] - c["baseline"])
    assert len(saved["comparisons"]) == 2 * 2 + 1
    assert [c["name"] for c in result["comparisons"]] == [c["name"] for c in saved["comparisons"]]


def test_real_sets_come_from_the_installed_package_and_split_by_profile(tmp_path):
    import pyarrow.parquet as pq

    s = quality.SETS["randhie"]
    cols = quality.read_set(s)
    assert cols["label"].shape == (20_190,) and set(np.unique(cols["label"])) == {0, 1}
    root = quality.prepare(s, tmp_path)
    splits = {k: pq.read_table(root / k) for k in ("train", "validation", "eval")}
    assert sum(t.num_rows for t in splits.values()) == 20_190
    assert 0.69 < splits["train"].num_rows / 20_190 < 0.71
    features = [*s.dense, *s.ids]

    def profiles(t):
        return {tuple(row) for row in zip(*(t.column(c).to_pylist() for c in features))}

    tr, va, ev = (profiles(splits[k]) for k in ("train", "validation", "eval"))
    assert not (tr & va) and not (tr & ev) and not (va & ev)  # no person in two splits


def test_bad_thread_count_is_refused_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr(quality, "RUNS", tmp_path / "runs")
    with pytest.raises(ValueError, match=r"bench quality: threads must be >= 1 .* found 0"):
        quality.measure(quick=True, data=tmp_path / "tiny", threads=0)
    assert not (tmp_path / "tiny").exists() and not (tmp_path / "runs").exists()
