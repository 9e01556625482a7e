"""The store's CPU pooling kernels equal torch's embedding / embedding_bag, forward and backward."""

import numpy as np
import torch

from recsys.store.tables.pooling import local_copy, pool_backward, pool_forward, pool_torch


def _case(seed: int, weighted: bool):
    """Return rows [R, D] (last row zero) and the indices of B samples: single-hot features
    at schema positions 0 and 3 (some samples without an id), multi-hot ones at 1 and 2
    (bags of 0..4 ids)."""
    g = torch.Generator().manual_seed(seed)
    R, D, B = 13, 5, 7
    rows = torch.randn(R, D, generator=g)
    rows[-1] = 0
    single_idx = torch.randint(0, R - 1, (B, 2), generator=g)
    single_idx[torch.rand(B, 2, generator=g) < 0.3] = R - 1  # no id: the zero row
    lengths = torch.randint(0, 5, (2 * B,), generator=g)
    lengths[0] = 0  # an empty bag
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    values = torch.randint(0, R - 1, (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.shape[0], generator=g) if weighted else None
    return rows, single_idx, torch.tensor([0, 3]), values, offsets, weights, torch.tensor([1, 2])


def test_pool_kernels_match_torch_forward_and_backward():
    for seed, weighted in ((0, False), (1, True)):
        rows, single_idx, single_cols, values, offsets, weights, multi_cols = _case(seed, weighted)
        B, D = single_idx.shape[0], rows.shape[1]
        ref_rows = rows.clone().requires_grad_(True)
        ref = pool_torch(ref_rows, single_idx, single_cols, values, offsets, weights, multi_cols)
        args = (single_idx.numpy(), single_cols.numpy(), values.numpy(), offsets.numpy(),
                None if weights is None else weights.numpy(), multi_cols.numpy())
        out = pool_forward(rows.numpy(), *args, np.full((B, 4, D), np.nan, dtype=np.float32))
        torch.testing.assert_close(torch.from_numpy(out), ref.detach())
        # by hand: feature 3 of sample 0 and the bag of feature 1 for sample 0 (empty)
        torch.testing.assert_close(ref[0, 3], rows[single_idx[0, 1]])
        torch.testing.assert_close(ref[0, 1], torch.zeros(D))

        upstream = torch.randn(B, 4, D, generator=torch.Generator().manual_seed(seed + 10))
        (ref * upstream).sum().backward()
        grads = pool_backward(upstream.numpy(), *args, np.zeros(rows.shape, dtype=np.float32))
        # the zero row (R - 1) is padding: torch gives it no gradient, ours is never read
        torch.testing.assert_close(torch.from_numpy(grads[:-1]), ref_rows.grad[:-1])


def test_local_copy_is_an_equal_copy_in_a_reused_per_thread_buffer():
    import threading

    rng = np.random.default_rng(3)
    a = rng.standard_normal((5000, 16)).astype(np.float32)
    c = local_copy(a)
    np.testing.assert_array_equal(c, a)
    assert c.shape == a.shape and c.dtype == np.float32 and c.flags["C_CONTIGUOUS"]
    assert not np.shares_memory(c, a)
    b = rng.standard_normal((3000, 16)).astype(np.float32)
    c2 = local_copy(b)  # fits: the same buffer, now holding b
    np.testing.assert_array_equal(c2, b)
    assert c2.ctypes.data == c.ctypes.data
    big = rng.standard_normal((50_000, 16)).astype(np.float32)
    np.testing.assert_array_equal(local_copy(big), big)  # grows
    other = {}
    t = threading.Thread(target=lambda: other.setdefault("ptr", local_copy(b).ctypes.data))
    t.start()
    t.join()
    assert other["ptr"] != local_copy(b).ctypes.data  # each thread its own buffer
