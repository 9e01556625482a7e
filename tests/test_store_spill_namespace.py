"""Spill namespaces belong to one run: derived from the run directory and job, claimed in
Redis, refused to another run, emptied at start; a restore sees only its own rows.

Legend: ``D`` dim.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import redis

from recsys.features.schema import Schema, TableSpec, FeatureSpec
from recsys.store.config import SpillConfig, StoreConfig, run_namespace
from recsys.store.sharded.store import ShardedEmbeddingStore
from recsys.store.spill.tier import SpillError
from recsys.redisio.spill_layout import owner_key, spill_key
from recsys.store.tables.table import EmbeddingTable, init_vectors

pytestmark = pytest.mark.redis

D = 4
KEYS = np.arange(1, 13, dtype=np.int64)  # 12 keys through a 4-row table: 8 of them spill


def schema(capacity: int = 4) -> Schema:
    return Schema(dense=["d"], tables={"user": TableSpec(dim=D, capacity=capacity)}, sparse=[FeatureSpec(name="user")])


def cfg_for(url: str, **spill) -> StoreConfig:
    """The tests' store settings; ``spill``: keys of ``[store.spill]`` over the tests' own."""
    tier = SpillConfig(**{"url": url, "retries": 1, "backoff_s": 0.01, "timeout_s": 2.0, **spill})
    return StoreConfig(optimizer="adagrad", lr=0.1, spill=tier)


def store_for(url: str, run_dir, job: str = "job", **spill) -> ShardedEmbeddingStore:
    return ShardedEmbeddingStore(schema(), cfg_for(url, **spill), run_dir=run_dir, job_name=job)


def train(store: ShardedEmbeddingStore, steps: int = 3, start: int = 0) -> None:
    """Look up and update every key each step (most of them spill), then flush."""
    table = store.tables["user"]
    for step in range(start, start + steps):
        for start in range(0, KEYS.shape[0], 4):
            keys = KEYS[start : start + 4]
            rows = table.lookup(keys, step)
            table.apply_gradients(keys, np.ones_like(rows) + rows, step)
    store.flush()
    table.flush()


def initial(keys: np.ndarray) -> np.ndarray:
    return init_vectors(keys, D, "user", 0, StoreConfig().init_bound(D))


def spilled_names(url: str, namespace: str) -> list[bytes]:
    client = redis.Redis.from_url(url)
    try:
        return sorted(client.scan_iter(match=f"{namespace}:spill:*"))
    finally:
        client.close()


def test_run_namespace_is_stable_per_run_directory_and_distinct_between_runs(tmp_path):
    a = run_namespace(tmp_path / "a", "clicks")
    assert a == run_namespace(str(tmp_path / "a"), "clicks")  # str or Path: the same run
    assert a.startswith("recsys-clicks-") and len(a) == len("recsys-clicks-") + 12
    assert a != run_namespace(tmp_path / "b", "clicks") != run_namespace(tmp_path / "a", "views")
    assert run_namespace(tmp_path, "my job*") .startswith("recsys-my_job_-")  # no space, no glob character
    cfg = StoreConfig()
    assert cfg.spill.namespace == "" and cfg.spill.namespace_for(tmp_path / "a", "clicks") == a
    assert SpillConfig(namespace="mine").namespace_for(tmp_path / "a", "clicks") == "mine"
    for bad in ("a b", "a*", "x[1]"):
        with pytest.raises(ValueError, match="namespace must have no whitespace and no glob characters"):
            SpillConfig(namespace=bad)


def test_two_runs_with_the_same_tables_never_see_each_others_rows(redis_server, tmp_path):
    """The defect: with one default namespace for every job, run B read run A's rows as its own."""
    a = store_for(redis_server.url, tmp_path / "run-a")
    try:
        train(a)
        a_rows = a.tables["user"].peek(KEYS)
        assert a.counters()["user"]["evictions"] > 0
        assert not np.array_equal(a_rows, initial(KEYS))
        b = store_for(redis_server.url, tmp_path / "run-b")
        try:
            ns_a, ns_b = a.tables["user"].spill.namespace, b.tables["user"].spill.namespace
            assert ns_a == run_namespace(tmp_path / "run-a", "job") != ns_b
            got = b.tables["user"].lookup(KEYS[:4], 0)  # keys A trained and spilled
            np.testing.assert_array_equal(got, initial(KEYS[:4]))  # B's own, new rows
            assert b.counters()["user"]["spill_hits"] == 0
        finally:
            b.close()
        # B's start and close left A's rows alone
        np.testing.assert_array_equal(a.tables["user"].peek(KEYS), a_rows)
    finally:
        a.close()


