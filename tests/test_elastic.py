"""Elastic membership: ``recsys train --nnodes MIN:MAX`` on several machines (here: several
agents on loopback, one "node" each), and resizing by stop-and-resume.

- The multi-node flags are checked before anything starts (one line, exit code 2) and map
  onto torchrun's c10d rendezvous; without them the launch stays ``--standalone``.
- Two agents, one worker each: kill one agent with its worker (SIGKILL) → the other goes on
  at world size 1 from the last checkpoint; start a new agent → the job grows back to world
  size 2 (torchrun stops the running worker with SIGTERM, it checkpoints, and both resume
  from that checkpoint). Every training row exactly once per epoch across both changes.
- 2 → 1 → 3 workers by SIGTERM to the launcher and a relaunch with another ``--nproc``.
- Exactness (the long variants): the final trajectory equals the same world-size schedule
  run as clean stages (``train.max_steps`` at each change, then a relaunch with the next
  size): the same loss at every step, the same final evaluation and sparse rows, so the
  optimizer state and the reader position are carried exactly through every change.

The figures (time to resume after each change, rows lost and repeated) are printed; run
with ``-s`` to see them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from conftest import wait_until
from recsys.bench.faults import environ_of, kill_tagged, records, tagged
from test_faults import assert_exactly_once
from test_train import JOB, ROOT, final_rows, losses, overrides

DEADLINE = 300  # seconds one phase may take before the test calls the job hung
EVERY = 10  # checkpoint interval (steps)


# --------------------------------------------------------------------------- the flags


def _parse(*argv: str) -> argparse.Namespace:
    from recsys.cli import build_parser

    return build_parser().parse_args(["train", "--config", "job.toml", *argv])


BAD_FLAGS = {
    "min-above-max": (["--nnodes", "3:2", "--rdzv-endpoint", "h:29400", "--rdzv-id", "j", "--run-dir", "r"],
                      "--nnodes MIN:MAX needs 1 <= MIN <= MAX, found '3:2'"),
    "zero-nodes": (["--nnodes", "0", "--rdzv-endpoint", "h:29400", "--rdzv-id", "j", "--run-dir", "r"],
                   "1 <= MIN <= MAX, found '0'"),
    "not-a-number": (["--nnodes", "two", "--rdzv-endpoint", "h:29400", "--rdzv-id", "j", "--run-dir", "r"],
                     "--nnodes takes N or MIN:MAX (whole numbers), found 'two'"),
    "three-parts": (["--nnodes", "1:2:3", "--rdzv-endpoint", "h:29400", "--rdzv-id", "j", "--run-dir", "r"],
                    "--nnodes takes N or MIN:MAX"),
    "no-endpoint": (["--nnodes", "1:2", "--rdzv-id", "j", "--run-dir", "r"],
                    "--nnodes needs --rdzv-endpoint HOST:PORT"),
    "endpoint-without-port": (["--nnodes", "2", "--rdzv-endpoint", "h", "--rdzv-id", "j", "--run-dir", "r"],
                              "--rdzv-endpoint takes HOST:PORT"),
    "endpoint-port-zero": (["--nnodes", "2", "--rdzv-endpoint", "h:0", "--rdzv-id", "j", "--run-dir", "r"],
                           "--rdzv-endpoint takes HOST:PORT"),
    "endpoint-port-too-big": (["--nnodes", "2", "--rdzv-endpoint", "h:70000", "--rdzv-id", "j", "--run-dir", "r"],
                              "found 'h:70000'"),
    "endpoint-bad-host": (["--nnodes", "2", "--rdzv-endpoint", "a b:1", "--rdzv-id", "j", "--run-dir", "r"],
                          "--rdzv-endpoint takes HOST:PORT"),
    "no-id": (["--nnodes", "1:2", "--rdzv-endpoint", "h:29400", "--run-dir", "r"],
              "--rdzv-endpoint needs --rdzv-id ID"),
    "bad-id": (["--nnodes", "1:2", "--rdzv-endpoint", "h:29400", "--rdzv-id", "a/b", "--run-dir", "r"],
               "--rdzv-id takes letters, digits"),
    "no-run-dir": (["--nnodes", "1:2", "--rdzv-endpoint", "h:29400", "--rdzv-id", "j"],
                   "--nnodes needs --run-dir"),
    "endpoint-without-nnodes": (["--rdzv-endpoint", "h:29400", "--rdzv-id", "j"],
                                "--rdzv-endpoint and --rdzv-id need(s) --nnodes"),
    "conf-unknown-key": (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-id", "j", "--run-dir", "r",
                          "--rdzv-conf", "join_timout=5"], "KEY one of join_timeout"),
    "conf-not-seconds": (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-id", "j", "--run-dir", "r",
                          "--rdzv-conf", "join_timeout=soon"], "join_timeout takes a whole number of seconds"),
    "conf-is-host-not-a-bool": (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-id", "j", "--run-dir", "r",
                                 "--rdzv-conf", "is_host=maybe"], "is_host takes true or false, found 'maybe'"),
    "bad-local-addr": (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-id", "j", "--run-dir", "r",
                        "--local-addr", "a b"], "--local-addr takes a host name or address"),
}


@pytest.mark.parametrize("argv,expected", list(BAD_FLAGS.values()), ids=list(BAD_FLAGS))
def test_bad_multinode_flags_are_one_line_before_anything_starts(argv, expected, capsys):
    from recsys.cli import main

    # the job file does not exist: the flags are checked first, before any file is read
    code = main(["train", "--config", "/nonexistent/job.toml", *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("recsys train: error: train: "), err
    assert expected in lines[0], lines[0]


def test_multinode_flags_map_onto_torchrun_c10d_rendezvous():
    from recsys.train.launch import multinode_args

    assert multinode_args(_parse("--nproc", "2")) is None  # one machine: --standalone, as before
    got = multinode_args(_parse("--nnodes", "1:2", "--rdzv-endpoint", "node0.example:29400", "--rdzv-id", "ctr-7",
                                "--run-dir", "/shared/run", "--rdzv-conf",
                                "last_call_timeout=5, join_timeout=900,is_host=True", "--local-addr", "10.0.0.2"))
    assert got == ["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0.example:29400",
                   "--rdzv-id", "ctr-7", "--rdzv-conf", "last_call_timeout=5,join_timeout=900,is_host=true",
                   "--local-addr", "10.0.0.2"]
    fixed = multinode_args(_parse("--nnodes", "2:2", "--rdzv-endpoint", "[::1]:29400", "--rdzv-id", "j",
                                  "--run-dir", "r"))
    assert fixed[:2] == ["--nnodes", "2"] and fixed[5] == "[::1]:29400"


# --------------------------------------------------------------------------- processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sets(data: Path, *extra: str) -> list[str]:
    out = []
    # one thread per worker everywhere: the same arithmetic with one node of two workers or
    # two nodes of one (exact comparisons), and no oversubscription of this machine's cores
    for o in overrides(data, "train.collective_timeout_s=60", "data.train.passthrough=['row_id']",
                      "train.record_rows=true", f"train.checkpoint_every_steps={EVERY}", "train.threads=1", *extra):
        out += ["--set", o]
    return out


def _start(cmd: list[str], log: Path, tag: str) -> subprocess.Popen:
    with open(log, "a") as fh:  # the child keeps its own copy
        return subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "RECSYS_TEST_TAG": tag})


class Nodes:
    """Agents of one multi-node job on loopback, each a "node" with its own tag and log."""

    def __init__(self, data: Path, run_dir: Path, *sets: str) -> None:
        self.data, self.run_dir, self.sets = data, run_dir, sets
        self.endpoint = f"127.0.0.1:{_free_port()}"
        self.job_id = uuid.uuid4().hex[:12]
        self.tag = uuid.uuid4().hex
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, host: bool = False) -> subprocess.Popen:
        """Start a node; ``host``: it hosts the rendezvous (every node's address is 127.0.0.1
        here, so the roles are given instead of derived from the endpoint)."""
        cmd = [sys.executable, "-m", "recsys.cli", "train", "--config", str(JOB), "--nproc", "1",
               "--max-restarts", "3", "--run-dir", str(self.run_dir),
               "--nnodes", "1:2", "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.job_id,
               # a node without a heartbeat for 3 x 2 s is dropped; 3 s more for late joiners
               "--rdzv-conf", f"last_call_timeout=3,keep_alive_interval=2,keep_alive_max_attempt=3,is_host={host}",
               *_sets(self.data, *self.sets)]
        self.procs[name] = _start(cmd, self.log(name), f"{self.tag}-{name}")
        return self.procs[name]

    def log(self, name: str) -> Path:
        return self.run_dir.parent / f"{self.run_dir.name}-{name}.log"

    def logs(self) -> str:
        return "\n".join(f"--- {name}\n{self.log(name).read_text()[-3000:]}" for name in self.procs)

    def kill(self, name: str) -> None:
        """SIGKILL the node: its agent and its worker."""
        kill_tagged(f"{self.tag}-{name}")
        self.procs[name].wait()

    def workers(self) -> dict[int, dict[str, str]]:
        """{pid: environment} of the live training workers of every node."""
        out = {}
        for name in self.procs:
            for pid in tagged(f"{self.tag}-{name}"):
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
        return self.procs[name].poll() is None

    def close(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            kill_tagged(f"{self.tag}-{name}")


def _steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in records(run_dir) if "loss/train" in r]


def _resumed(run_dir: Path) -> list[dict]:
    return [r for r in records(run_dir) if r.get("event") == "resumed"]


def _stepped_after_resume(run_dir: Path, count: int) -> dict | None:
    """The ``count``-th resumed event once a step after it is logged, else None."""
    recs = records(run_dir)
    idx = [i for i, r in enumerate(recs) if r.get("event") == "resumed"]
    if len(idx) < count:
        return None
    at = idx[count - 1]
    return recs[at] if any("loss/train" in r for r in recs[at + 1:]) else None


def _checkpoints_before(run_dir: Path, record: dict) -> list[int]:
    recs = records(run_dir)
    return [r["step"] for r in recs[:recs.index(record)] if r.get("event") == "checkpoint"]


def _attempts(run_dir: Path) -> list[tuple[int, int]]:
    """(start step, world size) of every attempt, from the row audit's directories (one file
    per rank, created when the rank starts)."""
    out = []
    for path in sorted((run_dir / "rows").glob("attempt-*")):
        out.append((int(path.name.split("-")[3]), len(list(path.glob("rank-*.i64")))))
    return out


def _trajectory(run_dir: Path) -> list[tuple[int, int]]:
    """The final trajectory's segments: (start step, world size), rolled-back attempts removed."""
    segments: list[tuple[int, int]] = []
    for start, world in _attempts(run_dir):
        while segments and segments[-1][0] >= start:
            segments.pop()
        segments.append((start, world))
    return segments


