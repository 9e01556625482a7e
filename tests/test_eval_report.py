"""``recsys report``: a real run's metrics.jsonl as PNG curves and a Markdown summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recsys.cli import main


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory) -> Path:
    """A tiny run of 2 epochs with an evaluation on a validation split after each and the best
    checkpoint kept (the eval split doubles as the validation split: tiny has no third one)."""
    from serving_data import train_tiny

    out = tmp_path_factory.mktemp("report_run")
    return train_tiny(out, "--set", "train.log_every=4", "--set", f"data.validation.paths=['{out / 'data' / 'eval'}']",
                      "--set", "train.epochs=2", "--set", "train.eval.every_epochs=1", "--set", "train.eval.keep_best='auc'")


def test_report_writes_nonblank_curves_and_a_summary(logged_run, tmp_path, capsys):
    import matplotlib.image as mpimg

    out = tmp_path / "report"
    assert main(["report", str(logged_run), "--out", str(out)]) == 0
    assert "report.md" in capsys.readouterr().out
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["eval.png", "loss.png", "store.png", "throughput.png", "time.png"]
    for name in pngs:
        img = mpimg.imread(out / name)
        assert img.shape[0] >= 250 and img.shape[1] >= 500 and img[..., :3].var() > 1e-4, name
    md = (out / "report.md").read_text()
    evals = [r for r in map(json.loads, (logged_run / "metrics.jsonl").read_text().splitlines())
             if r.get("event") == "eval"]
    final = [r for r in evals if r["split"] == "eval"][-1]
    periodic = [r for r in evals if r["split"] == "validation"]
    oracle = json.loads((logged_run.parent / "data" / "oracle.json").read_text())["eval"]
    assert "`synthetic_tiny`" in md and f"| auc | {final['auc']:.5g} |" in md and "| rows | 2,000 |" in md
    assert f"gap to the final AUC {oracle['auc'] - final['auc']:.5f}" in md
    # the periodic evaluations are reported apart from the final one, with the best checkpoint
    assert len(periodic) == 2
    for r in periodic:
        assert f"| {r['step']} | 2,000 | {r['auc']:.5g} | {r['log_loss']:.5g} |" in md
    best = max(periodic, key=lambda r: r["auc"])
    assert f"Best checkpoint by validation auc: step {best['step']} (auc {best['auc']:.5f})" in md
    for name in pngs:
        assert f"]({name})" in md


def test_report_of_a_directory_without_metrics_fails_clearly(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
