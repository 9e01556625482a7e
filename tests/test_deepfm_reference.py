"""recsys' DeepFM (``model.arch = "deepfm"``, ``deepfm_dense = "raw"``, ``wide = true``)
computes the paper's DeepFM: the reference written from the paper
(``recsys.testing.deepfm_ref.ReferenceDeepFM``) and ours, given the same weights and inputs,
give the same logits and the same gradients."""

from __future__ import annotations

import itertools

import pytest
import torch

from recsys.testing.deepfm_ref import ReferenceDeepFM
from recsys.model.arch import RankingModel
from recsys.model.config import ModelConfig

F, N, D, HIDDEN = 4, 3, 8, [16, 8]


def _pair(dropout: float = 0.0, seed: int = 0):
    """(reference, ours with the reference's weights copied in)."""
    torch.manual_seed(seed)
    ref = ReferenceDeepFM([11, 7, 5, 13], D, N, HIDDEN, init_std=0.3).double()
    with torch.no_grad():  # a bias and first-order weights that are not zero
        ref.bias.fill_(0.25)
        ref.dense_weight.weight.normal_()
    ours = RankingModel(ModelConfig(arch="deepfm", deepfm_dense="raw", wide=True, top_mlp=[*HIDDEN, 1],
                                    dropout=dropout), N, F, D).double()
    hidden = [m for m in ref.hidden if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for layer, src in zip(ours.over_arch.model[0]._mlp, hidden, strict=True):
            layer._linear.weight.copy_(src.weight)
            layer._linear.bias.copy_(src.bias)
        ours.over_arch.model[1].weight.copy_(ref.out.weight)
        ours.over_arch.model[1].bias.copy_(ref.bias)  # the reference's b: the top MLP's last bias
        ours.dense_linear.weight.copy_(ref.dense_weight.weight)
    return ref, ours


def _inputs(seed: int = 1, batch: int = 32):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randint(0, v, (batch,), generator=g) for v in (11, 7, 5, 13)], dim=1)
    dense = torch.randn(batch, N, generator=g, dtype=torch.float64)
    return ids, dense


def _ours_inputs(ref: ReferenceDeepFM, ids: torch.Tensor):
    """What the store gives our model for these ids: the pooled embeddings [B, F, D] and the
    wide arm's pooled weights [B, F, 1] (single-id features: the rows themselves)."""
    pooled = ref.field_vectors(ids).detach().requires_grad_(True)
    wide = torch.stack([ref.weights[f](ids[:, f]) for f in range(F)], dim=1).detach().requires_grad_(True)
    return pooled, wide


def test_forward_equals_the_reference_on_copied_weights():
    ref, ours = _pair()
    assert not hasattr(ours, "dense_arch")  # no bottom MLP in the paper's DeepFM
    ids, dense = _inputs()
    want = ref(ids, dense)
    pooled, wide = _ours_inputs(ref, ids)
    got = ours(dense, pooled, wide)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # and the reference by hand for one row: b + first order + pairwise dots + deep
    e = ref.field_vectors(ids)[0]
    pairs = sum((e[i] * e[j]).sum() for i, j in itertools.combinations(range(F), 2))
    first = sum(ref.weights[f].weight[ids[0, f], 0] for f in range(F)) + ref.dense_weight.weight[0] @ dense[0]
    deep = ref.out(ref.hidden(torch.cat((e.flatten(), dense[0]))))[0]
    torch.testing.assert_close(want[0], ref.bias[0] + first + pairs + deep, rtol=1e-12, atol=1e-12)


