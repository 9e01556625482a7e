"""The job ``recsys convert --infer`` proposes for the data it converted (``_job.toml``): label,
dense and sparse features picked from the first block's columns by type and cardinality.
"""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import tomli_w

from recsys.io.convert_options import Column

_LABEL_NAMES = ("label", "click", "clicked", "is_click", "target", "y", "conversion", "converted")


def propose_job(sample: pa.Table, columns: list[Column], out: Path) -> str:
    """Return a job TOML for the converted data: label, dense and sparse features by type and cardinality.

    - label: a column named like one (``label``, ``click``, ``target``, ...), else the first
      integer or boolean column holding only 0 and 1;
    - sparse: string columns; integer columns named ``*id`` or with more distinct values
      than half the sampled rows; lists of ids (multi-hot);
    - dense: the other numeric and boolean columns.
    Capacities are ten times the distinct ids seen in the sample (at least 1000): edit them
    for the full data.
    """
    n = max(sample.num_rows, 1)
    names = [c.name for c in columns]
    label = next((c for c in names if c.lower() in _LABEL_NAMES), None)
    if label is None:
        for c in columns:
            if pa.types.is_integer(c.type) or pa.types.is_boolean(c.type):
                vals = pc.unique(sample.column(c.name).drop_null()).to_pylist()
                if set(vals) <= {0, 1, True, False} and vals:
                    label = c.name
                    break
    dense, sparse = [], []
    for c in columns:
        if c.name == label:
            continue
        t = c.type
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            v = t.value_type
            kind = "int64" if pa.types.is_integer(v) else "string" if pa.types.is_string(v) else None
            if kind:
                distinct = len(pc.unique(pc.list_flatten(sample.column(c.name)).drop_null()))
                sparse.append((c.name, kind, True, distinct))
            continue
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            sparse.append((c.name, "string", False, len(pc.unique(sample.column(c.name).drop_null()))))
        elif pa.types.is_integer(t):
            distinct = len(pc.unique(sample.column(c.name).drop_null()))
            if c.name.lower().endswith("id") or distinct > n / 2:
                sparse.append((c.name, "int64", False, distinct))
            else:
                dense.append(c.name)
        elif pa.types.is_floating(t) or pa.types.is_boolean(t):
            dense.append(c.name)
    top = {"name": _toml_key(out.name or "converted"),
           "schema": {"label": label or "CHOOSE_A_LABEL_COLUMN", "dense": dense,
                      "sparse": [{"name": _toml_key(name), "column": name, "kind": kind,
                                  **({"multi_hot": True} if multi else {})} for name, kind, multi, _ in sparse]}}
    parts = [
        f"# Proposed by `recsys convert --infer` from the first {sample.num_rows:,} rows: check the label,\n"
        "# which columns are dense or sparse, and the capacities; then `recsys inspect --config` this file.\n",
        tomli_w.dumps(top),
    ]
    for name, _kind, _multi, distinct in sparse:
        cap = max(1000, 10 * distinct)
        parts.append(f"# {distinct:,} distinct ids in the sample\n"
                     + tomli_w.dumps({"schema": {"tables": {_toml_key(name): {"dim": 16, "capacity": cap}}}}))
    parts.append(tomli_w.dumps({"data": {"train": {"paths": [str(out)]}}}))
    return "\n".join(parts)


def _toml_key(name: str) -> str:
    """Return ``name`` as a feature/table name the schema accepts (other characters become ``_``)."""
    key = re.sub(r"[^A-Za-z0-9_.\-]", "_", name)
    return key if re.match(r"^[A-Za-z_]", key) else f"f_{key}"
