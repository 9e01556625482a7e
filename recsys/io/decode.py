"""Arrow row group → model-ready arrays (once per unit); batches are slices of units.

A converted unit (``UnitData``; ``n`` rows, ``D`` dense columns, ``F1`` single-hot and
``F2`` multi-hot features), column-major so every conversion pass writes contiguously::

    dense        float32 [D, n]      nulls filled, transformed, checked finite
    labels       float32 [n]         checked: 0/1, or in [0, 1] (schema.label_kind); never null
    weights      float32 [n]         schema.weight's values, checked finite, >= 0, never null
                                     ([0] without a weight column)
    single_keys  int64   [F1, n]     hashed (and folded) key per row; anything if null. Ids are
                                     checked: uint64 within int64, string columns UTF-8
    single_len   uint8   [F1, n]     1 = the row has an id, 0 = null (empty bag)
    multi_offs   int64   [F2, n+1]   bag (f, r) = multi_vals[multi_offs[f, r] : multi_offs[f, r+1]]
    multi_vals   int64   [V]         hashed keys, feature-major, null lists/elements dropped
    multi_wts    float32 [V]         each id's weight (1 for unweighted features); [0] when no
                                     feature of the schema is weighted
    extra        {column: [n]}       passthrough columns (int64, float64 or bool)

Rows are stored in the order they will be consumed: when shuffling, the unit's fixed
per-epoch permutation is applied once here, one array (or one feature) at a time so the
source stays in cache. Gathering random rows per batch instead was ~4x slower: every batch
touched every feature's region of every open unit, long evicted. A batch is then a
concatenation of contiguous row ranges, one per unit it draws from, written straight into
the KJT layout: values feature-major, lengths ``[F, B]`` flattened
(``recsys.io.batch_arrays``).

Conversion reads Arrow buffers directly (validity bitmaps, offsets with the array's slice
offset applied): no per-row Python, and hashing runs in numba ``nogil`` kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from numba import njit

from recsys.features import hashing
from recsys.features.dense import DenseStats, DenseTransform, signed_log1p_
from recsys.io.errors import ReadError
from recsys.io.units import expected_sparse, is_list_type, is_numeric_type
from recsys.features.schema import Schema

_EMPTY_U8 = np.zeros(0, dtype=np.uint8)
_EMPTY_I64 = np.zeros(0, dtype=np.int64)
_EMPTY_F32 = np.zeros(0, dtype=np.float32)


# --------------------------------------------------------------------------- kernels


@njit(nogil=True, cache=True)
def _bit(bits, i):
    return (bits[i >> 3] >> (i & 7)) & 1


_F32_MAX = float(np.finfo(np.float32).max)


@njit(nogil=True, cache=True)
def _dense_kernel(raw, bits, bit_off, fill, out, row0):
    """Write raw (nulls → fill) to out[row0:] as float32.

    Return -1 if all went well, the first non-finite row, or -2 - row for the first value
    beyond float32's range (the caller then redoes the column in float64).
    """
    has_bits = bits.shape[0] > 0
    for i in range(raw.shape[0]):
        if has_bits and _bit(bits, bit_off + i) == 0:
            out[row0 + i] = fill
        else:
            v = np.float64(raw[i])
            if not np.isfinite(v):
                return i
            if abs(v) > _F32_MAX:
                return -2 - i
            out[row0 + i] = v
    return -1


@njit(nogil=True, cache=True)
def _label_kernel(raw, binary, out, row0):
    """Write raw to out[row0:] as float32; return -1, or the first row whose value is not a
    label: not exactly 0 or 1 (binary), not in [0, 1] (else; NaN is neither)."""
    for i in range(raw.shape[0]):
        v = np.float64(raw[i])
        if binary:
            if v != 0.0 and v != 1.0:
                return i
        elif not (v >= 0.0 and v <= 1.0):
            return i
        out[row0 + i] = v
    return -1


@njit(nogil=True, cache=True)
def _compact_kernel(offs, row_bits, row_off, elem_bits, elem_off, keys, out_vals, out_offs):
    """Drop null rows' bags and null elements; return the number of values kept."""
    has_rows = row_bits.shape[0] > 0
    has_elems = elem_bits.shape[0] > 0
    c = 0
    out_offs[0] = 0
    for i in range(offs.shape[0] - 1):
        if not has_rows or _bit(row_bits, row_off + i) == 1:
            for p in range(offs[i], offs[i + 1]):
                if not has_elems or _bit(elem_bits, elem_off + p) == 1:
                    out_vals[c] = keys[p]
                    c += 1
        out_offs[i + 1] = c
    return c