def _report(name: str, **figures) -> None:
    print(f"\nFIGURES {name}: " + json.dumps(figures), flush=True)


# --------------------------------------------------------------------------- the reference


def _staged_reference(data: Path, run_dir: Path, segments: list[tuple[int, int]], *sets: str) -> None:
    """Train the world-size schedule ``segments`` as clean stages: ``train.max_steps`` at each
    change, then a relaunch with the next ``--nproc`` on the same run directory."""
    tag = uuid.uuid4().hex
    for i, (_start_step, world) in enumerate(segments):
        stop = [f"train.max_steps={segments[i + 1][0]}"] if i + 1 < len(segments) else []
        cmd = [sys.executable, "-m", "recsys.cli", "train", "--config", str(JOB), "--nproc", str(world),
               "--run-dir", str(run_dir), *_sets(data, *sets, *stop)]
        log = run_dir.parent / f"{run_dir.name}.log"
        proc = _start(cmd, log, tag)
        try:
            code = proc.wait(timeout=DEADLINE)
        finally:
            proc.kill()
            kill_tagged(tag)
        assert code == 0, log.read_text()[-4000:]


def _assert_same_training(reference: Path, run_dir: Path) -> None:
    """The same loss at every step of the final trajectory, the same final evaluation and rows."""
    a, b = losses(reference), losses(run_dir)  # a rolled-back step is logged again: the last one stays
    final_step = json.loads((run_dir / "result.json").read_text())["step"]
    assert sorted(b) == list(range(1, final_step + 1)) and sorted(a) == sorted(b), (len(a), len(b), final_step)
    different = {s: (a[s], b[s]) for s in a if a[s] != b[s]}
    assert not different, f"{len(different)} step(s) with another loss, first: {min(different.items())}"
    assert json.loads((run_dir / "result.json").read_text()) == json.loads((reference / "result.json").read_text())
    ra, rb = final_rows(reference), final_rows(run_dir)
    assert ra.keys() == rb.keys()
    for name in ra:
        assert ra[name].keys() == rb[name].keys(), f"table {name}: different keys"
        for key in ra[name]:
            np.testing.assert_array_equal(ra[name][key], rb[name][key], err_msg=f"table {name} key {key}")


