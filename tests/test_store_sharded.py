"""The sharded store: lookup/pool/push, 2 ranks == 1 rank, resharding, the staleness schedule."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dist_utils import run_distributed
from recsys.features.schema import FeatureSpec, Schema, TableSpec
from recsys.store.config import HostConfig, StoreConfig
from recsys.store.sharded.store import ShardedEmbeddingStore

DIM = 4


def make_schema(capacity: int = 10_000) -> Schema:
    return Schema(
        dense=["d"],
        tables={"user": TableSpec(dim=DIM, capacity=capacity), "item": TableSpec(dim=DIM, capacity=capacity)},
        sparse=[
            FeatureSpec(name="user"),
            FeatureSpec(name="item"),
            FeatureSpec(name="history", table="item", multi_hot=True, pooling="mean"),
        ],
    )


def make_kjt(rng: np.random.Generator, B: int, vocab: int = 60) -> KeyedJaggedTensor:
    """Return a KJT of B rows: user, item single-hot; history 0..4 items (mean pooled)."""
    lengths = np.concatenate([np.ones(B), np.ones(B), rng.integers(0, 5, B)]).astype(np.int32)
    values = rng.zipf(1.3, size=int(lengths.sum())) % vocab
    return KeyedJaggedTensor(
        keys=["user", "item", "history"], values=torch.from_numpy(values.astype(np.int64)),
        lengths=torch.from_numpy(lengths),
    )


def split_kjt(kjt: KeyedJaggedTensor, parts: int) -> list[KeyedJaggedTensor]:
    """Return the KJT's rows cut into ``parts`` equal consecutive slices (rank r gets slice r)."""
    B = kjt.stride()
    per = B // parts
    out = []
    jts = kjt.to_dict()
    for r in range(parts):
        vals, lens = [], []
        for key in kjt.keys():
            jt = jts[key]
            l = jt.lengths()[r * per : (r + 1) * per]
            o = jt.offsets()
            vals.append(jt.values()[o[r * per] : o[(r + 1) * per]])
            lens.append(l)
        out.append(KeyedJaggedTensor(keys=kjt.keys(), values=torch.cat(vals), lengths=torch.cat(lens)))
    return out


def train_steps(store: ShardedEmbeddingStore, kjts, world: int, steps_per_push_check=None) -> list[float]:
    """Run steps of loss = sum(pooled * V) / B_global; return the losses of this rank's part."""
    V = torch.linspace(-1, 1, 3 * DIM).view(1, 3, DIM)
    losses = []
    for step, kjt in enumerate(kjts):
        lookup = store.lookup(kjt, step)
        pooled = lookup.pooled(3)
        loss = (pooled * V).sum() / (kjt.stride() * world)
        loss.backward()
        store.push(lookup)
        losses.append(loss.item())
    store.flush()
    return losses


def all_rows(state: dict[str, pa.Table]) -> dict[str, dict[int, np.ndarray]]:
    out = {}
    for name, t in state.items():
        keys = t.column("key").to_numpy()
        emb = np.stack(t.column("embedding").to_numpy(zero_copy_only=False)) if len(keys) else np.empty((0, DIM))
        out[name] = {int(k): e for k, e in zip(keys, emb)}
    return out


def global_batches(steps: int = 6, B: int = 16):
    rng = np.random.default_rng(7)
    return [make_kjt(rng, B) for _ in range(steps)]


def _sharded_body(rank: int, world: int, staleness: int):
    batches = [split_kjt(k, world)[rank] for k in global_batches()]
    store = ShardedEmbeddingStore(make_schema(), StoreConfig(lr=0.1, staleness=staleness), threaded=True)
    losses = train_steps(store, batches, world)
    state = store.state_dict()
    store.close()
    return losses, state


