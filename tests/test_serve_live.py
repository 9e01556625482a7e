"""recsys serve --follow: live rows a training job pushes (recsys.redisio.live) overlaid on the
published version, the version string naming the newest live step served, the TTL bound of
the live row cache, the step guard under interleaved writers, incompatible live manifests,
a Redis Cluster, and the flags' errors."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import subprocess
import sys
import threading

import httpx
import numpy as np
import pyarrow.parquet as pq
import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import wait_until
from embedding_server import export as publish
from embedding_server import binary_body as wire
from embedding_server.app import create_app
from embedding_server.backends import RedisBackend
from embedding_server.cache import LiveTableCache
from embedding_server.catalog import Catalog, FeatureInfo, TableInfo
from embedding_server.settings import ServeSettings
from recsys.checkpoint import read as checkpoint_files
from recsys.features import hashing
from recsys.redisio import live
from recsys.redisio import published as layout
from recsys.testing.harness import start_redis
from recsys.train.live_writer import LiveWriter
from serving_data import UNSEEN_INT, UNSEEN_STR, LiveServer, start_cluster

pytestmark = pytest.mark.redis

LIVE_NS = "live"
DIM = 16


class FakeClock:
    """A clock the test moves by hand (the live cache's TTL never depends on wall time here)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def salts(tables) -> dict[str, str]:
    return {n: f"{hashing.table_salt(n):016x}" for n in tables}


def writer_for(url: str, dtype: str = "float32", tables=("c1", "c3"), ns: str = LIVE_NS) -> LiveWriter:
    """Return a LiveWriter of ``ns`` whose manifest (run "test-run") is written."""
    w = LiveWriter(url, ns, buckets=8)
    w.write_manifest(live.manifest("test-run", dtype, 8, {t: DIM for t in tables}, salts(tables)))
    return w


def train_ids(tiny_run, feature: str, n: int) -> list:
    """Return ``n`` distinct ids of ``feature`` from the training data (trained: in the checkpoint)."""
    data = pq.read_table(sorted((tiny_run.parent / "data" / "train").glob("*.parquet"))[0], columns=[feature])
    return list(dict.fromkeys(v for v in data.column(feature).to_pylist() if v is not None))[:n]


def keys_of(feature: str, ids: list) -> np.ndarray:
    if isinstance(ids[0], str):
        return hashing.hash_string_list(ids, feature)
    return hashing.hash_int64(np.array(ids, dtype=np.int64), feature)


def published(ckpt, table: str) -> dict[int, np.ndarray]:
    """Return key -> the checkpoint's float32 row of ``table``."""
    t = checkpoint_files.load_sparse(ckpt, [table])[table]
    keys = t.column("key").to_numpy()
    emb = t.column("embedding").combine_chunks().flatten().to_numpy().reshape(len(keys), -1)
    return {int(k): emb[i].astype(np.float32) for i, k in enumerate(keys)}


def post(url: str, body: dict, route: str = "/v1/lookup", binary: bool = False):
    """Return (version, [(vectors, found), ...]) of one lookup request, in either format."""
    r = httpx.post(url + route, json=body, headers={"accept": wire.MEDIA_TYPE} if binary else {}, timeout=30)
    assert r.status_code == 200, r.text
    if binary:
        return wire.decode(r.content)
    data = r.json()
    results = data["results"] if "results" in data else [data]
    return data["version"], [(np.asarray(x["embeddings"], dtype=np.float32).reshape(len(x["embeddings"]), -1),
                              np.asarray(x["found"], dtype=bool)) for x in results]


def metric_values(text: str) -> dict[str, float]:
    return {name: float(v) for name, v in (line.rsplit(" ", 1) for line in text.splitlines()
                                           if line and not line.startswith("#"))}


def count_round_trips(backend: RedisBackend) -> list[int]:
    """Count the backend's row reads (MGET batches: one round trip on a single Redis, one per
    node in a cluster), one entry per call with the keys it read."""
    calls, mget = [], backend._mget

    async def counted(names):
        calls.append(len(names))
        return await mget(names)

    backend._mget = counted
    return calls


def overlaying(url: str) -> bool:
    return "overlaying live namespace" in httpx.get(url + "/readyz").json()["detail"]


@pytest.fixture
def exported(tiny_run, redis_server):
    """(checkpoint, published version) of tiny_run exported to ``redis_server``."""
    ckpt = checkpoint_files.resolve(tiny_run)
    publish.export(ckpt, redis_server.url, publish.ExportSettings(version="v1"), progress=False)
    return ckpt, "v1"


# --------------------------------------------------------------------------- overlay


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_live_rows_are_served_over_the_published_version(tiny_run, redis_server, exported, dtype):
    ckpt, version = exported
    rng = np.random.default_rng(0)
    ids = train_ids(tiny_run, "c1", 6)
    keys = keys_of("c1", ids)
    ckpt_rows = published(ckpt, "c1")
    assert all(int(k) in ckpt_rows for k in keys)
    w = writer_for(redis_server.url, dtype)
    live_ids = [*ids[:3], UNSEEN_INT]  # three trained ids and one the version does not have
    pushed = rng.standard_normal((4, DIM)).astype(np.float32)
    assert w.write([("c1", keys_of("c1", live_ids), pushed)], step=7, dtype=dtype) == 4
    str_ids = [*train_ids(tiny_run, "c3", 2), f"{UNSEEN_STR}live"]
    pushed_c3 = rng.standard_normal((3, DIM)).astype(np.float32)
    w.write([("c3", keys_of("c3", str_ids), pushed_c3)], step=9, dtype=dtype)
    expect = pushed.astype(np.float16).astype(np.float32) if dtype == "float16" else pushed
    expect_c3 = pushed_c3.astype(np.float16).astype(np.float32) if dtype == "float16" else pushed_c3

    # a TTL far beyond the test: the second pass is served from the live cache whatever the machine's load
    app = create_app(ServeSettings(redis=redis_server.url, follow=LIVE_NS, live_ttl_s=3600, refresh_s=0.02))
    with LiveServer(app) as server:
        wait_until(lambda: overlaying(server.url), 30, "the overlay")
        for binary in (False, True):
            got_version, [(vec, found)] = post(server.url, {"feature": "c1", "ids": [*ids, UNSEEN_INT]},
                                               binary=binary)
            assert got_version == f"{version}+live@7"
            np.testing.assert_array_equal(vec[[0, 1, 2, 6]], expect)  # live rows, exact (float16: rounded)
            for j in (3, 4, 5):  # not in the live namespace: the published rows
                np.testing.assert_array_equal(vec[j], ckpt_rows[int(keys[j])])
            assert found.tolist() == [True] * 7  # the unseen id is found: it has a live row

            # no live row among the ids: the published version alone
            got_version, [(vec, found)] = post(server.url, {"feature": "c1", "ids": ids[3:]}, binary=binary)
            assert got_version == version
            np.testing.assert_array_equal(vec, np.stack([ckpt_rows[int(k)] for k in keys[3:]]))

            # pooled: the live rows are the ones pooled
            got_version, [(vec, _)] = post(server.url, {"feature": "c1", "ids": [ids[0], ids[3], ids[0]],
                                                        "pooling": "mean"}, binary=binary)
            rows = np.stack([expect[0], ckpt_rows[int(keys[3])], expect[0]])
            assert got_version == f"{version}+live@7"
            np.testing.assert_array_equal(vec[0], rows.sum(axis=0, dtype=np.float32) / np.float32(3))

            # a batch names the newest live step among all its lookups
            body = {"lookups": [{"feature": "c1", "ids": ids[:2]}, {"feature": "c3", "ids": str_ids}]}
            got_version, [(v1, f1), (v3, f3)] = post(server.url, body, route="/v1/lookup/batch", binary=binary)
            assert got_version == f"{version}+live@9"
            np.testing.assert_array_equal(v1, expect[:2])
            np.testing.assert_array_equal(v3, expect_c3)
            assert f1.all() and f3.all()
            body = {"lookups": [{"feature": "c1", "ids": ids[:2]}, {"feature": "c3", "ids": ["nope"]}]}
            assert post(server.url, body, route="/v1/lookup/batch", binary=binary)[0] == f"{version}+live@7"
        assert httpx.get(server.url + "/readyz").status_code == 200
        m = metric_values(httpx.get(server.url + "/metrics").text)
        assert m["recsys_serve_live_overlay"] == 1.0
        assert m["recsys_serve_live_rows_total"] >= 4 + 3
        assert m["recsys_serve_live_cache_hits_total"] > 0 and m["recsys_serve_live_cache_misses_total"] > 0
        assert m["recsys_serve_live_cache_bytes"] > 0


def test_without_follow_live_rows_are_ignored(tiny_run, redis_server, exported):
    ckpt, version = exported
    ids = train_ids(tiny_run, "c1", 2)
    writer_for(redis_server.url).write([("c1", keys_of("c1", ids), np.ones((2, DIM), np.float32))], 3, "float32")
    with LiveServer(create_app(ServeSettings(redis=redis_server.url, refresh_s=0.02))) as server:
        got_version, [(vec, _)] = post(server.url, {"feature": "c1", "ids": ids})
        assert got_version == version
        rows = published(ckpt, "c1")
        np.testing.assert_array_equal(vec, np.stack([rows[int(k)] for k in keys_of("c1", ids)]))


# --------------------------------------------------------------------------- freshness and the TTL


def test_ttl_zero_serves_a_new_push_on_the_next_request(tiny_run, redis_server, exported):
    _, version = exported
    ids = train_ids(tiny_run, "c1", 2)
    keys = keys_of("c1", ids)
    w = writer_for(redis_server.url)
    settings_ = ServeSettings(redis=redis_server.url, follow=LIVE_NS, live_ttl_s=0, refresh_s=0.02)
    with LiveServer(create_app(settings_)) as server:
        wait_until(lambda: overlaying(server.url), 30, "the overlay")
        for step in (1, 2, 5):
            rows = np.full((2, DIM), step, np.float32)
            w.write([("c1", keys, rows)], step, "float32")
            got_version, [(vec, found)] = post(server.url, {"feature": "c1", "ids": ids})
            assert got_version == f"{version}+live@{step}"
            np.testing.assert_array_equal(vec, rows)
        w.write([("c1", keys, np.zeros((2, DIM), np.float32))], 4, "float32")  # older: the guard refuses it
        got_version, [(vec, _)] = post(server.url, {"feature": "c1", "ids": ids})
        assert got_version == f"{version}+live@5" and (vec == 5).all()
        m = metric_values(httpx.get(server.url + "/metrics").text)
        assert m["recsys_serve_live_cache_hits_total"] == 0 and m["recsys_serve_live_cache_misses_total"] == 8


def test_cached_live_rows_are_served_until_the_ttl_passes(tiny_run, redis_server, exported):
    _, version = exported
    ids = train_ids(tiny_run, "c1", 3)
    keys = keys_of("c1", ids)
    w = writer_for(redis_server.url)
    clock = FakeClock()
    settings_ = ServeSettings(redis=redis_server.url, follow=LIVE_NS, live_ttl_s=5.0, refresh_s=0.02)
    backend = RedisBackend(redis_server.url, follow=LIVE_NS, live_ttl_s=5.0, refresh_s=0.02, clock=clock)
    reads = count_round_trips(backend)
    w.write([("c1", keys[:2], np.full((2, DIM), 1, np.float32))], 1, "float32")
    with LiveServer(create_app(settings_, backend)) as server:
        wait_until(lambda: overlaying(server.url), 30, "the overlay")

        def ask():
            got_version, [(vec, found)] = post(server.url, {"feature": "c1", "ids": ids})
            return got_version, vec

        got_version, vec = ask()  # read at 1000: key 0 and 1 live at step 1, key 2 absent from live
        assert got_version == f"{version}+live@1" and (vec[:2] == 1).all() and not (vec[2] == 1).all()
        assert reads == [3 + 3]  # the published rows and the live rows in one MGET batch
        w.write([("c1", keys, np.full((3, DIM), 2, np.float32))], 2, "float32")
        clock.now = 1004.99  # within the TTL: the cached rows (and the cached absence of key 2)
        got_version, vec = ask()
        assert got_version == f"{version}+live@1" and (vec[:2] == 1).all() and not (vec[2] == 2).all()
        assert reads == [6]  # everything from the caches: no read
        clock.now = 1005.0  # the TTL has passed: read again
        got_version, vec = ask()
        assert got_version == f"{version}+live@2" and (vec == 2).all()
        assert reads == [6, 3]  # the live rows only: the published ones stay cached
        m = metric_values(httpx.get(server.url + "/metrics").text)
        assert m["recsys_serve_live_cache_misses_total"] == 6 and m["recsys_serve_live_cache_hits_total"] == 3
        assert m["recsys_serve_live_rows_total"] == 2 + 2 + 3


# --------------------------------------------------------------------------- the guard under interleavings


@pytest.fixture(scope="module")
def guard_redis(tmp_path_factory):
    """One redis-server for the interleaving tests, holding a published version of one table 't'."""
    server = start_redis(tmp_path_factory.mktemp("guard-redis"))
    table = TableInfo(name="t", dim=4, rows=0, seed=0, init_bound=0.1, min_count=1, salt=hashing.table_salt("t"))
    catalog = Catalog(tables={"t": table}, features={"t": FeatureInfo(name="t", table="t", kind="int64")})
    client = redis.Redis.from_url(server.url)
    client.set(layout.manifest_key("pub", "v1"), json.dumps(catalog.to_manifest(dtype="float32", buckets=4)))
    client.set(layout.current_key("pub"), "v1")
    client.close()
    yield server
    server.stop()


_namespaces = itertools.count()
KEYS = np.array([3, -7, 11, 2**62 + 5, -(2**40), 99], dtype=np.int64)


def row_of(key_index: int, step: int) -> np.ndarray:
    """The row a writer pushes for KEYS[key_index] at ``step`` (one per (key, step): comparable)."""
    return np.array([step, key_index, step * 0.5, -key_index], dtype=np.float32)


class Observer:
    """Reads KEYS through the lookup service's backend and checks no key's step ever goes back."""

    def __init__(self, url: str, ns: str, ttl_s: float) -> None:
        self.clock = FakeClock()
        self.backend = RedisBackend(url, "pub", cache_bytes=1 << 20, follow=ns, live_ttl_s=ttl_s, clock=self.clock)
        self.last = np.full(KEYS.shape[0], -1, dtype=np.int64)
        self.reads = 0

    async def read(self, order: np.ndarray) -> np.ndarray:
        """Return the live step served per key of KEYS (-1: none), checked against the rows."""
        snap = await self.backend.snapshot()
        assert snap.live is not None, self.backend.status()
        ((vec, found),), newest = await self.backend.rows(snap, [("t", KEYS[order])])
        steps = np.full(KEYS.shape[0], -1, dtype=np.int64)
        for j, i in enumerate(order):
            if vec[j, 1] == i and vec[j, 3] == -i and found[j]:  # a live row (published rows are the init vectors)
                steps[i] = int(vec[j, 0])
                np.testing.assert_array_equal(vec[j], row_of(i, steps[i]))
        assert newest == (steps.max() if (steps >= 0).any() else None)
        assert (steps >= self.last).all(), f"a step went back: {self.last} -> {steps}"
        self.last = steps
        self.reads += 1
        return steps


def final_check(url: str, ns: str, writes) -> None:
    """Redis holds, per key, the row of the newest step written to it."""
    newest = {}
    for _, key_idx, step in writes:
        for i in key_idx:
            newest[i] = max(newest.get(i, -1), step)
    reader = LiveWriter(url, ns, buckets=8)
    found, steps, rows = reader.read("t", KEYS, 4, "float32")
    reader.close()
    for i in range(KEYS.shape[0]):
        assert steps[i] == newest.get(i, -1)
        if i in newest:
            np.testing.assert_array_equal(rows[i], row_of(i, newest[i]))
    assert found.tolist() == [i in newest for i in range(KEYS.shape[0])]


writes_strategy = st.lists(st.tuples(st.integers(0, 2),  # the writer
                                     st.lists(st.integers(0, KEYS.shape[0] - 1), min_size=1, max_size=4, unique=True),
                                     st.integers(0, 30)),  # the step
                           min_size=1, max_size=20)


def new_namespace(url: str, writers: int) -> tuple[str, list[LiveWriter]]:
    ns = f"guard{next(_namespaces)}"
    ws = [LiveWriter(url, ns, buckets=8) for _ in range(writers)]
    ws[0].write_manifest(live.manifest("guard-run", "float32", 8, {"t": 4}, salts(["t"])))
    return ns, ws


def push(w: LiveWriter, key_idx: list[int], step: int) -> None:
    idx = np.array(key_idx)
    w.write([("t", KEYS[idx], np.stack([row_of(i, step) for i in key_idx]))], step, "float32")


@given(writes=writes_strategy, reads=st.lists(st.tuples(st.booleans(), st.sampled_from([0.0, 0.4, 1.0, 3.0])),
                                              min_size=20, max_size=20),
       ttl=st.sampled_from([0.0, 1.0]), data=st.data())
@settings(max_examples=40, deadline=None)
def test_interleaved_writers_never_take_a_row_back(guard_redis, writes, reads, ttl, data):
    """Writers' pushes in any order (steps out of order, repeated, interleaved); a reader
    between any two of them, with the clock moved in between, never sees a step decrease."""
    ns, writers = new_namespace(guard_redis.url, 3)
    observer = Observer(guard_redis.url, ns, ttl)

    async def run():
        try:
            await observer.backend.refresh()
            for (writer, key_idx, step), (read_now, dt) in zip(writes, reads):
                await asyncio.to_thread(push, writers[writer], key_idx, step)
                if read_now:
                    observer.clock.now += dt
                    await observer.read(np.array(data.draw(st.permutations(range(KEYS.shape[0])))))
            observer.clock.now += ttl + 1  # past the TTL: the reader sees Redis as it ends
            return await observer.read(np.arange(KEYS.shape[0]))
        finally:
            await observer.backend.close()

    try:
        final = asyncio.run(run())
    finally:
        for w in writers:
            w.close()
    final_check(guard_redis.url, ns, writes)
    newest = {}
    for _, key_idx, step in writes:
        for i in key_idx:
            newest[i] = max(newest.get(i, -1), step)
    assert final.tolist() == [newest.get(i, -1) for i in range(KEYS.shape[0])]


@given(writes=st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, KEYS.shape[0] - 1), min_size=1, max_size=4,
                                                              unique=True), st.integers(0, 30)), min_size=1, max_size=20))
