"""Run a test body in N spawned processes forming a gloo process group on a free port."""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from pathlib import Path

import torch.multiprocessing as mp

from conftest import free_port


def _entry(rank: int, world_size: int, port: int, fn, args, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    result_path = Path(out_dir) / f"rank{rank}.pkl"
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        payload = ("ok", value)
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        payload = ("error", traceback.format_exc())
    with open(result_path, "wb") as fh:
        pickle.dump(payload, fh)


def run_distributed(fn, world_size: int, *args, timeout: float = 300):
    """Return ``[fn(rank, world_size, *args) for each rank]`` run in spawned gloo processes.

    ``fn`` must be importable (a module-level function). A failure in any rank raises with
    that rank's traceback.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _entry, args=(world_size, free_port(), fn, args, out_dir), nprocs=world_size,
            join=False, start_method="spawn",
        )
        import time
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"distributed test did not finish in {timeout}s")
        results = []
        for rank in range(world_size):
            with open(Path(out_dir) / f"rank{rank}.pkl", "rb") as fh:
                status, value = pickle.load(fh)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results
