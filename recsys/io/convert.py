"""``recsys convert``: CSV, TSV (Criteo's click logs included) and JSON lines → Parquet for the reader.

::

    input files (local or any pyarrow filesystem URI; .gz/.bz2/.zst decompressed on the fly)
      └─► blocks of ``block_bytes`` cut at line ends; each block's first line number is known
            └─► Arrow's CSV / JSON parser (its threads), column types fixed up front
                  └─► value checks (label 0/1, finite dense values, weights ≥ 0), vectorized
                        └─► SplitWriter (zstd, row groups of ``row_group_rows``) on a second thread

Memory is bounded by one block being parsed, one being written and the row group pending.

Column types are fixed before the first block is parsed: by the preset (``criteo``), by a
job's schema (``--schema``: label int8 or float32, dense float32, ids int64 or string,
weights float32, multi-hot and weighted features from JSON arrays), or inferred by Arrow from
the first block. An empty field is a null (no id, or a null dense value the reader fills).
The options, the output columns and ``ConvertError`` are in ``recsys.io.convert_options``;
the job ``--infer`` proposes is written by ``recsys.io.convert_job``.

Bad rows: Arrow's fast path either parses a block cleanly or not. When it does not, or the
value checks flag rows, the block is checked again line by line in Python (rare: only
blocks with bad rows pay for it), which finds each bad line's number, column and value.
``bad_rows = "error"`` stops at the first block holding one, naming it; ``"skip"`` drops
them, counted, and the first ``BAD_ROWS_KEPT`` go into the report.

Output appears whole or not at all: it goes to a hidden directory inside ``out``, is fsynced,
and is moved in only when every input converted, under a marker the reader refuses
(``recsys.io.convert_output``). A failed or killed run leaves ``out`` as it was, or (killed
while moving in) leaves it refused until the next conversion into it finishes the move.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.fs as pafs
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from recsys.errors import UserError
from recsys.io.convert_job import find_lists, propose_job
from recsys.io.convert_options import (CRITEO_COLUMNS, FIT_ROW_GROUPS, Column, ConvertError, ConvertOptions,
                                       criteo_columns, job_columns)
from recsys.io.convert_output import fault, finish_interrupted, hold, move_in, refuse_parts, remove_abandoned
from recsys.io.parquet_out import SplitWriter
from recsys.features.schema import Schema

BAD_ROWS_KEPT = 100
"""Bad rows listed (file, line, column, what) in ``_convert.json``; all are counted."""
REPORT = "_convert.json"
"""The conversion's report, next to the files (a leading ``_``: the reader skips it)."""
PROPOSED_JOB = "_job.toml"
"""Where ``--infer`` writes the job it proposes."""


# --------------------------------------------------------------------------- input blocks


@dataclass(slots=True)
class _Input:
    display: str
    filesystem: pafs.FileSystem
    path: str
    size: int


def resolve_inputs(paths: list[str]) -> list[_Input]:
    """Return the input files (files, directories, globs; local or pyarrow filesystem URIs), sorted, each once."""
    if not paths:
        raise ConvertError("convert: expected at least one input file, found none")
    from recsys.io.units import expand_paths  # directories and globs as the reader takes them

    out, seen = [], set()
    try:
        files = expand_paths(list(paths))
    except UserError as exc:
        raise ConvertError(f"convert: {exc}") from None
    for sf in files:
        if sf.display in seen:
            continue
        seen.add(sf.display)
        info = sf.filesystem.get_file_info(sf.path)
        out.append(_Input(sf.display, sf.filesystem, sf.path, int(info.size or 0)))
    return out


_CODECS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".lz4": "lz4"}
"""Compressed inputs, by file name extension."""


