"""Bad content in Redis never makes the lookup service answer 5xx or stop: a row value it
cannot decode is served as an unseen id (counted, named in /readyz); a manifest, a ``current``
or a live manifest that does not validate is refused (named in /readyz) while the version
served until then stays; a served version a gc deletes makes the service unready (503),
never an answer of defaults as if they were rows; and a refused name published again is
tried again. Every test runs against a real redis-server."""

from __future__ import annotations

import copy
import json
import logging

import httpx
import numpy as np
import pyarrow.parquet as pq
import pytest
import redis

from conftest import wait_until
from embedding_server import export as publish
from embedding_server.app import create_app
from embedding_server.catalog import Catalog
from embedding_server.settings import ServeSettings
from recsys.features import hashing
from recsys.redisio import live
from recsys.redisio import published as layout
from recsys.train.live_writer import LiveWriter
from serving_data import LiveServer

pytestmark = pytest.mark.redis

DIM = 16


def trained_ids(tiny_run, feature: str, n: int) -> list:
    data = pq.read_table(sorted((tiny_run.parent / "data" / "train").glob("*.parquet"))[0], columns=[feature])
    return list(dict.fromkeys(v for v in data.column(feature).to_pylist() if v is not None))[:n]


def manifest_of(client, version: str) -> dict:
    return json.loads(client.get(layout.manifest_key("recsys", version)))


def row_key(manifest: dict, version: str, table: str, raw_id: int) -> bytes:
    key = hashing.hash_int64(np.array([raw_id], dtype=np.int64), table)
    return layout.row_keys("recsys", version, table, key, manifest["buckets"])[0]


def unseen_vector(manifest: dict, table: str, raw_id: int) -> np.ndarray:
    key = hashing.hash_int64(np.array([raw_id], dtype=np.int64), table)
    return Catalog.from_manifest(manifest, "test").tables[table].defaults(key)[0]


def bad_rows_counted(url: str, source: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f'recsys_serve_bad_rows_total{{source="{source}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def detail(c: httpx.Client) -> str:
    return c.get("/readyz").json()["detail"]


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "full-app"])
@pytest.mark.parametrize("value", [b"\x00" * 12, np.full(DIM, np.nan, dtype="<f4").tobytes()],
                         ids=["wrong-length", "nan"])
def test_a_row_that_cannot_be_decoded_is_served_as_an_unseen_id(tiny_run, redis_server, fast_path, value):
    publish.export(tiny_run, redis_server.url, publish.ExportSettings(version="v1"), progress=False)
    client = redis.Redis.from_url(redis_server.url)
    manifest = manifest_of(client, "v1")
    bad, good = trained_ids(tiny_run, "c1", 2)
    client.set(row_key(manifest, "v1", "c1", bad), value)
    app = create_app(ServeSettings(redis=redis_server.url, fast_path=fast_path))  # the row cache on
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        for ask in (1, 2):  # the unusable value is never cached: read, and counted, again
            r = c.post("/v1/lookup", json={"feature": "c1", "ids": [bad, good]})
            assert r.status_code == 200, r.text
            assert r.json()["found"] == [False, True] and r.json()["version"] == "v1"
            np.testing.assert_array_equal(np.float32(r.json()["embeddings"][0]), unseen_vector(manifest, "c1", bad))
            assert bad_rows_counted(server.url, "published") == ask
        ready = c.get("/readyz")
        assert ready.status_code == 200
        assert "row value(s) of version 'v1' table 'c1' served as unseen ids" in ready.json()["detail"], ready.json()
        why = "a value of 12 bytes, expected 64 (16 x float32)" if len(value) == 12 else "not finite (NaN or infinity)"
        assert why in ready.json()["detail"], ready.json()
        r = c.post("/v1/lookup", json={"feature": "c1", "ids": [bad], "pooling": "sum"},
                   headers={"accept": "application/octet-stream"})
        assert r.status_code == 200


