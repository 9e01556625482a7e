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
    ga = torch.autograd.grad(ours, (dense, sparse), g)
    gb = torch.autograd.grad(theirs, (dense, sparse), g)
    torch.testing.assert_close(ga, gb)


def test_pair_dots_backward_is_the_derivative():
    """The interaction's own backward against finite differences (float64)."""
    from recsys.model.arch import DotInteraction

    torch.manual_seed(2)
    inter = DotInteraction(4).double()
    dense = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    sparse = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(inter, (dense, sparse))


@pytest.mark.parametrize("arch", ["dlrm", "dcn", "deepfm"])
def test_buffers_are_constants_that_training_leaves_alone(arch):
    """DDP syncs no buffers before a forward (recsys/train/loop.py): every rank's buffers
    must be the same without a broadcast, so they may depend neither on the seed nor on
    training, and none may be saved in a checkpoint."""
    cfg = ModelConfig(arch=arch, bottom_mlp=[8, 4], top_mlp=[16, 1], dcn_low_rank=4, dropout=0.2)
    kinds = ["periodic", "signed_log1p", "numeric_embedding", "quantile_buckets"]
    models = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        models.append(RankingModel(cfg, 4, 3, 4, kinds, buckets=4))
    a, b = models
    before = {n: t.clone() for n, t in a.named_buffers()}
    assert before, "the test needs a model with buffers"
    assert {n: t for n, t in b.named_buffers()}.keys() == before.keys()
    assert all(torch.equal(t, before[n]) for n, t in b.named_buffers()), "a buffer depends on the seed"
    opt = torch.optim.Adam(a.parameters(), lr=0.1)
    for _ in range(3):
        dense = torch.cat((torch.randn(6, 3), torch.randint(0, 4, (6, 1)).float()), dim=1)  # a bucket's index last
        loss = a(dense, torch.randn(6, 3, 4)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(torch.equal(t, before[n]) for n, t in a.named_buffers()), "training changed a buffer"
    assert not set(before) & set(a.state_dict()), "a buffer is saved with the weights"
