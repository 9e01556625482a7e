"""``model.heads``: the top MLP as K BatchEnsemble heads (recsys/model/heads.py).

One head is the model as it was (its parameters, names and outputs; the golden losses of
tests/test_train.py pin its training); K heads predict the mean of their probabilities,
train on the mean of their losses, differ, and survive a checkpoint, ``recsys eval`` and
``recsys export``."""

from __future__ import annotations

import json
import types

import pytest
import torch
from torchrec.models.dlrm import DenseArch, OverArch
from torchrec.modules.crossnet import LowRankCrossNet

import test_train as tt
from recsys.model.arch import RankingModel
from recsys.model.config import ModelConfig
from recsys.model.heads import mean_probability_logit

N, F, D = 5, 3, 4


def _inputs(rows: int = 9, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, N, generator=g), torch.randn(rows, F, D, generator=g)


@pytest.mark.parametrize("arch", ["dlrm", "dcn"])
def test_one_head_is_the_model_built_the_old_way(arch):
    """heads = 1: torchrec's DenseArch, (the cross net,) OverArch, created in that order from
    the same seed, with the same names: the same parameters and the same logits."""
    cfg = ModelConfig(arch=arch, bottom_mlp=[8, D], top_mlp=[16, 8, 1], dcn_low_rank=4)
    torch.manual_seed(5)
    ours = RankingModel(cfg, N, F, D)
    torch.manual_seed(5)
    dense_arch = DenseArch(N, cfg.bottom_mlp)
    if arch == "dcn":
        cross = LowRankCrossNet((F + 1) * D, num_layers=cfg.dcn_layers, low_rank=cfg.dcn_low_rank)
    over_arch = OverArch((F + 1) * D if arch == "dcn" else D + F * (F + 1) // 2, cfg.top_mlp)
    want = {f"dense_arch.{k}": v for k, v in dense_arch.state_dict().items()}
    if arch == "dcn":
        want.update({f"interaction.crossnet.{k}": v for k, v in cross.state_dict().items()})
    want.update({f"over_arch.{k}": v for k, v in over_arch.state_dict().items()})
    got = ours.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    dense, pooled = _inputs()
    if arch == "dlrm":
        rows, cols = torch.triu_indices(F + 1, F + 1, offset=1)
        vectors = torch.cat((dense_arch(dense).unsqueeze(1), pooled), dim=1)
        inter = torch.cat((dense_arch(dense), torch.bmm(vectors, vectors.transpose(1, 2))[:, rows, cols]), dim=1)
    else:
        inter = cross(torch.cat((dense_arch(dense), pooled.flatten(1)), dim=1))
    torch.testing.assert_close(ours(dense, pooled), over_arch(inter).squeeze(-1), rtol=0, atol=1e-6)
    assert ModelConfig().heads == 1


@pytest.mark.parametrize("arch", ["dlrm", "dcn", "deepfm"])
def test_heads_predict_the_mean_of_their_probabilities(arch):
    cfg = ModelConfig(arch=arch, bottom_mlp=[8, D], top_mlp=[16, 8, 1], dcn_low_rank=4, heads=4, wide=True)
    torch.manual_seed(0)
    model = RankingModel(cfg, N, F, D)
    dense, pooled = _inputs()
    wide = torch.randn(9, F, 1)
    per_head = model(dense, pooled, wide)  # training: each head's logit
    assert per_head.shape == (9, 4)
    model.eval()
    with torch.no_grad():
        predicted = torch.sigmoid(model(dense, pooled, wide))
        heads = torch.sigmoid(model.head_logits(dense, pooled, wide))
    torch.testing.assert_close(heads, torch.sigmoid(per_head.detach()))
    torch.testing.assert_close(predicted, heads.mean(dim=1), rtol=1e-6, atol=1e-7)
    assert heads.std(dim=1).min() > 0  # the heads start apart
    first, *others = model.ensemble.layers  # TabM's start: the first input adapter random signs, the others ones
    assert set(first.r.unique().tolist()) == {-1.0, 1.0} and (first.r[1:] != first.r[0]).any(dim=1).all()
    assert all(torch.equal(p, torch.ones_like(p)) for layer in model.ensemble.layers for p in (layer.s,))
    assert all(torch.equal(layer.r, torch.ones_like(layer.r)) for layer in others)
    far = torch.tensor([[60.0, -60.0], [200.0, 200.0], [-200.0, -90.0]])
    torch.testing.assert_close(mean_probability_logit(far), torch.tensor([0.0, 200.0, -90.0 - torch.log(torch.tensor(2.0))]))


def test_the_loss_is_the_mean_of_the_heads_losses():
    from recsys.train.loop import _loss

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(10, 3, generator=g)
    labels = (torch.rand(10, generator=g) < 0.4).float()
    for weights in (None, torch.rand(10, generator=g)):
        batch = types.SimpleNamespace(labels=labels, weights=weights)
        each = [_loss(logits[:, k], batch) for k in range(3)]
        torch.testing.assert_close(_loss(logits, batch), torch.stack(each).mean())


def test_every_adapter_learns_and_the_heads_stay_apart():
    cfg = ModelConfig(bottom_mlp=[8, D], top_mlp=[16, 8, 1], heads=4)
    torch.manual_seed(0)
    model = RankingModel(cfg, N, F, D)
    dense, pooled = _inputs(256, seed=3)
    labels = (dense[:, 0] + pooled[:, 0, 0] > 0).float()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(30):
        logits = model(dense, pooled)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.unsqueeze(1).expand_as(logits))
        opt.zero_grad()
        loss.backward()
        if step == 0:
            for i, layer in enumerate(model.ensemble.layers):
                for name in ("r", "s", "bias"):
                    grad = getattr(layer, name).grad
                    assert grad.abs().sum(dim=1).min() > 0, f"layer {i}'s {name}: a head got no gradient"
        opt.step()
    for name, value in model.state_dict().items():
        if name.startswith("ensemble."):
            assert not torch.equal(value, start[name]), f"{name} did not move"
    model.eval()
    with torch.no_grad():
        heads = model.head_logits(dense, pooled)
    gaps = (heads.unsqueeze(2) - heads.unsqueeze(1)).abs().amax(dim=0)  # [K, K]: each pair's largest gap
    assert gaps[~torch.eye(4, dtype=torch.bool)].min() > 1e-3


