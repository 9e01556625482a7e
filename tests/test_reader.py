"""The Parquet reader: exactly-once sharding, batch content, determinism, epochs, describe()."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import sys
import threading

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch

from recsys.features import hashing
from recsys.io.config import ReaderConfig
from recsys.io.decode import UnitConverter
from recsys.io.reader import ParquetReader, ReadError, describe
from recsys.features.schema import FeatureSpec, Schema, TableSpec
from reader_data import (
    batch_rows,
    expected_dense,
    expected_keys,
    ids_of,
    kjt_rows,
    make_schema,
    write_dataset,
)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("reader") / "data")


def read_all_ranks(data, world_size, **cfg):
    """Return {rank: batches} of one epoch, each rank read by its own reader."""
    out = {}
    for rank in range(world_size):
        with ParquetReader(data.config(**cfg), make_schema(), rank=rank, world_size=world_size) as r:
            out[rank] = list(r)
            assert r.epoch == 1
    return out


def data_cfg(path, **kw):
    kw.setdefault("batch_size", 16)
    return ReaderConfig(paths=[str(path)], **kw)


def assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x.dense, y.dense)
        assert torch.equal(x.labels, y.labels)
        assert torch.equal(x.sparse.values(), y.sparse.values())
        assert torch.equal(x.sparse.lengths(), y.sparse.lengths())
        assert x.extra.keys() == y.extra.keys()
        for k in x.extra:
            assert torch.equal(x.extra[k], y.extra[k])


def check_rows(batches, data, schema):
    """Every row's dense, label and KJT bags equal what its raw values give."""
    for b in batches:
        assert b.sparse.keys() == schema.feature_names
        assert b.sparse.stride() == b.size
        assert b.dense.dtype == torch.float32 and b.dense.shape == (b.size, len(schema.dense))
        assert b.labels.dtype == torch.float32 and b.extra["row_id"].dtype == torch.int64
        assert b.sparse.values().dtype == torch.int64 and b.sparse.lengths().dtype == torch.int32
        for rid, bags, dense, label in zip(batch_rows(b), kjt_rows(b), b.dense.tolist(), b.labels.tolist()):
            row = data.rows[rid]
            assert bags == expected_keys(row, schema), f"row {rid}"
            np.testing.assert_allclose(dense, expected_dense(row, schema), rtol=1e-5, atol=1e-6)
            assert label == row["label"]


@pytest.mark.multiproc
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_row_once_across_2_ranks_x_2_workers(data, shuffle):
    per_rank = read_all_ranks(data, 2, num_workers=2, shuffle=shuffle)
    ids = ids_of(per_rank[0]) + ids_of(per_rank[1])
    assert sorted(ids) == data.row_ids
    assert len(per_rank[0]) > 1 and len(per_rank[1]) > 1
    if not shuffle:  # a slot reads its units in order, each unit's rows in order
        for batches in per_rank.values():
            for b in batches:
                assert batch_rows(b) == sorted(batch_rows(b))
    check_rows(per_rank[0] + per_rank[1], data, make_schema())  # shuffled rows stay whole


@pytest.mark.multiproc
@pytest.mark.timeout(180)  # without the freeze a worker hangs (or crashes) in the destructor
def test_forked_workers_never_free_what_they_inherit(data, tmp_path, monkeypatch):
    """Garbage of the reading process (a cycle owning a gloo ProcessGroup, as a torchrec
    model's optimizer can leave) is not freed by a forked worker's garbage collector: its
    destructor joins threads the child does not have (a segmentation fault)."""
    import gc
    from datetime import timedelta

    import torch.distributed as dist

    from recsys.io import reader_workers as reader_module

    class Cycle:
        def __init__(self, marker):
            self.me, self.marker = self, marker
            self.group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=30))

        def __del__(self):  # where it is freed: the reading process, never a worker
            with open(self.marker, "a") as fh:
                fh.write(f"{os.getpid()}\n")

    def collect_then(target, _original=reader_module.background_priority):
        gc.collect()  # in each worker, first thing: a full collection
        _original(target)

    monkeypatch.setattr(reader_module, "background_priority", collect_then)
    marker = tmp_path / "freed"
    gc.collect()
    gc.disable()  # the cycle stays garbage, uncollected, until the workers have started
    try:
        Cycle(marker)
        with ParquetReader(data.config(num_workers=2, start_method="fork"), make_schema()) as r:
            ids = ids_of(list(r))
    finally:
        gc.enable()
    gc.collect()
    assert sorted(ids) == data.row_ids
    assert marker.read_text().split() == [str(os.getpid())]