def test_a_fresh_start_of_a_run_deletes_rows_its_earlier_attempt_left(redis_server, tmp_path):
    """A crash before the first checkpoint leaves spilled rows; the next start must not use them."""
    first = store_for(redis_server.url, tmp_path / "run")
    train(first)
    ns = first.tables["user"].spill.namespace
    first.tables["user"].flush()
    left = spilled_names(redis_server.url, ns)
    assert left, "nothing was spilled"
    for t in first.tables.values():  # a crash: no close, the rows stay in Redis
        t.spill.abandon()
    again = store_for(redis_server.url, tmp_path / "run")  # same run directory: same namespace, ours
    try:
        assert again.tables["user"].spill.namespace == ns
        assert spilled_names(redis_server.url, ns) == []
        np.testing.assert_array_equal(again.tables["user"].lookup(KEYS[:4], 0), initial(KEYS[:4]))
    finally:
        again.close()


def test_a_restore_sees_exactly_its_checkpoints_rows(redis_server, tmp_path):
    """Rows spilled after the checkpoint (or by another run) never come back in a restore."""
    run = tmp_path / "run"
    store = store_for(redis_server.url, run)
    train(store, steps=2)
    saved = store.state_dict()  # the checkpoint: held and spilled rows
    train(store, steps=1, start=2)  # more training after the checkpoint spills newer rows
    newer = store.state_dict()
    for t in store.tables.values():
        t.spill.abandon()  # the process dies
    other = store_for(redis_server.url, tmp_path / "other")  # another run trains the same keys meanwhile
    train(other, steps=4)
    restored = store_for(redis_server.url, run)
    try:
        restored.load_state_dict(saved)
        assert restored.state_dict()["user"].equals(saved["user"])
        assert not restored.state_dict()["user"].equals(newer["user"])
        assert restored.state_dict()["user"].equals(saved["user"])  # reading twice changes nothing
    finally:
        restored.close()
        other.close()


def check_spilled_after_restore(url: str, ns: str, saved_rows, table, delete_restored: bool) -> None:
    """Redis holds every checkpoint row the table does not hold and no key the checkpoint
    lacks; the rows back in memory keep their copies unless ``spill.delete_restored``."""
    table.flush()
    held = set(table._map.items()[0].tolist())
    saved_keys = saved_rows.column("key").to_pylist()
    want = {spill_key(ns, "user", k).encode() for k in saved_keys if k not in held}
    names = set(spilled_names(url, ns))
    if delete_restored:
        assert names == want
    else:
        assert want <= names <= {spill_key(ns, "user", k).encode() for k in saved_keys}


@pytest.mark.parametrize("delete_restored", [False, True])
def test_a_restore_in_the_running_process_leaves_redis_exactly_its_spilled_rows(redis_server, tmp_path,
                                                                                delete_restored):
    """Restored into the store that kept training: spilled rows of keys the checkpoint lacks
    are deleted, the checkpoint's rows replace the others, and Redis ends holding exactly the
    checkpoint's rows the table does not hold (and, unless ``spill.delete_restored``, the
    kept copies of rows it does)."""
    store = store_for(redis_server.url, tmp_path / "run", delete_restored=delete_restored)
    try:
        train(store, steps=2)
        saved = store.state_dict()
        table = store.tables["user"]
        later = np.arange(100, 108, dtype=np.int64)  # keys first seen after the checkpoint
        for step, keys in enumerate([later[:4], KEYS[:4], later[4:], KEYS[4:8]], start=2):
            rows = table.lookup(keys, step)
            table.apply_gradients(keys, np.full_like(rows, 0.5), step)
        table.flush()
        ns = table.spill.namespace
        assert any(name.endswith(b"%016x" % 100) for name in spilled_names(redis_server.url, ns))
        store.load_state_dict(saved)
        assert store.state_dict()["user"].equals(saved["user"])
        check_spilled_after_restore(redis_server.url, ns, saved["user"], table, delete_restored)
    finally:
        store.close()


