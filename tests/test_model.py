"""Dense models: shapes, gradients, config errors."""

import pytest
import torch

from recsys.model.arch import RankingModel
from recsys.model.config import ModelConfig


@pytest.mark.parametrize("arch", ["dlrm", "dcn"])
def test_forward_backward_shapes(arch):
    torch.manual_seed(0)
    model = RankingModel(ModelConfig(arch=arch, bottom_mlp=[8, 4], top_mlp=[16, 1], dcn_low_rank=4), 5, 3, 4)
    dense = torch.randn(7, 5)
    pooled = torch.randn(7, 3, 4, requires_grad=True)
    logits = model(dense, pooled)
    assert logits.shape == (7,)
    logits.sum().backward()
    assert pooled.grad is not None and pooled.grad.abs().sum() > 0
    assert all(p.grad is not None for p in model.parameters())


def test_same_seed_same_weights():
    cfg = ModelConfig(bottom_mlp=[8, 4], top_mlp=[16, 1])
    torch.manual_seed(3)
    a = RankingModel(cfg, 5, 3, 4)
    torch.manual_seed(3)
    b = RankingModel(cfg, 5, 3, 4)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_config_errors():
    with pytest.raises(ValueError, match=r"must end in the embedding dim 16"):
        RankingModel(ModelConfig(bottom_mlp=[8, 4]), 5, 3, 16)
    with pytest.raises(ValueError, match=r"ending in 1"):
        ModelConfig(top_mlp=[16, 2])


def test_dot_interaction_equals_torchrec_interaction():
    from torchrec.models.dlrm import InteractionArch

    from recsys.model.arch import DotInteraction

    torch.manual_seed(1)
    dense = torch.randn(6, 4, requires_grad=True)
    sparse = torch.randn(6, 5, 4, requires_grad=True)
    ours = DotInteraction(5)(dense, sparse)
    theirs = InteractionArch(5)(dense, sparse)
    assert torch.equal(ours, theirs)
    g = torch.randn_like(ours)
    (ga,) = torch.autograd.grad(ours, sparse, g)
    (gb,) = torch.autograd.grad(theirs, sparse, g)
    torch.testing.assert_close(ga, gb)
