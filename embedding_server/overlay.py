"""Live rows over a published version (``recsys serve --follow NS``): when to overlay, and with what.

A training job pushes fresh rows of the keys it touched into a live namespace
(``recsys.redisio.live``: the layout, the step prefix and the Lua guard). The service
reads that namespace's manifest at every refresh of the served version and overlays its
rows on the version only when the two agree on how a raw id becomes a row:

- every live table is a table of the published version, with the same dim and the same
  hashing salt (so a key means the same id in both);
- the live manifest is one this code reads (format, dtype, buckets).

Otherwise ``incompatibility`` says why, the service serves the published rows only and
/readyz shows the reason. An ``Overlay`` is what a request needs to read live rows: the
namespace, the value dtype, the buckets, the dims, and the per-worker TTL caches of live
rows (``cache.LiveTableCache``; None when the TTL is 0). A request takes it with its
snapshot, like the version, so the rows it reads are decoded with one manifest.
"""

from __future__ import annotations

from dataclasses import dataclass

from embedding_server.cache import CacheBudget
from embedding_server.catalog import Catalog


MAX_BUCKETS = 1 << 16
"""Buckets a row key can name (4 hex digits, ``recsys.redisio.published``)."""


@dataclass(frozen=True, slots=True)
class Overlay:
    """The live namespace a request overlays on its version (see the module doc)."""

    ns: str
    dtype: str
    buckets: int
    dims: dict[str, int]
    """The live tables and their dims (all of them tables of the served version)."""
    run: str
    identity: tuple
    """What the cached live rows depend on (a new run, dtype, buckets or dims: new caches)."""
    caches: CacheBudget | None
    """Live row caches, one per live table (None: TTL 0, every request reads Redis)."""
    ttl_s: float

    def describe(self) -> str:
        tables = ", ".join(f"{n} ({d})" for n, d in self.dims.items())
        ttl = f"cached {self.ttl_s:g} s" if self.caches is not None else "not cached"
        return f"run {self.run!r}, {self.dtype}, tables {tables}; live rows {ttl}"


def incompatibility(manifest: dict, catalog: Catalog) -> str | None:
    """Return why ``manifest`` (a parsed live manifest) cannot overlay ``catalog``, or None.
    Every field a request reads is checked here, so no request fails on it later."""
    buckets = manifest["buckets"]
    if type(buckets) is not int or not 1 <= buckets <= MAX_BUCKETS:
        return f"buckets {buckets!r:.40}, expected an integer in [1, {MAX_BUCKETS}]"
    if not isinstance(manifest["tables"], dict) or not manifest["tables"]:
        return "the live manifest names no tables"
    for name, table in manifest["tables"].items():
        if not isinstance(table, dict) or type(table.get("dim")) is not int:
            return f"live table {name!r:.60} has no integer dim"
    salts = manifest.get("salts")
    if not isinstance(salts, dict):
        return "the live manifest has no hashing salts"
    for name, table in manifest["tables"].items():
        published = catalog.tables.get(name)
        if published is None:
            return f"live table {name!r} is not in the published version (its tables: {sorted(catalog.tables)})"
        if int(table["dim"]) != published.dim:
            return f"live table {name!r} has dim {int(table['dim'])}, the published version {published.dim}"
        salt = salts.get(name)
        try:
            same = salt is not None and int(salt, 16) == published.salt
        except (TypeError, ValueError):
            same = False
        if not same:
            return (f"live table {name!r} was hashed with salt {salt!r}, the published version with "
                    f"{published.salt:016x}: its keys would name other ids")
    return None


def identity(manifest: dict) -> tuple:
    """Return what cached live rows of ``manifest``'s namespace depend on."""
    dims = tuple(sorted((n, int(t["dim"])) for n, t in manifest["tables"].items()))
    return (manifest.get("run"), manifest.get("started"), manifest["dtype"], int(manifest["buckets"]), dims)


def build(ns: str, manifest: dict, catalog: Catalog, cache_bytes: int, ttl_s: float,
          previous: Overlay | None = None) -> Overlay:
    """Return the overlay of a compatible live ``manifest`` on ``catalog``.

    The caches of ``previous`` are kept when the live rows they hold still mean the same
    (same run start, dtype, buckets and dims); otherwise they start empty."""
    ident = identity(manifest)
    dims = {n: int(t["dim"]) for n, t in manifest["tables"].items()}
    if previous is not None and previous.identity == ident and previous.ttl_s == ttl_s:
        caches = previous.caches
    elif ttl_s > 0:
        caches = CacheBudget(cache_bytes, {n: (catalog.tables[n].rows, d) for n, d in dims.items()}, ttl_s=ttl_s)
    else:
        caches = None
    return Overlay(ns=ns, dtype=manifest["dtype"], buckets=int(manifest["buckets"]), dims=dims,
                   run=str(manifest.get("run", "")), identity=ident, caches=caches, ttl_s=ttl_s)


def version_string(version: str, live_step: int | None) -> str:
    """Return the ``version`` field of a response: the published version, plus ``+live@<step>``
    (the newest step among the live rows it served) when it served any."""
    return version if live_step is None else f"{version}+live@{live_step}"

