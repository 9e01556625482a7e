"""An LRU cache of row values, bounded in bytes, in front of Redis (one per worker process).

Keys are the rows' Redis key names, which carry the version, so a version switch can never
serve a cached row of another version (old entries simply age out). A published version
is immutable, so "absent" answers are cached too (``MISSING``): an id that was never
trained costs one Redis round trip per version, not one per request.

Charged size of an entry: ``len(name) + len(value) + ENTRY_OVERHEAD`` (the dict slot,
the linked-list node and two bytes objects' headers, measured at ~ 150 bytes on CPython 3.11).
Single-threaded use only (the service's event loop).
"""

from __future__ import annotations

from collections import OrderedDict

MISSING = b""  # a cached "no such row" (a real value is never empty)
ENTRY_OVERHEAD = 150


class ByteLRU:
    """Row values by key name, least-recently-used first out once ``max_bytes`` is passed."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"cache max_bytes must be >= 0 (0: no cache), found {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._data: OrderedDict[bytes, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._data)

    def get_many(self, names: list[bytes]) -> list[bytes | None]:
        """Return each name's cached value (``MISSING`` for a cached absence) or None."""
        if not self.max_bytes:
            self.misses += len(names)
            return [None] * len(names)
        data = self._data
        out = [data.get(n) for n in names]
        hit = 0
        for n, v in zip(names, out):
            if v is not None:
                data.move_to_end(n)
                hit += 1
        self.hits += hit
        self.misses += len(names) - hit
        return out

    def put_many(self, names: list[bytes], values: list[bytes | None]) -> None:
        """Cache ``values`` (None: the row does not exist), evicting the oldest entries."""
        if not self.max_bytes:
            return
        data = self._data
        for n, v in zip(names, values):
            v = MISSING if v is None else v
            old = data.pop(n, None)
            if old is not None:
                self.bytes -= len(n) + len(old) + ENTRY_OVERHEAD
            data[n] = v
            self.bytes += len(n) + len(v) + ENTRY_OVERHEAD
        while self.bytes > self.max_bytes and data:
            n, v = data.popitem(last=False)
            self.bytes -= len(n) + len(v) + ENTRY_OVERHEAD

    def hit_rate(self) -> float:
        """Return hits / lookups so far (0 before any lookup)."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0
