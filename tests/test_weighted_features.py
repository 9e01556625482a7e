"""Weighted sparse features (id-score lists): read as KJT weights, pooled as Σ weight × row,
forward and backward against torch's ``embedding_bag`` with per-sample weights."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys.features import hashing
from recsys.io.config import ReaderConfig
from recsys.io.errors import ReadError
from recsys.io.reader import ParquetReader
from recsys.features.schema import FeatureSpec, Schema, TableSpec
from recsys.store.config import StoreConfig
from recsys.store.sharded.store import ShardedEmbeddingStore

DIM = 8


def _schema(parallel: bool) -> Schema:
    return Schema(
        label="label",
        sparse=[
            FeatureSpec(name="user"),
            FeatureSpec(name="tags", column="tags", kind="string", multi_hot=True, weighted=True,
                        weight_column="tag_w" if parallel else "", table="tags"),
            FeatureSpec(name="hist", multi_hot=True, table="user"),
        ],
        tables={"user": TableSpec(dim=DIM), "tags": TableSpec(dim=DIM)},
    )


def _rows(n: int, rng) -> list[dict]:
    out = []
    for i in range(n):
        k = int(rng.integers(0, 4))
        tags = [f"t{int(rng.integers(0, 9))}" for _ in range(k)]
        w = [round(float(rng.random() * 3), 3) for _ in range(k)]
        if k and i % 7 == 0:
            tags[0] = None  # a null id: dropped with its weight
        out.append({"row_id": i, "label": i % 2, "user": i % 5, "tags": None if i % 11 == 5 else tags,
                    "w": None if i % 11 == 5 else w, "hist": [i, i + 1]})
    return out


def _write(path, rows, parallel: bool):
    cols = {c: [r[c] for r in rows] for c in ("row_id", "label", "user", "hist")}
    if parallel:
        cols["tags"] = pa.array([r["tags"] for r in rows], pa.list_(pa.string()))
        cols["tag_w"] = pa.array([r["w"] for r in rows], pa.list_(pa.float32()))
    else:
        st = pa.struct([("id", pa.string()), ("weight", pa.float32())])
        cols["tags"] = pa.array([None if r["tags"] is None else [{"id": t, "weight": w} for t, w in zip(r["tags"], r["w"])]
                                 for r in rows], pa.list_(st))
    pq.write_table(pa.table(cols), path, row_group_size=40)


@pytest.mark.parametrize("parallel", [False, True], ids=["struct", "parallel-lists"])
def test_reader_gives_each_id_its_weight(tmp_path, parallel):
    rows = _rows(120, np.random.default_rng(1))
    _write(tmp_path / "a.parquet", rows, parallel)
    cfg = ReaderConfig(paths=[str(tmp_path)], batch_size=32, shuffle=True, seed=3, passthrough=["row_id"],
                       num_workers=2 if parallel else 0)
    seen = set()
    with ParquetReader(cfg, _schema(parallel)) as r:
        for b in r:
            per = b.sparse.to_dict()
            tags, hist = per["tags"], per["hist"]
            for j, rid in enumerate(b.extra["row_id"].tolist()):
                row = rows[rid]
                pairs = [(t, w) for t, w in zip(row["tags"] or [], row["w"] or []) if t is not None]
                o = tags.offsets()
                assert tags.values()[o[j]:o[j + 1]].tolist() == hashing.hash_string_reference([t for t, _ in pairs],
                                                                                              "tags")
                assert np.allclose(tags.weights()[o[j]:o[j + 1]].numpy(), [w for _, w in pairs])
                oh = hist.offsets()
                assert hist.weights()[oh[j]:oh[j + 1]].tolist() == [1.0, 1.0]  # unweighted: 1 each
                assert per["user"].weights()[j].item() == 1.0
                seen.add(rid)
    assert seen == set(range(120))


def test_bad_weights_are_read_errors_naming_the_row(tmp_path):
    rows = _rows(60, np.random.default_rng(2))
    rows[45]["tags"], rows[45]["w"] = ["a", "b"], [1.0, None]
    _write(tmp_path / "a.parquet", rows, parallel=False)
    with pytest.raises(ReadError) as err:
        with ParquetReader(ReaderConfig(paths=[str(tmp_path)], shuffle=False), _schema(False)) as r:
            list(r)
    assert (err.value.column, err.value.row_group, err.value.row) == ("tags", 1, 5)
    assert "a finite weight >= 0 for each id of feature 'tags'" in str(err.value)
    rows = _rows(60, np.random.default_rng(2))
    rows[12]["tags"], rows[12]["w"] = ["a", "b"], [1.0]
    (tmp_path / "a.parquet").unlink()
    _write(tmp_path / "b.parquet", rows, parallel=True)
    with pytest.raises(ReadError, match=r"column 'tag_w': row 12: expected a list of weights as long as "
                                        r"column 'tags'.s list, found 1 weights for 2 ids"):
        with ParquetReader(ReaderConfig(paths=[str(tmp_path)], shuffle=False), _schema(True)) as r:
            list(r)


def test_schema_refuses_weighted_without_lists_or_with_mean_pooling(tmp_path):
    with pytest.raises(ValueError, match="must be multi_hot"):
        FeatureSpec(name="x", weighted=True)
    with pytest.raises(ValueError, match="pooling must be 'sum'"):
        FeatureSpec(name="x", multi_hot=True, weighted=True, pooling="mean")
    pq.write_table(pa.table({"label": [0], "user": [1], "tags": [["a"]], "hist": [[1]]}), tmp_path / "a.parquet")
    with pytest.raises(ReadError, match="expected a list<struct<id: string, weight: float>> column"):
        ParquetReader(ReaderConfig(paths=[str(tmp_path)]), _schema(False))


def test_weighted_pooling_forward_and_backward_match_embedding_bag():
    schema = Schema(
        tables={"t": TableSpec(dim=DIM)},
        sparse=[FeatureSpec(name="a", table="t"), FeatureSpec(name="w", table="t", multi_hot=True, weighted=True),
                FeatureSpec(name="m", table="t", multi_hot=True, pooling="mean")],
    )
    rng = np.random.default_rng(0)
    B = 24
    lens = np.concatenate([np.ones(B), rng.integers(0, 5, B), rng.integers(0, 4, B)]).astype(np.int32)
    values = rng.integers(0, 30, int(lens.sum())).astype(np.int64)
    weights = (rng.random(values.size) * 4 - 1).astype(np.float32)  # negative weights pool too
    n_a, n_w = B, int(lens[B:2 * B].sum())
    weights[:n_a] = 1.0
    weights[n_a + n_w:] = 1.0
    kjt = KeyedJaggedTensor(keys=["a", "w", "m"], values=torch.from_numpy(values), lengths=torch.from_numpy(lens),
                            weights=torch.from_numpy(weights))
    store = ShardedEmbeddingStore(schema, StoreConfig(lr=0.1))
    try:
        lookup = store.lookup(kjt, 0)
        rows = lookup.rows_all.detach().clone().requires_grad_(True)
        keys = lookup.parts[0].keys_U
        slot = {int(k): i for i, k in enumerate(keys)}
        idx = torch.tensor([slot[int(v)] for v in values])
        pooled = lookup.pooled(3)
        # torch's reference: embedding_bag per feature, with per-sample weights for "w"
        o = np.concatenate([[0], np.cumsum(lens)])
        ref = []
        for f, mode in ((0, "sum"), (1, "sum"), (2, "mean")):
            lo, hi = o[f * B], o[(f + 1) * B]
            offs = torch.from_numpy(o[f * B:(f + 1) * B + 1] - lo)
            psw = torch.from_numpy(weights[lo:hi]) if f == 1 else None
            ref.append(torch.nn.functional.embedding_bag(idx[lo:hi], rows, offs, mode=mode, per_sample_weights=psw,
                                                         include_last_offset=True))
        ref = torch.stack(ref, dim=1)
        assert torch.allclose(pooled, ref, atol=1e-5)
        upstream = torch.from_numpy(rng.standard_normal(pooled.shape).astype(np.float32))
        (ref * upstream).sum().backward()
        grad = np.zeros_like(lookup.rows_all.detach().numpy())
        lookup.pool_backward(upstream.numpy(), grad)
        assert np.allclose(grad, rows.grad.numpy(), atol=1e-5)
        store.cancel(lookup)
    finally:
        store.close()


def test_unweighted_kjt_in_a_weighted_schema_pools_with_weight_one():
    schema = Schema(tables={"t": TableSpec(dim=DIM)},
                    sparse=[FeatureSpec(name="w", table="t", multi_hot=True, weighted=True)])
    kjt = KeyedJaggedTensor(keys=["w"], values=torch.tensor([3, 4, 3]), lengths=torch.tensor([2, 1], dtype=torch.int32))
    store = ShardedEmbeddingStore(schema, StoreConfig(lr=0.1))
    try:
        lookup = store.lookup(kjt, None, train=False)
        r = dict(zip(lookup.parts[0].keys_U.tolist(), lookup.rows_all.detach()))
        assert torch.allclose(lookup.pooled(1)[0, 0], r[3] + r[4]) and torch.allclose(lookup.pooled(1)[1, 0], r[3])
    finally:
        store.close()
