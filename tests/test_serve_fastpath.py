"""The lookups' hot path (``embedding_server.fastpath``): what it answers is byte for byte
what the full app answers, everything else goes through the app unchanged, and the metrics
count each request once. Each comparison runs over every way rows are served: the embedded
backend, the Redis backend without and with its row cache, ``--follow`` with live rows
overlaid, and ``recsys serve --workers 2`` (processes, real redis-server)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from embedding_server import export as publish
from embedding_server.app import create_app
from embedding_server.fastpath import FastLookup
from embedding_server.settings import ServeSettings
from recsys.features import hashing
from recsys.redisio import live
from recsys.testing.harness import start_redis, start_service, stop_process
from serving_data import LiveServer

BINARY = {"accept": "application/octet-stream"}
BACKENDS = ["embedded", "redis", "redis-cache", "follow-live", "workers-2"]


def _fast_layer(app) -> FastLookup:
    assert isinstance(app.fast, FastLookup)  # in front of the whole app, not among its middleware
    return app.fast


@pytest.fixture(scope="module")
def published_redis(tiny_run, tmp_path_factory):
    """A redis-server holding tiny_run as version v1, and live rows of some requested ids."""
    from recsys.train.live_writer import LiveWriter

    server = start_redis(tmp_path_factory.mktemp("fastpath-redis"))
    try:
        publish.export(tiny_run, server.url, publish.ExportSettings(version="v1"), progress=False)
        tables = {"c1": 16, "c3": 16}
        w = LiveWriter(server.url, "live", buckets=8)
        w.write_manifest(live.manifest("test-run", "float32", 8, tables,
                                       {n: f"{hashing.table_salt(n):016x}" for n in tables}))
        keys_c1 = hashing.hash_int64(np.array([1, 5], dtype=np.int64), "c1")
        keys_c3 = hashing.hash_string_list([b"a", b"x"], "c3")
        rows = np.arange(2 * 16, dtype=np.float32).reshape(2, 16) / 7
        w.write([("c1", keys_c1, rows), ("c3", keys_c3, -rows)], step=3, dtype="float32")
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module", params=BACKENDS)
def servers(request, tiny_run, tmp_path_factory):
    """(the service with the fast path, the same without it, the first's app or None for
    processes) over one backend."""
    token = tmp_path_factory.mktemp("token") / "token"
    token.write_text("s3cret\n")
    kind = request.param
    if kind == "embedded":
        kw = dict(checkpoint=str(tiny_run))
    else:
        url = request.getfixturevalue("published_redis").url
        kw = dict(redis=url, cache_bytes=0 if kind == "redis" else 256 << 20,
                  follow="live" if kind == "follow-live" else "")
    kw.update(max_ids=100, max_body_bytes=4096, token_file=str(token))
    if kind == "workers-2":
        args = ["--redis", kw["redis"], "--workers", "2", "--max-ids", "100", "--max-body-bytes", "4096",
                "--token-file", str(token)]
        logs = tmp_path_factory.mktemp("workers")
        fast, fast_url = start_service(args, logs / "fast.log")
        try:
            slow, slow_url = start_service([*args, "--no-fast-path"], logs / "slow.log")
        except BaseException:
            stop_process(fast)
            raise
        try:
            yield _Url(fast_url), _Url(slow_url), None
        finally:
            stop_process(fast)
            stop_process(slow)
        return
    fast, slow = create_app(ServeSettings(**kw)), create_app(ServeSettings(fast_path=False, **kw))
    with LiveServer(fast) as f, LiveServer(slow) as s:
        if kind == "follow-live":  # the overlay is in use, or the comparison would not cover it
            for server in (f, s):  # both asked: their metrics stay comparable
                assert "overlaying live namespace" in httpx.get(server.url + "/readyz", headers=AUTH).json()["detail"]
        yield f, s, fast


class _Url:
    def __init__(self, url: str) -> None:
        self.url = url


AUTH = {"authorization": "Bearer s3cret"}

REQUESTS = [
    ("/v1/lookup", {"feature": "c1", "ids": [1, 2, 2, 99999]}, {}),
    ("/v1/lookup", {"feature": "c3", "ids": ["a", "b"], "pooling": "mean"}, BINARY),
    ("/v1/lookup/batch", {"lookups": [{"feature": "c1", "ids": [5]}, {"feature": "c3", "ids": ["x"]}]}, {}),
    ("/v1/lookup/batch", {"lookups": [{"feature": "c2", "ids": [7, 8]}]}, BINARY),
]

ERRORS = [  # (path, body or raw bytes, headers, status)
    ("/v1/lookup", {"feature": "nope", "ids": [1]}, AUTH, 422),
    ("/v1/lookup", {"feature": "c1", "ids": list(range(101))}, AUTH, 413),
    ("/v1/lookup", b'{"feature": "c1", "ids": [1', AUTH, 422),
    ("/v1/lookup", b'{"feature": "c1", "ids": [' + b"1, " * 2000 + b"1]}", AUTH, 413),  # past max_body_bytes
    ("/v1/lookup", {"feature": "c1", "ids": [1]}, {}, 401),
    ("/v1/lookup", {"feature": "c1", "ids": [1]}, {"authorization": "Bearer wrong"}, 401),
    ("/v1/lookup/batch", {"lookups": [{"feature": "c1", "ids": ["s"]}]}, AUTH, 422),
]


def _post(url, path, body, headers):
    if isinstance(body, bytes):
        return httpx.post(url + path, content=body, headers={"content-type": "application/json", **headers},
                          timeout=30)
    return httpx.post(url + path, json=body, headers=headers, timeout=30)


def _requests_counted(url: str) -> dict[tuple[str, str], float]:
    out = {}
    for line in httpx.get(url + "/metrics", headers=AUTH).text.splitlines():
        if line.startswith("recsys_serve_requests_total{"):
            labels, value = line[len("recsys_serve_requests_total{"):].split("} ")
            d = dict(part.split("=") for part in labels.split(","))
            out[(d["route"].strip('"'), d["status"].strip('"'))] = float(value)
    return out


@pytest.mark.parametrize("path, body, headers", REQUESTS)
def test_the_fast_path_answers_as_the_app_does(servers, path, body, headers):
    fast, slow, app = servers
    before = _fast_layer(app).answered if app is not None else 0
    a, b = _post(fast.url, path, body, {**AUTH, **headers}), _post(slow.url, path, body, {**AUTH, **headers})
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    assert a.content == b.content
    assert a.headers["content-type"] == b.headers["content-type"]
    if app is not None:
        assert _fast_layer(app).answered == before + 1  # answered by the fast path, not the app


def test_a_fast_answer_never_enters_the_frameworks_stack(servers, monkeypatch):
    fast, slow, app = servers
    if app is None:
        pytest.skip("the app runs in the worker processes")
    entered = []
    full = app.fast.app

    async def counted(scope, receive, send):
        entered.append(scope["path"])
        await full(scope, receive, send)

    monkeypatch.setattr(app.fast, "app", counted)
    for path, body, headers in REQUESTS:
        assert _post(fast.url, path, body, {**AUTH, **headers}).status_code == 200
        _post(slow.url, path, body, {**AUTH, **headers})  # the two servers' metrics stay comparable
    assert entered == []
    assert _post(fast.url, "/v1/lookup", {"feature": "nope", "ids": [1]}, AUTH).status_code == 422
    _post(slow.url, "/v1/lookup", {"feature": "nope", "ids": [1]}, AUTH)
    assert entered == ["/v1/lookup"]  # what it does not answer goes through the whole app


def test_with_fastapis_own_telemetry_on_every_request_goes_through_the_app(tiny_run, monkeypatch):
    app = create_app(ServeSettings(checkpoint=str(tiny_run)))
    monkeypatch.setattr(type(app), "instrumented", lambda self: True)  # as with a tracer provider configured
    with LiveServer(app) as server:
        for path, body, headers in REQUESTS:
            assert _post(server.url, path, body, headers).status_code == 200
    assert app.fast.answered == 0


@pytest.mark.parametrize("path, body, headers, status", ERRORS)
def test_what_the_fast_path_does_not_answer_the_app_answers_unchanged(servers, path, body, headers, status):
    fast, slow, app = servers
    before = _fast_layer(app).answered if app is not None else 0
    a, b = _post(fast.url, path, body, headers), _post(slow.url, path, body, headers)
    assert a.status_code == b.status_code == status, (a.text, b.text)
    assert a.content == b.content
    if app is not None:
        assert _fast_layer(app).answered == before


def test_each_request_is_counted_once_in_the_metrics(servers):
    fast, slow, _ = servers
    for path, body, headers in REQUESTS:
        _post(fast.url, path, body, {**AUTH, **headers})
        _post(slow.url, path, body, {**AUTH, **headers})
    for path, body, headers, _ in ERRORS:
        _post(fast.url, path, body, headers)
        _post(slow.url, path, body, headers)
    assert _requests_counted(fast.url) == _requests_counted(slow.url)


def test_the_switch_reads_true_or_false_from_the_environment(tiny_run):
    env = {"RECSYS_SERVE_CHECKPOINT": str(tiny_run)}
    assert ServeSettings.from_env({**env, "RECSYS_SERVE_FAST_PATH": "false"}).fast_path is False
    assert ServeSettings.from_env({**env, "RECSYS_SERVE_FAST_PATH": "1"}).fast_path is True
    assert ServeSettings.from_env(ServeSettings(checkpoint=str(tiny_run), fast_path=False).to_env()).fast_path is False
    with pytest.raises(ValueError, match="RECSYS_SERVE_FAST_PATH='maybe': expected true or false"):
        ServeSettings.from_env({**env, "RECSYS_SERVE_FAST_PATH": "maybe"})
