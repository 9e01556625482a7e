"""``recsys convert``: Criteo's layout from gzip, CSV with a job's schema, JSON lines, bad rows, --infer."""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys.features import hashing
from recsys.io import synth
from recsys.cli import main
from recsys.config import load_job
from recsys.io.convert import CRITEO_COLUMNS, ConvertError, ConvertOptions, convert
from recsys.features.schema import FeatureSpec, Schema, TableSpec

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def criteo(tmp_path_factory) -> Path:
    """The tiny synthetic set in Criteo's layout: train.txt.gz (6000 rows), eval.txt.gz (2000)."""
    out = tmp_path_factory.mktemp("criteo")
    synth.write_criteo_tsv(out, "tiny", seed=3)
    return out


def _tsv_rows(path: Path) -> list[list[str]]:
    with gzip.open(path, "rt", newline="") as f:
        return [line.rstrip("\n").split("\t") for line in f]


def _read_dir(out: Path) -> pa.Table:
    files = sorted(out.glob("part-*.parquet"))
    return pa.concat_tables(pq.read_table(f) for f in files)


def test_criteo_gzip_to_parquet_keeps_every_value_and_sizes_row_groups(criteo, tmp_path):
    out = tmp_path / "train"
    report = convert([str(criteo / "train.txt.gz")], out,
                     ConvertOptions(fmt="tsv", preset="criteo", row_group_rows=1000, rows_per_file=2500))
    rows = _tsv_rows(criteo / "train.txt.gz")
    assert report["rows"] == len(rows) == 6000 and report["bad_rows"] == 0
    files = sorted(out.glob("part-*.parquet"))
    assert [pq.ParquetFile(f).metadata.num_rows for f in files] == [2500, 2500, 1000]
    assert [pq.ParquetFile(files[0]).metadata.row_group(i).num_rows for i in range(3)] == [1000, 1000, 500]
    assert pq.ParquetFile(files[0]).metadata.row_group(0).column(0).compression == "ZSTD"
    got = _read_dir(out)
    assert got.column_names == CRITEO_COLUMNS
    assert got.schema.field("label").type == pa.int8() and got.schema.field("i1").type == pa.float32()
    assert got.schema.field("c1").type == pa.string()
    # every field against an independent parse of the text
    for j, name in enumerate(CRITEO_COLUMNS):
        col = got.column(name).to_pylist()
        if name == "label":
            want = [int(r[j]) for r in rows]
        elif name.startswith("i"):
            want = [None if r[j] == "" else float(np.float32(r[j])) for r in rows]
        else:
            want = [None if r[j] == "" else r[j] for r in rows]
        assert col == want, name
    assert any(v is None for v in got.column("c22").to_pylist())  # empty fields are nulls
    saved = json.loads((out / "_convert.json").read_text())
    assert saved["rows"] == 6000 and len(saved["files"]) == 3 and not list(out.glob(".convert-*"))


def test_criteo_job_reads_the_converted_files(criteo, tmp_path):
    from recsys.io.reader import ParquetReader

    out = tmp_path / "train"
    convert([str(criteo / "train.txt.gz")], out, ConvertOptions(fmt="tsv", preset="criteo", row_group_rows=2048))
    job = load_job(ROOT / "jobs" / "criteo.toml", [f'data.train.paths=["{out}"]'])
    cfg = job.data.train.__class__(paths=[str(out)], batch_size=6000, shuffle=False)
    with ParquetReader(cfg, job.schema) as reader:
        (batch,) = list(reader)
    rows = _tsv_rows(criteo / "train.txt.gz")
    assert batch.labels.tolist() == [float(r[0]) for r in rows]
    i1 = np.array([0.0 if r[1] == "" else float(r[1]) for r in rows], dtype=np.float32)
    assert np.allclose(batch.dense[:, 0].numpy(), np.sign(i1) * np.log1p(np.abs(i1)), atol=1e-6)
    c3 = [r[16] for r in rows if r[16] != ""]
    assert batch.sparse["c3"].values().tolist() == hashing.hash_string_reference(c3, "c3")


