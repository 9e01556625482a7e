"""Training with sample weights and weighted sparse features, end to end through the Trainer on
real Parquet: weights all 1 train exactly like no weights; weight-0 rows do not move the model
(all of them: every parameter and embedding row stays at its initial value, one and two
processes; some of them: their labels and dense values change nothing); two ranks equal one
rank with weights; a weighted feature with weights
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
    from recsys.checkpoint import write as ckpt

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
    from recsys.checkpoint import read as checkpoint_files
    from recsys.eval.evaluate import _job_of
    from recsys.store.tables.initial import init_vectors

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


def _scramble_zero_weight_rows(batch, seed: int):
    """Return ``batch`` with the labels of its weight-0 rows flipped and their dense values
    redrawn (ids kept, so the same keys are looked up)."""
    import dataclasses as dc

    zero = torch.from_numpy(batch.weights.numpy() == 0)
    gen = torch.Generator().manual_seed(seed)
    dense = torch.where(zero[:, None], torch.randn(batch.dense.shape, generator=gen) * 5, batch.dense)
    labels = torch.where(zero, 1.0 - batch.labels, batch.labels)
    return dc.replace(batch, dense=dense, labels=labels)


def _weighted_batches(splits) -> tuple:
    from recsys.config import load_job
    from recsys.io.reader import ParquetReader

    job = load_job(JOB, overrides(splits["random"], splits["eval"], STEPS, "schema.weight='w'",
                                  "data.train.shuffle=false"))
    with ParquetReader(job.data.train, job.schema) as reader:
        batches = [b for _, b in zip(range(8), reader)]
    return job, batches


def test_rows_of_weight_zero_do_not_change_training(splits, tmp_path):
    """8 batches with a tenth of their rows weighing 0, against the same batches with those
    rows' labels flipped and dense values redrawn: exactly the same losses and parameters."""
    job, batches = _weighted_batches(splits)
    scrambled = [_scramble_zero_weight_rows(b, i) for i, b in enumerate(batches)]
    assert sum(int((b.weights == 0).sum()) for b in batches) > 100
    assert any(not torch.equal(a.labels, b.labels) for a, b in zip(batches, scrambled))
    train(tmp_path / "a", splits["random"], splits["eval"], job=job, source=ListSource(batches, 0, 1))
    train(tmp_path / "b", splits["random"], splits["eval"], job=job, source=ListSource(scrambled, 0, 1))
    la, lb = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert sorted(la) == list(range(1, 9)) and la == lb
    assert_same(saved(tmp_path / "a"), saved(tmp_path / "b"))
    # the check can fail: where those rows weigh 1, the same scramble changes the run
    def counted(bs):
        return [dataclasses.replace(b, weights=torch.where(b.weights == 0, 1.0, b.weights)) for b in bs]

    train(tmp_path / "c", splits["random"], splits["eval"], job=job, source=ListSource(counted(batches), 0, 1))
    train(tmp_path / "d", splits["random"], splits["eval"], job=job, source=ListSource(counted(scrambled), 0, 1))
    assert losses(tmp_path / "c") != losses(tmp_path / "d")


def _weighted_two_rank_body(rank, world, train_dir, eval_dir, run_dir, batches):
    from recsys.config import load_job

    job = load_job(JOB, overrides(Path(train_dir), Path(eval_dir), STEPS, "schema.weight='w'"))
    return train(Path(run_dir), Path(train_dir), Path(eval_dir), job=job, source=ListSource(batches, rank, world))


@pytest.mark.multiproc
def test_two_ranks_equal_one_rank_with_sample_weights(splits, tmp_path):
    """The staleness-0 invariant holds with weights: each rank's half of a global batch has its
    own weight sum, so the loss must normalize by rows (Σ w·l / B), not by Σ w, for DDP's mean
    of the ranks' losses to be the global batch's."""
    job, batches = _weighted_batches(splits)
    halves = [b.weights[: b.size // 2].sum() / b.weights[b.size // 2 :].sum() for b in batches]
    assert any(abs(float(h) - 1) > 0.02 for h in halves)  # the halves' weight sums differ
    train(tmp_path / "one", splits["random"], splits["eval"], job=job, source=ListSource(batches, 0, 1))
    run_distributed(_weighted_two_rank_body, 2, str(splits["random"]), str(splits["eval"]), str(tmp_path / "two"),
                    batches)
    l1, l2 = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(l1) == sorted(l2) == list(range(1, 9))
    for step in l1:
        assert l2[step] == pytest.approx(l1[step], rel=1e-5)
    assert_same(saved(tmp_path / "one"), saved(tmp_path / "two"), atol=1e-5)


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
