"""``recsys export``: publish a checkpoint's embeddings to Redis as a new version, then flip
the alias; and ``recsys export --gc``: remove failed, abandoned and old versions.

Legend: ``N`` rows of a chunk, ``B`` buckets per table.

    checkpoint shards ──► chunks of N rows (key, embedding) ──► storage dtype
        ──► group by bucket ──► one MSET per bucket (pipelined, one round trip per chunk)
    registry: ns:versions[v] = writing (heartbeat every chunk, written and verified alike)
    verify: EXISTS over every written key == rows per table; a sample read back byte-equal
    manifest ──► ns:manifest:v ;  registry: flipping ;  the sample and the manifest re-checked
        ──► SET ns:current v (the atomic flip) ;  registry: ready ;  the previous one: superseded_at
    prune: ready versions beyond the newest ``keep``, superseded ``superseded_grace_s`` ago or
        more ──► SCAN MATCH ns:{v:* + UNLINK

An export that fails midway marks its version ``failed`` (or, if the process died, leaves
it ``writing`` with a heartbeat that stops): ``current`` is untouched, and ``gc`` removes
it (``writing`` ones once their heartbeat is older than ``grace_s``). Layout: ``recsys.redisio.published``.

No served row goes missing:

- an export changes its registry entry only from what it last wrote (a compare-and-set in
  Redis), and a gc takes a version over the same way (state ``deleting``) before it deletes
  a row: an export whose entry a gc took (it paused longer than the gc's grace) fails at its
  next heartbeat or at the flip, and never flips ``current`` to it;
- a version ``current`` no longer names is kept ``superseded_grace_s`` (default 60 s) after
  the flip, whatever ``keep`` says: servers read ``current`` every ``--refresh-s`` and may
  still read the previous version's rows until then. It goes at the next export or
  ``recsys export --gc`` after that. A gc never removes the version ``current`` names.
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

from embedding_server.catalog import Catalog
from recsys.checkpoint import read as checkpoint_files
from recsys.redisio import published as layout
from recsys.redisio.client import connect, redact

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
    superseded_grace_s: float = 60.0
    """A version ``current`` no longer names is kept this long after the flip (servers may
    still read it until their next refresh of ``current``), beyond ``keep`` too."""

    def __post_init__(self) -> None:
        layout.check_name(self.namespace, "namespace")
        if self.version:
            layout.check_version(self.version, "version")
        if self.dtype not in layout.DTYPES:
            raise ValueError(f"dtype must be one of {list(layout.DTYPES)}, found {self.dtype!r}")
        if self.keep < 1:
            raise ValueError(f"keep must be >= 1 (the new version is kept), found {self.keep}")
        if not 1 <= self.buckets <= 4096:
            raise ValueError(f"buckets must be in [1, 4096], found {self.buckets}")
        if not 1 <= self.chunk_rows <= 1_000_000:
            raise ValueError(f"chunk_rows must be in [1, 1000000], found {self.chunk_rows}")
        if not self.superseded_grace_s >= 0:
            raise ValueError(f"superseded_grace_s must be >= 0, found {self.superseded_grace_s}")


class ExportError(RuntimeError):
    """The export could not complete; ``current`` still names the previous version."""


class AfterFlipError(RuntimeError):
    """Something failed once ``SET current`` was sent: the message says whether ``current``
    names the new version (or that it could not be read back) and what is left to do."""


_CAS = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
if ARGV[3] == '' then redis.call('HDEL', KEYS[1], ARGV[1]) else redis.call('HSET', KEYS[1], ARGV[1], ARGV[3]) end
return 1
"""
"""Registry field ARGV[1]: from exactly ARGV[2] to ARGV[3] (deleted if empty); 1 if it was ARGV[2]."""
_UNFLIP = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('SET', KEYS[1], ARGV[2]) return 1 end
return 0
"""
"""``current``: from ARGV[1] back to ARGV[2], only if it still names ARGV[1]."""


def _swap(client, ns: str, version: str, old: str, new: dict | None) -> bool:
    """Change ``version``'s registry entry from exactly ``old`` (its JSON) to ``new`` (None:
    remove it); return False, changing nothing, if someone changed it first."""
    return bool(client.eval(_CAS, 1, layout.registry_key(ns), version, old, "" if new is None else json.dumps(new)))


class _Entry:
    """This export's registry entry, only ever changed from what this export last wrote."""

    def __init__(self, client, ns: str, version: str, clock) -> None:
        self.client, self.ns, self.version, self.clock = client, ns, version, clock
        self.started = clock()
        self.text = ""

    def create(self) -> bool:
        text = json.dumps({"state": "writing", "started": self.started, "heartbeat": self.started})
        if not self.client.hsetnx(layout.registry_key(self.ns), self.version, text):
            return False
        self.text = text
        return True

    def set(self, state: str, **extra) -> None:
        """Move to ``state`` with a fresh heartbeat; ExportError if a gc took the version over."""
        new = {"state": state, "started": self.started, "heartbeat": self.clock(), **extra}
        # a retried call (redis-py resends one whose reply was lost) finds its own write: that is no takeover
        if not _swap(self.client, self.ns, self.version, self.text, new) and self.client.hget(
                layout.registry_key(self.ns), self.version) != json.dumps(new).encode():
            raise ExportError(f"version {self.version!r}: a gc took it over (its heartbeat was older than the gc's "
                              "--grace-s: this export paused longer than that) and removes its rows; "
                              "export again")
        self.text = json.dumps(new)

    def beat(self) -> None:
        self.set("writing")