def test_batch_content_equals_hashing_raw_values(data):
    schema = make_schema()
    with ParquetReader(data.config(shuffle=False), schema) as r:
        batches = list(r)
    assert ids_of(batches) == data.row_ids  # no shuffle: files, row groups and rows in order
    check_rows(batches, data, schema)
    # the cases that matter are present: nulls, empty and null lists, null elements, folding
    rows = [data.rows[i] for i in data.row_ids]
    assert any(r["item_id"] is None for r in rows) and any(r["cat"] is None for r in rows)
    assert any(r["hist"] is None for r in rows) and any(r["hist"] == [] for r in rows)
    assert any(r["hist"] and None in r["hist"] for r in rows)
    assert any(r["tags"] is None for r in rows) and any(r["tags"] == [] for r in rows)
    values = torch.cat([b.sparse["cat"].values() for b in batches])
    assert int(values.min()) >= 0 and int(values.max()) < 97  # fixed-size table folds


def test_shared_table_shares_keys(tmp_path):
    """Two features on one table map the same raw id to the same key."""
    pq.write_table(
        pa.table({"label": [1, 0], "a": [5, 6], "b": pa.array([[6, 5], []], pa.list_(pa.int64()))}),
        tmp_path / "x.parquet",
    )
    schema = Schema(
        label="label",
        sparse=[FeatureSpec(name="a", table="t"), FeatureSpec(name="b", multi_hot=True, table="t")],
        tables={"t": TableSpec(dim=4)},
    )
    with ParquetReader(data_cfg(tmp_path, shuffle=False), schema) as r:
        (b,) = list(r)
    assert b.sparse["a"].values().tolist() == hashing.hash_int64(np.array([5, 6]), "t").tolist()
    assert b.sparse["b"].values().tolist() == hashing.hash_int64(np.array([6, 5]), "t").tolist()
    assert b.dense.shape == (2, 0)


def test_same_config_twice_gives_identical_batches(data):
    cfg = dict(shuffle=True, shuffle_buffer=3, seed=7)
    with ParquetReader(data.config(**cfg), make_schema()) as r1, ParquetReader(data.config(**cfg), make_schema()) as r2:
        a, b = list(r1), list(r2)
    assert_batches_equal(a, b)
    with ParquetReader(data.config(**{**cfg, "seed": 8}), make_schema()) as r3:
        c = list(r3)
    assert ids_of(c) != ids_of(a) and sorted(ids_of(c)) == sorted(ids_of(a))


@pytest.mark.multiproc
def test_workers_and_thread_give_the_same_batches_per_slot(data):
    """A slot's batches do not depend on whether it runs in a thread or a worker process."""
    with ParquetReader(data.config(num_workers=0), make_schema(), rank=1, world_size=2) as r:
        thread = list(r)
    with ParquetReader(data.config(num_workers=1), make_schema(), rank=1, world_size=2) as r:
        worker = list(r)
    assert_batches_equal(thread, worker)


def test_shuffle_mixes_units_and_rows(data):
    with ParquetReader(data.config(shuffle=True, shuffle_buffer=4, batch_size=32), make_schema()) as r:
        batches = list(r)
    first = batch_rows(batches[0])
    assert len({_unit_of(data, i) for i in first}) == 4  # drawn across the 4 open row groups
    assert first != sorted(first)
    assert sorted(ids_of(batches)) == data.row_ids
    with ParquetReader(data.config(shuffle=True, shuffle_buffer=1, batch_size=32), make_schema()) as r:
        first = batch_rows(next(iter(r)))
        r.close()
    assert len({_unit_of(data, i) for i in first}) <= 2 and first != sorted(first)


