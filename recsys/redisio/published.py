"""How published versions lie in Redis: key names, row values, manifests and the alias.

The protocol between what writes rows to Redis (``recsys export``) and what reads them (the
lookup service); live rows (``recsys.redisio.live``) use its row keys too. No torch here.

Legend: ``N`` rows of a call, ``D`` dim, ``B`` buckets per table.

Keys (``ns`` the namespace, default ``recsys``; ``v`` the version; names are restricted to
``[A-Za-z0-9_.-]`` so none holds a ``{``, ``}``, ``:`` or glob character)::

    ns:current                      string: the version served now (the alias; one SET flips it)
    ns:versions                     hash: version -> {"state": writing|flipping|ready|failed|
                                    deleting, "started", "heartbeat", "rows", "superseded_at"}
                                    (JSON); the registry export and gc use (``publish``)
    ns:manifest:v                   string: the version's manifest (JSON; ``Catalog.to_manifest``)
    ns:{v:table:bbbb}:kkkkkkkkkkkkkkkk
                                    string: one row; bbbb = bucket (4 hex digits), k = the
                                    key's uint64 bits in 16 hex digits

One string key per row, hash-tagged by (version, table, bucket) with ``bucket =
owner_of(key, B)`` (``recsys.features.hashing``: a re-mix of the key, independent of the low bits):
a Redis Cluster spreads a table over ``B`` slots, and the keys of one bucket share a slot,
so a request's ids become one MGET per bucket, pipelined per node. On a single Redis
the tags mean nothing and a request is one MGET. Chosen by measurement over one hash per
bucket (HSET/HMGET): 200 k rows x 64 float32 on Redis 7.0, one string per row took 426
bytes per row (payload 256) and read 2.5x faster (one MGET vs. a dozen HMGETs per
request); a hash per bucket took 379 bytes per row. Binary keys instead of hex would save
16 bytes per row (4 %); hex keys stay readable in ``redis-cli --scan``.

Values: the row's ``D`` numbers, little-endian float32 or float16 (the manifest's dtype),
nothing else: decoded with ``np.frombuffer``.
"""

from __future__ import annotations

import functools
import re

import numpy as np
from numba import njit

from recsys.features import hashing
from recsys.redisio.client import glob_escape

NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")
DTYPES = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2")}


RESERVED_VERSIONS = {"live": "the version component of live rows (recsys.redisio.live.VERSION): a version "
                               "named so would share its row keys with the live rows of a namespace of that name"}
"""Names no published version may have, and why: every other key of the two layouts has a
fixed word (``current``, ``versions``, ``manifest``, ``live``) before any version name, and
names hold no ``:``, so only the version part of a row key can collide."""


def check_name(value: str, what: str) -> str:
    """Return ``value`` if it is a valid namespace or version name, else raise ``ValueError``."""
    if not isinstance(value, str) or not NAME.match(value):
        raise ValueError(f"{what} must match {NAME.pattern} (letters, digits, '_', '.', '-'), found {value!r}")
    return value


def check_version(value: str, what: str) -> str:
    """Return ``value`` if it may name a published version (``check_name``, and not one of
    ``RESERVED_VERSIONS``), else raise ``ValueError`` naming ``what``. The export and the gc
    check every version name with it; the lookup service may check ``current`` with it too."""
    check_name(value, what)
    if value in RESERVED_VERSIONS:
        raise ValueError(f"{what} {value!r} is reserved ({RESERVED_VERSIONS[value]}); pick another name")
    return value


def current_key(ns: str) -> str:
    """Return the alias key naming the served version."""
    return f"{ns}:current"


def registry_key(ns: str) -> str:
    """Return the hash key of the versions' states."""
    return f"{ns}:versions"


def manifest_key(ns: str, version: str) -> str:
    """Return the key of ``version``'s manifest."""
    return f"{ns}:manifest:{version}"


def version_pattern(ns: str, version: str) -> str:
    """Return the SCAN MATCH pattern of every row key of ``version``."""
    return f"{glob_escape(ns)}:{{{glob_escape(version)}:*"


def buckets_of(keys_N: np.ndarray, buckets: int) -> np.ndarray:
    """Return each key's bucket in ``[0, buckets)``."""
    return hashing.owner_of(keys_N, buckets)


def by_bucket(buckets_N: np.ndarray) -> list[np.ndarray]:
    """Return the row positions of each bucket present (one hash slot per group), each
    group in row order."""
    order = np.argsort(buckets_N, kind="stable")
    return np.split(order, np.flatnonzero(np.diff(buckets_N[order])) + 1)


def row_keys(ns: str, version: str, table: str, keys_N: np.ndarray, buckets: int) -> list[bytes]:
    """Return the Redis key of each of ``keys_N`` (vectorized: no per-key formatting)."""
    buf = row_key_bytes(ns, version, table, keys_N, buckets)
    if buf.shape[0] == 0:
        return []
    return buf.view(f"S{buf.shape[1]}").reshape(buf.shape[0]).tolist()