class _Source:
    """An input file as blocks of whole lines, with the raw (compressed) bytes consumed so far."""

    def __init__(self, inp: _Input, block_bytes: int) -> None:
        self.inp = inp
        self.block_bytes = block_bytes
        try:
            # a random-access file: its position is the raw (compressed) bytes consumed
            self.raw = inp.filesystem.open_input_file(inp.path)
        except (pa.ArrowException, OSError) as exc:
            raise ConvertError(f"{inp.display}: expected a readable file, found {exc}") from None
        codec = _CODECS.get(os.path.splitext(inp.path)[1].lower())
        self.stream = pa.CompressedInputStream(self.raw, codec) if codec else self.raw
        self.line = 1
        """Number of the next line the blocks yield (1-based)."""
        self._carry = b""

    def raw_pos(self) -> int:
        return self.raw.tell()

    def _read(self) -> bytes:
        try:
            return self.stream.read(self.block_bytes)
        except (pa.ArrowException, OSError) as exc:  # a truncated or corrupt .gz, a vanished file
            raise ConvertError(f"{self.inp.display}: near line {self.line}: expected readable "
                               f"{'compressed ' if self.stream is not self.raw else ''}data, found {exc}") from None

    def header(self) -> bytes:
        """Return the first line (without its end) and move past it."""
        while b"\n" not in self._carry:
            data = self._read()
            if not data:
                break
            self._carry += data
        line, sep, rest = self._carry.partition(b"\n")
        self._carry = rest
        self.line += 1 if sep else 0
        return line.rstrip(b"\r")

    def blocks(self) -> Iterator[tuple[bytes, int]]:
        """Yield (block of whole lines, number of its first line)."""
        while True:
            data = self._read()
            if not data:
                break
            buf = self._carry + data if self._carry else data
            cut = buf.rfind(b"\n")
            if cut < 0:
                self._carry = buf
                continue
            block, self._carry = buf[: cut + 1], buf[cut + 1 :]
            first = self.line
            self.line += block.count(b"\n")
            yield block, first
        if self._carry:  # lines read with the header, or a last line without its line end
            block, self._carry = self._carry, b""
            if not block.endswith(b"\n"):
                block += b"\n"
            first = self.line
            self.line += block.count(b"\n")
            yield block, first

    def close(self) -> None:
        self.stream.close()
        if self.stream is not self.raw:
            self.raw.close()


# --------------------------------------------------------------------------- parsing


@dataclass(slots=True)
class BadRow:
    """A row left out: where it is and what is wrong with it."""

    file: str
    line: int
    column: str | None
    expected: str
    found: str

    def __str__(self) -> str:
        col = f"column {self.column!r}: " if self.column else ""
        return f"{self.file}: line {self.line}: {col}expected {self.expected}, found {self.found}"