def test_single_process_push_matches_manual_rowwise_adagrad():
    schema = make_schema()
    store = ShardedEmbeddingStore(schema, StoreConfig(lr=0.5))
    kjt = KeyedJaggedTensor(keys=["user", "item", "history"], values=torch.tensor([1, 2, 3, 2, 2, 5]),
                            lengths=torch.tensor([1, 1, 1, 1, 0, 2], dtype=torch.int32))
    lookup = store.lookup(kjt, 0)
    before = {n: r.detach().clone() for n, r in lookup.rows.items()}
    pooled = lookup.pooled(3)
    # history row 0 is empty -> zeros; row 1 is the mean of items 2 and 5
    assert torch.allclose(pooled[0, 2], torch.zeros(DIM))
    item = dict(zip(lookup.parts[1].keys_U.tolist(), before["item"]))
    assert torch.allclose(pooled[1, 2], (item[2] + item[5]) / 2)
    pooled.sum().backward()
    store.push(lookup)
    store.flush()
    # item 2: once as 'item' (row 0) and as half of a history mean (row 1): grad 1.5 per element
    g = 1.5
    expected = item[2] - 0.5 * g / (np.sqrt(g * g) + 1e-8)
    after = store.peek_rows("item", np.array([2]))
    assert torch.allclose(torch.from_numpy(after[0]), expected, atol=1e-6)


def test_two_ranks_equal_one_rank_at_staleness_zero():
    single = ShardedEmbeddingStore(make_schema(), StoreConfig(lr=0.1))
    losses_1 = train_steps(single, global_batches(), 1)
    rows_1 = all_rows(single.state_dict())
    results = run_distributed(_sharded_body, 2, 0)
    losses_2 = [a + b for a, b in zip(results[0][0], results[1][0])]
    np.testing.assert_allclose(losses_2, losses_1, rtol=1e-5)
    merged = {name: {} for name in rows_1}
    for _, state in results:
        for name, rows in all_rows(state).items():
            assert not set(rows) & set(merged[name]), "a key is owned by two ranks"
            merged[name].update(rows)
    for name in rows_1:
        assert merged[name].keys() == rows_1[name].keys()
        for k, v in rows_1[name].items():
            np.testing.assert_allclose(merged[name][k], v, rtol=1e-5, atol=1e-6)


def _reshard_body(rank: int, world: int, state):
    store = ShardedEmbeddingStore(make_schema(), StoreConfig(lr=0.1))
    store.load_state_dict(state)
    mine = store.state_dict()
    kjt = split_kjt(global_batches(1, 12)[0], world)[rank]
    pooled = store.lookup(kjt, None, train=False).pooled(3)
    return mine, pooled


@pytest.mark.slow  # make test-slow, in CI: keeps make test under 20 minutes
def test_state_saved_at_two_ranks_loads_at_one_and_three():
    saved = run_distributed(_sharded_body, 2, 0)
    full = {name: pa.concat_tables([s[name] for _, s in saved]) for name in saved[0][1]}
    one = ShardedEmbeddingStore(make_schema(), StoreConfig(lr=0.1))
    one.load_state_dict(full)
    rows_one = all_rows(one.state_dict())
    assert {n: len(r) for n, r in rows_one.items()} == {n: t.num_rows for n, t in full.items()}
    pooled_one = one.lookup(global_batches(1, 12)[0], None, train=False).pooled(3)
    three = run_distributed(_reshard_body, 3, full)
    for name in full:
        parts = [all_rows(state)[name] for state, _ in three]
        assert sum(len(p) for p in parts) == full[name].num_rows
        union = {k: v for p in parts for k, v in p.items()}
        assert union.keys() == rows_one[name].keys()
        for k, v in union.items():
            np.testing.assert_array_equal(v, rows_one[name][k])
    torch.testing.assert_close(torch.cat([p for _, p in three]), pooled_one)


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_each_push_becomes_visible_exactly_staleness_steps_later(staleness):
    store = ShardedEmbeddingStore(make_schema(), StoreConfig(lr=0.1, staleness=staleness), threaded=True)
    batches = global_batches(8)
    # submit the next lookup before pushing the current step, as the trainer does
    future = store.submit_lookup(batches[0], 0)
    for step in range(len(batches)):
        lookup = future.result()
        if step + 1 < len(batches):
            future = store.submit_lookup(batches[step + 1], step + 1)
        lookup.pooled(3).sum().backward()
        store.push(lookup)
    store.flush()
    store.close()
    seen = dict(store.visibility)
    for push_step in range(len(batches) - staleness - 1):
        assert seen[push_step] == push_step + staleness + 1
    for push_step in range(len(batches) - staleness - 1, len(batches)):
        assert seen[push_step] == -1  # applied by the final flush, seen by no lookup