@settings(max_examples=40, deadline=None)
def test_an_attempts_ranks_and_a_zombie_writer_never_take_a_row_back(guard_redis, writes):
    """The trainer's case: writers 0 and 1 are the ranks of one attempt (one fence group, each
    writing only its own keys: even and odd indices), writer 2 a zombie of an earlier attempt
    (another group, any keys); steps in any order. Redis ends with each key's newest row, and
    a reader between the writes never sees a step decrease, whichever path each write took."""
    ns = f"guard{next(_namespaces)}"
    writers = [LiveWriter(guard_redis.url, ns, buckets=8, group="attempt", member=str(r)) for r in range(2)]
    writers.append(LiveWriter(guard_redis.url, ns, buckets=8, group="zombie"))
    writers[0].write_manifest(live.manifest("guard-run", "float32", 8, {"t": 4}, salts(["t"])))
    owned = [[i for i in key_idx if writer == 2 or i % 2 == writer] for writer, key_idx, _ in writes]
    writes = [(writer, keys, step) for (writer, _, step), keys in zip(writes, owned) if keys]
    observer = Observer(guard_redis.url, ns, ttl_s=0.0)

    async def run():
        try:
            await observer.backend.refresh()
            for writer, key_idx, step in writes:
                await asyncio.to_thread(push, writers[writer], key_idx, step)
                await observer.read(np.arange(KEYS.shape[0]))
        finally:
            await observer.backend.close()

    try:
        asyncio.run(run())
    finally:
        for w in writers:
            w.close()
    final_check(guard_redis.url, ns, writes)


