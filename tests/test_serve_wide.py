"""The wide arm's weights (``model.wide``) served like the embeddings: ``"arm": "wide"``.

- A served weight is the checkpoint's, bit for bit, from the embedded backend and from a
  version published to Redis (JSON and binary); an unseen id weighs 0 with found=false.
- A ranking service reproduces the model's wide term from served weights: per eval row,
  the sum over features of the pooled weights equals what the model adds to its logit.
- A model trained without the wide arm answers a wide lookup with a 422 naming the feature,
  the missing arm and what the version serves; everything else is as before.
(Live pushes of the wide weights while a job trains: ``test_publish.py``.)"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import redis

from embedding_server import export as publish
from embedding_server.app import create_app
from embedding_server.settings import ServeSettings
from recsys.checkpoint import read as checkpoint_files
from recsys.features import hashing
from recsys.redisio import published as layout
from serving_data import JOB, UNSEEN_INT, UNSEEN_STR, LiveServer, eval_wide, probe_file, train_tiny
from test_serve import lookup

pytestmark = pytest.mark.redis

PROBED = ("c1", "c3", "m2")  # an int64 and a string single-hot feature, a string multi-hot one


@pytest.fixture(scope="module")
def wide_run(tmp_path_factory):
    """The tiny job trained with ``model.wide = true`` (1 process, CLI)."""
    return train_tiny(tmp_path_factory.mktemp("wide_run"), "--set", "model.wide=true")


@pytest.fixture(scope="module")
def schema():
    from recsys.config import load_job

    return load_job(JOB).schema


@pytest.fixture(scope="module")
def wide_weights(wide_run):
    """{wide table: {key: float32 weight}} of the run's latest checkpoint."""
    ckpt = checkpoint_files.resolve(wide_run)
    names = [n for n in checkpoint_files.load_meta(ckpt)["tables"] if n.endswith(".wide")]
    out = {}
    for name, t in checkpoint_files.load_sparse(ckpt, names).items():
        keys = t.column("key").to_numpy()
        w = t.column("embedding").combine_chunks().flatten().to_numpy()
        assert w.shape == keys.shape, f"{name}: not one weight per key"
        out[name] = dict(zip(keys.tolist(), w.astype(np.float32)))
    assert len(out) == 28
    return out


def trained_ids(run, column: str, n: int) -> list:
    """Return ``n`` distinct ids of ``column`` from the training data (bags flattened)."""
    import pyarrow.parquet as pq

    data = pq.read_table(sorted((run.parent / "data" / "train").glob("*.parquet"))[0], columns=[column])
    values = data.column(column).to_pylist()
    flat = [i for v in values if v for i in v] if isinstance(next(v for v in values if v), list) else values
    return list(dict.fromkeys(v for v in flat if v is not None))[:n]


def key_of(feat, ids: list) -> np.ndarray:
    if feat.kind == "string":
        return hashing.hash_string_list(ids, feat.table)
    return hashing.hash_int64(np.array(ids, dtype=np.int64), feat.table)


