"""Training with sample weights and weighted sparse features, end to end through the Trainer on
real Parquet: weights all 1 train exactly like no weights; weight-0 rows do not move the model
(all of them: every parameter and embedding row stays at its initial value, one and two
processes; some of them: the same run as without those rows); a weighted feature with weights
all 1 trains exactly like the same feature unweighted (sum pooling)."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dist_utils import run_distributed
from test_train import ListSource
from weighted_data import JOB, add_weights, ones, overrides, random_weights, train


def zeros(n: int, seed: int) -> np.ndarray:
    return np.zeros(n, dtype=np.float32)


def losses(run_dir: Path) -> dict[int, float]:
    recs = (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss/train"] for r in recs if "loss/train" in r}


def saved(run_dir: Path) -> tuple[dict, dict]:
    """Return ({name: dense tensor}, {table: {key: row}}) of the run's latest checkpoint."""
    from recsys.train import checkpoint as ckpt

    path = ckpt.latest(run_dir / "checkpoints")
    rows = {}
    for name, table in ckpt.load_sparse(path).items():
        emb = table.column("embedding").to_numpy(zero_copy_only=False)
        rows[name] = dict(zip(table.column("key").to_pylist(), (np.asarray(e) for e in emb)))
    return ckpt.load_dense(path)["model"], rows


def assert_same(a: tuple[dict, dict], b: tuple[dict, dict], atol: float = 0.0) -> None:
    dense_a, rows_a = a
    dense_b, rows_b = b
    assert dense_a.keys() == dense_b.keys()
    for k in dense_a:
        torch.testing.assert_close(dense_a[k], dense_b[k], rtol=0, atol=atol, msg=k)
    assert rows_a.keys() == rows_b.keys()
    for t in rows_a:
        assert rows_a[t].keys() == rows_b[t].keys(), t
        for key, row in rows_a[t].items():
            np.testing.assert_allclose(row, rows_b[t][key], rtol=0, atol=atol, err_msg=f"{t} {key}")


