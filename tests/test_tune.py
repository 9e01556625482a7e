"""``recsys tune``: trials are real training runs on the tiny synthetic set, a bad trial is
pruned at its first validation evaluation, a restarted study continues its numbering, two
processes share one study through a real Redis, and the space file is checked."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "jobs" / "synthetic_tiny.toml"
SECRET = "s3cret-pw"

SPACE = """
[params]
"store.lr" = { low = 0.01, high = 0.2, log = true }
"train.optim.lr" = { low = 1e-4, high = 1e-2, log = true }
"model.top_mlp" = { choices = [[64, 1], [32, 16, 1]] }
"""


def job_sets(data: Path) -> list[str]:
    """A handful of steps with a validation evaluation every 4 (tiny: ~19 steps an epoch)."""
    return [f"data.train.paths=['{data / 'train'}']", f"data.eval.paths=['{data / 'eval'}']",
            "train.eval.validation_fraction=0.25", "train.eval.every=4", "train.eval.keep_best='auc'", "train.max_steps=8",
            "train.schedule.warmup_steps=0", "train.log_every=4",
            # a password in the job must reach none of tune's files (trials push nothing live)
            f"publish.redis='redis://:{SECRET}@127.0.0.1:9/0'"]


@pytest.fixture
def space(tmp_path) -> Path:
    path = tmp_path / "space.toml"
    path.write_text(SPACE)
    return path


def _validation_evals(run_dir: Path) -> list[dict]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r.get("event") == "eval" and r.get("split") == "validation"]


def test_a_bad_trial_is_pruned_and_a_restart_continues_the_study(tiny_data, space, tmp_path):
    from recsys.config import load_job
    from recsys.tune.run import TuneOptions, tune

    out = tmp_path / "tuned"
    good = {"store.lr": 0.2, "train.optim.lr": 0.01, "model.top_mlp": "[64, 1]"}
    bad = {"store.lr": 0.01, "train.optim.lr": 1e-4, "model.top_mlp": "[64, 1]"}
    opts = TuneOptions(config=str(JOB), cv="off", out=str(out), space=str(space), sets=job_sets(tiny_data), trials=2,
                       prune_startup=1, prune_warmup=0, seed=0, progress=False, enqueue=[good, bad],
                       given_first=False)
    lines: list[str] = []
    summary = tune(opts, log=lines.append)
    assert (summary["complete"], summary["pruned"]) == (1, 1), lines

    # the good trial: a whole run; its objective is its best *validation* evaluation
    good_run, bad_run = out / "trials" / "0", out / "trials" / "1"
    evals = _validation_evals(good_run)
    assert len(evals) == 2 and summary["best"]["number"] == 0
    assert summary["best"]["value"] == max(e["auc"] for e in evals)
    final = json.loads((good_run / "result.json").read_text())
    assert final["step"] == 8 and "stopped" not in final
    assert final["auc"] != summary["best"]["value"]  # the eval split's figure is not the objective

    # the bad one stopped cleanly at its first evaluation, its run directory kept
    result = json.loads((bad_run / "result.json").read_text())
    assert result["stopped"] == "pruned" and result["step"] == 4
    assert len(_validation_evals(bad_run)) == 1 and (bad_run / "checkpoints").is_dir()

    # best.toml trains the good trial's job; no password anywhere
    best = load_job(out / "best.toml")
    assert (best.store.lr, best.train.optim.lr, best.model.top_mlp) == (0.2, 0.01, [64, 1])
    assert best.train.eval.keep_best == "auc" and best.publish.redis == "redis://127.0.0.1:9/0"
    for name in ("best.toml", "trials.csv", "summary.json", "tune.json"):
        assert SECRET not in (out / name).read_text(), name
    with open(out / "trials.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["number"], r["state"]) for r in rows] == [("0", "complete"), ("1", "pruned")]
    assert (out / "history.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "evaluations.png").read_bytes()[:4] == b"\x89PNG"

    # the same command again continues the study (its journal in DIR): trial 2, the earlier two kept
    again = tune(TuneOptions(**{**opts.__dict__, "trials": 1, "enqueue": []}), log=lines.append)
    assert again["trials"] == 3 and (out / "trials" / "2" / "result.json").exists()
    assert again["complete"] + again["pruned"] == 3


@pytest.mark.slow  # make test-slow, in CI: keeps make test under 20 minutes
def test_two_processes_share_one_study_through_redis(tiny_data, space, tmp_path, redis_server):
    """`recsys tune --jobs 2 --storage redis://...`: two worker processes, each opening the
    study from the URL as another machine would, run a trial each; the trials are numbered
    once across both, and the outputs cover the whole study."""
    import optuna
    from optuna.storages.journal import JournalRedisBackend, JournalStorage

    out = tmp_path / "tuned"
    sets = [a for s in job_sets(tiny_data) for a in ("--set", s)]
    proc = subprocess.run([sys.executable, "-m", "recsys.cli", "tune", "--config", str(JOB), "--cv", "off", *sets,
                           "--space", str(space), "--out", str(out), "--storage", redis_server.url,
                           "--study", "shared", "--pruner", "none", "--no-progress", "--trials", "2", "--jobs", "2"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout

    with warnings.catch_warnings():  # the Redis journal is "experimental" in Optuna
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        backend = JournalRedisBackend(redis_server.url, prefix="recsys-tune")
    study = optuna.load_study(study_name="shared", storage=JournalStorage(backend))
    assert sorted(t.number for t in study.trials) == [0, 1]
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    assert len({t.user_attrs["pid"] for t in study.trials}) == 2  # one trial in each worker
    assert sorted(p.name for p in (out / "trials").iterdir()) == ["0", "1"]
    assert f"trial {study.best_trial.number}, validation auc" in (out / "best.toml").read_text()
    assert "trial 0 (the job as given) complete" in proc.stdout and "trial 1 complete" in proc.stdout
    assert redis_server.url in proc.stdout and SECRET not in proc.stdout


def test_the_space_file_is_checked(tiny_data, tmp_path):
    from recsys.config import ConfigError, apply_overrides, read_toml, JobConfig
    from recsys.tune.space import load_space

    base = apply_overrides(read_toml(JOB), job_sets(tiny_data), JobConfig)
    path = tmp_path / "space.toml"

    def error(text: str) -> str:
        path.write_text(text)
        with pytest.raises(ConfigError) as exc:
            load_space(path, base)
        return str(exc.value)

    msg = error('[params]\n"store.lrate" = { low = 0.01, high = 0.1 }\n')
    assert "store.lrate" in msg and "unknown key 'lrate'" in msg and "'initial_accumulator'" in msg
    assert "needs a number setting" in error('[params]\n"model.arch" = { low = 1, high = 2 }\n')
    msg = error('[params]\n"model.arch" = { choices = ["dlrm", "transformer"] }\n')
    assert 'params."model.arch"' in msg and "expected one of ['dlrm', 'dcn', 'deepfm']" in msg
    assert "must be an int" in error('[params]\n"data.train.batch_size" = { low = 64.5, high = 512 }\n')
    assert "log = true needs low > 0" in error('[params]\n"train.optim.weight_decay" = { low = 0, high = 1, log = true }\n')
    assert "objective" in error('[params]\n"train.eval.keep_best" = { choices = ["auc", "log_loss"] }\n')
    msg = error('[params]\n"train.lr" = { low = 1e-4, high = 1e-2, log = true }\n')  # a key that moved
    assert msg == f'{path}: params."train.lr": train.lr: moved to train.optim.lr', msg
    assert "unknown section(s) ['param']" in error('[param]\n"store.lr" = { low = 0.01, high = 0.1 }\n')

    # the shipped default space fits a CTR job; '*' sets every table's dim
    from recsys.tune.run import DEFAULT_SPACE

    space = load_space(DEFAULT_SPACE, base)
    group = next(p for p in space.params if p.name == "embedding")
    values = next(iter(group.choices.values()))
    assert {k for k in values if k.startswith("schema.tables.")} == {f"schema.tables.{t}.dim" for t in
                                                                     base["schema"]["tables"]}


def test_the_default_space_fits_a_job_that_tunes_its_wide_arm(tiny_data):
    """A job with wide_lr set (model.wide = true) loads under the default space, whose
    model.wide choice includes false: a trial without the arm drops the arm's settings."""
    from recsys.config import JobConfig, apply_overrides, read_toml
    from recsys.tune.run import DEFAULT_SPACE
    from recsys.tune.space import load_space

    base = apply_overrides(read_toml(JOB), [*job_sets(tiny_data), "model.wide=true", "model.wide_lr=0.05"],
                           JobConfig)
    space = load_space(DEFAULT_SPACE, base)
    assert space.job({"model.wide": False}, "trial").model.wide is False
    kept = space.job({"model.wide": True}, "trial").model
    assert kept.wide is True and kept.wide_lr == 0.05
    assert base["model"]["wide_lr"] == 0.05  # the base job is not changed by a trial


