"""``recsys train``: launch training processes with torchrun (elastic), or run in-process.

Before any process starts, ``preflight`` checks what it can: the job file loads, every data
path exists and holds Parquet files with the schema's columns (the reader's own footer
checks, as ``recsys inspect --config`` shows them), the checkpoint to resume from loads and
the run directory is writable. A worker's user error (``recsys.errors.user_message``) is
written to the launch directory (``RECSYS_LAUNCH_DIR``) instead of being printed by every
rank; the launcher prints it once, as one line, and exits with 2.

SIGTERM to the launcher (what Kubernetes and Slurm send): torchrun's agent forwards it to
the workers, which checkpoint at the end of their current step and exit 0 (each writes
``stopped-rank-<r>``); the launcher then exits 0 too, and the next ``recsys train`` with the
same run directory resumes from that checkpoint. Workers get
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds (default 30 here too) before the agent kills them.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

LAUNCH_DIR_ENV = "RECSYS_LAUNCH_DIR"
"""Set by the launcher for its workers: where they leave user errors and SIGTERM stops."""


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


def load_job_args(args: argparse.Namespace):
    """Return the job of ``--config`` with ``--set`` and ``--device`` applied.

    A job file that cannot be read as UTF-8 text (a directory, no permission, binary) is a
    ``ConfigError`` naming it."""
    from recsys.config import ConfigError, load_job

    overrides = list(args.set) + ([f"train.device={args.device!r}"] if args.device else [])
    try:
        return load_job(args.config, overrides)
    except ConfigError:
        raise
    except (OSError, UnicodeDecodeError) as exc:
        from recsys.errors import user_message

        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else user_message(exc)
        raise ConfigError(f"{args.config}: cannot read the job file: {why}") from None


def check_resume(resume: Path | None, run_dir: Path | None) -> None:
    """Check that the checkpoint a run would start from (``--resume`` or the run's latest)
    is complete and of this format (raises ``UserError`` / ``FileNotFoundError``)."""
    from recsys import checkpoint_files
    from recsys.errors import UserError

    source = resume
    if source is None and run_dir is not None and (Path(run_dir) / "checkpoints").is_dir():
        source = checkpoint_files.latest(Path(run_dir) / "checkpoints")
    if source is None:
        return
    path = checkpoint_files.resolve(source)
    try:
        checkpoint_files.load_meta(path)
    except (ValueError, KeyError) as exc:  # not JSON, or another format version
        raise UserError(f"cannot resume from {path}: {exc}") from None


def preflight(job, resume: Path | None, run_dir: Path) -> None:
    """Check what can be checked before spawning any process (raises ``UserError``)."""
    from recsys.errors import UserError
    from recsys.io.units import build_units, expand_paths

    for field in dataclasses.fields(job.data):  # every split with paths: train, eval...
        cfg = getattr(job.data, field.name)
        if field.name == "train" or getattr(cfg, "paths", None):
            # what the reader does first: list the files, read the footers, check the columns
            build_units(expand_paths(cfg.paths), job.schema, list(cfg.passthrough), cfg.on_bad_file)
    check_resume(resume, run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise UserError(f"run directory {run_dir} is not writable: {exc.strerror or exc}") from None


def launch(args: argparse.Namespace) -> int:
    """Run ``recsys train``: torchrun with ``--nproc`` workers and elastic restarts."""
    from recsys.errors import UserError

    if args.nproc < 1 or args.max_restarts < 0:
        raise UserError(f"train: need --nproc >= 1 and --max-restarts >= 0, found {args.nproc} and {args.max_restarts}")
    verbose = bool(getattr(args, "verbose", False))
    job = load_job_args(args)
    run_dir = args.run_dir or new_run_dir(job.name)
    preflight(job, args.resume, run_dir)  # fail fast, before any process starts
    forwarded = ["--config", str(args.config), "--run-dir", str(run_dir)]
    for s in args.set:
        forwarded += ["--set", s]
    if args.resume:
        forwarded += ["--resume", str(args.resume)]
    if args.device:
        forwarded += ["--device", args.device]
    if verbose:
        forwarded.append("--verbose")
    if args.nproc == 1 and args.max_restarts == 0:
        from recsys.train.__main__ import main

        return main(forwarded)
    return _torchrun(args, forwarded, verbose)


def _torchrun(args: argparse.Namespace, forwarded: list[str], verbose: bool) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    torchrun_args = [
        "--standalone",  # one node; c10d rendezvous on a free local port
        "--nproc-per-node", str(args.nproc),
        "--max-restarts", str(args.max_restarts),
        "-m", "recsys.train",
        *forwarded,
    ]
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    launch_dir = Path(tempfile.mkdtemp(prefix="recsys-launch-"))
    saved_env = os.environ.get(LAUNCH_DIR_ENV)
    os.environ[LAUNCH_DIR_ENV] = str(launch_dir)
    saved_levels = {} if verbose else _quiet_torch_logs()
    try:
        try:
            torchrun(torchrun_args)
        except SignalException as exc:
            stopped = sorted(launch_dir.glob("stopped-rank-*")) + sorted(launch_dir.glob("finished-rank-*"))
            if len(stopped) == args.nproc and not _user_errors(launch_dir):
                print(f"recsys train: stopped by {exc.sigval.name}; every worker saved a checkpoint "
                      f"(resume: the same command)", file=sys.stderr)
                return 0
            print(f"recsys train: stopped by {exc.sigval.name}; {len(stopped)} of {args.nproc} worker(s) "
                  "saved a checkpoint (a resume starts from the latest complete one)", file=sys.stderr)
            return 128 + int(exc.sigval)
        except SystemExit as exc:  # torchrun exits through SystemExit / ChildFailedError
            code = int(exc.code or 0)
            if code and _report_user_errors(launch_dir, verbose):
                return 2
            return code
        except Exception as exc:  # noqa: BLE001 - torchrun's ChildFailedError carries the story
            if _report_user_errors(launch_dir, verbose):
                return 2
            print(f"recsys train: training failed: {exc}", file=sys.stderr)
            return 1
        return 0
    finally:
        for logger, level in saved_levels.items():
            logger.setLevel(level)
        if saved_env is None:
            os.environ.pop(LAUNCH_DIR_ENV, None)
        else:
            os.environ[LAUNCH_DIR_ENV] = saved_env
        shutil.rmtree(launch_dir, ignore_errors=True)


def _quiet_torch_logs() -> dict:
    """Silence torchrun's agent logs (its story of a failed worker; the worker says it in one
    line); return the previous levels. ``-v`` keeps them."""
    saved = {}
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith("torch.distributed") and isinstance(logger, logging.Logger):
            saved[logger] = logger.level
            logger.setLevel(logging.CRITICAL)
    return saved


def _user_errors(launch_dir: Path) -> list[str]:
    """Return the distinct user errors the workers left, by rank."""
    out: list[str] = []
    for path in sorted(launch_dir.glob("error-rank-*"), key=lambda p: int(p.name.rsplit("-", 1)[1])):
        text = path.read_text(errors="replace").strip()
        if text and text not in out:
            out.append(text)
    return out


def _report_user_errors(launch_dir: Path, verbose: bool) -> bool:
    """Print the workers' user errors as one line (all of them with ``-v``); False if none."""
    errors = _user_errors(launch_dir)  # ranks reading the same bad input say the same: once
    if not errors:
        return False
    more = len(errors) - 1
    if verbose or not more:
        for text in errors:
            print(f"recsys train: error: {text}", file=sys.stderr)
    else:
        print(f"recsys train: error: {errors[0]} (and {more} other error(s) on other ranks; -v shows them)",
              file=sys.stderr)
    return True