def test_staleness_runs_are_deterministic():
    def run():
        store = ShardedEmbeddingStore(make_schema(), StoreConfig(lr=0.1, staleness=2), threaded=True)
        losses = train_steps_pipelined(store, global_batches(8))
        rows = all_rows(store.state_dict())
        store.close()
        return losses, rows

    (l1, r1), (l2, r2) = run(), run()
    assert l1 == l2
    for name in r1:
        assert r1[name].keys() == r2[name].keys()
        for k in r1[name]:
            np.testing.assert_array_equal(r1[name][k], r2[name][k])


def train_steps_pipelined(store, batches):
    losses = []
    future = store.submit_lookup(batches[0], 0)
    for step in range(len(batches)):
        lookup = future.result()
        if step + 1 < len(batches):
            future = store.submit_lookup(batches[step + 1], step + 1)
        loss = lookup.pooled(len(store.schema.sparse)).pow(2).sum()
        loss.backward()
        store.push(lookup)
        losses.append(loss.item())
    store.flush()
    return losses


def test_schedule_errors_are_clear():
    store = ShardedEmbeddingStore(make_schema(), StoreConfig(staleness=0))
    batches = global_batches(2)
    lookup = store.lookup(batches[0], 0)
    with pytest.raises(RuntimeError, match=r"must see the pushes of steps \[0\]"):
        store.lookup(batches[1], 1)
    with pytest.raises(ValueError, match="already looked up"):
        store.submit_lookup(batches[0], 0)
    with pytest.raises(RuntimeError, match=r"looked up but not pushed"):
        store.flush()
    store.cancel(lookup)
    with pytest.raises(ValueError, match="no pending training lookup"):
        store.push(lookup)
    store.flush()


def test_empty_batch_pools_to_zero_rows_of_every_feature():
    # what a rank whose data ran out feeds while the others finish the epoch
    store = ShardedEmbeddingStore(make_schema(), StoreConfig())
    kjt = KeyedJaggedTensor(keys=["user", "item", "history"], values=torch.empty(0, dtype=torch.int64),
                            lengths=torch.empty(0, dtype=torch.int32), stride=0)
    lookup = store.lookup(kjt, 0)
    pooled = lookup.pooled(3)
    assert pooled.shape == (0, 3, DIM)
    pooled.sum().backward()
    store.push(lookup)
    store.flush()


def _pipelined_rows(store, batches, staleness: int):
    """Train like the trainer (next lookup submitted before this step's push; a store
    without a thread at staleness 0 cannot take that, so it looks up after each push);
    return the losses and every row after a flush."""
    if staleness == 0 and not store.schedule.threaded:
        losses = []
        for step, kjt in enumerate(batches):
            lookup = store.lookup(kjt, step)
            loss = lookup.pooled(3).pow(2).sum()
            loss.backward()
            store.push(lookup)
            losses.append(loss.item())
        store.flush()
    else:
        losses = train_steps_pipelined(store, batches)
    rows = all_rows(store.state_dict())
    store.close()
    return losses, rows


@pytest.mark.parametrize("staleness", [0, 1])
def test_early_key_work_under_eviction_equals_the_serial_schedule(staleness):
    # capacity 36 for a 60-id vocabulary: every lookup evicts, often rows whose push is
    # still pending. The threaded store does a lookup's key work (insert, evict) before
    # those pushes are applied; the result must equal the serial order, where each push
    # lands first.
    batches = global_batches(10)
    cfg = StoreConfig(lr=0.1, staleness=staleness)
    serial = ShardedEmbeddingStore(make_schema(capacity=36), cfg, threaded=False)
    threaded = ShardedEmbeddingStore(make_schema(capacity=36), cfg, threaded=True)
    l_serial, r_serial = _pipelined_rows(serial, batches, staleness)
    evictions = sum(c["evictions"] for c in serial.counters().values())
    l_threaded, r_threaded = _pipelined_rows(threaded, batches, staleness)
    assert evictions > 50
    assert l_threaded == l_serial
    for name in r_serial:
        assert r_threaded[name].keys() == r_serial[name].keys()
        for k in r_serial[name]:
            np.testing.assert_array_equal(r_threaded[name][k], r_serial[name][k])


