"""THE one function family that turns raw ids into 64-bit keys. No torch here.

Definition (frozen; golden vectors in ``tests/test_hashing.py`` pin it)::

    fmix64(x)   = murmur3's 64-bit finalizer (a bijection on uint64)
    salt(table) = str_hash(utf8(table), salt=0)
    int key     = fmix64(uint64(raw) ^ salt)                  # bijective per table
    str_hash(b, salt):
        h = salt ^ (len(b) · 0x9E3779B97F4A7C15)
        for each 8-byte little-endian word w of b (last one zero-padded):
            h = fmix64(h ^ w)
        return fmix64(h ^ 0x27D4EB2F165667C5)

All arithmetic is modulo 2**64, so the result is the same on every platform. Keys are
returned as ``int64`` arrays holding the uint64 bit pattern (torch has no uint64 tensors).
A fixed-size table folds keys with ``fold(keys, num_rows)`` (unsigned modulo).

Int ids of one table never collide (``fmix64`` is a bijection). Strings of equal length
never collide either; across lengths, collisions are as for a random 64-bit function.

The hot loops are numba-compiled (``nogil``, cached on disk), so reader threads hash in
parallel; ``*_reference`` versions in plain numpy/Python define the same function and are
what the tests compare against.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import njit

__all__ = [
    "fmix64",
    "table_salt",
    "hash_int64",
    "hash_strings",
    "hash_string_list",
    "fold",
    "owner_of",
    "hex_into",
]

_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_STR_TAG = np.uint64(0x27D4EB2F165667C5)
_OWNER_TAG = np.uint64(0x5BD1E9955BD1E995)
_S33 = np.uint64(33)
_MASK = (1 << 64) - 1
HEX_PAIRS = np.frombuffer(b"".join(b"%02x" % i for i in range(256)), dtype=np.uint8).reshape(256, 2)
"""Each byte value's two lowercase hex digits."""


# --------------------------------------------------------------------------- kernels


@njit(inline="always")
def fmix(k):
    """``fmix64`` for numba kernels (inlined): the mix every hash here and the store's own
    (key map, sketch, dedup, initial vectors, spill index) are built on."""
    k ^= k >> _S33
    k *= _M1
    k ^= k >> _S33
    k *= _M2
    k ^= k >> _S33
    return k


@njit(nogil=True, cache=True)
def _hash_int_kernel(values_u64, salt, out_u64):
    for i in range(values_u64.shape[0]):
        out_u64[i] = fmix(values_u64[i] ^ salt)


@njit(nogil=True, cache=True)
def _hash_str_kernel(offsets, data, salt, out_u64):
    for i in range(offsets.shape[0] - 1):
        start = offsets[i]
        end = offsets[i + 1]
        n = end - start
        h = salt ^ (np.uint64(n) * _GOLDEN)
        p = start
        while p + 8 <= end:
            w = np.uint64(0)
            for b in range(8):
                w |= np.uint64(data[p + b]) << np.uint64(8 * b)
            h = fmix(h ^ w)
            p += 8
        if p < end:
            w = np.uint64(0)
            for b in range(end - p):
                w |= np.uint64(data[p + b]) << np.uint64(8 * b)
            h = fmix(h ^ w)
        out_u64[i] = fmix(h ^ _STR_TAG)


@njit(nogil=True, cache=True)
def _fold_kernel(keys_u64, num_rows, out_i64):
    for i in range(keys_u64.shape[0]):
        out_i64[i] = np.int64(keys_u64[i] % num_rows)


@njit(inline="always")
def owner_rank(key_u64, world_size):
    """Return the owning rank of one key (uint64 bit pattern) among ``world_size`` (uint64):
    ``owner_of``'s rule, callable from numba kernels."""
    return np.int64(fmix(key_u64 ^ _OWNER_TAG) % world_size)


@njit(inline="always")
def put_hex(key_u64, pairs, out, i, col):
    """Write ``key_u64``'s 16 lowercase hex digits, most significant first, into row ``i`` of
    ``out`` (uint8) from column ``col``; ``pairs``: ``HEX_PAIRS``. Callable from numba kernels."""
    for j in range(8):
        v = np.int64((key_u64 >> np.uint64(56 - 8 * j)) & np.uint64(0xFF))
        out[i, col + 2 * j] = pairs[v, 0]
        out[i, col + 2 * j + 1] = pairs[v, 1]


@njit(nogil=True, cache=True)
def _hex_kernel(keys_u64, pairs, out, col):
    for i in range(keys_u64.shape[0]):
        put_hex(keys_u64[i], pairs, out, i, col)


@njit(nogil=True, cache=True)
def _owner_kernel(keys_u64, world_size, out_i64):
    for i in range(keys_u64.shape[0]):
        out_i64[i] = owner_rank(keys_u64[i], world_size)


# --------------------------------------------------------------------------- public API


def fmix64(x: int) -> int:
    """Return murmur3's 64-bit finalizer of the Python int ``x`` (mod 2**64)."""
    x &= _MASK
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _MASK
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & _MASK
    x ^= x >> 33
    return x


