"""``recsys bench faults``: the fault scenarios of training, run for real, with their figures.

Every scenario launches ``recsys train`` (torchrun, gloo, 2 workers unless said) on the tiny
synthetic set (generated under the output directory if missing), injects its fault into the
real processes, and checks what the project promises (RELIABILITY.md):

- ``killed_worker``: SIGKILL one worker at a random step (a seed picks step and rank) under
  ``--max-restarts 2``. Passed when the job finishes, every training row was consumed exactly
  once per epoch (``train.record_rows``), and the final evaluation and the final sparse rows
  equal an uninterrupted run's, at staleness 0 and 1 alike (a checkpoint is a synchronization
  point of the store; the issue asked for AUC within 0.005 at s = 1: exact is stronger).
  Figure: seconds from the kill to the first step after the restart.
- ``hung_worker``: SIGSTOP one worker. The other notices within ``train.collective_timeout_s``
  (20 s here) and exits; torchrun kills the stopped one and restarts both from the last
  checkpoint. Passed as above. Figures: seconds from SIGSTOP to the peer's exit (detection)
  and to the first step after the restart.
- ``checkpoint_crash``: a worker is SIGKILLed at a point of a checkpoint write (the
  checkpoint module's ``RECSYS_FAULT_CHECKPOINT`` hook). Passed when the job resumes once,
  from a complete checkpoint, leaves no temp or half-deleted directory behind and ends
  exactly like the uninterrupted run. Figure: the step it resumed from.
- ``preemption``: SIGTERM to the launcher (what Kubernetes and Slurm send). Passed when it
  exits 0 with a checkpoint of every worker, and the same command resumes and ends exactly
  like the uninterrupted run. Figure: seconds from SIGTERM to the launcher's exit.
- ``spill_outage``: Redis under the spill tier (tables small enough to spill) stops after
  the first checkpoint: the job exits 2 with one line naming the intact checkpoint; Redis
  returns empty and the same command resumes to exactly the uninterrupted run's end (the run
  without spilling: a spilled row comes back bit-exact). Figure: seconds from the Redis stop
  to the job's exit.
- ``bad_data``: a truncated training file: by default one line naming it (exit 2); with
  ``on_bad_file = "skip"`` the job trains on the other files, each of their rows exactly
  once per epoch, and counts the skipped file in its ``epoch_end`` events.
- ``clear_errors``: a missing data path under ``--nproc 2``: exit code 2 and one line.
- ``elastic_nodes``: two agents on loopback (``--nnodes 1:2``, one worker each). One node is
  SIGKILLed with its worker: the other goes on at world size 1 from the last checkpoint; a
  new node joins: the job grows back to 2 from the checkpoint torchrun's stop made. Passed
  when every row is consumed exactly once per epoch (and, full run, the trajectory equals the
  same world sizes trained as clean stages, step by step). Figures: seconds from the kill
  and from the join to the first step after, rows lost and repeated.
- ``resize``: 2 → 1 → 3 workers by SIGTERM and the same command with another ``--nproc``.
  Passed as ``elastic_nodes``. Figures: seconds from SIGTERM to exit and from each launch to
  its first step, rows lost and repeated.

A job's processes carry ``RECSYS_TEST_TAG=<tag>`` in their environment, so its workers are
found through ``/proc`` (Linux) and every leftover is killed at the end, orphans included.
Quick: one seed per scenario, 1 epoch, no staged references; full: several seeds, 2
epochs. No timing assertion anywhere: a scenario passes or fails on results; the seconds
are figures.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
import uuid
from pathlib import Path

import numpy as np

from recsys.harness import (DEADLINE_S, ROOT, TrainJob, environ_of, final_rows, kill_tagged, last_step, losses,
                            records, start_redis, tagged, wait_for, workers)
from recsys.runtime.spawn import free_port

EVERY = 10
"""Checkpoint interval (steps) of the scenario jobs."""
EPOCHS = 2
"""Epochs of the scenario jobs (the tests' and the full bench's; --quick runs 1)."""
STEPS_PER_EPOCH = 48  # tiny: 6,000 rows / (2 ranks x 64)


def job_overrides(data: Path, *extra: str, epochs: int = EPOCHS) -> list[str]:
    """The scenario jobs' settings: tiny data, ``epochs`` epochs, a checkpoint every ``EVERY`` steps."""
    return [
        f"data.train.paths=['{data / 'train'}']",
        f"data.eval.paths=['{data / 'eval'}']",
        "data.train.batch_size=64",
        "data.eval.batch_size=1024",
        "data.train.passthrough=['row_id']",
        "train.record_rows=true",
        "train.log_every=1",
        "train.warmup_steps=0",
        "train.progress='none'",
        f"train.epochs={epochs}",
        f"train.checkpoint_every_steps={EVERY}",
        "train.collective_timeout_s=60",
        *extra,
    ]