def push_after_first_watch(monkeypatch, writer, slots, version) -> list:
    """Patch LiveWriter's exchange so that right after the first WATCH (a fence read) any
    writer sends, ``writer`` pushes ``slots`` at ``version``; return the list that records it."""
    exchange = LiveWriter._exchange
    hits = []

    def exchange_then_write(conn, packed):
        replies = exchange(conn, packed)
        if packed[0].startswith(b"*") and b"WATCH" in packed[0][:20] and not hits:
            hits.append(1)
            push(writer, slots, version)
        return replies

    monkeypatch.setattr(LiveWriter, "_exchange", staticmethod(exchange_then_write))
    return hits


def test_a_write_between_the_fence_check_and_exec_goes_the_guarded_way(guard_redis, monkeypatch):
    """Another writer's later rows land after a writer read the fence and before its EXEC: the
    transaction is aborted (WATCH), its rows go through the guard, and Redis keeps the later rows."""
    ns, (w, other) = new_namespace(guard_redis.url, 2)
    push(w, [0, 1], 5)  # plain: an empty fence
    assert w.counters == {"rows_plain": 2, "rows_guarded": 0, "fence_conflicts": 0}
    hits = push_after_first_watch(monkeypatch, other, [0, 2], 20)  # on the other writer's own connection
    push(w, [0, 1, 2, 3], 10)
    monkeypatch.undo()
    assert hits and w.counters == {"rows_plain": 2, "rows_guarded": 4, "fence_conflicts": 1}
    assert other.counters["rows_plain"] == 2  # the fence allowed it (20 > 5)
    for writer in (w, other):
        writer.close()
    final_check(guard_redis.url, ns, [(0, [0, 1], 5), (1, [0, 2], 20), (0, [0, 1, 2, 3], 10)])


