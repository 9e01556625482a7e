"""``recsys tune --cv K``: the folds partition the training rows (real Parquet), a trial's
value is its folds' mean with their spread, the pruner sees the folds' running mean,
``best.toml`` trains on every training row for a fixed number of epochs; and the
multi-fidelity pruners (``--pruner hyperband|halving``) prune."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "jobs" / "synthetic_tiny.toml"

SPACE = """
[params]
"store.lr" = { low = 0.01, high = 0.2, log = true }
"model.top_mlp" = { choices = [[64, 1], [32, 16, 1]] }
"""


def _sets(data: Path) -> list[str]:
    return [f"data.train.paths=['{data / 'train'}']", f"data.eval.paths=['{data / 'eval'}']",
            "train.schedule.warmup_steps=0"]


@pytest.fixture
def space(tmp_path) -> Path:
    path = tmp_path / "space.toml"
    path.write_text(SPACE)
    return path


def _row_ids(cfg, schema) -> list[int]:
    import dataclasses

    from recsys.io.reader import ParquetReader

    cfg = dataclasses.replace(cfg, passthrough=["row_id"], shuffle=False, drop_last=False, num_workers=0)
    ids: list[int] = []
    with ParquetReader(cfg, schema) as reader:
        for batch in reader:
            ids += batch.extra["row_id"].tolist()
    return ids


@pytest.mark.parametrize("k, pooled", [(3, False), (5, False), (3, True)])
def test_the_folds_partition_the_training_rows_exactly_once(tiny_data, k, pooled):
    """Fold j validates on the j-th slice and trains on the rest; over the k folds every
    training row is validated on exactly once, and no fold trains on a row it validates on.
    Pooled (a job with validation files of its own): the rows of both sets of files."""
    import pyarrow.dataset as ds

    from recsys.config import JobConfig, apply_overrides, from_dict, read_toml
    from recsys.train.loop import read_splits
    from recsys.tune.run import fold_sets

    dirs = [tiny_data / "train"] + ([tiny_data / "eval"] if pooled else [])
    everything = [i for d in dirs for i in ds.dataset(d).to_table(columns=["row_id"]).column("row_id").to_pylist()]
    paths = tuple(str(d) for d in dirs) if pooled else ()
    validated: list[int] = []
    for j in range(k):
        data = apply_overrides(read_toml(JOB), _sets(tiny_data) + fold_sets(j, k, paths), JobConfig)
        job = from_dict(JobConfig, data, "fold")
        train_cfg, val_cfg = read_splits(job)
        train, val = _row_ids(train_cfg, job.schema), _row_ids(val_cfg, job.schema)
        assert val and train and len(set(train)) == len(train) and len(set(val)) == len(val)
        assert sorted(train + val) == sorted(everything), f"fold {j}"
        validated += val
    assert sorted(validated) == sorted(everything)


def test_auto_cross_validates_a_small_validation_split_only(tiny_data, tmp_path):
    from recsys.errors import UserError
    from recsys.tune.run import CV_FOLDS, TuneOptions, prepare

    def ctx(cv, *sets):
        return prepare(TuneOptions(config=str(JOB), out=str(tmp_path / "o"), sets=_sets(tiny_data) + list(sets), cv=cv))

    auto = ctx("auto")  # tune's validation split of the tiny set: a tenth of its 6 k rows
    assert auto.folds == CV_FOLDS and 0 < auto.validation_rows < 20_000
    assert auto.study.user_attrs["cv_folds"] == CV_FOLDS
    with pytest.raises(UserError, match="scores trials over 5 folds"):  # the study's trials must compare
        ctx("off")
    # a small validation split of its own files: folded with the training files, pooled
    separate = [f"data.validation.paths=['{tiny_data / 'eval'}']", "train.eval.validation_fraction=0"]
    (tmp_path / "o" / "study.journal").unlink()
    own = ctx("auto", *separate)
    assert own.folds == CV_FOLDS and own.pooled == (str(tiny_data / "train"), str(tiny_data / "eval"))
    assert 0 < own.validation_rows < 20_000
    (tmp_path / "o" / "study.journal").unlink()
    assert ctx("3", *separate).folds == 3
    (tmp_path / "o" / "study.journal").unlink()
    assert ctx("off", *separate).folds == 0
    with pytest.raises(UserError, match="--cv must be auto, off or a number of folds"):
        ctx("1")


def test_a_tune_with_three_folds_scores_by_their_mean_and_trains_best_on_every_row(tiny_data, space, tmp_path):
    import optuna

    from recsys.config import load_job
    from recsys.tune.run import TuneOptions, epochs_at, open_storage, tune

    out = tmp_path / "tuned"
    lines: list[str] = []
    sets = _sets(tiny_data) + ["train.epochs=2", "train.eval.early_stopping_patience=1"]
    summary = tune(TuneOptions(config=str(JOB), out=str(out), space=str(space), sets=sets, trials=1, cv="3",
                               pruner="none", seed=0, progress=False), log=lines.append)
    assert summary["complete"] == 1 and summary["cv_folds"] == 3
    assert any(x.startswith("cross-validation: each trial trains 3 times") for x in lines), lines
    study = optuna.load_study(study_name="synthetic_tiny", storage=open_storage("", out))
    (t,) = study.trials
    cv = t.user_attrs["cv"]
    assert cv["folds"] == cv["done"] == 3 and len(cv["values"]) == 3 and len(set(cv["values"])) == 3
    assert t.value == pytest.approx(sum(cv["values"]) / 3) == cv["mean"]
    mean = cv["mean"]
    std = (sum((v - mean) ** 2 for v in cv["values"]) / 2) ** 0.5
    assert cv["std"] == pytest.approx(std) and cv["stderr"] == pytest.approx(std / 3 ** 0.5)
    assert summary["best"]["cv"] == cv
    assert f"validation auc {mean:.5f} ± {std:.5f} (mean ± std over 3 folds" in "\n".join(lines)
    for j in range(3):  # each fold its own run, validating on its own slice; its best epoch as recorded
        run = out / "trials" / "0" / f"fold-{j}"
        record = json.loads((run / "validation.json").read_text())
        assert record["fold"] == j and record["fraction"] == pytest.approx(1 / 3)
        result = json.loads((run / "result.json").read_text())
        assert result["best"]["value"] == cv["values"][j]
        assert cv["best_epochs"][j] == result["best_epochs"] == epochs_at(run, result["best"]["step"])
    # best.toml: every training row, the folds' mean best epochs, no validation, no selection on eval
    best = load_job(out / "best.toml")
    assert best.train.eval.validation_fraction == 0 and not best.data.validation.paths
    assert best.train.epochs == cv["epochs"] == max(1, round(sum(cv["best_epochs"]) / 3)) and not best.train.max_steps
    assert (best.train.eval.keep_best, best.train.eval.early_stopping_patience) == ("", 0)
    assert (best.train.eval.every, best.train.eval.every_epochs) == (0, 0)
    assert "mean over 3 folds" in (out / "best.toml").read_text().splitlines()[0]
    with (out / "trials.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert rows[0]["folds"] == "3" and float(rows[0]["std"]) == pytest.approx(std)


@pytest.mark.slow  # ~10 s (make test-slow, in CI); the pooled folds' partition is checked in make test
def test_a_job_with_validation_files_of_its_own_is_folded_over_both_and_best_trains_on_both(tiny_data, space,
                                                                                             tmp_path):
    """Its own small validation files: each fold trains and validates within the training and
    validation files pooled (no validation files of its own); best.toml trains on all of them."""
    from recsys.config import load_job
    from recsys.tune.run import TuneOptions, tune

    out = tmp_path / "tuned"
    lines: list[str] = []
    pooled = [str(tiny_data / "train"), str(tiny_data / "eval")]
    sets = _sets(tiny_data) + [f"data.validation.paths=['{tiny_data / 'eval'}']", "train.eval.validation_fraction=0",
                               "train.epochs=1", "train.eval.every_epochs=1", "train.eval.keep_best='auc'"]
    summary = tune(TuneOptions(config=str(JOB), out=str(out), space=str(space), sets=sets, trials=1, cv="3",
                               pruner="none", seed=0, progress=False), log=lines.append)
    assert summary["complete"] == 1 and summary["cv_folds"] == 3
    assert any("over the training and validation files pooled" in x for x in lines), lines
    for j in range(3):
        fold = load_job(out / "trials" / "0" / f"fold-{j}" / "config.toml")
        assert list(fold.data.train.paths) == pooled and not fold.data.validation.paths
        assert fold.data.train.holdout_fold == j and fold.train.eval.validation_fraction == pytest.approx(1 / 3)
    best = load_job(out / "best.toml")
    assert list(best.data.train.paths) == pooled and not best.data.validation.paths
    assert best.train.eval.validation_fraction == 0 and best.train.eval.keep_best == ""


def _folds_stub(scores: dict[int, list[float]], calls: list):
    """A ``_train`` whose fold j of trial n scores ``scores[n][j]``."""

    def train(ctx, trial, values, run_dir, fold=None):
        calls.append((trial.number, fold))
        value = scores[trial.number][fold]
        return {"step": 4, "epoch": 2, "best": {"step": 4, "value": value}, "best_epochs": 2.0}, 1

    return train


def test_the_pruner_sees_the_folds_running_mean(tiny_data, space, tmp_path, monkeypatch):
    """Trial 1's second fold (0.5) is below trial 0's (0.6) but its running mean (0.6) is not:
    it goes on; trial 2's first fold is below: pruned there, its later folds never trained."""
    import optuna

    from recsys.tune import run
    from recsys.tune.run import TuneOptions, open_storage, tune

    calls: list = []
    monkeypatch.setattr(run, "_train", _folds_stub({0: [0.6, 0.6, 0.6], 1: [0.7, 0.5, 0.7], 2: [0.5, 0.9, 0.9]}, calls))
    out = tmp_path / "tuned"
    lines: list[str] = []
    summary = tune(TuneOptions(config=str(JOB), out=str(out), space=str(space), sets=_sets(tiny_data), trials=3,
                               cv="3", pruner="median", prune_startup=1, prune_warmup=0, seed=0, progress=False,
                               given_first=False), log=lines.append)
    assert (summary["complete"], summary["pruned"]) == (2, 1), lines
    study = optuna.load_study(study_name="synthetic_tiny", storage=open_storage("", out))
    _, t1, t2 = study.trials
    assert t1.intermediate_values == pytest.approx({1: 0.7, 2: 0.6, 3: 1.9 / 3})
    assert t1.value == pytest.approx(1.9 / 3) and summary["best"]["number"] == 1
    assert t2.state.name == "PRUNED" and t2.intermediate_values == {1: 0.5}
    assert t2.user_attrs["cv"]["done"] == 1 and (2, 1) not in calls
    assert "trial 2 pruned after fold 1 of 3: validation auc 0.50000 (running mean)" in "\n".join(lines)


