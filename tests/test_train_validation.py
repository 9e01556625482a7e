"""Validation-driven training: periodic evaluations on a validation split, the best checkpoint
kept as checkpoints/best, early stopping at the peak, and all of it carried by a resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recsys.checkpoint import read as checkpoint_files
from test_train import JOB, overrides


@pytest.fixture(scope="module")
def tiny(tiny_data) -> Path:
    return tiny_data


def _run(data: Path, run_dir: Path, *extra: str) -> dict:
    from recsys.config import load_job
    from recsys.train.loop import Trainer, setup_env

    # the eval split doubles as the validation split here: tiny has no third one
    job = load_job(JOB, overrides(data, f"data.validation.paths=['{data / 'eval'}']", *extra))
    trainer = Trainer(job, run_dir, setup_env("cpu"))
    try:
        return trainer.train()
    finally:
        trainer.close()


def _evals(run_dir: Path) -> list[dict]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r.get("event") == "eval" and r.get("split") == "validation"]


def test_early_stopping_stops_after_the_peak_and_keeps_the_best(tiny, tmp_path):
    run_dir = tmp_path / "run"
    # 8 epochs of the tiny set overfit (the job file says a second one already does)
    result = _run(tiny, run_dir, "train.epochs=8", "train.eval.every_epochs=1", "train.eval.keep_best='auc'",
                  "train.eval.early_stopping_patience=2", "train.checkpoint.keep_last=1")
    evals = _evals(run_dir)
    aucs = [e["auc"] for e in evals]
    peak = max(range(len(aucs)), key=aucs.__getitem__)
    assert result["stopped"] == "early stopping" and result["epoch"] < 8
    assert len(evals) == peak + 1 + 2  # stopped exactly `patience` evaluations after the peak
    assert result["best"] == {"metric": "auc", "value": aucs[peak], "step": evals[peak]["step"]}
    best = checkpoint_files.resolve(run_dir / "checkpoints" / "best")
    assert checkpoint_files.load_meta(best)["step"] == evals[peak]["step"]
    assert best != checkpoint_files.latest(run_dir / "checkpoints")  # kept past keep_last=1
    # the best checkpoint scores what the trainer logged for it, through `recsys eval`'s path
    from recsys.eval.scoring import evaluate_checkpoint

    again = evaluate_checkpoint(run_dir / "checkpoints" / "best", [str(tiny / "eval")])
    assert again["auc"] == pytest.approx(aucs[peak], abs=1e-12)


def test_a_resume_keeps_the_best_so_far_and_the_count(tiny, tmp_path):
    from recsys.config import load_job
    from recsys.train.loop import Trainer, setup_env

    run_dir = tmp_path / "run"
    first = _run(tiny, run_dir, "train.epochs=3", "train.eval.every_epochs=1", "train.eval.keep_best='log_loss'",
                 "train.eval.early_stopping_patience=5")
    job = load_job(JOB, overrides(tiny, f"data.validation.paths=['{tiny / 'eval'}']", "train.epochs=4",
                                  "train.eval.every_epochs=1", "train.eval.keep_best='log_loss'",
                                  "train.eval.early_stopping_patience=5"))
    resumed = Trainer(job, run_dir, setup_env("cpu"))
    try:
        assert resumed.best == first["best"]
        evals = _evals(run_dir)
        best_i = min(range(len(evals)), key=lambda i: evals[i]["log_loss"])
        assert resumed.evals_without_improvement == len(evals) - 1 - best_i
    finally:
        resumed.close()


def test_keep_best_needs_periodic_evaluations():
    from recsys.config import ConfigError, load_job

    with pytest.raises(ConfigError, match=r"train.eval: keep_best and early_stopping_patience need periodic evaluations"):
        load_job(JOB, ["train.eval.keep_best='auc'"])


# --------------------------------------------------------------------------- validation_fraction


def _row_ids(data: Path, keys: list[str]) -> set[int]:
    """Row ids of the row groups ``<file>#<row group>`` under ``data/train``."""
    import pyarrow.parquet as pq

    out: set[int] = set()
    for key in keys:
        name, rg = key.rsplit("#", 1)
        table = pq.ParquetFile(data / "train" / name).read_row_group(int(rg), columns=["row_id"])
        out |= set(table.column("row_id").to_pylist())
    return out


def test_held_out_row_groups_are_stable_whole_and_never_all():
    from recsys.io.units import held_out

    keys = [f"part-{f:05d}.parquet#{rg}" for f in range(4) for rg in range(3)]
    mask = held_out(keys, 0.25, seed=0)
    assert mask.sum() == 3
    assert (held_out(list(reversed(keys)), 0.25, seed=0) == mask[::-1]).all()  # by key, not position
    assert not (held_out(keys, 0.25, seed=1) == mask).all()  # the seed changes the choice
    assert held_out(keys, 0.01, seed=0).sum() == 1  # at least one row group
    assert not held_out(keys, 0.0, seed=0).any()


def test_validation_fraction_never_trains_on_the_rows_it_validates_on(tiny, tmp_path):
    import pyarrow.dataset as ds

    from recsys.train.rows import consumed
    from test_train import run

    run_dir = tmp_path / "run"
    run(tiny, run_dir, "train.eval.validation_fraction=0.25", "train.eval.every_epochs=1", "train.epochs=2",
        "train.record_rows=true", "data.train.passthrough=['row_id']")
    record = json.loads((run_dir / "validation.json").read_text())
    assert record["fraction"] == 0.25 and len(record["row_groups"]) == 3
    held = _row_ids(tiny, record["row_groups"])
    assert len(held) == record["rows"] > 0
    everything = set(ds.dataset(tiny / "train").to_table(columns=["row_id"]).column("row_id").to_pylist())
    for epoch, ids in consumed(run_dir).items():  # every other row, once per epoch; no held-out row
        assert sorted(ids.tolist()) == sorted(everything - held), f"epoch {epoch}"
    evals = _evals(run_dir)
    assert len(evals) == 2 and all(e["rows"] == record["rows"] for e in evals)


def test_validation_fraction_and_validation_paths_are_one_or_the_other(tiny, tmp_path):
    from recsys.config import ConfigError

    with pytest.raises(ConfigError, match="validation_fraction"):
        _run(tiny, tmp_path / "run", "train.eval.validation_fraction=0.25")