# --------------------------------------------------------------------------- membership changes


def _leave_and_join(data: Path, run_dir: Path, cycles: int, *sets: str) -> dict:
    """Nodes a and b train; then ``cycles`` times: kill the second node entirely (agent and
    worker, SIGKILL), check that a goes on alone at world size 1 from the last checkpoint,
    start a new node and check that the job grows back to 2 from a's SIGTERM checkpoint.
    Return the figures."""
    nodes = Nodes(data, run_dir, *sets)
    figures: dict = {"resume_after_leave_s": [], "resume_after_join_s": []}
    try:
        nodes.start("a", host=True)  # a hosts the rendezvous (the endpoint's store): it stays
        nodes.start("b")  # usually within a's last call; if not, a trains alone until b joins
        second = "b"
        for cycle in range(cycles):
            # both nodes train, past a checkpoint of this world to resume from
            def ready():
                recs = records(run_dir)
                since = recs[max((i for i, r in enumerate(recs) if r.get("event") == "resumed"), default=0):]
                ckpt = [r["step"] for r in since if r.get("event") == "checkpoint"]
                return (nodes.world_sizes() == [2, 2] and ckpt and max(_steps(run_dir), default=0) >= max(ckpt) + 2
                        ) or not nodes.alive("a")
            wait_until(ready, DEADLINE, f"cycle {cycle}: two nodes training past a checkpoint")
            assert nodes.alive("a") and nodes.alive(second), "a node ended:\n" + nodes.logs()

            killed_at = max(_steps(run_dir))
            t_kill = time.monotonic()
            nodes.kill(second)
            n = len(_resumed(run_dir)) + 1
            wait_until(lambda: _stepped_after_resume(run_dir, n) or not nodes.alive("a"), DEADLINE,
                       f"cycle {cycle}: node a to resume alone")
            figures["resume_after_leave_s"].append(round(time.monotonic() - t_kill, 1))
            resumed = _stepped_after_resume(run_dir, n)
            assert resumed is not None, "node a ended:\n" + nodes.logs()
            # from the last checkpoint before the kill, at world size 1
            assert resumed["step"] == max(_checkpoints_before(run_dir, resumed)) <= killed_at, resumed
            assert resumed["saved_world_size"] == 2
            assert nodes.world_sizes() == [1], nodes.workers()

            second = f"n{cycle}"
            t_join = time.monotonic()
            nodes.start(second)
            wait_until(lambda: _stepped_after_resume(run_dir, n + 1) or not nodes.alive("a"), DEADLINE,
                       f"cycle {cycle}: node {second} to join")
            figures["resume_after_join_s"].append(round(time.monotonic() - t_join, 1))
            grown = _stepped_after_resume(run_dir, n + 1)
            assert grown is not None, "the job ended before the new node joined:\n" + nodes.logs()
            # torchrun stopped a's worker with SIGTERM: it checkpointed at the end of its step
            stops = _checkpoints_before(run_dir, grown)
            assert grown["step"] == max(stops) > resumed["step"], (grown, stops)
            assert grown["saved_world_size"] == 1
            wait_until(lambda: nodes.world_sizes() == [2, 2] or not nodes.alive("a"), DEADLINE,
                       "two workers of world size 2")
        for name in ("a", second):
            try:
                code = nodes.procs[name].wait(timeout=DEADLINE)
            except subprocess.TimeoutExpired:
                pytest.fail(f"node {name} did not finish in {DEADLINE}s:\n" + nodes.logs())
            assert code == 0, f"node {name} exited with {code}:\n" + nodes.logs()
    finally:
        nodes.close()
    figures["trajectory"] = _trajectory(run_dir)
    return figures


