"""The wide arm in training: 2 ranks equal 1 rank at staleness 0 (slow), an exact resume, and
``recsys eval`` scoring what the trainer scored (the wide tables are in the checkpoint)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import test_train as tt
from dist_utils import run_distributed

WIDE = ("model.wide=true",)


def _two_rank_body(rank, world, data, run_dir, batches):
    return tt.run(data, Path(run_dir), "train.max_steps=8", *WIDE, source=tt.ListSource(batches, rank, world))


@pytest.mark.slow  # 2 spawned ranks; `make test` trains the wide arm at 2 ranks and restores it at 1 in
# test_dense_train.py::test_checkpoint_with_stats_restores_and_evaluates_identically_at_another_world_size
def test_wide_two_ranks_equal_one_rank_at_staleness_zero(tiny_data, tmp_path):
    batches = tt.global_batches(tiny_data)
    tt.run(tiny_data, tmp_path / "one", "train.max_steps=8", *WIDE, source=tt.ListSource(batches, 0, 1))
    run_distributed(_two_rank_body, 2, tiny_data, str(tmp_path / "two"), batches)
    l1, l2 = tt.losses(tmp_path / "one"), tt.losses(tmp_path / "two")
    assert sorted(l1) == sorted(l2) == list(range(1, 9))
    for step in l1:
        assert l2[step] == pytest.approx(l1[step], rel=1e-5)
    rows1, rows2 = tt.final_rows(tmp_path / "one"), tt.final_rows(tmp_path / "two")
    assert {t for t in rows1 if t.endswith(".wide")} == {f"{t}.wide" for t in rows1 if not t.endswith(".wide")}
    tt.assert_rows_close(rows1, rows2)


def test_wide_resume_equals_uninterrupted_run_and_eval_scores_the_same(tiny_data, tmp_path):
    from recsys.eval.scoring import evaluate_checkpoint

    extra = ("train.max_steps=8", "train.checkpoint.every_steps=4", "train.checkpoint.keep_last=5", *WIDE)
    full = tt.run(tiny_data, tmp_path / "full", *extra)
    ckpt4 = tmp_path / "full" / "checkpoints" / "step-00000004"
    tt.run(tiny_data, tmp_path / "resumed", *extra, resume=ckpt4)
    a, b = tt.losses(tmp_path / "full"), tt.losses(tmp_path / "resumed")
    assert sorted(b) == list(range(5, 9)) and {s: a[s] for s in b} == b
    rows = tt.final_rows(tmp_path / "full")
    assert max(abs(r).max() for k, t in rows.items() if k.endswith(".wide") for r in t.values()) > 0
    tt.assert_rows_close(rows, tt.final_rows(tmp_path / "resumed"), rtol=0, atol=0)
    scored = evaluate_checkpoint(tmp_path / "full")
    assert scored["auc"] == pytest.approx(full["auc"], abs=1e-12)
    assert scored["log_loss"] == pytest.approx(full["log_loss"], rel=1e-6)


def _wide_rows(run_dir: Path) -> dict[str, dict[int, tuple[float, float]]]:
    """{wide table: {key: (weight, row-wise Adagrad state)}} of the run's latest checkpoint."""
    from recsys.checkpoint import write as ckpt

    out = {}
    for name, t in ckpt.load_sparse(ckpt.latest(run_dir / "checkpoints")).items():
        if name.endswith(".wide"):
            w = np.stack(t.column("embedding").to_numpy(zero_copy_only=False))[:, 0]
            out[name] = dict(zip(t.column("key").to_pylist(), zip(w, t.column("rowwise_state").to_numpy())))
    return out


def test_wide_optimizer_settings_move_the_wide_weights_only(tiny_data, tmp_path):
    """One step from zero weights: the gradients are the same with and without
    ``model.wide_lr`` / ``wide_initial_accumulator``, so the embeddings are bit-identical and
    each wide weight's step is row-wise Adagrad's with the wide settings, by hand."""
    from recsys.config import load_job

    lr, acc0 = 0.003, 1e-6
    store_lr = load_job(tt.JOB, tt.overrides(tiny_data)).store.lr
    assert store_lr != lr
    tt.run(tiny_data, tmp_path / "base", "train.max_steps=1", *WIDE)
    tt.run(tiny_data, tmp_path / "tuned", "train.max_steps=1", *WIDE, f"model.wide_lr={lr}",
           f"model.wide_initial_accumulator={acc0}")
    a, b = tt.final_rows(tmp_path / "base"), tt.final_rows(tmp_path / "tuned")
    deep = [t for t in a if not t.endswith(".wide")]
    tt.assert_rows_close({t: a[t] for t in deep}, {t: b[t] for t in deep}, rtol=0, atol=0)
    wa, wb = _wide_rows(tmp_path / "base"), _wide_rows(tmp_path / "tuned")
    assert wa.keys() == wb.keys() and all(wa[t].keys() == wb[t].keys() for t in wa)
    eps = 1e-8
    moved = 0
    for t in wa:
        for key, (w0, s0) in wa[t].items():
            w1, s1 = wb[t][key]
            g = -w0 * (np.sqrt(s0) + eps) / store_lr  # the step's gradient, from the default run
            assert s1 == pytest.approx(acc0 + s0, rel=1e-5)
            assert w1 == pytest.approx(-lr * g / (np.sqrt(acc0 + g * g) + eps), rel=1e-4, abs=1e-9)
            moved += w1 != 0
    assert moved > 100


def test_wide_settings_reach_the_wide_store_only_and_are_checked():
    from recsys.model.config import ModelConfig
    from recsys.store.config import StoreConfig
    from recsys.store.tables.wide import wide_store_config

    store = StoreConfig(lr=0.05, weight_decay=0.01, initial_accumulator=0.0)
    same = wide_store_config(store, ModelConfig(wide=True))
    assert (same.lr, same.weight_decay, same.initial_accumulator, same.init_scale) == (0.05, 0.01, 0.0, 0.0)
    own = wide_store_config(store, ModelConfig(wide=True, wide_lr=0.2, wide_weight_decay=0.0,
                                               wide_initial_accumulator=1e-7))
    assert (own.lr, own.weight_decay, own.initial_accumulator) == (0.2, 0.0, 1e-7)
    assert (store.lr, store.weight_decay) == (0.05, 0.01)
    with pytest.raises(ValueError, match=r"wide_lr must be a finite number > 0 .* found 0"):
        ModelConfig(wide=True, wide_lr=0.0)
    with pytest.raises(ValueError, match=r"wide_initial_accumulator must be a finite number >= 0 .* found -1"):
        ModelConfig(wide=True, wide_initial_accumulator=-1.0)
    with pytest.raises(ValueError, match=r"need model.wide = true"):
        ModelConfig(wide_weight_decay=0.1)