def export(checkpoint: str | Path, url: str, settings: ExportSettings | None = None, *,
           progress: bool = True, fail_after_rows: int | None = None, clock=time.time, password_file: str = "") -> dict:
    """Publish ``checkpoint``'s rows to the Redis at ``url`` as a new version; return a summary.

    ``fail_after_rows`` (tests): raise after writing that many rows, as a crash would.
    ``clock``: the time heartbeats and the superseded version's grace are counted in.
    ``password_file``: the password of a ``url`` without one (else ``$REDIS_PASSWORD``).

    Raises ``ExportError`` (or a Redis error) before the flip: ``current`` is unchanged;
    ``AfterFlipError`` once ``SET current`` was sent. The new version is never marked
    ``failed`` after that: if marking it ``ready`` fails it stays ``flipping`` (a gc never
    removes the current version, and gives a superseded one its grace either way).
    """
    s = settings or ExportSettings()
    path = checkpoint_files.resolve(checkpoint)
    meta = checkpoint_files.load_meta(path)
    files = {name: checkpoint_files.sparse_files(path, name) for name in (s.tables or meta["tables"])}
    rows = {name: sum(pq.ParquetFile(f).metadata.num_rows for f in fs) for name, fs in files.items()}
    catalog = Catalog.from_checkpoint(path, meta, rows, s.tables)
    version = s.version or f"s{meta['step']:08d}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    client = connect(url, timeout_s=s.timeout_s, password_file=password_file, where="--redis")
    ns = s.namespace
    try:
        entry = _Entry(client, ns, version, clock)
        if client.exists(layout.manifest_key(ns, version)) or not entry.create():
            raise ExportError(f"version {version!r} already exists in namespace {ns!r} at {redact(url)}; "
                              "pick another --version (or remove it with --gc if it failed)")
        started = entry.started
        sent_flip = False
        try:
            written, checksums, sample = _write_rows(client, ns, version, catalog, files, s, entry.beat, progress,
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
            entry.set("flipping", rows=total)  # from here on no gc takes it: a gc that did fails this
            _recheck(client, ns, version, sample)
            previous = client.get(layout.current_key(ns))
            sent_flip = True
            client.set(layout.current_key(ns), version)
            try:
                entry.set("ready", rows=total)
            except ExportError:  # a gc took it between the two: serve the previous version again
                if previous is not None:
                    client.eval(_UNFLIP, 1, layout.current_key(ns), version, previous)
                sent_flip = False  # current names the previous version again (or the gc kept ours)
                raise
        except BaseException as exc:
            if sent_flip:  # current may name it: never mark it failed (the next export would delete it at once)
                raise _after_flip(client, ns, version, url, "marking it ready", exc) from None
            try:
                entry.set("failed")
            except Exception:  # noqa: BLE001 - Redis itself may be what failed, or a gc took it: gc handles both
                log.warning("could not mark version %s failed; `recsys export --gc` removes it later", version)
            raise
        try:
            if previous is not None and previous != version.encode():
                _supersede(client, ns, previous.decode("utf-8", "backslashreplace"), clock())
            elapsed = clock() - started
            result = gc(url, ns, keep=s.keep, superseded_grace_s=s.superseded_grace_s, client=client, clock=clock)
        except Exception as exc:  # noqa: BLE001 - the flip happened: say so, whatever failed after it
            raise _after_flip(client, ns, version, url, "removing old versions", exc) from None
        removed = result["removed"]
        for v, why in result["skipped"].items():
            log.warning("gc: skipped registry entry %r of namespace %s: %s", v, ns, why)
    finally:
        client.close()
    return {"version": version, "namespace": ns, "checkpoint": str(path), "step": meta["step"], "rows": total,
            "tables": {n: t.rows for n, t in catalog.tables.items()}, "dtype": s.dtype, "seconds": elapsed,
            "rows_per_s": total / elapsed if elapsed > 0 else float("nan"), "removed_versions": removed}


def _after_flip(client, ns: str, version: str, url: str, step: str, exc: BaseException) -> BaseException:
    """Return the error to raise for ``exc``, raised by ``step`` once ``SET current`` was sent."""
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        return exc
    why = f"{type(exc).__name__}: {exc}"
    try:
        now = client.get(layout.current_key(ns))
    except Exception:  # noqa: BLE001 - Redis is what failed
        now = None
        said = f"`current` could not be read back (it names {version!r} or the previous version: `recsys export --list`)"
    else:
        said = (f"`current` -> {version} (flipped)" if now == version.encode()
                else f"`current` names {now.decode('utf-8', 'backslashreplace') if now else None!r}, not {version!r}")
    after = ("; its registry entry stays 'flipping' (never removed while current; `recsys export --gc` "
             "finishes the rest)" if step == "marking it ready" else
             "; `recsys export --gc` removes the old versions later")
    return AfterFlipError(f"version {version!r} at {redact(url)}: {said}, but {step} failed: {why}{after}")


def _write_rows(client, ns, version, catalog, files, s: ExportSettings, beat, progress, fail_after_rows):
    """Write every table's rows, calling ``beat`` after every chunk; return (rows written,
    checksum) per table and the row keys read back, after verifying them."""
    from tqdm import tqdm

    total = sum(t.rows for t in catalog.tables.values())
    bar = tqdm(total=total, unit="rows", unit_scale=True, desc=f"export {version}", file=sys.stderr,
               disable=not progress, mininterval=0.5)
    written = {name: 0 for name in catalog.tables}
    checksums = {name: 0 for name in catalog.tables}
    done = 0
    sampled = []
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
                    beat()
                    if fail_after_rows is not None and done >= fail_after_rows:
                        raise ExportError(f"failing on purpose after {done} rows (fail_after_rows)")
            _verify(client, ns, version, name, files[name], s, written[name], sample_keys, sample_values, beat)
            sampled += sample_keys
    finally:
        bar.close()
    return written, checksums, sampled


def _mset_by_bucket(client, names: list[bytes], values: list[bytes], buckets: np.ndarray) -> None:
    """Write one chunk: one MSET per bucket (one hash slot each), in one pipelined round trip."""
    pipe = client.pipeline(transaction=False)
    for group in layout.by_bucket(buckets):
        args = []
        for i in group.tolist():
            args += (names[i], values[i])
        pipe.execute_command("MSET", *args)
    pipe.execute()


def _verify(client, ns, version, table, files, s, rows, sample_keys, sample_values, beat) -> None:
    """Raise ``ExportError`` unless every row of ``table`` exists and the sample reads back
    equal; ``beat`` after every chunk (a long verification is no abandoned export)."""
    present = 0
    for f in files:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=s.chunk_rows, columns=["key"]):
            keys = batch.column(0).to_numpy()
            names = layout.row_keys(ns, version, table, keys, s.buckets)
            pipe = client.pipeline(transaction=False)
            for group in layout.by_bucket(layout.buckets_of(keys, s.buckets)):
                pipe.execute_command("EXISTS", *[names[i] for i in group.tolist()])
            present += sum(pipe.execute())
            beat()
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


