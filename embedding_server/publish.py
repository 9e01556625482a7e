"""``recsys export``: publish a checkpoint's embeddings to Redis as a new version, then flip
the alias; and ``recsys export --gc``: remove failed, abandoned and old versions.

Legend: ``N`` rows of a chunk, ``B`` buckets per table.

    checkpoint shards ──► chunks of N rows (key, embedding) ──► storage dtype
        ──► group by bucket ──► one MSET per bucket (pipelined, one round trip per chunk)
    registry: ns:versions[v] = writing (heartbeat every chunk)
    verify: EXISTS over every written key == rows per table; a sample read back byte-equal
    manifest ──► ns:manifest:v ;  registry: ready ;  SET ns:current v   (the atomic flip)
    prune: ready versions beyond the newest ``keep`` ──► SCAN MATCH ns:{v:* + UNLINK

An export that fails midway marks its version ``failed`` (or, if the process died, leaves
it ``writing`` with a heartbeat that stops): ``current`` is untouched, and ``gc`` removes
it (``writing`` ones once their heartbeat is older than ``grace_s``). Layout: ``layout``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from embedding_server import layout
from embedding_server.catalog import Catalog
from recsys import checkpoint_files
from recsys.redis_util import connect, redact

log = logging.getLogger(__name__)

SAMPLE_PER_CHUNK = 4  # rows of every chunk read back after the write (byte-compared)


@dataclass(kw_only=True, slots=True)
class ExportSettings:
    """How ``export`` writes a version."""

    namespace: str = "recsys"
    """Prefix of every key (one namespace per serving deployment)."""
    version: str = ""
    """Version name; default ``s<step>-<UTC time>``."""
    dtype: str = "float32"
    """Storage type of the rows in Redis: float32 (exact) or float16 (half the memory, rounded)."""
    keep: int = 3
    """Ready versions kept (the new one included); older ones are deleted."""
    tables: list[str] | None = None
    """Tables to publish (default: all)."""
    buckets: int = 64
    """Hash-tag buckets per table: the Redis Cluster slots a table spreads over."""
    chunk_rows: int = 20_000
    """Rows per pipelined round trip (bounds the exporter's memory)."""
    timeout_s: float = 30.0
    """Socket timeout of one Redis call."""

    def __post_init__(self) -> None:
        layout.check_name(self.namespace, "namespace")
        if self.version:
            layout.check_name(self.version, "version")
        if self.dtype not in layout.DTYPES:
            raise ValueError(f"dtype must be one of {list(layout.DTYPES)}, found {self.dtype!r}")
        if self.keep < 1:
            raise ValueError(f"keep must be >= 1 (the new version is kept), found {self.keep}")
        if not 1 <= self.buckets <= 4096:
            raise ValueError(f"buckets must be in [1, 4096], found {self.buckets}")
        if not 1 <= self.chunk_rows <= 1_000_000:
            raise ValueError(f"chunk_rows must be in [1, 1000000], found {self.chunk_rows}")


class ExportError(RuntimeError):
    """The export could not complete; ``current`` still names the previous version."""


def _registry(client, ns: str) -> dict[str, dict]:
    raw = client.hgetall(layout.registry_key(ns))
    return {k.decode(): json.loads(v) for k, v in raw.items()}


def _set_state(client, ns: str, version: str, **state) -> None:
    client.hset(layout.registry_key(ns), version, json.dumps(state))


def export(checkpoint: str | Path, url: str, settings: ExportSettings | None = None, *,
           progress: bool = True, fail_after_rows: int | None = None) -> dict:
    """Publish ``checkpoint``'s rows to the Redis at ``url`` as a new version; return a summary.

    ``fail_after_rows`` (tests): raise after writing that many rows, as a crash would.
    """
    s = settings or ExportSettings()
    path = checkpoint_files.resolve(checkpoint)
    meta = checkpoint_files.load_meta(path)
    files = {name: checkpoint_files.sparse_files(path, name) for name in (s.tables or meta["tables"])}
    rows = {name: sum(pq.ParquetFile(f).metadata.num_rows for f in fs) for name, fs in files.items()}
    catalog = Catalog.from_checkpoint(path, meta, rows, s.tables)
    version = s.version or f"s{meta['step']:08d}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    client = connect(url, timeout_s=s.timeout_s)
    ns = s.namespace
    try:
        if version in _registry(client, ns) or client.exists(layout.manifest_key(ns, version)):
            raise ExportError(f"version {version!r} already exists in namespace {ns!r} at {redact(url)}; "
                              "pick another --version (or remove it with --gc if it failed)")
        started = time.time()
        _set_state(client, ns, version, state="writing", started=started, heartbeat=started)
        try:
            written, checksums = _write_rows(client, ns, version, catalog, files, s, started, progress,
                                              fail_after_rows)
            tables = {}
            for name, t in catalog.tables.items():
                if written[name] != t.rows:
                    raise ExportError(f"table {name!r}: wrote {written[name]} rows, the checkpoint has {t.rows}")
                tables[name] = replace(t, checksum=f"{checksums[name]:016x}")
            catalog = catalog.with_tables(**tables)
            manifest = catalog.to_manifest(version=version, dtype=s.dtype, buckets=s.buckets, namespace=ns,
                                           created_at=started)
            client.set(layout.manifest_key(ns, version), json.dumps(manifest))
            total = sum(written.values())
            _set_state(client, ns, version, state="ready", started=started, heartbeat=time.time(), rows=total)
            client.set(layout.current_key(ns), version)
        except BaseException:
            try:
                _set_state(client, ns, version, state="failed", started=started, heartbeat=time.time())
            except Exception:  # noqa: BLE001 - Redis itself may be what failed; gc handles "writing"
                log.warning("could not mark version %s failed; `recsys export --gc` removes it later", version)
            raise
        elapsed = time.time() - started
        removed = gc(url, ns, keep=s.keep, client=client)["removed"]
    finally:
        client.close()
    return {"version": version, "namespace": ns, "checkpoint": str(path), "step": meta["step"], "rows": total,
            "tables": {n: t.rows for n, t in catalog.tables.items()}, "dtype": s.dtype, "seconds": elapsed,
            "rows_per_s": total / elapsed if elapsed > 0 else float("nan"), "removed_versions": removed}


def _write_rows(client, ns, version, catalog, files, s: ExportSettings, started, progress, fail_after_rows):
    """Write every table's rows; return (rows written, checksum) per table, after verifying them."""
    from tqdm import tqdm

    total = sum(t.rows for t in catalog.tables.values())
    bar = tqdm(total=total, unit="rows", unit_scale=True, desc=f"export {version}", file=sys.stderr,
               disable=not progress, mininterval=0.5)
    written = {name: 0 for name in catalog.tables}
    checksums = {name: 0 for name in catalog.tables}
    done = 0
    try:
        for name, table in catalog.tables.items():
            sample_keys, sample_values = [], []
            for f in files[name]:
                for batch in pq.ParquetFile(f).iter_batches(batch_size=s.chunk_rows, columns=["key", "embedding"]):
                    keys = batch.column(0).to_numpy()
                    flat = batch.column(1).flatten().to_numpy(zero_copy_only=False)
                    emb = flat.reshape(-1, table.dim)
                    names = layout.row_keys(ns, version, name, keys, s.buckets)
                    values = layout.encode_rows(emb, s.dtype)
                    _mset_by_bucket(client, names, values, layout.buckets_of(keys, s.buckets))
                    checksums[name] = (checksums[name] + layout.checksum(keys, values)) & ((1 << 64) - 1)
                    written[name] += len(names)
                    done += len(names)
                    pick = np.linspace(0, len(names) - 1, min(SAMPLE_PER_CHUNK, len(names))).astype(int)
                    sample_keys += [names[i] for i in pick]
                    sample_values += [values[i] for i in pick]
                    bar.update(len(names))
                    _set_state(client, ns, version, state="writing", started=started, heartbeat=time.time())
                    if fail_after_rows is not None and done >= fail_after_rows:
                        raise ExportError(f"failing on purpose after {done} rows (fail_after_rows)")
            _verify(client, ns, version, name, files[name], s, written[name], sample_keys, sample_values)
    finally:
        bar.close()
    return written, checksums


def _mset_by_bucket(client, names: list[bytes], values: list[bytes], buckets: np.ndarray) -> None:
    """Write one chunk: one MSET per bucket (one hash slot each), in one pipelined round trip."""
    pipe = client.pipeline(transaction=False)
    for group in layout.by_bucket(buckets):
        args = []
        for i in group.tolist():
            args += (names[i], values[i])
        pipe.execute_command("MSET", *args)
    pipe.execute()


def _verify(client, ns, version, table, files, s, rows, sample_keys, sample_values) -> None:
    """Raise ``ExportError`` unless every row of ``table`` exists and the sample reads back equal."""
    present = 0
    for f in files:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=s.chunk_rows, columns=["key"]):
            keys = batch.column(0).to_numpy()
            names = layout.row_keys(ns, version, table, keys, s.buckets)
            pipe = client.pipeline(transaction=False)
            for group in layout.by_bucket(layout.buckets_of(keys, s.buckets)):
                pipe.execute_command("EXISTS", *[names[i] for i in group.tolist()])
            present += sum(pipe.execute())
    if present != rows:
        raise ExportError(f"table {table!r}: {present} of {rows} rows are in Redis after the write "
                          "(evicted by maxmemory? check the server's maxmemory-policy)")
    pipe = client.pipeline(transaction=False)
    for name in sample_keys:
        pipe.get(name)
    back = pipe.execute()
    bad = [n for n, want, got in zip(sample_keys, sample_values, back) if got != want]
    if bad:
        raise ExportError(f"table {table!r}: {len(bad)} sampled rows read back different, e.g. {bad[0]!r}")