def spilling_overrides(url: str) -> list[str]:
    """Settings that make the scenario job's larger tables spill to the Redis at ``url``."""
    small = [f"schema.tables.{t}.capacity={300 if t[0] == 'c' else 1000}"
             for t in ("c3", "c4", "c7", "c10", "c12", "c15", "c16", "c21", "c24", "c26", "m1", "m2")]
    return [f"store.spill_url='{url}'", "store.spill_retries=2", "store.spill_backoff_s=0.02",
            "store.spill_timeout_s=1.0", *small]


# --------------------------------------------------------------------------- membership changes


class ScenarioFailed(RuntimeError):
    """A promise of a scenario did not hold (the message says which, with the logs)."""


def require(condition, message) -> None:
    """Raise ``ScenarioFailed(message)`` unless ``condition`` (``message`` may be a callable,
    called only on failure)."""
    if not condition:
        raise ScenarioFailed(message() if callable(message) else message)


def steps(run_dir: Path) -> list[int]:
    """The steps logged so far (a rolled-back step appears again)."""
    return [r["step"] for r in records(run_dir) if "loss/train" in r]


def resumed_events(run_dir: Path) -> list[dict]:
    return [r for r in records(run_dir) if r.get("event") == "resumed"]


def stepped_after_resume(run_dir: Path, count: int) -> dict | None:
    """The ``count``-th ``resumed`` event once a step after it is logged, else None."""
    recs = records(run_dir)
    idx = [i for i, r in enumerate(recs) if r.get("event") == "resumed"]
    if len(idx) < count:
        return None
    at = idx[count - 1]
    return recs[at] if any("loss/train" in r for r in recs[at + 1:]) else None


def checkpoints_before(run_dir: Path, record: dict) -> list[int]:
    """The steps of the checkpoints logged before ``record``."""
    recs = records(run_dir)
    return [r["step"] for r in recs[:recs.index(record)] if r.get("event") == "checkpoint"]


def attempts(run_dir: Path) -> list[tuple[int, int]]:
    """(start step, world size) of every attempt, from the row audit's directories (one file
    per rank, created when the rank starts)."""
    out = []
    for path in sorted((Path(run_dir) / "rows").glob("attempt-*")):
        out.append((int(path.name.split("-")[3]), len(list(path.glob("rank-*.i64")))))
    return out


def trajectory(run_dir: Path) -> list[tuple[int, int]]:
    """The final trajectory's segments: (start step, world size), rolled-back attempts removed."""
    segments: list[tuple[int, int]] = []
    for start, world in attempts(run_dir):
        while segments and segments[-1][0] >= start:
            segments.pop()
        segments.append((start, world))
    return segments


class Nodes:
    """The agents of one multi-node job on loopback: each a "node" (``recsys train --nproc 1
    --nnodes 1:2``) with its own tag and log, all on one run directory."""

    def __init__(self, run_dir: Path, overrides: list[str], max_restarts: int = 3) -> None:
        self.run_dir, self.overrides, self.max_restarts = Path(run_dir), list(overrides), max_restarts
        self.endpoint = f"127.0.0.1:{free_port()}"
        self.job_id = uuid.uuid4().hex[:12]
        self.jobs: dict[str, TrainJob] = {}

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        return {name: job.proc for name, job in self.jobs.items()}

    def start(self, name: str, host: bool = False) -> subprocess.Popen:
        """Start a node; ``host``: it hosts the rendezvous (every node's address is 127.0.0.1
        here, so the roles are given instead of derived from the endpoint)."""
        multinode = ["--nnodes", "1:2", "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.job_id,
                     # a node without a heartbeat for 3 x 2 s is dropped; 3 s more for late joiners
                     "--rdzv-conf", f"last_call_timeout=3,keep_alive_interval=2,keep_alive_max_attempt=3,is_host={host}"]
        job = TrainJob(self.run_dir, self.overrides, nproc=1, max_restarts=self.max_restarts, name=name,
                       launcher_args=multinode)
        self.jobs[name] = job.start()
        return job.proc

    def log(self, name: str) -> Path:
        return self.jobs[name].log_path

    def logs(self) -> str:
        return "\n".join(f"--- {name}\n{job.log_tail(3000)}" for name, job in self.jobs.items())

    def kill(self, name: str) -> None:
        """SIGKILL the node: its agent and its worker at once."""
        kill_tagged(self.jobs[name].tag)
        self.jobs[name].proc.wait()

    def workers(self) -> dict[int, dict[str, str]]:
        """{pid: environment} of the live training workers of every node."""
        out = {}
        for job in self.jobs.values():
            for pid in tagged(job.tag):
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                env = environ_of(pid)
                if b"recsys.train" in cmdline and "RANK" in env:
                    out[pid] = env
        return out

    def world_sizes(self) -> list[int]:
        return sorted(int(env["WORLD_SIZE"]) for env in self.workers().values())

    def alive(self, name: str) -> bool:
        return self.jobs[name].proc.poll() is None

    def training(self, *names: str) -> bool:
        """True once the nodes ``names`` train as two workers of world size 2 past a checkpoint
        of theirs, or once one of them ended (the caller then says which)."""
        recs = records(self.run_dir)
        since = recs[max((i for i, r in enumerate(recs) if r.get("event") == "resumed"), default=0):]
        ckpt = [r["step"] for r in since if r.get("event") == "checkpoint"]
        if not all(self.alive(name) for name in names):
            return True
        return bool(self.world_sizes() == [2, 2] and ckpt and max(steps(self.run_dir), default=0) >= max(ckpt) + 2)

    def finish(self, *names: str, timeout: float = DEADLINE_S) -> None:
        """Wait for the nodes ``names`` to exit 0."""
        for name in names:
            try:
                code = self.jobs[name].proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise ScenarioFailed(f"node {name} did not finish in {timeout:.0f}s:\n{self.logs()}") from None
            require(code == 0, lambda: f"node {name} exited with {code}:\n{self.logs()}")

    def close(self) -> None:
        for job in self.jobs.values():
            job.kill()


