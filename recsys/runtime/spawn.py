"""Run a function in N local processes that form a gloo process group (benchmarks, tests).

Training itself goes through torchrun (``recsys.train.launch``); this is for code that
needs a few ranks on this machine and each rank's return value back.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path


def free_port() -> int:
    """Return a TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn, args, out_dir: str) -> None:
    """One rank: run ``fn``, write its outcome, then leave without interpreter teardown.

    Once the outcome is on disk the rank's work is done, and Python's finalization must not
    undo it: a native thread (gloo's, torch's) that wants the GIL after finalization began
    is ended by ``pthread_exit``, which aborts a C++ thread ("terminate called without an
    active exception", SIGABRT). A ``recsys eval --nproc 2`` rank died with that message
    once in CI, most likely that way (38 runs here did not repeat it). So the rank exits
    with ``os._exit``. A fatal signal before that point prints every thread's Python stack
    (faulthandler), so a crash while working names where it happened.
    """
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            payload = ("ok", fn(rank, world_size, *args))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        payload = ("error", traceback.format_exc())
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as fh:
        pickle.dump(payload, fh)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_gloo(fn, world_size: int, *args, timeout: float = 300, error=RuntimeError) -> list:
    """Return ``[fn(rank, world_size, *args) for each rank]``, run in spawned gloo processes.

    ``fn`` must be importable (a module-level function). A rank's failure raises ``error``
    with that rank's traceback; ranks still running after ``timeout`` seconds are killed
    (``TimeoutError``).
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_entry, args=(world_size, free_port(), fn, args, out_dir), nprocs=world_size,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{world_size} gloo processes did not finish in {timeout}s")
        results = []
        for rank in range(world_size):
            with open(Path(out_dir) / f"rank{rank}.pkl", "rb") as fh:
                status, value = pickle.load(fh)
            if status != "ok":
                raise error(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results