def test_rows_gradient_and_pooled_gradient_are_pushed_together():
    # a loss on the rows themselves (an L2 term on the batch's rows) plus one on pooled
    store = ShardedEmbeddingStore(make_schema(), StoreConfig(optimizer="sgd", lr=1.0))
    kjt = global_batches(1)[0]
    lookup = store.lookup(kjt, 0)
    before = {name: rows.detach().clone() for name, rows in lookup.rows.items()}
    pooled = lookup.pooled(3)
    (pooled.sum() + sum((r**2).sum() for r in lookup.rows.values())).backward()
    store.push(lookup)
    store.flush()
    # d sum(pooled) / d row: 1 per single-hot occurrence, 1/len per history occurrence
    user = kjt["user"].values().numpy()
    item = kjt["item"].values().numpy()
    hist = kjt["history"]
    counts = {"user": {}, "item": {}}
    for k in user:
        counts["user"][int(k)] = counts["user"].get(int(k), 0.0) + 1.0
    for k in item:
        counts["item"][int(k)] = counts["item"].get(int(k), 0.0) + 1.0
    lengths, values = hist.lengths().numpy(), hist.values().numpy()
    at = 0
    for n in lengths:
        for k in values[at : at + n]:
            counts["item"][int(k)] = counts["item"].get(int(k), 0.0) + 1.0 / n
        at += n
    for part in lookup.parts:
        got = store.peek_rows(part.name, part.keys_U)
        for i, key in enumerate(part.keys_U):
            row = before[part.name][i]
            want = row - (2 * row + counts[part.name][int(key)])
            np.testing.assert_allclose(got[i], want.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("threaded", [False, True])
def test_any_thread_count_gives_the_same_numbers(threaded):
    """``store.host.threads``: tables split over threads (keys, rows, pooling backward, optimizer)
    give bit-identical pooled outputs and rows,
    with evictions (capacity below the ids seen) and a mean-pooled bag sharing a table."""
    from store_data import random_kjts, three_feature_schema, train_pooled

    dim, B = 8, 600
    schema = three_feature_schema(dim, capacity=1600)
    kjts = random_kjts(6, vocab=4000, seed=3, B=B)
    runs = {}
    for threads in (1, 2, 3):
        store = ShardedEmbeddingStore(schema, StoreConfig(lr=0.1, host=HostConfig(threads=threads)), threaded=threaded)
        assert store._lanes.n == threads
        pooled = train_pooled(store, kjts, dim)
        runs[threads] = (pooled, {t: v.sort_by("key") for t, v in store.state_dict().items()})
        store.close()
    for threads in (2, 3):
        for a, b in zip(runs[1][0], runs[threads][0]):
            assert torch.equal(a, b)
        for t in runs[1][1]:
            assert runs[1][1][t].equals(runs[threads][1][t]), t
    assert runs[1][1]["item"].num_rows == 1600  # full: evictions happened


@pytest.mark.parametrize("staleness", [0, 2])
def test_the_table_group_gives_each_tables_own_numbers_and_counters(staleness):
    """One kernel call per phase for all tables (``TableGroup``) against each table's own
    calls: bit-identical pooled outputs, rows and counters, with one table that never
    evicts (its calls fused) and one that evicts once full (its calls left to the table,
    and at staleness 2 pushes whose slots moved since their lookup)."""
    from store_data import random_kjts, train_pooled

    dim, B = 8, 600
    schema = Schema(dense=["d"],
                    tables={"user": TableSpec(dim=dim, capacity=100_000), "item": TableSpec(dim=dim, capacity=1600)},
                    sparse=[FeatureSpec(name="user"), FeatureSpec(name="item"),
                            FeatureSpec(name="history", table="item", multi_hot=True, pooling="mean")])
    kjts = random_kjts(8, vocab=4000, seed=5, B=B)
    runs, calls = {}, []
    for grouped in (True, False):
        store = ShardedEmbeddingStore(schema, StoreConfig(lr=0.1, staleness=staleness))
        assert store._group is not None
        if grouped:
            reserve, apply = store._group.reserve, store._group.apply

            def spy_reserve(idx, *args):
                rest = reserve(idx, *args)
                calls.append(("reserve", list(idx), rest))
                return rest

            def spy_apply(idx, *args):
                rest = apply(idx, *args)
                calls.append(("apply", list(idx), rest))
                return rest

            store._group.reserve, store._group.apply = spy_reserve, spy_apply
        else:
            store._group = None
        pooled = train_pooled(store, kjts, dim)
        runs[grouped] = (pooled, {t: v.sort_by("key") for t, v in store.state_dict().items()}, store.counters())
        store.close()
    for a, b in zip(runs[True][0], runs[False][0]):
        assert torch.equal(a, b)
    for t in runs[False][1]:
        assert runs[True][1][t].equals(runs[False][1][t]), t
    assert runs[True][2] == runs[False][2]
    assert runs[False][2]["item"]["evictions"] > 0
    reserved = [c for c in calls if c[0] == "reserve"]
    assert len(reserved) == len(kjts) and all(c[1] == [0, 1] for c in reserved)
    assert all(0 not in c[2] for c in reserved)  # user: always one call with the others
    assert [] in [c[2] for c in reserved] and [1] in [c[2] for c in reserved]  # item: fused, then left once full
    if staleness:  # some push found the item table's slots moved by a later lookup's evictions
        assert any(c[2] == [1] for c in calls if c[0] == "apply")


@pytest.mark.parametrize("threaded", [False, True])
def test_a_failing_table_raises_as_in_table_order_with_threads(threaded):
    """Two tables fail in one call: the first in schema order is the error raised, whichever
    thread ran which table (threaded: tables handed out to the worker and the waiting caller)."""
    schema = Schema(tables={n: TableSpec(dim=4, capacity=4) for n in ("a", "b", "c")},
                    sparse=[FeatureSpec(name=n) for n in ("a", "b", "c")])
    # 8 rows: table a holds 1 distinct id, b 6 (> capacity 4), c 5 (> capacity 4)
    values = np.concatenate([np.zeros(8), [0, 1, 2, 3, 4, 5, 0, 1], [0, 1, 2, 3, 4, 0, 1, 2]]).astype(np.int64)
    kjt = KeyedJaggedTensor(keys=["a", "b", "c"], values=torch.from_numpy(values),
                            lengths=torch.ones(24, dtype=torch.int32))
    messages = {}
    for threads in (1, 2, 3):
        store = ShardedEmbeddingStore(schema, StoreConfig(host=HostConfig(threads=threads)), threaded=threaded)
        assert (store._board is not None) == threaded
        with pytest.raises(ValueError) as err:
            store.lookup(kjt, 0)
        messages[threads] = str(err.value)
        store.close()
    assert "table 'b': the batch of step 0 has 6 distinct ids" in messages[1], messages[1]
    assert messages[2] == messages[1] and messages[3] == messages[1]


def test_lanes_split_every_item_once_and_balance():
    from recsys.store.sharded.lanes import Lanes

    lanes = Lanes(3)
    try:
        costs = [5.0, 1.0, 1.0, 4.0, 3.0, 9.0, 0.0]
        groups = lanes.split(costs)
        assert sorted(i for g in groups for i in g) == list(range(len(costs)))
        assert all(g == sorted(g) for g in groups)
        loads = sorted(sum(costs[i] for i in g) for g in groups)
        assert loads[-1] - loads[0] <= max(costs)
    finally:
        lanes.close()


def test_a_waiting_caller_takes_tables_of_the_workers_call():
    """The board hands items to the worker and to a thread waiting on a future, one at a
    time, each exactly once; the lowest failing item's error is the one raised."""
    import threading
    from concurrent.futures import Future

    from recsys.store.sharded.lanes import Board, HelpedFuture, Lanes

    board = Board()
    lanes = Lanes(1, board)
    done: HelpedFuture = HelpedFuture(board)
    helper_started = threading.Event()
    ran: dict[int, str] = {}
    lock = threading.Lock()

    def fn(i: int) -> None:
        name = threading.current_thread().name
        if name == "waiter":
            helper_started.set()
        elif i == 0:
            assert helper_started.wait(10), "the waiting thread never took an item"
        with lock:
            assert i not in ran
            ran[i] = name

    def worker() -> None:
        try:
            lanes.each(list(range(8)), [1.0] * 8, fn)
            done.set_result("ok")
        except BaseException as exc:  # noqa: BLE001
            done.set_exception(exc)

    got = []
    waiter = threading.Thread(target=lambda: got.append(done.result()), name="waiter")
    waiter.start()
    threading.Thread(target=worker, name="worker").start()
    waiter.join(30)
    assert got == ["ok"]
    assert sorted(ran) == list(range(8))
    assert {"worker", "waiter"} <= set(ran.values())

    def failing(i: int) -> None:
        if i in (5, 2):
            raise ValueError(f"item {i}")

    # largest first hands out 5, then 7, 6, 4, 3, 2, 1, 0: once 5 failed, 7 and 6 (later in
    # schema order) are skipped; the earlier items still run, and item 2's error is raised,
    # as a loop in schema order would raise it
    ran.clear()

    def record(i: int) -> None:
        ran[i] = threading.current_thread().name
        failing(i)

    costs = [float(i) for i in range(8)]
    costs[5] = 100.0
    with pytest.raises(ValueError, match="item 2"):
        lanes.each(list(range(8)), costs, record)
    assert sorted(ran) == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="item 2"):
        lanes.each(list(range(8)), [float(8 - i) for i in range(8)], failing)
    plain = Future()
    plain.set_result(1)
    assert plain.result() == 1


