"""Model arms: DeepFM's FM term against the explicit pairwise sum, the dense columns'
embeddings (quantile buckets, piecewise-linear numeric embeddings) against hand computation."""

from __future__ import annotations

import itertools

import pytest
import torch

from recsys.model.arch import DenseEmbeddings, RankingModel, fm_second_order
from recsys.model.config import ModelConfig


def test_fm_term_equals_the_explicit_pairwise_sum():
    torch.manual_seed(0)
    v = torch.randn(5, 7, 4, dtype=torch.float64)
    explicit = torch.stack([sum((v[b, i] * v[b, j]).sum() for i, j in itertools.combinations(range(7), 2))
                            for b in range(5)])
    torch.testing.assert_close(fm_second_order(v), explicit)


def test_deepfm_logit_is_the_deep_tower_plus_the_fm_term():
    torch.manual_seed(1)
    model = RankingModel(ModelConfig(arch="deepfm", bottom_mlp=[8, 4], top_mlp=[16, 1]), 3, 2, 4)
    dense = torch.randn(6, 3)
    pooled = torch.randn(6, 2, 4, requires_grad=True)
    logits = model(dense, pooled)
    d = model.dense_arch(dense)
    vectors = torch.cat([d.unsqueeze(1), pooled], dim=1)  # [B, 3, D]
    fm = sum((vectors[:, i] * vectors[:, j]).sum(1) for i, j in itertools.combinations(range(3), 2))
    deep = model.over_arch(vectors.flatten(1)).squeeze(-1)
    torch.testing.assert_close(logits, deep + fm)
    logits.sum().backward()
    assert pooled.grad.abs().sum() > 0 and all(p.grad is not None for p in model.parameters())


def test_dense_embeddings_by_hand():
    torch.manual_seed(2)
    emb = DenseEmbeddings(["quantile_buckets", "numeric_embedding"], buckets=4, dim=3)
    values = torch.tensor([[0.0, 1.5], [4.0, -1.0], [2.0, 4.0]])
    out = emb(values)
    table, proj, null = emb.tables[0].weight, emb.projections[0], emb.null_vectors[0]
    torch.testing.assert_close(out[:, 0], table[[0, 4, 2]])  # bucket ids; 4 = the null bucket
    # piecewise-linear encoding of 1.5 over 4 bins: [1, 0.5, 0, 0]; of 4 (the top): all ones
    enc = torch.tensor([[1.0, 0.5, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    torch.testing.assert_close(out[[0, 2], 1], proj(enc))
    torch.testing.assert_close(out[1, 1], null.detach())  # a null: the learned null vector


@pytest.mark.parametrize("arch", ["dlrm", "dcn", "deepfm"])
def test_embedded_dense_columns_join_the_interaction(arch):
    torch.manual_seed(3)
    cfg = ModelConfig(arch=arch, bottom_mlp=[8, 4], top_mlp=[16, 1], dcn_low_rank=4)
    kinds = ["quantile_buckets", "signed_log1p", "numeric_embedding"]
    model = RankingModel(cfg, 3, 2, 4, kinds, buckets=4)
    dense = torch.tensor([[0.0, 0.3, 2.5], [4.0, -1.0, -1.0], [3.0, 0.0, 0.0]])
    pooled = torch.randn(3, 2, 4, requires_grad=True)
    logits = model(dense, pooled)
    assert logits.shape == (3,)
    logits.sum().backward()
    assert model.dense_embeddings.tables[0].weight.grad[[0, 4, 3]].abs().sum(1).gt(0).all()
    assert model.dense_embeddings.tables[0].weight.grad[[1, 2]].abs().sum() == 0  # buckets no row fell in
    # every column embedded: the bottom MLP still gives the interaction its (learned, constant) vector
    only = RankingModel(cfg, 2, 2, 4, ["quantile_buckets", "numeric_embedding"], buckets=4)
    assert only(dense[:, [0, 2]], pooled.detach()).shape == (3,)


def test_default_model_is_unchanged_by_the_new_arms():
    """No dense kinds given (or all plain): the same modules, parameters and order as before."""
    cfg = ModelConfig(bottom_mlp=[8, 4], top_mlp=[16, 1])
    torch.manual_seed(4)
    a = RankingModel(cfg, 5, 3, 4)
    torch.manual_seed(4)
    b = RankingModel(cfg, 5, 3, 4, ["signed_log1p"] * 4 + ["standardize"])
    assert [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()]
    assert not any(n.startswith("dense_embeddings") for n, _ in a.named_parameters())
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
