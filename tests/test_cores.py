"""``train.runtime.pin_cores``: each local process of a CPU job on its own share of the host's cores."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dist_utils import run_distributed
from recsys.train.cores import share

pytestmark = pytest.mark.multiproc


def test_share_gives_each_local_rank_an_equal_contiguous_part():
    assert [share([0, 1], r, 2) for r in range(2)] == [[0], [1]]
    assert [share([3, 2, 1, 0], r, 2) for r in range(2)] == [[0, 1], [2, 3]]
    assert [share([0, 1, 2], r, 2) for r in range(2)] == [[0], [1]]  # equal shares: the odd core is left over
    assert share([4, 5], 0, 1) == [4, 5]  # one process: every core
    assert share([7], 1, 2) == [7]  # fewer cores than processes: every core


def _rank_cores(rank, world, data, run_dir, pin):
    from test_train import build

    trainer = build(Path(data), Path(run_dir), "train.max_steps=2", f"train.runtime.pin_cores={pin}")
    try:
        trainer.train()
        masks = set()
        for tid in os.listdir("/proc/self/task"):  # every thread still alive: store, reader, gloo, torch
            try:
                masks.add(tuple(sorted(os.sched_getaffinity(int(tid)))))
            except OSError:
                pass
        return trainer.cores, masks, len(os.listdir("/proc/self/task"))
    finally:
        trainer.close()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and 2 cores")
def test_each_rank_of_a_two_process_job_runs_every_thread_on_its_own_cores(tiny_data, tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    got = run_distributed(_rank_cores, 2, str(tiny_data), str(tmp_path / "pinned"), "true", timeout=180)
    for rank, (cores, masks, threads) in enumerate(got):
        assert cores == share(allowed, rank, 2)
        assert threads > 3 and masks == {tuple(cores)}  # threads started before and after the pin
    assert not set(got[0][0]) & set(got[1][0])


@pytest.mark.slow  # 8 s of a make test near its 20 minutes; the option's one branch
@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and 2 cores")
def test_with_pin_cores_off_every_thread_may_run_on_every_core(tiny_data, tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    off = run_distributed(_rank_cores, 2, str(tiny_data), str(tmp_path / "free"), "false", timeout=180)
    for cores, masks, _ in off:
        assert cores is None and masks == {tuple(allowed)}