def _unit_of(data, row_id):
    """Return the row group (as a global index) holding ``row_id`` (ids follow file order)."""
    sizes = [md.row_group(g).num_rows for f in data.files for md in [pq.ParquetFile(f).metadata]
             for g in range(md.num_row_groups)]
    return int(np.searchsorted(np.cumsum(sizes), row_id, side="right"))


def test_epoch_rollover_reshuffles(data):
    with ParquetReader(data.config(shuffle=True), make_schema()) as r:
        assert r.epoch == 0
        e0 = ids_of(list(r))
        assert r.epoch == 1 and r.stats["epochs_completed"] == 1
        e1 = ids_of(list(r))
        assert r.epoch == 2
    assert sorted(e0) == sorted(e1) == data.row_ids
    assert e0 != e1


def test_epoch_rolls_over_when_caller_stops_at_the_last_batch(data):
    with ParquetReader(data.config(shuffle=False, batch_size=1000), make_schema()) as r:
        it = iter(r)
        first = next(it)  # the whole epoch in one batch; the caller never hits StopIteration
        assert first.size == len(data.rows)
        state = r.state_dict()
        it.close()
        assert r.epoch == 0
        again = list(r)  # the epoch is fully read: the next iteration is epoch 1
        assert r.epoch == 2 and ids_of(again) == data.row_ids
    with ParquetReader(data.config(shuffle=False, batch_size=1000), make_schema()) as r2:
        r2.load_state_dict(state)
        assert ids_of(list(r2)) == data.row_ids and r2.epoch == 2


def test_drop_last_drops_each_slots_short_tail(data):
    B = 16
    total = len(data.rows)
    with ParquetReader(data.config(drop_last=True, batch_size=B), make_schema(), rank=0, world_size=2) as r0, \
         ParquetReader(data.config(drop_last=True, batch_size=B), make_schema(), rank=1, world_size=2) as r1:
        b0, b1 = list(r0), list(r1)
        assert all(b.size == B for b in b0 + b1)
        dropped = r0.stats["dropped_rows"] + r1.stats["dropped_rows"]
    ids = ids_of(b0) + ids_of(b1)
    assert len(set(ids)) == len(ids)
    assert len(ids) + dropped == total
    assert 0 < dropped < 2 * B


def test_state_dict_is_json_serializable(data):
    with ParquetReader(data.config(num_workers=0), make_schema()) as r:
        it = iter(r)
        next(it)
        state = r.state_dict()
        it.close()
    text = json.dumps(state)
    assert json.loads(text) == state
    assert state["version"] == 1
    assert sum(state["consumed"].values()) == 16


def test_close_mid_epoch_leaves_no_threads(data):
    before = {t.ident for t in threading.enumerate()}
    r = ParquetReader(data.config(prefetch=1, batch_size=4), make_schema())
    it = iter(r)
    next(it)
    r.close()
    left = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert left == []
    # an abandoned iterator is cleaned up too, and the reader keeps working
    it = iter(r)
    next(it)
    del it
    left = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert left == []
    assert len(ids_of(list(r))) == len(data.rows) - 2 * 4


@pytest.mark.multiproc
def test_close_mid_epoch_leaves_no_worker_processes(data):
    r = ParquetReader(data.config(num_workers=2, prefetch=2, batch_size=4), make_schema())
    it = iter(r)
    next(it)
    assert multiprocessing.active_children()
    r.close()
    assert multiprocessing.active_children() == []