BAD_TSV = (
    "1\t5\t\tab\n"        # line 1: fine (empty dense is a null)
    "0\t7\n"              # line 2: 2 fields, 4 expected
    "1\tx1\t3\tcd\n"      # line 3: non-numeric dense
    "2\t1\t1\tef\n"       # line 4: label 2
    "\n"                  # line 5: an empty line
    "0\t1\t2\tgh\n"       # line 6: fine
    "1\tnan\t2\tij\n"     # line 7: NaN dense
    "0\t3\t4\tkl"         # line 8: fine, no final line end
)
SMALL = Schema(label="label", dense=["a", "b"], sparse=[FeatureSpec(name="c", kind="string")],
               tables={"c": TableSpec(dim=4)})


def _write_small(tmp_path: Path, text: str, name: str = "in.tsv") -> Path:
    path = tmp_path / name
    path.write_text("label\ta\tb\tc\n" + text)
    return path


def test_bad_rows_error_names_file_line_column_and_writes_nothing(tmp_path):
    path = _write_small(tmp_path, BAD_TSV)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConvertError) as err:
        convert([str(path)], out, ConvertOptions(fmt="tsv"), schema=SMALL)
    msg = str(err.value)
    assert f"{path}: line 3: expected 4 fields, found 2 fields" in msg  # the header is line 1
    assert "5 bad rows" in msg and "nothing was written" in msg
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_bad_rows_skip_counts_and_lists_each_with_its_line(tmp_path):
    path = _write_small(tmp_path, BAD_TSV)
    out = tmp_path / "out"
    report = convert([str(path)], out, ConvertOptions(fmt="tsv", bad_rows="skip"), schema=SMALL)
    assert report["rows"] == 3 and report["bad_rows"] == 5
    listed = [(b["line"], b["column"], b["found"]) for b in report["bad_rows_listed"]]
    assert listed == [(3, None, "2 fields"), (4, "a", "'x1'"), (5, "label", "'2'"), (6, None, "an empty line"),
                      (8, "a", "'nan'")]
    got = _read_dir(out)
    assert got.to_pydict() == {"label": [1, 0, 0], "a": [5.0, 1.0, 3.0], "b": [None, 2.0, 4.0],
                               "c": ["ab", "gh", "kl"]}


def test_value_checks_without_a_parse_error_give_exact_lines(tmp_path):
    # Arrow parses every line here; the label and dense checks alone find the bad rows
    path = _write_small(tmp_path, "1\t1\t1\ta\n3\t1\t1\tb\n0\tinf\t1\tc\n0\t2\t2\td\n")
    report = convert([str(path)], tmp_path / "out", ConvertOptions(fmt="tsv", bad_rows="skip"), schema=SMALL)
    assert [(b["line"], b["column"]) for b in report["bad_rows_listed"]] == [(3, "label"), (4, "a")]
    assert _read_dir(tmp_path / "out").column("c").to_pylist() == ["a", "d"]


def test_csv_with_header_quotes_extra_columns_and_a_job_schema(tmp_path):
    path = tmp_path / "in.csv"
    path.write_text('user_id,label,note,price,city\n7,1,"a, quoted",1.5,"Paris"\n-3,0,x,,""\n')
    schema = Schema(label="label", dense=["price"],
                    sparse=[FeatureSpec(name="user", column="user_id"), FeatureSpec(name="city", kind="string")],
                    tables={"user": TableSpec(dim=4), "city": TableSpec(dim=4)})
    convert([str(path)], tmp_path / "out", ConvertOptions(fmt="csv"), schema=schema)
    got = _read_dir(tmp_path / "out")
    assert got.column_names == ["label", "price", "user_id", "city"]  # the job's columns only
    assert got.schema.field("user_id").type == pa.int64()
    assert got.to_pydict() == {"label": [1, 0], "price": [1.5, None], "user_id": [7, -3], "city": ["Paris", ""]}


def test_job_column_missing_from_the_header_is_named(tmp_path):
    path = tmp_path / "in.csv"
    path.write_text("label,x\n1,2\n")
    with pytest.raises(ConvertError, match=r"in.csv: line 1: expected columns \['a', 'b', 'c'\]"):
        convert([str(path)], tmp_path / "out", ConvertOptions(fmt="csv"), schema=SMALL)


