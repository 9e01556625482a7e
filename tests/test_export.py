"""recsys export: versions, the atomic alias, keep K, failed exports and --gc, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
import redis

from embedding_server import export as publish
from recsys.checkpoint import read as checkpoint_files
from recsys.redisio import published as layout
from recsys.redisio.client import connect
from serving_data import start_cluster

pytestmark = pytest.mark.redis


def row_count(url: str, version: str, ns: str = "recsys") -> int:
    client = connect(url)
    try:
        return sum(1 for _ in client.scan_iter(match=layout.version_pattern(ns, version), count=1000))
    finally:
        client.close()


def test_export_writes_every_row_and_a_manifest(tiny_run, redis_server):
    ckpt = checkpoint_files.resolve(tiny_run)
    rows = checkpoint_files.load_sparse(ckpt)
    summary = publish.export(tiny_run, redis_server.url, publish.ExportSettings(version="a"), progress=False)
    assert summary["rows"] == sum(t.num_rows for t in rows.values()) == row_count(redis_server.url, "a")
    client = redis.Redis.from_url(redis_server.url)
    assert client.get("recsys:current") == b"a"
    manifest = json.loads(client.get("recsys:manifest:a"))
    assert manifest["source_checkpoint"] == str(ckpt.resolve())
    assert manifest["step"] == checkpoint_files.load_meta(ckpt)["step"]
    assert {f["name"]: f["table"] for f in manifest["features"]}["m1"] == "m1"
    assert manifest["tables"]["c3"]["rows"] == rows["c3"].num_rows
    # every value is the checkpoint's row, raw little-endian float32
    t = rows["c7"]
    keys = t.column("key").to_numpy()
    emb = t.column("embedding").combine_chunks().flatten().to_numpy().reshape(len(keys), -1)
    values = client.mget(layout.row_keys("recsys", "a", "c7", keys, manifest["buckets"]))
    np.testing.assert_array_equal(np.frombuffer(b"".join(values), "<f4").reshape(emb.shape), emb)
    # the checksum covers exactly those rows
    assert manifest["tables"]["c7"]["checksum"] == f"{layout.checksum(keys, values):016x}"


def test_keep_k_and_gc(tiny_run, redis_server):
    for v in ("v1", "v2", "v3"):
        publish.export(tiny_run, redis_server.url, publish.ExportSettings(version=v, keep=2, superseded_grace_s=0),
                       progress=False)
    info = publish.versions(redis_server.url)
    assert info["current"] == "v3" and sorted(info["versions"]) == ["v2", "v3"]
    assert row_count(redis_server.url, "v1") == 0 and row_count(redis_server.url, "v2") > 0
    assert not redis.Redis.from_url(redis_server.url).exists("recsys:manifest:v1")
    with pytest.raises(publish.ExportError, match="already exists"):
        publish.export(tiny_run, redis_server.url, publish.ExportSettings(version="v3"), progress=False)


def test_failed_export_leaves_current_and_gc_removes_it(tiny_run, redis_server):
    publish.export(tiny_run, redis_server.url, publish.ExportSettings(version="good"), progress=False)
    with pytest.raises(publish.ExportError, match="on purpose"):
        publish.export(tiny_run, redis_server.url, publish.ExportSettings(version="bad", chunk_rows=500),
                       progress=False, fail_after_rows=1000)
    info = publish.versions(redis_server.url)
    assert info["current"] == "good" and info["versions"]["bad"]["state"] == "failed"
    assert row_count(redis_server.url, "bad") >= 1000
    out = subprocess.run([sys.executable, "-m", "recsys.cli", "export", "--redis", redis_server.url, "--gc"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "removed 1 version(s)" in out.stdout and "bad" in out.stdout
    assert row_count(redis_server.url, "bad") == 0 and row_count(redis_server.url, "good") > 0
    assert publish.versions(redis_server.url)["current"] == "good"


def test_abandoned_export_is_removed_after_its_grace(tiny_run, redis_server):
    client = redis.Redis.from_url(redis_server.url)
    client.hset("recsys:versions", "dead", json.dumps({"state": "writing", "started": 0, "heartbeat": 0}))
    client.set(b"recsys:{dead:c1:0000}:0000000000000001", b"x" * 64)
    client.hset("recsys:versions", "busy", json.dumps({"state": "writing", "started": 0, "heartbeat": 1e12}))
    removed = publish.gc(redis_server.url, grace_s=60)["removed"]
    assert removed == {"dead": 1}
    assert "busy" in publish.versions(redis_server.url)["versions"]


class Clock:
    """The time export and gc count heartbeats and graces in, moved by the test."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _pausing_reads(monkeypatch, after_chunk):
    """Make the export's verification pass (its reads of the key column alone) call
    ``after_chunk()`` after each chunk."""
    real = publish.pq.ParquetFile

    class Reads:
        def __init__(self, path):
            self._file = real(path)
            self.metadata = self._file.metadata

        def iter_batches(self, *, batch_size, columns):
            for batch in self._file.iter_batches(batch_size=batch_size, columns=columns):
                yield batch
                if columns == ["key"]:
                    after_chunk()

    monkeypatch.setattr(publish.pq, "ParquetFile", Reads)


