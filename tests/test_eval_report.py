"""``recsys report``: a real run's metrics.jsonl as PNG curves and a Markdown summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recsys.cli import main


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory) -> Path:
    from serving_data import train_tiny

    return train_tiny(tmp_path_factory.mktemp("report_run"), "--set", "train.log_every=4")


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
    final = [json.loads(line) for line in (logged_run / "metrics.jsonl").read_text().splitlines()
             if '"eval"' in line][-1]
    oracle = json.loads((logged_run.parent / "data" / "oracle.json").read_text())["eval"]
    assert "`synthetic_tiny`" in md and f"| auc | {final['auc']:.5g} |" in md
    assert f"gap to the final AUC {oracle['auc'] - final['auc']:.5f}" in md
    for name in pngs:
        assert f"]({name})" in md


def test_report_of_a_directory_without_metrics_fails_clearly(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