def test_jsonl_multi_hot_lists_and_a_bad_line(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"label": 1, "a": 0.5, "tags": ["x", "y"]}\n'
                    '{"label": 0, "a": null, "tags": []}\n'
                    '{"label": 1, "a": "high", "tags": ["z"]}\n'
                    'not json\n'
                    '{"label": 0, "a": 2, "tags": null}\n')
    schema = Schema(label="label", dense=["a"], sparse=[FeatureSpec(name="tags", kind="string", multi_hot=True)],
                    tables={"tags": TableSpec(dim=4)})
    with pytest.raises(ConvertError, match=r"in.jsonl: line 3: column 'a': expected a finite number"):
        convert([str(path)], tmp_path / "err", ConvertOptions(fmt="jsonl"), schema=schema)
    report = convert([str(path)], tmp_path / "out", ConvertOptions(fmt="jsonl", bad_rows="skip"), schema=schema)
    assert [b["line"] for b in report["bad_rows_listed"]] == [3, 4]
    got = _read_dir(tmp_path / "out")
    assert got.to_pydict() == {"label": [1, 0, 0], "a": [0.5, None, 2.0], "tags": [["x", "y"], [], None]}


def test_infer_proposes_a_job_that_inspect_accepts(tmp_path):
    from recsys.io.reader import describe

    rng = np.random.default_rng(0)
    path = tmp_path / "in.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["clicked", "age", "score", "item_id", "country"])
        for i in range(400):
            w.writerow([int(rng.random() < 0.3), int(rng.integers(18, 70)), f"{rng.random():.3f}", 1000 + i,
                        ["fr", "de", "us"][i % 3]])
    out = tmp_path / "out"
    report = convert([str(path)], out, ConvertOptions(fmt="csv"), infer=True)
    job = load_job(report["proposed_job"])
    assert job.schema.label == "clicked"
    assert job.schema.dense == ["age", "score"]
    assert [(f.name, f.kind) for f in job.schema.sparse] == [("item_id", "int64"), ("country", "string")]
    assert job.data.train.paths == [str(out)]
    text = describe(job.data.train.paths, job.schema)
    assert "MISSING" not in text and "WRONG TYPE" not in text


def test_infer_writes_any_column_name_as_toml_data_never_as_toml(tmp_path):
    """A JSON key holding a quote and line ends that would open a table of their own."""
    import tomllib

    label = 'clk"\n[data.eval]\npaths = ["/etc"]\n#'
    item = 'item "id"\n'
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({label: i % 2, "price": i / 4, item: f"i{i}"}) + "\n" for i in range(50)))
    out = tmp_path / "out"
    report = convert([str(path)], out, ConvertOptions(fmt="jsonl"), infer=True)
    proposed = tomllib.loads(Path(report["proposed_job"]).read_text())
    assert proposed["schema"]["label"] == label
    assert "eval" not in proposed["data"]
    assert [(f["column"], f["kind"]) for f in proposed["schema"]["sparse"]] == [(item, "string")]
    job = load_job(report["proposed_job"])
    assert job.schema.label == label and job.schema.dense == ["price"]


def test_a_deeply_nested_json_line_is_a_bad_row(tmp_path):
    """Python's JSON parser recurses: a line nested deeper than its limit is skipped and
    counted under ``skip``, and named under ``error``, never a RecursionError."""
    deep = '{"label": 1, "a": ' + "[" * 100_000 + "]" * 100_000 + "}"
    path = tmp_path / "in.jsonl"
    path.write_text('{"label": 0, "a": 1.5}\n' + deep + '\n{"label": 1, "a": 2.5}\n')
    schema = Schema(label="label", dense=["a"])
    report = convert([str(path)], tmp_path / "out", ConvertOptions(fmt="jsonl", bad_rows="skip"), schema=schema)
    assert report["bad_rows"] == 1 and report["bad_rows_listed"][0]["line"] == 2
    assert "nested too deeply" in report["bad_rows_listed"][0]["found"]
    assert _read_dir(tmp_path / "out").column("a").to_pylist() == [1.5, 2.5]
    with pytest.raises(ConvertError, match=r"in.jsonl: line 2: expected a JSON object, found JSON nested too deeply"):
        convert([str(path)], tmp_path / "err", ConvertOptions(fmt="jsonl"), schema=schema)


def test_output_directory_with_parts_is_refused(criteo, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "part-00000.parquet").write_bytes(b"x")
    with pytest.raises(ConvertError, match="without part-\\*.parquet files"):
        convert([str(criteo / "eval.txt.gz")], out, ConvertOptions(fmt="tsv", preset="criteo"))
    assert (out / "part-00000.parquet").read_bytes() == b"x"