def _mutations(good: dict) -> dict[str, bytes]:
    """Manifests (raw values of ``ns:manifest:<v>``) a server must refuse, by name."""

    def changed(edit) -> bytes:
        m = copy.deepcopy(good)
        edit(m)
        return json.dumps(m).encode()

    def set_(path, value):
        def edit(m):
            d = m
            for p in path[:-1]:
                d = d[p]
            d[path[-1]] = value
        return edit

    feat0 = good["features"][0]
    return {
        "buckets-0": changed(set_(["buckets"], 0)),
        "buckets-text": changed(set_(["buckets"], "64")),
        "buckets-huge": changed(set_(["buckets"], 1 << 40)),
        "dim-0": changed(set_(["tables", "c1", "dim"], 0)),
        "dim-float": changed(set_(["tables", "c1", "dim"], 16.5)),
        "rows-negative": changed(set_(["tables", "c1", "rows"], -1)),
        "bound-nan": changed(set_(["tables", "c1", "init_bound"], float("nan"))),
        "min-count-0": changed(set_(["tables", "c1", "min_count"], 0)),
        "num-rows-0": changed(set_(["tables", "c1", "num_rows"], 0)),
        "table-a-list": changed(set_(["tables", "c1"], [16])),
        "tables-a-list": changed(set_(["tables"], [])),
        "table-unknown-field": changed(set_(["tables", "c1", "color"], "red")),
        "table-name-with-brace": changed(lambda m: (m["tables"].__setitem__("c}1", m["tables"]["c1"]),
                                                    m["hashing"]["salts"].__setitem__("c}1", "0"))),
        "salts-missing": changed(lambda m: m["hashing"]["salts"].pop("c1")),
        "kind-unknown": changed(lambda m: m["features"].__setitem__(0, {**feat0, "kind": "float"})),
        "pooling-unknown": changed(lambda m: m["features"].__setitem__(0, {**feat0, "pooling": "max"})),
        "feature-of-no-table": changed(lambda m: m["features"].append({**feat0, "name": "zz", "table": "nope"})),
        "features-a-dict": changed(set_(["features"], {})),
        "dense-unusable": changed(set_(["dense"], {"columns": ["i1"], "transform": "signed_log1p"})),
        "dtype-unknown": changed(set_(["dtype"], "int8")),
        "wide-text": changed(set_(["wide"], "yes")),
        "format-2": changed(set_(["format"], 2)),
        "version-of-another": changed(set_(["version"], "v0")),
        "a-list": b"[1, 2]",
        "not-json": b"{not json",
        "not-utf8": b"\xff\xfe{}",
        "nested-deep": b"[" * 100_000 + b"]" * 100_000,
    }


def test_a_manifest_that_does_not_validate_is_refused_and_the_old_version_stays(tiny_run, redis_server, caplog):
    publish.export(tiny_run, redis_server.url, publish.ExportSettings(version="v1"), progress=False)
    client = redis.Redis.from_url(redis_server.url)
    good = manifest_of(client, "v1")
    del good["version"]  # checked only when present: each mutation is refused for what it changes
    body = {"feature": "c1", "ids": trained_ids(tiny_run, "c1", 3)}
    app = create_app(ServeSettings(redis=redis_server.url, refresh_s=0.02))
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        served = c.post("/v1/lookup", json=body)
        assert served.status_code == 200 and served.json()["version"] == "v1"
        for name, text in _mutations(good).items():
            version = f"bad-{name}"
            client.set(layout.manifest_key("recsys", version), text)
            client.set(layout.current_key("recsys"), version)
            wait_until(lambda: f"refused version {version!r}" in detail(c), 30, f"the refusal of {version}")
            ready = c.get("/readyz")
            assert ready.status_code == 200 and ready.json()["detail"].startswith("serving version v1"), ready.json()
            assert f"manifest of version {version!r}" in ready.json()["detail"], ready.json()
            for fast in ({}, {"accept": "application/octet-stream"}):
                r = c.post("/v1/lookup", json=body, headers=fast)
                assert r.status_code == 200, (name, r.text)
            assert c.post("/v1/lookup", json=body).content == served.content, name
            assert c.get("/v1/tables").json()["version"] == "v1"
        # current naming a version with no manifest: not served, said, the old one stays
        client.set(layout.current_key("recsys"), "never-published")
        wait_until(lambda: "'never-published'" in detail(c) and "has no manifest" in detail(c), 30, "the note")
        assert c.get("/readyz").status_code == 200
        assert c.post("/v1/lookup", json=body).content == served.content
    assert not [r for r in caplog.records if r.exc_info], "a refresh logged a traceback"


def test_the_issues_manifest_with_buckets_0_is_refused(tiny_run, redis_server):
    """The reported case: the server switched to it and answered 500 to every lookup."""
    publish.export(tiny_run, redis_server.url, publish.ExportSettings(version="v1"), progress=False)
    client = redis.Redis.from_url(redis_server.url)
    client.set(layout.manifest_key("recsys", "v2"), json.dumps({**manifest_of(client, "v1"), "buckets": 0,
                                                                 "version": "v2"}))
    app = create_app(ServeSettings(redis=redis_server.url, refresh_s=0.02))
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        client.set(layout.current_key("recsys"), "v2")
        wait_until(lambda: "refused version 'v2'" in detail(c), 30, "the refusal")
        assert "buckets must be an integer in [1, 65536], found 0" in detail(c)
        r = c.post("/v1/lookup", json={"feature": "c1", "ids": [1, 2]})
        assert r.status_code == 200 and r.json()["version"] == "v1"


@pytest.mark.parametrize("value", [b"\xff\xfe", b"has space", b"live", "hash"], ids=["not-utf8", "not-a-name",
                                                                                   "live", "a-hash"])
