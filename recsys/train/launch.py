"""``recsys train``: launch training processes with torchrun (elastic), or run in-process."""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys
from pathlib import Path


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the arguments every training process understands."""
    parser.add_argument("--config", required=True, type=Path, help="job file (TOML)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a job setting, e.g. --set train.max_steps=100")
    parser.add_argument("--run-dir", type=Path, help="run directory (default: a new one under runs/)")
    parser.add_argument("--resume", type=Path, help="checkpoint to start from: a step directory, run directory, checkpoints/ directory or its latest file (default: the run's latest)")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="shortcut for --set train.device=...")


def new_run_dir(name: str) -> Path:
    """Return a new dated run directory path under ``runs/``."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{name}-{stamp}"


def run_dir_for(job, run_dir: Path | None, env) -> Path:
    """Return the run directory every rank agrees on (rank 0 picks one when none is given)."""
    if run_dir is not None:
        return Path(run_dir)
    choice = [str(new_run_dir(job.name))]
    if env.world_size > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(choice, src=0)
    return Path(choice[0])


def launch(args: argparse.Namespace) -> int:
    """Run ``recsys train``: torchrun with ``--nproc`` workers and elastic restarts."""
    from recsys.config import load_job

    job = load_job(args.config, args.set)  # fail fast, before any process starts
    run_dir = args.run_dir or new_run_dir(job.name)
    forwarded = ["--config", str(args.config), "--run-dir", str(run_dir)]
    for s in args.set:
        forwarded += ["--set", s]
    if args.resume:
        forwarded += ["--resume", str(args.resume)]
    if args.device:
        forwarded += ["--device", args.device]
    if args.nproc == 1 and args.max_restarts == 0:
        from recsys.train.__main__ import main

        return main(forwarded)
    from torch.distributed.run import main as torchrun

    torchrun_args = [
        "--standalone",  # one node; c10d rendezvous on a free local port
        "--nproc-per-node", str(args.nproc),
        "--max-restarts", str(args.max_restarts),
        "-m", "recsys.train",
        *forwarded,
    ]
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    try:
        torchrun(torchrun_args)
    except SystemExit as exc:  # torchrun exits through SystemExit / ChildFailedError
        return int(exc.code or 0)
    except Exception as exc:  # noqa: BLE001 - torchrun's ChildFailedError carries the story
        print(f"recsys train: training failed: {exc}", file=sys.stderr)
        return 1
    return 0
