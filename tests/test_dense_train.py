"""Dense transforms end to end: the statistics a run computes, saved in the run directory and
its checkpoints; training, ``recsys eval`` and the served path transform identically; a
checkpoint restores and evaluates identically at another world size."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pyarrow.parquet as pq
import pytest

import test_train as tt
from dist_utils import run_distributed
from serving_data import LiveServer

TRANSFORMS = ("schema.dense_transform={i1='quantile_buckets', i3='numeric_embedding', i2='standardize', "
              "i4='none', i5='periodic', '*'='signed_log1p'}", "schema.dense_buckets=8", "schema.dense_standardize_log=true")


def _stats_of(path: Path) -> dict:
    from recsys.checkpoint import write as ckpt

    return ckpt.load_meta(ckpt.resolve(path))["dense_stats"]


def _reader_dense(job, stats, paths) -> np.ndarray:
    from recsys.io.reader import ParquetReader

    cfg = dataclasses.replace(job.data.eval, paths=list(paths), shuffle=False, batch_size=4096, passthrough=[])
    with ParquetReader(cfg, job.schema, dense_stats=stats) as reader:
        return np.concatenate([b.dense.numpy() for b in reader])


@pytest.fixture(scope="module")
def transform_run(tiny_data, tmp_path_factory):
    """(run directory, final result) of a 6-step run with every kind of transform."""
    run_dir = tmp_path_factory.mktemp("transforms") / "run"
    return run_dir, tt.run(tiny_data, run_dir, "train.max_steps=6", *TRANSFORMS)


def _dense_body(table, columns) -> dict:
    return {"values": {c: table.column(c).to_pylist() for c in columns}}


def test_training_eval_and_serving_transform_identically(tiny_data, transform_run):
    from embedding_server.app import create_app
    from embedding_server.settings import ServeSettings
    from recsys.features.dense import DenseStats
    from recsys.eval.scoring import dense_stats_of, evaluate_checkpoint, load_trained

    run_dir, result = transform_run
    saved = json.loads((run_dir / "dense_stats.json").read_text())
    assert _stats_of(run_dir) == saved
    stats = DenseStats.from_json(saved)
    assert stats.rows == 6000 and set(stats.columns) == {f"i{j}" for j in range(1, 14)}
    assert stats.columns["i1"].nulls > 0  # the synthetic set has null dense cells: the null bucket is used

    job, store, _model, path, meta = load_trained(run_dir)
    store.close()
    eval_stats = dense_stats_of(job, meta, path)
    assert eval_stats.to_json() == stats.to_json()
    files = sorted(str(p) for p in (tiny_data / "eval").glob("*.parquet"))
    train_side = _reader_dense(job, stats, files)
    eval_side = _reader_dense(job, eval_stats, files)
    np.testing.assert_array_equal(train_side, eval_side)
    j1, j2 = job.schema.dense.index("i1"), job.schema.dense.index("i3")
    assert set(np.unique(train_side[:, j1])) <= set(range(9)) and (train_side[:, j1] == 8).any()  # 8: the null bucket
    assert (train_side[:, j2] == -1).any() and train_side[:, j2].max() <= 8
    j5 = job.schema.dense.index("i5")  # periodic: standardized (after the log), no NaN for nulls
    assert np.isfinite(train_side[:, j5]).all() and abs(train_side[:, j5].mean()) < 0.5

    rows = 200
    table = pq.read_table(files[0]).slice(0, rows)
    body = _dense_body(table, job.schema.dense)
    with LiveServer(create_app(ServeSettings(checkpoint=str(run_dir)))) as server:
        r = httpx.post(f"{server.url}/v1/dense", json=body, timeout=30)
        assert r.status_code == 200, r.text
        served = np.asarray(r.json()["dense"], dtype=np.float32)
        np.testing.assert_array_equal(served, train_side[:rows])
        bad = httpx.post(f"{server.url}/v1/dense", json={"values": {"i1": [1.0]}}, timeout=30)
        assert bad.status_code == 422 and "expected exactly the dense columns" in bad.text

    again = evaluate_checkpoint(run_dir)
    assert again["auc"] == pytest.approx(result["auc"], abs=1e-12)
    assert again["log_loss"] == pytest.approx(result["log_loss"], rel=1e-6)


@pytest.mark.redis
def test_a_published_version_transforms_as_the_checkpoint(tiny_data, transform_run, redis_server):
    from embedding_server import export as publish
    from embedding_server.app import create_app
    from embedding_server.settings import ServeSettings
    from recsys.eval.scoring import dense_stats_of, load_trained

    run_dir, _ = transform_run
    job, store, _model, path, meta = load_trained(run_dir)
    store.close()
    files = sorted(str(p) for p in (tiny_data / "eval").glob("*.parquet"))
    want = _reader_dense(job, dense_stats_of(job, meta, path), files[:1])[:100]
    publish.export(run_dir / "checkpoints" / "latest", redis_server.url, progress=False)
    with LiveServer(create_app(ServeSettings(redis=redis_server.url))) as server:
        r = httpx.post(f"{server.url}/v1/dense", json=_dense_body(pq.read_table(files[0]).slice(0, 100),
                                                                job.schema.dense), timeout=30)
        assert r.status_code == 200, r.text
        np.testing.assert_array_equal(np.asarray(r.json()["dense"], dtype=np.float32), want)


WIDE = ("model.wide=true",)


def _two_ranks(rank, world, data, run_dir, *extra):
    return tt.run(data, Path(run_dir), "train.max_steps=5", *TRANSFORMS, *extra)


def test_checkpoint_with_stats_restores_and_evaluates_identically_at_another_world_size(tiny_data, tmp_path):
    """Trained at 2 ranks (with the wide arm: its tables are in the checkpoint too), evaluated
    in 1 process: the figures of the 2-rank trainer's own final evaluation of that checkpoint;
    resumed in 1 process with the saved statistics."""
    from recsys.eval.evaluate import EvalOptions, run_eval
    from recsys.io import dense_stats
    from recsys.config import load_job

    trained = run_distributed(_two_ranks, 2, tiny_data, str(tmp_path / "two"), *WIDE)[0]
    saved = _stats_of(tmp_path / "two")
    job = load_job(tt.JOB, tt.overrides(tiny_data, *TRANSFORMS))
    assert dense_stats.compute(job.data.train, job.schema).to_json() == saved  # 2 ranks' stats == 1 pass
    one = run_eval(tmp_path / "two", EvalOptions(nproc=1))
    assert trained["step"] == 5 and one["rows"] == 2000
    assert one["auc"] == pytest.approx(trained["auc"], abs=1e-12)
    assert one["log_loss"] == pytest.approx(trained["log_loss"], rel=1e-6)
    trainer = tt.build(tiny_data, tmp_path / "one", "train.max_steps=7", *TRANSFORMS, *WIDE,
                       resume=str(tmp_path / "two" / "checkpoints" / "latest"))
    try:
        assert trainer.step == 5 and trainer.dense_stats.to_json() == saved
        assert not (tmp_path / "one" / "dense_stats.json").exists()  # restored, not recomputed
        trainer.train()
    finally:
        trainer.close()
    assert _stats_of(tmp_path / "one") == saved


def test_checkpoint_without_the_stats_its_transforms_need_is_refused(tiny_data, tmp_path):
    from recsys.checkpoint.read import MARKER
    from recsys.errors import UserError
    from recsys.eval.scoring import evaluate_checkpoint

    tt.run(tiny_data, tmp_path / "run", "train.max_steps=2", *TRANSFORMS)
    src = tmp_path / "run" / "checkpoints" / "step-00000002"
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    meta = json.loads((bad / "meta.json").read_text())
    del meta["dense_stats"]
    (bad / "meta.json").write_text(json.dumps(meta))
    marker = json.loads((bad / MARKER).read_text())
    marker["files"]["meta.json"] = (bad / "meta.json").stat().st_size
    (bad / MARKER).write_text(json.dumps(marker))
    with pytest.raises(UserError, match=r"need the training data's dense statistics, but the checkpoint has none"):
        evaluate_checkpoint(bad)
    from embedding_server.backends import EmbeddedBackend

    with pytest.raises(ValueError, match=r"'quantile_buckets' for column 'i1' needs dense statistics"):
        EmbeddedBackend(bad)


@pytest.mark.slow
def test_a_checkpoint_with_stats_evaluates_identically_in_one_and_two_processes(tiny_data, tmp_path):
    """``recsys eval --nproc 2`` of a 2-rank checkpoint with stats gives ``--nproc 1``'s figures
    (the fast test above compares one process with the 2-rank trainer's own evaluation)."""
    from recsys.eval.evaluate import EvalOptions, run_eval

    run_distributed(_two_ranks, 2, tiny_data, str(tmp_path / "two"))
    one = run_eval(tmp_path / "two", EvalOptions(nproc=1))
    two = run_eval(tmp_path / "two", EvalOptions(nproc=2))
    assert one["rows"] == two["rows"] == 2000
    assert one["auc"] == two["auc"] and one["log_loss"] == pytest.approx(two["log_loss"], rel=1e-9)