def test_waiter_help_changes_no_number():
    """Threaded stores with and without the waiting caller's help, pipelined steps with
    evictions: the same losses and rows, bit for bit."""
    from store_data import random_kjts, three_feature_schema

    schema = three_feature_schema(8, capacity=1600)
    kjts = random_kjts(8, vocab=4000, seed=5, B=600)
    runs = []
    for helps in (False, True):
        store = ShardedEmbeddingStore(schema, StoreConfig(lr=0.1, host=HostConfig(waiter_helps=helps)), threaded=True)
        assert (store._board is not None) == helps
        losses = train_steps_pipelined(store, kjts)
        runs.append((losses, {t: v.sort_by("key") for t, v in store.state_dict().items()}))
        store.close()
    assert runs[0][0] == runs[1][0]
    for t in runs[0][1]:
        assert runs[0][1][t].equals(runs[1][1][t]), t



def test_write_state_hands_over_state_dicts_tables_one_at_a_time():
    """A checkpoint's writer gets every table's rows, equal to ``state_dict``'s, each one
    released before the next is built (one table's copy alive besides the store)."""
    import gc
    import weakref

    store = ShardedEmbeddingStore(make_schema(), StoreConfig(lr=0.5))
    rng = np.random.default_rng(0)
    for step in range(3):
        lookup = store.lookup(make_kjt(rng, 8), step)
        lookup.pooled(3).sum().backward()
        store.push(lookup)
    store.flush()
    want = store.state_dict()
    got, alive = {}, []

    def each(name: str, rows: pa.Table) -> None:
        gc.collect()
        alive.append(sum(r() is not None for r in refs))  # tables handed over before this one
        refs.append(weakref.ref(rows))
        got[name] = rows.to_pydict()

    refs: list = []
    store.write_state(each)
    assert list(got) == list(want) and len(got) == 2
    assert all(got[n] == want[n].to_pydict() for n in want)
    assert alive == [0, 0]
    store.close()


