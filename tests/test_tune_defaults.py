"""What ``recsys tune`` (and ``recsys train --early-stopping``) supply when the job does not
say: a job as written tunes with no ``--set``, a ``--set`` wins over a default, the study's
first trial is the job as given, and ``best.toml`` is that job when no trial beat it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "jobs" / "synthetic_tiny.toml"
CHOSEN = ("train.eval.keep_best = 'auc'", "train.eval.validation_fraction = 0.1", "train.eval.every_epochs = 1",
          "train.eval.early_stopping_patience = 3")

SPACE = """
[params]
"store.lr" = { low = 0.01, high = 0.2, log = true }
"train.optim.weight_decay" = { low = 1e-8, high = 1e-4, log = true }
"model.top_mlp" = { choices = [[64, 1], [128, 64, 1]] }
"""


def _in_data_dir(tiny_data: Path, tmp_path: Path) -> Path:
    """A working directory where the job's own relative paths (data/synthetic_tiny/...) are the tiny set."""
    cwd = tmp_path / "cwd"
    (cwd / "data").mkdir(parents=True)
    (cwd / "data" / "synthetic_tiny").symlink_to(tiny_data)
    return cwd


def _given_job(*sets: str):
    """The tiny job as tune trains it when it is given as written: its file, the sets, tune's defaults."""
    from recsys.config import JobConfig, apply_overrides, from_dict, read_toml
    from recsys.train.config import early_stopping_defaults

    data, _ = early_stopping_defaults(apply_overrides(read_toml(JOB), list(sets), JobConfig))
    return from_dict(JobConfig, data, "given")


def test_the_defaults_fill_only_what_the_job_leaves_out():
    from recsys.train.config import EARLY_STOPPING_DEFAULTS, early_stopping_defaults

    data, chosen = early_stopping_defaults({"train": {"log_every": 5}})
    assert chosen == EARLY_STOPPING_DEFAULTS and data["train"]["log_every"] == 5
    assert data["train"]["eval"]["validation_fraction"] == 0.1 and data["train"]["epochs"] == 20
    # what the job says wins: its own validation paths, its evaluations, its length, its patience
    job = {"data": {"validation": {"paths": ["v"]}},
           "train": {"max_steps": 100, "eval": {"every": 50, "early_stopping_patience": 0, "keep_best": "log_loss"}}}
    data, chosen = early_stopping_defaults(job)
    assert chosen == {} and data == job
    data, chosen = early_stopping_defaults({"train": {"epochs": 3, "eval": {"every_epochs": 2}}})
    assert set(chosen) == {"train.eval.keep_best", "train.eval.validation_fraction",
                           "train.eval.early_stopping_patience"}
    assert data["train"]["eval"]["every_epochs"] == 2 and data["train"]["epochs"] == 3
    # evaluations turned off: no objective, split or early stopping is supplied (the job's check
    # then names what it lacks), only the epoch cap
    data, chosen = early_stopping_defaults({"train": {"eval": {"every_epochs": 0}}})
    assert set(chosen) == {"train.epochs"}
    assert "keep_best" not in data["train"]["eval"] and "early_stopping_patience" not in data["train"]["eval"]


def test_a_set_overriding_a_default_wins(tiny_data, tmp_path):
    from recsys.tune.run import TuneOptions, prepare

    sets = [f"data.train.paths=['{tiny_data / 'train'}']", f"data.eval.paths=['{tiny_data / 'eval'}']",
            "train.eval.early_stopping_patience=1", "train.eval.validation_fraction=0.25"]
    ctx = prepare(TuneOptions(config=str(JOB), out=str(tmp_path / "o"), sets=sets))
    job = ctx.space.job({}, "base")
    assert job.train.eval.early_stopping_patience == 1 and job.train.eval.validation_fraction == 0.25
    assert set(ctx.chosen) == {"train.eval.keep_best", "train.eval.every_epochs"}
    assert (job.train.eval.keep_best, job.train.eval.every_epochs) == ("auc", 1)


