"""The CPU pooling kernels equal torch's embedding / embedding_bag, forward and backward."""

import torch

from recsys.store.pooling import bag_sum, gather_rows


def test_gather_matches_embedding_with_padding():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(11, 5, generator=g)
    rows[-1] = 0
    idx = torch.randint(0, 11, (7, 3), generator=g)
    upstream = torch.randn(7, 3, 5, generator=g)
    a = rows.clone().requires_grad_(True)
    b = rows.clone().requires_grad_(True)
    out_a = gather_rows(a, idx, pad=10)
    out_b = torch.nn.functional.embedding(idx, b, padding_idx=10)
    torch.testing.assert_close(out_a, out_b)
    (out_a * upstream).sum().backward()
    (out_b * upstream).sum().backward()
    torch.testing.assert_close(a.grad[:10], b.grad[:10])


def test_bag_sum_matches_embedding_bag_with_weights_and_empty_bags():
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(9, 4, generator=g)
    lengths = torch.tensor([2, 0, 3, 1, 0])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    values = torch.randint(0, 9, (int(lengths.sum()),), generator=g)
    for weights in (None, torch.rand(int(lengths.sum()), generator=g)):
        a = rows.clone().requires_grad_(True)
        b = rows.clone().requires_grad_(True)
        out_a = bag_sum(a, values, offsets, weights, pad=8)
        out_b = torch.nn.functional.embedding_bag(values, b, offsets, mode="sum", per_sample_weights=weights,
                                                  include_last_offset=True)
        torch.testing.assert_close(out_a, out_b)
        upstream = torch.randn(5, 4, generator=g)
        (out_a * upstream).sum().backward()
        (out_b * upstream).sum().backward()
        torch.testing.assert_close(a.grad, b.grad)