def _str_hash_py(b: bytes, salt: int) -> int:
    h = (salt ^ (len(b) * 0x9E3779B97F4A7C15)) & _MASK
    for p in range(0, len(b), 8):
        h = fmix64(h ^ int.from_bytes(b[p : p + 8], "little"))
    return fmix64(h ^ 0x27D4EB2F165667C5)


def table_salt(table: str) -> int:
    """Return the 64-bit salt of the table named ``table`` (a Python int)."""
    return _str_hash_py(table.encode("utf-8"), 0)


@functools.lru_cache(maxsize=4096)
def _salt_u64(salt: int | str) -> np.uint64:
    # remembered: every batch column and every served request hashes with its table's
    # salt, and the name's hash is pure Python
    return np.uint64(table_salt(salt) if isinstance(salt, str) else salt & _MASK)


def hash_int64(values: np.ndarray, salt: int | str) -> np.ndarray:
    """Return int64 keys for the int ids ``values`` hashed with ``salt`` (or a table name)."""
    values = np.ascontiguousarray(values)
    if values.dtype.kind not in "iu":
        raise TypeError(f"hash_int64 expects an integer array, found dtype {values.dtype}")
    src = values.astype(np.int64, copy=False).view(np.uint64)
    out = np.empty(src.shape[0], dtype=np.uint64)
    _hash_int_kernel(src.reshape(-1), _salt_u64(salt), out)
    return out.view(np.int64).reshape(values.shape)


def hash_strings(offsets: np.ndarray, data: np.ndarray, salt: int | str) -> np.ndarray:
    """Return int64 keys for the strings ``data[offsets[i]:offsets[i+1]]`` (UTF-8 bytes).

    This is the layout of an Arrow string array's buffers, so no Python string is built.
    """
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    data = np.ascontiguousarray(data).view(np.uint8)
    if offsets.ndim != 1 or offsets.shape[0] < 1:
        raise ValueError("offsets must be a 1-D array of at least one entry")
    out = np.empty(offsets.shape[0] - 1, dtype=np.uint64)
    _hash_str_kernel(offsets, data, _salt_u64(salt), out)
    return out.view(np.int64)


def hash_string_list(strings: list[str] | list[bytes], salt: int | str) -> np.ndarray:
    """Return int64 keys for a Python list of ``str`` (UTF-8 encoded) or ``bytes``."""
    encoded = [s.encode("utf-8") if isinstance(s, str) else bytes(s) for s in strings]
    lengths = np.fromiter((len(b) for b in encoded), dtype=np.int64, count=len(encoded))
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    data = np.frombuffer(b"".join(encoded), dtype=np.uint8)
    return hash_strings(offsets, data, salt)


def fold(keys: np.ndarray, num_rows: int) -> np.ndarray:
    """Return ``keys`` (uint64 bit patterns in int64) folded into ``[0, num_rows)``."""
    if num_rows <= 0:
        raise ValueError(f"num_rows must be > 0, found {num_rows}")
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    out = np.empty(keys.shape[0], dtype=np.int64)
    _fold_kernel(keys.view(np.uint64), np.uint64(num_rows), out)
    return out


def owner_of(keys: np.ndarray, world_size: int) -> np.ndarray:
    """Return the owning rank of each key: ``fmix64(key ^ tag) % world_size``.

    Re-mixed so ownership is independent of ``fold`` and of the key's low bits.
    """
    if world_size <= 0:
        raise ValueError(f"world_size must be > 0, found {world_size}")
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    out = np.empty(keys.shape[0], dtype=np.int64)
    _owner_kernel(keys.view(np.uint64), np.uint64(world_size), out)
    return out


def hex_into(keys: np.ndarray, out: np.ndarray, col: int) -> None:
    """Write each key's 16 lowercase hex digits (its uint64 bits, most significant first)
    into ``out[i, col : col + 16]`` (uint8 [N, >= col + 16], C-contiguous): the hex part of
    the Redis names of rows, one compiled pass instead of a string a key."""
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    if out.dtype != np.uint8 or out.ndim != 2 or out.shape[0] != keys.shape[0] or out.shape[1] < col + 16:
        raise ValueError(f"out must be uint8 [{keys.shape[0]}, >= {col + 16}], found {out.dtype} {out.shape}")
    _hex_kernel(keys.view(np.uint64), HEX_PAIRS, out, np.int64(col))


# --------------------------------------------------------------------------- references


def hash_int64_reference(values, salt: int | str) -> list[int]:
    """Return the int keys (as signed int64 Python ints) computed in pure Python."""
    s = table_salt(salt) if isinstance(salt, str) else salt & _MASK
    return [_signed(fmix64((int(v) & _MASK) ^ s)) for v in values]


def hash_string_reference(strings, salt: int | str) -> list[int]:
    """Return the string keys (as signed int64 Python ints) computed in pure Python."""
    s = table_salt(salt) if isinstance(salt, str) else salt & _MASK
    return [_signed(_str_hash_py(x.encode() if isinstance(x, str) else x, s)) for x in strings]


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= (1 << 63) else u
