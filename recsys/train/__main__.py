"""``python -m recsys.train`` / ``torchrun ... -m recsys.train``: one training process.

Reads top to bottom: parse → config → environment → trainer → train → close.

A user error (``recsys.errors.user_message``: a bad job file, data the reader rejects, a
missing path...) ends the process with exit code 2 and one line, no traceback (``-v``
shows it). Under ``recsys train`` the line goes to the launcher (``RECSYS_LAUNCH_DIR``),
which prints it once for all ranks; a rank that fails only because a peer left with a user
error exits quietly. SIGTERM (also before training starts) makes the process save a
checkpoint at the end of its current step and exit 0. The stop is all-reduced, so every
rank saves at that step; in an elastic multi-node job (``--nnodes MIN:MAX``) a rank that
stopped only because another node's launcher got SIGTERM exits with ``LEFT_BEHIND_EXIT``
instead, and torchrun starts it again without that node (a graceful leave).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import traceback
from pathlib import Path

from recsys.train.job_args import (LAUNCH_DIR_ENV, LEFT_BEHIND_EXIT, NNODES_ENV, add_job_arguments, check_resume,
                                   load_job_args, run_dir_for)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recsys.train", description=__doc__)
    add_job_arguments(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="tracebacks for user errors too")
    args = parser.parse_args(argv)
    _forget_earlier_starts()
    sigterm = {"seen": False}
    previous = signal.signal(signal.SIGTERM, lambda *_: sigterm.update(seen=True))  # until the trainer's own
    try:
        return _train(args, sigterm)
    except Exception as exc:  # noqa: BLE001 - sorted into user errors and the rest below
        return _fail(exc, args.verbose)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _train(args: argparse.Namespace, sigterm: dict) -> int:
    job = load_job_args(args)  # the job file and the checkpoint first: no torch needed to reject them
    check_resume(args.resume, args.run_dir)
    _one_namespace_per_round(os.environ)

    import torch.distributed as dist

    from recsys.config import write_resolved
    from recsys.train.loop import Trainer, setup_env

    env = setup_env(job.train.device, job.train.runtime.collective_timeout_s)
    run_dir = run_dir_for(job, args.run_dir, env)
    if env.is_main:
        write_resolved(job, run_dir)
        print(f"run directory: {run_dir}", flush=True)
    trainer = Trainer(job, run_dir, env, resume=args.resume)
    if sigterm["seen"]:  # asked to stop while starting: one step, a checkpoint, done
        trainer._on_sigterm(signal.SIGTERM, None)
    try:
        result = trainer.train()
    finally:
        trainer.close()
    if env.is_main:
        (run_dir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result), flush=True)
        print(f"run directory: {run_dir}", flush=True)
    # the launcher counts these after a SIGTERM: every local worker saved (or finished) and exits 0
    _leave(f"{'stopped' if result.get('stopped') else 'finished'}-{_local_rank()}", str(result["step"]))
    if dist.is_initialized():
        dist.destroy_process_group()
    if result.get("stopped") == "SIGTERM" and not trainer._stop and _elastic(os.environ):
        # another node was stopped (its launcher got SIGTERM) and this one was not: the stop was
        # all-reduced, so this rank checkpointed too. Exit 0 would end this node (torchrun's
        # agent waits for the gone node at its exit barrier, then stops); a failure makes the
        # agent start the workers again, which resume from that checkpoint without the node
        # that left (or with the nodes waiting to join, when the stop was a membership change)
        print(f"recsys train: rank {env.rank}: another node stopped; restarting without it", file=sys.stderr,
              flush=True)
        return LEFT_BEHIND_EXIT
    return 0


def _elastic(environ) -> bool:
    """Whether this worker belongs to a job whose node count may change (``--nnodes MIN:MAX``, MIN < MAX)."""
    low, _, high = environ.get(NNODES_ENV, "").partition(":")
    return low.isdigit() and high.isdigit() and int(low) < int(high)


def _one_namespace_per_round(environ) -> None:
    """Give every worker of a rendezvous round the same attempt number when the round's
    rendezvous store is new (torchrun's ``TORCHELASTIC_USE_AGENT_STORE=False``, which
    ``recsys train --nnodes`` sets up).

    ``recsys.train.distributed`` puts an attempt's keys under ``TORCHELASTIC_RESTART_COUNT``,
    but every node's agent counts its own restarts: a node that joined later, or whose
    workers a membership change restarted (not counted), has another count than its peers,
    and the ranks of one round would wait for each other under different names until the
    collective timeout, round after round. Without the agent's store, rank 0 of every round
    hosts a new store on a new port, so no round can read an earlier round's keys: one name
    for all of them is safe. With the agent's store (one node) nothing changes."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "False" and "TORCHELASTIC_RESTART_COUNT" in environ:
        environ["TORCHELASTIC_RESTART_COUNT"] = "0"


def _rank() -> str:
    return os.environ.get("RANK", "0")


def _local_rank() -> str:
    return f"local-{os.environ.get('LOCAL_RANK', '0')}"


def _forget_earlier_starts() -> None:
    """Remove what this local worker's earlier start left for the launcher (torchrun restarts
    workers after a failure or a membership change, and global ranks move between nodes):
    the launcher must only count the stops of the workers running now."""
    where = os.environ.get(LAUNCH_DIR_ENV)
    if where:
        for kind in ("stopped", "finished"):
            (Path(where) / f"{kind}-{_local_rank()}").unlink(missing_ok=True)


def _leave(name: str, text: str) -> bool:
    """Write ``text`` to the launcher's directory (atomically); False when there is none."""
    where = os.environ.get(LAUNCH_DIR_ENV)
    if not where:
        return False
    tmp = Path(where) / f".{name}.tmp"
    tmp.write_text(text + "\n")
    os.replace(tmp, Path(where) / name)
    return True


def _fail(exc: Exception, verbose: bool) -> int:
    from recsys.errors import user_message

    message = user_message(exc)
    if message is None:  # a bug or a failure of the job itself, unless a peer's user error caused it
        where = os.environ.get(LAUNCH_DIR_ENV)
        if where and any(Path(where).glob("error-rank-*")) and not verbose:
            return 1
        raise exc
    if verbose:
        traceback.print_exception(exc)
    if not _leave(f"error-rank-{_rank()}", message):
        world = int(os.environ.get("WORLD_SIZE", "1"))
        who = f" (rank {_rank()})" if world > 1 else ""
        print(f"recsys train: error{who}: {message}", file=sys.stderr, flush=True)
    return 2


if __name__ == "__main__":
    sys.exit(main())