@pytest.mark.parametrize("registered", [True, False])
def test_a_group_member_joining_aborts_no_transaction_once_registered(guard_redis, monkeypatch, registered):
    """Two ranks of one attempt (one group, disjoint keys): the second's first write lands
    between the first's fence read and its EXEC. Registered beforehand (``register``, as every
    publisher does before the trainer's barrier), it changes nothing the transaction watches
    and every row goes plain; unregistered, its entering the registry aborts the transaction."""
    ns = f"guard{next(_namespaces)}"
    w, mate = (LiveWriter(guard_redis.url, ns, buckets=8, group="attempt", member=m) for m in ("0", "1"))
    if registered:
        w.register()
        mate.register()
    hits = push_after_first_watch(monkeypatch, mate, [2, 3], 10)  # its own keys, on its own connection
    push(w, [0, 1], 10)
    monkeypatch.undo()
    assert hits and mate.counters["rows_plain"] == 2
    if registered:
        assert w.counters == {"rows_plain": 2, "rows_guarded": 0, "fence_conflicts": 0}
    else:
        assert w.counters == {"rows_plain": 0, "rows_guarded": 2, "fence_conflicts": 1}
    for writer in (w, mate):
        writer.close()
    final_check(guard_redis.url, ns, [(0, [0, 1], 10), (1, [2, 3], 10)])