def staged_reference(run_dir: Path, overrides: list[str], segments: list[tuple[int, int]]) -> None:
    """Train the world-size schedule ``segments`` ((start step, world size), as
    ``trajectory`` returns) as clean stages: ``train.max_steps`` at each change, then a relaunch
    with the next ``--nproc`` on the same run directory."""
    for i, (_start_step, world) in enumerate(segments):
        stop = [f"train.max_steps={segments[i + 1][0]}"] if i + 1 < len(segments) else []
        job = TrainJob(run_dir, [*overrides, *stop], nproc=world, max_restarts=0).start()
        code = job.wait()
        require(code == 0, lambda: f"stage {i} of the staged reference exited with {code}:\n{job.log_tail()}")


def same_training(reference: Path, run_dir: Path) -> dict:
    """Compare a run whose world size changed with ``staged_reference``'s: the same loss at
    every step, the same final evaluation, bit-identical sparse rows."""
    a, b = losses(reference), losses(run_dir)
    out = compare_runs(reference, run_dir, exact=True)
    out["steps"] = len(b)
    out["steps_with_other_loss"] = sum(1 for step in a.keys() | b.keys() if a.get(step) != b.get(step))
    out["ok"] = out["ok"] and out["steps_with_other_loss"] == 0
    return out


def leave_and_join(run_dir: Path, overrides: list[str], cycles: int) -> dict:
    """Nodes a and b train; then ``cycles`` times: kill the second node entirely (agent and
    worker, SIGKILL), check that a goes on alone at world size 1 from the last checkpoint,
    start a new node and check that the job grows back to 2 from a's SIGTERM checkpoint (torchrun
    stops a's worker to admit the new node). Return the figures and the final trajectory."""
    nodes = Nodes(run_dir, overrides)
    figures: dict = {"resume_after_leave_s": [], "resume_after_join_s": []}
    try:
        nodes.start("a", host=True)  # a hosts the rendezvous (the endpoint's store): it stays
        nodes.start("b")  # usually within a's last call; if not, a trains alone until b joins
        second = "b"
        for cycle in range(cycles):
            wait_for(lambda: nodes.training("a", second), DEADLINE_S,
                     f"cycle {cycle}: two nodes training past a checkpoint")
            require(nodes.alive("a") and nodes.alive(second), lambda: "a node ended:\n" + nodes.logs())

            killed_at = max(steps(run_dir))
            t_kill = time.monotonic()
            nodes.kill(second)
            n = len(resumed_events(run_dir)) + 1
            wait_for(lambda: stepped_after_resume(run_dir, n) or not nodes.alive("a"), DEADLINE_S,
                     f"cycle {cycle}: node a to resume alone")
            figures["resume_after_leave_s"].append(round(time.monotonic() - t_kill, 1))
            resumed = stepped_after_resume(run_dir, n)
            require(resumed is not None, lambda: "node a ended:\n" + nodes.logs())
            # from the last checkpoint before the kill, at world size 1
            require(resumed["step"] == max(checkpoints_before(run_dir, resumed)) <= killed_at,
                    f"node a resumed from step {resumed['step']}, not from the last checkpoint before the kill "
                    f"(step {killed_at}): {resumed}")
            require(resumed["saved_world_size"] == 2, f"resumed from a checkpoint of another world: {resumed}")
            require(nodes.world_sizes() == [1], lambda: f"expected one worker of world size 1: {nodes.workers()}")

            second = f"n{cycle}"
            t_join = time.monotonic()
            nodes.start(second)
            wait_for(lambda: stepped_after_resume(run_dir, n + 1) or not nodes.alive("a"), DEADLINE_S,
                     f"cycle {cycle}: node {second} to join")
            figures["resume_after_join_s"].append(round(time.monotonic() - t_join, 1))
            grown = stepped_after_resume(run_dir, n + 1)
            require(grown is not None, lambda: "the job ended before the new node joined:\n" + nodes.logs())
            # torchrun stopped a's worker with SIGTERM: it checkpointed at the end of its step
            stops = checkpoints_before(run_dir, grown)
            require(grown["step"] == max(stops) > resumed["step"],
                    f"the grown job resumed from step {grown['step']}, not from a's stop checkpoint: {stops}")
            require(grown["saved_world_size"] == 1, f"resumed from a checkpoint of another world: {grown}")
            wait_for(lambda: nodes.world_sizes() == [2, 2] or not nodes.alive("a"), DEADLINE_S,
                     "two workers of world size 2")
        nodes.finish("a", second)
    finally:
        nodes.close()
    figures["trajectory"] = trajectory(run_dir)
    return figures