def test_a_gc_during_a_long_verification_leaves_the_version_in_flight(tiny_run, redis_server, monkeypatch):
    """Every chunk of the verification takes three quarters of the gc's grace, and a gc runs
    after each: the heartbeat goes on through the verification, so none removes the export."""
    clock, grace, gcs = Clock(), 60.0, []

    def slow_chunk():
        clock.now += 0.75 * grace
        gcs.append(publish.gc(redis_server.url, grace_s=grace, clock=clock)["removed"])

    _pausing_reads(monkeypatch, slow_chunk)
    summary = publish.export(tiny_run, redis_server.url, publish.ExportSettings(version="long", chunk_rows=500),
                             progress=False, clock=clock)
    assert len(gcs) > 4 and all(removed == {} for removed in gcs), gcs
    assert publish.versions(redis_server.url)["current"] == "long"
    assert row_count(redis_server.url, "long") == summary["rows"]


def test_an_export_a_gc_took_over_before_the_flip_never_becomes_current(tiny_run, redis_server, monkeypatch):
    """The export pauses longer than the gc's grace after its verification (while it makes
    the manifest), and a gc removes the version then: the export fails, and ``current``
    keeps naming the whole previous version."""
    first = publish.export(tiny_run, redis_server.url, publish.ExportSettings(version="first"), progress=False)
    clock, grace, gcs = Clock(), 60.0, []
    real = publish.Catalog.to_manifest

    def paused(catalog, **extra):
        clock.now += 2 * grace
        gcs.append(publish.gc(redis_server.url, grace_s=grace, clock=clock)["removed"])
        return real(catalog, **extra)

    monkeypatch.setattr(publish.Catalog, "to_manifest", paused)
    with pytest.raises(publish.ExportError, match="'second': a gc took it over"):
        publish.export(tiny_run, redis_server.url, publish.ExportSettings(version="second"), progress=False,
                       clock=clock)
    assert list(gcs[0]) == ["second"]
    info = publish.versions(redis_server.url)
    assert info["current"] == "first" and "second" not in info["versions"]
    assert row_count(redis_server.url, "first") == first["rows"] and row_count(redis_server.url, "second") == 0


