"""Version switches under concurrent requests never mix versions; a Redis outage is a 503
with a clear body, and the service recovers by itself when Redis returns."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import threading

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from conftest import wait_until
from embedding_server import export as publish
from embedding_server import binary_body as wire
from embedding_server.app import create_app
from embedding_server.backends import BackendUnavailable, RedisBackend
from embedding_server.settings import ServeSettings
from recsys.checkpoint import read as checkpoint_files
from recsys.testing.harness import start_redis
from serving_data import LiveServer

pytestmark = pytest.mark.redis


def scaled_copy(ckpt, out, factor: float):
    """Return a copy of checkpoint ``ckpt`` with every embedding multiplied by ``factor``."""
    shutil.copytree(ckpt, out)
    for f in out.glob("sparse/*/*.parquet"):
        t = pq.read_table(f)
        emb = t.column("embedding").combine_chunks()
        scaled = pa.FixedSizeListArray.from_arrays(pc.multiply(emb.flatten(), pa.scalar(factor, pa.float32())),
                                                   emb.type.list_size)
        pq.write_table(t.set_column(t.schema.get_field_index("embedding"), "embedding", scaled), f)
    marker = out / checkpoint_files.MARKER  # the files changed on purpose: list their new sizes
    files = json.loads(marker.read_text())["files"]
    marker.write_text(json.dumps({"files": {rel: (out / rel).stat().st_size for rel in files}}))
    return out


def test_version_switches_never_mix(tiny_run, redis_server, tmp_path):
    ckpt = checkpoint_files.resolve(tiny_run)
    factors = {"a": 1.0, "b": -2.0}
    sources = {name: scaled_copy(ckpt, tmp_path / name, f) for name, f in factors.items()}
    data = pq.read_table(sorted((tiny_run.parent / "data" / "train").glob("*.parquet"))[0]).slice(0, 200)
    body = {"lookups": [{"feature": f, "ids": [v for v in data.column(f).to_pylist() if v is not None][:50]}
                        for f in ("c1", "c3", "c12", "c16")]}
    publish.export(sources["a"], redis_server.url, publish.ExportSettings(version="a-0", keep=3), progress=False)
    app = create_app(ServeSettings(redis=redis_server.url, refresh_s=0.02))
    backend = app.state.backend
    clients = 3
    with LiveServer(app) as server:
        # the reference answer of each source (found rows scale with the factor, unseen ones do not)
        _, base = wire.decode(httpx.post(server.url + "/v1/lookup/batch", json=body,
                                         headers={"accept": wire.MEDIA_TYPE}).content)
        assert sum(int(found.sum()) for _, found in base) > 100
        responses, errors, stop = [], [], threading.Event()
        seen = [set() for _ in range(clients)]  # the versions each client was answered from

        def client(i: int):
            with httpx.Client(base_url=server.url, timeout=30) as c:
                while not stop.is_set():
                    r = c.post("/v1/lookup/batch", json=body, headers={"accept": wire.MEDIA_TYPE})
                    if r.status_code != 200:
                        errors.append(r.text)
                    else:
                        responses.append(wire.decode(r.content))
                        seen[i].add(responses[-1][0])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        published = ["a-0"]
        try:
            wait_until(lambda: all("a-0" in v for v in seen), 30, "every client answered")
            for i in range(1, 7):  # six switches, alternating sources
                name = "b" if i % 2 else "a"
                publish.export(sources[name], redis_server.url, publish.ExportSettings(version=f"{name}-{i}", keep=3),
                               progress=False)
                published.append(f"{name}-{i}")
                flipped_at = backend.refreshes  # refreshes started by the time current names it
                # every client is answered from the new version while the others keep asking: the
                # switch happens under concurrent requests, whatever the host's speed
                wait_until(lambda: all(f"{name}-{i}" in v for v in seen), 30, f"every client answered by {name}-{i}")
                # picked up by the first refresh that began after the flip (or the one under way):
                # within one --refresh-s, counted in refreshes rather than seconds
                assert backend.switched_at <= flipped_at + 1, (backend.switched_at, flipped_at)
        finally:
            stop.set()
            for t in threads:
                t.join()
    assert not errors, errors[:3]
    assert {v for v, _ in responses} == set(published)
    for version, blocks in responses:
        factor = factors[version[0]]
        for (vec, found), (ref, ref_found) in zip(blocks, base):
            np.testing.assert_array_equal(found, ref_found)
            np.testing.assert_array_equal(vec[found], ref[found] * np.float32(factor), err_msg=version)
            np.testing.assert_array_equal(vec[~found], ref[~found])


def test_redis_outage_is_a_503_and_recovers(tiny_run, tmp_path):
    # persistence on, so the published version survives the restart as it would in production
    server = start_redis(tmp_path / "redis", "--appendonly", "yes")
    try:
        publish.export(tiny_run, server.url, publish.ExportSettings(version="v1"), progress=False)
        app = create_app(ServeSettings(redis=server.url, refresh_s=0.05, redis_timeout_s=0.5, cache_bytes=0))
        with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=30) as c:
            body = {"feature": "c1", "ids": [1, 2, 3]}
            ok = c.post("/v1/lookup", json=body)
            assert ok.status_code == 200
            server.stop()
            r = c.post("/v1/lookup", json=body)
            assert r.status_code == 503, r.text
            assert f"127.0.0.1:{server.port}" in r.json()["detail"] and "Redis" in r.json()["detail"]
            wait_until(lambda: c.get("/readyz").status_code == 503, 10, "/readyz to report the outage")
            server.restart()
            wait_until(lambda: c.post("/v1/lookup", json=body).status_code == 200, 30, "lookups to recover")
            assert c.post("/v1/lookup", json=body).json() == ok.json()
            assert c.get("/readyz").status_code == 200
            metrics = dict(line.rsplit(" ", 1) for line in c.get("/metrics").text.splitlines()
                           if line and not line.startswith("#"))
            assert float(metrics["recsys_serve_backend_errors_total"]) >= 1
    finally:
        server.stop()


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "full-app"])
def test_a_hung_redis_costs_a_request_one_timeout_not_two(tiny_run, tmp_path, fast_path):
    # the fast path's failed read is the app's answer: the app does not read again (and wait again)
    server = start_redis(tmp_path / "redis")
    try:
        publish.export(tiny_run, server.url, publish.ExportSettings(version="v1"), progress=False)
        app = create_app(ServeSettings(redis=server.url, refresh_s=3600, redis_timeout_s=0.5, cache_bytes=0,
                                       fast_path=fast_path))
        backend = app.state.backend
        with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=30) as c:
            body = {"feature": "c1", "ids": [1, 2, 3]}
            assert c.post("/v1/lookup", json=body).status_code == 200
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                before = backend.errors
                r = c.post("/v1/lookup", json=body)
                assert r.status_code == 503 and "TimeoutError" in r.json()["detail"], r.text
                assert backend.errors - before == 1  # one Redis read failed, and only one was tried
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            wait_until(lambda: c.post("/v1/lookup", json=body).status_code == 200, 30, "lookups to recover")
    finally:
        server.stop()


def test_a_failure_of_an_older_call_does_not_undo_a_newer_calls_recovery(tiny_run, redis_server):
    # the follower's refresh and requests overlap: a call that began before Redis came back
    # can fail after a later call has answered, and must not mark the service unready again
    import redis

    publish.export(tiny_run, redis_server.url, publish.ExportSettings(version="v1"), progress=False)
    backend = RedisBackend(redis_server.url, refresh_s=3600)

    async def run():
        await backend.refresh()
        assert backend.status()[0], backend.status()
        release = asyncio.Event()

        async def failing(_client):
            await release.wait()
            raise redis.ConnectionError("the connection broke in the outage")

        async def answering(client):
            return await client.get("recsys:current")

        older = asyncio.create_task(backend._call("an older read", failing))
        await asyncio.sleep(0)  # the older call starts first
        assert await backend._call("a newer read", answering) == b"v1"
        release.set()
        with pytest.raises(BackendUnavailable, match="an older read"):
            await older
        ready_after_older, why = backend.status()

        # the other order: a newer call's failure stands though an older call answers after it
        release.clear()

        async def answering_late(client):
            await release.wait()
            return await client.get("recsys:current")

        async def failing_now(_client):
            raise redis.ConnectionError("Redis went away again")

        older = asyncio.create_task(backend._call("an older read", answering_late))
        await asyncio.sleep(0)
        with pytest.raises(BackendUnavailable):
            await backend._call("a newer read", failing_now)
        release.set()
        assert await older == b"v1"
        ready_after_newer, why_newer = backend.status()
        await backend.close()
        return ready_after_older, why, ready_after_newer, why_newer

    ready_after_older, why, ready_after_newer, why_newer = asyncio.run(run())
    assert ready_after_older, why
    assert backend.errors == 2
    assert not ready_after_newer and "a newer read" in why_newer and "went away again" in why_newer


def test_a_manifest_the_server_cannot_serve_is_refused_and_the_old_version_stays(tiny_run, redis_server):
    import redis

    publish.export(tiny_run, redis_server.url, publish.ExportSettings(version="good"), progress=False)
    client = redis.Redis.from_url(redis_server.url)
    manifest = json.loads(client.get("recsys:manifest:good"))
    manifest["hashing"]["salts"]["c1"] = "0" * 16  # as if hashed by another function
    client.set("recsys:manifest:alien", json.dumps(manifest))
    app = create_app(ServeSettings(redis=redis_server.url, refresh_s=0.02))
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.post("/v1/lookup", json={"feature": "c1", "ids": [1]}).json()["version"] == "good"
        client.set("recsys:current", "alien")
        wait_until(lambda: "refused version 'alien'" in c.get("/readyz").json()["detail"], 30,
                   "the refusal in /readyz")
        r = c.post("/v1/lookup", json={"feature": "c1", "ids": [1]})
        assert r.status_code == 200 and r.json()["version"] == "good"
        assert c.get("/readyz").status_code == 200 and "salt" in c.get("/readyz").json()["detail"]
