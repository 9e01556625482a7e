"""A job killed (SIGKILL) at any point of a checkpoint write: ``latest`` always names a
complete checkpoint that loads, a half-written or half-deleted one is never picked, the next
save removes what the crash left, and the resumed job ends exactly like an uninterrupted one.

The kills come from the test hook of ``recsys.checkpoint.write`` (``RECSYS_FAULT_CHECKPOINT``):
the process SIGKILLs itself at the named point. One process runs here; a driver process
imports the trainer once and forks each run (``python -m recsys.train``'s ``main``) from
it, so the many short runs do not each pay torch's import. The 2-rank case goes through
``recsys train --nproc 2 --max-restarts 1``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from recsys.checkpoint import read as cf
from test_faults import assert_same_end
from test_train import JOB, ROOT, overrides

pytestmark = pytest.mark.multiproc

DEADLINE = 300  # seconds a launched job may take before the test calls it hung

# one process: checkpoints at steps 2 and 4, the save of step 6 is killed; keep_last=2 so
# that save prunes step 2
EVERY, KILLED_AT, STEPS, KEEP = 2, 6, 8, 2
# the points of a save (module doc of recsys.checkpoint.write; ``mid-sparse`` is the torchrun
# case below), with what must be there after the kill: the checkpoint ``latest`` resolves to,
# and which leftover shows the kill landed
POINTS = {
    "before-sparse": (4, ".tmp-step-00000006"),
    "after-sparse": (4, ".tmp-step-00000006"),
    "after-marker": (4, ".tmp-step-00000006"),
    "before-latest": (4, "step-00000006"),  # renamed into place, the pointer not yet moved
    "after-latest": (6, "step-00000002"),  # not yet pruned
    "prune": (6, ".del-step-00000002"),  # moved aside and partly deleted
}

# Runs the jobs of argv[1] (a JSON list of {"run_dir", "args", "fault", "snapshot", "wave"}),
# each in a process forked from this one: wave after wave, two at a time within a wave (the
# jobs of a wave use different run directories); writes {"status": [...]} to argv[2].
DRIVER = r"""
import json, os, shutil, sys
import recsys.train.__main__ as entry
import recsys.train.loop  # noqa: F401 - imported once, before any fork

jobs, out = json.loads(sys.argv[1]), sys.argv[2]
status = [None] * len(jobs)


def start(job):
    log = os.open(job["run_dir"] + ".log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    pid = os.fork()
    if pid:
        os.close(log)
        return pid
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.pop("RECSYS_FAULT_CHECKPOINT", None)
    if job["fault"]:
        os.environ["RECSYS_FAULT_CHECKPOINT"] = job["fault"]
    try:
        code = entry.main(job["args"])
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 99
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


for wave in sorted({job["wave"] for job in jobs}):
    todo = [i for i, job in enumerate(jobs) if job["wave"] == wave]
    running = {}
    while todo or running:
        while todo and len(running) < 2:
            i = todo.pop(0)
            running[start(jobs[i])] = i
        pid, raw = os.wait()
        i = running.pop(pid)
        status[i] = -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)
        if jobs[i]["snapshot"]:  # the run directory as the kill left it, before the resume changes it
            shutil.copytree(jobs[i]["run_dir"], jobs[i]["snapshot"], symlinks=True)
with open(out, "w") as fh:
    json.dump({"status": status}, fh)