def test_a_resumed_attempt_writes_guarded_until_it_passes_the_earlier_attempts_steps(guard_redis):
    """An attempt that pushed up to step 100 dies; the next resumes from step 50's checkpoint
    (a new group). Its pushes at steps 60 and 100 cannot replace the dead attempt's rows (the
    guard), a key only it has is written; from step 101 on it writes plain MSETs again."""
    ns = f"guard{next(_namespaces)}"
    dead = LiveWriter(guard_redis.url, ns, buckets=8, group="attempt0", member="0")
    push(dead, [0, 1], 90)
    push(dead, [0], 100)
    assert dead.counters["rows_plain"] == 3
    resumed = LiveWriter(guard_redis.url, ns, buckets=8, group="attempt1", member="0")
    assert resumed.write([("t", KEYS[[0, 1, 2]], np.stack([row_of(i, 60) for i in (0, 1, 2)]))], 60, "float32") == 1
    push(resumed, [0, 1], 100)
    assert resumed.counters == {"rows_plain": 0, "rows_guarded": 5, "fence_conflicts": 0}
    push(resumed, [0, 1, 2], 101)
    assert resumed.counters["rows_plain"] == 3
    for writer in (dead, resumed):
        writer.close()
    final_check(guard_redis.url, ns, [(0, [0, 1], 90), (0, [0], 100), (1, [0, 1, 2], 60), (1, [0, 1], 100),
                                      (1, [0, 1, 2], 101)])