@njit(nogil=True, cache=True)
def _permuted_sources(offs, perm, out_offs, src):
    """For bags reordered by perm: fill out_offs and, per output value, its source index."""
    c = 0
    for f in range(offs.shape[0]):
        out_offs[f, 0] = c
        for i in range(perm.shape[0]):
            r = perm[i]
            for p in range(offs[f, r], offs[f, r + 1]):
                src[c] = p
                c += 1
            out_offs[f, i + 1] = c


def _permute_jagged(offs: np.ndarray, vals: np.ndarray, perm: np.ndarray, wts: np.ndarray | None = None):
    """Return (offs, vals, wts) with every feature's bags (and their weights, if given) in perm order.

    Two passes (source indices, then one np.take) run ~2x faster than copying bag by bag:
    the gather's loads are independent, so the CPU overlaps their cache misses.
    """
    out_offs = np.empty_like(offs)
    src = np.empty(vals.shape[0], dtype=np.int64)
    _permuted_sources(offs, perm, out_offs, src)
    return (out_offs, np.take(vals, src, mode="clip"),
            _EMPTY_F32 if wts is None else np.take(wts, src, mode="clip"))


# --------------------------------------------------------------------------- unit data


@dataclass(slots=True)
class UnitData:
    """One converted unit (see module docstring for the layout)."""

    n: int
    dense: np.ndarray
    labels: np.ndarray
    weights: np.ndarray
    single_keys: np.ndarray
    single_len: np.ndarray
    multi_offs: np.ndarray
    multi_vals: np.ndarray
    multi_wts: np.ndarray
    extra: dict[str, np.ndarray]



@dataclass(slots=True)
class _Where:
    file: str
    row_group: int
    row0: int
    """Row number of the row group's first row within the file."""

    def error(self, column: str, expected: str, found: str, row: int | None = None,
              count: int | None = None) -> ReadError:
        """Return the error; ``row`` is within the row group, ``count`` how many rows are bad."""
        if row is not None:
            found = f"{found} (row {self.row0 + row} of the file"
            found += f"; {count} bad rows in the row group)" if count and count > 1 else ")"
        return ReadError(
            file=self.file, row_group=self.row_group, column=column, row=row,
            expected=expected, found=found,
        )


def _validity(arr: pa.Array) -> tuple[np.ndarray, int]:
    """Return (bitmap bytes, bit offset) of arr's nulls, or an empty bitmap if it has none."""
    if arr.null_count == 0:
        return _EMPTY_U8, 0
    buf = arr.buffers()[0]
    return np.frombuffer(buf, dtype=np.uint8), arr.offset


def _fixed_values(arr: pa.Array) -> np.ndarray:
    """Return arr's fixed-width values (slice offset applied; null slots hold anything)."""
    dtype = np.dtype(arr.type.to_pandas_dtype())
    buf = arr.buffers()[1]
    if buf is None or len(arr) == 0:
        return np.zeros(len(arr), dtype=dtype)
    return np.frombuffer(buf, dtype=dtype, count=arr.offset + len(arr))[arr.offset :]


def _numeric(arr: pa.Array) -> pa.Array:
    """Return arr as a type numba reads directly (bools and float16 widened)."""
    t = arr.type
    if pa.types.is_boolean(t):
        return pc.cast(arr, pa.uint8())
    if pa.types.is_float16(t):
        return pc.cast(arr, pa.float32())
    return arr


def _first_null(arr: pa.Array) -> int:
    return int(np.flatnonzero(~arr.is_valid().to_numpy(zero_copy_only=False))[0])




def _take(src: np.ndarray, perm: np.ndarray | None, out: np.ndarray) -> None:
    if perm is None:
        out[...] = src
    else:  # mode="clip" skips numpy's bounds-check buffering (perm is a permutation)
        np.take(src, perm, out=out, mode="clip")


class _TypeMismatch(Exception):
    pass


class _BadIds(Exception):
    """Ids the store must not take: ``mask`` marks them (non-null entries of the array)."""

    def __init__(self, mask: np.ndarray, expected: str, show) -> None:
        self.mask = mask
        self.expected = expected
        self.show = show
        """show(i) -> the i-th entry, as found (for the message)."""


