"""``recsys train``: launch training processes with torchrun (elastic), or run in-process.

Before any process starts, ``preflight`` checks what it can: the job file loads, every data
path exists and holds Parquet files with the schema's columns (the reader's own footer
checks, as ``recsys inspect --config`` shows them), the checkpoint to resume from loads and
the run directory is writable. A worker's user error (``recsys.errors.user_message``) is
written to the launch directory (``RECSYS_LAUNCH_DIR``) instead of being printed by every
rank; the launcher prints it once, as one line, and exits with 2.

SIGTERM to the launcher (what Kubernetes and Slurm send): torchrun's agent forwards it to
the workers, which checkpoint at the end of their current step and exit 0 (each writes
``stopped-local-<local rank>``); the launcher then exits 0 too, and the next ``recsys train`` with the
same run directory resumes from that checkpoint. Workers get
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds (default 30 here too) before the agent kills them.

Several machines (``--nnodes``, ``--rdzv-endpoint``, ``--rdzv-id``; ``multinode_args``): the
same command on every node, with ``--nproc`` workers per node, joins torchrun's c10d
rendezvous at the endpoint instead of ``--standalone``. With ``--nnodes MIN:MAX`` the job is
elastic: when a node leaves, the others' workers fail their next collective and torchrun
restarts them (one of ``--max-restarts``) at the smaller world size; when a node asks to join,
torchrun stops the running workers with SIGTERM (they checkpoint at the end of their step)
and starts them again with the newcomer (not counted as a restart). SIGTERM to one node's
launcher is a graceful leave: every rank checkpoints at the end of the same step, that node
exits 0, and the others' workers exit with ``LEFT_BEHIND_EXIT`` so torchrun starts them again
without it (one of ``--max-restarts``). Every start resumes
from the run directory's latest checkpoint, which restores at any world size, so the run
directory must be one shared directory, at the same path on every node.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from recsys.train.job_args import (LAUNCH_DIR_ENV, LEFT_BEHIND_EXIT, NNODES_ENV, check_resume, load_job_args,
                                   new_run_dir)

NO_SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""torchrun's switch: set to 1 for several nodes (see ``_torchrun``)."""


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


def check_devices(device: str, nproc: int) -> None:
    """Check that ``--device cuda`` has a GPU for each of the node's ``nproc`` workers (one
    process per GPU, ``cuda:LOCAL_RANK``), before any process starts (raises ``UserError``)."""
    if device != "cuda":
        return
    import torch

    from recsys.errors import UserError

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={shown!r})" if shown is not None else ""
    if visible == 0:
        build = "torch has no CUDA support: see the README's GPU section" if torch.version.cuda is None else (
            f"torch {torch.__version__} sees no GPU{where}")
        raise UserError(f"train: --device cuda needs a GPU: {build}")
    if nproc > visible:
        raise UserError(f"train: --device cuda --nproc {nproc} runs one process per GPU, but {visible} GPU(s) are "
                        f"visible{where}: use --nproc {visible} or fewer")


RDZV_CONF_KEYS = {
    "join_timeout": "seconds a node waits for --nnodes MIN nodes (default 600)",
    "last_call_timeout": "seconds to wait for more nodes once MIN joined (default 30)",
    "close_timeout": "seconds to close the rendezvous at the end (default 30)",
    "heartbeat_timeout": "seconds without a heartbeat before a node is dropped",
    "keep_alive_interval": "seconds between a node's heartbeats (default 5)",
    "keep_alive_max_attempt": "heartbeats a node may miss before it is dropped (default 3)",
    "read_timeout": "seconds a rendezvous store read may take (default 60)",
    "is_host": "true on the node that hosts the rendezvous, false elsewhere (default: the node whose "
               "address is the endpoint's host)",
}
"""The ``--rdzv-conf`` keys (torchrun's c10d rendezvous settings): whole numbers of seconds
> 0, except ``is_host`` (true/false)."""


