"""A batch as numpy arrays in the KJT layout, all in one buffer (``BatchArrays``), assembled
from row ranges of converted units (``recsys.io.decode``'s ``UnitData``).

A batch is a concatenation of contiguous row ranges, one per unit it draws from, written
straight into the KJT layout: values feature-major, lengths ``[F, B]`` flattened, every
array a view into one buffer (at 64-byte aligned offsets) that ``alloc`` provides (shared
memory in a worker process). The per-feature copies are numba ``nogil`` kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from recsys.io.decode import UnitConverter, UnitData


# --------------------------------------------------------------------------- kernels


@njit(nogil=True, cache=True)
def _slice_totals(single_len, multi_offs, start, t, single_fidx, multi_fidx, totals):
    """Add each feature's value count over rows [start, start + t) to totals[f]."""
    for j in range(single_len.shape[0]):
        s = 0
        for i in range(start, start + t):
            s += single_len[j, i]
        totals[single_fidx[j]] += s
    for j in range(multi_offs.shape[0]):
        totals[multi_fidx[j]] += multi_offs[j, start + t] - multi_offs[j, start]


@njit(nogil=True, cache=True)
def _slice_weights(single_len, multi_offs, multi_wts, start, t, single_fidx, multi_fidx, out, cursor):
    """The weights of ``_slice_sparse``'s values: 1 per single-hot id, the bags' own weights."""
    for j in range(single_len.shape[0]):
        f = single_fidx[j]
        c = cursor[f]
        for i in range(t):
            if single_len[j, start + i]:
                out[c] = 1.0
                c += 1
        cursor[f] = c
    for j in range(multi_offs.shape[0]):
        f = multi_fidx[j]
        lo = multi_offs[j, start]
        hi = multi_offs[j, start + t]
        c = cursor[f]
        out[c : c + hi - lo] = multi_wts[lo:hi]
        cursor[f] = c + hi - lo


@njit(nogil=True, cache=True)
def _slice_sparse(single_keys, single_len, multi_offs, multi_vals, start, t,
                  single_fidx, multi_fidx, lengths, col0, out, cursor):
    """Append rows [start, start + t) of every feature: lengths[f, col0:], values at cursor[f]."""
    for j in range(single_keys.shape[0]):
        f = single_fidx[j]
        c = cursor[f]
        for i in range(t):
            n = single_len[j, start + i]
            lengths[f, col0 + i] = n
            if n:
                out[c] = single_keys[j, start + i]
                c += 1
        cursor[f] = c
    for j in range(multi_offs.shape[0]):
        f = multi_fidx[j]
        for i in range(t):
            lengths[f, col0 + i] = multi_offs[j, start + i + 1] - multi_offs[j, start + i]
        lo = multi_offs[j, start]
        hi = multi_offs[j, start + t]
        c = cursor[f]
        out[c : c + hi - lo] = multi_vals[lo:hi]
        cursor[f] = c + hi - lo


# --------------------------------------------------------------------------- batches


@dataclass(slots=True)
class BatchArrays:
    """A batch as numpy arrays in the KJT layout (see ``recsys.io.batch``), all views into one
    buffer so that crossing a process boundary moves a single shared-memory block."""

    buffer: np.ndarray
    """uint8, holds every array below."""
    owner: object
    """What allocated ``buffer`` (a shared-memory tensor in worker processes), or None."""
    layout: dict[str, tuple[int, str, tuple[int, ...]]]
    """Array name → (byte offset in buffer, numpy dtype name, shape)."""
    dense: np.ndarray
    labels: np.ndarray
    values: np.ndarray
    lengths: np.ndarray
    """int32 [F * B], feature-major."""
    length_per_key: list[int]
    offset_per_key: list[int]
    extra: dict[str, np.ndarray]


def numpy_alloc(nbytes: int) -> tuple[None, np.ndarray]:
    """The default batch allocator: (no owner, a fresh uint8 array)."""
    return None, np.empty(nbytes, dtype=np.uint8)


def _plan_layout(specs: list[tuple[str, np.dtype, tuple[int, ...]]]) -> tuple[dict, int]:
    layout, off = {}, 0
    for name, dtype, shape in specs:
        layout[name] = (off, np.dtype(dtype).name, shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        off += -(-nbytes // 64) * 64  # 64-byte aligned segments
    return layout, off


def assemble(pieces: list[tuple[UnitData, int, int]], conv: UnitConverter, alloc=numpy_alloc) -> BatchArrays:
    """Return the batch made of rows ``[start, start + t)`` of each piece's unit, in order.

    ``alloc(nbytes) -> (owner, uint8 array)`` provides the one buffer the batch lives in.
    """
    B = sum(t for _, _, t in pieces)
    F = conv.num_features
    first = pieces[0][0]
    totals = np.zeros(F, dtype=np.int64)
    for unit, start, t in pieces:
        _slice_totals(unit.single_len, unit.multi_offs, start, t, conv.single_fidx, conv.multi_fidx, totals)
    offsets = np.zeros(F + 1, dtype=np.int64)
    np.cumsum(totals, out=offsets[1:])
    specs = [
        ("values", np.int64, (int(offsets[-1]),)),
        ("dense", np.float32, (B, first.dense.shape[0])),
        ("labels", np.float32, (B,)),
        *((("weights", np.float32, (B,)),) if conv.schema.weight else ()),
        *((("id_weights", np.float32, (int(offsets[-1]),)),) if conv.weighted else ()),
        ("lengths", np.int32, (F * B,)),
        *((f"extra.{c}", a.dtype, (B,)) for c, a in first.extra.items()),
    ]
    layout, nbytes = _plan_layout(specs)
    owner, buffer = alloc(nbytes)
    views = {}
    for name, (off, dtype, shape) in layout.items():
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        views[name] = buffer[off : off + size].view(dtype).reshape(shape)
    dense, labels, values = views["dense"], views["labels"], views["values"]
    weights = views.get("weights")
    lengths = views["lengths"].reshape(F, B)
    extra = {c: views[f"extra.{c}"] for c in first.extra}
    pos = 0
    for unit, start, t in pieces:
        dense[pos : pos + t] = unit.dense[:, start : start + t].T
        labels[pos : pos + t] = unit.labels[start : start + t]
        if weights is not None:
            weights[pos : pos + t] = unit.weights[start : start + t]
        for c, arr in extra.items():
            arr[pos : pos + t] = unit.extra[c][start : start + t]
        pos += t
    cursor = offsets[:-1].copy()
    pos = 0
    for unit, start, t in pieces:
        _slice_sparse(unit.single_keys, unit.single_len, unit.multi_offs, unit.multi_vals, start, t,
                      conv.single_fidx, conv.multi_fidx, lengths, pos, values, cursor)
        pos += t
    if conv.weighted:
        id_weights, cursor = views["id_weights"], offsets[:-1].copy()
        for unit, start, t in pieces:
            _slice_weights(unit.single_len, unit.multi_offs, unit.multi_wts, start, t, conv.single_fidx,
                           conv.multi_fidx, id_weights, cursor)
    return BatchArrays(
        buffer=buffer, owner=owner, layout=layout, dense=dense, labels=labels, values=values,
        lengths=views["lengths"], length_per_key=totals.tolist(), offset_per_key=offsets.tolist(),
        extra=extra,
    )