def stop_and_resume(run_dir: Path, overrides: list[str], sizes: list[int], steps_each: int) -> dict:
    """Launch with ``--nproc sizes[0]``, SIGTERM the launcher after ``steps_each`` steps,
    relaunch with the next size on the same run directory...; the last size runs to the end.
    Return the figures and the final trajectory."""
    figures: dict = {"stop_s": [], "resume_s": []}
    for i, nproc in enumerate(sizes):
        job = TrainJob(run_dir, overrides, nproc=nproc, max_restarts=0)
        before = json.loads((run_dir / "result.json").read_text())["step"] if i else 0  # where it stopped
        t_launch = time.monotonic()
        job.start()
        try:
            if i:
                wait_for(lambda: stepped_after_resume(run_dir, i) or job.proc.poll() is not None, DEADLINE_S,
                         f"launch {i} (--nproc {nproc}) to resume")
                figures["resume_s"].append(round(time.monotonic() - t_launch, 1))
                resumed = stepped_after_resume(run_dir, i)
                require(resumed is not None, lambda: job.log_tail())
                require(resumed["step"] == before and resumed["saved_world_size"] == sizes[i - 1],
                        f"launch {i} resumed from {resumed}, not from step {before} of world size {sizes[i - 1]}")
            if i + 1 < len(sizes):
                wait_for(lambda: max(steps(run_dir), default=0) >= before + steps_each or job.proc.poll() is not None,
                         DEADLINE_S, f"launch {i}: {steps_each} steps")
                require(job.proc.poll() is None, lambda: "the job ended before SIGTERM:\n" + job.log_tail())
                t_term = time.monotonic()
                job.proc.send_signal(signal.SIGTERM)
            code = job.wait()
            if i + 1 < len(sizes):
                figures["stop_s"].append(round(time.monotonic() - t_term, 1))
        finally:
            job.kill()
        require(code == 0, lambda: f"launch {i} exited with {code}:\n{job.log_tail()}")
        if i + 1 < len(sizes):
            require("every worker saved a checkpoint" in job.log_tail(100_000), lambda: job.log_tail())
            stopped = json.loads((run_dir / "result.json").read_text())
            require(stopped.get("stopped") == "SIGTERM" and stopped["step"] >= before + steps_each,
                    f"launch {i} did not stop on SIGTERM after {steps_each} steps: {stopped}")
    figures["trajectory"] = trajectory(run_dir)
    return figures


# --------------------------------------------------------------------------- results


def train_row_ids(data: Path) -> np.ndarray:
    import pyarrow.dataset as ds

    return ds.dataset(Path(data) / "train").to_table(columns=["row_id"]).column("row_id").to_numpy()


def train_row_ids_of(path: Path) -> np.ndarray:
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=["row_id"]).column("row_id").to_numpy()