_INT64_MAX = np.iinfo(np.int64).max
_EXPECT_INT64 = "ids within int64 (the service takes int64 ids; an unsigned id above 2**63-1 has none)"
_EXPECT_UTF8 = "UTF-8 text (the column's type is string; keep raw bytes in a binary column)"


class UnitConverter:
    """Turns one row group (an Arrow table of the job's columns) into a UnitData."""

    def __init__(self, schema: Schema, passthrough: list[str], dense_stats: DenseStats | None = None) -> None:
        self.schema = schema
        self.passthrough = list(passthrough)
        self.dense_transform = DenseTransform(schema, dense_stats)
        self.single = []
        self.multi = []
        for f, feat in enumerate(schema.sparse):
            spec = (f, feat, hashing.table_salt(feat.table), schema.tables[feat.table].num_rows)
            (self.multi if feat.multi_hot else self.single).append(spec)
        self.num_features = len(schema.sparse)
        self.weighted = any(f.weighted for f in schema.sparse)
        """Whether batches carry id weights (KJT weights; 1 for the ids of unweighted features)."""
        self.single_fidx = np.array([s[0] for s in self.single], dtype=np.int64)
        self.multi_fidx = np.array([s[0] for s in self.multi], dtype=np.int64)

    # ------------------------------------------------------------------ the unit

    def convert(self, table: pa.Table, file: str, row_group: int, row0: int,
                perm: np.ndarray | None = None) -> UnitData:
        """Return the converted unit, rows in ``perm`` order if given; ReadError on bad data."""
        where = _Where(file, row_group, row0)
        n = table.num_rows
        labels = np.empty(n, dtype=np.float32)
        self._labels(table, where, labels)
        if perm is not None:
            labels = np.take(labels, perm, mode="clip")
        weights = _EMPTY_F32
        if self.schema.weight:
            weights = self._sample_weights(table, where, perm)
        D = len(self.schema.dense)
        dense = np.empty((D, n), dtype=np.float32)
        dt = self.dense_transform
        for j, c in enumerate(self.schema.dense):
            log1p = dt.kinds[j] == "signed_log1p"
            done = self._floats(table, c, where, dense[j], allow_null=True, log1p=log1p,
                                expected="a finite number or null", fill=dt.fills[j])
            if log1p and not done:
                signed_log1p_(dense[j])  # one implementation with the served path (recsys.features.dense)
            elif not log1p:
                dt.apply(j, dense[j])
        if perm is not None:  # row by row: 1-D takes run ~3x faster than one take(axis=1)
            permuted = np.empty_like(dense)
            for j in range(D):
                _take(dense[j], perm, permuted[j])
            dense = permuted
        single_keys = np.empty((len(self.single), n), dtype=np.int64)
        single_len = np.empty((len(self.single), n), dtype=np.uint8)
        for j, (_, feat, salt, num_rows) in enumerate(self.single):
            keys, lens = self._single(table, feat, salt, where)
            if num_rows is not None:
                keys = hashing.fold(keys, num_rows)
            _take(keys, perm, single_keys[j])
            if lens is None:
                single_len[j] = 1
            else:
                _take(lens, perm, single_len[j])
        multi_offs = np.empty((len(self.multi), n + 1), dtype=np.int64)
        parts, wparts, base = [], [], 0
        for j, (_, feat, salt, num_rows) in enumerate(self.multi):
            if feat.weighted:
                vals, offs, wts = self._weighted(table, feat, salt, where)
            else:
                vals, offs = self._multi(table, feat, salt, where)
                wts = np.ones(vals.shape[0], dtype=np.float32) if self.weighted else None
            if num_rows is not None and vals.shape[0]:
                vals = hashing.fold(vals, num_rows)
            np.add(offs, base, out=multi_offs[j])
            base += vals.shape[0]
            parts.append(vals)
            wparts.append(wts)
        multi_vals = np.concatenate(parts) if parts else _EMPTY_I64
        multi_wts = np.concatenate(wparts) if self.weighted else _EMPTY_F32
        if perm is not None and len(self.multi):
            multi_offs, multi_vals, multi_wts = _permute_jagged(multi_offs, multi_vals, perm,
                                                                multi_wts if self.weighted else None)
        extra = {}
        for c in self.passthrough:
            arr = self._passthrough(table, c, where)
            extra[c] = arr if perm is None else np.take(arr, perm, mode="clip")
        return UnitData(n=n, dense=dense, labels=labels, weights=weights, single_keys=single_keys,
                        single_len=single_len, multi_offs=multi_offs, multi_vals=multi_vals,
                        multi_wts=multi_wts, extra=extra)

    def _labels(self, table, where, out) -> None:
        """Fill ``out`` (float32 [n]) from the label column: every value a label of the schema's
        ``label_kind`` (0/1, or a number in [0, 1]); ReadError naming the first other one."""
        column = self.schema.label
        binary = self.schema.label_kind == "binary"
        row0 = 0
        for chunk in table.column(column).chunks:
            if len(chunk) == 0:
                continue
            t = chunk.type
            if not (pa.types.is_null(t) or is_numeric_type(t)):
                raise where.error(column, self.label_expected, f"type {t}")
            if chunk.null_count == 0 and _label_kernel(_fixed_values(_numeric(chunk)), binary, out, row0) < 0:
                row0 += len(chunk)
                continue
            raise self._label_error(table, where)

    def _label_error(self, table, where) -> ReadError:
        """Return the error naming the first null or bad label of the row group (the error path)."""
        column = self.schema.label
        col = table.column(column)
        values = col.cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False)  # nulls -> NaN
        if self.schema.label_kind == "binary":
            ok = (values == 0) | (values == 1)
        else:
            ok = (values >= 0) & (values <= 1)
        bad = np.flatnonzero(~ok)
        first = int(bad[0])
        cell = col[first]
        if not cell.is_valid:
            shown = "null"
        elif pa.types.is_floating(cell.type):  # the shortest text of the stored width: 0.3, not 0.30000001192
            shown = str(np.dtype(cell.type.to_pandas_dtype()).type(cell.as_py()))
        else:
            shown = str(cell.as_py())
        return where.error(column, self.label_expected, shown, row=first, count=int(bad.size))

    def _sample_weights(self, table, where, perm) -> np.ndarray:
        """Return schema.weight's values (float32 [n], in ``perm`` order): finite, >= 0, never null."""
        column, expected = self.schema.weight, "a finite sample weight >= 0"
        out = np.empty(table.num_rows, dtype=np.float32)
        self._floats(table, column, where, out, allow_null=False, expected=expected)
        negative = np.flatnonzero(out < 0)
        if negative.size:
            row = int(negative[0])
            raise where.error(column, expected, repr(float(out[row])), row=row, count=int(negative.size))
        return out if perm is None else np.take(out, perm, mode="clip")

    @property
    def label_expected(self) -> str:
        """What a label must be, in words (for errors)."""
        if self.schema.label_kind == "binary":
            return ("a label of 0 or 1 (schema.label_kind = 'binary'; set it to 'probability' "
                    "for soft labels in [0, 1])")
        return "a label in [0, 1] (schema.label_kind = 'probability')"

    def _floats(self, table, column, where, out, *, allow_null, expected, log1p=False, fill=None) -> bool:
        """Fill ``out`` (float32 [n]) from a numeric column; nulls → ``fill`` (if allowed;
        default ``schema.dense_fill_null``).

        Return True if ``out`` already holds transformed values: a value beyond float32's
        range is fine under signed_log1p, so such a column is transformed in float64 first.
        """
        fill = float(self.schema.dense_fill_null if fill is None else fill)
        row0 = 0
        for chunk in table.column(column).chunks:
            if len(chunk) == 0:
                continue
            if pa.types.is_null(chunk.type):
                if not allow_null:
                    raise where.error(column, expected, "null", row=row0)
                raw = np.zeros(len(chunk), np.float64)
                bits, off = np.zeros((len(chunk) + 7) // 8 + 1, np.uint8), 0
            else:
                t = chunk.type
                if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
                    raise where.error(column, expected, f"type {t}")
                if not allow_null and chunk.null_count:
                    raise where.error(column, expected, "null", row=row0 + _first_null(chunk))
                chunk = _numeric(chunk)
                raw = _fixed_values(chunk)
                bits, off = _validity(chunk)
            bad = _dense_kernel(raw, bits, off, fill, out, row0)
            if bad >= 0:
                raise where.error(column, expected, repr(float(raw[bad])), row=row0 + bad)
            if bad <= -2:
                if not log1p:
                    row = -2 - bad
                    raise where.error(column, f"{expected} within float32 range", repr(float(raw[row])),
                                      row=row0 + row)
                self._wide_log1p(table, column, where, out, expected)
                return True
            row0 += len(chunk)
        return False

    def _wide_log1p(self, table, column, where, out, expected) -> None:
        """The rare path: fill, check and transform the whole column in float64, then narrow."""
        fill = float(self.schema.dense_fill_null)
        col = table.column(column).cast(pa.float64()).fill_null(fill).to_numpy()
        bad = np.flatnonzero(~np.isfinite(col))
        if bad.size:
            raise where.error(column, expected, repr(float(col[bad[0]])), row=int(bad[0]))
        out[:] = np.copysign(np.log1p(np.abs(col)), col)

    def _passthrough(self, table, column, where) -> np.ndarray:
        col = table.column(column)
        t = col.type
        if col.null_count:
            row = 0
            for c in col.chunks:
                if c.null_count:
                    row += _first_null(c)
                    break
                row += len(c)
            raise where.error(column, "a passthrough column without nulls", "null", row=row)
        if pa.types.is_integer(t):
            return col.to_numpy().astype(np.int64, copy=False)
        if pa.types.is_boolean(t):
            return col.to_numpy().astype(np.bool_, copy=False)
        if pa.types.is_floating(t):
            return col.to_numpy().astype(np.float64, copy=False)
        raise where.error(column, "a numeric or boolean passthrough column", f"type {t}")

    # ------------------------------------------------------------------ sparse

    def _chunks(self, table, feat, where, fn):
        out = []
        row0 = 0
        for chunk in table.column(feat.column).chunks:
            if len(chunk) == 0:
                continue
            try:
                out.append(fn(chunk))
            except _TypeMismatch as exc:
                raise where.error(feat.column, expected_sparse(feat), str(exc)) from None
            except _BadIds as exc:  # mask: the rows holding such ids
                rows = np.flatnonzero(exc.mask)
                raise where.error(feat.column, exc.expected, exc.show(int(rows[0])), row=row0 + int(rows[0]),
                                  count=rows.size) from None
            row0 += len(chunk)
        return out

    def _single(self, table, feat, salt, where) -> tuple[np.ndarray, np.ndarray | None]:
        """Return (keys [n], 0/1 lengths [n] or None when no row is null) of one feature."""

        def one(arr):
            if is_list_type(arr.type):
                raise _TypeMismatch(f"{arr.type} (a list column; set multi_hot = true)")
            keys, bits, off = _keys(arr, feat.kind, salt)
            if bits.shape[0] == 0:
                return keys, None
            return keys, np.unpackbits(bits, count=off + len(arr), bitorder="little")[off:]

        pieces = self._chunks(table, feat, where, one)
        if len(pieces) == 1:
            return pieces[0]
        keys = np.concatenate([k for k, _ in pieces])
        if all(v is None for _, v in pieces):
            return keys, None
        lens = np.concatenate([np.ones(len(k), np.uint8) if v is None else v for k, v in pieces])
        return keys, lens

    def _weighted(self, table, feat, salt, where) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Return (vals, offs [n+1] from 0, float32 weights [V]) of one weighted feature.

        Ids and weights come from a ``list<struct<id, weight>>`` column or from two parallel
        list columns (``weight_column``). An id dropped (null id, null list) drops its weight;
        a kept id needs a finite weight >= 0.
        """
        col = table.column(feat.column).combine_chunks()
        if feat.weight_column:
            wcol = table.column(feat.weight_column).combine_chunks()
            if not (is_list_type(wcol.type) and is_numeric_type(wcol.type.value_type)):
                raise where.error(feat.weight_column, f"a list of numeric weights for feature {feat.name!r}",
                                  f"type {wcol.type}")
            ids = col
            n_ids, n_w = pc.list_value_length(ids), pc.list_value_length(wcol)
            bad = pc.fill_null(pc.and_(pc.is_valid(ids), pc.or_kleene(pc.is_null(wcol), pc.not_equal(n_ids, n_w))),
                               False)
            if pc.any(bad).as_py():
                rows = np.flatnonzero(bad.to_numpy(zero_copy_only=False))
                r = int(rows[0])
                found = "null" if not wcol[r].is_valid else f"{n_w[r].as_py()} weights for {n_ids[r].as_py()} ids"
                raise where.error(feat.weight_column, f"a list of weights as long as column {feat.column!r}'s list",
                                  found, row=r, count=int(rows.size))
            weights = pc.if_else(pc.is_valid(ids), wcol, pa.scalar(None, wcol.type))  # a null bag has no weights
            wcolumn = feat.weight_column
        else:
            t = col.type
            if not (is_list_type(t) and pa.types.is_struct(t.value_type) and t.value_type.num_fields == 2):
                raise where.error(feat.column, expected_sparse(feat), f"type {t}")
            struct = t.value_type
            id_i = struct.get_field_index("id") if struct.get_field_index("id") >= 0 else 0
            w_i = 1 - id_i
            if not is_numeric_type(struct.field(w_i).type):
                raise where.error(feat.column, expected_sparse(feat), f"type {t}")
            if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
                col = pc.cast(col, pa.large_list(struct))
            mask = pc.is_null(col) if col.null_count else None
            ids = type(col).from_arrays(col.offsets, pc.struct_field(col.values, [id_i]), mask=mask)
            weights = type(col).from_arrays(col.offsets, pc.struct_field(col.values, [w_i]), mask=mask)
            wcolumn = feat.column
        vals, offs = self._multi(pa.table({feat.column: ids}), feat, salt, where)
        kept = pc.is_valid(pc.list_flatten(ids))  # the ids _bags keeps, in order
        w = pc.list_flatten(weights).filter(kept)
        ok = pc.fill_null(pc.and_(pc.is_finite(pc.cast(w, pa.float64())), pc.greater_equal(w, 0)), False)
        if not pc.all(ok).as_py():
            parents = pc.list_parent_indices(ids).filter(kept).to_numpy()
            bad = np.flatnonzero(~ok.to_numpy(zero_copy_only=False))
            shown = w[int(bad[0])].as_py()
            raise where.error(wcolumn, f"a finite weight >= 0 for each id of feature {feat.name!r}",
                              "null" if shown is None else repr(shown), row=int(parents[bad[0]]),
                              count=int(np.unique(parents[bad]).size))
        return vals, offs, w.to_numpy(zero_copy_only=False).astype(np.float32)

    def _multi(self, table, feat, salt, where) -> tuple[np.ndarray, np.ndarray]:
        """Return (vals, offs [n+1] from 0) of one multi-hot feature."""
        pieces = self._chunks(table, feat, where, lambda arr: _bags(arr, feat.kind, salt))
        if len(pieces) == 1:
            return pieces[0]
        vals = np.concatenate([v for v, _ in pieces])
        offs = [np.zeros(1, dtype=np.int64)]
        base = 0
        for v, o in pieces:
            offs.append(o[1:] + base)
            base += v.shape[0]
        return vals, np.concatenate(offs)


def _bags(arr: pa.Array, kind: str, salt: int) -> tuple[np.ndarray, np.ndarray]:
    """Return (hashed keys, offsets [n+1] from 0) of a list array; null lists/elements dropped."""
    t = arr.type
    n = len(arr)
    if pa.types.is_null(t):
        return _EMPTY_I64, np.zeros(n + 1, dtype=np.int64)
    if not is_list_type(t):
        raise _TypeMismatch(f"{t} (not a list; set multi_hot = false)")
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
        arr = pc.cast(arr, pa.large_list(t.value_type))
        t = arr.type
    dtype = np.int32 if pa.types.is_list(t) else np.int64
    offs = np.frombuffer(arr.buffers()[1], dtype=dtype, count=arr.offset + n + 1)[arr.offset :]
    offs = offs.astype(np.int64)
    start, end = int(offs[0]), int(offs[-1])
    if start:
        offs -= start
    # ListArray.values ignores the slice: take the child range the offsets cover
    child = arr.values.slice(start, end - start)
    row_bits, row_off = _validity(arr)
    try:
        keys, elem_bits, elem_off = _keys(child, kind, salt)
    except _BadIds as exc:
        elems = np.flatnonzero(exc.mask)
        rows = np.searchsorted(offs, elems, side="right") - 1
        live = _valid_mask(row_bits, row_off, n)[rows]  # ids under a null row are dropped anyway
        elems, rows = elems[live], rows[live]
        if rows.size:
            mask = np.zeros(n, dtype=bool)
            mask[rows] = True
            shown = f"{exc.show(int(elems[0]))} in the list"
            raise _BadIds(mask, exc.expected, lambda _: shown) from None
        keys, elem_bits, elem_off = _keys(child, kind, salt, check=False)
    if row_bits.shape[0] == 0 and elem_bits.shape[0] == 0:
        return keys, offs
    out_vals = np.empty(keys.shape[0], dtype=np.int64)
    out_offs = np.empty(n + 1, dtype=np.int64)
    k = _compact_kernel(offs, row_bits, row_off, elem_bits, elem_off, keys, out_vals, out_offs)
    return out_vals[:k], out_offs


def _keys(arr: pa.Array, kind: str, salt: int, check: bool = True) -> tuple[np.ndarray, np.ndarray, int]:
    """Return (hashed keys [n], validity bitmap, bit offset) of a flat id array.

    ``_BadIds`` (when ``check``) if a non-null id is one the service could never be asked
    for: an unsigned int above int64's range, or bytes that are not UTF-8 in a string column.
    """
    t = arr.type
    n = len(arr)
    if pa.types.is_null(t):
        return np.zeros(n, dtype=np.int64), np.zeros((n + 7) // 8 + 1, dtype=np.uint8), 0
    if pa.types.is_dictionary(t):
        if arr.dictionary.null_count:
            return _keys(arr.dictionary_decode(), kind, salt, check)
        indices = _fixed_values(arr.indices)
        bits, off = _validity(arr)
        if len(arr.dictionary) == 0:  # every row null (their indices point nowhere)
            return np.zeros(n, dtype=np.int64), bits, off
        try:  # the distinct values only: checks and hashing are cheap here
            dict_keys, _, _ = _keys(arr.dictionary, kind, salt, check)
        except _BadIds as exc:
            mask = exc.mask[indices] & _valid_mask(bits, off, n)
            if mask.any():
                show = exc.show
                raise _BadIds(mask, exc.expected, lambda i: show(int(indices[i]))) from None
            dict_keys, _, _ = _keys(arr.dictionary, kind, salt, check=False)
        return np.take(dict_keys, indices, mode="clip"), bits, off
    bits, off = _validity(arr)
    if kind == "int64":
        if not pa.types.is_integer(t):
            raise _TypeMismatch(str(t))
        values = _fixed_values(arr)
        if check and values.dtype == np.uint64 and n:
            _check_uint64(values, bits, off)
        return hashing.hash_int64(values, salt), bits, off
    if check and (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)):
        _check_utf8(arr)
    if pa.types.is_string_view(t) or pa.types.is_binary_view(t):
        arr = pc.cast(arr, pa.large_binary())
        t = arr.type
    if pa.types.is_string(t) or pa.types.is_binary(t):
        odt = np.int32
    elif pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        odt = np.int64
    else:
        raise _TypeMismatch(str(t))
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=odt, count=arr.offset + n + 1)[arr.offset :]
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else _EMPTY_U8
    return hashing.hash_strings(offsets, data, salt), bits, off


def _valid_mask(bits: np.ndarray, off: int, n: int) -> np.ndarray:
    if bits.shape[0] == 0:
        return np.ones(n, dtype=bool)
    return np.unpackbits(bits, count=off + n, bitorder="little")[off:] == 1


def _check_uint64(values: np.ndarray, bits: np.ndarray, off: int) -> None:
    """Raise _BadIds if a non-null uint64 id is beyond int64 (the check is one vectorized max)."""
    if values.max() <= _INT64_MAX:
        return
    mask = (values > _INT64_MAX) & _valid_mask(bits, off, values.shape[0])
    if mask.any():
        raise _BadIds(mask, _EXPECT_INT64, lambda i: str(values[i]))


def _check_utf8(arr: pa.Array) -> None:
    """Raise _BadIds if a non-null value of a string array is not UTF-8.

    Arrow's full validation checks UTF-8 (~2 ms per 65k short strings; the reader reads
    string id columns as dictionaries, so it runs on the distinct values only); the slow
    search for the culprits runs only when it fails.
    """
    try:
        arr.validate(full=True)
        return
    except pa.ArrowInvalid:
        pass
    raw = pc.cast(arr, pa.large_binary()).to_pylist()
    mask = np.zeros(len(raw), dtype=bool)
    for i, b in enumerate(raw):
        if b is not None:
            try:
                b.decode("utf-8")
            except UnicodeDecodeError:
                mask[i] = True
    if mask.any():
        raise _BadIds(mask, _EXPECT_UTF8, lambda i: f"{raw[i][:40]!r} (not UTF-8)")