class _Parser:
    """Parses blocks of one format with fixed column types, and checks values by role."""

    def __init__(self, opts: ConvertOptions, names: list[str] | None, columns: list[Column]) -> None:
        self.opts = opts
        self.names = names  # every field of a CSV line, in order (None for JSON)
        self.columns = columns
        self.delimiter = "\t" if opts.fmt == "tsv" else ","

    # --- the fast path

    def parse(self, block: bytes) -> tuple[pa.Table | None, int, Exception | None]:
        """Return (table, rows Arrow left out for a wrong field count, Arrow's error)."""
        invalid = []
        try:
            if self.opts.fmt == "jsonl":
                table = pa_json.read_json(
                    pa.BufferReader(block),
                    read_options=pa_json.ReadOptions(use_threads=True, block_size=1 << 20),
                    parse_options=pa_json.ParseOptions(
                        explicit_schema=pa.schema([(c.name, c.type) for c in self.columns]),
                        unexpected_field_behavior="ignore"),
                )
            else:
                table = pa_csv.read_csv(
                    pa.BufferReader(block),
                    read_options=pa_csv.ReadOptions(column_names=self.names, use_threads=True, block_size=1 << 20),
                    parse_options=pa_csv.ParseOptions(
                        delimiter=self.delimiter, ignore_empty_lines=False,
                        quote_char='"' if self.opts.fmt == "csv" else False,
                        invalid_row_handler=lambda row: invalid.append(row) or "skip"),
                    convert_options=pa_csv.ConvertOptions(
                        column_types={c.name: c.type for c in self.columns},
                        include_columns=[c.name for c in self.columns],
                        null_values=[""], strings_can_be_null=True, quoted_strings_can_be_null=False),
                )
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
            return None, len(invalid), exc
        return table, len(invalid), None

    def check(self, table: pa.Table) -> list[tuple[int, str, str, str]]:
        """Return (row, column, expected, found) of every row whose values the job refuses."""
        out = []
        for col in self.columns:
            if col.role == "other" or col.role == "id":
                continue
            arr = table.column(col.name)
            # ok: True, False, or null for a null cell (allowed for dense values only)
            if col.role == "label":
                ok = pc.or_(pc.equal(arr, 0), pc.equal(arr, 1))
            elif col.role == "label_probability":
                ok = pc.and_(pc.greater_equal(arr, 0), pc.less_equal(arr, 1))
            elif col.role == "dense":
                ok = pc.is_finite(arr)
            else:  # weight
                ok = pc.and_(pc.is_finite(arr), pc.greater_equal(arr, 0))
            bad = pc.invert(pc.fill_null(ok, col.role == "dense"))
            if not pc.any(bad).as_py():
                continue
            rows = pc.indices_nonzero(bad).to_numpy()
            values = arr.take(pa.array(rows[:BAD_ROWS_KEPT])).to_pylist()
            expected = _EXPECTED[col.role]
            for i, r in enumerate(rows.tolist()):
                shown = "null (an empty field)" if i < len(values) and values[i] is None else (
                    repr(values[i]) if i < len(values) else "a bad value")
                out.append((r, col.name, expected, shown))
        out.sort()
        return out

    # --- the slow path: line by line

    def scan(self, block: bytes) -> list[tuple[int, str | None, str, str]]:
        """Return (line index in the block, column, expected, found) of each bad line."""
        lines = block.split(b"\n")[:-1]
        out = []
        for i, raw in enumerate(lines):
            problem = self._line_problem(raw.rstrip(b"\r"))
            if problem is not None:
                out.append((i, *problem))
        return out

    def _line_problem(self, raw: bytes) -> tuple[str | None, str, str] | None:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            return None, "UTF-8 text", f"bytes that are not UTF-8 ({raw[:40]!r})"
        if self.opts.fmt == "jsonl":
            return self._json_problem(text)
        if self.opts.fmt == "csv":
            fields = next(csv.reader([text], delimiter=",", quotechar='"', strict=True), [])
        else:
            fields = text.split("\t")
        if not text:
            return None, f"{len(self.names)} fields", "an empty line"
        if len(fields) != len(self.names):
            return None, f"{len(self.names)} fields", f"{len(fields)} fields"
        by_name = dict(zip(self.names, fields))
        for col in self.columns:
            problem = _value_problem(col, by_name[col.name] if by_name[col.name] != "" else None, text=True)
            if problem is not None:
                return col.name, *problem
        return None

    def _json_problem(self, text: str) -> tuple[str | None, str, str] | None:
        if not text.strip():
            return None, "a JSON object", "an empty line"
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            return None, "a JSON object", f"invalid JSON ({exc.msg} at column {exc.colno})"
        except RecursionError:  # a bad row like any other, not the end of the conversion
            return None, "a JSON object", f"JSON nested too deeply for Python's parser ({len(text):,} characters)"
        if not isinstance(obj, dict):
            return None, "a JSON object", type(obj).__name__
        for col in self.columns:
            problem = _value_problem(col, obj.get(col.name), text=False)
            if problem is not None:
                return col.name, *problem
        return None


_EXPECTED = {
    "label": "a label 0 or 1",
    "label_probability": "a label in [0, 1]",
    "dense": "a finite number (or an empty field)",
    "weight": "a finite weight >= 0",
}
_INT = re.compile(r"^\s*[+-]?\d+\s*$")
_FLOAT = re.compile(r"^\s*[+-]?(\d+\.?\d*([eE][+-]?\d+)?|\.\d+([eE][+-]?\d+)?|nan|NaN|inf|Inf|infinity|Infinity)\s*$")


def _number(value, text: bool, pattern: re.Pattern, cast, types):
    """Return ``value`` (a CSV field when ``text``, else a JSON value) as a number of ``cast``'s
    type, or None when it is not one (``pattern`` checks a field; a JSON bool is no number)."""
    if text:
        return cast(value) if pattern.match(value) else None
    if isinstance(value, bool) or not isinstance(value, types):
        return None
    return cast(value)