def test_a_step_outside_32_bits_is_refused_by_the_table_group_too():
    """The key map stores a step in 32 bits: the table group's fused reservation leaves a
    step outside them to the tables' own path, which refuses it with a clear error and
    changes nothing; the largest step inside them goes through the group."""
    from recsys.store.tables.fused import TableGroup
    from recsys.store.tables.keymap import STEP_MAX
    from recsys.store.tables.table import EmbeddingTable

    cfg = StoreConfig(lr=0.1)
    tables = [EmbeddingTable(n, TableSpec(dim=4, capacity=100), cfg) for n in ("a", "b")]
    group = TableGroup.of(tables)
    assert group is not None
    keys = np.array([5, 6, 7], dtype=np.int64)
    base = np.array([0, 2, 3], dtype=np.int64)
    slots = np.full(3, -1, dtype=np.int64)
    assert group.reserve([0, 1], keys, base, STEP_MAX + 1, slots) == [0, 1]
    with pytest.raises(ValueError, match="outside"):
        tables[0].reserve(keys[:2], STEP_MAX + 1)
    assert [len(t._map) for t in tables] == [0, 0]
    assert group.reserve([0, 1], keys, base, STEP_MAX, slots) == []
    assert [len(t._map) for t in tables] == [2, 1] and (slots >= 0).all()
    assert tables[1]._map.steps_of(slots[2:]).tolist() == [STEP_MAX]