"""


def _args(data: Path, run_dir: Path) -> list[str]:
    extra = [f"train.max_steps={STEPS}", f"train.checkpoint.every_steps={EVERY}", f"train.checkpoint.keep_last={KEEP}"]
    out = ["--config", str(JOB), "--run-dir", str(run_dir)]
    for o in overrides(data, *extra):
        out += ["--set", o]
    return out


@pytest.fixture(scope="module")
def killed_runs(tiny_data, tmp_path_factory):
    """Run the reference job, then per point: the job killed there, and the same command again."""
    base = tmp_path_factory.mktemp("crash")
    jobs = [{"run_dir": str(base / "reference"), "args": _args(tiny_data, base / "reference"), "fault": None,
             "snapshot": None, "wave": 0}]
    for point in POINTS:
        run_dir = base / point
        jobs.append({"run_dir": str(run_dir), "args": _args(tiny_data, run_dir), "fault": f"{point}:step={KILLED_AT}",
                     "snapshot": str(base / f"{point}-killed"), "wave": 0})
        jobs.append({"run_dir": str(run_dir), "args": _args(tiny_data, run_dir), "fault": None, "snapshot": None,
                     "wave": 1})
    out = base / "status.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(jobs), str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=DEADLINE * 3)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    status = json.loads(out.read_text())["status"]
    logs = {Path(j["run_dir"]).name: Path(j["run_dir"] + ".log") for j in jobs}
    assert status[0] == 0, logs["reference"].read_text()[-3000:]
    return base, dict(zip(POINTS, zip(status[1::2], status[2::2]))), logs


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _assert_loads(path: Path) -> None:
    """The checkpoint at ``path`` is complete and every part of it loads."""
    from recsys.checkpoint import write as ckpt

    assert cf.incomplete(path) is None, cf.incomplete(path)
    meta = cf.load_meta(path)
    dense = ckpt.load_dense(path)
    assert set(dense) >= {"model", "optimizer", "scheduler"}
    tables = cf.load_sparse(path)
    assert sorted(tables) == sorted(meta["tables"]) and all(t.num_rows > 0 for t in tables.values())




@pytest.mark.parametrize("point", list(POINTS))
def test_a_kill_during_a_checkpoint_write_leaves_latest_complete_and_resume_exact(killed_runs, point):
    base, status, logs = killed_runs
    killed, resumed = status[point]
    assert killed == -signal.SIGKILL, f"the hook did not kill the run at {point}:\n" + logs[point].read_text()[-3000:]
    assert resumed == 0, logs[point].read_text()[-3000:]

    # as the kill left it: latest names a complete checkpoint that loads, nothing half-done is picked
    snapshot = base / f"{point}-killed" / "checkpoints"
    want_step, leftover = POINTS[point]
    assert (snapshot / leftover).exists(), sorted(p.name for p in snapshot.iterdir())
    found = cf.latest(snapshot)
    assert found == snapshot / f"step-{want_step:08d}" == cf.resolve(snapshot.parent)
    _assert_loads(found)
    for path in snapshot.glob("step-*"):  # every step-* is whole: nothing half-written or half-deleted
        _assert_loads(path)
    # the TensorBoard events hold every step up to that checkpoint (flushed with it)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(snapshot.parent / "tensorboard"))
    events.Reload()
    assert {e.step for e in events.Scalars("loss/train")} >= set(range(1, want_step + 1))

    # the same command again resumes from it, cleans up and ends exactly like the uninterrupted run
    run_dir = base / point
    resumes = [r for r in _records(run_dir) if r.get("event") == "resumed"]
    assert [r["step"] for r in resumes] == [want_step]
    reference = base / "reference"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == sorted(
        p.name for p in (reference / "checkpoints").iterdir())  # no .tmp-/.del- left, keep_last kept
    assert_same_end(reference, run_dir)


# --------------------------------------------------------------------------- 2 ranks, torchrun

# 16 steps of 2 x 64 rows, a checkpoint every 4, keep_last=1 (so the save of step 8 prunes step 4)
TORCHRUN_KILLED_AT = 8


def _launch(data: Path, run_dir: Path, fault: str | None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "recsys.cli", "train", "--config", str(JOB), "--nproc", "2", "--max-restarts", "1",
           "--run-dir", str(run_dir)]
    for o in overrides(data, "data.train.batch_size=64", "train.max_steps=16", "train.checkpoint.every_steps=4",
                       "train.checkpoint.keep_last=1", "train.runtime.collective_timeout_s=60"):
        cmd += ["--set", o]
    env = {k: v for k, v in os.environ.items() if k != "RECSYS_FAULT_CHECKPOINT"}
    if fault:
        env["RECSYS_FAULT_CHECKPOINT"] = fault
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=DEADLINE)


@pytest.fixture(scope="module")
def torchrun_reference(tiny_data, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("torchrun") / "reference"
    proc = _launch(tiny_data, run_dir, None)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir


def _assert_killed_and_resumed(data: Path, reference: Path, run_dir: Path, point: str, rank: int,
                               resumed_from: int) -> None:
    """Kill ``rank`` at ``point`` of the save of step 8; torchrun restarts both workers, which
    resume from ``resumed_from`` and finish exactly like the uninterrupted job."""
    killed = _launch(data, run_dir, f"{point}:step={TORCHRUN_KILLED_AT}:rank={rank}")
    out = killed.stdout[-3000:] + killed.stderr[-3000:]
    assert killed.returncode == 0, out
    assert "RECSYS_FAULT_CHECKPOINT: killing process" in killed.stderr + killed.stdout, out
    recs = _records(run_dir)
    assert [r["step"] for r in recs if r.get("event") == "resumed"] == [resumed_from], out
    # the restarted attempt logged every step from the checkpoint to the end
    after = recs.index(next(r for r in recs if r.get("event") == "resumed"))
    assert [r["step"] for r in recs[after:] if "loss/train" in r] == list(range(resumed_from + 1, 17))
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == sorted(p.name for p in (reference / "checkpoints").iterdir())  # nothing left over
    assert_same_end(reference, run_dir)


@pytest.mark.slow  # make test-slow, in CI: keeps make test under 20 minutes
def test_a_worker_killed_mid_write_under_torchrun_resumes_to_the_uninterrupted_result(tiny_data, torchrun_reference,
                                                                                      tmp_path):
    """``recsys train --nproc 2 --max-restarts 1``: rank 1 dies after writing one table's shard
    of step 8's checkpoint; the half-written step 8 is never read, the job resumes from step 4."""
    _assert_killed_and_resumed(tiny_data, torchrun_reference, tmp_path / "killed", "mid-sparse", 1, 4)


# every point under torchrun, the rank that dies, the step the job resumes from
TORCHRUN_POINTS = {
    "before-sparse": (0, 4),
    "after-sparse": (1, 4),
    "after-marker": (0, 4),
    "before-latest": (0, 4),
    "after-latest": (0, 8),
    "prune": (0, 8),
}


@pytest.mark.slow
@pytest.mark.parametrize("point", list(TORCHRUN_POINTS))
def test_every_point_of_a_save_under_torchrun(tiny_data, torchrun_reference, tmp_path, point):
    rank, resumed_from = TORCHRUN_POINTS[point]
    _assert_killed_and_resumed(tiny_data, torchrun_reference, tmp_path / "killed", point, rank, resumed_from)