@pytest.mark.multiproc
def test_a_node_leaves_and_one_joins_rows_exactly_once(tiny_data, tmp_path):
    """Fast variant: one leave and one join in a one-epoch job."""
    run_dir = tmp_path / "elastic"
    # few periodic checkpoints (each writes every table): the one to resume from is enough
    sets = ("data.train.batch_size=16", "train.epochs=1", "train.log_every=2", "train.checkpoint_every_steps=25")
    figures = _leave_and_join(tiny_data, run_dir, 1, *sets)
    worlds = [w for _, w in figures["trajectory"]]
    assert worlds in ([2, 1, 2], [1, 2, 1, 2]), figures  # a may train alone until b joins
    report = assert_exactly_once(run_dir, tiny_data, epochs=1)
    result = json.loads((run_dir / "result.json").read_text())
    assert result["epoch"] == 1 and 0.5 < result["auc"] <= 1.0, result
    _report("leave-and-join", **figures, rows={e: {k: v for k, v in r.items()} for e, r in report["epochs"].items()})


@pytest.mark.multiproc
@pytest.mark.slow
def test_nodes_leave_and_join_twice_exactly(tiny_data, tmp_path):
    """Long variant: two epochs, two leave/join cycles; the final trajectory equals the same
    world-size schedule trained as clean stages (optimizer state and reader position carried
    exactly), and every row is consumed exactly once per epoch."""
    run_dir = tmp_path / "elastic"
    sets = ("data.train.batch_size=16", "train.epochs=2")
    figures = _leave_and_join(tiny_data, run_dir, 2, *sets)
    segments = figures["trajectory"]
    assert [w for _, w in segments] in ([2, 1, 2, 1, 2], [1, 2, 1, 2, 1, 2]), figures
    report = assert_exactly_once(run_dir, tiny_data, epochs=2)
    _staged_reference(tiny_data, tmp_path / "reference", segments, *sets)
    _assert_same_training(tmp_path / "reference", run_dir)
    _report("leave-and-join-twice", **figures, rows=report["epochs"])