def compare_runs(reference: Path, run_dir: Path, exact: bool, auc_tolerance: float = 0.005) -> dict:
    """Compare a faulted run's result with the uninterrupted one's: exactly (the same final
    evaluation and bit-identical sparse rows) or the final AUC within ``auc_tolerance``."""
    want = json.loads((Path(reference) / "result.json").read_text())
    got = json.loads((Path(run_dir) / "result.json").read_text())
    out = {"auc": got.get("auc"), "reference_auc": want.get("auc"),
           "auc_delta": abs(got.get("auc", float("nan")) - want.get("auc", float("nan")))}
    if exact:
        a, b = final_rows(reference), final_rows(run_dir)
        differing = sum(1 for t in a for k in a[t] if b.get(t, {}).get(k) != a[t][k])
        extra = sum(len(set(b.get(t, {})) - set(a[t])) for t in a) + len(set(b) - set(a))
        out.update(result_equal=got == want, rows_differing=differing + extra)
        out["ok"] = out["result_equal"] and out["rows_differing"] == 0
    else:
        out["ok"] = out["auc_delta"] <= auc_tolerance
    return out


def rows_lost_and_repeated(audit: dict) -> dict:
    """The figures of a ``row_audit``: training rows never consumed and consumed again, over all epochs."""
    return {"rows_lost": sum(e["missing"] for e in audit["epochs"].values()),
            "rows_repeated": sum(e["repeated"] for e in audit["epochs"].values())}


def row_audit(run_dir: Path, data: Path, epochs: int) -> dict:
    from recsys.train.rows import check_exactly_once

    report = check_exactly_once(run_dir, train_row_ids(data), epochs)
    return {"ok": report["ok"], "epochs": {str(e): v for e, v in report["epochs"].items()}}


# --------------------------------------------------------------------------- scenarios


