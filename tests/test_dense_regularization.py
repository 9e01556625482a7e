"""The dense towers' regularization in a real trainer: ``train.optim.weight_decay`` reaches every
dense parameter (the towers, the paper-DeepFM's linear term, the dense columns' embeddings),
and ``model.dropout`` trains and evaluates (dropout off in evaluation)."""

from __future__ import annotations

import pytest

import test_train as tt


@pytest.mark.parametrize("arch", ["dlrm", "deepfm"])
def test_weight_decay_and_dropout_reach_the_dense_towers(tiny_data, tmp_path, arch):
    trainer = tt.build(tiny_data, tmp_path / "run", "train.max_steps=2", f"model.arch='{arch}'",
                       "train.optim.weight_decay=0.001", "model.dropout=0.2",
                       "schema.dense_transform={i1='periodic', i2='quantile_buckets', '*'='signed_log1p'}")
    try:
        optimized = {id(p): g["weight_decay"] for g in trainer.opt.param_groups for p in g["params"]}
        names = [n for n, _ in trainer.model.named_parameters()]
        assert {id(p) for p in trainer.model.parameters()} == set(optimized), names
        assert set(optimized.values()) == {0.001}
        assert any(n.startswith("over_arch.") for n in names)
        assert any(n.startswith("dense_arch." if arch == "dlrm" else "dense_linear.") for n in names)
        assert any(n.startswith("dense_embeddings.periodic") for n in names)
        hooked = [m for m in trainer.model.modules() if m._forward_hooks]
        # the tiny job's towers: top 128-64-1 (2 hidden layers), bottom 64-32-16 (all but the last: 2)
        assert len(hooked) == (4 if arch == "dlrm" else 2)
        result = trainer.train()
    finally:
        trainer.close()
    assert result["step"] == 2 and 0.0 < result["auc"] < 1.0
