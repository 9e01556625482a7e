"""The store's CPU pooling kernels equal torch's embedding / embedding_bag, forward and backward."""

import numpy as np
import torch

from recsys.store.pooling import pool_backward, pool_forward, pool_torch


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