def test_converter_handles_sliced_and_chunked_arrow(tmp_path):
    """ListArray.values ignores slicing; null lists may cover values; columns may be chunked."""
    schema = make_schema()
    # a null list whose offsets still span values (allowed by Arrow)
    offsets = pa.array([0, 2, 4, 5, 5], pa.int32())
    values = pa.array([1, 2, 3, 4, None, 6], pa.int64())
    mask = pa.array([False, True, False, False])
    hist = pa.ListArray.from_arrays(offsets, values, mask=mask)
    assert hist.null_count == 1 and len(hist.values) == 6
    tags = pa.array([["a"], ["b", None], None, []], pa.list_(pa.string()))
    base = pa.table({
        "label": pa.array([0, 1, 0, 1], pa.int8()),
        "d1": pa.array([1.0, None, -2.0, 3.0], pa.float32()),
        "d2": pa.array([0.5, 1.5, None, 2.5]),
        "d3": pa.array([1, 2, 3, None], pa.int32()),
        "item_id": pa.array([10, None, 12, 13]),
        "cat": pa.array(["x", "y", None, "z"]),
        "hist": hist,
        "tags": tags,
        "row_id": pa.array([0, 1, 2, 3]),
    })
    sliced = base.slice(1, 3)
    chunked = pa.concat_tables([base.slice(0, 1), base.slice(1, 3)])
    assert chunked.column("hist").num_chunks == 2
    conv = UnitConverter(schema, ["row_id"])
    raw = [dict(zip(base.column_names, vals)) for vals in zip(*[c.to_pylist() for c in base.columns])]
    for table, rows in [(base, raw), (sliced, raw[1:]), (chunked, raw)]:
        unit = conv.convert(table, "mem", 0, 0)
        for i, row in enumerate(rows):
            got = {}
            for j, (f, feat, _, _) in enumerate(conv.single):
                got[feat.name] = [int(unit.single_keys[j, i])] if unit.single_len[j, i] else []
            for j, (f, feat, _, _) in enumerate(conv.multi):
                lo, hi = unit.multi_offs[j, i], unit.multi_offs[j, i + 1]
                got[feat.name] = unit.multi_vals[lo:hi].tolist()
            assert got == expected_keys(row, schema), (table is sliced, i)
            np.testing.assert_allclose(unit.dense[:, i], expected_dense(row, schema), rtol=1e-6)
        assert unit.extra["row_id"].tolist() == [r["row_id"] for r in rows]


def test_dictionary_and_unsigned_id_columns(tmp_path):
    cats = pa.array(["p", "q", None, "p"]).dictionary_encode()
    pq.write_table(pa.table({"label": [0, 1, 0, 1], "cat": cats, "n": pa.array([3, 4, 5, 3], pa.uint32())}),
                   tmp_path / "d.parquet")
    schema = Schema(
        label="label",
        sparse=[FeatureSpec(name="cat", kind="string"), FeatureSpec(name="n")],
        tables={"cat": TableSpec(dim=4), "n": TableSpec(dim=4)},
    )
    with ParquetReader(data_cfg(tmp_path, shuffle=False), schema) as r:
        (b,) = list(r)
    assert b.sparse["cat"].lengths().tolist() == [1, 1, 0, 1]
    assert b.sparse["cat"].values().tolist() == hashing.hash_string_reference(["p", "q", "p"], "cat")
    assert b.sparse["n"].values().tolist() == hashing.hash_int64_reference([3, 4, 5, 3], "n")


def test_inputs_files_dirs_globs_and_uris(data, tmp_path):
    schema = make_schema()
    (data.root / "_SUCCESS").write_text("")
    (data.root / ".hidden.parquet").write_text("junk")
    variants = [
        [str(data.root)],
        [str(data.root / "*.parquet")],
        [str(data.root / "**" / "part-0[0-2].parquet")],
        [str(f) for f in reversed(data.files)],
        [f"file://{data.root}"],
        [str(data.files[0]), str(data.root / "part-0*.parquet")],  # overlaps count once
    ]
    for paths in variants:
        with ParquetReader(data.config(paths=paths, shuffle=False), schema) as r:
            assert ids_of(list(r)) == data.row_ids, paths
            assert r.stats["files"] == 3
    # any pyarrow filesystem: paths are then inside it
    sub = pafs.SubTreeFileSystem(str(data.root.parent), pafs.LocalFileSystem())
    for paths in (["data"], ["data/*.parquet"], ["**/part-0?.parquet"]):
        with ParquetReader(data.config(paths=paths, shuffle=False), schema, filesystem=sub) as r:
            assert ids_of(list(r)) == data.row_ids, paths
            assert r.state_dict()["units"][0][0] == "part-00.parquet#0"