def test_tune_runs_a_job_as_written_and_its_first_trial_is_that_job(tiny_data, tmp_path):
    """`recsys tune --config jobs/synthetic_tiny.toml --out DIR` with no --set (the job's own
    relative data paths), the default space: its first line says what it chose, trial 0
    trains the job as given (with those choices) and records the job's own values."""
    import optuna

    from recsys.config import load_job
    from recsys.tune.run import open_storage

    cwd = _in_data_dir(tiny_data, tmp_path)
    proc = subprocess.run([sys.executable, "-m", "recsys.cli", "tune", "--config", str(JOB), "--out", "tuned",
                           "--trials", "2", "--no-progress", "--seed", "0", "--cv", "off"], cwd=cwd,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout
    first = proc.stdout.splitlines()[0]
    assert first.startswith("tune: the job does not say, so: ") and all(c in first for c in CHOSEN), first
    assert "train.epochs" not in first  # the job sets its epochs: it wins
    assert "trial 0 trains the job as given" in proc.stdout
    assert "trial 0 (the job as given) complete" in proc.stdout and "trial 1 complete" in proc.stdout

    given = _given_job()
    trained = load_job(cwd / "tuned" / "trials" / "0" / "config.toml")
    assert trained.train.eval == given.train.eval and trained.model == given.model
    assert trained.store == given.store and trained.schema == given.schema
    assert trained.data.train.batch_size == given.data.train.batch_size
    assert json.loads((cwd / "tuned" / "trials" / "0" / "validation.json").read_text())["fraction"] == 0.1
    study = optuna.load_study(study_name="synthetic_tiny", storage=open_storage("", cwd / "tuned"))
    t0, t1 = study.trials
    assert t0.user_attrs["given"] and t0.user_attrs["values"] == {} and "given" not in t1.user_attrs
    # the job's own values where the default space has them: the sampler learns from trial 0
    assert (t0.params["store.lr"], t0.params["data.train.batch_size"], t0.params["model.arch"]) == (0.05, 256, "dlrm")
    assert t0.params["embedding"] == "dim=16 bottom_mlp=[64, 32, 16]"
    assert "train.optim.weight_decay" not in t0.params  # the job's 0 is outside the space's log range


def test_best_toml_is_the_given_job_when_no_trial_beat_it(tiny_data, tmp_path, monkeypatch):
    """A stubbed objective under which every sampled trial scores below the given job:
    best.toml is the job as given (with tune's defaults), and says so."""
    from recsys.config import load_job, to_dict
    from recsys.tune import run
    from recsys.tune.run import TuneOptions, tune

    def scored(ctx, trial, values, run_dir):
        value = 0.7 if not values else 0.6  # the given trial sets no value
        trial.report(value, 1)
        return {"step": 4, "best": {"step": 4, "value": value}}, 1

    monkeypatch.setattr(run, "_train", scored)
    space = tmp_path / "space.toml"
    space.write_text(SPACE)
    sets = [f"data.train.paths=['{tiny_data / 'train'}']", f"data.eval.paths=['{tiny_data / 'eval'}']"]
    out = tmp_path / "tuned"
    summary = tune(TuneOptions(config=str(JOB), out=str(out), space=str(space), sets=sets, trials=3, seed=0,
                               pruner="none", cv="off", progress=False), log=lambda _: None)
    assert summary["complete"] == 3 and summary["best"]["number"] == 0 and summary["best"]["given"]
    text = (out / "best.toml").read_text()
    assert "the job as given" in text
    assert to_dict(load_job(out / "best.toml")) == to_dict(_given_job(*sets))


def test_train_early_stopping_applies_the_defaults(tiny_data, tmp_path):
    """`recsys train --early-stopping`: the same choices as tune, said in one line; the run
    holds out a validation split and evaluates on it at the end of the epoch."""
    from recsys.config import load_job

    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "recsys.cli", "train", "--config", str(JOB), "--early-stopping",
                           "--run-dir", str(run_dir), "--set", f"data.train.paths=['{tiny_data / 'train'}']",
                           "--set", f"data.eval.paths=['{tiny_data / 'eval'}']", "--set", "train.progress='none'",
                           "--set", "train.eval.early_stopping_patience=1"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout
    line = next(x for x in proc.stdout.splitlines() if x.startswith("train --early-stopping: "))
    assert all(c in line for c in CHOSEN if "patience" not in c) and "patience" not in line, line
    job = load_job(run_dir / "config.toml")
    assert (job.train.eval.keep_best, job.train.eval.validation_fraction, job.train.eval.every_epochs,
            job.train.eval.early_stopping_patience) == ("auc", 0.1, 1, 1)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in records if r.get("event") == "eval" and r.get("split") == "validation"]
    assert (run_dir / "validation.json").exists() and (run_dir / "checkpoints" / "best").exists()
