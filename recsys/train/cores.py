"""Each local process of a CPU job on its own share of the host's cores (``train.runtime.pin_cores``).

With ``--nproc n`` on one host, every rank runs its dense step, its store's worker, its
reader's threads and gloo's threads. Left to the scheduler, a rank's background thread often
runs on the core the other rank's dense step wants; that rank's step then ends later, and
each of a step's all-to-alls makes the first rank wait for it. Pinned, a rank's background
threads take only the moments its own core idles (with ``train.runtime.idle_background`` they yield
to its dense step at once). Linux only: elsewhere nothing is pinned.
"""

from __future__ import annotations

import os


def share(allowed: list[int], local_rank: int, local_world_size: int) -> list[int]:
    """Return the cores of ``local_rank`` among ``local_world_size`` processes: an equal,
    contiguous share of ``allowed`` (sorted), or all of ``allowed`` when it has fewer cores
    than processes."""
    cores = sorted(allowed)
    k = len(cores) // max(1, local_world_size)
    if k == 0 or local_world_size <= 1:
        return cores
    return cores[local_rank * k : (local_rank + 1) * k]


def pin_process(local_rank: int, local_world_size: int) -> list[int] | None:
    """Pin every thread of this process (and those it starts later) to its ``share``;
    return the cores, or None when nothing was pinned (one process, too few cores, no
    ``sched_setaffinity``)."""
    if local_world_size <= 1 or not hasattr(os, "sched_setaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    mine = share(allowed, local_rank, local_world_size)
    if mine == allowed:  # fewer cores than processes: nothing to pin
        return None
    for tid in os.listdir("/proc/self/task"):  # threads started so far (gloo's among them)
        try:
            os.sched_setaffinity(int(tid), mine)
        except (OSError, ValueError):  # a thread that just ended
            pass
    os.sched_setaffinity(0, mine)  # this thread, whose later threads inherit it
    return mine
