"""``recsys bench train`` on tiny sizes: the JSON shape, and every ratio and rate computed
from the measured numbers (rows and seconds the run recorded). No timings asserted."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from recsys import bench
from recsys.bench import train

ROOT = Path(__file__).resolve().parent.parent
TINY = train.Settings(batch_size=256, chunk=2, warmup_chunks=1, timed_chunks=2, scaling=False,
                      job=str(ROOT / "jobs" / "synthetic_tiny.toml"))


def _run(tmp_path, monkeypatch, data: Path, settings: train.Settings) -> tuple[dict, dict]:
    monkeypatch.setattr(train, "QUICK", settings)
    out = tmp_path / "train.json"
    result = bench.run("train", json_out=out, quick=True, data=data)
    return result, json.loads(out.read_text())


def _check_common(result: dict, saved: dict, s: train.Settings) -> dict:
    assert saved["target"] == "train" and saved["quick"] is True
    assert [c["name"] for c in saved["comparisons"]] == [c["name"] for c in result["comparisons"]]
    for c in saved["comparisons"]:
        assert c["ours"] > 0 and c["baseline"] > 0
        assert abs(c["ratio"] - c["ours"] / c["baseline"]) < 1e-9
    by_name = {c["name"]: c for c in saved["comparisons"]}
    d = saved["details"]

    # rates are the recorded rows over the recorded seconds, after the warm-up only
    timed_rows = s.timed_steps * s.batch_size
    assert d["ours"]["timed_rows"] == timed_rows
    assert d["ours"]["samples_per_s"] == pytest.approx(timed_rows / d["ours"]["timed_seconds"])
    for side in ("torchrec", "dense_only"):
        assert d[side]["timed_rows"] == timed_rows
        assert len(d[side]["seconds_per_segment"]) == s.timed_chunks
        assert d[side]["samples_per_s"] == pytest.approx(timed_rows / sum(d[side]["seconds_per_segment"]))
    vs_peer, vs_limit = by_name["ours vs torchrec DMP fused"], by_name["ours vs dense-only limit"]
    assert vs_peer["ours"] == d["ours"]["samples_per_s"] == vs_limit["ours"]
    assert vs_peer["baseline"] == d["torchrec"]["samples_per_s"]
    assert vs_limit["baseline"] == d["dense_only"]["samples_per_s"]
    # one pause per segment: the warm-up one, then one per timed segment
    assert len(d["pauses_s"]) == s.timed_chunks + 1

    # both trained the same steps, then scored the whole eval split
    auc = by_name["AUC ours vs torchrec"]
    assert d["ours"]["eval"]["step"] == s.steps
    assert d["ours"]["eval"]["rows"] == d["torchrec"]["eval"]["rows"] > 0
    assert auc["ours"] == auc["auc_ours"] == d["ours"]["eval"]["auc"]
    assert auc["baseline"] == auc["auc_torchrec"] == d["torchrec"]["eval"]["auc"]
    assert auc["auc_difference"] == pytest.approx(auc["auc_ours"] - auc["auc_torchrec"])
    assert 0.0 < auc["auc_ours"] < 1.0 and 0.0 < auc["auc_torchrec"] < 1.0

    # the peer is what the benchmark says it is
    peer = d["torchrec"]
    assert peer["compute_kernels"] == ["fused"]
    assert peer["pipelined_modules"] == ["ShardedEmbeddingBagCollection"]
    assert len(peer["table_rows"]) == saved["settings"]["features"]

    settings = saved["settings"]
    assert settings["steps"] == s.steps and settings["batch_size"] == s.batch_size
    assert settings["torch_threads"] == s.threads
    assert {"torch", "torchrec", "fbgemm_gpu", "numpy", "numba", "pyarrow"} <= set(saved["versions"])
    return by_name


@pytest.mark.slow  # every check but the 3-row table is test_train_bench_two_processes' too (it runs this and more)
def test_train_bench_quick_writes_json(tmp_path, monkeypatch, capsys, tiny_data):
    result, saved = _run(tmp_path, monkeypatch, tiny_data, TINY)
    by_name = _check_common(result, saved, TINY)
    assert set(by_name) == {"ours vs torchrec DMP fused", "ours vs dense-only limit", "AUC ours vs torchrec"}
    assert saved["details"]["two_processes"] is None and saved["details"]["one_process"] is None
    assert "ratio" in capsys.readouterr().out


@pytest.mark.multiproc
@pytest.mark.slow  # the bench end to end at tiny sizes, two processes (make test-slow, in CI)
def test_train_bench_two_processes(tmp_path, monkeypatch, capsys, tiny_data):
    s = train.Settings(**{**TINY.__dict__, "scaling": True, "scaling_rounds": 1})  # 2 runs: make test's time
    result, saved = _run(tmp_path, monkeypatch, tiny_data, s)
    by_name = _check_common(result, saved, s)
    assert "ratio" in capsys.readouterr().out
    one, two = saved["details"]["one_process"], saved["details"]["two_processes"]
    scaling = by_name["2 processes vs 1 (ours)"]
    rounds = s.scaling_rounds
    for side, world in ((one, 1), (two, 2)):  # the same global batches, every round
        assert len(side["rounds"]) == rounds
        assert [r["timed_rows"] for r in side["rounds"]] == [s.timed_steps * s.batch_size] * rounds
        assert side["timed_rows"] == rounds * s.timed_steps * s.batch_size
        assert side["batch_per_rank"] == s.batch_size // world
        assert side["threads_per_rank"] == (s.threads if world == 1 else 1)
        assert side["samples_per_s"] == pytest.approx(side["timed_rows"] / side["timed_seconds"])
        assert side["timed_seconds"] == pytest.approx(sum(r["timed_seconds"] for r in side["rounds"]))
    assert scaling["ours"] == two["samples_per_s"] and scaling["baseline"] == one["samples_per_s"]
    ratios = [a["timed_seconds"] / b["timed_seconds"] for a, b in zip(one["rounds"], two["rounds"])]
    assert scaling["paired_ratios"] == [round(r, 4) for r in ratios]
    assert math.isfinite(scaling["ratio"])


# --------------------------------------------------------------------------- the quick bench's sizing


def test_the_quick_settings_fit_the_quick_data_a_fresh_checkout_generates(tmp_path, monkeypatch):
    """`recsys bench train --quick` on a fresh checkout generates its data set, then checks that
    each of the 2 processes surely has data for every step: that check passes on it."""
    monkeypatch.setattr(train, "QUICK_DATA", tmp_path / "train-quick")
    root = train.ensure_data(True, None)
    assert root == tmp_path / "train-quick" and (root / "oracle.json").exists()
    train._check_rank_data(root, train.QUICK)  # raises if a rank may run out of data
    assert train._train_rows(root) // train.QUICK.batch_size >= train.QUICK.steps  # the 1-process run's batches
    preset = train._quick_preset()
    assert train.steps_each_rank_surely_has(preset.train_rows, preset.row_group_size,
                                            train.QUICK.batch_size) >= train.QUICK.steps


def test_a_misconfigured_bench_is_one_line_through_the_cli(tiny_data, capsys):
    """The quick sizes on a set too small for them: exit code 2 and one line naming the set,
    no traceback, nothing trained."""
    from recsys.cli import main

    assert main(["bench", "train", "--quick", "--data", str(tiny_data)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert lines[0].startswith(f"recsys bench: error: bench train: {tiny_data}: {train.QUICK.steps} steps of "
                               f"{train.QUICK.batch_size // 2} rows per rank may run a rank out of data"), lines[0]
    assert "ratio" not in captured.out  # no table: it stopped before measuring


@pytest.mark.slow  # the whole quick bench (3 sides, 31 steps of 4,096 rows, then 2 processes): minutes here
def test_the_quick_bench_runs_end_to_end_through_the_cli(tmp_path, monkeypatch, capsys):
    from recsys.cli import main

    monkeypatch.setattr(train, "QUICK_DATA", tmp_path / "train-quick")
    out = tmp_path / "quick.json"
    assert main(["bench", "train", "--quick", "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    by_name = _check_common(saved, saved, train.QUICK)
    # 31 steps of 4,096 rows learn most of what the quick set's hidden model holds (oracle AUC
    # 0.851; measured: ours 0.772, torchrec's 0.759): a side that stops learning (frozen rows,
    # a model scored untrained) ends near 0.5 and fails here
    auc = by_name["AUC ours vs torchrec"]
    assert auc["oracle_auc"] - 0.11 <= auc["auc_ours"] <= auc["oracle_auc"], auc
    assert auc["oracle_auc"] - 0.13 <= auc["auc_torchrec"] <= auc["oracle_auc"], auc
    assert saved["details"]["two_processes"]["timed_rows"] == train.QUICK.timed_steps * train.QUICK.batch_size