class _FakeTrainer:
    """A trainer whose evaluation e of trial n scores 0.9 - 0.01 n + 0.001 e (each trial
    worse than the ones before), through the real ``after_validation`` hook."""

    EPOCHS = 9

    def __init__(self, job, run_dir, env):
        self.number = int(Path(run_dir).name)
        self.after_validation = None

    def train(self):
        for e in range(1, self.EPOCHS + 1):
            if self.after_validation(e, {"auc": 0.9 - 0.01 * self.number + 0.001 * e}):
                return {"step": e, "epoch": e, "best": {"metric": "auc", "value": 0.0, "step": e}, "stopped": "pruned"}
        return {"step": self.EPOCHS, "epoch": self.EPOCHS, "best": {"metric": "auc", "value": 0.9, "step": 9}}

    def close(self):
        pass


@pytest.mark.parametrize("pruner", ["hyperband", "halving"])
def test_a_multi_fidelity_pruner_prunes_on_the_validation_evaluations(tiny_data, space, tmp_path, monkeypatch,
                                                                       pruner):
    import optuna

    from recsys.train import loop
    from recsys.tune.run import TuneOptions, open_storage, tune

    monkeypatch.setattr(loop, "Trainer", _FakeTrainer)
    out = tmp_path / "tuned"
    sets = _sets(tiny_data) + ["train.epochs=9", "train.eval.every_epochs=1"]
    summary = tune(TuneOptions(config=str(JOB), out=str(out), space=str(space), sets=sets, trials=8, cv="off",
                               pruner=pruner, prune_warmup=0, seed=0, progress=False, given_first=False),
                   log=lambda _: None)
    study = optuna.load_study(study_name="synthetic_tiny", storage=open_storage("", out))
    kind = optuna.pruners.HyperbandPruner if pruner == "hyperband" else optuna.pruners.SuccessiveHalvingPruner
    from recsys.config import JobConfig, apply_overrides, from_dict, read_toml
    from recsys.tune.run import make_pruner

    job = from_dict(JobConfig, apply_overrides(read_toml(JOB), sets, JobConfig), "job")
    assert isinstance(make_pruner(TuneOptions(config="", out="", pruner=pruner, prune_warmup=0), job, 0), kind)
    pruned = [t for t in study.trials if t.state.name == "PRUNED"]
    assert summary["pruned"] == len(pruned) >= 2 and summary["complete"] >= 1
    assert all(t.last_step < _FakeTrainer.EPOCHS for t in pruned)
    assert all(json.loads((out / "trials" / str(t.number) / "result.json").read_text())["stopped"] == "pruned"
               for t in pruned)
