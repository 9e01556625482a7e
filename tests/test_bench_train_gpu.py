"""``recsys bench train --device cuda`` (recsys/bench/train_gpu.py) on tiny sizes: the whole
benchmark's code on device "cpu" (and on "cuda" where there is a GPU): the JSON's shape,
every side trained, rates and ratios computed from the recorded seconds. No timings asserted."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from recsys import bench
from recsys.bench import train_gpu
from recsys.cli import main

ROOT = Path(__file__).resolve().parent.parent
TINY = train_gpu.Settings(batch_size=256, chunk=4, warmup_chunks=1, timed_chunks=3, threads=1, dense_batches=2,
                          device="cpu", lr_warmup_steps=0, child_timeout_s=600.0,
                          job=str(ROOT / "jobs" / "synthetic_tiny.toml"))
TRAINED = ("ours", "ours_cache", "ours_host", "ours_keymap", "ours_keymap_cache", "plain_torch")


def _run(tmp_path, monkeypatch, data: Path, s: train_gpu.Settings) -> tuple[dict, dict]:
    monkeypatch.setattr(train_gpu, "QUICK", s)
    out = tmp_path / "train_gpu.json"
    result = bench.run("train_gpu", json_out=out, quick=True, data=data)
    return result, json.loads(out.read_text())


def _check(result: dict, saved: dict, s: train_gpu.Settings, with_torchrec: bool) -> None:
    assert saved["target"] == "train_gpu" and saved["quick"] is True
    assert [c["name"] for c in saved["comparisons"]] == [c["name"] for c in result["comparisons"]]
    d, settings = saved["details"], saved["settings"]
    timed = ("dense_only", *TRAINED) + (("torchrec",) if with_torchrec else ())
    rows = s.timed_steps * s.batch_size
    for name in timed:
        side = d[name]
        assert side["timed_rows"] == rows and len(side["seconds_per_segment"]) == s.timed_chunks
        assert side["samples_per_s"] > 0
        assert side["samples_per_s"] == pytest.approx(rows / sum(side["seconds_per_segment"]))
        lo, hi = side["min_max_samples_per_s"]
        assert lo <= side["median_samples_per_s"] <= hi
    for name in TRAINED + (("torchrec",) if with_torchrec else ()):  # each side that trains learned something
        assert d[name]["eval"]["auc"] > 0.5, (name, d[name]["eval"])
        assert d[name]["eval"]["rows"] == d["plain_torch"]["eval"]["rows"] > 0
    for name in train_gpu.OURS:
        assert d[name]["eval"]["step"] == s.steps
        assert 0.0 <= d[name]["store_hit_rate"] <= 1.0
        assert d[name]["phase_ms_per_step"]
    # the GPU tier holds whole tables, the cache a share, the host store nothing
    assert d["ours"]["device_rows_fraction_of_capacity"] == 1.0
    assert 0.0 < d["ours_cache"]["device_rows_fraction_of_capacity"] < 1.0
    assert d["ours_host"]["device_rows"] == 0 and d["ours_host"]["device_cache_hit_rate"] is None
    for name in ("ours", "ours_cache"):
        assert 0.0 < d[name]["device_cache_hit_rate"] <= 1.0
    # the device key map: whole tables, and as a cache of a share in front of host tables
    assert d["ours_keymap"]["device_rows_fraction_of_capacity"] == 1.0
    assert 0.0 < d["ours_keymap_cache"]["device_rows_fraction_of_capacity"] < 1.0
    assert 0.0 < d["ours_keymap_cache"]["device_cache_hit_rate"] < 1.0
    assert "store.device.key_map='device'" in d["ours_keymap_cache"]["overrides"]

    by_name = {c["name"]: c for c in saved["comparisons"]}
    pairs = {"ours (GPU tables) vs plain PyTorch EmbeddingBag": ("ours", "plain_torch"),
             "ours (GPU tables) vs dense-only limit": ("ours", "dense_only"),
             "ours GPU cache 10% vs store on host": ("ours_cache", "ours_host"),
             "ours device key map (GPU tables) vs plain PyTorch EmbeddingBag": ("ours_keymap", "plain_torch"),
             "ours device key map vs ours (GPU tables)": ("ours_keymap", "ours"),
             "ours device key map, GPU cache 10% vs store on host": ("ours_keymap_cache", "ours_host")}
    if with_torchrec:
        pairs["ours (GPU tables) vs torchrec DMP fused"] = ("ours", "torchrec")
    assert set(by_name) == {*pairs, "AUC ours vs plain PyTorch"}
    for name, (a, b) in pairs.items():
        c = by_name[name]
        assert c["ours"] == d[a]["samples_per_s"] and c["baseline"] == d[b]["samples_per_s"]
        assert c["ratio"] == pytest.approx(c["ours"] / c["baseline"]) and c["paired_rounds"] == s.timed_chunks
    auc = by_name["AUC ours vs plain PyTorch"]
    assert auc["auc"]["ours_host"] == d["ours_host"]["eval"]["auc"]
    assert auc["auc_difference"] == pytest.approx(auc["ours"] - auc["baseline"])

    assert settings["steps"] == s.steps and settings["batch_size"] == s.batch_size
    assert {"torch", "numpy", "cuda"} <= set(saved["versions"])
    assert saved["environment"]["cpu"]["model"]
    assert all(math.isfinite(v) for v in saved["seconds_per_part"].values())


@pytest.mark.slow  # 22 s, like the CPU bench's whole quick run; make gpu-check runs it on a GPU
def test_train_gpu_bench_tiny_on_cpu(tmp_path, monkeypatch, capsys, tiny_data):
    result, saved = _run(tmp_path, monkeypatch, tiny_data, TINY)
    _check(result, saved, TINY, with_torchrec=True)  # on CPU, (c) is the CPU bench's torchrec peer
    assert saved["settings"]["device"] == "cpu" and saved["settings"]["gpu"] is None
    assert saved["details"]["torchrec"]["eval"]["auc"] > 0.5
    out = capsys.readouterr().out
    assert "ratio" in out and "device: cpu" in out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_train_gpu_bench_tiny_on_cuda(tmp_path, monkeypatch, tiny_data):
    s = dataclasses.replace(TINY, device="cuda")
    result, saved = _run(tmp_path, monkeypatch, tiny_data, s)
    reason = train_gpu.torchrec_skip_reason("cuda")
    _check(result, saved, s, with_torchrec=reason is None)
    assert saved["settings"]["gpu"] == torch.cuda.get_device_name(0)
    if reason is not None:
        assert saved["details"]["torchrec"] == {"skipped": reason}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_device_cuda_without_gpu_is_one_line(capsys):
    assert main(["bench", "train", "--quick", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a CUDA GPU" in err[0], err


def test_device_cuda_is_for_train_only(capsys):
    assert main(["bench", "store", "--device", "cuda"]) == 2
    assert "--device cuda is for `recsys bench train` only" in capsys.readouterr().err