def test_describe_reports_rows_row_groups_and_mapping(data, tmp_path):
    text = describe([str(data.root)], make_schema(), passthrough=["row_id"])
    assert f"3 file(s), 9 row group(s), {len(data.rows):,} rows" in text
    assert "part-00.parquet" in text and "row_groups=3" in text
    assert "sparse hist (multi-hot int64, table item)" in text and "'hist'" in text
    assert "list<element: int64>" in text or "list<item: int64>" in text
    assert "MISSING" not in text and "WRONG TYPE" not in text
    bad = make_schema().replace(
        sparse=[
            FeatureSpec(name="item", column="item_id", kind="string", table="item"),
            FeatureSpec(name="ghost", column="no_such", table="item"),
        ],
        tables={"item": TableSpec(dim=4)},
    )
    text = describe([str(data.root)], bad)
    assert "MISSING in 3 file(s)" in text and "'no_such'" in text
    assert "WRONG TYPE: expected a string or binary column" in text
    assert "columns (of part-00.parquet):" in text and "row_id: int64" in text


@pytest.mark.multiproc
def test_forkserver_workers(data):
    """The non-fork start methods pickle the read context into fresh interpreters (slower)."""
    with ParquetReader(data.config(num_workers=2, start_method="forkserver"), make_schema()) as r:
        assert sorted(ids_of(list(r))) == data.row_ids


def test_dense_values_beyond_float32_range(tmp_path):
    """1e300 is finite: signed_log1p brings it into float32 range; without a transform it cannot fit."""
    pq.write_table(pa.table({"label": [0, 1, 1], "x": pa.array([1e300, None, -2.0]), "y": [1.0, 2.0, 3.0]}),
                   tmp_path / "w.parquet")
    schema = Schema(label="label", dense=["x", "y"], dense_transform="signed_log1p")
    with ParquetReader(data_cfg(tmp_path, shuffle=False), schema) as r:
        (b,) = list(r)
    expected = [[math.log1p(1e300), math.log1p(1.0)], [0.0, math.log1p(2.0)], [-math.log1p(2.0), math.log1p(3.0)]]
    np.testing.assert_allclose(b.dense.tolist(), expected, rtol=1e-6)
    with pytest.raises(ReadError, match=r"w\.parquet: row group 0: column 'x': row 0: expected a finite number "
                                        r"or null within float32 range, found 1e\+300"):
        list(ParquetReader(data_cfg(tmp_path, shuffle=False), schema.replace(dense_transform="none")))


@pytest.mark.multiproc
def test_batches_larger_than_a_ring_slot_take_torchs_path(data, monkeypatch):
    """Worker batches go through shared-memory ring slots; ones that do not fit still arrive."""
    import recsys.io.reader_workers as reader_module

    with ParquetReader(data.config(num_workers=0), make_schema(), rank=0, world_size=2) as r:
        thread = list(r)
    nbytes = sorted(b.labels.untyped_storage().nbytes() for b in thread)  # one buffer per batch
    median = nbytes[len(nbytes) // 2]
    assert nbytes[0] < median < nbytes[-1]
    monkeypatch.setattr(reader_module, "_slot_bytes", lambda ctx: median)  # some batches fit, some not
    with ParquetReader(data.config(num_workers=1), make_schema(), rank=0, world_size=2) as r:
        worker = list(r)
    assert_batches_equal(thread, worker)


def _thread_nice(native_id: int) -> int:
    """Return a thread's nice value (field 19 of /proc/self/task/TID/stat)."""
    with open(f"/proc/self/task/{native_id}/stat") as fh:
        stat = fh.read()
    return int(stat[stat.rindex(")") + 2 :].split()[16])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
@pytest.mark.parametrize("nice", [0, 7])
def test_reader_threads_run_at_the_configured_lower_priority(data, nice):
    mine = _thread_nice(threading.get_native_id())
    r = ParquetReader(data.config(prefetch=1, batch_size=4, nice=nice), make_schema())
    it = iter(r)
    next(it)
    readers = [t for t in threading.enumerate() if t.name.startswith("recsys-reader")]
    assert {t.name.split("-")[2].rstrip("_0123456789") for t in readers} >= {"slot", "decode", "convert"}
    assert {_thread_nice(t.native_id) for t in readers} == {min(19, mine + nice)}
    assert _thread_nice(threading.get_native_id()) == mine  # the caller's priority is untouched
    r.close()


def test_nice_out_of_range_is_a_clear_config_error():
    with pytest.raises(ValueError, match=r"nice must be in 0..19, found 20"):
        ReaderConfig(paths=["x"], nice=20)
