"""Per-example weights (``schema.weight``): read and checked, carried in batches, scaling the loss
and the metrics (weighted AUC and log loss against scikit-learn's with sample weights)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from sklearn.metrics import log_loss as sk_log_loss
from sklearn.metrics import roc_auc_score

from recsys.eval.metrics import evaluate_predictions, log_loss, roc_auc
from recsys.io.config import ReaderConfig
from recsys.io.errors import ReadError
from recsys.io.reader import ParquetReader
from recsys.features.schema import FeatureSpec, Schema, TableSpec
from recsys.train.loop import _loss

SCHEMA = Schema(label="label", dense=["x"], dense_transform="signed_log1p",
                sparse=[FeatureSpec(name="item")], tables={"item": TableSpec(dim=4)},
                weight="w")


@pytest.mark.parametrize("seed,tied", [(0, False), (1, True), (2, True)])
def test_weighted_auc_and_log_loss_match_sklearn(seed, tied):
    rng = np.random.default_rng(seed)
    n = 3000
    y = (rng.random(n) < 0.3).astype(np.float64)
    p = rng.random(n) * 0.98 + 0.01
    if tied:
        p = np.clip(np.round(p, 1), 0.05, 0.95)  # many ties: they count one half, weighted
    w = rng.exponential(1.0, n)
    w[rng.random(n) < 0.1] = 0.0  # zero weights drop a row
    assert roc_auc(y, p, sample_weight=w) == pytest.approx(roc_auc_score(y, p, sample_weight=w), abs=1e-12)
    assert log_loss(y, p, sample_weight=w) == pytest.approx(sk_log_loss(y, p, sample_weight=w), rel=1e-12)
    got = evaluate_predictions(y, p, w)
    assert got["auc"] == pytest.approx(roc_auc_score(y, p, sample_weight=w), abs=1e-12)
    assert got["base_ctr"] == pytest.approx((w * y).sum() / w.sum())
    assert got["weight_sum"] == pytest.approx(w.sum())
    # integer weights equal repeating rows
    k = rng.integers(0, 4, n)
    rep = np.repeat(np.arange(n), k)
    assert roc_auc(y, p, sample_weight=k) == pytest.approx(roc_auc(y[rep], p[rep]), abs=1e-12)
    assert evaluate_predictions(y, p, k)["normalized_entropy"] == pytest.approx(
        evaluate_predictions(y[rep], p[rep])["normalized_entropy"], rel=1e-9)


def test_weighted_metrics_refuse_bad_weights():
    y, p = np.array([0.0, 1.0]), np.array([0.2, 0.7])
    with pytest.raises(ValueError, match="finite and >= 0"):
        roc_auc(y, p, sample_weight=[1.0, -1.0])
    with pytest.raises(ValueError, match="differ in length"):
        log_loss(y, p, sample_weight=[1.0])
    with pytest.raises(ValueError, match="both classes with weight > 0"):
        roc_auc(y, p, sample_weight=[1.0, 0.0])


def test_weighted_loss_is_the_mean_of_weighted_row_losses_and_its_gradient():
    from recsys.io.batch import Batch

    logits = torch.tensor([0.3, -1.0, 2.0, 0.1], requires_grad=True)
    labels = torch.tensor([1.0, 0.0, 0.0, 1.0])
    w = torch.tensor([2.0, 0.5, 0.0, 1.0])
    batch = Batch(dense=torch.empty(4, 0), labels=labels, sparse=None, weights=w)
    loss = _loss(logits, batch)
    per_row = torch.nn.functional.binary_cross_entropy_with_logits(logits.detach(), labels, reduction="none")
    assert loss.item() == pytest.approx(float((per_row * w).sum() / 4))  # / rows, not / Σ w (see _loss)
    loss.backward()
    assert logits.grad[2].item() == 0.0  # a weight-0 row does not train
    assert _loss(logits, Batch(dense=torch.empty(4, 0), labels=labels, sparse=None)).item() == pytest.approx(
        float(per_row.mean()))
    zero = Batch(dense=torch.empty(4, 0), labels=labels, sparse=None, weights=torch.zeros(4))
    assert _loss(logits, zero).item() == 0.0


def _write(path, w, **cols):
    n = len(w)
    table = {"row_id": np.arange(n), "label": np.arange(n) % 2, "x": np.linspace(0, 1, n), "item": np.arange(n) % 7,
             "w": w, **cols}
    pq.write_table(pa.table(table), path, row_group_size=16)


def test_reader_carries_weights_with_their_rows_across_shuffles_and_workers(tmp_path):
    n = 100
    w = np.round(np.random.default_rng(0).random(n) * 5, 3).astype(np.float64)
    _write(tmp_path / "a.parquet", w)
    for workers in (0, 2):
        cfg = ReaderConfig(paths=[str(tmp_path)], batch_size=32, shuffle=True, num_workers=workers,
                           passthrough=["row_id"], seed=5)
        with ParquetReader(cfg, SCHEMA) as r:
            got = {}
            for b in r:
                assert b.weights is not None and b.weights.dtype == torch.float32
                got.update(zip(b.extra["row_id"].tolist(), b.weights.tolist()))
        assert got == {i: float(np.float32(w[i])) for i in range(n)}
    no_weight = SCHEMA.replace(weight="")
    with ParquetReader(ReaderConfig(paths=[str(tmp_path)], batch_size=32), no_weight) as r:
        assert all(b.weights is None for b in r)


@pytest.mark.parametrize("bad,found", [(-1.0, "-1.0"), (float("nan"), "nan"), (None, "null")])
def test_bad_weight_is_a_read_error_naming_the_row(tmp_path, bad, found):
    w = pa.array([1.0] * 40 + [bad] + [1.0] * 9, pa.float64())
    _write(tmp_path / "a.parquet", w)
    cfg = ReaderConfig(paths=[str(tmp_path)], batch_size=50, shuffle=False)
    with pytest.raises(ReadError) as err:
        with ParquetReader(cfg, SCHEMA) as r:
            list(r)
    e = err.value
    assert (e.column, e.row_group, e.row) == ("w", 2, 8) and "a finite sample weight >= 0" in str(e)
    assert found in str(e) and "row 40 of the file" in str(e)


def test_weight_column_type_and_role_are_checked(tmp_path):
    _write(tmp_path / "a.parquet", np.ones(20), )
    pq.write_table(pa.table({"label": [0, 1], "x": [0.0, 1.0], "item": [1, 2], "w": ["a", "b"]}),
                   tmp_path / "b.parquet")
    with pytest.raises(ReadError, match="b.parquet: column 'w': expected a numeric .*sample weight"):
        ParquetReader(ReaderConfig(paths=[str(tmp_path)]), SCHEMA)
    with pytest.raises(ValueError, match="weight column 'x' is also the label or a feature"):
        SCHEMA.replace(weight="x")


def test_batch_to_its_own_device_is_itself_and_to_another_moves_the_dense_side_only():
    """``Batch.to`` skips the no-op copies (the trainer calls it every step) and moves a
    batch that is elsewhere: weights and passthrough columns included, while the sparse ids
    (and their id weights) stay on the host, where the store reads them."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recsys.io.batch import Batch

    kjt = KeyedJaggedTensor(keys=["a"], values=torch.tensor([1, 2], dtype=torch.int64),
                            lengths=torch.tensor([1, 1], dtype=torch.int32), weights=torch.ones(2))
    b = Batch(dense=torch.zeros(2, 3), labels=torch.zeros(2), sparse=kjt, extra={"row_id": torch.arange(2)},
              weights=torch.ones(2))
    assert b.to("cpu") is b and b.to(torch.device("cpu")) is b
    m = b.to("meta")
    assert m is not b
    moved = [m.dense, m.labels, m.weights, m.extra["row_id"]]
    assert all(t.device.type == "meta" for t in moved)
    assert m.sparse is kjt and all(t.device.type == "cpu" for t in (kjt.values(), kjt.lengths(), kjt.weights()))
    assert m.to("meta") is m  # already there: the host-side ids do not make it move again
    half = Batch(dense=b.dense, labels=m.labels, sparse=m.sparse)  # the dense part elsewhere: moved
    assert half.to("meta") is not half and half.to("meta").dense.device.type == "meta"