def test_a_redis_that_lost_the_guard_script_gets_it_loaded_again(guard_redis):
    """Redis restarted meanwhile (its scripts gone: SCRIPT FLUSH): the guarded call's error
    comes back as a reply, not raised, so the writer loads the script again and its rows land."""
    ns = f"guard{next(_namespaces)}"
    ahead = LiveWriter(guard_redis.url, ns, buckets=8, group="attempt0", member="0")
    push(ahead, [0, 1], 100)
    behind = LiveWriter(guard_redis.url, ns, buckets=8, group="attempt1", member="0")
    push(behind, [0, 2], 60)  # guarded (the other group's fence is at 100): the script loaded
    client = redis.Redis.from_url(guard_redis.url)
    client.script_flush()
    client.close()
    push(behind, [1, 3], 70)
    assert behind.counters == {"rows_plain": 0, "rows_guarded": 4, "fence_conflicts": 0}
    for writer in (ahead, behind):
        writer.close()
    final_check(guard_redis.url, ns, [(0, [0, 1], 100), (1, [0, 2], 60), (1, [1, 3], 70)])


@given(per_writer=st.lists(st.lists(st.tuples(st.lists(st.integers(0, KEYS.shape[0] - 1), min_size=1, max_size=4,
                                                       unique=True), st.integers(0, 30)),
                                    min_size=1, max_size=8), min_size=2, max_size=4))
@settings(max_examples=25, deadline=None)
def test_concurrent_writers_and_readers_never_take_a_row_back(guard_redis, per_writer):
    """Writer threads push at once (each its own connection) while three concurrent readers in
    the service's event loop read through the live cache; the clock passes the TTL every few
    reads. No reader, and no sequence of responses in completion order, sees a step decrease;
    Redis ends with each key's newest row."""
    ns, writers = new_namespace(guard_redis.url, len(per_writer))
    observer = Observer(guard_redis.url, ns, ttl_s=1.0)
    start = threading.Barrier(len(per_writer))
    errors = []

    def writer_thread(w, sequence):
        try:
            start.wait(timeout=30)
            for key_idx, step in sequence:
                push(w, key_idx, step)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    async def run():
        await observer.backend.refresh()
        completed = []  # steps per response, in completion order (one event loop: a total order)
        threads = [threading.Thread(target=writer_thread, args=(w, seq)) for w, seq in zip(writers, per_writer)]
        for t in threads:
            t.start()

        async def reader(r: int):
            last = np.full(KEYS.shape[0], -1, dtype=np.int64)
            for n in itertools.count():
                done = not any(t.is_alive() for t in threads)
                observer.clock.now += 0.3  # the TTL (1 s) passes every few reads
                order = np.roll(np.arange(KEYS.shape[0]), r + n)
                snap = await observer.backend.snapshot()
                ((vec, found),), _ = await observer.backend.rows(snap, [("t", KEYS[order])])
                steps = np.full(KEYS.shape[0], -1, dtype=np.int64)
                live_rows = found & (vec[:, 1] == order) & (vec[:, 3] == -order)
                steps[order[live_rows]] = vec[live_rows, 0].astype(np.int64)
                assert (steps >= last).all(), f"reader {r}: a step went back: {last} -> {steps}"
                completed.append(steps)
                last = steps
                if done:
                    return
                await asyncio.sleep(0)

        try:
            await asyncio.gather(*(reader(r) for r in range(3)))
        finally:
            for t in threads:
                t.join()
            await observer.backend.close()
        for a, b in itertools.pairwise(completed):
            assert (b >= a).all(), f"responses in completion order went back: {a} -> {b}"

    try:
        asyncio.run(run())
    finally:
        for w in writers:
            w.close()
    assert not errors, errors
    final_check(guard_redis.url, ns, [(0, k, s) for seq in per_writer for k, s in seq])


@given(st.lists(st.tuples(st.lists(st.integers(0, 9), min_size=1, max_size=6, unique=True),
                          st.lists(st.integers(-1, 20), min_size=6, max_size=6), st.floats(0, 3)),
                min_size=1, max_size=40))
