"""The fault jobs of training, shared by the tests and ``recsys bench faults``.

The tiny job's overrides (``job_overrides``, ``spilling_overrides``), a run's records read
back (steps, attempts, resumes, trajectory), ``Nodes`` (the agents of an elastic job on
loopback), staged reference runs, runs compared and the row audit. A job's processes carry
``RECSYS_TEST_TAG=<tag>`` in their environment, so its workers are found through ``/proc``
(Linux) and every leftover is killed at the end, orphans included.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import numpy as np

from recsys.testing.harness import (DEADLINE_S, TrainJob, environ_of, final_rows, kill_tagged, losses,
                                    records, tagged, wait_for)
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
        "train.schedule.warmup_steps=0",
        "train.progress='none'",
        f"train.epochs={epochs}",
        f"train.checkpoint.every_steps={EVERY}",
        "train.runtime.collective_timeout_s=60",
        *extra,
    ]


def spilling_overrides(url: str) -> list[str]:
    """Settings that make the scenario job's larger tables spill to the Redis at ``url``."""
    small = [f"schema.tables.{t}.capacity={300 if t[0] == 'c' else 1000}"
             for t in ("c3", "c4", "c7", "c10", "c12", "c15", "c16", "c21", "c24", "c26", "m1", "m2")]
    return [f"store.spill.url='{url}'", "store.spill.retries=2", "store.spill.backoff_s=0.02",
            "store.spill.timeout_s=1.0", *small]


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

    def workers(self, *names: str) -> dict[int, dict[str, str]]:
        """{pid: environment} of the live training workers of the nodes ``names`` (all if none)."""
        out = {}
        for name, job in self.jobs.items():
            if names and name not in names:
                continue
            for pid in tagged(job.tag):
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                env = environ_of(pid)
                if b"recsys.train" in cmdline and "RANK" in env:
                    out[pid] = env
        return out

    def join(self, new: str, running: str) -> None:
        """Start node ``new`` beside node ``running``, which trains alone, so that the job
        cannot end before ``new`` joins however slowly this host starts it: ``running``'s
        workers are stopped (SIGSTOP to their process groups, where torchrun starts each
        worker with its reader processes) until its agent has asked them to stop for the
        new node (SIGTERM pending, what torchrun does to admit a node), or either node ended;
        then they go on (SIGCONT) and handle that SIGTERM as usual."""
        held = list(self.workers(running))
        require(held, lambda: f"node {running} has no training worker to hold:\n{self.logs()}")
        for pid in held:
            _signal_group(pid, signal.SIGSTOP)
        try:
            self.start(new)
            wait_for(lambda: all(_sigterm_pending(pid) for pid in held) or not self.alive(running)
                     or not self.alive(new), DEADLINE_S, f"node {running}'s agent to admit node {new}")
        finally:
            for pid in held:
                _signal_group(pid, signal.SIGCONT)

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


def _signal_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group ``pid`` leads (a torchrun worker's), else to ``pid``."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _sigterm_pending(pid: int) -> bool:
    """Whether SIGTERM waits for delivery to the (stopped) process ``pid``; True once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    masks = [int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("ShdPnd:", "SigPnd:"))]
    return any(mask >> (signal.SIGTERM - 1) & 1 for mask in masks)


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
            nodes.join(second, "a")  # a waits for it: the epoch cannot end before it joins
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