def add_multinode_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``recsys train``'s multi-node flags (torchrun's c10d rendezvous)."""
    group = parser.add_argument_group(
        "several machines", "the same command on every node (torchrun's c10d rendezvous); "
        "--nproc is per node; the run directory must be shared")
    group.add_argument("--nnodes", metavar="N|MIN:MAX",
                       help="nodes of the job; MIN:MAX is elastic (nodes may leave down to MIN and join up to MAX)")
    group.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                       help="where the nodes meet: a port on one of them (that node hosts the rendezvous "
                            "and must stay up)")
    group.add_argument("--rdzv-id", metavar="ID", help="the job's id, the same on every node (letters, digits, . _ -)")
    group.add_argument("--rdzv-conf", metavar="KEY=VALUE,...",
                       help="rendezvous settings: " + ", ".join(RDZV_CONF_KEYS))
    group.add_argument("--local-addr", metavar="HOST",
                       help="this node's address as the others reach it (default: its host name)")


_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)$")
_RDZV_ID = re.compile(r"^[A-Za-z0-9_.-]+$")


def parse_nnodes(text: str) -> tuple[int, int]:
    """Return (MIN, MAX) of ``--nnodes N`` or ``--nnodes MIN:MAX`` (raises ``UserError``)."""
    from recsys.errors import UserError

    parts = text.strip().split(":")
    try:
        if len(parts) not in (1, 2):
            raise ValueError
        low, high = int(parts[0]), int(parts[-1])
    except ValueError:
        raise UserError(f"train: --nnodes takes N or MIN:MAX (whole numbers), found {text!r}") from None
    if not 1 <= low <= high:
        raise UserError(f"train: --nnodes MIN:MAX needs 1 <= MIN <= MAX, found {text!r}")
    return low, high


def parse_endpoint(text: str) -> tuple[str, int]:
    """Return (host, port) of ``--rdzv-endpoint HOST:PORT`` (raises ``UserError``)."""
    from recsys.errors import UserError

    host, sep, port = text.strip().rpartition(":")
    if not sep or not _HOST.match(host) or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UserError(f"train: --rdzv-endpoint takes HOST:PORT (an IPv6 host in brackets, a port "
                        f"1-65535 the nodes can reach), found {text!r}")
    return host.strip("[]"), int(port)


def parse_rdzv_conf(text: str) -> dict[str, int | bool]:
    """Return the settings of ``--rdzv-conf KEY=VALUE,...`` (raises ``UserError``)."""
    from recsys.errors import UserError

    out: dict[str, int | bool] = {}
    for item in filter(None, (i.strip() for i in text.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in RDZV_CONF_KEYS:
            raise UserError(f"train: --rdzv-conf takes KEY=VALUE,... with KEY one of "
                            f"{', '.join(RDZV_CONF_KEYS)}, found {item!r}")
        if key == "is_host":
            if value.lower() not in ("true", "false", "1", "0"):
                raise UserError(f"train: --rdzv-conf is_host takes true or false, found {value!r}")
            out[key] = value.lower() in ("true", "1")
        elif not value.isdigit() or int(value) < 1:
            raise UserError(f"train: --rdzv-conf {key} takes a whole number of seconds > 0, found {value!r}")
        else:
            out[key] = int(value)
    return out


def multinode_args(args: argparse.Namespace) -> list[str] | None:
    """Return torchrun's rendezvous arguments for the multi-node flags, or None without them
    (one machine: ``--standalone``). Checks the flags (raises ``UserError``)."""
    from recsys.errors import UserError

    nnodes = getattr(args, "nnodes", None)
    endpoint = getattr(args, "rdzv_endpoint", None)
    rdzv_id = getattr(args, "rdzv_id", None)
    conf = getattr(args, "rdzv_conf", None)
    local_addr = getattr(args, "local_addr", None)
    if nnodes is None:
        given = [flag for flag, value in (("--rdzv-endpoint", endpoint), ("--rdzv-id", rdzv_id),
                                          ("--rdzv-conf", conf), ("--local-addr", local_addr)) if value is not None]
        if given:
            raise UserError(f"train: {' and '.join(given)} need(s) --nnodes N or MIN:MAX (a multi-node job)")
        return None
    low, high = parse_nnodes(nnodes)
    if endpoint is None:
        raise UserError("train: --nnodes needs --rdzv-endpoint HOST:PORT (where the nodes meet; "
                        "the same on every node)")
    parse_endpoint(endpoint)
    if not rdzv_id:
        raise UserError("train: --rdzv-endpoint needs --rdzv-id ID (the job's id, the same on every node)")
    if not _RDZV_ID.match(rdzv_id):
        raise UserError(f"train: --rdzv-id takes letters, digits, '.', '_' and '-', found {rdzv_id!r}")
    if args.run_dir is None:
        raise UserError("train: --nnodes needs --run-dir (one shared directory, the same path on every node: "
                        "every start resumes from its latest checkpoint)")
    out = ["--nnodes", f"{low}:{high}" if low != high else str(low), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", endpoint.strip(), "--rdzv-id", rdzv_id]
    if conf is not None:
        settings = parse_rdzv_conf(conf)
        if settings:
            out += ["--rdzv-conf", ",".join(f"{k}={str(v).lower()}" for k, v in settings.items())]
    if local_addr is not None:
        if not _HOST.match(local_addr.strip()):
            raise UserError(f"train: --local-addr takes a host name or address, found {local_addr!r}")
        out += ["--local-addr", local_addr.strip().strip("[]")]
    return out


def launch(args: argparse.Namespace) -> int:
    """Run ``recsys train``: torchrun with ``--nproc`` workers and elastic restarts."""
    from recsys.errors import UserError

    if args.nproc < 1 or args.max_restarts < 0:
        raise UserError(f"train: need --nproc >= 1 and --max-restarts >= 0, found {args.nproc} and {args.max_restarts}")
    rendezvous = multinode_args(args)  # before reading anything: the flags themselves
    verbose = bool(getattr(args, "verbose", False))
    job = load_job_args(args, log=print)
    run_dir = args.run_dir or new_run_dir(job.name)
    check_devices(job.train.device, args.nproc)
    preflight(job, args.resume, run_dir)  # fail fast, before any process starts
    forwarded = ["--config", str(args.config), "--run-dir", str(run_dir)]
    for s in args.set:
        forwarded += ["--set", s]
    if args.resume:
        forwarded += ["--resume", str(args.resume)]
    if args.device:
        forwarded += ["--device", args.device]
    if getattr(args, "early_stopping", False):
        forwarded.append("--early-stopping")
    if verbose:
        forwarded.append("--verbose")
    if args.nproc == 1 and args.max_restarts == 0 and rendezvous is None:
        from recsys.train.__main__ import main

        return main(forwarded)
    return _torchrun(args, forwarded, verbose, rendezvous)


def _torchrun(args: argparse.Namespace, forwarded: list[str], verbose: bool,
              rendezvous: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    torchrun_args = [
        # one node: c10d rendezvous on a free local port; several: at --rdzv-endpoint
        *(rendezvous if rendezvous is not None else ["--standalone"]),
        "--nproc-per-node", str(args.nproc),
        "--max-restarts", str(args.max_restarts),
        "-m", "recsys.train",
        *forwarded,
    ]
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    launch_dir = Path(tempfile.mkdtemp(prefix="recsys-launch-"))
    saved_env = {name: os.environ.get(name) for name in (LAUNCH_DIR_ENV, NO_SHARED_STORE_ENV, NNODES_ENV)}
    os.environ[LAUNCH_DIR_ENV] = str(launch_dir)
    if rendezvous is not None:
        low, high = parse_nnodes(args.nnodes)
        os.environ[NNODES_ENV] = f"{low}:{high}"
        # torchrun's agent shares its rendezvous store with the workers only if rank 0 stays on
        # one node (a node keeping rank 0 does not publish the store's address again to the next
        # round: a joining node waits for it and fails); without sharing, rank 0 of every round
        # hosts a new store on a new port, so no round can read an earlier round's keys
        os.environ[NO_SHARED_STORE_ENV] = "1"
    saved_levels = {} if verbose else _quiet_torch_logs()
    try:
        try:
            torchrun(torchrun_args)
        except SignalException as exc:
            stopped = sorted(launch_dir.glob("stopped-local-*")) + sorted(launch_dir.glob("finished-local-*"))
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
            why = _rendezvous_failure(exc, args) if rendezvous is not None else None
            failures = getattr(exc, "failures", None) or {}
            if failures and all(getattr(f, "exitcode", None) == LEFT_BEHIND_EXIT for f in failures.values()):
                why = ("another node stopped (SIGTERM) and --max-restarts is used up, so this node stops too; "
                       "every worker saved a checkpoint: the same command resumes")
            print(f"recsys train: training failed: {why or exc}", file=sys.stderr)
            return 1
        return 0
    finally:
        for logger, level in saved_levels.items():
            logger.setLevel(level)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(launch_dir, ignore_errors=True)


def _rendezvous_failure(exc: Exception, args: argparse.Namespace) -> str | None:
    """Return what a failed multi-node rendezvous means for the user, or None for another error."""
    from torch.distributed.elastic.rendezvous.api import (RendezvousClosedError, RendezvousConnectionError,
                                                          RendezvousError, RendezvousTimeoutError)

    where = f"the rendezvous at {args.rdzv_endpoint} (--rdzv-id {args.rdzv_id})"
    resume = f"{args.run_dir} keeps its checkpoints: the same commands resume from the latest complete one"
    if isinstance(exc, RendezvousConnectionError):
        return (f"lost the connection to {where}: the node hosting it stopped (or the job ended) or "
                f"cannot be reached (it must stay up for the whole job); {resume}")
    if isinstance(exc, RendezvousTimeoutError):
        return (f"too few nodes joined {where} in time (--nnodes {args.nnodes}; rendezvous timeouts: "
                f"--rdzv-conf join_timeout=SECONDS); {resume}")
    if isinstance(exc, RendezvousClosedError):
        return f"{where} is closed (its job ended); a new job needs another --rdzv-id"
    if isinstance(exc, RendezvousError):
        return f"{where} failed: {exc}; {resume}"
    return None


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
