"""Bad requests get 4xx naming the field, never 5xx or a hang; the bearer token; the limits."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from embedding_server.app import create_app
from embedding_server.settings import ServeSettings
from serving_data import LiveServer


@pytest.fixture(scope="module")
def server(tiny_run):
    with LiveServer(create_app(ServeSettings(checkpoint=str(tiny_run), max_ids=100, max_body_bytes=4096))) as s:
        s.tiny_run = tiny_run
        yield s


def post(server, body, **kw):
    return httpx.post(server.url + "/v1/lookup", json=body, timeout=30, **kw)


@pytest.mark.parametrize("body, status, loc", [
    ({"feature": "nope", "ids": [1]}, 422, ["body", "feature"]),
    ({"feature": "c1", "ids": ["1"]}, 422, ["body", "ids", 0]),        # a string for an int64 feature
    ({"feature": "c3", "ids": ["a", 7]}, 422, ["body", "ids", 1]),     # an int for a string feature
    ({"feature": "c1", "ids": [1, True]}, 422, ["body", "ids", 1]),    # bools are not ids
    ({"feature": "c1", "ids": [1, 2**63]}, 422, ["body", "ids", 1]),   # past int64
    ({"feature": "c1", "ids": [1.5]}, 422, ["body", "ids", 0]),
    ({"feature": "c1", "ids": [1], "pooling": "max"}, 422, ["body", "pooling"]),
    ({"feature": "c1", "ids": [1], "extra": 1}, 422, ["body", "extra"]),
    ({"ids": [1]}, 422, ["body", "feature"]),
    ({"feature": "c1", "ids": list(range(101))}, 413, ["body", "ids"]),
])
def test_bad_lookups_name_the_field(server, body, status, loc):
    r = post(server, body)
    assert r.status_code == status, r.text
    assert any(item["loc"][: len(loc)] == loc for item in r.json()["detail"]), r.json()


def test_lone_surrogate_string_id_is_a_422(server):
    r = httpx.post(server.url + "/v1/lookup", content=b'{"feature": "c3", "ids": ["ok", "\\ud800"]}',
                   headers={"content-type": "application/json"})
    # the JSON parser refuses it, naming where
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body"]
    assert "column 40" in r.json()["detail"][0]["msg"]


def test_batch_limits_count_every_lookup(server):
    body = {"lookups": [{"feature": "c1", "ids": list(range(60))}, {"feature": "c2", "ids": list(range(60))}]}
    r = httpx.post(server.url + "/v1/lookup/batch", json=body)
    assert r.status_code == 413 and r.json()["detail"][0]["loc"] == ["body", "lookups"]
    body["lookups"][1] = {"feature": "c3", "ids": [1]}
    r = httpx.post(server.url + "/v1/lookup/batch", json=body)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "lookups", 1, "ids", 0]


def test_batch_limits_count_lookups_without_ids(tiny_run):
    """Empty lookups cost no id but each is resolved and read: ~150 k of them fit in 4 MiB."""
    settings = ServeSettings(checkpoint=str(tiny_run))  # the defaults: 4 MiB, 1000 lookups
    empty = {"feature": "c1", "ids": []}
    with LiveServer(create_app(settings)) as s:
        r = httpx.post(s.url + "/v1/lookup/batch", json={"lookups": [empty] * (settings.max_lookups + 1)}, timeout=60)
        assert r.status_code == 413, r.text[:300]
        assert r.json()["detail"] == [{"loc": ["body", "lookups"], "type": "too_many_lookups",
                                       "msg": "1001 lookups in one request, at most 1000 allowed"}]
        r = httpx.post(s.url + "/v1/lookup/batch", json={"lookups": [empty] * settings.max_lookups}, timeout=60)
        assert r.status_code == 200 and len(r.json()["results"]) == settings.max_lookups


@pytest.mark.parametrize("path", ["/v1/lookup", "/v1/lookup/batch", "/v1/dense"])
def test_non_utf8_and_deeply_nested_bodies_are_a_422(server, path):
    nested = b'{"values": {"i1": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}"  # 200 kB, under a 4 MiB limit
    bodies = {"non-UTF-8": b'{"values": {"i\xff\xfe1": [1.0]}, "feature": "\xc3\x28", "lookups": []}',
              "a non-UTF-8 first byte": b"\xff{}", "deeply nested": nested}
    with LiveServer(create_app(ServeSettings(checkpoint=str(server.tiny_run)))) as big:
        for what, body in bodies.items():
            r = httpx.post(big.url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
            assert r.status_code == 422, (what, r.status_code, r.text[:300])
            (item,) = r.json()["detail"]
            assert item["loc"] == ["body"] and item["type"] == "json_invalid", (what, item)
            assert "line 1 column" in item["msg"], (what, item)  # names where


def test_dense_lists_a_few_unknown_columns_not_all(server):
    body = {"values": {**{f"i{j}": [1.0] for j in range(1, 14)}, **{f"x{j}": [] for j in range(300)}}}
    r = httpx.post(server.url + "/v1/dense", json=body, timeout=30)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "values"]
    msg = r.json()["detail"][0]["msg"]
    assert "'x0'" in msg and "and 290 more" in msg and "'x299'" not in msg and len(msg) < 400, msg


def test_body_limits(server):
    big = b'{"feature": "c3", "ids": ["' + b"x" * 5000 + b'"]}'
    r = httpx.post(server.url + "/v1/lookup", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "4096" in r.json()["detail"][0]["msg"]

    def chunks():  # no content-length: the limit is counted while the body streams in
        yield b'{"feature": "c3", "ids": ["'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"]}'

    r = httpx.post(server.url + "/v1/lookup", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    r = httpx.post(server.url + "/v1/lookup", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422


def test_token_auth(tiny_run, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    app = create_app(ServeSettings(checkpoint=str(tiny_run), token_file=str(token)))
    with LiveServer(app) as s:
        body = {"feature": "c1", "ids": [1]}
        assert httpx.post(s.url + "/v1/lookup", json=body).status_code == 401
        r = httpx.post(s.url + "/v1/lookup", json=body, headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(s.url + "/metrics").status_code == 401
        assert httpx.get(s.url + "/v1/tables").status_code == 401
        ok = {"authorization": "Bearer s3cret-token"}
        assert httpx.post(s.url + "/v1/lookup", json=body, headers=ok).status_code == 200
        assert httpx.get(s.url + "/healthz").status_code == 200  # probes stay open
        r = httpx.get(s.url + "/readyz")
        # the probe answers, but where the rows come from (a path, a Redis URL) only with the token
        assert r.status_code == 200 and r.json() == {"ready": True} and str(tiny_run) not in r.text
        r = httpx.get(s.url + "/readyz", headers={"authorization": "Bearer wrong"})
        assert r.json() == {"ready": True}
        r = httpx.get(s.url + "/readyz", headers=ok)
        assert r.status_code == 200 and str(tiny_run) in r.json()["detail"] and r.json()["backend"] == "embedded"


def test_empty_token_file_is_refused(tiny_run, tmp_path):
    (tmp_path / "token").write_text("  \n")
    with pytest.raises(ValueError, match="expected one token"):
        create_app(ServeSettings(checkpoint=str(tiny_run), token_file=str(tmp_path / "token")))


# ------------------------------------------------------------------ fuzz over the OpenAPI schema


@pytest.mark.parametrize("path, method", [("/v1/lookup", "POST"), ("/v1/lookup/batch", "POST"), ("/v1/dense", "POST"),
                                          ("/v1/tables", "GET"), ("/readyz", "GET"), ("/metrics", "GET")])
def test_fuzz_never_a_server_error(tiny_run, path, method):
    """Requests generated from the OpenAPI schema (valid and invalid bodies) never get a 5xx."""
    app = create_app(ServeSettings(checkpoint=str(tiny_run), max_ids=50, max_body_bytes=8192))
    operation = schemathesis.openapi.from_asgi("/openapi.json", app)[path][method]
    calls = []
    strategy = st.one_of(*(operation.as_strategy(generation_mode=mode) for mode in GenerationMode))

    @given(case=strategy)
    @settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def check(case):
        response = case.call()
        calls.append(response.status_code)
        assert response.status_code < 500, (case.as_curl_command(), response.status_code, response.text[:500])

    check()
    if method == "POST":  # feature names are free text in the schema: mostly 422s; valid ids below
        assert len(calls) >= 30 and 422 in calls, sorted(set(calls))


ID = st.one_of(st.integers(min_value=-(2**70), max_value=2**70), st.text(max_size=12), st.booleans(),
               st.floats(allow_nan=False, allow_infinity=False), st.none())


def test_ids_of_every_shape_get_200_or_a_422_naming_them(tiny_run):
    """For real features, any JSON ids: 200 exactly when every id fits the feature's kind."""
    app = create_app(ServeSettings(checkpoint=str(tiny_run)))
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:

        @given(feature=st.sampled_from(["c1", "c3", "m1", "m2"]), ids=st.lists(ID, max_size=8),
               pooling=st.sampled_from(["none", "sum", "mean"]))
        @settings(max_examples=150, deadline=None, database=None)
        def check(feature, ids, pooling):
            r = client.post("/v1/lookup", json={"feature": feature, "ids": ids, "pooling": pooling})
            string_feature = feature in ("c3", "m2")

            def fits(v):
                if string_feature:
                    return type(v) is str
                return type(v) is int and -(2**63) <= v < 2**63

            if all(fits(v) for v in ids):
                assert r.status_code == 200, r.text
                body = r.json()
                assert len(body["found"]) == len(ids)
                assert len(body["embeddings"]) == (len(ids) if pooling == "none" else 1)
            else:
                assert r.status_code == 422, r.text
                assert r.json()["detail"][0]["loc"][:2] == ["body", "ids"]

        check()
