"""export → serve round trips: a served vector equals what `recsys eval` reads for the raw id.

Both backends (Redis, embedded), both response formats (JSON, binary), int and string ids,
single- and multi-hot features, unseen ids (the initial vector, found=false)."""

from __future__ import annotations

import socket
import subprocess
import sys

import httpx
import numpy as np
import psutil
import pyarrow.parquet as pq
import pytest

from embedding_server import export as publish
from embedding_server import binary_body as wire
from embedding_server.app import create_app
from embedding_server.backends import EmbeddedBackend
from embedding_server.settings import ServeSettings
from recsys.checkpoint import read as checkpoint_files
from recsys.features import hashing
from serving_data import UNSEEN_INT, UNSEEN_STR, LiveServer, eval_pooled, probe_file

pytestmark = pytest.mark.redis


@pytest.fixture(scope="module")
def reference(tiny_run, tmp_path_factory):
    path = probe_file(tiny_run, tmp_path_factory.mktemp("probe"))
    names, pooled, rows = eval_pooled(tiny_run, path)
    ckpt = checkpoint_files.resolve(tiny_run)
    keys = {t: set(tab.column("key").to_pylist()) for t, tab in checkpoint_files.load_sparse(ckpt).items()}
    return names, pooled, rows, keys


def lookup(url: str, body: dict, binary: bool, route: str = "/v1/lookup"):
    """Return (version, [(vectors, found), ...]) from the service, in either format."""
    headers = {"accept": wire.MEDIA_TYPE} if binary else {}
    r = httpx.post(url + route, json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    if binary:
        assert r.headers["content-type"] == wire.MEDIA_TYPE
        return wire.decode(r.content)
    data = r.json()
    results = data["results"] if "results" in data else [data]
    return data["version"], [(np.asarray(x["embeddings"], dtype=np.float32).reshape(len(x["embeddings"]), -1),
                              np.asarray(x["found"], dtype=bool)) for x in results]


def check_against_eval(url: str, reference, binary: bool) -> None:
    names, pooled, rows, ckpt_keys = reference
    from recsys.config import load_job

    schema = load_job(sys.modules["serving_data"].JOB).schema
    seen_unseen = 0
    for f, name in enumerate(names):
        feat = schema.feature(name)
        values = rows.column(feat.column).to_pylist()
        if not feat.multi_hot:
            idx = [b for b, v in enumerate(values) if v is not None]
            ids = [values[b] for b in idx]
            _, [(vec, found)] = lookup(url, {"feature": name, "ids": ids}, binary)
            np.testing.assert_array_equal(vec, pooled[idx, f], err_msg=f"feature {name}")
            hashed = (hashing.hash_int64(np.array(ids, dtype=np.int64), feat.table) if feat.kind == "int64"
                      else hashing.hash_string_list(ids, feat.table))
            np.testing.assert_array_equal(found, [int(k) in ckpt_keys[feat.table] for k in hashed])
            unseen = [i for i, v in enumerate(ids) if v == UNSEEN_INT + i or v == f"{UNSEEN_STR}{i}"]
            assert not found[unseen].any()
            seen_unseen += len(unseen)
        else:
            bags = [(b, v) for b, v in enumerate(values) if v]
            body = {"lookups": [{"feature": name, "ids": v, "pooling": feat.pooling} for _, v in bags]}
            _, results = lookup(url, body, binary, route="/v1/lookup/batch")
            got = np.stack([vec[0] for vec, _ in results])
            np.testing.assert_allclose(got, pooled[[b for b, _ in bags], f], rtol=1e-5, atol=1e-6,
                                       err_msg=f"feature {name}")
    assert seen_unseen == 8  # 4 unseen ints in c1, 4 unseen strings in c3


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_embedded_serves_what_eval_reads(tiny_run, reference, binary):
    with LiveServer(create_app(ServeSettings(checkpoint=str(tiny_run)))) as server:
        check_against_eval(server.url, reference, binary)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_redis_serves_what_eval_reads(tiny_run, reference, redis_server, binary):
    publish.export(tiny_run / "checkpoints" / "latest", redis_server.url, progress=False)
    with LiveServer(create_app(ServeSettings(redis=redis_server.url))) as server:
        check_against_eval(server.url, reference, binary)
        version, _ = lookup(server.url, {"feature": "c1", "ids": [1]}, binary)
        assert version == publish.versions(redis_server.url)["current"]


def test_tables_and_readiness(tiny_run, redis_server):
    ckpt = checkpoint_files.resolve(tiny_run)
    counts = {t: pq.ParquetFile(checkpoint_files.sparse_files(ckpt, t)[0]).metadata.num_rows
              for t in checkpoint_files.load_meta(ckpt)["tables"]}
    with LiveServer(create_app(ServeSettings(redis=redis_server.url))) as server:
        r = httpx.get(server.url + "/readyz")
        assert r.status_code == 503 and "no version published" in r.json()["detail"]
        assert httpx.post(server.url + "/v1/lookup", json={"feature": "c1", "ids": [1]}).status_code == 503
        summary = publish.export(ckpt, redis_server.url, progress=False)
        r = httpx.post(server.url + "/v1/lookup", json={"feature": "c1", "ids": [1]})
        assert r.status_code == 200 and r.json()["version"] == summary["version"]
        assert httpx.get(server.url + "/readyz").status_code == 200
        tables = httpx.get(server.url + "/v1/tables").json()
        assert {t["name"]: t["rows"] for t in tables["tables"]} == counts
        assert {t["name"]: t["dim"] for t in tables["tables"]} == {t: 16 for t in counts}
        assert next(t for t in tables["tables"] if t["name"] == "c1")["features"] == ["c1"]
        assert httpx.get(server.url + "/healthz").json() == {"status": "ok"}
        text = httpx.get(server.url + "/metrics").text
        assert 'recsys_serve_requests_total{route="/v1/lookup",status="200"} 1.0' in text
        assert f'recsys_serve_version_info{{version="{summary["version"]}"}} 1.0' in text


def test_float16_export_serves_rounded_rows(tiny_run, redis_server):
    ckpt = checkpoint_files.resolve(tiny_run)
    publish.export(ckpt, redis_server.url, publish.ExportSettings(dtype="float16"), progress=False)
    rows = checkpoint_files.load_sparse(ckpt, ["c3"])["c3"]
    keys = rows.column("key").to_numpy()
    emb = rows.column("embedding").combine_chunks().flatten().to_numpy().reshape(len(keys), -1)
    backend = EmbeddedBackend(ckpt)
    with LiveServer(create_app(ServeSettings(redis=redis_server.url))) as server:
        # string ids of c3 whose keys are in the checkpoint: take them from the training data
        data = pq.read_table(sorted((tiny_run.parent / "data" / "train").glob("*.parquet"))[0], columns=["c3"])
        ids = list(dict.fromkeys(v for v in data.column("c3").to_pylist() if v is not None))[:200]
        _, [(vec, found)] = lookup(server.url, {"feature": "c3", "ids": ids}, binary=True)
    hashed = hashing.hash_string_list(ids, "c3")
    pos = {int(k): i for i, k in enumerate(keys)}
    assert found.sum() > 100
    for j in np.flatnonzero(found):
        np.testing.assert_array_equal(vec[j], emb[pos[int(hashed[j])]].astype(np.float16).astype(np.float32))
    assert backend.path == ckpt


def test_eval_accepts_the_latest_file(tiny_run):
    out = subprocess.run([sys.executable, "-m", "recsys.cli", "eval", "--checkpoint",
                          str(tiny_run / "checkpoints" / "latest")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert '"auc"' in out.stdout


def serve_workers(pid: int) -> list[psutil.Process]:
    """Return the worker processes of the ``recsys serve --workers N`` process ``pid``."""
    out = []
    for child in psutil.Process(pid).children():
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                out.append(child)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.multiproc
def test_workers_share_one_port_and_sum_their_metrics(tiny_run):
    from recsys.runtime.spawn import free_port

    from conftest import wait_until

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "recsys.cli", "serve", "--checkpoint", str(tiny_run),
                             "--workers", "2", "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        def ready():
            try:
                return httpx.get(url + "/readyz").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(ready, 120, "two workers to serve")
        for i in range(30):  # 30 new connections, spread by the kernel over the workers
            assert httpx.post(url + "/v1/lookup", json={"feature": "c1", "ids": [i]}).status_code == 200
        text = httpx.get(url + "/metrics").text
        assert 'recsys_serve_requests_total{route="/v1/lookup",status="200"} 30.0' in text
        assert "recsys_serve_ids_per_request_count 30.0" in text

        # 16 connections opened at once reach both workers: each listens on its own socket and
        # the kernel spreads connections by address hash (one worker gets none with
        # probability 2**-15). On one shared socket, a burst went mostly to one worker.
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(16)]
        try:
            workers = serve_workers(proc.pid)
            assert len(workers) == 2

            def served() -> list[int]:
                return [sum(c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port
                            for c in w.net_connections("tcp")) for w in workers]

            wait_until(lambda: sum(served()) == 16, 30, "the workers to accept 16 connections")
            assert min(served()) >= 1, served()
        finally:
            for sock in held:
                sock.close()

        # a worker killed is replaced, and the service answers on
        workers[0].kill()
        wait_until(lambda: len(serve_workers(proc.pid)) == 2
                   and workers[0].pid not in [w.pid for w in serve_workers(proc.pid)], 60,
                   "a new worker in place of the killed one")
        wait_until(ready, 120, "the service after a worker was killed")
        for i in range(10):
            assert httpx.post(url + "/v1/lookup", json={"feature": "c1", "ids": [i]}).status_code == 200
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0


@pytest.mark.multiproc
def test_workers_that_cannot_start_stop_the_service_with_their_error(tmp_path):
    """A worker that dies before it serves (here: no checkpoint where one was named) stops
    the service with its error and a non-zero exit, instead of being restarted forever."""
    from recsys.runtime.spawn import free_port

    out = subprocess.run([sys.executable, "-m", "recsys.cli", "serve", "--checkpoint", str(tmp_path),
                          "--workers", "2", "--port", str(free_port())], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0
    assert "not a checkpoint" in out.stderr
    assert "before it served" in out.stderr
