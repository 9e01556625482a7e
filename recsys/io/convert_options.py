"""What a conversion is asked for, shared by the parts of ``recsys convert`` (``recsys.io.convert``):
its options (``ConvertOptions``), its error (``ConvertError``), and the output columns it plans,
each with its Arrow type and the role that picks its value checks (Criteo's layout, or the
columns a job reads).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pyarrow as pa

from recsys.errors import UserError
from recsys.features.schema import Schema

FORMATS = ("csv", "tsv", "jsonl")
FIT_ROW_GROUPS = (40, 1024)
"""``fit_row_groups``: at least this many row groups, of at least this many rows each."""
CRITEO_DENSE = [f"i{j}" for j in range(1, 14)]
CRITEO_SPARSE = [f"c{j}" for j in range(1, 27)]
CRITEO_COLUMNS = ["label", *CRITEO_DENSE, *CRITEO_SPARSE]
"""The Criteo click logs' layout: a 0/1 label, 13 integer counts, 26 hashed categories (hex)."""


class ConvertError(UserError):
    """Bad input to a conversion: names the file, line and column, and what was expected."""


@dataclass(kw_only=True, slots=True)
class ConvertOptions:
    """How input files become Parquet files."""

    fmt: Literal["csv", "tsv", "jsonl"]
    """Input format: comma- or tab-separated text, or one JSON object per line."""
    preset: Literal["", "criteo"] = ""
    """``criteo``: the Criteo click logs' layout (no header, tab-separated, ``CRITEO_COLUMNS``)."""
    header: bool = True
    """CSV/TSV: the first line of every file names the columns (off for the ``criteo`` preset)."""
    rows_per_file: int = 4_194_304
    """Rows per output file (the last one may have fewer)."""
    row_group_rows: int = 131_072
    """Rows per Parquet row group: the reader's work unit (64-256k keeps shuffling and memory balanced)."""
    bad_rows: Literal["error", "skip"] = "error"
    """A bad row (wrong field count, a value of the wrong type, a label not 0/1, a non-finite
    dense value): stop with an error naming it, or skip it (counted and reported)."""
    block_bytes: int = 16 << 20
    """Input bytes parsed at once."""
    infer_rows: int = 100_000
    """Rows of the first block looked at to infer types and propose a job (``--infer``)."""
    split: dict[str, str] = field(default_factory=dict)
    """CSV/TSV: column -> separator: the string field is split there into a list (a multi-hot
    feature; ``--split tags='|'``). ``--infer`` finds such columns itself."""
    fit_row_groups: bool = False
    """With ``--infer``: row groups of fewer rows when the input is small (``FIT_ROW_GROUPS``),
    so that the proposed job's validation split, a tenth of the row groups, is a tenth of
    the rows. Off when ``--row-group-rows`` is given."""

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, found {self.fmt!r}")
        if self.preset not in ("", "criteo"):
            raise ValueError(f"preset must be 'criteo' or empty, found {self.preset!r}")
        if self.preset == "criteo":
            if self.fmt != "tsv":
                raise ValueError(f"the criteo preset reads tab-separated files: use --from tsv, found {self.fmt!r}")
            self.header = False
        if self.bad_rows not in ("error", "skip"):
            raise ValueError(f"bad_rows must be 'error' or 'skip', found {self.bad_rows!r}")
        if self.row_group_rows < 1:
            raise ValueError(f"row_group_rows must be >= 1, found {self.row_group_rows}")
        if self.rows_per_file < self.row_group_rows:
            raise ValueError(f"rows_per_file ({self.rows_per_file}) must be >= row_group_rows ({self.row_group_rows})")
        for column, sep in self.split.items():
            if not sep or self.fmt == "jsonl":
                raise ValueError(f"split {column}: needs a separator and a CSV/TSV input (JSON has its own arrays)")
        if self.block_bytes < 1024:
            raise ValueError(f"block_bytes must be >= 1024, found {self.block_bytes}")


# --------------------------------------------------------------------------- column plans


@dataclass(slots=True)
class Column:
    """One output column: its Arrow type and what the job does with it (the checks it gets)."""

    name: str
    type: pa.DataType
    role: Literal["label", "label_probability", "dense", "id", "weight", "other"] = "other"
    split: str = ""
    """A CSV/TSV string field split at this separator into a list of ``list_type`` (``type``
    is the field's: a string)."""
    list_type: pa.DataType = field(default_factory=pa.string)

    @property
    def out_type(self) -> pa.DataType:
        """The column's type in the Parquet files."""
        return pa.list_(self.list_type) if self.split else self.type


def criteo_columns() -> list[Column]:
    """Return the Criteo layout's columns: label int8, i1..i13 float32, c1..c26 strings."""
    return ([Column("label", pa.int8(), "label")] + [Column(c, pa.float32(), "dense") for c in CRITEO_DENSE]
            + [Column(c, pa.string(), "id") for c in CRITEO_SPARSE])


def job_columns(schema: Schema, passthrough: list[str], split: dict[str, str] | None = None) -> list[Column]:
    """Return the columns a job reads, typed for it (passthrough columns typed by the data); a
    multi-hot column in ``split`` is read as a string and split there."""
    label = (Column(schema.label, pa.int8(), "label") if schema.label_kind == "binary"
             else Column(schema.label, pa.float32(), "label_probability"))
    out = [label] + [Column(c, pa.float32(), "dense") for c in schema.dense]
    for f in schema.sparse:
        value = pa.int64() if f.kind == "int64" else pa.string()
        if f.multi_hot and split and f.column in split:
            out.append(Column(f.column, pa.string(), "id", split=split[f.column], list_type=value))
            continue
        if f.multi_hot:
            value = pa.list_(value)
        out.append(Column(f.column, value, "id"))
    weight = getattr(schema, "weight", "")
    if weight:
        out.append(Column(weight, pa.float32(), "weight"))
    seen = {c.name for c in out}
    for c in passthrough:
        if c not in seen:
            out.append(Column(c, pa.null(), "other"))  # typed from the first block
            seen.add(c)
    return out