def row_key_bytes(ns: str, version: str, table: str, keys_N: np.ndarray, buckets: int) -> np.ndarray:
    """Return uint8 [N, K]: the Redis key of each of ``keys_N``, one per row (all of one length).
    One compiled call: for the few dozen keys a served request misses, the seven numpy calls
    this took before cost more than the work (6 % of a lookup service worker's CPU)."""
    if buckets <= 0:
        raise ValueError(f"buckets must be > 0, found {buckets}")
    keys = np.ascontiguousarray(keys_N, dtype=np.int64)
    prefixes = _prefixes(ns, version, table, buckets)
    buf = np.empty((keys.shape[0], prefixes.shape[1] + 16), dtype=np.uint8)
    _row_key_kernel(keys.view(np.uint64), np.uint64(buckets), prefixes, hashing.HEX_PAIRS, buf)
    return buf


@njit(nogil=True, cache=True)
def _row_key_kernel(keys_u64, buckets_u64, prefixes, hex_digits, out):
    """Row ``i`` of ``out``: the prefix of key ``i``'s bucket, then the key's 16 hex digits."""
    p = prefixes.shape[1]
    for i in range(keys_u64.shape[0]):
        k = keys_u64[i]
        b = hashing.owner_rank(k, buckets_u64)
        for j in range(p):
            out[i, j] = prefixes[b, j]
        hashing.put_hex(k, hex_digits, out, i, p)


@functools.lru_cache(maxsize=1024)
def _prefixes(ns: str, version: str, table: str, buckets: int) -> np.ndarray:
    """Return uint8 [buckets, P]: every bucket's key prefix (all of one length: fixed-width bucket)."""
    arr = np.array([f"{ns}:{{{version}:{table}:{b:04x}}}:".encode() for b in range(buckets)])
    return arr.view(np.uint8).reshape(buckets, arr.dtype.itemsize)


def parse_row_key(name: bytes) -> tuple[str, str, int]:
    """Return (version, table, key) of a row key (``ValueError`` if it is not one)."""
    try:
        head, hexkey = name.rsplit(b":", 1)
        tag = head[head.index(b"{") + 1 : head.rindex(b"}")].decode()
        version, table, _bucket = tag.split(":")
        key = int(hexkey, 16)
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"not a row key: {name[:80]!r}") from None
    return version, table, key - (1 << 64) if key >= (1 << 63) else key


def encode_rows(rows_ND: np.ndarray, dtype: str) -> list[bytes]:
    """Return one little-endian value per row, in the storage ``dtype`` (float16: rounded to nearest even)."""
    arr = np.ascontiguousarray(rows_ND, dtype=DTYPES[dtype])
    if arr.shape[0] == 0:
        return []
    return arr.view(np.dtype((np.void, arr.shape[1] * arr.itemsize))).reshape(-1).tolist()


def decode_rows(values: list[bytes], dim: int, dtype: str, where: str) -> np.ndarray:
    """Return float32 [N, dim] rows from values written by ``encode_rows`` (all present)."""
    dt = DTYPES[dtype]
    size = dim * dt.itemsize
    blob = b"".join(values)
    if len(blob) != size * len(values) or set(map(len, values)) - {size}:
        bad = next(len(v) for v in values if len(v) != size)
        raise ValueError(f"{where}: a row value has {bad} bytes, expected {size} ({dim} x {dtype})")
    return np.frombuffer(blob, dtype=dt).reshape(len(values), dim).astype(np.float32, copy=False)


def checksum(keys_N: np.ndarray, values: list[bytes]) -> int:
    """Return an order-independent 64-bit checksum of (key, value) pairs.

    ``sum over rows of fmix64(str_hash(value) ^ hash_int64(key))`` modulo 2**64, so shards
    and chunks can be summed in any order.
    """
    if not values:
        return 0
    lengths = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    data = np.frombuffer(b"".join(values), dtype=np.uint8)
    row_hash = hashing.hash_strings(offsets, data, 0) ^ hashing.hash_int64(keys_N, 0x5EED)
    mixed = hashing.hash_int64(row_hash, 0).view(np.uint64)
    return int(mixed.sum(dtype=np.uint64))


def unlink_version(client, ns: str, version: str, batch: int = 1000) -> int:
    """Delete every row key of ``version`` with SCAN + UNLINK (never KEYS); return how many.
    ``recsys export --gc`` removes versions with it, a live namespace's takeover its rows."""
    n = 0
    names = []
    for name in client.scan_iter(match=version_pattern(ns, version), count=batch):
        names.append(name)
        if len(names) >= batch:
            n += client.unlink(*names)
            names = []
    if names:
        n += client.unlink(*names)
    return n
