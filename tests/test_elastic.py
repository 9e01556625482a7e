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
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import wait_until
from recsys.testing.faults import (Nodes, attempts, checkpoints_before, job_overrides, leave_and_join, resumed_events,
                                 staged_reference, stepped_after_resume, stop_and_resume, trajectory)
from recsys.testing.harness import JOB, ROOT, losses, records
from recsys.runtime.spawn import free_port
from test_faults import assert_exactly_once, assert_same_end

DEADLINE = 300  # seconds one phase may take before the test calls the job hung


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


# --------------------------------------------------------------------------- the jobs (recsys/testing/faults.py)


def _sets(data: Path, *extra: str) -> list[str]:
    """The scenario jobs' settings, one thread per worker everywhere: the same arithmetic with
    one node of two workers or two nodes of one (exact comparisons), and no oversubscription
    of this machine's cores."""
    return job_overrides(data, "train.runtime.threads=1", *extra)


def _report(name: str, **figures) -> None:
    print(f"\nFIGURES {name}: " + json.dumps(figures), flush=True)


def _assert_same_training(reference: Path, run_dir: Path, log_every: int = 1) -> None:
    """The same loss at every logged step of the final trajectory (every step unless the job
    logs every ``log_every``), the same final evaluation and rows."""
    a, b = losses(reference), losses(run_dir)  # a rolled-back step is logged again: the last one stays
    final_step = json.loads((run_dir / "result.json").read_text())["step"]
    if log_every == 1:
        assert sorted(b) == list(range(1, final_step + 1)), (len(b), final_step)
    assert b and sorted(a) == sorted(b), (len(a), len(b), final_step)
    different = {s: (a[s], b[s]) for s in a if a[s] != b[s]}
    assert not different, f"{len(different)} step(s) with another loss, first: {min(different.items())}"
    assert_same_end(reference, run_dir)


# --------------------------------------------------------------------------- membership changes


@pytest.mark.multiproc
@pytest.mark.slow  # make test-slow, in CI; make test keeps the flags, the refusals and 2 ranks -> 1 exactly
def test_a_node_leaves_and_one_joins_rows_exactly_once(tiny_data, tmp_path):
    """Fast variant: one leave and one join in a one-epoch job, compared with clean stages."""
    run_dir = tmp_path / "elastic"
    # few periodic checkpoints (each writes every table): the one to resume from is enough.
    # The epoch's length is no race with the join: node a waits for the new node (Nodes.join)
    sets = _sets(tiny_data, "data.train.batch_size=16", "train.epochs=1", "train.log_every=2",
                 "train.checkpoint.every_steps=25")
    figures = leave_and_join(run_dir, sets, 1)
    worlds = [w for _, w in figures["trajectory"]]
    assert worlds in ([2, 1, 2], [1, 2, 1, 2]), figures  # a may train alone until b joins
    report = assert_exactly_once(run_dir, tiny_data, epochs=1)
    assert json.loads((run_dir / "result.json").read_text())["epoch"] == 1
    # the membership changes train exactly as the clean stop-and-restart stages of the same
    # world sizes (a shrink that kept only the rows a rank owned before ends within 0.005 AUC
    # of the right result, which no floor tells apart). The stages restore through the same
    # code, so a restore that loses state at another world size is not caught here but by
    # test_train_promises' two-ranks-then-one test (against one rank throughout)
    staged_reference(tmp_path / "reference", sets, figures["trajectory"])
    _assert_same_training(tmp_path / "reference", run_dir, log_every=2)
    _report("leave-and-join", **figures, rows=report["epochs"])


@pytest.mark.multiproc
@pytest.mark.slow
def test_nodes_leave_and_join_twice_exactly(tiny_data, tmp_path):
    """Long variant: two epochs, two leave/join cycles; the final trajectory equals the same
    world-size schedule trained as clean stages (optimizer state and reader position carried
    exactly), and every row is consumed exactly once per epoch."""
    run_dir = tmp_path / "elastic"
    sets = _sets(tiny_data, "data.train.batch_size=16", "train.epochs=2")
    figures = leave_and_join(run_dir, sets, 2)
    segments = figures["trajectory"]
    assert [w for _, w in segments] in ([2, 1, 2, 1, 2], [1, 2, 1, 2, 1, 2]), figures
    report = assert_exactly_once(run_dir, tiny_data, epochs=2)
    staged_reference(tmp_path / "reference", sets, segments)
    _assert_same_training(tmp_path / "reference", run_dir)
    _report("leave-and-join-twice", **figures, rows=report["epochs"])


def _wait_training(nodes: Nodes, what: str, *names: str) -> None:
    """Wait until the nodes ``names`` train as two workers of world size 2, past a checkpoint
    of theirs."""
    wait_until(lambda: nodes.training(*names), DEADLINE, what)
    assert all(nodes.alive(name) for name in names), "a node ended:\n" + nodes.logs()


def _one_epoch_nodes(data: Path, run_dir: Path) -> Nodes:
    # a node joining one that trains alone is waited for (Nodes.join): the epoch's length is no race
    return Nodes(run_dir, _sets(data, "data.train.batch_size=16", "train.epochs=1", "train.log_every=2",
                                "train.checkpoint.every_steps=25"))