def test_a_current_that_is_no_version_name_neither_stops_the_start_nor_the_service(tiny_run, redis_server, value,
                                                                                     caplog):
    publish.export(tiny_run, redis_server.url, publish.ExportSettings(version="v1"), progress=False)
    client = redis.Redis.from_url(redis_server.url)
    cur = layout.current_key("recsys")

    def spoil():
        if value == "hash":  # in one MULTI: a refresh between the two would see no current at all
            with client.pipeline(transaction=True) as pipe:
                pipe.delete(cur).hset(cur, "a", "b").execute()
        else:
            client.set(cur, value)

    spoil()  # before the start: the service starts, unready, saying why
    with LiveServer(create_app(ServeSettings(redis=redis_server.url, refresh_s=0.02))) as server, \
            httpx.Client(base_url=server.url, timeout=30) as c:
        ready = c.get("/readyz")
        assert ready.status_code == 503 and "refused version" in ready.json()["detail"], ready.json()
        r = c.post("/v1/lookup", json={"feature": "c1", "ids": [1]})
        assert r.status_code == 503 and "refused version" in r.json()["detail"]
        client.delete(cur)
        client.set(cur, "v1")
        wait_until(lambda: c.get("/readyz").status_code == 200, 30, "v1 served")
        spoil()  # while serving: v1 stays
        wait_until(lambda: "refused version" in detail(c), 30, "the refusal")
        assert c.get("/readyz").status_code == 200
        r = c.post("/v1/lookup", json={"feature": "c1", "ids": [1]})
        assert r.status_code == 200 and r.json()["version"] == "v1"
    assert not [r for r in caplog.records if r.exc_info], "a refresh logged a traceback"


def _export_refused_v2(tiny_run, url, monkeypatch):
    """Export v2 with a manifest of a newer format: a server refuses it and serves v1 on."""
    orig = Catalog.to_manifest
    monkeypatch.setattr(Catalog, "to_manifest", lambda self, **kw: {**orig(self, **kw), "format": 2})
    publish.export(tiny_run, url, publish.ExportSettings(version="v2"), progress=False)
    monkeypatch.setattr(Catalog, "to_manifest", orig)


def test_a_served_version_a_gc_deletes_makes_the_server_unready_not_an_answer_of_defaults(tiny_run, redis_server,
                                                                                         monkeypatch):
    publish.export(tiny_run, redis_server.url, publish.ExportSettings(version="v1"), progress=False)
    ids = trained_ids(tiny_run, "c1", 4)
    app = create_app(ServeSettings(redis=redis_server.url, refresh_s=0.02, cache_bytes=0))
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        served = c.post("/v1/lookup", json={"feature": "c1", "ids": ids})
        assert served.json()["found"] == [True] * 4
        _export_refused_v2(tiny_run, redis_server.url, monkeypatch)
        wait_until(lambda: "refused version 'v2'" in detail(c), 30, "the refusal of v2")
        assert c.post("/v1/lookup", json={"feature": "c1", "ids": ids}).content == served.content
        removed = publish.gc(redis_server.url, keep=1, superseded_grace_s=0)["removed"]
        assert "v1" in removed  # the version the server serves
        wait_until(lambda: c.get("/readyz").status_code == 503, 30, "the server to go unready")
        assert "version 'v1'" in detail(c) and "refused version 'v2'" in detail(c), detail(c)
        r = c.post("/v1/lookup", json={"feature": "c1", "ids": ids})
        assert r.status_code == 503, r.text  # not 200 with found: false for every id
        assert "version 'v1'" in r.json()["detail"]


def test_a_gc_marking_the_served_version_deleting_makes_the_server_unready_before_a_row_goes(tiny_run, redis_server,
                                                                                            monkeypatch):
    """The registry state 'deleting' comes before a gc's first UNLINK: seen at a refresh."""
    publish.export(tiny_run, redis_server.url, publish.ExportSettings(version="v1"), progress=False)
    app = create_app(ServeSettings(redis=redis_server.url, refresh_s=0.02))
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        _export_refused_v2(tiny_run, redis_server.url, monkeypatch)
        wait_until(lambda: "refused version 'v2'" in detail(c), 30, "the refusal of v2")
        client = redis.Redis.from_url(redis_server.url)
        entry = json.loads(client.hget(layout.registry_key("recsys"), "v1"))
        client.hset(layout.registry_key("recsys"), "v1", json.dumps({**entry, "state": "deleting"}))
        wait_until(lambda: c.get("/readyz").status_code == 503, 30, "the server to go unready")
        assert "a gc is deleting it" in detail(c)
        assert c.post("/v1/lookup", json={"feature": "c1", "ids": [1]}).status_code == 503