@settings(max_examples=150, deadline=None)
def test_live_cache_keeps_the_newest_step_and_expires(ops):
    """LiveTableCache against a reference: a hit is an entry read less than ttl_s before; a put
    never replaces an entry with an older step, and returns what it kept."""
    ttl, cache, now = 1.5, LiveTableCache(64, 2, 1.5), 0.0
    ref: dict[int, tuple[int, float]] = {}  # key -> (step, stamp)
    for keys_list, steps_list, dt in ops:
        now += dt
        keys = np.array(keys_list, dtype=np.int64)
        hit, rows, found, steps, stamps = cache.get(keys, now)
        for j, k in enumerate(keys_list):
            assert hit[j] == (k in ref and now - ref[k][1] < ttl)
            if hit[j]:
                assert (steps[j], stamps[j]) == ref[k] and found[j] == (ref[k][0] >= 0)
                assert rows[j].tolist() == ([float(ref[k][0]), float(k)] if ref[k][0] >= 0 else [0.0, 0.0])
        fetched = np.array(steps_list[: len(keys_list)], dtype=np.int64)
        new_steps = np.where(hit, steps, fetched)
        new_found = new_steps >= 0
        new_rows = np.where(new_found[:, None], np.stack([new_steps, keys]).T.astype(np.float32), 0)
        new_stamps = np.where(hit, stamps, now)
        kept_rows, kept_found, kept_steps, kept_stamps = cache.put(keys, new_rows, new_found, new_steps, new_stamps)
        for j, k in enumerate(keys_list):
            if k not in ref or ref[k][0] <= new_steps[j]:
                ref[k] = (int(new_steps[j]), float(new_stamps[j]))
            assert (kept_steps[j], kept_stamps[j]) == ref[k] and kept_found[j] == (ref[k][0] >= 0)


# --------------------------------------------------------------------------- compatibility


def incompatible(manifest: dict, how: str) -> dict:
    m = json.loads(json.dumps(manifest))
    if how == "unknown table":
        m["tables"]["not_published"] = {"dim": DIM}
        m["salts"]["not_published"] = f"{hashing.table_salt('not_published'):016x}"
    elif how == "other dim":
        m["tables"]["c1"]["dim"] = 8
    elif how == "other salt":
        m["salts"]["c1"] = "0" * 16
    elif how == "unknown dtype":
        m["dtype"] = "bfloat16"
    elif how == "unknown format":
        m["format"] = 99
    return m


WHY = {"unknown table": "'not_published' is not in the published version", "other dim": "dim 8",
       "other salt": "salt '0000000000000000'", "unknown dtype": "dtype 'bfloat16'", "unknown format": "format 99"}


@pytest.mark.parametrize("how", list(WHY))
def test_an_incompatible_live_manifest_serves_published_rows_and_says_why(tiny_run, redis_server, exported, how):
    ckpt, version = exported
    ids = train_ids(tiny_run, "c1", 3)
    w = writer_for(redis_server.url)
    w.write([("c1", keys_of("c1", ids), np.ones((3, DIM), np.float32))], 4, "float32")
    good = w.read_manifest()
    client = redis.Redis.from_url(redis_server.url)
    client.set(live.manifest_key(LIVE_NS), json.dumps(incompatible(good, how)))
    rows = published(ckpt, "c1")
    reference = np.stack([rows[int(k)] for k in keys_of("c1", ids)])
    with LiveServer(create_app(ServeSettings(redis=redis_server.url, follow=LIVE_NS, refresh_s=0.02))) as server:
        r = httpx.get(server.url + "/readyz")
        assert r.status_code == 200, r.text
        assert "not overlaid" in r.json()["detail"] and WHY[how] in r.json()["detail"], r.json()["detail"]
        got_version, [(vec, _)] = post(server.url, {"feature": "c1", "ids": ids})
        assert got_version == version
        np.testing.assert_array_equal(vec, reference)
        assert metric_values(httpx.get(server.url + "/metrics").text)["recsys_serve_live_overlay"] == 0.0
        client.set(live.manifest_key(LIVE_NS), json.dumps(good))  # the job's own manifest again: overlaid
        wait_until(lambda: overlaying(server.url), 30, "the overlay")
        got_version, [(vec, _)] = post(server.url, {"feature": "c1", "ids": ids})
        assert got_version == f"{version}+live@4" and (vec == 1).all()
    client.close()