def test_the_job_must_have_a_validation_split_and_a_metric(tiny_data, space, tmp_path):
    """A job that says it has none (tune supplies them only where the job says nothing)."""
    from recsys.errors import UserError
    from recsys.tune.run import TuneOptions, prepare

    sets = [*job_sets(tiny_data), "train.eval.validation_fraction=0"]
    with pytest.raises(UserError, match="no validation split"):
        prepare(TuneOptions(config=str(JOB), cv="off", out=str(tmp_path / "o"), space=str(space), sets=sets))
    sets = [*job_sets(tiny_data), "train.eval.keep_best=''"]
    with pytest.raises(UserError, match="train.eval.keep_best"):
        prepare(TuneOptions(config=str(JOB), cv="off", out=str(tmp_path / "o"), space=str(space), sets=sets))


def test_best_toml_is_the_job_the_trial_trained_not_this_commands(tiny_data, space, tmp_path):
    """A study continued with another --set: best.toml of an earlier trial is the job that
    trial trained (saved in the study), not this command's job with the trial's values."""
    from recsys.config import load_job
    from recsys.tune.run import TuneOptions, tune

    out = tmp_path / "tuned"
    good = {"store.lr": 0.2, "train.optim.lr": 0.01, "model.top_mlp": "[64, 1]"}
    opts = TuneOptions(config=str(JOB), cv="off", out=str(out), space=str(space), sets=job_sets(tiny_data), trials=1,
                       pruner="none", seed=0, progress=False, enqueue=[good], given_first=False)
    assert tune(opts, log=lambda _: None)["best"]["number"] == 0
    assert load_job(out / "best.toml").model.bottom_mlp == [64, 32, 16]
    # continued with another --set and no new trial: trial 0 is still the best, as it trained
    again = TuneOptions(**{**opts.__dict__, "trials": 0, "enqueue": [],
                           "sets": [*job_sets(tiny_data), "model.bottom_mlp=[8]"]})
    assert tune(again, log=lambda _: None)["best"]["number"] == 0
    text = (out / "best.toml").read_text()
    best = load_job(out / "best.toml")
    assert best.model.bottom_mlp == [64, 32, 16] and best.store.lr == 0.2, text
    assert "did not save its job" not in text and SECRET not in text


