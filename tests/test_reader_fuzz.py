"""Fuzz: random schemas, column types, values, row group layouts and corrupted bytes through the
reader. An independent model of the rules in docs/data.md predicts each outcome: the rows and
their exact content, a ReadError naming the file (and, for a value, the row group, column and
row), or a skip with its counters. Nothing else may happen: any other exception fails.

The fast variant is derandomized (the same examples every run); the ``slow`` one draws many
more, at random (hypothesis prints the example to reproduce a failure).
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recsys.features import hashing
from recsys.io.config import ReaderConfig
from recsys.io.reader import ParquetReader, ReadError
from recsys.features.schema import FeatureSpec, Schema, TableSpec
from reader_data import kjt_rows

INT64_MAX = 2**63 - 1
F32_MAX = float(np.finfo(np.float32).max)
BAD_UTF8 = b"\xc3("  # a lead byte without its continuation

# --------------------------------------------------------------------------- column kinds
#
# A column kind: (Arrow type, is it what the role accepts, strategy of one cell). Cells of
# string columns are bytes (written as they are, UTF-8 or not).

INTS = st.sampled_from([0, 1, -1, 7, 2**31, -(2**63), INT64_MAX, 123456789])  # every int64 is an id
U64 = st.sampled_from([0, 3, INT64_MAX])
U64_BAD = st.sampled_from([2**63, 2**64 - 1])
TEXT = st.sampled_from([b"", b"a", "é".encode(), b"id-42", "日本".encode()])
TEXT_BAD = st.sampled_from([BAD_UTF8, b"\xff", b"caf\xe9"])
BYTES = st.one_of(TEXT, TEXT_BAD)  # a binary column takes any bytes
FLOATS = st.sampled_from([0.0, -0.0, 1.5, -2.25, 1e10, 3e38, -1e-300])
FLOATS_BAD = st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e300, -1e300])  # 1e300: fine under log1p


def lists(cell, n=4):
    return st.lists(st.one_of(st.none(), cell, cell, cell), max_size=n)


# kind name -> (Arrow type, good cell, bad cell or None)
LABEL_CELLS = {
    "int8": (pa.int8(), st.sampled_from([0, 1]), st.sampled_from([2, -1])),
    "int64": (pa.int64(), st.sampled_from([0, 1]), st.just(5)),
    "bool": (pa.bool_(), st.booleans(), None),
    "float32": (pa.float32(), st.sampled_from([0.0, 1.0]), st.sampled_from([0.25, 0.5, 1.5, float("nan")])),
    "float64": (pa.float64(), st.sampled_from([0.0, 1.0]), st.sampled_from([0.75, -0.5, float("inf")])),
    "string": (pa.string(), st.sampled_from([b"0", b"1"]), None),
}
DENSE_CELLS = {
    "int32": (pa.int32(), st.sampled_from([0, -5, 2**31 - 1]), None),
    "int64": (pa.int64(), INTS, None),
    "bool": (pa.bool_(), st.booleans(), None),
    "float32": (pa.float32(), st.sampled_from([0.5, -3.0, 3e38]), st.sampled_from([float("nan"), float("inf")])),
    "float64": (pa.float64(), FLOATS, FLOATS_BAD),
    "null": (pa.null(), st.none(), None),
    "string": (pa.string(), TEXT, None),
    "list": (pa.list_(pa.float64()), st.lists(st.just(1.0), max_size=2), None),
}
SPARSE_CELLS = {  # (kind, multi_hot) -> {name: (type, good cell, bad cell)}
    ("int64", False): {
        "int64": (pa.int64(), INTS, None),
        "int32": (pa.int32(), st.sampled_from([0, -1, 2**31 - 1]), None),
        "uint64": (pa.uint64(), U64, U64_BAD),
        "null": (pa.null(), st.none(), None),
        "string": (pa.string(), TEXT, None),
        "float64": (pa.float64(), st.just(1.0), None),
        "list": (pa.list_(pa.int64()), st.lists(INTS, max_size=2), None),
    },
    ("string", False): {
        "string": (pa.string(), TEXT, TEXT_BAD),
        "large_string": (pa.large_string(), TEXT, TEXT_BAD),
        "binary": (pa.binary(), BYTES, None),
        "int64": (pa.int64(), INTS, None),
        "list": (pa.list_(pa.string()), st.lists(TEXT, max_size=2), None),
    },
    ("int64", True): {
        "list": (pa.list_(pa.int64()), lists(INTS), None),
        "large_list": (pa.large_list(pa.int64()), lists(INTS), None),
        "list_u64": (pa.list_(pa.uint64()), lists(U64, 3), lists(U64_BAD, 2).filter(lambda v: any(x is not None for x in v))),
        "null": (pa.null(), st.none(), None),
        "int64": (pa.int64(), INTS, None),
        "list_str": (pa.list_(pa.string()), st.lists(TEXT, max_size=2), None),
    },
    ("string", True): {
        "list": (pa.list_(pa.string()), lists(TEXT), st.lists(TEXT_BAD, min_size=1, max_size=2)),
        "list_bin": (pa.list_(pa.binary()), lists(BYTES, 3), None),
        "string": (pa.string(), TEXT, None),
    },
}


def accepted(role: str, name: str, kind=None, multi=False) -> bool:
    """Whether a column of kind ``name`` is of a type the role takes (docs/data.md)."""
    if role == "label":
        return name != "string"
    if role == "dense":
        return name not in ("string", "list")
    if kind == "int64" and not multi:
        return name in ("int64", "int32", "uint64", "null")
    if kind == "string" and not multi:
        return name in ("string", "large_string", "binary")
    if kind == "int64":
        return name in ("list", "large_list", "list_u64", "null")
    return name in ("list", "list_bin")


# --------------------------------------------------------------------------- the data set


@dataclass
class Col:
    name: str
    role: str  # label, dense, sparse, rid
    kind_name: str
    arrow_type: pa.DataType
    feature: FeatureSpec | None = None
    missing_in: set[int] = field(default_factory=set)  # files lacking the column


@dataclass
class Case:
    schema: Schema
    cols: list[Col]
    files: list[list[list[dict]]]  # file -> row group -> rows (column -> cell)
    corrupt: tuple[int, str, int] | None  # (file, how, seed)
    page_checksums: bool
    on_bad_file: str
    shuffle: bool
    batch_size: int
    shuffle_buffer: int


def _kind(draw, table: dict, clean: bool, accepts) -> str:
    names = sorted(table)
    if clean or draw(st.integers(0, 3)) > 0:  # mostly of a type the role takes
        names = [n for n in names if accepts(n)]
    return draw(st.sampled_from(names))


@st.composite
def cases(draw) -> Case:
    """A data set: ``clean`` ones have only valid cells and files (their rows must come out
    exactly); the others mix in bad types, values, missing columns and corrupted bytes."""
    clean = draw(st.booleans())
    cols = []
    label_name = _kind(draw, LABEL_CELLS, clean, lambda n: accepted("label", n))
    label_kind = draw(st.sampled_from(["binary", "probability"]))
    cols.append(Col("y", "label", label_name, LABEL_CELLS[label_name][0]))
    for j in range(draw(st.integers(0, 2))):
        name = _kind(draw, DENSE_CELLS, clean, lambda n: accepted("dense", n))
        cols.append(Col(f"d{j}", "dense", name, DENSE_CELLS[name][0]))
    features, tables = [], {}
    for j in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["int64", "string"]))
        multi = draw(st.booleans())
        name = _kind(draw, SPARSE_CELLS[(kind, multi)], clean, lambda n: accepted("sparse", n, kind, multi))
        feat = FeatureSpec(name=f"f{j}", column=f"s{j}", kind=kind, multi_hot=multi, table=f"t{j}")
        features.append(feat)
        tables[f"t{j}"] = TableSpec(dim=4, num_rows=draw(st.sampled_from([None, None, 13])))
        cols.append(Col(f"s{j}", "sparse", name, SPARSE_CELLS[(kind, multi)][name][0], feature=feat))
    cols.append(Col("rid", "rid", "int64", pa.int64()))
    transform = draw(st.sampled_from(["none", "signed_log1p"]))
    schema = Schema(
        label="y", label_kind=label_kind, dense=[c.name for c in cols if c.role == "dense"],
        dense_transform=transform, dense_fill_null=draw(st.sampled_from([0.0, -1.0, 2.5])),
        sparse=features, tables=tables,
    )
    n_files = draw(st.integers(1, 2))
    files, rid = [], 0
    for f in range(n_files):
        groups = []
        for _ in range(draw(st.integers(0 if not clean else 1, 3))):
            rows = []
            for _ in range(draw(st.integers(0, 6))):
                row = {"rid": rid}
                rid += 1
                for c in cols:
                    if c.role != "rid":
                        row[c.name] = draw(_cell(c, label_kind, clean))
                rows.append(row)
            groups.append(rows)
        files.append(groups)
        for c in cols:
            if not clean and c.role != "rid" and draw(st.integers(0, 15)) == 0:
                c.missing_in.add(f)
    corrupt = None
    if not clean and draw(st.integers(0, 3)) == 0:
        corrupt = (draw(st.integers(0, n_files - 1)), draw(st.sampled_from(["truncate", "flip", "zero-tail"])),
                   draw(st.integers(0, 2**16)))
    return Case(
        schema=schema, cols=cols, files=files, corrupt=corrupt, page_checksums=draw(st.booleans()),
        on_bad_file=draw(st.sampled_from(["error", "skip"])), shuffle=draw(st.booleans()),
        batch_size=draw(st.integers(1, 8)), shuffle_buffer=draw(st.integers(1, 3)),
    )


def _cell(c: Col, label_kind: str, clean: bool):
    if c.role == "label":
        _, good, bad = LABEL_CELLS[c.kind_name]
        if label_kind == "probability" and c.kind_name.startswith("float"):
            good = st.one_of(good, st.sampled_from([0.25, 0.5]))
            bad = st.sampled_from([1.5, -0.5, float("nan")])
        if clean or bad is None:
            return good
        return st.one_of(good, good, good, good, st.none(), bad)  # a null label is bad
    _, good, bad = (DENSE_CELLS[c.kind_name] if c.role == "dense"
                    else SPARSE_CELLS[(c.feature.kind, c.feature.multi_hot)][c.kind_name])
    cell = st.one_of(st.none(), good, good, good) if c.kind_name != "null" else good
    if clean or bad is None:
        return cell
    return st.one_of(cell, cell, cell, cell, bad)


# --------------------------------------------------------------------------- writing


def _strings(values: list, arrow_type: pa.DataType) -> pa.Array:
    """A string/binary array holding the bytes as they are (Arrow checks no UTF-8 here)."""
    large = pa.types.is_large_string(arrow_type) or pa.types.is_large_binary(arrow_type)
    offsets, data = [0], b""
    for v in values:
        data += v or b""
        offsets.append(len(data))
    valid = np.array([v is not None for v in values], dtype=bool)
    bitmap = pa.py_buffer(np.packbits(valid, bitorder="little").tobytes())
    return pa.Array.from_buffers(arrow_type, len(values), [
        bitmap, pa.py_buffer(np.array(offsets, np.int64 if large else np.int32).tobytes()), pa.py_buffer(data),
    ], null_count=int((~valid).sum()))


def _array(values: list, t: pa.DataType) -> pa.Array:
    if pa.types.is_null(t):
        return pa.nulls(len(values))
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t):
        return _strings(values, t)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        flat = [x for v in values if v is not None for x in v]
        offsets, pos = [0], 0
        for v in values:
            pos += len(v) if v is not None else 0
            offsets.append(pos)
        cls = pa.LargeListArray if pa.types.is_large_list(t) else pa.ListArray
        mask = pa.array([v is None for v in values]) if any(v is None for v in values) else None
        otype = pa.int64() if pa.types.is_large_list(t) else pa.int32()
        return cls.from_arrays(pa.array(offsets, otype), _array(flat, t.value_type), mask=mask)
    return pa.array(values, t)


def write_case(case: Case, root: str) -> list[str]:
    paths = []
    for f, groups in enumerate(case.files):
        cols = [c for c in case.cols if f not in c.missing_in]
        schema = pa.schema([(c.name, c.arrow_type) for c in cols])
        path = os.path.join(root, f"part-{f}.parquet")
        with pq.ParquetWriter(path, schema, write_page_checksum=case.page_checksums,
                              compression="none" if case.page_checksums else "snappy") as w:
            for rows in groups:
                w.write_table(pa.table({c.name: _array([r[c.name] for r in rows], c.arrow_type) for c in cols},
                                       schema=schema))
        paths.append(path)
    if case.corrupt is not None:
        f, how, seed = case.corrupt
        with open(paths[f], "rb") as fh:
            blob = bytearray(fh.read())
        rng = np.random.default_rng(seed)
        if how == "truncate":
            blob = blob[: int(rng.integers(0, len(blob)))]
        elif how == "flip":
            for i in rng.integers(0, len(blob), size=3):
                blob[i] ^= 1 << int(rng.integers(0, 8))
        else:
            cut = int(rng.integers(1, min(64, len(blob))))
            blob[-cut:] = bytes(cut)
        with open(paths[f], "wb") as fh:
            fh.write(bytes(blob))
    return paths


# --------------------------------------------------------------------------- the model


def is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def cell_error(case: Case, c: Col, v) -> bool:
    """Whether one cell is a value the reader must refuse (its column's type being accepted)."""
    s = case.schema
    if c.role == "label":
        if v is None:
            return True
        x = float(v)
        return not (x in (0.0, 1.0) if s.label_kind == "binary" else 0.0 <= x <= 1.0)
    if c.role == "dense":
        if v is None:
            return False
        x = float(v)
        if not math.isfinite(x):
            return True
        if c.kind_name == "float32":
            x = float(np.float32(x))
        return s.dense_transform == "none" and abs(x) > F32_MAX
    if v is None:
        return False
    ids = v if c.feature.multi_hot else [v]
    t = c.arrow_type.value_type if c.feature.multi_hot else c.arrow_type
    for x in ids:
        if x is None:
            continue
        if pa.types.is_uint64(t) and x > INT64_MAX:
            return True
        if is_text(t) and not utf8(x):
            return True
    return False


def first_error(case: Case, rows: list[dict]) -> tuple[str, int] | None:
    """(column, row) of the first value the converter refuses, in its order: label, dense,
    single-hot features, multi-hot features."""
    order = [c for c in case.cols if c.role == "label"] + [c for c in case.cols if c.role == "dense"]
    order += [c for c in case.cols if c.role == "sparse" and not c.feature.multi_hot]
    order += [c for c in case.cols if c.role == "sparse" and c.feature.multi_hot]
    for c in order:
        for i, r in enumerate(rows):
            if cell_error(case, c, r[c.name]):
                return c.name, i
    return None


def file_error(case: Case, f: int) -> str | None:
    """The column a file's footer check names (missing or of a type its role refuses), if any."""
    for c in case.cols:
        if c.role == "rid":
            continue
        if f in c.missing_in:
            return c.name
        multi = c.feature.multi_hot if c.feature else False
        if not accepted(c.role, c.kind_name, c.feature.kind if c.feature else None, multi):
            return c.name
    return None


def expected_row(case: Case, r: dict) -> dict:
    s = case.schema
    out = {"label": float(np.float32(float(r["y"])))}
    dense = []
    for c in case.cols:
        if c.role != "dense":
            continue
        v = r[c.name]
        x = s.dense_fill_null if v is None else float(np.float32(v)) if c.kind_name == "float32" else float(v)
        dense.append(math.copysign(math.log1p(abs(x)), x) if s.dense_transform == "signed_log1p" else x)
    out["dense"] = dense
    bags = {}
    for c in case.cols:
        if c.role != "sparse":
            continue
        feat = c.feature
        v = r[c.name]
        ids = [] if v is None else [x for x in (v if feat.multi_hot else [v]) if x is not None]
        keys = (hashing.hash_int64_reference(ids, feat.table) if feat.kind == "int64"
                else hashing.hash_string_reference(ids, feat.table))
        num_rows = s.tables[feat.table].num_rows
        if num_rows is not None:
            keys = [(k & (2**64 - 1)) % num_rows for k in keys]
        bags[feat.name] = keys
    out["bags"] = bags
    return out


def check_row(case: Case, r: dict, label: float, dense: list[float], bags: dict) -> None:
    want = expected_row(case, r)
    assert label == want["label"], (r, label)
    np.testing.assert_allclose(dense, np.float32(want["dense"]), rtol=2e-6, atol=0, err_msg=str(r))
    assert bags == want["bags"], r


# --------------------------------------------------------------------------- the property


def run_case(case: Case) -> None:
    with tempfile.TemporaryDirectory(prefix="recsys-fuzz-") as root:
        paths = write_case(case, root)
        cfg = ReaderConfig(paths=[root], batch_size=case.batch_size, shuffle=case.shuffle,
                           shuffle_buffer=case.shuffle_buffer, passthrough=["rid"], on_bad_file=case.on_bad_file,
                           seed=3)
        outcome, err, got, stats = None, None, [], None
        try:
            with ParquetReader(cfg, case.schema) as reader:
                for b in reader:
                    for rid, label, dense, bags in zip(b.extra["rid"].tolist(), b.labels.tolist(),
                                                       b.dense.tolist(), kjt_rows(b)):
                        got.append((rid, label, dense, bags))
                stats = dict(reader.stats)
            outcome = "rows"
        except ReadError as exc:
            outcome, err = "error", exc
        # any other exception propagates: the test fails with it
        judge(case, paths, outcome, err, got, stats)


def judge(case: Case, paths, outcome, err, got, stats) -> None:
    skip = case.on_bad_file == "skip"
    if err is not None:
        msg = str(err)
        assert "\n" not in msg and "Traceback" not in msg
        assert err.file is not None and err.expected, msg
    bad_units: dict[tuple[int, int], tuple[str, int]] = {}
    good_rows: dict[int, dict] = {}
    bad_files: dict[int, str] = {}
    units_rows = 0
    for f, groups in enumerate(case.files):
        column = file_error(case, f)
        if column is not None:
            bad_files[f] = column
            continue
        for g, rows in enumerate(groups):
            if not rows:
                continue
            units_rows += 1
            e = first_error(case, rows)
            if e is not None:
                bad_units[(f, g)] = e
            else:
                good_rows.update((r["rid"], r) for r in rows)

    if case.corrupt is not None:  # unpredictable: a clear error naming the file, or rows
        f = case.corrupt[0]
        if outcome == "error":
            assert err.file is not None
            if paths[f] not in str(err):  # the other file (or the data set: no rows left)
                assert f"part-{1 - f}" in err.file or "at least one row" in str(err), str(err)
            return
        intact = {rid: r for rid, r in good_rows.items() if not any(rid == x["rid"] for x in _rows_of(case, f))}
        seen = {}
        for rid, label, dense, bags in got:
            seen.setdefault(rid, []).append((label, dense, bags))
        for rid, r in intact.items():
            assert rid in seen, f"row {rid} of an intact file was lost"
        return

    has_rows = any(rows for f, groups in enumerate(case.files) for rows in groups if f not in bad_files)
    if not skip and bad_files:
        assert outcome == "error", "a file the footer check refuses was read"
        f = min(bad_files)
        assert err.file == paths[f] and err.column == bad_files[f], (str(err), bad_files)
        return
    if not has_rows:
        assert outcome == "error" and "expected at least one row to read" in str(err), (outcome, err)
        return
    if not skip and bad_units:
        assert outcome == "error", f"bad values were read: {bad_units}"
        f = paths.index(err.file)
        column, row = bad_units[(f, err.row_group)]
        assert (err.column, err.row) == (column, row), (str(err), column, row)
        return
    assert outcome == "rows", f"unexpected error: {err}"
    ids = [rid for rid, *_ in got]
    assert sorted(ids) == sorted(good_rows), "every good row exactly once"
    for rid, label, dense, bags in got:
        check_row(case, good_rows[rid], label, dense, bags)
    empty_files = sum(1 for f, groups in enumerate(case.files) if f not in bad_files and not any(groups))
    empty_groups = sum(1 for f, groups in enumerate(case.files) if f not in bad_files and any(groups)
                       for rows in groups if not rows)
    assert stats["skipped_files"] == len(bad_files)
    assert stats["skipped_row_groups"] == len(bad_units)
    assert stats["skipped_rows"] == sum(len(case.files[f][g]) for f, g in bad_units)
    assert (stats["empty_files"], stats["empty_row_groups"]) == (empty_files, empty_groups)
    assert units_rows >= len(bad_units)


def _rows_of(case: Case, f: int) -> list[dict]:
    return [r for rows in case.files[f] for r in rows]


FAST = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SLOW = settings(max_examples=1500, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FAST
@given(case=cases())
def test_reader_fuzz(case):
    run_case(case)


@pytest.mark.slow
@SLOW
@given(case=cases())
def test_reader_fuzz_long(case):
    run_case(case)
