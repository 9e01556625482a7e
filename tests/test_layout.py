"""Redis key names of published and live rows: the documented format, byte for byte."""

from __future__ import annotations

import numpy as np

from recsys.redisio import published as layout


def test_row_keys_are_the_documented_format():
    """``ns:{version:table:bbbb}:kkkkkkkkkkkkkkkk``: bucket as 4 hex digits, the key as the 16
    hex digits of its unsigned 64-bit value (formatted here one key at a time, in Python)."""
    rng = np.random.default_rng(3)
    keys = np.concatenate([np.array([0, 1, -1, 2**63 - 1, -(2**63), 0x0123456789ABCDEF], dtype=np.int64),
                           rng.integers(-(2**63), 2**63 - 1, 2000, dtype=np.int64)])
    buckets = layout.buckets_of(keys, 64)
    expected = [f"ns:{{live:t7:{int(b):04x}}}:{int(k) & (2**64 - 1):016x}".encode() for k, b in zip(keys, buckets)]
    assert layout.row_keys("ns", "live", "t7", keys, 64) == expected
    assert [layout.parse_row_key(name) for name in expected[:6]] == [("live", "t7", int(k)) for k in keys[:6].tolist()]