def test_a_failed_trials_error_and_traceback_hold_no_password(tiny_data, space, tmp_path, monkeypatch):
    """A trial failing with an error that quotes a Redis URL (not a UserError: its traceback
    is kept): error.txt and the study's error attribute show the URL without its password."""
    import optuna

    from recsys.tune import run
    from recsys.tune.run import TuneOptions, tune

    def broken(ctx, trial, values, run_dir):
        raise RuntimeError(f"lost redis://:{SECRET}@10.0.0.1:6379/0 mid-write")

    monkeypatch.setattr(run, "_train", broken)
    out = tmp_path / "tuned"
    opts = TuneOptions(config=str(JOB), cv="off", out=str(out), space=str(space), sets=job_sets(tiny_data), trials=1,
                       pruner="none", seed=0, progress=False)
    lines: list[str] = []
    assert tune(opts, log=lines.append)["fail"] == 1
    traceback_text = (out / "trials" / "0" / "error.txt").read_text()
    assert "Traceback" in traceback_text and "redis://:***@10.0.0.1:6379/0 mid-write" in traceback_text
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study = optuna.load_study(study_name="synthetic_tiny", storage=run.open_storage("", out))
    assert study.trials[0].user_attrs["error"] == "RuntimeError: lost redis://:***@10.0.0.1:6379/0 mid-write"
    for path in [*out.rglob("*.txt"), *out.rglob("*.csv"), *out.rglob("*.json"), out / "study.journal"]:
        assert SECRET not in path.read_text(errors="replace"), path
    assert not any(SECRET in line for line in lines)


def test_timeout_starts_no_trial_after_it_passes(tiny_data, space, tmp_path, monkeypatch):
    """--timeout: no new trial starts once it has passed (a trial that runs past it ends)."""
    import threading

    from recsys.tune import run
    from recsys.tune.run import TuneOptions, tune

    gate = threading.Event()
    started: list[int] = []

    def slow(ctx, trial, values, run_dir):  # a trial longer than the timeout: waits for it to pass
        started.append(trial.number)
        gate.wait(5.0)  # not set: the timeout below has passed by the end (5 s > 0.5 s)
        trial.report(0.6, 1)
        return {"step": 4, "best": {"step": 4, "value": 0.6}}, 1

    monkeypatch.setattr(run, "_train", slow)
    opts = TuneOptions(config=str(JOB), cv="off", out=str(tmp_path / "t"), space=str(space), sets=job_sets(tiny_data),
                       trials=5, timeout_s=0.5, pruner="none", seed=0, progress=False)
    summary = tune(opts, log=lambda _: None)
    assert started == [0] and summary["trials"] == 1 and summary["complete"] == 1


def _wait_running(out: Path, proc, what: str, trial: int = 0) -> None:
    """Wait until trial ``trial`` of the tune command ``proc`` has trained a logged step."""
    import time

    metrics = out / "trials" / str(trial) / "metrics.jsonl"
    while not (metrics.exists() and '"loss/train"' in metrics.read_text()):
        assert proc.poll() is None, f"{what}: tune ended first: {proc.stdout.read()}"
        time.sleep(0.1)


