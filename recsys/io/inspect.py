"""``recsys inspect``: what a data set holds and how the job's feature schema maps onto it."""

from __future__ import annotations

import pyarrow as pa

from recsys.io.errors import ReadError
from recsys.io.units import check_column, column_checks, expand_paths, file_keys, open_parquet
from recsys.features.schema import Schema


def describe(paths, schema: Schema | None = None, filesystem=None, passthrough: list[str] = ()) -> str:
    """Return a report: files with rows and row groups, the Arrow schema, and (given a
    schema) each label/dense/sparse/passthrough column: its type, and where it is missing or
    of the wrong type. Reads footers only."""
    files = expand_paths(paths, filesystem)
    keys = file_keys(files)
    lines: list[str] = []
    schemas: dict[str, pa.Schema] = {}
    bad: dict[str, str] = {}
    total_rows = total_rgs = 0
    rows_out = []
    for sf, key in zip(files, keys):
        try:
            pf = open_parquet(sf)
        except ReadError as err:
            bad[key] = str(err)
            rows_out.append(f"  {key}  UNREADABLE: {err.found}")
            continue
        md = pf.metadata
        rg_rows = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
        schemas[key] = pf.schema_arrow
        pf.close()
        total_rows += md.num_rows
        total_rgs += md.num_row_groups
        spread = (
            f"{min(rg_rows):,}..{max(rg_rows):,} rows each" if rg_rows else "none"
        )
        empty = sum(1 for n in rg_rows if n == 0)
        note = f"; {empty} EMPTY row group(s)" if empty else ""
        if md.num_rows == 0:
            note += "; EMPTY file"
        rows_out.append(
            f"  {key}  rows={md.num_rows:,}  row_groups={md.num_row_groups} ({spread}){note}"
        )
    lines.append(
        f"{len(files)} file(s), {total_rgs:,} row group(s), {total_rows:,} rows"
        + (f", {len(bad)} unreadable" if bad else "")
    )
    lines += rows_out
    if schemas:
        first_key, first = next(iter(schemas.items()))
        lines.append(f"columns (of {first_key}):")
        lines += [f"  {f.name}: {f.type}" for f in first]
        differ = [k for k, s in schemas.items() if not s.equals(first)]
        if differ:
            lines.append(f"  (schema differs in {len(differ)} file(s), e.g. {differ[:3]})")
    if schema is not None:
        lines.append("feature schema -> columns:")
        roles = column_checks(schema, list(passthrough))
        for column, role, expected in roles:
            what = _role_name(schema, role)
            missing, wrong, types = [], [], set()
            for key, s in schemas.items():
                if column not in s.names:
                    missing.append(key)
                    continue
                if s.names.count(column) > 1:
                    wrong.append(f"{key}: {s.names.count(column)} columns of that name")
                    continue
                t = s.field(column).type
                types.add(str(t))
                found = check_column(schema, column, role, t)
                if found is not None:
                    wrong.append(f"{key}: {found}")
            status = "ok"
            if missing:
                status = f"MISSING in {len(missing)} file(s) {missing[:3]}"
            if wrong:
                status = (status + "; " if missing else "") + (
                    f"WRONG TYPE: expected {expected}; found {wrong[:3]}"
                )
            tname = ", ".join(sorted(types)) or "-"
            lines.append(f"  {what:<32} <- {column!r} [{tname}]  {status}")
    for key, msg in bad.items():
        lines.append(f"unreadable: {msg}")
    return "\n".join(lines)


def _role_name(schema: Schema, role: str) -> str:
    if role.startswith("sparse:"):
        feat = schema.feature(role.split(":", 1)[1])
        hot = "multi-hot" if feat.multi_hot else "single-hot"
        return f"sparse {feat.name} ({hot} {feat.kind}, table {feat.table})"
    return role