def _recheck(client, ns: str, version: str, sample_keys: list[bytes]) -> None:
    """Right before the flip: the manifest and every sampled row are still there."""
    pipe = client.pipeline(transaction=False)
    pipe.exists(layout.manifest_key(ns, version))
    for name in sample_keys:
        pipe.exists(name)
    found = pipe.execute()
    if not all(found):
        raise ExportError(f"version {version!r}: {found.count(0)} of {len(found)} re-checked keys (its manifest and "
                          "sampled rows) went missing after the verification (evicted by maxmemory, or deleted); "
                          "`current` was not flipped")


def _supersede(client, ns: str, version: str, now: float) -> None:
    """Note when ``version`` stopped being current (its grace counts from then)."""
    text = client.hget(layout.registry_key(ns), version)
    if text is None:
        return
    try:
        state = json.loads(text)
    except ValueError:  # a malformed entry: the gc reports it
        return
    if isinstance(state, dict) and state.get("state") in ("ready", "flipping"):  # flipping: its export died
        _swap(client, ns, version, text.decode(), {**state, "state": "ready", "superseded_at": now})  # after the flip


def versions(url: str, namespace: str = "recsys", client=None, password_file: str = "") -> dict:
    """Return ``{"current": version or None, "versions": {version: state}}`` (a malformed
    registry entry as ``{"malformed": why}``)."""
    own = client is None
    client = client or connect(url, password_file=password_file, where="--redis")
    try:
        cur = client.get(layout.current_key(namespace))
        entries, bad = _read_registry(client, namespace)
        return {"current": cur.decode("utf-8", "backslashreplace") if cur is not None else None,
                "versions": {**{v: st for v, (_, st) in entries.items()}, **{v: {"malformed": why}
                                                                             for v, why in bad.items()}}}
    finally:
        if own:
            client.close()