def test_a_superseded_version_is_kept_for_its_grace_even_beyond_keep(tiny_run, redis_server):
    clock = Clock()
    one = publish.export(tiny_run, redis_server.url, publish.ExportSettings(version="one"), progress=False,
                         clock=clock)
    clock.now += 5
    two = publish.export(tiny_run, redis_server.url, publish.ExportSettings(version="two", keep=1,
                                                                             superseded_grace_s=30),
                         progress=False, clock=clock)
    flipped = clock.now
    assert two["removed_versions"] == {} and publish.versions(redis_server.url)["current"] == "two"
    assert row_count(redis_server.url, "one") == one["rows"]  # servers may still read it
    clock.now = flipped + 29.5
    assert publish.gc(redis_server.url, keep=1, superseded_grace_s=30, clock=clock)["removed"] == {}
    assert row_count(redis_server.url, "one") == one["rows"]
    clock.now = flipped + 30
    assert publish.gc(redis_server.url, keep=1, superseded_grace_s=30, clock=clock)["removed"] == {"one": one["rows"]}
    assert row_count(redis_server.url, "two") == two["rows"]
    out = subprocess.run([sys.executable, "-m", "recsys.cli", "export", "--redis", redis_server.url, "--gc",
                          "--keep", "1", "--superseded-grace-s", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "removed 0 version(s)" in out.stdout, out.stderr


def test_cli_errors_are_one_line(tiny_run, redis_server, tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "recsys.cli", "export", *args], capture_output=True,
                              text=True, timeout=120)

    out = run("--checkpoint", str(tmp_path), "--redis", redis_server.url)
    assert out.returncode == 2 and "not a checkpoint" in out.stderr and "Traceback" not in out.stderr
    out = run("--checkpoint", str(tiny_run), "--redis", "redis://:secret@127.0.0.1:1/0")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "secret" not in out.stderr and ":***@" in out.stderr
    out = run("--checkpoint", str(tiny_run), "--redis", redis_server.url, "--version", "bad name")
    assert out.returncode == 2 and "version must match" in out.stderr
    out = run("--checkpoint", str(tiny_run), "--redis", redis_server.url, "--tables", "c1,nope")
    assert out.returncode == 2 and "'nope'" in out.stderr


@pytest.mark.multiproc
def test_cluster_export_and_serve_equal_single_redis(tiny_run, redis_server, tmp_path):
    import httpx

    from embedding_server.app import create_app
    from embedding_server.settings import ServeSettings
    from serving_data import LiveServer

    cluster = start_cluster(tmp_path / "cluster")
    try:
        for url in (redis_server.url, cluster.url):
            publish.export(tiny_run, url, publish.ExportSettings(version="v1"), progress=False)
        # the rows spread over the nodes
        per_node = [redis.Redis(port=n.port).dbsize() for n in cluster.nodes]
        assert all(n > 1000 for n in per_node), per_node
        data = tiny_run.parent / "data" / "train"
        import pyarrow.parquet as pq

        t = pq.read_table(sorted(data.glob("*.parquet"))[0]).slice(0, 300)
        body = {"lookups": [{"feature": f, "ids": [v for v in t.column(f).to_pylist() if v is not None]}
                            for f in ("c1", "c3", "c12", "c16")]}
        answers = []
        for url in (redis_server.url, cluster.url):
            with LiveServer(create_app(ServeSettings(redis=url))) as server:
                r = httpx.post(server.url + "/v1/lookup/batch", json=body, timeout=30)
                assert r.status_code == 200, r.text
                answers.append(r.json())
        assert answers[0] == answers[1]
        assert sum(sum(x["found"]) for x in answers[0]["results"]) > 600
        # keep K and gc work across the nodes too
        publish.export(tiny_run, cluster.url, publish.ExportSettings(version="v2", keep=1, superseded_grace_s=0),
                       progress=False)
        assert [list(redis.Redis(port=n.port).scan_iter("recsys:{v1:*")) for n in cluster.nodes] == [[], [], []]
    finally:
        cluster.stop()


# ------------------------------------------------------------------ Redis failing after the flip


class DroppingProxy:
    """A TCP proxy to a real redis-server that closes a client's connection, before forwarding,
    whenever what it sends holds ``marker``: that command never reaches Redis, and redis-py's
    retries meet the same. ``then_down``: after the first drop every connection is refused
    too (Redis went away at that command)."""

    def __init__(self, port: int, marker: bytes, then_down: bool = False) -> None:
        import socket
        import threading

        self.target, self.marker, self.then_down = port, marker, then_down
        self.dropped = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}/0"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            if self.then_down and self.dropped:
                conn.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pump, args=(conn, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, conn, False), daemon=True).start()

    def _pump(self, src, dst, watch: bool) -> None:
        tail = b""
        try:
            while data := src.recv(1 << 16):
                if watch and self.marker in tail + data:
                    self.dropped += 1
                    break
                tail = data[-len(self.marker):]
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.close()
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()