def trained_tables(names, url: str, run, steps: int, **spill) -> tuple[Schema, ShardedEmbeddingStore]:
    """A store of 4-row tables ``names`` in ``run``, every table trained on ``KEYS`` (most spill)."""
    schema_ = Schema(dense=["d"], tables={n: TableSpec(dim=D, capacity=4) for n in names},
                     sparse=[FeatureSpec(name=n) for n in names])
    store = ShardedEmbeddingStore(schema_, cfg_for(url, **spill), run_dir=run, job_name="job")
    for step in range(steps):
        for n in names:
            for start in range(0, KEYS.shape[0], 4):
                keys = KEYS[start : start + 4]
                rows = store.tables[n].lookup(keys, step)
                store.tables[n].apply_gradients(keys, np.ones_like(rows) + rows, step)
    store.flush()
    return schema_, store


@pytest.mark.parametrize("delete_restored", [False, True])
def test_a_store_built_to_restore_rewrites_its_earlier_rows_instead_of_deleting_them_first(redis_server, tmp_path,
                                                                                           delete_restored):
    """``restoring=True`` (a resume): the start only finds the earlier attempt's rows, refuses
    to read them, and the load deletes those its checkpoint lacks (in a table it does not
    hold, all) and rewrites the others: no UNLINK of a row it writes again."""
    run = tmp_path / "run"
    opt = {"delete_restored": delete_restored}
    two, store = trained_tables(("user", "item"), redis_server.url, run, steps=3, **opt)
    saved = {"user": store.state_dict()["user"]}  # a checkpoint without "item"
    later = np.arange(100, 106, dtype=np.int64)  # spilled after it: in Redis, not in the checkpoint
    for step, keys in enumerate([later[:3], later[3:], KEYS[:4]], start=3):
        rows = store.tables["user"].lookup(keys, step)
        store.tables["user"].apply_gradients(keys, np.full_like(rows, 0.5), step)
    for t in store.tables.values():
        t.spill.flush()
        t.spill.abandon()  # the process dies
    ns = store.tables["user"].spill.namespace
    left = spilled_names(redis_server.url, ns)
    assert any(b":item:" in name for name in left) and any(name.endswith(b"%016x" % 100) for name in left)
    client = redis.Redis.from_url(redis_server.url)
    try:
        unlinks = int(client.info("commandstats").get("cmdstat_unlink", {}).get("calls", 0))
        restored = ShardedEmbeddingStore(two, cfg_for(redis_server.url, **opt), run_dir=run, job_name="job",
                                         restoring=True)
        try:
            assert sorted(spilled_names(redis_server.url, ns)) == sorted(left)  # nothing deleted at start
            assert int(client.info("commandstats").get("cmdstat_unlink", {}).get("calls", 0)) == unlinks
            with pytest.raises(RuntimeError, match="load the checkpoint"):
                restored.tables["user"].lookup(KEYS[:4], 0)  # leftovers are never read as rows
            restored.load_state_dict(saved)
            assert restored.state_dict()["user"].equals(saved["user"])
            assert restored.state_dict()["item"].num_rows == 0
            for t in restored.tables.values():
                t.flush()
            check_spilled_after_restore(redis_server.url, ns, saved["user"], restored.tables["user"],
                                        delete_restored)
        finally:
            restored.close()
    finally:
        client.close()