def _wait_training(nodes: Nodes, run_dir: Path, what: str, *names: str) -> None:
    """Wait until the nodes ``names`` train as two workers of world size 2, past a checkpoint
    of theirs."""
    def ready():
        recs = records(run_dir)
        since = recs[max((i for i, r in enumerate(recs) if r.get("event") == "resumed"), default=0):]
        ckpt = [r["step"] for r in since if r.get("event") == "checkpoint"]
        done = [name for name in names if not nodes.alive(name)]
        return (nodes.world_sizes() == [2, 2] and ckpt and max(_steps(run_dir), default=0) >= max(ckpt) + 2) or done
    wait_until(ready, DEADLINE, what)
    assert all(nodes.alive(name) for name in names), "a node ended:\n" + nodes.logs()


def _finish(nodes: Nodes, *names: str) -> None:
    for name in names:
        try:
            code = nodes.procs[name].wait(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node {name} did not finish in {DEADLINE}s:\n" + nodes.logs())
        assert code == 0, f"node {name} exited with {code}:\n" + nodes.logs()


@pytest.mark.multiproc
def test_too_few_nodes_is_one_line(tiny_data, tmp_path):
    """--nnodes 2 and no second node: after join_timeout, one line naming the rendezvous."""
    endpoint = f"127.0.0.1:{_free_port()}"
    cmd = [sys.executable, "-m", "recsys.cli", "train", "--config", str(JOB), "--nproc", "1", "--nnodes", "2",
           "--rdzv-endpoint", endpoint, "--rdzv-id", "alone", "--rdzv-conf", "join_timeout=3",
           "--run-dir", str(tmp_path / "run"), *_sets(tiny_data)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=DEADLINE)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("recsys train")]
    assert lines == [f"recsys train: training failed: too few nodes joined the rendezvous at {endpoint} "
                     "(--rdzv-id alone) in time (--nnodes 2; rendezvous timeouts: --rdzv-conf join_timeout=SECONDS); "
                     f"{tmp_path / 'run'} keeps its checkpoints: the same commands resume from the latest complete "
                     "one"], out.stderr[-3000:]