def test_the_reason_is_logged_once_and_a_missing_manifest_serves_published(tiny_run, redis_server, exported, caplog):
    _, version = exported
    backend = RedisBackend(redis_server.url, follow=LIVE_NS)
    client = redis.Redis.from_url(redis_server.url)

    async def run():
        caplog.set_level(logging.INFO, logger="embedding_server.backends")
        for _ in range(3):
            await backend.refresh()
        assert backend.status()[0] and "has no manifest" in backend.status()[1]
        assert (await backend.snapshot()).live is None
        w = writer_for(redis_server.url)
        client.set(live.manifest_key(LIVE_NS), json.dumps(incompatible(w.read_manifest(), "other dim")))
        w.close()
        for _ in range(3):
            await backend.refresh()
        assert (await backend.snapshot()).live is None
        ready, why = backend.status()
        assert ready and "dim 8" in why
        await backend.close()

    asyncio.run(run())
    client.close()
    messages = [r.getMessage() for r in caplog.records if r.name == "embedding_server.backends"]
    assert sum("has no manifest" in m for m in messages) == 1, messages
    assert sum("dim 8" in m for m in messages) == 1, messages
    assert any(r.levelno == logging.WARNING and "dim 8" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- Redis Cluster


def cluster_push(url: str, table: str, keys: np.ndarray, rows: np.ndarray, step: int, buckets: int = 8) -> int:
    """Write live rows with the trainer's LiveWriter (the Lua guard, one call per bucket, each
    sent to the node of its hash slot); return how many replaced an older row."""
    w = LiveWriter(url, LIVE_NS, buckets=buckets)
    try:
        return w.write([(table, keys, rows)], step, "float32")
    finally:
        w.close()


@pytest.mark.multiproc
def test_cluster_overlays_live_rows(tiny_run, tmp_path):
    cluster = start_cluster(tmp_path / "cluster")
    try:
        ckpt = checkpoint_files.resolve(tiny_run)
        publish.export(ckpt, cluster.url, publish.ExportSettings(version="v1"), progress=False)
        ids = train_ids(tiny_run, "c1", 60)
        keys = keys_of("c1", ids)
        live_part = np.arange(0, 60, 2)  # every other id gets a live row; the buckets spread over the nodes
        pushed = np.random.default_rng(1).standard_normal((live_part.shape[0], DIM)).astype(np.float32)
        writer_for(cluster.url).close()  # the manifest
        assert cluster_push(cluster.url, "c1", keys[live_part], pushed, 12) == live_part.shape[0]
        assert cluster_push(cluster.url, "c3", keys_of("c3", [f"{UNSEEN_STR}x"]), np.ones((1, DIM), np.float32), 13) == 1
        assert cluster_push(cluster.url, "c1", keys[live_part], np.zeros_like(pushed), 11) == 0  # older: refused
        per_node = [len(list(redis.Redis(port=n.port).scan_iter(live.pattern(LIVE_NS)))) for n in cluster.nodes]
        assert sum(per_node) == live_part.shape[0] + 1 and sum(n > 0 for n in per_node) >= 2, per_node
        rows = published(ckpt, "c1")
        settings_ = ServeSettings(redis=cluster.url, follow=LIVE_NS, refresh_s=0.05, cache_bytes=0)
        backend = RedisBackend(cluster.url, follow=LIVE_NS, refresh_s=0.05, cache_bytes=0)
        reads = count_round_trips(backend)
        with LiveServer(create_app(settings_, backend)) as server:
            wait_until(lambda: overlaying(server.url), 30, "the overlay")
            body = {"lookups": [{"feature": "c1", "ids": ids}, {"feature": "c3", "ids": [f"{UNSEEN_STR}x", "y"]}]}
            for binary in (False, True):
                got_version, [(vec, found), (v3, f3)] = post(server.url, body, "/v1/lookup/batch", binary)
                assert got_version == "v1+live@13"
                np.testing.assert_array_equal(vec[live_part], pushed)
                rest = np.setdiff1d(np.arange(60), live_part)
                np.testing.assert_array_equal(vec[rest], np.stack([rows[int(k)] for k in keys[rest]]))
                assert found.all() and f3.tolist() == [True, False] and (v3[0] == 1).all()
            # no cache: each request is one MGET batch of every published and live row (redis-py
            # groups it by hash slot and pipelines it per node)
            assert reads == [(60 + 2) * 2] * 2
    finally:
        cluster.stop()


# --------------------------------------------------------------------------- flags


def test_settings_round_trip_through_the_environment():
    s = ServeSettings(redis="redis://127.0.0.1:6379/0", follow="live.ns-1", live_ttl_s=0.25)
    assert ServeSettings.from_env(s.to_env()) == s
    with pytest.raises(ValueError, match="follow needs redis"):
        ServeSettings(checkpoint="x", follow="live")
    with pytest.raises(ValueError, match="live_ttl_s"):
        ServeSettings(redis="redis://h:1/0", follow="live", live_ttl_s=-1)


@pytest.mark.parametrize("args, message", [
    (["--checkpoint", "somewhere", "--follow", "live"], "--follow needs --redis"),
    (["--redis", "redis://127.0.0.1:1/0", "--follow", "bad name"], "--follow must match"),
    (["--redis", "redis://127.0.0.1:1/0", "--follow", ""], "--follow must match"),
    (["--redis", "redis://127.0.0.1:1/0", "--follow", "live", "--namespace", "a/b"], "namespace must match"),
    (["--redis", "redis://127.0.0.1:1/0", "--follow", "live", "--live-ttl-s", "-1"], "live_ttl_s must be >= 0"),
])
def test_bad_flags_are_one_line(args, message):
    out = subprocess.run([sys.executable, "-m", "recsys.cli", "serve", *args], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("recsys serve: error:") and message in out.stderr, out.stderr
