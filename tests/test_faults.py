"""Faults under torchrun: a restarted attempt never sees the previous one's connection data,
and a worker killed with SIGKILL mid-run is restarted from the last checkpoint to the same end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from conftest import wait_until
from recsys.testing.faults import (EPOCHS, EVERY, STEPS_PER_EPOCH, compare_runs, job_overrides, spilling_overrides,
                                 train_row_ids)
from recsys.testing.harness import TrainJob, environ_of, kill_tagged, last_step, records, tagged, workers
from dist_utils import run_distributed
from test_train import JOB, ROOT, final_rows, losses, overrides

pytestmark = pytest.mark.multiproc

DEADLINE = 240  # seconds any one launched job may take before the test calls it hung


# --------------------------------------------------------------------------- processes
# the bench's machinery (recsys/testing/faults.py) finds, kills and watches a job's processes

_environ, _tagged, _kill_tagged, _workers, _records = environ_of, tagged, kill_tagged, workers, records


# --------------------------------------------------------------------------- stale rendezvous data

WORKER = """
import os, torch, torch.distributed as dist
from recsys.train.loop import setup_env
from recsys.train.distributed import new_group
env = setup_env("cpu", 60.0)
store_group = new_group(env.collective_timeout_s)
t = torch.ones(1)
dist.all_reduce(t)
dist.all_reduce(t, group=store_group)
print("sum", t.item(), flush=True)
os._exit(0)  # no destroy_process_group: like a worker torchrun stops
"""


def test_restarted_attempt_never_reads_the_previous_attempts_addresses(tmp_path):
    """The agent's store outlives attempt 0; attempt 1's rank 0 starts alone and must wait for
    its peer's new address instead of connecting to attempt 0's (a dead process)."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the agent's store
    tag = uuid.uuid4().hex

    def start(rank: int, attempt: int) -> subprocess.Popen:
        env = {**os.environ, "RECSYS_TEST_TAG": tag, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
               "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": str(attempt),
               "TORCHELASTIC_RUN_ID": "faults", "OMP_NUM_THREADS": "1"}
        return subprocess.Popen([sys.executable, "-c", WORKER], cwd=ROOT, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def finish(proc: subprocess.Popen) -> str:
        try:
            out, _ = proc.communicate(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0]
            pytest.fail(f"a rank did not finish in {DEADLINE}s (hung?):\n{out[-3000:]}")
        assert proc.returncode == 0, out[-3000:]
        assert "sum 4.0" in out, out[-3000:]
        return out

    try:
        first = [start(r, 0) for r in range(2)]
        for proc in first:
            finish(proc)
        keys_after_attempt0 = store.num_keys()
        rank0 = start(0, 1)
        # attempt 1's rank 0 is rendezvousing once it wrote a key of its own; a key of attempt
        # 0's name would only be overwritten (no new key) and rank 0 would go on to dial attempt
        # 0's dead rank 1 and fail: both end the wait
        wait_until(lambda: store.num_keys() > keys_after_attempt0 or rank0.poll() is not None, DEADLINE,
                   "attempt 1's rank 0 to rendezvous")
        assert rank0.poll() is None, "attempt 1's rank 0 gave up alone:\n" + rank0.communicate()[0][-3000:]
        rank1 = start(1, 1)
        finish(rank0)
        finish(rank1)
    finally:
        _kill_tagged(tag)


# --------------------------------------------------------------------------- SIGKILL under torchrun

def _job(data: Path, run_dir: Path, tag: str, *extra: str) -> TrainJob:
    return TrainJob(run_dir, job_overrides(data, *extra), tag=tag)


def _launch(data: Path, run_dir: Path, tag: str, *extra: str) -> subprocess.Popen:
    return _job(data, run_dir, tag, *extra).start().proc


def _wait(proc: subprocess.Popen, run_dir: Path, tag: str) -> None:
    job = TrainJob(run_dir, [], tag=tag, proc=proc)
    try:
        code = job.wait(DEADLINE)
    except TimeoutError as exc:
        pytest.fail(str(exc))
    assert code == 0, job.log_tail()


def _log_tail(run_dir: Path) -> str:
    return TrainJob(run_dir, []).log_tail()


_last_step = last_step


@pytest.fixture(scope="module")
def tiny(tiny_data) -> Path:
    return tiny_data


@pytest.fixture(scope="module")
def uninterrupted(tiny, tmp_path_factory):
    """The reference: the same job as the faulted runs, never interrupted."""
    data = tiny
    run_dir = tmp_path_factory.mktemp("faults") / "reference"
    tag = uuid.uuid4().hex
    _wait(_launch(data, run_dir, tag), run_dir, tag)
    return data, run_dir


def assert_exactly_once(run_dir: Path, data: Path, epochs: int) -> dict:
    from recsys.train.rows import check_exactly_once

    report = check_exactly_once(run_dir, train_row_ids(data), epochs)
    assert report["ok"], report
    return report


def assert_same_end(reference: Path, run_dir: Path) -> None:
    """Exact resume at staleness 0: the same final evaluation and bit-identical sparse rows."""
    want = json.loads((reference / "result.json").read_text())
    got = json.loads((run_dir / "result.json").read_text())
    assert got == want
    a, b = final_rows(reference), final_rows(run_dir)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys(), f"table {name}: different keys"
        for key in a[name]:
            np.testing.assert_array_equal(a[name][key], b[name][key], err_msg=f"table {name} key {key}")


def _resumes(job: TrainJob) -> list[dict]:
    return [r for r in job.records() if r.get("event") == "resumed"]


def _fault(job: TrainJob, faults: list[tuple[int, int]], sig: int) -> list[int]:
    """Send ``sig`` to worker ``rank`` of attempt k once it checkpointed and reached step
    ``after``, for each ``(after, rank)`` of ``faults`` in turn; return the steps hit."""
    hit = []
    try:
        for attempt, (after, victim) in enumerate(faults):
            pids = job.wait_for_step(after, attempt, DEADLINE)
            os.kill(pids[victim], sig)
            hit.append(last_step(job.records()))
    except BaseException:
        job.kill()
        raise
    return hit


def _assert_resumed_from_last_checkpoint(job: TrainJob, hit: list[int]) -> None:
    recs = job.records()
    resumed = _resumes(job)
    assert len(resumed) == len(hit), resumed
    for r, at in zip(resumed, hit):
        # from the last checkpoint before the fault (one may complete while the fault lands)
        assert r["step"] % EVERY == 0 and at - EVERY <= r["step"] <= at + EVERY, (resumed, hit)
    # the last attempt logged every step from its checkpoint to the end of the job
    after = [r["step"] for r in recs[recs.index(resumed[-1]):] if "loss/train" in r]
    assert after == list(range(resumed[-1]["step"] + 1, EPOCHS * STEPS_PER_EPOCH + 1))


# each kill: (at a step >= this, after a checkpoint of the running attempt, SIGKILL this rank);
# every restart is a new chance for the previous attempt's rendezvous data to be read
KILLS = {
    "step12-rank1_then_step45-rank0": [(12, 1), (45, 0)],
    "step33-rank0_then_epoch2-step70-rank1": [(33, 0), (70, 1)],
    "epoch2-step55-rank1_then_step78-rank0": [(55, 1), (78, 0)],
}


# make test runs the pair that crosses an epoch; the other two run with the slow tests
# (``pytest -m slow``): 40 s each, and make test must stay under 20 minutes on 2 cores
IN_MAKE_TEST = "step33-rank0_then_epoch2-step70-rank1"


@pytest.mark.parametrize("kills", [pytest.param(v, id=k, marks=() if k == IN_MAKE_TEST else pytest.mark.slow)
                                   for k, v in KILLS.items()])
def test_sigkilled_workers_restart_from_checkpoint_to_the_same_result(uninterrupted, tmp_path, kills):
    data, reference = uninterrupted
    job = _job(data, tmp_path / "killed", uuid.uuid4().hex).start()
    hit = _fault(job, kills, signal.SIGKILL)
    _wait(job.proc, job.run_dir, job.tag)
    _assert_resumed_from_last_checkpoint(job, hit)
    # every training row exactly once per epoch, counted on the rows the final trajectory saw
    assert_exactly_once(job.run_dir, data, epochs=EPOCHS)
    assert_same_end(reference, job.run_dir)


@pytest.mark.slow  # make test-slow, in CI: keeps make test under 20 minutes
def test_a_killed_worker_whose_rows_spill_resumes_over_its_earlier_rows_exactly(uninterrupted, tmp_path, redis_server):
    """Tables that spill, a worker SIGKILLed after a checkpoint: Redis keeps the killed
    attempt's rows, newer than the checkpoint among them. The resumed attempt rewrites or
    deletes them as it restores (``restoring``), never reads one, and ends bit-exactly like
    the uninterrupted run whose rows never spilled."""
    data, reference = uninterrupted
    job = _job(data, tmp_path / "spilling", uuid.uuid4().hex, *spilling_overrides(redis_server.url)).start()
    # late after the checkpoint of step 30: rows of keys first seen since then have spilled too
    hit = _fault(job, [(38, 1)], signal.SIGKILL)
    _wait(job.proc, job.run_dir, job.tag)
    _assert_resumed_from_last_checkpoint(job, hit)
    assert_exactly_once(job.run_dir, data, epochs=EPOCHS)
    assert_same_end(reference, job.run_dir)
    import redis

    client = redis.Redis.from_url(redis_server.url)
    try:  # the rows did spill: the run's namespace holds some at the end
        assert next(client.scan_iter(match="recsys-*:spill:*"), None) is not None
    finally:
        client.close()


@pytest.mark.slow  # 77 s, most of it the collective timeout and torchrun's 30 s grace: make test stays < 20 min
def test_a_stopped_worker_is_noticed_and_the_job_restarts_to_the_same_result(uninterrupted, tmp_path):
    """SIGSTOP: the peer's collective times out after train.runtime.collective_timeout_s (not gloo's
    30 minutes), it exits, torchrun kills the stopped worker and restarts both from the last
    checkpoint; the job ends exactly like the uninterrupted one."""
    data, reference = uninterrupted
    job = _job(data, tmp_path / "stopped", uuid.uuid4().hex, "train.runtime.collective_timeout_s=15").start()
    hit = _fault(job, [(25, 1)], signal.SIGSTOP)
    _wait(job.proc, job.run_dir, job.tag)
    _assert_resumed_from_last_checkpoint(job, hit)
    assert_exactly_once(job.run_dir, data, epochs=EPOCHS)
    assert_same_end(reference, job.run_dir)


@pytest.mark.slow
def test_a_killed_worker_at_staleness_one_resumes_exactly(tiny, tmp_path):
    """A checkpoint is a synchronization point of the store, so even at staleness 1 the
    killed job ends exactly like the uninterrupted one (the issue asks AUC within 0.005)."""
    ref = _job(tiny, tmp_path / "reference-s1", uuid.uuid4().hex, "store.staleness=1").start()
    _wait(ref.proc, ref.run_dir, ref.tag)
    job = _job(tiny, tmp_path / "killed-s1", uuid.uuid4().hex, "store.staleness=1").start()
    hit = _fault(job, [(37, 0)], signal.SIGKILL)
    _wait(job.proc, job.run_dir, job.tag)
    _assert_resumed_from_last_checkpoint(job, hit)
    assert_exactly_once(job.run_dir, tiny, epochs=EPOCHS)
    assert_same_end(ref.run_dir, job.run_dir)
    assert compare_runs(ref.run_dir, job.run_dir, exact=True)["ok"]


# --------------------------------------------------------------------------- end-of-epoch resume


def _two_rank_run(rank, world, data, run_dir, extra, resume):
    from test_train import run

    return run(Path(data), Path(run_dir), *extra, resume=resume)


def _batches_per_rank(data: Path, batch_size: int) -> list[int]:
    from recsys.config import load_job
    from recsys.io.reader import ParquetReader

    job = load_job(JOB, overrides(data, f"data.train.batch_size={batch_size}"))
    out = []
    for rank in range(2):
        with ParquetReader(job.data.train, job.schema, rank=rank, world_size=2) as reader:
            out.append(sum(1 for _ in reader))
    return out


def _assert_same_run(full: Path, resumed: Path, from_step: int) -> None:
    a, b = losses(full), losses(resumed)
    assert sorted(b) == [s for s in sorted(a) if s > from_step]
    assert {s: a[s] for s in b} == b
    ra, rb = final_rows(full), final_rows(resumed)
    assert ra.keys() == rb.keys()
    for name in ra:
        assert ra[name].keys() == rb[name].keys(), f"table {name}: different keys"
        for key in ra[name]:
            np.testing.assert_array_equal(ra[name][key], rb[name][key], err_msg=f"table {name} key {key}")


@pytest.mark.parametrize("after_end", [pytest.param(0, id="at-the-short-ranks-last-batch", marks=pytest.mark.slow),
                                       pytest.param(1, id="one-empty-batch-later", marks=pytest.mark.slow)])
def test_resume_where_one_rank_already_finished_the_epoch(tiny, tmp_path, after_end):
    """Two ranks with uneven shares: the checkpoint is taken when the short rank's data ran out
    (its look-ahead fetch came back empty) but the other's did not; the resumed run must go on
    exactly like the uninterrupted one (the short rank feeds empty batches until the epoch ends)."""
    data = tiny
    batches = _batches_per_rank(data, 48)
    short = min(batches)
    at = short + after_end
    assert at < max(batches), f"the scenario needs uneven ranks: {batches} batches per rank"
    extra = ["data.train.batch_size=48", "train.epochs=2", f"train.checkpoint.every_steps={at}",
             "train.checkpoint.keep_last=10", "train.runtime.collective_timeout_s=30"]
    full = run_distributed(_two_rank_run, 2, str(data), str(tmp_path / "full"), extra, None, timeout=120)
    ckpt = tmp_path / "full" / "checkpoints" / f"step-{at:08d}"
    assert (ckpt / "meta.json").exists()
    # a rank that rolled into the next epoch no longer pairs its collectives with the other's:
    # without a bound this hangs for gloo's default 30 minutes
    resumed = run_distributed(_two_rank_run, 2, str(data), str(tmp_path / "resumed"), extra, str(ckpt),
                              timeout=120)
    assert resumed[0] == full[0]  # step, epoch, final evaluation
    _assert_same_run(tmp_path / "full", tmp_path / "resumed", at)


# --------------------------------------------------------------------------- checkpoint pointer


def _save(root: Path, step: int, marker: float):
    import pyarrow as pa
    import torch

    from recsys.checkpoint import write as ckpt

    rows = pa.table({"key": pa.array([1, 2], pa.int64()), "embedding": pa.array([[marker], [marker]])})
    return ckpt.save(root, step, sparse={"t": rows}, dense={"w": torch.full((2,), marker)}, meta={}, keep_last=3)


def test_resaving_a_step_never_leaves_latest_naming_nothing(tmp_path, monkeypatch):
    """A crash in the middle of re-saving the step ``latest`` names (SIGTERM right after a
    periodic save) must leave ``latest`` naming a complete checkpoint that loads: the re-save
    never renames over it (the crash hook on that rename never fires). A save of the same
    step over a leftover no pointer names does rename, and a crash there (the hook fires)
    leaves ``latest`` naming the checkpoint it named."""
    from recsys.checkpoint import write as ckpt

    root = tmp_path / "checkpoints"
    _save(root, 10, 1.0)
    real_replace = os.replace
    crashed: list[str] = []

    def crash_on_checkpoint_rename(src, dst):
        if Path(dst).name.startswith("step-"):
            crashed.append(Path(dst).name)
            raise KeyboardInterrupt("killed between removing and renaming")  # not an Exception: a crash
        return real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", crash_on_checkpoint_rename)
    _save(root, 10, 2.0)  # the step latest names: kept as it is, nothing renamed over it
    assert crashed == []
    (root / "step-00000011").mkdir()  # a leftover of step 11, no marker: the next save replaces it
    with pytest.raises(KeyboardInterrupt):
        _save(root, 11, 3.0)
    assert crashed == ["step-00000011"], crashed
    monkeypatch.undo()
    found = ckpt.latest(root)
    assert found == root / "step-00000010"
    assert ckpt.load_meta(found)["step"] == 10
    assert ckpt.load_dense(found)["w"].tolist() == [1.0, 1.0]
    assert ckpt.load_sparse(found)["t"].column("key").to_pylist() == [1, 2]