@pytest.mark.multiproc
@pytest.mark.slow
def test_losing_the_rendezvous_host_ends_the_job_and_the_same_commands_resume(tiny_data, tmp_path):
    """The node at the endpoint hosts the rendezvous: killing it ends the other node with one
    line; starting both again resumes from the latest checkpoint, rows exactly once."""
    run_dir = tmp_path / "elastic"
    nodes = Nodes(tiny_data, run_dir, "data.train.batch_size=16", "train.epochs=1", "train.log_every=2",
                  "train.checkpoint_every_steps=25")
    try:
        nodes.start("a", host=True)
        nodes.start("b")
        _wait_training(nodes, run_dir, "two nodes training past a checkpoint", "a", "b")
        last = max(r["step"] for r in records(run_dir) if r.get("event") == "checkpoint")
        nodes.kill("a")
        code = nodes.procs["b"].wait(timeout=DEADLINE)
        assert code == 1, nodes.logs()
        said = [line for line in nodes.log("b").read_text().splitlines() if line.startswith("recsys train")]
        assert said == [f"recsys train: training failed: lost the connection to the rendezvous at {nodes.endpoint} "
                        f"(--rdzv-id {nodes.job_id}): the node hosting it stopped (or the job ended) or cannot be "
                        f"reached (it must stay up for the whole job); {run_dir} keeps its checkpoints: the same commands resume "
                        "from the latest complete one"], nodes.logs()
        assert not nodes.workers(), "workers outlived their nodes"
        nodes.start("a2", host=True)
        nodes.start("b2")
        _finish(nodes, "a2", "b2")
    finally:
        nodes.close()
    resumed = [r for r in _resumed(run_dir) if r["step"] >= last]
    assert resumed and resumed[0]["step"] == max(_checkpoints_before(run_dir, resumed[0])), resumed
    assert_exactly_once(run_dir, tiny_data, epochs=1)


@pytest.mark.multiproc
@pytest.mark.slow
def test_sigterm_to_one_node_is_a_graceful_leave_and_to_every_node_a_stop(tiny_data, tmp_path):
    """SIGTERM to one node's launcher: every rank checkpoints at the end of the same step (the
    stop is all-reduced), that node exits 0 and the others go on without it from that
    checkpoint, nothing redone. SIGTERM to every node (what a scheduler does): all exit 0
    and the same commands resume. Rows exactly once per epoch throughout."""
    run_dir = tmp_path / "elastic"
    nodes = Nodes(tiny_data, run_dir, "data.train.batch_size=16", "train.epochs=1", "train.log_every=2",
                  "train.checkpoint_every_steps=25")
    try:
        nodes.start("a", host=True)
        nodes.start("b")
        _wait_training(nodes, run_dir, "two nodes training past a checkpoint", "a", "b")
        n = len(_resumed(run_dir)) + 1
        nodes.procs["b"].send_signal(signal.SIGTERM)
        _finish(nodes, "b")
        assert "every worker saved a checkpoint" in nodes.log("b").read_text()
        wait_until(lambda: _stepped_after_resume(run_dir, n) or not nodes.alive("a"), DEADLINE,
                   "node a to go on alone")
        left = _stepped_after_resume(run_dir, n)
        assert left is not None, nodes.logs()
        assert left["saved_world_size"] == 2 and nodes.world_sizes() == [1], (left, nodes.workers())
        assert left["step"] == max(_checkpoints_before(run_dir, left)), left  # the stop's checkpoint

        nodes.start("c")
        _wait_training(nodes, run_dir, "node c to join", "a", "c")
        for name in ("a", "c"):  # together, as a scheduler does
            nodes.procs[name].send_signal(signal.SIGTERM)
        _finish(nodes, "a", "c")
        stopped = json.loads((run_dir / "result.json").read_text())
        assert stopped["stopped"] == "SIGTERM", stopped
        nodes.start("a2", host=True)
        nodes.start("c2")
        _finish(nodes, "a2", "c2")
    finally:
        nodes.close()
    resumed = _resumed(run_dir)[-1]
    assert resumed["step"] == stopped["step"] and resumed["saved_world_size"] == 2, resumed
    assert_exactly_once(run_dir, tiny_data, epochs=1)
    assert [w for _, w in _trajectory(run_dir)][-4:] == [2, 1, 2, 2], _attempts(run_dir)