READY = b'"state": "ready"'  # what the call marking a version ready sends (its registry entry)
HGETALL = b"$7\r\nHGETALL\r\n"  # the gc's first read of the registry


class Published:
    """Version ``one`` published and current; ``export`` publishes the tiny run again at the test's clock."""

    def __init__(self, tiny_run, url) -> None:
        self.run, self.clock = tiny_run, Clock()
        self.first = self.export(url, "one")
        self.clock.now += 5

    def export(self, url, version, **settings):
        return publish.export(self.run, url, publish.ExportSettings(version=version, **settings), progress=False,
                              clock=self.clock)


@pytest.fixture
def one_published(tiny_run, redis_server):
    return Published(tiny_run, redis_server.url)


def test_marking_the_flipped_version_ready_fails_the_message_says_flipped_and_it_is_never_failed(
        one_published, redis_server, capsys):
    """The call marking ``two`` ready never reaches Redis (after ``SET current two``): the one
    line says ``current`` names ``two``; ``two`` stays ``flipping``, not ``failed``; the next
    export supersedes it with its grace, not at once; the previous one, ``one``, keeps its grace."""
    from recsys.cli import main

    clock, first = one_published.clock, one_published.first
    proxy = DroppingProxy(redis_server.port, READY)
    try:
        code = main(["export", "--checkpoint", str(one_published.run), "--redis", proxy.url, "--version", "two",
                     "--no-progress"])
    finally:
        proxy.close()
    err = capsys.readouterr().err.strip()
    assert code == 2 and proxy.dropped and len(err.splitlines()) == 1, err
    assert "`current` -> two (flipped), but marking it ready failed: ConnectionError" in err, err
    assert "unchanged" not in err
    info = publish.versions(redis_server.url)
    assert info["current"] == "two" and info["versions"]["two"]["state"] == "flipping"
    assert publish.gc(redis_server.url, grace_s=0, clock=clock)["removed"] == {}  # current: never removed
    clock.now = time.time() + 100  # the command counted in real time
    one_published.export(redis_server.url, "three", keep=1, superseded_grace_s=30)
    flipped = clock.now
    info = publish.versions(redis_server.url)
    assert info["current"] == "three" and info["versions"]["two"]["superseded_at"] == flipped
    assert row_count(redis_server.url, "two") == first["rows"]  # servers may still read it
    clock.now = flipped + 30
    removed = publish.gc(redis_server.url, keep=1, superseded_grace_s=30, clock=clock)["removed"]
    assert sorted(removed) == ["one", "two"]


def test_a_gc_failing_after_the_flip_is_reported_as_after_the_flip(one_published, redis_server, tmp_path):
    clock = one_published.clock
    proxy = DroppingProxy(redis_server.port, HGETALL)
    try:
        with pytest.raises(publish.AfterFlipError) as err:
            one_published.export(proxy.url, "two")
    finally:
        proxy.close()
    message = str(err.value)
    assert "`current` -> two (flipped), but removing old versions failed" in message, message
    info = publish.versions(redis_server.url)
    assert info["current"] == "two" and info["versions"]["two"]["state"] == "ready"
    assert info["versions"]["one"]["superseded_at"] == clock.now  # its grace counts from the flip


