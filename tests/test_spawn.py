"""``recsys.runtime.spawn.run_gloo``: each rank's result or error comes back, and a rank's
interpreter teardown cannot fail a run whose results are written."""

from __future__ import annotations

import atexit
import os

import pytest

from recsys.runtime.spawn import run_gloo


def _sum_then_abort_at_exit(rank: int, world_size: int, base: int) -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([base + rank])
    dist.all_reduce(t)
    atexit.register(os.abort)  # a teardown that dies of SIGABRT, as a native thread can
    return int(t.item()) * 10 + rank


def _fail_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank one's bad input")
    return rank


@pytest.mark.multiproc
def test_results_survive_a_rank_whose_teardown_aborts():
    assert run_gloo(_sum_then_abort_at_exit, 2, 5) == [110, 111]


@pytest.mark.multiproc
def test_a_ranks_exception_is_raised_with_its_traceback():
    class RankFailed(Exception):
        pass

    with pytest.raises(RankFailed) as exc:
        run_gloo(_fail_on_rank_one, 2, error=RankFailed)
    msg = str(exc.value)
    assert "rank 1 failed" in msg and "ValueError: rank one's bad input" in msg and "_fail_on_rank_one" in msg