def _study_trials(out: Path):
    import optuna

    from recsys.tune.run import open_storage

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.load_study(study_name="synthetic_tiny", storage=open_storage("", out)).trials


def _long_tune(tiny_data, space, out: Path, jobs: int = 1, sigint=signal.SIG_DFL) -> subprocess.Popen:
    """`recsys tune` of trials that run until stopped (no early stopping: tune would supply a
    patience), its SIGINT as ``sigint``: a terminal's foreground job has it at its default,
    a shell's background job or a nohup'ed one ignores it. Set here, not inherited from
    whatever started pytest: a pytest run in the background would otherwise ignore Ctrl-C."""
    sets = [a for s in [*job_sets(tiny_data), "train.max_steps=1000000", "train.epochs=100000", "train.log_every=1",
                        "train.eval.early_stopping_patience=0"]
            for a in ("--set", s)]
    return subprocess.Popen([sys.executable, "-m", "recsys.cli", "tune", "--config", str(JOB), "--cv", "off", *sets,
                             "--space", str(space), "--out", str(out), "--pruner", "none", "--no-progress",
                             "--trials", "3", "--jobs", str(jobs)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))


def _signal_mid_trial(out: Path, proc, sig, trials=(0,)) -> str:
    """Send ``sig`` to the tune command ``proc`` once each of ``trials`` has trained a logged
    step; return its output once it ended (killed if it has not within 120 s)."""
    try:
        for trial in trials:
            _wait_running(out, proc, sig.name, trial=trial)
        proc.send_signal(sig)
        stdout, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.stdout.close()
    return stdout


def test_ctrl_c_marks_the_running_trial_failed_and_exits_130(tiny_data, space, tmp_path):
    """SIGINT to `recsys tune` mid-trial: exit 130, the trial failed ("interrupted"), no other
    trial started, the outputs written and the study kept."""
    from optuna.trial import TrialState

    out = tmp_path / "tuned"
    proc = _long_tune(tiny_data, space, out)
    stdout = _signal_mid_trial(out, proc, signal.SIGINT)
    assert proc.returncode == 130, stdout
    assert "interrupted: the study is kept" in stdout and "Traceback" not in stdout
    trials = _study_trials(out)
    assert [(t.number, t.state, t.user_attrs.get("error")) for t in trials] == [(0, TrialState.FAIL, "interrupted")]
    assert (out / "trials.csv").exists() and (out / "summary.json").exists()


def test_sigterm_to_a_tune_of_two_workers_that_ignores_sigint_interrupts_both_trials(tiny_data, space, tmp_path):
    """`recsys tune --jobs 2` started as a background job (SIGINT ignored, as a shell or nohup
    leaves it), then SIGTERM mid-trial: tune forwards it to its workers as SIGINT, which they
    take although they were born ignoring it; exit 130, both running trials failed
    ("interrupted"), none left running for a later command to find dead."""
    from optuna.trial import TrialState

    out = tmp_path / "tuned"
    proc = _long_tune(tiny_data, space, out, jobs=2, sigint=signal.SIG_IGN)
    stdout = _signal_mid_trial(out, proc, signal.SIGTERM, trials=(0, 1))
    assert proc.returncode == 130, stdout
    assert "interrupted: the study is kept" in stdout
    trials = _study_trials(out)
    assert sorted((t.number, t.state, t.user_attrs.get("error")) for t in trials) == [
        (0, TrialState.FAIL, "interrupted"), (1, TrialState.FAIL, "interrupted")]


def test_a_trial_killed_with_its_process_is_marked_failed_by_the_next_run(tiny_data, space, tmp_path):
    """kill -9 of `recsys tune` mid-trial leaves the trial RUNNING in the journal; the next
    command marks it failed (its process is gone) and says so."""
    from optuna.trial import TrialState

    from recsys.tune.run import TuneOptions, tune

    out = tmp_path / "tuned"
    proc = _long_tune(tiny_data, space, out)
    try:
        _wait_running(out, proc, "kill -9")
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.stdout.close()
    assert [t.state for t in _study_trials(out)] == [TrialState.RUNNING]
    lines: list[str] = []
    summary = tune(TuneOptions(config=str(JOB), cv="off", out=str(out), space=str(space), sets=job_sets(tiny_data), trials=0,
                               progress=False), log=lines.append)
    assert "trial 0: its process ended before it finished (marked failed)" in lines, lines
    assert summary["fail"] == 1 and summary["running"] == 0
    [t] = _study_trials(out)
    assert t.state == TrialState.FAIL and t.user_attrs["error"] == "its process ended before it finished"
