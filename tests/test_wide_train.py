"""The wide arm in training: 2 ranks equal 1 rank at staleness 0, an exact resume, and
``recsys eval`` scoring what the trainer scored (the wide tables are in the checkpoint)."""

from __future__ import annotations

from pathlib import Path

import pytest

import test_train as tt
from dist_utils import run_distributed

WIDE = ("model.wide=true",)


def _two_rank_body(rank, world, data, run_dir, batches):
    return tt.run(data, Path(run_dir), "train.max_steps=8", *WIDE, source=tt.ListSource(batches, rank, world))


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
    from recsys.eval.run import evaluate_checkpoint

    extra = ("train.max_steps=8", "train.checkpoint_every_steps=4", "train.keep_last=5", *WIDE)
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
