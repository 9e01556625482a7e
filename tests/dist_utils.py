"""Run a test body in N spawned processes forming a gloo process group on a free port."""

from __future__ import annotations

from recsys.runtime.spawn import run_gloo


def run_distributed(fn, world_size: int, *args, timeout: float = 300):
    """Return ``[fn(rank, world_size, *args) for each rank]`` run in spawned gloo processes.

    ``fn`` must be importable (a module-level function). A failure in any rank raises
    ``AssertionError`` with that rank's traceback.
    """
    return run_gloo(fn, world_size, *args, timeout=timeout, error=AssertionError)