def test_cli_convert_and_one_line_errors(criteo, tmp_path, capsys):
    out = tmp_path / "eval"
    assert main(["convert", "--from", "tsv", "--preset", "criteo", str(criteo / "eval.txt.gz"), "--out", str(out),
                 "--no-progress"]) == 0
    assert "converted 2,000 rows into 1 file(s)" in capsys.readouterr().out
    assert main(["convert", "--from", "csv", "--preset", "criteo", str(criteo / "eval.txt.gz"), "--out",
                 str(tmp_path / "x")]) == 2
    assert "the criteo preset reads tab-separated files" in capsys.readouterr().err
    truncated = tmp_path / "cut.txt.gz"
    truncated.write_bytes((criteo / "eval.txt.gz").read_bytes()[:20_000])
    assert main(["convert", "--from", "tsv", "--preset", "criteo", str(truncated), "--out", str(tmp_path / "y"),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{truncated}: near line" in err and "compressed data" in err
    assert not (tmp_path / "y").exists() or not list((tmp_path / "y").glob("part-*"))


def _clicks_csv(path: Path, rows: int = 60_000) -> None:
    """A CSV shaped like a click log: integer user and item ids (the items about 19 k distinct,
    fewer than half the rows), an integer category, a price, an integer age in days, and tags
    joined by '|' (one to three of twelve, some rows none)."""
    rng = np.random.default_rng(0)
    vocab = [f"t{j}" for j in range(12)]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["clicked", "user", "item", "category", "price", "age_days", "tags"])
        for i in range(rows):
            tags = "" if i % 10 == 0 else "|".join(rng.choice(vocab, size=rng.integers(1, 4), replace=False))
            w.writerow([int(rng.random() < 0.3), int(rng.integers(0, 5000)), int(rng.integers(0, 21_000)),
                        int(rng.integers(0, 40)), f"{rng.random() * 100:.2f}", int(rng.integers(0, 3650)), tags])


def test_infer_on_a_click_log_proposes_ids_lists_and_a_validation_split(tmp_path):
    """`recsys convert --infer` on a 60 k-row CSV: the integer `item` (many distinct values,
    named like ids) and `category` are sparse, each with the reason in a comment; `tags`
    (`a|b`) is split into a list column and proposed as a multi-hot feature; `age_days` and
    `price` stay dense; the proposal has a validation split (a tenth of the row groups, which
    the small input gets enough of) with early stopping, and `recsys train` runs it."""
    import subprocess
    import sys

    from recsys.io.reader import describe

    path = tmp_path / "clicks.csv"
    _clicks_csv(path)
    out = tmp_path / "out"
    assert main(["convert", "--from", "csv", str(path), "--out", str(out), "--infer", "--no-progress"]) == 0
    proposed = out / "_job.toml"
    text = proposed.read_text()
    job = load_job(proposed)
    assert job.schema.label == "clicked" and job.schema.dense == ["price", "age_days"]
    sparse = {f.name: (f.kind, f.multi_hot) for f in job.schema.sparse}
    assert sparse == {"user": ("int64", False), "item": ("int64", False), "category": ("int64", False),
                      "tags": ("string", True)}
    assert "# item: an integer column (no fractional part) named like ids ('item'), 19," in text, text
    assert "split at '|' into a list: a multi-hot feature" in text
    ev = job.train.eval
    assert (ev.validation_fraction, ev.every_epochs, ev.keep_best, ev.early_stopping_patience) == (0.1, 1, "auc", 3)
    assert job.train.epochs == 20
    files = sorted(out.glob("part-*.parquet"))
    assert sum(pq.ParquetFile(f).num_row_groups for f in files) >= 40  # a tenth of them: a tenth of the rows
    report = json.loads((out / "_convert.json").read_text())
    assert report["row_group_rows"] == pq.ParquetFile(files[0]).metadata.row_group(0).num_rows  # what was written
    got = _read_dir(out)
    assert got.schema.field("tags").type == pa.list_(pa.string()) and got.schema.field("item").type == pa.int64()
    with open(path, newline="") as f:
        first = list(csv.DictReader(f))[:11]
    assert got.column("tags").to_pylist()[:11] == [r["tags"].split("|") if r["tags"] else None for r in first]
    described = describe(job.data.train.paths, job.schema)
    assert "MISSING" not in described and "WRONG TYPE" not in described

    # trained as proposed (one epoch): an evaluation on the validation split a user can judge
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "recsys.cli", "train", "--config", str(proposed), "--run-dir",
                           str(run_dir), "--set", "train.epochs=1", "--set", "train.progress='none'"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("event") == "eval" and r.get("split") == "validation" and "auc" in r for r in records)