def test_gradients_equal_the_references():
    ref, ours = _pair()
    ids, dense = _inputs(seed=2)
    label = (torch.rand(ids.shape[0], generator=torch.Generator().manual_seed(3)) < 0.3).double()
    e = ref.field_vectors(ids)
    e.retain_grad()
    w = torch.stack([ref.weights[f](ids[:, f]) for f in range(F)], dim=1)
    w.retain_grad()
    # the reference's logit from the same leaves e and w, so their gradients are comparable
    total = e.sum(1)
    fm = 0.5 * (total * total - (e * e).sum(1)).sum(1)
    logit_ref = ref.bias + w.sum((1, 2)) + ref.dense_weight(dense).squeeze(1) + fm + \
        ref.out(ref.hidden(torch.cat((e.flatten(1), dense), 1))).squeeze(1)
    torch.testing.assert_close(logit_ref, ref(ids, dense), rtol=1e-12, atol=1e-12)
    torch.nn.functional.binary_cross_entropy_with_logits(logit_ref, label).backward()
    pooled, wide = _ours_inputs(ref, ids)
    torch.nn.functional.binary_cross_entropy_with_logits(ours(dense, pooled, wide), label).backward()
    torch.testing.assert_close(pooled.grad, e.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(wide.grad, w.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours.dense_linear.weight.grad, ref.dense_weight.weight.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours.over_arch.model[1].bias.grad, ref.bias.grad, rtol=1e-10, atol=1e-12)
    first = ours.over_arch.model[0]._mlp[0]._linear.weight.grad
    torch.testing.assert_close(first, ref.hidden[0].weight.grad, rtol=1e-10, atol=1e-12)


def test_the_former_deepfm_differs_from_the_reference():
    """The check can fail: the bottom-MLP DeepFM (``deepfm_dense = "vector"``) is another model."""
    torch.manual_seed(0)
    ours = RankingModel(ModelConfig(arch="deepfm", deepfm_dense="vector", wide=True, bottom_mlp=[16, D],
                                    top_mlp=[*HIDDEN, 1]), N, F, D).double()
    ref, _ = _pair()
    ids, dense = _inputs()
    pooled, wide = _ours_inputs(ref, ids)
    assert hasattr(ours, "dense_arch")
    assert not torch.allclose(ours(dense, pooled, wide), ref(ids, dense), atol=1e-3)


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_dropout_acts_in_training_only(dropout):
    ref, ours = _pair(dropout=dropout)
    ids, dense = _inputs()
    pooled, wide = _ours_inputs(ref, ids)
    ours.eval()
    torch.testing.assert_close(ours(dense, pooled, wide), ref(ids, dense), rtol=1e-12, atol=1e-12)
    ours.train()
    torch.manual_seed(5)
    trained = ours(dense, pooled, wide)
    if dropout:
        assert not torch.allclose(trained, ref(ids, dense), atol=1e-6)
    else:
        torch.testing.assert_close(trained, ref(ids, dense), rtol=1e-12, atol=1e-12)


def test_a_deepfm_checkpoint_of_the_former_form_still_loads(tiny_data, tmp_path):
    """A checkpoint saved before ``deepfm_dense`` existed (no such key in its config) is the
    bottom-MLP form: ``recsys eval`` loads it as ``vector``; a resume with the new default
    names the setting instead of failing on parameter names."""
    import json
    import re

    import test_train as tt
    from recsys.checkpoint.read import MARKER
    from recsys.eval.scoring import evaluate_checkpoint

    result = tt.run(tiny_data, tmp_path / "run", "train.max_steps=2", "model.arch='deepfm'",
                    "model.deepfm_dense='vector'")
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000002"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert 'deepfm_dense = "vector"' in meta["config"]
    meta["config"] = re.sub(r'\ndeepfm_dense = "vector"', "", meta["config"])  # as the former recsys saved it
    (ckpt / "meta.json").write_text(json.dumps(meta))
    marker = json.loads((ckpt / MARKER).read_text())
    marker["files"]["meta.json"] = (ckpt / "meta.json").stat().st_size
    (ckpt / MARKER).write_text(json.dumps(marker))
    assert evaluate_checkpoint(ckpt)["auc"] == pytest.approx(result["auc"], abs=1e-12)
    from recsys.checkpoint import read as checkpoint_files
    from recsys.config import load_job
    from recsys.model.arch import model_for

    state = checkpoint_files.load_dense(ckpt)["model"]
    job = load_job(tt.JOB, tt.overrides(tiny_data, "model.arch='deepfm'"))  # a resume's model, the new default
    with pytest.raises(ValueError, match=r'holds a DeepFM with model.deepfm_dense = "vector".*set '
                                         r'model.deepfm_dense = "vector" to load it'):
        model_for(job).load_state_dict(state)


def test_reference_overrides_train_the_job_with_the_reference_settings():
    """``compare``'s matched arm: every table, the deep tower, the batch and both optimizers
    of a set's job take the reference's settings (the job's own are other values)."""
    from pathlib import Path

    from recsys.config import load_job
    from recsys.testing.deepfm_ref import Settings, reference_overrides

    job_path = Path(__file__).resolve().parents[1] / "jobs" / "quality_randhie.toml"
    own = load_job(job_path)
    settings = Settings(dim=12, hidden=(48, 24), lr=3e-3, batch_size=384, l2=2e-5, init_std=0.01, dropout=0.1)
    job = load_job(job_path, list(reference_overrides(job_path, settings)))
    assert own.schema.tables and all(t.dim != 12 for t in own.schema.tables.values())
    assert {name: t.dim for name, t in job.schema.tables.items()} == {name: 12 for name in own.schema.tables}
    assert (job.model.arch, job.model.deepfm_dense, job.model.top_mlp, job.model.dropout, job.model.wide) == \
        ("deepfm", "raw", [48, 24, 1], 0.1, True)
    assert job.data.train.batch_size == 384 and job.schema.dense_transform == "standardize"
    assert (job.store.optimizer, job.store.lr, job.store.weight_decay) == ("adam", 3e-3, 4e-5)
    assert job.store.init_scale == pytest.approx(0.01 * 3 ** 0.5)
    assert (job.model.wide_lr, job.model.wide_weight_decay) == (3e-3, 4e-5)
    assert (job.train.optim.name, job.train.optim.lr, job.train.optim.weight_decay) == ("adam", 3e-3, 0.0)
    assert (job.train.schedule.warmup_steps, job.train.schedule.decay) == (0, "none")