STATES = ("writing", "flipping", "ready", "failed", "deleting")


def _entry_problem(version: str, state) -> str | None:
    """Return why a registry entry cannot be acted on (None: it can): every field a gc reads."""
    try:
        layout.check_version(version, "its name")
    except ValueError as exc:
        return str(exc)
    if not isinstance(state, dict):
        return f"expected a JSON object, found {type(state).__name__}"
    if state.get("state") not in STATES:
        return f"'state' must be one of {list(STATES)}, found {state.get('state')!r}"
    for field in ("started", "heartbeat", "superseded_at"):
        value = state.get(field, 0.0 if field == "superseded_at" else None)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            return f"{field!r} must be a number (seconds since the epoch), found {value!r}"
    return None


def _read_registry(client, ns: str) -> tuple[dict[str, tuple[str, dict]], dict[str, str]]:
    """Return ({version: (its JSON text, its state)}, {entry: why it is malformed}) of ``ns``'s registry."""
    entries, bad = {}, {}
    for name, text in client.hgetall(layout.registry_key(ns)).items():
        version = name.decode("utf-8", "backslashreplace")
        try:
            raw = text.decode()
            state = json.loads(raw)
        except ValueError as exc:  # not UTF-8, not JSON
            bad[version] = f"not JSON: {type(exc).__name__}: {exc}"
            continue
        why = _entry_problem(version, state)
        if why is None and version.encode() != name:
            why = "its name is not UTF-8"
        if why is not None:
            bad[version] = why
            continue
        entries[version] = (raw, state)
    return entries, bad


