"""The job ``recsys convert --infer`` proposes for the data it converted (``_job.toml``): label,
dense and sparse features picked from the first block's columns by type, name and cardinality,
delimited string columns found as lists, and a validation split with early stopping.
"""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import tomli_w

from recsys.io.convert_options import Column
from recsys.train.config import EARLY_STOPPING_DEFAULTS

_LABEL_NAMES = ("label", "click", "clicked", "is_click", "target", "y", "conversion", "converted")


LIST_SEPARATORS = ("|", ";", ",")
"""Separators ``find_lists`` looks for inside a string column."""
_ID_SUFFIXES = {"id", "ids", "uid", "key", "hash", "code", "sku"}
"""A column name's last word that makes an integer column ids (``user_id``, ``categoryId``, ``zip_code``)."""
_ID_ENTITIES = {"user", "item", "product", "ad", "campaign", "advertiser", "creative", "account", "customer",
                "client", "member", "session", "device", "category", "cat", "genre", "brand", "shop", "store",
                "seller", "merchant", "movie", "song", "artist", "video", "query", "doc", "page", "site", "app",
                "zip", "zipcode", "postcode", "city", "region", "country"}
"""Words that name a thing, not a measure of it: a name made only of them is ids (``item``,
``ad_campaign``, ``userid``); one with another word after them is not (``user_age``,
``item_price``, ``page_views``: the cardinality rule decides)."""


def find_lists(sample: pa.Table, columns: list[Column]) -> dict[str, str]:
    """Return column -> separator for the string columns of ``sample`` that hold delimited
    lists: one of ``LIST_SEPARATORS`` in at least a fifth of the values, every other one in
    under 1 %, and fewer distinct pieces than distinct values (the pieces recur: a bag of tags,
    not free text)."""
    found = {}
    for c in columns:
        if c.split or not (pa.types.is_string(c.type) or pa.types.is_large_string(c.type)):
            continue
        values = sample.column(c.name).drop_null()
        if not len(values):
            continue
        share = {sep: pc.sum(pc.match_substring(values, sep)).as_py() / len(values) for sep in LIST_SEPARATORS}
        sep = max(share, key=share.get)
        if share[sep] < 0.2 or any(v >= 0.01 for s, v in share.items() if s != sep):
            continue
        pieces = pc.utf8_trim_whitespace(pc.list_flatten(pc.split_pattern(values, pattern=sep)))
        if len(pc.unique(pieces)) < len(pc.unique(values)):
            found[c.name] = sep
    return found


def _id_reason(name: str, distinct: int, n: int) -> str | None:
    """Why an integer column is ids (a sparse feature), or None (a dense number)."""
    words = [w.lower() for w in re.split(r"[^A-Za-z0-9]+|(?<=[a-z0-9])(?=[A-Z])", name) if w]
    flat = name.lower()
    if words and (words[-1] in _ID_SUFFIXES or all(w in _ID_ENTITIES for w in words)
                  or (flat.endswith("id") and flat[:-2] in _ID_ENTITIES)):
        return (f"an integer column (no fractional part) named like ids ({name!r}), "
                f"{distinct:,} distinct values in {n:,} rows")
    if distinct > n / 2:
        return f"an integer column (no fractional part) with {distinct:,} distinct values in {n:,} rows: ids"
    return None


def propose_job(sample: pa.Table, columns: list[Column], out: Path, row_groups: int = 0) -> str:
    """Return a job TOML for the converted data: label, dense and sparse features by type and
    cardinality, and a validation split with early stopping.

    - label: a column named like one (``label``, ``click``, ``target``, ...), else the first
      integer or boolean column holding only 0 and 1;
    - sparse: string columns; integer columns named like ids (a last word of ``_ID_SUFFIXES``,
      or only words of ``_ID_ENTITIES``) or with more distinct values than half the sampled rows, each with the reason
      in a comment; lists of ids (multi-hot), delimited strings split into lists included;
    - dense: the other numeric and boolean columns;
    - ``[train.eval]``: what ``recsys tune`` chooses by itself (``EARLY_STOPPING_DEFAULTS``),
      a validation split of a tenth of the ``row_groups`` among them.
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
        t = c.out_type
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            v = t.value_type
            kind = "int64" if pa.types.is_integer(v) else "string" if pa.types.is_string(v) else None
            if kind:
                distinct = len(pc.unique(pc.list_flatten(sample.column(c.name)).drop_null()))
                why = (f"strings like 'a{c.split}b' split at {c.split!r} into a list: a multi-hot feature "
                       f"(convert more with --split {c.name}='{c.split}')") if c.split else ""
                sparse.append((c.name, kind, True, distinct, why))
            continue
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            sparse.append((c.name, "string", False, len(pc.unique(sample.column(c.name).drop_null())), ""))
        elif pa.types.is_integer(t):
            distinct = len(pc.unique(sample.column(c.name).drop_null()))
            why = _id_reason(c.name, distinct, sample.num_rows)
            if why:
                sparse.append((c.name, "int64", False, distinct, why))
            else:
                dense.append(c.name)
        elif pa.types.is_floating(t) or pa.types.is_boolean(t):
            dense.append(c.name)
    top = {"name": _toml_key(out.name or "converted"),
           "schema": {"label": label or "CHOOSE_A_LABEL_COLUMN", "dense": dense,
                      "sparse": [{"name": _toml_key(name), "column": name, "kind": kind,
                                  **({"multi_hot": True} if multi else {})} for name, kind, multi, _, _ in sparse]}}
    parts = [
        f"# Proposed by `recsys convert --infer` from the first {sample.num_rows:,} rows: check the label,\n"
        "# which columns are dense or sparse, and the capacities; then `recsys inspect --config` this file.\n",
        tomli_w.dumps(top),
    ]
    for name, _kind, _multi, distinct, why in sparse:
        cap = max(1000, 10 * distinct)
        parts.append((f"# {name}: {why}\n" if why else "") + f"# {distinct:,} distinct ids in the sample\n"
                     + tomli_w.dumps({"schema": {"tables": {_toml_key(name): {"dim": 16, "capacity": cap}}}}))
    parts.append(tomli_w.dumps({"data": {"train": {"paths": [str(out)]}}}))
    parts.append(_train_section(row_groups))
    return "\n".join(parts)


def _train_section(row_groups: int) -> str:
    """``[train]``: the evaluations ``recsys tune`` would choose, so that training says how it does."""
    ev = {k.rsplit(".", 1)[-1]: v for k, v in EARLY_STOPPING_DEFAULTS.items() if k.startswith("train.eval.")}
    fraction = ev["validation_fraction"]
    held = max(1, round(fraction * row_groups))
    head = (f"# a validation split: {held} of the {row_groups} row groups written (about {held / max(row_groups, 1):.0%} "
            "of the rows), never trained on;\n# an evaluation on it every epoch, the best checkpoint by AUC, early "
            "stopping, an epoch cap\n")
    if row_groups < 2:  # nothing to hold out: the trainer refuses a validation fraction of one row group
        return ("# no validation split: the data is one row group; convert again with a smaller --row-group-rows, "
                "or give\n# data.validation.paths, then `recsys train --early-stopping` evaluates on it\n")
    return head + tomli_w.dumps({"train": {"epochs": EARLY_STOPPING_DEFAULTS["train.epochs"], "eval": ev}})


def _toml_key(name: str) -> str:
    """Return ``name`` as a feature/table name the schema accepts (other characters become ``_``)."""
    key = re.sub(r"[^A-Za-z0-9_.\-]", "_", name)
    return key if re.match(r"^[A-Za-z_]", key) else f"f_{key}"
