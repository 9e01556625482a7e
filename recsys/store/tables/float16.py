"""Float16 rows: the conversions a table and the spill tier share, as numba kernels.

numba has no float16 type and numpy converts float16 in software (~8x slower than these
loops), so float16 rows are moved as uint16 bit patterns and converted here: IEEE
binary16, round to nearest even, overflow to inf, subnormals kept; NaN becomes a quiet NaN.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(inline="always")
def _f32_to_f16_bits(x):
    sign = (x >> np.uint32(16)) & np.uint32(0x8000)
    a = x & np.uint32(0x7FFFFFFF)
    if a > np.uint32(0x7F800000):  # NaN
        return np.uint16(sign | np.uint32(0x7E00))
    if a >= np.uint32(0x477FF000):  # >= 65520 rounds past the largest half, 65504
        return np.uint16(sign | np.uint32(0x7C00))
    if a < np.uint32(0x38800000):  # below 2^-14: a subnormal half (or zero)
        if a <= np.uint32(0x33000000):  # <= 2^-25: the tie at 2^-25 goes to even, zero
            return np.uint16(sign)
        e = a >> np.uint32(23)
        m = (a & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
        shift = np.uint32(126) - e  # value / 2^-24 = m >> shift, 14 <= shift <= 24
        q = m >> shift
        rem = m & ((np.uint32(1) << shift) - np.uint32(1))
        halfway = np.uint32(1) << (shift - np.uint32(1))
    else:
        q = (a - np.uint32(0x38000000)) >> np.uint32(13)  # rebias 127 -> 15, keep 10 bits
        rem = a & np.uint32(0x1FFF)
        halfway = np.uint32(0x1000)
    if rem > halfway or (rem == halfway and (q & np.uint32(1))):
        q += np.uint32(1)  # a carry into the exponent is the right answer
    return np.uint16(sign | q)


@njit(inline="always")
def _f16_bits_to_f32_bits(h):
    h32 = np.uint32(h)
    sign = (h32 & np.uint32(0x8000)) << np.uint32(16)
    e = (h32 >> np.uint32(10)) & np.uint32(0x1F)
    m = h32 & np.uint32(0x3FF)
    if e == np.uint32(0):
        if m == np.uint32(0):
            return sign
        e32 = np.uint32(113)
        while (m & np.uint32(0x400)) == np.uint32(0):
            m <<= np.uint32(1)
            e32 -= np.uint32(1)
        return sign | (e32 << np.uint32(23)) | ((m & np.uint32(0x3FF)) << np.uint32(13))
    if e == np.uint32(31):
        return sign | np.uint32(0x7F800000) | (m << np.uint32(13))
    return sign | ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13))


@njit(nogil=True, cache=True)
def _f16_table_kernel(out_u32):
    for h in range(out_u32.shape[0]):
        out_u32[h] = _f16_bits_to_f32_bits(np.uint16(h))


@njit(nogil=True, cache=True)
def gather_f16_kernel(w16, rows, lut_u32, out_u32):
    """``out[i] = float32(w[rows[i]])`` via the 64k-entry table, zeros where ``rows[i] < 0``."""
    for i in range(rows.shape[0]):
        r = rows[i]
        if r < 0:
            out_u32[i, :] = 0
        else:
            for d in range(out_u32.shape[1]):
                out_u32[i, d] = lut_u32[w16[r, d]]


_F16_LUT = None


def f16_lut() -> np.ndarray:
    """Return float32 bit patterns of all 65536 float16 values (built on first use: 256 KiB)."""
    global _F16_LUT
    if _F16_LUT is None:
        lut = np.empty(1 << 16, dtype=np.uint32)
        _f16_table_kernel(lut)
        _F16_LUT = lut
    return _F16_LUT


@njit(nogil=True, cache=True)
def scatter_f16_kernel(in_u32, w16, rows):
    """``w[rows[i]] = float16(in[i])`` for ``rows[i] >= 0``."""
    for i in range(rows.shape[0]):
        r = rows[i]
        if r >= 0:
            for d in range(in_u32.shape[1]):
                w16[r, d] = _f32_to_f16_bits(in_u32[i, d])


def to_float16(values: np.ndarray) -> np.ndarray:
    """Return float32 ``values`` [N, D] rounded to float16 by this module's kernel."""
    src = np.ascontiguousarray(values, dtype=np.float32)
    out = np.empty(src.shape, dtype=np.float16)
    scatter_f16_kernel(src.view(np.uint32), out.view(np.uint16), np.arange(src.shape[0]))
    return out


def to_float32(values: np.ndarray) -> np.ndarray:
    """Return float16 ``values`` [N, D] widened to float32 by this module's kernel."""
    src = np.ascontiguousarray(values, dtype=np.float16)
    out = np.empty(src.shape, dtype=np.float32)
    gather_f16_kernel(src.view(np.uint16), np.arange(src.shape[0]), f16_lut(), out.view(np.uint32))
    return out