def versions(url: str, namespace: str = "recsys", client=None) -> dict:
    """Return ``{"current": version or None, "versions": {version: state}}``."""
    own = client is None
    client = client or connect(url)
    try:
        cur = client.get(layout.current_key(namespace))
        return {"current": cur.decode() if cur else None, "versions": _registry(client, namespace)}
    finally:
        if own:
            client.close()


def gc(url: str, namespace: str = "recsys", keep: int = 3, grace_s: float = 60.0, client=None) -> dict:
    """Remove failed versions, ``writing`` ones whose heartbeat is older than ``grace_s``, and
    ready ones beyond the newest ``keep``; never the current one. Return what was removed."""
    own = client is None
    client = client or connect(url)
    try:
        info = versions(url, namespace, client)
        current, states = info["current"], info["versions"]
        now = time.time()
        ready = sorted((v for v, st in states.items() if st["state"] == "ready"),
                       key=lambda v: states[v]["started"], reverse=True)
        doomed = [v for v in ready[keep:] if v != current]
        doomed += [v for v, st in states.items() if v != current and (
            st["state"] == "failed" or (st["state"] == "writing" and now - st["heartbeat"] > grace_s))]
        removed = {}
        for v in doomed:
            removed[v] = _unlink_version(client, namespace, v)
            client.delete(layout.manifest_key(namespace, v))
            client.hdel(layout.registry_key(namespace), v)
        return {"current": current, "removed": removed, "kept": sorted(set(states) - set(removed))}
    finally:
        if own:
            client.close()


def _unlink_version(client, ns: str, version: str, batch: int = 1000) -> int:
    """Delete every row key of ``version`` with SCAN + UNLINK (never KEYS); return how many."""
    n = 0
    names = []
    for name in client.scan_iter(match=layout.version_pattern(ns, version), count=batch):
        names.append(name)
        if len(names) >= batch:
            n += client.unlink(*names)
            names = []
    if names:
        n += client.unlink(*names)
    return n