def _value_problem(col: Column, value, text: bool) -> tuple[str, str] | None:
    """Return (expected, found) if ``value`` (a CSV field, or a JSON value) does not fit ``col``."""
    t = col.type
    if value is None:
        if col.role in ("label", "label_probability", "weight"):
            return _EXPECTED[col.role], "null (an empty field)" if text else "null"
        return None
    if pa.types.is_integer(t):
        number = _number(value, text, _INT, int, int)
        if number is None:
            return _EXPECTED.get(col.role, "an integer"), repr(value)
        bits = t.bit_width
        lo, hi = (0, 2**bits - 1) if pa.types.is_unsigned_integer(t) else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
        if not lo <= number <= hi:
            return _EXPECTED.get(col.role, f"an integer within {t}"), repr(value)
        if col.role == "label" and number not in (0, 1):
            return _EXPECTED["label"], repr(value)
        return None
    if pa.types.is_floating(t):
        number = _number(value, text, _FLOAT, float, (int, float))
        if number is None:
            return _EXPECTED.get(col.role, "a number"), repr(value)
        if pa.types.is_float32(t) and math.isfinite(number) and abs(number) > 3.4028234663852886e38:
            number = math.inf
        if col.role == "dense" and not math.isfinite(number):
            return _EXPECTED["dense"], repr(value)
        if col.role == "weight" and not (math.isfinite(number) and number >= 0):
            return _EXPECTED["weight"], repr(value)
        if col.role == "label_probability" and not 0 <= number <= 1:
            return _EXPECTED["label_probability"], repr(value)
        return None
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        if not text and not isinstance(value, str):
            return "a string", repr(value)
        return None
    if pa.types.is_boolean(t):
        if text and value.strip().lower() not in ("true", "false", "1", "0"):
            return "true or false", repr(value)
        if not text and not isinstance(value, bool):
            return "true or false", repr(value)
        return None
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        if text:
            return None  # CSV has no lists; the column plan refuses them earlier
        if not isinstance(value, list):
            return f"a JSON array for {t}", repr(value)[:60]
        elem = Column(col.name, t.value_type, "other")
        for v in value:
            problem = _value_problem(elem, v, text=False)
            if problem is not None:
                return f"a JSON array of {t.value_type}", repr(v)[:60]
        return None
    if pa.types.is_struct(t):
        if not isinstance(value, dict):
            return f"a JSON object with {', '.join(f.name for f in t)}", repr(value)[:60]
        for f in t:
            problem = _value_problem(Column(f.name, f.type, "weight" if f.name == "weight" else "other"),
                                     value.get(f.name), text=False)
            if problem is not None:
                return f"field {f.name!r}: {problem[0]}", problem[1]
        return None
    return None


# --------------------------------------------------------------------------- progress