def test_a_bad_heads_is_one_line(tmp_path):
    from recsys.config import ConfigError, load_job
    from recsys.errors import user_message
    from recsys.testing.harness import JOB

    for bad, said in (("0", "heads must be an integer >= 1"), ("-2", "heads must be an integer >= 1"),
                      ("2.5", "model.heads"), ("true", "model.heads")):
        with pytest.raises(ConfigError) as exc:
            load_job(JOB, [f"model.heads={bad}"])
        message = user_message(exc.value)
        assert said in message and "\n" not in message, message
    with pytest.raises(ValueError, match=r"^heads must be an integer >= 1 \(1: one top MLP\), found True$"):
        ModelConfig(heads=True)


def test_a_heads_checkpoint_evaluates_alike_after_reload_and_exports(tiny_data, tmp_path, redis_server):
    """Trained with heads = 4: ``recsys eval`` of the checkpoint gives the trainer's own final
    evaluation (the reloaded model averages its heads as the trainer's did); a job of another
    ``model.heads`` is told which to set; the embeddings export as any checkpoint's do."""
    from embedding_server import export as publish
    from recsys.checkpoint import read as checkpoint_files
    from recsys.cli import main
    from recsys.eval import scoring

    run_dir = tmp_path / "run"
    result = tt.run(tiny_data, run_dir, "train.max_steps=12", "model.heads=4")
    out = tmp_path / "eval.json"
    assert main(["eval", "--checkpoint", str(run_dir), "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in logged if r.get("event") == "eval"][-1]
    assert got["step"] == final["step"] == result["step"] == 12
    for key in ("rows", "log_loss", "auc", "calibration"):
        assert got[key] == pytest.approx(final[key], abs=1e-9), key
    job, _, model, _, _ = scoring.load_trained(run_dir / "checkpoints" / "latest")
    assert job.model.heads == 4 and model.heads == 4 and not model.training
    one = RankingModel(ModelConfig(), len(job.schema.dense), len(job.schema.sparse), 16)
    with pytest.raises(ValueError, match=r"model.heads = 4, the job asks for 1: set model.heads = 4"):
        one.load_state_dict(model.state_dict())
    summary = publish.export(run_dir, redis_server.url, publish.ExportSettings(version="h4"), progress=False)
    rows = checkpoint_files.load_sparse(checkpoint_files.resolve(run_dir))
    assert summary["rows"] == sum(t.num_rows for t in rows.values()) > 0