# --------------------------------------------------------------------------- stop and resume


def _stop_and_resume(data: Path, run_dir: Path, sizes: list[int], steps_each: int, *sets: str) -> dict:
    """Launch with ``--nproc sizes[0]``, SIGTERM the launcher after ``steps_each`` steps,
    relaunch with the next size on the same run directory...; the last size runs to the end."""
    figures: dict = {"stop_s": [], "resume_s": []}
    tag = uuid.uuid4().hex
    for i, nproc in enumerate(sizes):
        cmd = [sys.executable, "-m", "recsys.cli", "train", "--config", str(JOB), "--nproc", str(nproc),
               "--run-dir", str(run_dir), *_sets(data, *sets)]
        log = run_dir.parent / f"{run_dir.name}.log"
        before = json.loads((run_dir / "result.json").read_text())["step"] if i else 0  # where it stopped
        t_launch = time.monotonic()
        proc = _start(cmd, log, tag)
        try:
            if i:
                wait_until(lambda: _stepped_after_resume(run_dir, i) or proc.poll() is not None, DEADLINE,
                           f"launch {i} (--nproc {nproc}) to resume")
                figures["resume_s"].append(round(time.monotonic() - t_launch, 1))
                resumed = _stepped_after_resume(run_dir, i)
                assert resumed is not None, log.read_text()[-4000:]
                assert resumed["step"] == before and resumed["saved_world_size"] == sizes[i - 1], resumed
            if i + 1 < len(sizes):
                wait_until(lambda: max(_steps(run_dir), default=0) >= before + steps_each or proc.poll() is not None,
                           DEADLINE, f"launch {i}: {steps_each} steps")
                assert proc.poll() is None, "the job ended before SIGTERM:\n" + log.read_text()[-4000:]
                t_term = time.monotonic()
                proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=DEADLINE)
            if i + 1 < len(sizes):
                figures["stop_s"].append(round(time.monotonic() - t_term, 1))
        finally:
            proc.kill()
            proc.wait()
            kill_tagged(tag)
        assert code == 0, log.read_text()[-4000:]
        if i + 1 < len(sizes):
            assert "every worker saved a checkpoint" in log.read_text()
            stopped = json.loads((run_dir / "result.json").read_text())
            assert stopped["stopped"] == "SIGTERM" and stopped["step"] >= before + steps_each, stopped
    figures["trajectory"] = _trajectory(run_dir)
    return figures


@pytest.mark.multiproc
def test_two_then_one_then_three_workers_by_stop_and_resume(tiny_data, tmp_path):
    run_dir = tmp_path / "resized"
    # no periodic checkpoints: SIGTERM makes the ones to resume from
    sets = ("data.train.batch_size=32", "train.epochs=1", "train.log_every=2", "train.checkpoint_every_steps=0")
    figures = _stop_and_resume(tiny_data, run_dir, [2, 1, 3], 12, *sets)
    assert [w for _, w in figures["trajectory"]] == [2, 1, 3], figures
    report = assert_exactly_once(run_dir, tiny_data, epochs=1)
    result = json.loads((run_dir / "result.json").read_text())
    assert result["epoch"] == 1 and 0.5 < result["auc"] <= 1.0, result
    _report("stop-and-resume-2-1-3", **figures, rows=report["epochs"])


@pytest.mark.multiproc
@pytest.mark.slow
def test_two_then_one_then_three_workers_exactly(tiny_data, tmp_path):
    """Long variant: two epochs (a change in each), compared with clean stages."""
    run_dir = tmp_path / "resized"
    sets = ("data.train.batch_size=32", "train.epochs=2")
    figures = _stop_and_resume(tiny_data, run_dir, [2, 1, 3], 60, *sets)
    segments = figures["trajectory"]
    assert [w for _, w in segments] == [2, 1, 3], figures
    report = assert_exactly_once(run_dir, tiny_data, epochs=2)
    _staged_reference(tiny_data, tmp_path / "reference", segments, *sets)
    _assert_same_training(tmp_path / "reference", run_dir)
    _report("stop-and-resume-2-1-3-exact", **figures, rows=report["epochs"])