def test_split_reads_a_delimited_csv_column_as_a_list_with_a_jobs_schema(tmp_path):
    """`--split tags='|'` with --schema: a CSV string field becomes the job's multi-hot list
    (pieces trimmed, empty ones dropped, an empty field a null); without it CSV is refused."""
    schema = Schema(label="label", sparse=[FeatureSpec(name="tags", kind="int64", multi_hot=True)],
                    tables={"tags": TableSpec(dim=4, capacity=100)})
    path = tmp_path / "in.csv"
    path.write_text('label,tags\n1,3|4\n0, 5 ||6\n1,\n0,7\n')
    with pytest.raises(ConvertError, match="hold lists"):
        convert([str(path)], tmp_path / "refused", ConvertOptions(fmt="csv"), schema=schema)
    out = tmp_path / "out"
    report = convert([str(path)], out, ConvertOptions(fmt="csv", split={"tags": "|"}), schema=schema)
    assert report["columns"]["tags"] == "list<item: int64>"
    assert _read_dir(out).column("tags").to_pylist() == [[3, 4], [5, 6], None, [7]]
    # a --split that would do nothing is refused, not ignored: a column the job reads as one
    # value, or the criteo preset's fixed columns
    single = Schema(label="label", sparse=[FeatureSpec(name="tags", kind="string")],
                    tables={"tags": TableSpec(dim=4, capacity=100)})
    with pytest.raises(ConvertError, match=r"--split tags: the job reads it as one value"):
        convert([str(path)], tmp_path / "single", ConvertOptions(fmt="csv", split={"tags": "|"}), schema=single)
    with pytest.raises(ConvertError, match="--split tags: the criteo preset"):
        convert([str(path)], tmp_path / "criteo", ConvertOptions(fmt="tsv", preset="criteo", split={"tags": "|"}))
    assert not [p for d in ("single", "criteo") for p in (tmp_path / d).glob("part-*.parquet")]


def test_a_bad_piece_in_a_split_column_is_a_bad_row_with_its_file_and_line(tmp_path):
    """A piece that is not the list's type (`x` in an int64 list) makes its row a bad row like
    any other: with --bad-rows skip it is left out and counted, naming its file and line (the
    rows after it keep theirs); with error the conversion stops there, nothing written."""
    schema = Schema(label="label", sparse=[FeatureSpec(name="tags", kind="int64", multi_hot=True)],
                    tables={"tags": TableSpec(dim=4, capacity=100)})
    path = tmp_path / "in.csv"
    path.write_text('label,tags\n1,3|4\n0,5|x\n1,8|9\n0,7\n')
    out = tmp_path / "out"
    report = convert([str(path)], out, ConvertOptions(fmt="csv", split={"tags": "|"}, bad_rows="skip"),
                     schema=schema)
    assert _read_dir(out).column("tags").to_pylist() == [[3, 4], [8, 9], [7]]
    assert report["bad_rows"] == 1
    listed = report["bad_rows_listed"]
    assert [(b["line"], b["column"], b["found"]) for b in listed] == [(3, "tags", "'x'")]
    assert listed[0]["file"].endswith("in.csv") and "int64 values between '|'" in listed[0]["expected"]
    with pytest.raises(ConvertError, match=r"in\.csv: line 3: column 'tags': expected int64 values between '\|', "
                                           r"found 'x'.*nothing was written"):
        convert([str(path)], tmp_path / "stopped", ConvertOptions(fmt="csv", split={"tags": "|"}, bad_rows="error"),
                schema=schema)
    assert not list((tmp_path / "stopped").glob("part-*.parquet"))


@pytest.mark.parametrize("name, ids", [
    ("item", True), ("user_id", True), ("userId", True), ("userid", True), ("zip_code", True), ("ad_campaign", True),
    ("user_age", False), ("item_price", False), ("page_views", False), ("session_length", False), ("paid", False),
    ("valid", False), ("price", False)])
def test_infer_reads_an_integer_column_as_ids_by_its_name_only_when_the_name_says_ids(name, ids):
    """A name ending in an id word, or made only of words naming a thing, is ids; a measure of a
    thing (``user_age``, ``item_price``) is a number unless its cardinality says ids."""
    from recsys.io.convert_job import _id_reason

    assert (_id_reason(name, 10, 1000) is not None) is ids
    assert _id_reason(name, 900, 1000) is not None  # more distinct values than half the rows: ids