def test_a_restore_of_several_spilled_tables_scans_the_namespace_once(redis_server, tmp_path):
    """Each table's own SCAN walked every table's keys (minutes at 27 M spilled rows): a
    start clears all its tables' spilled rows with one SCAN, stale rows included, and the
    restore after it needs none (the start left every table's index known)."""
    names = ("user", "item", "shop")
    run = tmp_path / "run"
    many, store = trained_tables(names, redis_server.url, run, steps=2)
    saved = store.state_dict()
    ns = store.tables["user"].spill.namespace
    for t in store.tables.values():
        t.spill.flush()
        t.spill.abandon()
    client = redis.Redis.from_url(redis_server.url)
    try:
        stale = spill_key(ns, "item", 999)  # a row no checkpoint holds (a later, crashed attempt)
        client.set(stale, client.get(spill_key(ns, "item", int(KEYS[0]))) or b"x")
        scans = int(client.info("commandstats").get("cmdstat_scan", {}).get("calls", 0))
        restored = ShardedEmbeddingStore(many, cfg_for(redis_server.url), run_dir=run, job_name="job")
        try:
            restored.load_state_dict(saved)
            after = int(client.info("commandstats").get("cmdstat_scan", {}).get("calls", 0))
            assert after - scans == 1  # one pass over a namespace this small (SCAN COUNT >= its keys)
            assert client.exists(stale) == 0
            state = restored.state_dict()
            for n in names:
                assert state[n].equals(saved[n])
        finally:
            restored.close()
    finally:
        client.close()


def test_a_namespace_owned_by_another_run_is_refused_unless_taken_over(redis_server, tmp_path):
    shared = dict(namespace="team")
    a = store_for(redis_server.url, tmp_path / "run-a", job="a", **shared)
    train(a)
    client = redis.Redis.from_url(redis_server.url)
    try:
        owner = json.loads(client.get(owner_key("team")))
        assert owner == {"run_dir": str((tmp_path / "run-a").resolve()), "job": "a"}
        with pytest.raises(SpillError) as err:
            store_for(redis_server.url, tmp_path / "run-b", job="b", **shared)
        msg = str(err.value)
        assert "\n" not in msg
        for part in ("'team'", redis_server.url, str(tmp_path / "run-a"), "job 'a'", str(tmp_path / "run-b"),
                     "store.spill.takeover"):
            assert part in msg, part
        assert spilled_names(redis_server.url, "team"), "the refused run deleted the owner's rows"
        # the owner itself may restart: same run directory and job
        a.close()
        a = store_for(redis_server.url, tmp_path / "run-a", job="a", **shared)
        train(a)
        a.close()
        # a foreign key in the namespace (not a table of this job) survives a takeover
        client.set("team:spill:other:0000000000000001", b"x")
        b = store_for(redis_server.url, tmp_path / "run-b", job="b", takeover=True, **shared)
        try:
            assert json.loads(client.get(owner_key("team")))["job"] == "b"
            assert spilled_names(redis_server.url, "team") == [b"team:spill:other:0000000000000001"]
            np.testing.assert_array_equal(b.tables["user"].lookup(KEYS[:4], 0), initial(KEYS[:4]))
        finally:
            b.close()
    finally:
        client.close()


def test_a_store_without_a_run_spills_to_a_temporary_namespace_deleted_at_close(redis_server):
    store = ShardedEmbeddingStore(schema(), cfg_for(redis_server.url))
    train(store)
    ns = store.tables["user"].spill.namespace
    assert ns.startswith("recsys-tmp-") and spilled_names(redis_server.url, ns)
    store.close()
    assert spilled_names(redis_server.url, ns) == []
    # a bare table too: its rows are its own and go with it
    t = EmbeddingTable("user", TableSpec(dim=D, capacity=2), cfg_for(redis_server.url))
    t.lookup(KEYS[:2], 0)
    t.lookup(KEYS[2:4], 1)
    t.flush()
    assert len(spilled_names(redis_server.url, t.spill.namespace)) == 2
    t.close()
    assert spilled_names(redis_server.url, t.spill.namespace) == []
    assert spill_key(t.spill.namespace, "user", 1).startswith("recsys-tmp-")