@pytest.mark.multiproc
def test_too_few_nodes_is_one_line(tiny_data, tmp_path):
    """--nnodes 2 and no second node: after join_timeout, one line naming the rendezvous."""
    endpoint = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "recsys.cli", "train", "--config", str(JOB), "--nproc", "1", "--nnodes", "2",
           "--rdzv-endpoint", endpoint, "--rdzv-id", "alone", "--rdzv-conf", "join_timeout=3",
           "--run-dir", str(tmp_path / "run")]
    for o in _sets(tiny_data):
        cmd += ["--set", o]
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
    nodes = _one_epoch_nodes(tiny_data, run_dir)
    try:
        nodes.start("a", host=True)
        nodes.start("b")
        _wait_training(nodes, "two nodes training past a checkpoint", "a", "b")
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
        nodes.finish("a2", "b2", timeout=DEADLINE)
    finally:
        nodes.close()
    resumed = [r for r in resumed_events(run_dir) if r["step"] >= last]
    assert resumed and resumed[0]["step"] == max(checkpoints_before(run_dir, resumed[0])), resumed
    assert_exactly_once(run_dir, tiny_data, epochs=1)


@pytest.mark.multiproc
@pytest.mark.slow
def test_sigterm_to_one_node_is_a_graceful_leave_and_to_every_node_a_stop(tiny_data, tmp_path):
    """SIGTERM to one node's launcher: every rank checkpoints at the end of the same step (the
    stop is all-reduced), that node exits 0 and the others go on without it from that
    checkpoint, nothing redone. SIGTERM to every node (what a scheduler does): all exit 0
    and the same commands resume. Rows exactly once per epoch throughout."""
    run_dir = tmp_path / "elastic"
    nodes = _one_epoch_nodes(tiny_data, run_dir)
    try:
        nodes.start("a", host=True)
        nodes.start("b")
        _wait_training(nodes, "two nodes training past a checkpoint", "a", "b")
        n = len(resumed_events(run_dir)) + 1
        nodes.procs["b"].send_signal(signal.SIGTERM)
        nodes.finish("b", timeout=DEADLINE)
        assert "every worker saved a checkpoint" in nodes.log("b").read_text()
        wait_until(lambda: stepped_after_resume(run_dir, n) or not nodes.alive("a"), DEADLINE,
                   "node a to go on alone")
        left = stepped_after_resume(run_dir, n)
        assert left is not None, nodes.logs()
        assert left["saved_world_size"] == 2 and nodes.world_sizes() == [1], (left, nodes.workers())
        assert left["step"] == max(checkpoints_before(run_dir, left)), left  # the stop's checkpoint

        nodes.join("c", "a")  # a waits for it: the epoch cannot end before it joins
        _wait_training(nodes, "node c to join", "a", "c")
        for name in ("a", "c"):  # together, as a scheduler does
            nodes.procs[name].send_signal(signal.SIGTERM)
        nodes.finish("a", "c", timeout=DEADLINE)
        stopped = json.loads((run_dir / "result.json").read_text())
        assert stopped["stopped"] == "SIGTERM", stopped
        nodes.start("a2", host=True)
        nodes.start("c2")
        nodes.finish("a2", "c2", timeout=DEADLINE)
    finally:
        nodes.close()
    resumed = resumed_events(run_dir)[-1]
    assert resumed["step"] == stopped["step"] and resumed["saved_world_size"] == 2, resumed
    assert_exactly_once(run_dir, tiny_data, epochs=1)
    assert [w for _, w in trajectory(run_dir)][-4:] == [2, 1, 2, 2], attempts(run_dir)


# --------------------------------------------------------------------------- stop and resume


@pytest.mark.multiproc
@pytest.mark.slow  # make test keeps the node-leaves-and-joins resize and the SIGTERM resume
def test_two_then_one_then_three_workers_by_stop_and_resume(tiny_data, tmp_path):
    run_dir = tmp_path / "resized"
    # no periodic checkpoints: SIGTERM makes the ones to resume from
    sets = _sets(tiny_data, "data.train.batch_size=32", "train.epochs=1", "train.log_every=2",
                 "train.checkpoint.every_steps=0")
    figures = stop_and_resume(run_dir, sets, [2, 1, 3], 12)
    segments = figures["trajectory"]
    assert [w for _, w in segments] == [2, 1, 3], figures
    report = assert_exactly_once(run_dir, tiny_data, epochs=1)
    assert json.loads((run_dir / "result.json").read_text())["epoch"] == 1
    # resumed from SIGTERM checkpoints only: the same training as the clean stages
    staged_reference(tmp_path / "reference", sets, segments)
    _assert_same_training(tmp_path / "reference", run_dir, log_every=2)
    _report("stop-and-resume-2-1-3", **figures, rows=report["epochs"])


@pytest.mark.multiproc
@pytest.mark.slow
def test_two_then_one_then_three_workers_exactly(tiny_data, tmp_path):
    """Long variant: two epochs (a change in each), compared with clean stages."""
    run_dir = tmp_path / "resized"
    sets = _sets(tiny_data, "data.train.batch_size=32", "train.epochs=2")
    figures = stop_and_resume(run_dir, sets, [2, 1, 3], 60)
    segments = figures["trajectory"]
    assert [w for _, w in segments] == [2, 1, 3], figures
    report = assert_exactly_once(run_dir, tiny_data, epochs=2)
    staged_reference(tmp_path / "reference", sets, segments)
    _assert_same_training(tmp_path / "reference", run_dir)
    _report("stop-and-resume-2-1-3-exact", **figures, rows=report["epochs"])