class Scenarios:
    """The scenarios of one bench run, sharing the data and the uninterrupted references."""

    def __init__(self, out: Path, data: Path, epochs: int = EPOCHS) -> None:
        self.out, self.data, self.epochs = out, data, epochs
        self._references: dict[int, Path] = {}

    def overrides(self, *extra: str) -> list[str]:
        return job_overrides(self.data, *extra, epochs=self.epochs)

    def fault_point(self, rng: random.Random) -> tuple[int, int]:
        """Return (a step after the first checkpoint and before the last, a rank)."""
        return rng.randrange(EVERY + 2, self.epochs * STEPS_PER_EPOCH - EVERY), rng.randrange(2)

    def reference(self, staleness: int) -> Path:
        """The uninterrupted run at ``staleness`` (run once)."""
        if staleness not in self._references:
            run_dir = self.out / f"reference-s{staleness}"
            job = TrainJob(run_dir, self.overrides(f"store.staleness={staleness}")).start()
            code = job.wait()
            if code != 0:
                raise RuntimeError(f"the uninterrupted reference run failed ({code}):\n{job.log_tail()}")
            self._references[staleness] = run_dir
        return self._references[staleness]

    def _finish(self, job: TrainJob, staleness: int, details: dict) -> bool:
        code = job.wait()
        details["exit_code"] = code
        if code != 0:
            details["log_tail"] = job.log_tail(1500)
            return False
        details["rows"] = row_audit(job.run_dir, self.data, self.epochs)
        details["result"] = compare_runs(self.reference(staleness), job.run_dir, exact=True)
        details["resumed"] = [r["step"] for r in job.records() if r.get("event") == "resumed"]
        return details["rows"]["ok"] and details["result"]["ok"]

    def killed_worker(self, seed: int, staleness: int = 0) -> dict:
        rng = random.Random(seed)
        at, victim = self.fault_point(rng)
        self.reference(staleness)
        job = TrainJob(self.out / f"killed-s{staleness}-seed{seed}", self.overrides(f"store.staleness={staleness}"))
        details: dict = {"seed": seed, "staleness": staleness, "victim_rank": victim, "kill_after_step": at}
        try:
            pids = job.start().wait_for_step(at, attempt=0)
            os.kill(pids[victim], signal.SIGKILL)
            killed = time.monotonic()
            details["killed_at_step"] = last_step(job.records())
            seconds = job.seconds_to_step_after_resume(1, killed)
        except BaseException:
            job.kill()
            raise
        passed = self._finish(job, staleness, details)
        return {"name": f"killed_worker[s={staleness},seed={seed}]", "passed": passed,
                "figure": {"kill_to_first_step_s": round(seconds, 2)}, "details": details}

    def hung_worker(self, seed: int, timeout_s: float = 20.0) -> dict:
        rng = random.Random(seed)
        at, victim = self.fault_point(rng)
        self.reference(0)
        job = TrainJob(self.out / f"hung-seed{seed}",
                       self.overrides(f"train.collective_timeout_s={timeout_s}"))
        details: dict = {"seed": seed, "victim_rank": victim, "stop_after_step": at, "collective_timeout_s": timeout_s}
        try:
            pids = job.start().wait_for_step(at, attempt=0)
            peer = pids[1 - victim]
            os.kill(pids[victim], signal.SIGSTOP)
            stopped = time.monotonic()
            details["stopped_at_step"] = last_step(job.records())
            wait_for(lambda: peer not in workers(job.tag)[1].values() or job.proc.poll() is not None,
                     DEADLINE_S, "the peer of the stopped worker to exit")
            detected = time.monotonic() - stopped
            seconds = job.seconds_to_step_after_resume(1, stopped)
        except BaseException:
            job.kill()
            raise
        passed = self._finish(job, 0, details)
        return {"name": f"hung_worker[seed={seed}]", "passed": passed,
                "figure": {"detection_s": round(detected, 2), "stop_to_first_step_s": round(seconds, 2)},
                "details": details}

    def preemption(self, seed: int) -> dict:
        rng = random.Random(seed)
        at, _ = self.fault_point(rng)
        self.reference(0)
        run_dir = self.out / f"preempted-seed{seed}"
        job = TrainJob(run_dir, self.overrides())
        details: dict = {"seed": seed, "sigterm_after_step": at}
        try:
            job.start().wait_for_step(at, attempt=0)
            job.proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            first = job.wait()
            exited = time.monotonic() - sent
        except BaseException:
            job.kill()
            raise
        details["first_exit_code"] = first
        details["stopped_at_step"] = last_step(job.records())
        again = TrainJob(run_dir, job.overrides)  # the same command
        passed = first == 0 and self._finish(again.start(), 0, details)
        return {"name": f"preemption[seed={seed}]", "passed": passed,
                "figure": {"sigterm_to_exit_s": round(exited, 2)}, "details": details}

    def checkpoint_crash(self, point: str, at_step: int = 2 * EVERY) -> dict:
        """A worker SIGKILLs itself at ``point`` of the save of ``at_step`` (the checkpoint
        module's test hook, first attempt only); torchrun restarts the job, which must resume
        from a complete checkpoint and end exactly like the uninterrupted run."""
        from recsys.checkpoint import read as checkpoint_files
        from recsys.checkpoint.write import FAULT_ENV

        rank = 0 if point in ("after-marker", "before-latest", "after-latest", "prune") else 1  # rank 0's steps
        self.reference(0)
        job = TrainJob(self.out / f"ckpt-crash-{point}", self.overrides("train.keep_last=1"),
                       env={FAULT_ENV: f"{point}:step={at_step}:rank={rank}"})
        details: dict = {"point": point, "step": at_step, "rank": rank}
        passed = self._finish(job.start(), 0, details)
        resumed = details.get("resumed", [])
        leftovers = sorted(p.name for p in (job.run_dir / "checkpoints").glob(".*-step-*"))
        latest = checkpoint_files.latest(job.run_dir / "checkpoints")
        details.update(leftovers=leftovers, latest=latest.name if latest else None)
        passed = passed and len(resumed) == 1 and resumed[0] in (at_step - EVERY, at_step) and not leftovers
        return {"name": f"checkpoint_crash[{point}]", "passed": passed,
                "figure": {"resumed_from_step": resumed[0] if resumed else None}, "details": details}

    def bad_data(self) -> dict:
        """One training file truncated (a copy of the data): by default the job stops before
        training with one line naming the file (exit 2); with ``data.train.on_bad_file =
        "skip"`` it trains on the other files, every one of their rows exactly once per
        epoch, and its ``epoch_end`` events count the skipped file."""
        import shutil

        from recsys.train.rows import check_exactly_once

        bad = self.out / "bad-data"
        shutil.copytree(self.data, bad)
        files = sorted((bad / "train").glob("*.parquet"))
        victim = files[len(files) // 2]
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
        good = np.concatenate([train_row_ids_of(f) for f in files if f != victim])

        stop = TrainJob(self.out / "bad-data-error", job_overrides(bad, epochs=self.epochs)).start()
        code = stop.wait()
        lines = [ln for ln in stop.log_tail().splitlines() if ln.strip()]
        stopped = code == 2 and len(lines) == 1 and victim.name in lines[0]

        skip = TrainJob(self.out / "bad-data-skip",
                        job_overrides(bad, "data.train.on_bad_file='skip'", epochs=self.epochs)).start()
        details: dict = {"file": victim.name, "error_exit_code": code, "error_output": lines[:3],
                         "skip_exit_code": skip.wait()}
        ends = [r for r in skip.records() if r.get("event") == "epoch_end"]
        details["epoch_end"] = ends
        skipped = details["skip_exit_code"] == 0 and len(ends) == self.epochs and all(
            e["skipped_files"] == 1 for e in ends)
        if details["skip_exit_code"] == 0:
            report = check_exactly_once(skip.run_dir, good, self.epochs)
            details["rows"] = {"ok": report["ok"], "epochs": {str(e): v for e, v in report["epochs"].items()}}
            skipped = skipped and report["ok"]
        else:
            details["log_tail"] = skip.log_tail(1500)
        return {"name": "bad_data[truncated file: error, then skip]", "passed": stopped and skipped,
                "figure": {"skipped_files": ends[-1]["skipped_files"] if ends else None,
                           "rows_trained_per_epoch": int(good.size)},
                "details": details}

    def spill_outage(self) -> dict:
        """Redis under the spill tier stops after the first checkpoint of a job whose tables
        spill (``store.spill_outage = "fail"``): the job exits 2 with one line naming the
        intact checkpoint; Redis comes back (empty: no persistence) and the same command
        resumes to exactly the end of the uninterrupted run, the one whose tables are large
        enough never to spill (a spilled row comes back bit-exact with its optimizer state)."""
        from recsys.checkpoint import read as checkpoint_files

        workdir = self.out / "spill-redis"
        workdir.mkdir(parents=True, exist_ok=True)
        server = start_redis(workdir)
        url, port = server.url, server.port
        extra = spilling_overrides(url)
        details: dict = {}
        try:
            reference = self.reference(0)  # spilling is exact: the same end as with every row in memory
            job = TrainJob(self.out / "spill-outage", self.overrides(*extra)).start()
            try:
                wait_for(lambda: checkpoint_files.latest(job.run_dir / "checkpoints") is not None
                         or job.proc.poll() is not None, DEADLINE_S, "the first checkpoint")
                server.proc.kill()
                server.proc.wait()
                stopped = time.monotonic()
                code = job.wait()
                exit_s = time.monotonic() - stopped
            except BaseException:
                job.kill()
                raise
            lines = [ln for ln in job.log_tail().splitlines() if ln.startswith("recsys train:")]
            latest = checkpoint_files.latest(job.run_dir / "checkpoints")
            details.update(exit_code=code, output=lines[:3], latest=str(latest))
            one_line = code == 2 and len(lines) == 1 and latest is not None and str(latest) in lines[0]
            server = start_redis(workdir, port=port)  # back, empty
            again = TrainJob(job.run_dir, job.overrides).start()
            code2 = again.wait()
            details["resume_exit_code"] = code2
            exact = False
            if code2 == 0:
                details["rows"] = row_audit(job.run_dir, self.data, self.epochs)
                details["result"] = compare_runs(reference, job.run_dir, exact=True)
                exact = details["rows"]["ok"] and details["result"]["ok"]
            else:
                details["log_tail"] = again.log_tail(1500)
        finally:
            server.proc.kill()
            server.proc.wait()
        return {"name": "spill_outage[fail, then resume]", "passed": one_line and exact,
                "figure": {"redis_stop_to_exit_s": round(exit_s, 2)}, "details": details}

    def elastic_nodes(self, cycles: int, exact: bool) -> dict:
        """Two agents on loopback (one worker each, ``--nnodes 1:2``); ``cycles`` times: one
        node is SIGKILLed with its worker, the other goes on at world size 1 from the last
        checkpoint, a new node joins and the job grows back to 2. Passed when both changes
        resume from the right checkpoint, the job finishes, every row is consumed exactly once
        per epoch and (``exact``) the run equals the same world-size schedule trained as clean
        stages: the optimizer state and reader position were carried exactly."""
        # smaller batches: enough steps per epoch for the changes; few periodic checkpoints
        sets = self.overrides("data.train.batch_size=16", "train.log_every=2", "train.threads=1",
                              f"train.checkpoint_every_steps={25 if cycles == 1 else EVERY}")
        run_dir = self.out / f"elastic-{cycles}"
        figures = leave_and_join(run_dir, sets, cycles)
        # node a may train alone until b joins: then the trajectory starts at world size 1
        allowed = ([2, 1] * cycles + [2], [1] + [2, 1] * cycles + [2])
        return self._membership(f"elastic_nodes[{cycles} leave+join{', exact' if exact else ''}]", run_dir, sets,
                                figures, allowed, exact,
                                {"resume_after_leave_s": figures["resume_after_leave_s"],
                                 "resume_after_join_s": figures["resume_after_join_s"]})

    def resize(self, sizes: list[int], exact: bool) -> dict:
        """Stop-and-resume through the world sizes ``sizes``: SIGTERM to the launcher, the same
        command with the next ``--nproc``. Passed as ``elastic_nodes``."""
        sets = self.overrides("data.train.batch_size=32", "train.log_every=2", "train.threads=1",
                              "train.checkpoint_every_steps=0")  # SIGTERM makes the checkpoints
        run_dir = self.out / f"resize-{'-'.join(map(str, sizes))}"
        figures = stop_and_resume(run_dir, sets, sizes, 12 if self.epochs == 1 else 60)  # a change in each epoch
        return self._membership(f"resize[{' -> '.join(map(str, sizes))} by stop and resume"
                                f"{', exact' if exact else ''}]", run_dir, sets, figures, (sizes,), exact,
                                {"sigterm_to_exit_s": figures["stop_s"], "launch_to_first_step_s": figures["resume_s"]})

    def _membership(self, name: str, run_dir: Path, sets: list[str], figures: dict, allowed: tuple, exact: bool,
                    figure: dict) -> dict:
        """The result of a membership scenario: the world sizes of its final trajectory among
        ``allowed``, rows exactly once per epoch, and (``exact``) equal to the staged reference."""
        worlds = [w for _, w in figures["trajectory"]]
        details: dict = {"trajectory": figures["trajectory"], "rows": row_audit(run_dir, self.data, self.epochs)}
        passed = worlds in [list(a) for a in allowed] and details["rows"]["ok"]
        if exact:
            staged = run_dir.with_name(run_dir.name + "-staged")
            staged_reference(staged, sets, figures["trajectory"])
            details["result"] = same_training(staged, run_dir)
            passed = passed and details["result"]["ok"]
        return {"name": name, "passed": passed, "figure": {**figure, **rows_lost_and_repeated(details["rows"])},
                "details": details}

    def clear_errors(self) -> dict:
        run_dir = self.out / "clear-errors"
        job = TrainJob(run_dir, self.overrides(f"data.train.paths=['{self.data / 'no-such-dir'}']"),
                       max_restarts=2).start()
        code = job.wait()
        lines = [ln for ln in job.log_tail().splitlines() if ln.strip()]
        passed = code == 2 and len(lines) == 1 and "no-such-dir" in lines[0]
        return {"name": "clear_errors[missing data, --nproc 2]", "passed": passed,
                "figure": {"exit_code": code, "lines": len(lines)}, "details": {"output": lines[:5]}}


def measure(quick: bool, data: Path | None) -> dict:
    """Run the scenarios (quick: one seed each); see the module doc."""
    from recsys.io import synth

    out = ROOT / "bench-out" / ("faults-quick" if quick else "faults")
    if out.exists():
        import shutil

        shutil.rmtree(out)
    if data is None:
        data = ROOT / "bench-out" / "data" / "tiny"
        if not (data / "oracle.json").exists():
            synth.generate("tiny", data, seed=0)
    s = Scenarios(out, Path(data), epochs=1 if quick else EPOCHS)
    seeds = [1] if quick else [1, 2, 3, 4, 5]
    plan = [("killed_worker", (seed, 0)) for seed in seeds]
    plan += [("killed_worker", (seed, 1)) for seed in seeds[:1 if quick else 3]]
    plan += [("hung_worker", (seed,)) for seed in seeds[:1 if quick else 2]]
    plan += [("preemption", (seed,)) for seed in seeds[:1 if quick else 2]]
    points = ["before-latest"] if quick else ["before-sparse", "mid-sparse", "after-sparse", "after-marker",
                                                 "before-latest", "after-latest", "prune"]
    plan += [("checkpoint_crash", (point,)) for point in points]
    plan += [("spill_outage", ()), ("bad_data", ()), ("clear_errors", ())]
    plan += [("elastic_nodes", (1, False) if quick else (2, True)), ("resize", ([2, 1, 3], not quick))]
    scenarios = []
    for name, args in plan:
        t0 = time.monotonic()
        try:
            result = getattr(s, name)(*args)
        except Exception as exc:  # noqa: BLE001 - a scenario that breaks is a failed scenario, named
            result = {"name": f"{name}{list(args)}", "passed": False, "figure": None, "details": {"error": str(exc)}}
        result["seconds"] = round(time.monotonic() - t0, 1)
        scenarios.append(result)
        print(f"  {'PASS' if result['passed'] else 'FAIL'}  {result['name']}  {json.dumps(result['figure'])}",
              flush=True)
    return {"comparisons": [], "scenarios": scenarios, "passed": all(r["passed"] for r in scenarios),
            "data": str(data), "out": str(out)}