def check_wide_weights(url: str, run, schema, weights, binary: bool) -> None:
    """Served weights of trained and unseen ids of ``PROBED`` equal the checkpoint's exactly."""
    for name in PROBED:
        feat = schema.feature(name)
        unseen = [f"{UNSEEN_STR}{i}" for i in range(3)] if feat.kind == "string" else [UNSEEN_INT + i for i in range(3)]
        ids = trained_ids(run, feat.column, 60) + unseen
        _, [(vec, found)] = lookup(url, {"feature": name, "ids": ids, "arm": "wide"}, binary)
        table = weights[f"{feat.table}.wide"]
        keys = key_of(feat, ids).tolist()
        want = np.array([table.get(k, 0.0) for k in keys], dtype=np.float32)
        assert vec.shape == (len(ids), 1), (name, vec.shape)
        np.testing.assert_array_equal(found, [k in table for k in keys], err_msg=f"feature {name}")
        np.testing.assert_array_equal(vec[:, 0], want, err_msg=f"feature {name}")
        assert found[:60].all() and not found[60:].any(), name
        assert np.count_nonzero(want) >= 50, f"feature {name}: the trained weights are mostly 0"
        # the embeddings of the same ids: the wide weights are keyed like them
        _, [(emb, emb_found)] = lookup(url, {"feature": name, "ids": ids}, binary)
        assert emb.shape == (len(ids), 16)
        np.testing.assert_array_equal(emb_found, found)
        # pooled like the embeddings
        _, [(pooled, _)] = lookup(url, {"feature": name, "ids": ids, "arm": "wide", "pooling": "mean"}, binary)
        assert pooled.shape == (1, 1)
        assert pooled[0, 0] == pytest.approx(float(want.astype(np.float64).mean()), rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_embedded_serves_the_checkpoints_wide_weights(wide_run, schema, wide_weights, binary):
    with LiveServer(create_app(ServeSettings(checkpoint=str(wide_run)))) as server:
        check_wide_weights(server.url, wide_run, schema, wide_weights, binary)


def test_a_published_version_serves_the_checkpoints_wide_weights(wide_run, schema, wide_weights, redis_server):
    ckpt = checkpoint_files.resolve(wide_run)
    summary = publish.export(ckpt, redis_server.url, progress=False)
    assert {n: rows for n, rows in summary["tables"].items() if n.endswith(".wide")} == \
        {n: len(w) for n, w in wide_weights.items()}
    assert len(summary["tables"]) == 56
    client = redis.Redis.from_url(redis_server.url)
    manifest = json.loads(client.get(layout.manifest_key("recsys", summary["version"])))
    assert manifest["wide"] is True
    assert manifest["tables"]["c3.wide"]["wide_of"] == "c3" and manifest["tables"]["c3.wide"]["dim"] == 1
    assert "wide_of" not in manifest["tables"]["c3"]
    # the wide weights' keys are the embeddings' keys: hashed with the embedding table's salt
    assert manifest["hashing"]["salts"]["c3.wide"] == manifest["hashing"]["salts"]["c3"]
    with LiveServer(create_app(ServeSettings(redis=redis_server.url))) as server:
        for binary in (False, True):
            check_wide_weights(server.url, wide_run, schema, wide_weights, binary)
        tables = {t["name"]: t for t in httpx.get(server.url + "/v1/tables").json()["tables"]}
        assert tables["m2.wide"] == {"name": "m2.wide", "dim": 1, "rows": len(wide_weights["m2.wide"]),
                                     "features": ["m2"], "arm": "wide"}
        assert tables["m2"]["arm"] == "embedding" and tables["m2"]["dim"] == 16
        r = httpx.post(server.url + "/v1/lookup/batch", json={"lookups": [
            {"feature": "c1", "ids": [1]}, {"feature": "c1", "ids": [1], "arm": "wide"}]})
        assert r.status_code == 200
        results = r.json()["results"]
        assert "arm" not in results[0] and results[1]["arm"] == "wide" and r.json()["version"] == summary["version"]
    # a version published without the wide tables says which table a wide lookup misses
    publish.export(ckpt, redis_server.url, publish.ExportSettings(namespace="partial", tables=["c1", "c3"]),
                   progress=False)
    with LiveServer(create_app(ServeSettings(redis=redis_server.url, namespace="partial"))) as server:
        assert httpx.post(server.url + "/v1/lookup", json={"feature": "c1", "ids": [1]}).status_code == 200
        r = httpx.post(server.url + "/v1/lookup", json={"feature": "c1", "ids": [1], "arm": "wide"})
        assert r.status_code == 422
        [err] = r.json()["detail"]
        assert err["loc"] == ["body", "arm"]
        assert "feature 'c1'" in err["msg"] and "table 'c1.wide'" in err["msg"] and "['c1', 'c3']" in err["msg"]


@pytest.mark.parametrize("backend", ["embedded", "redis"])
def test_served_wide_weights_reproduce_the_models_wide_term(wide_run, schema, backend, tmp_path, request):
    """Per eval row: one batch request of every feature's wide weights (pooled as the feature
    pools) gives the weights the evaluation pooled, and their sum is what the model adds to
    its logit (the tiny job's dense columns are plain numbers: no dense first-order term)."""
    path = probe_file(wide_run, tmp_path)  # 48 eval rows, some ids replaced by unseen ones
    names, want, sums, terms = eval_wide(wide_run, path)
    assert np.abs(terms).max() > 1e-3, "the wide term is too small to tell anything"
    np.testing.assert_allclose(sums, terms, rtol=0, atol=1e-5)  # forward adds exactly the pooled sum
    if backend == "redis":
        redis_server = request.getfixturevalue("redis_server")
        publish.export(checkpoint_files.resolve(wide_run), redis_server.url, progress=False)
        settings = ServeSettings(redis=redis_server.url)
    else:
        settings = ServeSettings(checkpoint=str(wide_run))
    import pyarrow.parquet as pq

    rows = pq.read_table(path)
    feats = [schema.feature(n) for n in names]
    columns = {f.name: rows.column(f.column).to_pylist() for f in feats}
    served = np.zeros(want.shape, dtype=np.float32)
    unseen = 0
    with LiveServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        for b in range(rows.num_rows):
            lookups = []
            for f in feats:
                v = columns[f.name][b]
                ids = [i for i in (v or []) if i is not None] if f.multi_hot else ([] if v is None else [v])
                lookups.append({"feature": f.name, "ids": ids, "arm": "wide", "pooling": f.pooling})
            r = client.post("/v1/lookup/batch", json={"lookups": lookups})
            assert r.status_code == 200, r.text
            for j, res in enumerate(r.json()["results"]):
                assert res["arm"] == "wide" and len(res["embeddings"]) == 1 and len(res["embeddings"][0]) == 1
                served[b, j] = res["embeddings"][0][0]
                unseen += res["found"].count(False)
    assert unseen >= 9  # the probe's unseen ids (4 in c1, 4 in c3, 1 in m1) weigh 0
    single = [j for j, f in enumerate(feats) if not f.multi_hot]
    np.testing.assert_array_equal(served[:, single], want[:, single])
    np.testing.assert_allclose(served, want, rtol=1e-6, atol=1e-8)  # mean pooling: another summation order
    np.testing.assert_allclose(served.astype(np.float64).sum(axis=1), terms, rtol=0, atol=1e-5)


@pytest.mark.parametrize("backend", ["embedded", "redis"])
def test_a_model_without_the_wide_arm_refuses_wide_lookups(tiny_run, backend, request):
    """The wide arm asked of a model trained without it: 422 at the request's ``arm``, naming
    the feature, model.wide and the features served; embedding lookups and the table list
    are as before (no wide tables, every table an embedding one)."""
    if backend == "redis":
        redis_server = request.getfixturevalue("redis_server")
        summary = publish.export(checkpoint_files.resolve(tiny_run), redis_server.url, progress=False)
        manifest = json.loads(redis.Redis.from_url(redis_server.url).get(
            layout.manifest_key("recsys", summary["version"])))
        assert "wide" not in manifest and not any("wide_of" in t for t in manifest["tables"].values())
        settings = ServeSettings(redis=redis_server.url)
    else:
        settings = ServeSettings(checkpoint=str(tiny_run))
    with LiveServer(create_app(settings)) as server:
        r = httpx.post(server.url + "/v1/lookup", json={"feature": "c3", "ids": ["a"], "arm": "wide"})
        assert r.status_code == 422
        [err] = r.json()["detail"]
        assert err["loc"] == ["body", "arm"] and err["type"] == "arm_not_served"
        msg = err["msg"]
        assert "arm 'wide' of feature 'c3'" in msg and "model.wide = false" in msg and "'m2'" in msg, msg
        r = httpx.post(server.url + "/v1/lookup/batch", json={"lookups": [
            {"feature": "c1", "ids": [1]}, {"feature": "m1", "ids": [1, 2], "arm": "wide", "pooling": "mean"}]})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "lookups", 1, "arm"]
        assert "feature 'm1'" in r.json()["detail"][0]["msg"]
        r = httpx.post(server.url + "/v1/lookup", json={"feature": "c1", "ids": [1], "arm": "deep"})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "arm"]
        r = httpx.post(server.url + "/v1/lookup/batch", json={"lookups": [{"feature": "c1", "ids": [1]}]})
        assert r.status_code == 200 and set(r.json()["results"][0]) == {"feature", "embeddings", "found"}
        tables = httpx.get(server.url + "/v1/tables").json()["tables"]
        assert len(tables) == 28 and {t["arm"] for t in tables} == {"embedding"}
        assert not any(t["name"].endswith(".wide") for t in tables)