def test_redis_gone_at_the_flip_says_current_is_unknown_and_marks_nothing_failed(one_published, redis_server):
    proxy = DroppingProxy(redis_server.port, READY, then_down=True)
    try:
        with pytest.raises(publish.AfterFlipError, match="`current` could not be read back .*recsys export --list"):
            one_published.export(proxy.url, "two")
    finally:
        proxy.close()
    info = publish.versions(redis_server.url)
    assert info["current"] == "two" and info["versions"]["two"]["state"] == "flipping"


def test_a_lost_reply_to_marking_ready_is_no_takeover(one_published, redis_server, monkeypatch):
    """redis-py resends a call whose reply was lost: the compare-and-set then finds the export's
    own write, which is success, not "a gc took it over" (that would flip ``current`` back)."""
    real = publish._swap

    def twice(client, ns, version, old, new):  # the first reply is lost; the retry is what comes back
        ok = real(client, ns, version, old, new)
        return real(client, ns, version, old, new) if new and new.get("state") == "ready" else ok

    monkeypatch.setattr(publish, "_swap", twice)
    assert one_published.export(redis_server.url, "two")["version"] == "two"
    info = publish.versions(redis_server.url)
    assert info["current"] == "two" and info["versions"]["two"]["state"] == "ready"


# ------------------------------------------------------------------ every mode answers in one line


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "recsys.cli", "export", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("mode", [[], ["--gc"], ["--list"], ["--gc", "--list"]])
def test_every_mode_answers_an_unreachable_or_bad_redis_in_one_line(mode, tiny_run, capsys):
    from recsys.cli import main

    checkpoint = [] if mode else ["--checkpoint", str(tiny_run)]
    for url, said in (("redis://:Zx9Secret@127.0.0.1:1/0", "Connection"), ("http://cache:6379/0", "expected a Redis URL"),
                      ("redis://:/Zx9Secret@127.0.0.1:1/0", "ambiguous Redis URL")):
        assert main(["export", *checkpoint, *mode, "--redis", url, "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and said in err and "Zx9Secret" not in err, err
    out = _cli(*checkpoint, *mode, "--redis", "redis://:Zx9Secret@127.0.0.1:1/0")
    assert out.returncode == 2 and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert "Zx9Secret" not in out.stderr + out.stdout and "redis://:***@127.0.0.1:1/0" in out.stderr


def test_gc_options_out_of_range_are_one_line(redis_server):
    for args, said in ((["--keep", "0"], "--keep must be >= 1"), (["--grace-s", "-1"], "--grace-s must be"),
                       (["--superseded-grace-s", "nan"], "--superseded-grace-s must be")):
        out = _cli("--gc", "--redis", redis_server.url, *args)
        assert out.returncode == 2 and said in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_export_takes_the_password_from_a_file(tiny_run, tmp_path):
    from recsys.testing.harness import start_redis

    server = start_redis(tmp_path / "redis", "--requirepass", "/Zx9Secret")
    try:
        (tmp_path / "pw").write_text("/Zx9Secret\n")
        url = f"redis://{server.host}:{server.port}/0"
        out = _cli("--checkpoint", str(tiny_run), "--redis", url, "--redis-password-file", str(tmp_path / "pw"),
                   "--version", "v1", "--no-progress")
        assert out.returncode == 0, out.stderr
        out = _cli("--list", "--redis", url, "--redis-password-file", str(tmp_path / "pw"))
        assert out.returncode == 0 and json.loads(out.stdout)["current"] == "v1", out.stderr
        out = _cli("--list", "--redis", url)  # none: Redis refuses, in one line
        assert out.returncode == 2 and "Traceback" not in out.stderr and "Authentication" in out.stderr, out.stderr
    finally:
        server.stop()


# ------------------------------------------------------------------ reserved names, malformed registry entries


def test_a_reserved_version_name_is_refused(tiny_run, redis_server):
    from recsys.redisio import live

    assert live.VERSION in layout.RESERVED_VERSIONS  # the live rows' version component
    with pytest.raises(ValueError, match="version 'live' is reserved"):
        publish.ExportSettings(version="live")
    out = _cli("--checkpoint", str(tiny_run), "--redis", redis_server.url, "--version", "live")
    assert out.returncode == 2 and "'live' is reserved" in out.stderr and "Traceback" not in out.stderr
    assert publish.versions(redis_server.url) == {"current": None, "versions": {}}


def test_a_malformed_registry_entry_is_skipped_and_named_not_the_end_of_the_gc(tiny_run, redis_server):
    """Each field a gc reads, broken in one entry: the gc removes the failed version all the
    same, leaves each malformed entry (and its rows) alone and names it."""
    publish.export(tiny_run, redis_server.url, publish.ExportSettings(version="good"), progress=False)
    client = redis.Redis.from_url(redis_server.url)
    client.hset("recsys:versions", "bad", json.dumps({"state": "failed", "started": 0, "heartbeat": 0}))
    client.set(b"recsys:{bad:c1:0000}:0000000000000001", b"x")
    broken = {"notjson": b"{", "notutf8": b"\xff", "list": b"[]", "nostate": b'{"started": 0, "heartbeat": 0}',
              "oddstate": b'{"state": "gone", "started": 0, "heartbeat": 0}',
              "textstart": b'{"state": "ready", "started": "x", "heartbeat": 0}',
              "noheartbeat": b'{"state": "writing", "started": 0}',
              "textsuper": b'{"state": "ready", "started": 0, "heartbeat": 0, "superseded_at": "x"}',
              "live": b'{"state": "failed", "started": 0, "heartbeat": 0}', "bad name": b'{"state": "failed"}'}
    for name, text in broken.items():
        client.hset("recsys:versions", name, text)
    client.set(b"recsys:{live:c1:0000}:0000000000000001", b"a live row")
    result = publish.gc(redis_server.url, grace_s=0)
    assert result["removed"] == {"bad": 1} and sorted(result["skipped"]) == sorted(broken)
    assert "'state' must be one of" in result["skipped"]["oddstate"] and "not JSON" in result["skipped"]["notjson"]
    assert "reserved" in result["skipped"]["live"] and client.exists(b"recsys:{live:c1:0000}:0000000000000001")
    listed = publish.versions(redis_server.url)["versions"]
    assert listed["good"]["state"] == "ready" and "malformed" in listed["notjson"]
    out = _cli("--gc", "--list", "--redis", redis_server.url)
    assert out.returncode == 0 and "skipped the malformed registry entry 'notjson'" in out.stdout, out.stderr
    client.close()


def test_a_current_naming_no_version_stops_a_gc_in_one_line(tiny_run, redis_server):
    publish.export(tiny_run, redis_server.url, publish.ExportSettings(version="good"), progress=False)
    client = redis.Redis.from_url(redis_server.url)
    client.set("recsys:current", b"\xff\xfe")
    out = _cli("--gc", "--redis", redis_server.url)
    assert out.returncode == 2 and "recsys:current must match" in out.stderr and "Traceback" not in out.stderr
    assert json.loads(_cli("--list", "--redis", redis_server.url).stdout)["versions"]["good"]["state"] == "ready"
    client.close()


def test_a_stale_flipping_version_gets_the_superseded_grace_it_may_need(redis_server):
    """Its export died at the flip: it may have been current, servers may still read it."""
    client = redis.Redis.from_url(redis_server.url)
    client.hset("recsys:versions", "died", json.dumps({"state": "flipping", "started": 0, "heartbeat": 0}))
    client.set(b"recsys:{died:c1:0000}:0000000000000001", b"x")
    clock = Clock()
    assert publish.gc(redis_server.url, grace_s=60, superseded_grace_s=30, clock=clock)["removed"] == {}
    assert publish.versions(redis_server.url)["versions"]["died"]["superseded_at"] == clock.now
    clock.now += 30
    assert publish.gc(redis_server.url, grace_s=60, superseded_grace_s=30, clock=clock)["removed"] == {"died": 1}
    client.close()