def gc(url: str, namespace: str = "recsys", keep: int = 3, grace_s: float = 60.0, superseded_grace_s: float = 60.0,
       client=None, clock=time.time, password_file: str = "") -> dict:
    """Remove failed versions, ``writing`` ones whose heartbeat is older than ``grace_s``, and
    ready ones beyond the newest ``keep`` that ``current`` stopped naming ``superseded_grace_s``
    ago or more; never the current one. Return what was removed, and the registry entries
    skipped as malformed (with why; their rows are left alone).

    A ready version beyond ``keep`` with no ``superseded_at`` (its export died right after
    the flip) gets one now; so does a ``flipping`` one whose heartbeat is older than
    ``grace_s`` (its export died at the flip: it may have been current). Each version is
    taken over (state ``deleting``, compare-and-set) before its rows go, so an export that
    changed its entry meanwhile keeps it."""
    own = client is None
    client = client or connect(url, password_file=password_file, where="--redis")
    try:
        entries, skipped = _read_registry(client, namespace)
        raw = {v: text for v, (text, _) in entries.items()}
        states = {v: st for v, (_, st) in entries.items()}
        cur = client.get(layout.current_key(namespace))
        current = cur.decode("utf-8", "backslashreplace") if cur is not None else None
        if cur is not None and current not in states:
            try:
                layout.check_version(current, f"{layout.current_key(namespace)}")
            except ValueError as exc:  # which version servers read is unknown: remove no ready one
                raise ExportError(f"{exc}; set it to a published version before a gc "
                                  f"(`recsys export --list` shows them)") from None
        now = clock()
        ready = sorted((v for v, st in states.items() if st["state"] == "ready"),
                       key=lambda v: states[v]["started"], reverse=True)
        stale = [v for v, st in states.items() if st["state"] in ("writing", "flipping") and v != current
                 and now - st["heartbeat"] > grace_s]
        doomed = []
        for v in ready[keep:] + [v for v in stale if states[v]["state"] == "flipping"]:
            since = states[v].get("superseded_at")
            if v == current:
                continue
            if since is None and _swap(client, namespace, v, raw[v], {**states[v], "superseded_at": now}):
                since, states[v] = now, {**states[v], "superseded_at": now}
                raw[v] = json.dumps(states[v])
            if since is not None and now - since >= superseded_grace_s:
                doomed.append(v)
        if current in states and "superseded_at" in states[current]:  # current again (set by hand): its grace restarts
            _swap(client, namespace, current, raw[current],
                  {k: x for k, x in states[current].items() if k != "superseded_at"})
        doomed += [v for v, st in states.items() if v != current and (
            st["state"] in ("failed", "deleting") or (st["state"] == "writing" and v in stale))]
        removed = {}
        for v in doomed:
            taken = {**states[v], "state": "deleting"}
            if not _swap(client, namespace, v, raw[v], taken):
                continue  # its export beat (or a gc took it) since we read it
            if client.get(layout.current_key(namespace)) == v.encode():  # flipped to meanwhile: keep it
                _swap(client, namespace, v, json.dumps(taken), states[v])
                continue
            removed[v] = layout.unlink_version(client, namespace, v)
            client.delete(layout.manifest_key(namespace, v))
            _swap(client, namespace, v, json.dumps(taken), None)
        return {"current": current, "removed": removed, "kept": sorted(set(states) - set(removed)),
                "skipped": skipped}
    finally:
        if own:
            client.close()
