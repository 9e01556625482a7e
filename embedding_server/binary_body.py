"""The binary response (``Accept: application/octet-stream``): float32 rows with a small header.

All integers little-endian uint32; rows little-endian float32, row-major::

    offset      size     field
    0           4        magic b"RSE1"
    4           4        B: result blocks (1 for /v1/lookup; one per lookup for /v1/lookup/batch)
    8           4        L: bytes of the version string
    12          L        version, UTF-8
    then B blocks, each starting on a 4-byte boundary (zero padding before it):
    +0          4        N: vectors (one per id; 1 with pooling "sum"/"mean")
    +4          4        D: dim
    +8          4        M: ids (the found flags that follow)
    +12         M        found flags, one byte per id (1 found, 0 not)
    ...         0-3      zero padding to a 4-byte boundary
    ...         N·D·4    the vectors

``decode`` is the reference reader (Python); any language reads it with two loops.
"""

from __future__ import annotations

import struct

import numpy as np

MAGIC = b"RSE1"
MEDIA_TYPE = "application/octet-stream"


def _pad(n: int) -> bytes:
    return b"\0" * (-n % 4)


def encode(version: str, blocks: list[tuple[np.ndarray, np.ndarray]]) -> bytes:
    """Return the binary body of ``blocks``: (float32 [N, D] vectors, bool [M] found) each."""
    v = version.encode()
    parts = [MAGIC, struct.pack("<II", len(blocks), len(v)), v]
    size = 12 + len(v)
    for vectors, found in blocks:
        vec = np.ascontiguousarray(vectors, dtype="<f4")
        flags = np.asarray(found, dtype=np.uint8).tobytes()
        head = _pad(size) + struct.pack("<III", vec.shape[0], vec.shape[1], len(flags)) + flags
        head += _pad(size + len(head))
        parts += [head, vec.tobytes()]
        size += len(head) + vec.nbytes
    return b"".join(parts)


def decode(body: bytes) -> tuple[str, list[tuple[np.ndarray, np.ndarray]]]:
    """Return (version, [(float32 [N, D] vectors, bool [M] found), ...]) of a binary body."""
    if body[:4] != MAGIC:
        raise ValueError(f"not a recsys binary lookup response (magic {body[:4]!r}, expected {MAGIC!r})")
    nblocks, vlen = struct.unpack_from("<II", body, 4)
    version = body[12 : 12 + vlen].decode()
    pos = 12 + vlen
    blocks = []
    for _ in range(nblocks):
        pos += -pos % 4
        n, d, m = struct.unpack_from("<III", body, pos)
        pos += 12
        found = np.frombuffer(body, dtype=np.uint8, count=m, offset=pos).astype(bool)
        pos += m
        pos += -pos % 4
        vectors = np.frombuffer(body, dtype="<f4", count=n * d, offset=pos).reshape(n, d)
        pos += n * d * 4
        blocks.append((vectors, found))
    if pos != len(body):
        raise ValueError(f"binary lookup response: {len(body) - pos} trailing bytes")
    return version, blocks