class _Progress:
    """A tqdm bar over input bytes on a TTY, else a line every ``every_s`` seconds."""

    def __init__(self, total_bytes: int, enabled: bool, every_s: float = 10.0) -> None:
        self.enabled = enabled
        self.total = total_bytes
        self.every_s = every_s
        self.t0 = time.perf_counter()
        self.last = self.t0
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="convert", file=sys.stderr,
                            dynamic_ncols=True)

    def update(self, done_bytes: int, rows: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        rate = rows / max(now - self.t0, 1e-9)
        if self.bar is not None:
            self.bar.n = done_bytes
            self.bar.set_postfix_str(f"{rows:,} rows, {rate:,.0f} rows/s", refresh=True)
        elif now - self.last >= self.every_s:
            self.last = now
            share = f"{100 * done_bytes / self.total:.0f}% of input, " if self.total else ""
            print(f"convert: {share}{rows:,} rows, {rate:,.0f} rows/s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------- the conversion


def _header_names(src: _Source, opts: ConvertOptions) -> list[str]:
    raw = src.header()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConvertError(f"{src.inp.display}: line 1: expected a header of column names in UTF-8, "
                           f"found {raw[:60]!r}") from None
    if opts.fmt == "csv":
        names = next(csv.reader([text]), [])
    else:
        names = text.split("\t")
    if not text or not all(names):
        raise ConvertError(f"{src.inp.display}: line 1: expected a header of column names, found {text[:80]!r}")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConvertError(f"{src.inp.display}: line 1: expected distinct column names, found {dup} repeated")
    return names


def _check_plan(columns: list[Column], names: list[str] | None, display: str, opts: ConvertOptions) -> None:
    if names is None:
        return
    missing = [c.name for c in columns if c.name not in names]
    if missing:
        shown = ", ".join(names[:40]) + (" ..." if len(names) > 40 else "")
        raise ConvertError(f"{display}: line 1: expected columns {missing} (the job reads them), "
                           f"found a header without them ({shown})")
    lists = [c.name for c in columns if pa.types.is_list(c.type) or pa.types.is_struct(c.type)]
    if lists:
        raise ConvertError(f"{display}: columns {lists} hold lists (multi-hot or weighted features), which "
                           f"{opts.fmt.upper()} fields cannot; convert from JSON lines (--from jsonl) instead")


def _infer_types(parser: _Parser, block: bytes, opts: ConvertOptions, display: str, first_line: int) -> pa.Schema:
    """Return the types Arrow infers from the start of ``block`` (for columns not typed yet)."""
    head = block
    if len(block) > (4 << 20):
        cut = block.find(b"\n", 4 << 20)
        head = block[: cut + 1] if cut >= 0 else block
    try:
        if opts.fmt == "jsonl":
            t = pa_json.read_json(pa.BufferReader(head))
        else:
            t = pa_csv.read_csv(pa.BufferReader(head), read_options=pa_csv.ReadOptions(column_names=parser.names),
                                parse_options=pa_csv.ParseOptions(delimiter=parser.delimiter,
                                                                  quote_char='"' if opts.fmt == "csv" else False),
                                convert_options=pa_csv.ConvertOptions(null_values=[""], strings_can_be_null=True))
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise ConvertError(f"{display}: lines {first_line}..: expected rows to infer column types from "
                           f"(or give --schema JOB.toml), found {exc}") from None
    return t.schema


def convert(
    inputs: list[str],
    out: str | os.PathLike,
    opts: ConvertOptions,
    *,
    schema: Schema | None = None,
    passthrough: list[str] = (),
    infer: bool = False,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Convert ``inputs`` into ``out/part-NNNNN.parquet``; return the report (also in ``out/_convert.json``).

    Columns: the preset's, the job's (``schema`` and ``passthrough``), or all the input's
    with types inferred from the first block. ``infer`` also writes ``out/_job.toml``, a job
    proposed from the first block's columns. ``out`` must hold no ``part-*.parquet`` yet.
    """
    files = resolve_inputs(inputs)
    out = Path(out)
    say = log or (lambda _msg: None)
    if out.exists() and not out.is_dir():
        raise ConvertError(f"{out}: expected an output directory, found a file")
    finished = False
    if out.is_dir():
        finished = finish_interrupted(out, say)
        remove_abandoned(out)
    refuse_parts(out, finished)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".convert-{os.getpid()}-", dir=out))
    lock = hold(tmp)
    writer = SplitWriter(tmp, opts.rows_per_file, opts.row_group_rows, lambda _msg: fault("mid-write"))
    bar = _Progress(sum(f.size for f in files), progress)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recsys-convert-write")
    pending = None
    stats = {"rows": 0, "bad_rows": 0, "lines": 0, "input_bytes": sum(f.size for f in files)}
    bad_kept: list[BadRow] = []
    columns: list[Column] | None = None
    names: list[str] | None = None
    parser: _Parser | None = None
    sample: pa.Table | None = None
    done_bytes = 0
    t0 = time.perf_counter()
    try:
        for inp in files:
            src = _Source(inp, opts.block_bytes)
            try:
                file_names = None
                if opts.fmt != "jsonl":
                    file_names = CRITEO_COLUMNS if opts.preset == "criteo" else (
                        _header_names(src, opts) if opts.header else None)
                if names is not None and file_names != names and opts.fmt != "jsonl" and opts.header:
                    raise ConvertError(f"{inp.display}: line 1: expected the header of the first file "
                                       f"({', '.join(names[:20])}...), found {', '.join(file_names[:20])}...")
                for block, first in src.blocks():
                    if parser is None:
                        if file_names is None and opts.fmt != "jsonl":  # no header: fields named by position
                            n = len(block[: block.find(b"\n")].split(b"\t" if opts.fmt == "tsv" else b","))
                            file_names = [f"f{j}" for j in range(n)]
                        names = file_names
                        columns = _plan(opts, schema, passthrough, names, inp.display)
                        parser = _Parser(opts, names, columns)
                        untyped = [c for c in columns if pa.types.is_null(c.type)]
                        if untyped or infer:
                            inferred = _infer_types(parser, block, opts, inp.display, first)
                            for c in untyped:
                                if c.name not in inferred.names:
                                    raise ConvertError(f"{inp.display}: expected a field {c.name!r}, found none "
                                                       f"in lines {first}..")
                                c.type = pa.string() if c.split else _widen(inferred.field(c.name).type)
                    table = _parse_block(parser, block, first, inp.display, opts, stats, bad_kept)
                    if infer and sample is None:
                        if schema is None and not opts.preset and opts.fmt != "jsonl":
                            found = find_lists(table.slice(0, opts.infer_rows), parser.columns)
                            for c in parser.columns:
                                if c.name in found:
                                    c.split = found[c.name]
                            table = _split_lists(table, [c for c in parser.columns if c.name in found])
                        sample = table.slice(0, opts.infer_rows)
                        if opts.fit_row_groups:
                            writer.row_group_size = _fit_row_groups(table.num_rows, src.raw_pos(),
                                                                    sum(f.size for f in files), opts)
                    stats["rows"] += table.num_rows
                    if pending is not None:
                        pending.result()
                    pending = pool.submit(writer.add, table) if table.num_rows else None
                    bar.update(done_bytes + src.raw_pos(), stats["rows"])
            finally:
                src.close()
            done_bytes += inp.size
            stats["lines"] += src.line - 1
            say(f"read {inp.display}: {src.line - 1:,} lines")
        if pending is not None:
            pending.result()
        writer.finish()
        if stats["rows"] == 0:
            raise ConvertError(f"{', '.join(f.display for f in files)}: expected at least one row, found "
                               f"{stats['bad_rows']} bad and no good rows")
    except BaseException:
        if pending is not None:
            try:
                pending.result()
            except BaseException:  # noqa: BLE001 - the first error is the one raised
                pass
        writer.abort()
        pool.shutdown(wait=True)
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(lock)
        raise
    pool.shutdown(wait=True)
    bar.close()
    seconds = time.perf_counter() - t0
    columns = parser.columns  # JSON without a job: typed from the first block
    moved = [p.name for p in writer.paths]
    report = {
        "inputs": [f.display for f in files],
        "format": opts.fmt,
        "preset": opts.preset,
        "out": str(out),
        "files": [str(out / name) for name in moved],
        "rows": stats["rows"],
        "lines": stats["lines"],
        "bad_rows": stats["bad_rows"],
        "bad_rows_listed": [dataclasses.asdict(b) for b in bad_kept],
        "seconds": round(seconds, 3),
        "rows_per_s": round(stats["rows"] / seconds, 1) if seconds > 0 else None,
        "input_bytes": stats["input_bytes"],
        "row_group_rows": writer.row_group_size,
        "rows_per_file": opts.rows_per_file,
        "columns": {c.name: str(c.out_type) for c in columns},
    }
    try:
        if infer:
            groups = sum(pq.ParquetFile(p).num_row_groups for p in writer.paths)
            (tmp / PROPOSED_JOB).write_text(propose_job(sample, columns, out, groups))
            report["proposed_job"] = str(out / PROPOSED_JOB)
            moved.append(PROPOSED_JOB)
        (tmp / REPORT).write_text(json.dumps(report, indent=2) + "\n")
        moved.append(REPORT)
        move_in(tmp, out, moved)
    finally:
        os.close(lock)
    return report



def _plan(opts: ConvertOptions, schema: Schema | None, passthrough, names, display) -> list[Column]:
    if opts.split and opts.preset == "criteo":
        raise ConvertError(f"--split {', '.join(sorted(opts.split))}: the criteo preset's columns hold single "
                           "values; expected --split only without --preset")
    if opts.split and schema is not None:
        lists = {f.column for f in schema.sparse if f.multi_hot}
        read = {f.column for f in schema.sparse} | set(schema.dense) | {schema.label}
        single = sorted(set(opts.split) - lists)
        if single:
            how = "reads it as one value" if all(c in read for c in single) else "does not read it as a list"
            raise ConvertError(f"--split {', '.join(single)}: the job {how}; expected --split only for a "
                               "multi_hot feature's column")
    if opts.preset == "criteo":
        columns = criteo_columns()
        if schema is not None:  # the job may read fewer columns, with its own label kind
            wanted = {c.name for c in job_columns(schema, list(passthrough))}
            columns = [c for c in columns if c.name in wanted]
            _check_plan(job_columns(schema, list(passthrough)), CRITEO_COLUMNS, display, opts)
        return columns
    unknown = sorted(set(opts.split) - set(names or []))
    if unknown:
        raise ConvertError(f"{display}: line 1: expected the columns to split {unknown}, found a header without "
                           f"them ({', '.join((names or [])[:40])})")
    if schema is not None:
        columns = job_columns(schema, list(passthrough), opts.split)
        _check_plan(columns, names, display, opts)
        return columns
    if names is None:  # JSON without a job: every field, typed from the first block
        return []
    return [Column(n, pa.null(), split=opts.split.get(n, "")) for n in names]


def _widen(t: pa.DataType) -> pa.DataType:
    """Return the type a column inferred as ``t`` from one block keeps for all of them."""
    if pa.types.is_null(t):
        return pa.string()
    if pa.types.is_timestamp(t) or pa.types.is_date(t) or pa.types.is_time(t):
        return pa.string()  # kept as written
    return t


def _parse_block(parser: _Parser, block: bytes, first: int, display: str, opts: ConvertOptions,
                 stats: dict, bad_kept: list[BadRow]) -> pa.Table:
    """Return the block's good rows as a table; count (and with ``error``, raise on) its bad rows."""
    if not parser.columns and opts.fmt == "jsonl":  # JSON without a job: fix the types now
        inferred = _infer_types(parser, block, opts, display, first)
        parser.columns = [Column(f.name, _widen(f.type)) for f in inferred]
    table, skipped, error = parser.parse(block)
    bad: list[tuple[int, str | None, str, str]] = []
    line_of = None  # the block line of each row of ``table`` (None: the same index)
    if table is not None and not skipped:
        bad = parser.check(table)
        if bad:  # rows are the block's lines one to one here
            mask = [True] * table.num_rows
            for r, *_ in bad:
                mask[r] = False
            line_of = np.flatnonzero(mask)
            table = table.filter(pa.array(mask))
    elif table is not None or error is not None:
        bad = parser.scan(block)
        lines = block.split(b"\n")
        bad_idx = {i for i, *_ in bad}
        good = b"".join(line + b"\n" for i, line in enumerate(lines[:-1]) if i not in bad_idx)
        line_of = np.array([i for i in range(len(lines) - 1) if i not in bad_idx], dtype=np.int64)
        table, skipped, error = parser.parse(good) if good else (None, 0, None)
        if good and (error is not None or skipped or parser.check(table)):
            why = error or f"{skipped} rows with a wrong field count"
            raise ConvertError(f"{display}: lines {first}-{first + len(lines) - 2}: expected rows Arrow parses, "
                               f"found {why}") from None
        if table is None:
            table = pa.table({c.name: pa.array([], c.type) for c in parser.columns})
    pieces_bad = _bad_pieces(table, parser.columns)
    if pieces_bad:  # a row whose list field holds a piece of the wrong type is a bad row too
        at = np.arange(table.num_rows) if line_of is None else line_of
        mask = np.ones(table.num_rows, dtype=bool)
        for r, *_ in pieces_bad:
            mask[r] = False
        table = table.filter(pa.array(mask))
        bad = sorted(bad + [(int(at[r]), c, e, f) for r, c, e, f in pieces_bad], key=lambda b: b[0])
    if bad:
        rows = [BadRow(display, first + r, c, e, f) for r, c, e, f in bad]
        stats["bad_rows"] += len(rows)
        if opts.bad_rows == "error":
            last = first + block.count(b"\n") - 1
            more = f" ({len(rows)} bad rows in lines {first}-{last})" if len(rows) > 1 else ""
            raise ConvertError(f"{rows[0]}{more}; --bad-rows skip leaves such rows out, counted; "
                               f"nothing was written")
        room = BAD_ROWS_KEPT - len(bad_kept)
        bad_kept.extend(rows[: max(room, 0)])
    return _split_lists(table.select([c.name for c in parser.columns]), parser.columns)


def _bad_pieces(table: pa.Table, columns: list[Column]) -> list[tuple[int, str, str, str]]:
    """Return (row, column, expected, found) for each row of ``table`` whose split column holds
    a piece that is not a ``list_type`` value (the first such piece of the row)."""
    out: dict[int, tuple[int, str, str, str]] = {}
    for c in columns:
        if not c.split or pa.types.is_string(c.list_type) or pa.types.is_large_string(c.list_type):
            continue
        lists = pc.split_pattern(table.column(c.name).combine_chunks(), pattern=c.split)
        pieces = pc.utf8_trim_whitespace(lists.values)
        try:
            pc.cast(pieces.filter(pc.fill_null(pc.not_equal(pieces, ""), False)), c.list_type)
            continue
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass
        starts = lists.offsets.to_numpy()
        texts = pieces.to_pylist()
        step = 1024  # cast in slices; only a failing slice is cast piece by piece
        for s0 in range(0, len(texts), step):
            chunk = texts[s0:s0 + step]
            try:
                pc.cast(pa.array([t for t in chunk if t], pa.string()), c.list_type)
                continue
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                pass
            for j, t in enumerate(chunk):
                if not t:
                    continue
                try:
                    pc.cast(pa.array([t], pa.string()), c.list_type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                    row = int(np.searchsorted(starts, s0 + j, side="right") - 1)
                    if row not in out:
                        out[row] = (row, c.name, f"{c.list_type} values between {c.split!r}", repr(t))
    return sorted(out.values())


def _split_lists(table: pa.Table, columns: list[Column]) -> pa.Table:
    """Return ``table`` with each column that has a ``split`` separator split into a list of
    its ``list_type`` (pieces trimmed, empty ones dropped; a null field stays null)."""
    for c in columns:
        if not c.split:
            continue
        i = table.column_names.index(c.name)
        lists = pc.split_pattern(table.column(c.name).combine_chunks(), pattern=c.split)
        pieces = pc.utf8_trim_whitespace(lists.values)
        keep = pc.fill_null(pc.not_equal(pieces, ""), False).to_numpy(zero_copy_only=False)
        ends = np.concatenate([[0], np.cumsum(keep)]).astype(np.int32)
        offsets = pa.array(ends[lists.offsets.to_numpy()])
        try:
            values = pc.cast(pieces.filter(pa.array(keep)), c.list_type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise ConvertError(f"column {c.name!r}: expected {c.list_type} values between {c.split!r}, found {exc}") \
                from None
        split = pa.ListArray.from_arrays(offsets, values, mask=lists.is_null())
        table = table.set_column(i, pa.field(c.name, split.type), split)
    return table


def _fit_row_groups(rows: int, read_bytes: int, total_bytes: int, opts: ConvertOptions) -> int:
    """Return the rows per row group that give a small input ``FIT_ROW_GROUPS``' row groups
    (its rows estimated from the first block's), never more than ``opts.row_group_rows``."""
    groups, least = FIT_ROW_GROUPS
    estimate = rows * total_bytes / max(read_bytes, 1)
    return int(min(opts.row_group_rows, max(least, math.ceil(estimate / groups))))

