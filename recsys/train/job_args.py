"""What the launcher (``recsys.train.launch``) and every training process (``python -m
recsys.train``) share: the environment the launcher sets for its workers, the job's
arguments, the run directory and the resume check. Light: no torch at import.
"""

from __future__ import annotations

import argparse
import datetime as _dt
from pathlib import Path

LAUNCH_DIR_ENV = "RECSYS_LAUNCH_DIR"
"""Set by the launcher for its workers: where they leave user errors and SIGTERM stops."""

LEFT_BEHIND_EXIT = 75
"""Exit code of a worker of an elastic job stopped by another node's SIGTERM: torchrun starts
it again without that node (``recsys.train.__main__``)."""

NNODES_ENV = "RECSYS_NNODES"
"""Set by the launcher of a multi-node job for its workers: ``MIN:MAX`` of ``--nnodes``."""

def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the arguments every training process understands."""
    parser.add_argument("--config", required=True, type=Path, help="job file (TOML)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a job setting, e.g. --set train.max_steps=100")
    parser.add_argument("--run-dir", type=Path, help="run directory (default: a new one under runs/)")
    parser.add_argument("--resume", type=Path, help="checkpoint to start from: a step directory, run directory, checkpoints/ directory or its latest file (default: the run's latest)")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="shortcut for --set train.device=...")
    parser.add_argument("--early-stopping", action="store_true",
                        help="what the job does not say, as `recsys tune` chooses it: a validation split (10%% of "
                             "the training row groups), an evaluation every epoch, the best checkpoint by AUC, "
                             "early stopping and an epoch cap")


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


def load_job_args(args: argparse.Namespace, log=None):
    """Return the job of ``--config`` with ``--set`` and ``--device`` applied, and with
    ``--early-stopping`` what the job does not say of its evaluations as ``recsys tune``
    chooses it (``recsys.train.config.early_stopping_defaults``; ``log`` gets the line
    saying what).

    A job file that cannot be read as UTF-8 text (a directory, no permission, binary) is a
    ``ConfigError`` naming it."""
    from recsys.config import ConfigError, JobConfig, apply_overrides, from_dict, load_job, read_toml

    overrides = list(args.set) + ([f"train.device={args.device!r}"] if args.device else [])
    try:
        if getattr(args, "early_stopping", False):
            from recsys.train.config import describe_defaults, early_stopping_defaults

            data, chosen = early_stopping_defaults(apply_overrides(read_toml(args.config), overrides, JobConfig))
            if log is not None:
                log(describe_defaults(chosen, "train --early-stopping"))
            return from_dict(JobConfig, data, str(args.config))
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
    from recsys.checkpoint import read as checkpoint_files
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
