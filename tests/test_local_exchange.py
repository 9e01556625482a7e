"""``LocalExchange``: gloo's all-to-all and all-gather through /dev/shm, among ranks of one host."""

from __future__ import annotations

import glob
import os
import signal
import time

import numpy as np
import pytest

from dist_utils import run_distributed
from recsys.runtime.local_exchange import SHM_DIR, LocalExchange

pytestmark = pytest.mark.skipif(not os.access(SHM_DIR, os.W_OK), reason=f"no writable {SHM_DIR}")


def _messages_body(rank, world):
    """Many calls of random sizes (empty blocks, outboxes that grow, both dtypes) against
    gloo's own all-to-all of the same blocks."""
    import torch
    import torch.distributed as dist

    ex = LocalExchange.open(dist.group.WORLD, timeout_s=60)
    assert ex is not None
    rng = np.random.default_rng(7 + rank)
    for call in range(60):
        dtype = np.float32 if call % 2 else np.int64
        # some calls far above the first outbox (1 MiB), some empty
        scale = 400_000 if call % 17 == 5 else 2_000
        sizes = rng.integers(0, scale, size=world) * (call % 13 != 3)
        send = rng.standard_normal(int(sizes.sum())).astype(dtype) if dtype == np.float32 else \
            rng.integers(-2**62, 2**62, size=int(sizes.sum()), dtype=np.int64)
        got, got_sizes = ex.all_to_all(send, sizes)
        # what gloo delivers of the same blocks (the sizes first)
        recv_sizes = torch.empty(world, dtype=torch.int64)
        dist.all_to_all_single(recv_sizes, torch.from_numpy(sizes.astype(np.int64)))
        want = torch.empty(int(recv_sizes.sum()), dtype=torch.from_numpy(send[:0]).dtype)
        dist.all_to_all_single(want, torch.from_numpy(send), output_split_sizes=recv_sizes.tolist(),
                               input_split_sizes=sizes.tolist())
        assert got.dtype == send.dtype
        np.testing.assert_array_equal(got_sizes, recv_sizes.numpy())
        np.testing.assert_array_equal(got, want.numpy())
        every = ex.all_gather(np.array([rank, call, len(send)], dtype=np.int64))
        assert [int(e[0]) for e in every] == list(range(world))
        assert all(int(e[1]) == call for e in every)
    left = sorted(glob.glob(ex.prefix + "*"))
    ex.close()
    dist.barrier()
    return left, sorted(glob.glob(ex.prefix + "*"))


@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_delivers_what_gloo_does(world):
    results = run_distributed(_messages_body, world)
    for left_open, left_closed in results:
        # at most the outboxes made by the last call still have names while open; none after close
        assert len(left_open) <= 2 * world, left_open
        assert left_closed == []


def _dead_peer_entry(rank, world, store_path, out_path):
    """A rank of its own gloo group (not torch's process runner, which kills every rank
    when one dies): rank 1 dies between two calls, rank 0 writes what its call did."""
    import pickle

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    ex = LocalExchange.open(dist.group.WORLD, timeout_s=60)
    ex.all_to_all(np.arange(2 * world, dtype=np.int64), [2] * world)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        ex.all_to_all(np.arange(2 * world, dtype=np.int64), [2] * world)
        outcome = "no error"
    except RuntimeError as e:
        outcome = str(e)
    ex.close()
    with open(out_path, "wb") as f:
        pickle.dump((outcome, time.monotonic() - t0, sorted(glob.glob(ex.prefix + "*"))), f)
    os._exit(0)  # gloo's teardown would wait for the dead rank


@pytest.mark.parametrize("world", [2, 3])
def test_a_killed_peer_raises_instead_of_hanging(tmp_path, world):
    import multiprocessing as mp
    import pickle

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_dead_peer_entry, args=(r, world, tmp_path / "store", tmp_path / f"out{r}"))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
    assert procs[1].exitcode == -signal.SIGKILL
    outcome, waited, left = pickle.loads((tmp_path / "out0").read_bytes())
    # W = 2: the FIFO's last writer is gone (at once); W = 3: rank 1's pid, at the next poll
    assert "rank 1" in outcome and "gone" in outcome, outcome
    assert procs[0].exitcode == 0
    assert waited < 30  # not the 60 s timeout
    if world == 2:  # rank 2, also waiting, cleans up its own files in its own time
        assert left == [], left  # the dead rank's outboxes too
