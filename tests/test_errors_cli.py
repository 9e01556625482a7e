"""User errors end in one line and exit code 2, with one process or several (tracebacks only
with -v); SIGTERM to the `recsys train --nproc 2` launcher checkpoints every worker, exits 0,
and the same command resumes exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import wait_until
from recsys.testing.harness import kill_tagged, records, tagged
from test_faults import assert_same_end
from test_train import JOB, ROOT, overrides

RECSYS = [sys.executable, "-m", "recsys.cli"]
WORKER = [sys.executable, "-m", "recsys.train"]


@pytest.fixture(scope="module")
def tiny(tiny_data) -> Path:
    return tiny_data


@pytest.fixture(scope="module")
def checkpoint(tiny, tmp_path_factory) -> Path:
    """A run directory with a checkpoint after 2 steps (trained in this process)."""
    from test_train import run

    run_dir = tmp_path_factory.mktemp("errors") / "two-steps"
    run(tiny, run_dir, "train.max_steps=2")
    return run_dir


def _sets(*items: str) -> list[str]:
    out = []
    for item in items:
        out += ["--set", item]
    return out


def _run(cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _one_error_line(out: subprocess.CompletedProcess, command: str = "train") -> str:
    """Assert exit code 2, no traceback, and exactly one error line in stderr; return it."""
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if "error" in line.lower()]
    assert len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith(f"recsys {command}: error"), lines
    return lines[0]


# --------------------------------------------------------------------------- missing data


def test_missing_data_path_with_two_processes_is_one_line(tiny, tmp_path):
    missing = tmp_path / "no-such-dir"
    run_dir = tmp_path / "run"
    out = _run([*RECSYS, "train", "--config", str(JOB), "--nproc", "2", "--run-dir", str(run_dir),
                *_sets(*overrides(tiny, f"data.train.paths=['{missing}']"))])
    line = _one_error_line(out)
    assert str(missing) in line
    assert out.stderr.strip() == line  # checked before any process starts: nothing else printed
    assert not (run_dir / "config.toml").exists()


def test_missing_eval_path_is_found_before_training(tiny, tmp_path):
    missing = tmp_path / "no-eval"
    out = _run([*RECSYS, "train", "--config", str(JOB), "--nproc", "2", "--run-dir", str(tmp_path / "run"),
                *_sets(*overrides(tiny, f"data.eval.paths=['{missing}']"))])
    assert str(missing) in _one_error_line(out)


def test_missing_schema_column_is_found_before_training(tiny, tmp_path):
    out = _run([*RECSYS, "train", "--config", str(JOB), "--nproc", "2", "--run-dir", str(tmp_path / "run"),
                *_sets(*overrides(tiny, "schema.dense=['i1', 'no_such_column']"))])
    line = _one_error_line(out)
    assert "no_such_column" in line and str(tiny / "train") in line


def test_unwritable_run_directory_is_one_line(tiny, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    out = _run([*RECSYS, "train", "--config", str(JOB), "--nproc", "2", "--run-dir", str(blocker / "run"),
                *_sets(*overrides(tiny))])
    assert str(blocker / "run") in _one_error_line(out)


def test_worker_without_launcher_prints_one_line(tiny, tmp_path):
    """`python -m recsys.train` (what torchrun runs) handles user errors the same way."""
    missing = tmp_path / "no-such-dir"
    out = _run([*WORKER, "--config", str(JOB), "--run-dir", str(tmp_path / "run"),
                *_sets(*overrides(tiny, f"data.train.paths=['{missing}']"))])
    assert str(missing) in _one_error_line(out)


@pytest.mark.slow  # make test-slow, in CI: keeps make test under 20 minutes
@pytest.mark.multiproc
def test_a_workers_user_error_is_printed_once(tiny, tmp_path):
    """Data whose footers pass the launcher's checks but whose values the reader rejects in
    both workers: one line, exit code 2, no per-rank tracebacks or torchrun summary."""
    bad = tmp_path / "bad-label"
    bad.mkdir()
    for f in sorted((tiny / "train").glob("*.parquet")):
        table = pq.read_table(f)
        labels = table.column("label").to_pylist()
        labels[5] = None
        i = table.schema.get_field_index("label")
        table = table.set_column(i, table.schema.field(i), pa.array(labels, table.schema.field(i).type))
        pq.write_table(table, bad / f.name)
    out = _run([*RECSYS, "train", "--config", str(JOB), "--nproc", "2", "--run-dir", str(tmp_path / "run"),
                *_sets(*overrides(bad.parent, f"data.train.paths=['{bad}']", f"data.eval.paths=['{tiny / 'eval'}']",
                                  "train.runtime.collective_timeout_s=60"))], timeout=240)
    line = _one_error_line(out)
    assert "label" in line and str(bad) in line and "null" in line
    assert "ChildFailedError" not in out.stderr and "exitcode" not in out.stderr  # torchrun's summary


# --------------------------------------------------------------------------- job files


@pytest.mark.parametrize("kind", ["directory", "not-utf8"])
@pytest.mark.parametrize("entry", ["launcher", "worker"])
def test_unreadable_job_file_is_one_line(tmp_path, kind, entry):
    job = tmp_path / "job.toml"
    if kind == "directory":
        job.mkdir()
    else:
        job.write_bytes(b'name = "\xff\xfe"\n')
    cmd = [*RECSYS, "train", "--nproc", "2"] if entry == "launcher" else list(WORKER)
    line = _one_error_line(_run([*cmd, "--config", str(job)]))
    assert str(job) in line
    assert ("is a directory" if kind == "directory" else "not UTF-8") in line


def test_verbose_shows_the_traceback(tmp_path):
    out = _run([*RECSYS, "train", "-v", "--config", str(tmp_path)])
    assert out.returncode == 2
    assert "Traceback" in out.stderr and f"recsys train: error: {tmp_path}" in out.stderr


# --------------------------------------------------------------------------- eval and checkpoints


def test_malformed_oracle_file_is_one_line(checkpoint, tmp_path):
    oracle = tmp_path / "oracle.json"
    oracle.write_text("{not json\n")
    out = _run([*RECSYS, "eval", "--checkpoint", str(checkpoint), "--oracle", str(oracle)])
    line = _one_error_line(out, "eval")
    assert "JSON" in line and str(oracle) in line
    oracle.write_text('{"train": {}}')  # JSON, but not an oracle
    out = _run([*RECSYS, "eval", "--checkpoint", str(checkpoint), "--oracle", str(oracle)])
    assert "eval.auc" in _one_error_line(out, "eval")


def test_eval_of_another_checkpoint_format_is_one_line(checkpoint, tmp_path):
    import shutil

    from recsys.checkpoint.read import latest

    ckpt = tmp_path / "other-format"
    shutil.copytree(latest(checkpoint / "checkpoints"), ckpt)
    meta = (ckpt / "meta.json").read_text()
    (ckpt / "meta.json").write_text(meta.replace('"format_version": 1', '"format_version": 9'))  # same size
    out = _run([*RECSYS, "eval", "--checkpoint", str(ckpt)])
    assert "format_version 9" in _one_error_line(out, "eval")


@pytest.mark.parametrize("entry", ["launcher", "worker"])
def test_checkpoint_format_mismatch_is_one_line(tiny, checkpoint, tmp_path, entry):
    import shutil

    from recsys.checkpoint.read import latest

    ckpt = tmp_path / "other-format"
    shutil.copytree(latest(checkpoint / "checkpoints"), ckpt)
    meta = (ckpt / "meta.json").read_text()
    assert '"format_version": 1' in meta
    (ckpt / "meta.json").write_text(meta.replace('"format_version": 1', '"format_version": 9'))  # same size
    cmd = [*RECSYS, "train", "--nproc", "2"] if entry == "launcher" else list(WORKER)
    out = _run([*cmd, "--config", str(JOB), "--run-dir", str(tmp_path / "run"), "--resume", str(ckpt),
                *_sets(*overrides(tiny))])
    line = _one_error_line(out)
    assert str(ckpt) in line and "format_version 9" in line


# --------------------------------------------------------------------------- preemption


def _launch(data: Path, run_dir: Path, tag: str) -> subprocess.Popen:
    cmd = [*RECSYS, "train", "--config", str(JOB), "--nproc", "2", "--run-dir", str(run_dir),
           *_sets(*overrides(data, "data.train.batch_size=64", "train.runtime.collective_timeout_s=60"))]
    log = open(run_dir.parent / f"{run_dir.name}.log", "a")  # noqa: SIM115 - the child keeps its copy
    try:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "RECSYS_TEST_TAG": tag})
    finally:
        log.close()


def _log(run_dir: Path) -> str:
    return (run_dir.parent / f"{run_dir.name}.log").read_text()


def _finish(proc: subprocess.Popen, run_dir: Path, tag: str, timeout: float = 240) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the job did not end in {timeout}s:\n" + _log(run_dir)[-4000:])
    finally:
        kill_tagged(tag)


@pytest.mark.multiproc
def test_sigterm_to_the_launcher_checkpoints_and_the_same_command_resumes_exactly(tiny, tmp_path):
    reference = tmp_path / "reference"
    tag = uuid.uuid4().hex
    assert _finish(_launch(tiny, reference, tag), reference, tag) == 0, _log(reference)[-4000:]

    run_dir = tmp_path / "preempted"
    tag = uuid.uuid4().hex
    proc = _launch(tiny, run_dir, tag)
    steps = lambda: [r["step"] for r in records(run_dir) if "loss/train" in r]  # noqa: E731
    try:
        wait_until(lambda: len(steps()) >= 10 or proc.poll() is not None, 180, "10 training steps")
        assert proc.poll() is None, "the job ended before SIGTERM:\n" + _log(run_dir)[-4000:]
        proc.send_signal(signal.SIGTERM)
        code = _finish(proc, run_dir, tag, timeout=240)  # a bound for a hung job, not a figure to meet
    finally:
        proc.kill()
    # the states, not a clock: the launcher says "every worker saved a checkpoint" (and exits 0)
    # only when every worker wrote its stopped marker, which a worker writes after its
    # checkpoint; one the agent killed at its shutdown timeout before that leaves none
    assert code == 0, _log(run_dir)[-4000:]
    assert not tagged(tag), "processes outlived the launcher"
    assert "every worker saved a checkpoint" in _log(run_dir)
    stopped_at = max(steps())
    assert 10 <= stopped_at < 48, stopped_at  # 6,000 rows / (2 ranks x 64): stopped mid-epoch
    assert json.loads((run_dir / "result.json").read_text()) == {"step": stopped_at, "stopped": "SIGTERM"}
    assert [r["step"] for r in records(run_dir) if r.get("event") == "checkpoint"] == [stopped_at]

    tag = uuid.uuid4().hex
    assert _finish(_launch(tiny, run_dir, tag), run_dir, tag) == 0, _log(run_dir)[-4000:]
    resumed = [r for r in records(run_dir) if r.get("event") == "resumed"]
    assert [r["step"] for r in resumed] == [stopped_at]
    assert_same_end(reference, run_dir)