def test_a_refused_version_published_again_under_its_name_is_tried_again(tiny_run, redis_server, monkeypatch):
    publish.export(tiny_run, redis_server.url, publish.ExportSettings(version="v1"), progress=False)
    app = create_app(ServeSettings(redis=redis_server.url, refresh_s=0.02))
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        _export_refused_v2(tiny_run, redis_server.url, monkeypatch)
        wait_until(lambda: "refused version 'v2'" in detail(c), 30, "the refusal of v2")
        refreshes = app.state.backend.refreshes
        wait_until(lambda: app.state.backend.refreshes > refreshes + 2, 30, "refreshes after the refusal")
        assert c.post("/v1/lookup", json={"feature": "c1", "ids": [1]}).json()["version"] == "v1"
        client = redis.Redis.from_url(redis_server.url)
        mkey = layout.manifest_key("recsys", "v2")
        client.set(mkey, json.dumps({**json.loads(client.get(mkey)), "format": 1}))  # written again, right
        wait_until(lambda: c.post("/v1/lookup", json={"feature": "c1", "ids": [1]}).json()["version"] == "v2", 30,
                   "v2 to be served")
        assert c.get("/readyz").status_code == 200 and "refused" not in detail(c)


def test_a_live_value_that_cannot_be_decoded_is_not_served(tiny_run, redis_server):
    publish.export(tiny_run, redis_server.url, publish.ExportSettings(version="v1"), progress=False)
    salts = {"c1": f"{hashing.table_salt('c1'):016x}"}
    w = LiveWriter(redis_server.url, "live", buckets=8)
    w.write_manifest(live.manifest("test-run", "float32", 8, {"c1": DIM}, salts))
    ids = trained_ids(tiny_run, "c1", 4)
    keys = hashing.hash_int64(np.array(ids, dtype=np.int64), "c1")
    pushed = np.ones((4, DIM), dtype=np.float32)
    w.write([("c1", keys, pushed)], step=5, dtype="float32")
    names = live.row_keys("live", "c1", keys, 8)
    client = redis.Redis.from_url(redis_server.url)
    row = pushed[0].astype("<f4").tobytes()
    client.set(names[1], b"%016x" % 5 + row[:-4])  # a row one number short
    client.set(names[2], b"zz" + b"0" * 14 + row)  # not a step
    client.set(names[3], b"%016x" % (1 << 63) + row)  # a step past int64 (and live.MAX_STEP)
    plain = create_app(ServeSettings(redis=redis_server.url))
    app = create_app(ServeSettings(redis=redis_server.url, follow="live", refresh_s=0.02))
    with LiveServer(plain) as ref, LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        wait_until(lambda: "overlaying live namespace" in detail(c), 30, "the overlay")
        published_rows = httpx.post(ref.url + "/v1/lookup", json={"feature": "c1", "ids": ids}).json()["embeddings"]
        r = c.post("/v1/lookup", json={"feature": "c1", "ids": ids})
        assert r.status_code == 200, r.text
        assert r.json()["version"] == "v1+live@5" and r.json()["found"] == [True] * 4
        assert r.json()["embeddings"][0] == [1.0] * DIM  # the good live row
        assert r.json()["embeddings"][1:] == published_rows[1:]  # the published rows, not the bad live ones
        assert bad_rows_counted(server.url, "live") == 3
        assert "3 row value(s) of live namespace 'live' table 'c1' not overlaid" in detail(c), detail(c)


@pytest.mark.parametrize("manifest", [
    {"buckets": 0}, {"buckets": True}, {"tables": {"c1": {"dim": "16"}}}, {"tables": {}}, b"\xff", "hash"],
    ids=["buckets-0", "buckets-bool", "dim-text", "no-tables", "not-utf8", "a-hash"])
def test_a_live_manifest_that_does_not_validate_leaves_the_published_rows(tiny_run, redis_server, manifest, caplog):
    publish.export(tiny_run, redis_server.url, publish.ExportSettings(version="v1"), progress=False)
    client = redis.Redis.from_url(redis_server.url)
    key = live.manifest_key("live")
    if manifest == "hash":
        client.hset(key, "a", "b")
    elif isinstance(manifest, bytes):
        client.set(key, manifest)
    else:
        good = live.manifest("test-run", "float32", 8, {"c1": DIM}, {"c1": f"{hashing.table_salt('c1'):016x}"})
        client.set(key, json.dumps({**good, **manifest}))
    app = create_app(ServeSettings(redis=redis_server.url, follow="live", refresh_s=0.02))
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        wait_until(lambda: "not overlaid" in detail(c), 30, "the live manifest's refusal")
        assert c.get("/readyz").status_code == 200
        r = c.post("/v1/lookup", json={"feature": "c1", "ids": [1, 2]})
        assert r.status_code == 200 and r.json()["version"] == "v1"
    assert not [r for r in caplog.records if r.exc_info], "a refresh logged a traceback"