@pytest.fixture(scope="module")
def splits(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("weighted_train")
    out = {name: add_weights(tiny_data / "train", root / name, weights=fn)
           for name, fn in (("ones", ones), ("zeros", zeros), ("random", random_weights))}
    out["eval"] = add_weights(tiny_data / "eval", root / "eval", seed=100)  # the trainer's final eval
    return out


STEPS = "train.max_steps=8"


def test_weights_all_one_train_exactly_like_no_weights(splits, tmp_path):
    ev = splits["eval"]
    train(tmp_path / "plain", splits["ones"], ev, STEPS)
    train(tmp_path / "weighted", splits["ones"], ev, STEPS, "schema.weight='w'")
    plain, weighted = losses(tmp_path / "plain"), losses(tmp_path / "weighted")
    assert sorted(plain) == list(range(1, 9)) and plain == weighted
    assert_same(saved(tmp_path / "plain"), saved(tmp_path / "weighted"))


def _initial(run_dir: Path, rows: dict) -> dict:
    """The initial vector of every saved key, as the store draws it (a function of the key)."""
    from recsys import checkpoint_files
    from recsys.eval.evaluate import _job_of
    from recsys.store.init import init_vectors

    job = _job_of(checkpoint_files.resolve(run_dir))  # the job the checkpoint saved
    out = {}
    for table, by_key in rows.items():
        keys = np.array(list(by_key), dtype=np.int64)
        dim = job.schema.tables[table].dim
        vecs = init_vectors(keys, dim, table, job.store.seed, job.store.init_bound(dim))
        out[table] = dict(zip(by_key, vecs))
    return out


def _zero_weight_run(rank, world, train_dir, eval_dir, run_dir):
    """Train on rows that all weigh 0; return the dense parameters before training."""
    from recsys.config import load_job
    from recsys.train.loop import Trainer, setup_env

    job = load_job(JOB, overrides(Path(train_dir), Path(eval_dir), STEPS, "schema.weight='w'"))
    trainer = Trainer(job, Path(run_dir), setup_env("cpu"))
    try:
        before = copy.deepcopy(trainer.model.state_dict())
        trainer.train()
    finally:
        trainer.close()
    return before


def _check_untouched(run_dir: Path, before: dict) -> None:
    assert set(losses(run_dir).values()) == {0.0}
    dense, rows = saved(run_dir)
    assert sum(len(r) for r in rows.values()) > 1000  # the batches' keys were looked up and saved
    assert_same((dense, rows), (before, _initial(run_dir, rows)))


def test_rows_of_weight_zero_leave_every_parameter_at_its_initial_value(splits, tmp_path):
    before = _zero_weight_run(0, 1, splits["zeros"], splits["eval"], tmp_path / "zero")
    _check_untouched(tmp_path / "zero", before)
    # the check can fail: the same job on weights that are not 0 moves the model
    moved = _zero_weight_run(0, 1, splits["random"], splits["eval"], tmp_path / "random")
    dense, rows = saved(tmp_path / "random")
    assert any(not torch.equal(dense[k], moved[k]) for k in dense)
    init = _initial(tmp_path / "random", rows)
    assert any(not np.array_equal(r, init[t][k]) for t in rows for k, r in rows[t].items())


@pytest.mark.multiproc
def test_rows_of_weight_zero_leave_every_parameter_at_its_initial_value_two_processes(splits, tmp_path):
    before = run_distributed(_zero_weight_run, 2, str(splits["zeros"]), str(splits["eval"]),
                             str(tmp_path / "zero2"))
    for k in before[0]:
        assert torch.equal(before[0][k], before[1][k])  # one seed, one initial model on both ranks
    _check_untouched(tmp_path / "zero2", before[0])


# --------------------------------------------------------------------------- some rows of weight 0


def _keep_rows(batch, keep: np.ndarray):
    """Return ``batch`` with only the rows where ``keep`` is true (ids, id weights and all)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recsys.io.batch import Batch

    kjt = batch.sparse
    rows = torch.from_numpy(np.tile(keep, len(kjt.keys())))
    values = torch.from_numpy(np.repeat(rows.numpy(), kjt.lengths().numpy()))
    w = kjt.weights_or_none()
    sparse = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values()[values], lengths=kjt.lengths()[rows],
                               weights=None if w is None else w[values])
    k = torch.from_numpy(keep)
    return Batch(batch.dense[k], batch.labels[k], sparse, {c: v[k] for c, v in batch.extra.items()},
                 batch.weights[k])


def test_rows_of_weight_zero_train_like_rows_left_out(splits, tmp_path):
    """8 batches with a tenth of their rows weighing 0, against the same batches without those
    rows: the same losses and parameters (to float rounding: the sums run over other terms),
    and the keys only those rows hold stay at their initial vectors."""
    from recsys.config import load_job
    from recsys.io.reader import ParquetReader

    job = load_job(JOB, overrides(splits["random"], splits["eval"], STEPS, "schema.weight='w'",
                                  "data.train.shuffle=false"))
    with ParquetReader(job.data.train, job.schema) as reader:
        batches = [b for _, b in zip(range(8), reader)]
    kept = [_keep_rows(b, b.weights.numpy() > 0) for b in batches]
    assert sum(b.size - k.size for b, k in zip(batches, kept)) > 100
    train(tmp_path / "all", splits["random"], splits["eval"], job=job, source=ListSource(batches, 0, 1))
    train(tmp_path / "kept", splits["random"], splits["eval"], job=job, source=ListSource(kept, 0, 1))
    la, lk = losses(tmp_path / "all"), losses(tmp_path / "kept")
    assert sorted(la) == sorted(lk) == list(range(1, 9))
    for step in la:
        assert la[step] == pytest.approx(lk[step], rel=1e-5)
    (dense_a, rows_a), (dense_k, rows_k) = saved(tmp_path / "all"), saved(tmp_path / "kept")
    only_zero = {t: {k: r for k, r in rows_a[t].items() if k not in rows_k[t]} for t in rows_a}
    assert sum(map(len, only_zero.values())) > 50  # keys only weight-0 rows looked up
    assert_same((dense_a, {t: {k: rows_a[t][k] for k in rows_k[t]} for t in rows_k}), (dense_k, rows_k), atol=1e-5)
    assert_same(({}, only_zero), ({}, _initial(tmp_path / "all", only_zero)))


# --------------------------------------------------------------------------- a weighted sparse feature


def _with_id_weights(src: Path, out: Path, value: float = 1.0) -> Path:
    """Copy ``src`` with ``m1_w``: a list of ``value`` parallel to the multi-hot ``m1`` (null where it is)."""
    out.mkdir(parents=True)
    for f in sorted(src.glob("*.parquet")):
        t = pq.read_table(f)
        m1 = t.column("m1").to_pylist()
        w = pa.array([None if v is None else [value] * len(v) for v in m1], pa.list_(pa.float32()))
        pq.write_table(t.append_column("m1_w", w), out / f.name, row_group_size=500)
    return out


def test_weighted_feature_with_weights_one_trains_like_the_unweighted_feature(tiny_data, tmp_path):
    from recsys.config import load_job

    tr = _with_id_weights(tiny_data / "train", tmp_path / "train")
    ev = _with_id_weights(tiny_data / "eval", tmp_path / "eval")
    base = load_job(JOB, overrides(tr, ev, STEPS))

    def job(**m1):
        sparse = [dataclasses.replace(f, pooling="sum", **m1) if f.name == "m1" else f for f in base.schema.sparse]
        return dataclasses.replace(base, schema=base.schema.replace(sparse=sparse))

    weighted = job(weighted=True, weight_column="m1_w")
    assert [f.weighted for f in weighted.schema.sparse if f.name == "m1"] == [True]
    train(tmp_path / "plain", tr, ev, job=job())
    train(tmp_path / "weighted", tr, ev, job=weighted)
    plain, got = losses(tmp_path / "plain"), losses(tmp_path / "weighted")
    assert sorted(plain) == list(range(1, 9)) and plain == got
    assert_same(saved(tmp_path / "plain"), saved(tmp_path / "weighted"))
    # the weights are used: the same feature with weights 2.0 trains otherwise
    tr2 = _with_id_weights(tiny_data / "train", tmp_path / "train2", 2.0)
    train(tmp_path / "twice", tr2, ev, job=dataclasses.replace(weighted, data=dataclasses.replace(
        weighted.data, train=dataclasses.replace(weighted.data.train, paths=[str(tr2)]))))
    assert losses(tmp_path / "twice")[8] != got[8]
