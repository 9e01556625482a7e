"""The service's row cache: exact LRU over the store's key map, absent rows cached, budget split."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedding_server.cache import ENTRY_OVERHEAD, MIN_ROWS, CacheBudget, LiveTableCache, TableCache, salted


def row(key: int, dim: int) -> np.ndarray:
    return np.full(dim, key, dtype=np.float32)


def redis_answer(req: list[int], dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, found) Redis holds for the keys ``req``: even keys have row(k), odd ones none."""
    truth = np.array([k % 2 == 0 for k in req])
    return np.stack([row(k, dim) if t else np.zeros(dim, np.float32) for k, t in zip(req, truth)]), truth


def request_lists(min_size: int, max_size: int):
    """Requests of 1-12 distinct keys in [0, 40]."""
    return st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=12, unique=True), min_size=min_size,
                    max_size=max_size)


@given(request_lists(1, 60), st.integers(12, 20))
@settings(max_examples=150, deadline=None)
def test_cache_matches_a_reference_lru(requests, capacity):
    dim = 3
    cache = TableCache(capacity, dim)
    ref: dict[int, tuple[int, bool]] = {}  # key -> (last request, found); odd keys are absent in Redis
    for step, req in enumerate(requests, start=1):
        keys = np.array(req, dtype=np.int64)
        hit, rows, found = cache.get(keys)
        for k, h, r, f in zip(req, hit, rows, found):
            assert h == (k in ref)
            if h:
                assert f == ref[k][1] and (not f or np.array_equal(r, row(k, dim)))
        fetched, truth = redis_answer(req, dim)
        cache.put(keys, fetched, truth)
        for k, t in zip(req, truth):
            ref[k] = (step, bool(t))
        # exact LRU: the least recently requested leave first, ties broken by the smaller key
        # as the map holds it (salted)
        for k in sorted(ref, key=lambda k: (ref[k][0], int(salted(np.array([k]))[0])))[: max(0, len(ref) - capacity)]:
            del ref[k]
        assert len(cache) == len(ref)


@given(request_lists(2, 40), st.integers(12, 20))
@settings(max_examples=150, deadline=None)
def test_requests_that_await_redis_in_between_never_leave_a_wrong_row(requests, capacity):
    # two requests at a time: A reads the cache, B reads and caches (evicting some of A's
    # hits, caching some of A's misses), then A caches what it read: every row held is its key's
    dim = 3
    cache = TableCache(capacity, dim)
    for a, b in zip(requests[::2], requests[1::2]):
        ka, kb = np.array(a, dtype=np.int64), np.array(b, dtype=np.int64)
        hit_a, rows_a, found_a = cache.get(ka)
        rows_b, found_b = redis_answer(b, dim)
        cache.put(kb, rows_b, found_b)
        fresh_rows, fresh_found = redis_answer(a, dim)  # A's misses come from Redis, its hits from the cache
        rows_a[~hit_a], found_a[~hit_a] = fresh_rows[~hit_a], fresh_found[~hit_a]
        cache.put(ka, rows_a, found_a)
        held = np.arange(41, dtype=np.int64)
        hit, rows, found = cache.get(held)
        assert set(held[hit].tolist()) >= set(a)  # A's keys are the most recent
        for k, h, r, f in zip(held, hit, rows, found):
            if h:
                assert f == (k % 2 == 0) and np.array_equal(r, row(k, dim) if f else np.zeros(dim, np.float32))


@pytest.mark.parametrize("kind", ["published", "live"])
def test_the_key_maps_hold_keys_salted_per_process(kind):
    # clients choose the ids, and every hash on their way to a map is public: the map must not
    # hold them as given (see embedding_server.cache.salted)
    from embedding_server import cache as cache_module
    keys = np.array([0, 1, -1, 2**62, -(2**63)], dtype=np.int64)
    rows, found = np.ones((5, 2), np.float32), np.ones(5, dtype=bool)
    if kind == "published":
        cache = TableCache(16, 2)
        cache.put(keys, rows, found)
        assert cache.get(keys)[0].all()
    else:
        cache = LiveTableCache(16, 2, ttl_s=60)
        cache.put(keys, rows, found, np.zeros(5, np.int64), np.zeros(5))
        assert cache.get(keys, 1.0)[0].all()
    assert cache_module._SALT != 0
    assert (cache._map.find(keys) < 0).all()  # as given: not there
    assert (cache._map.find(salted(keys)) >= 0).all()


def test_budget_splits_by_published_bytes():
    budget = CacheBudget(10_000 * (64 * 4 + ENTRY_OVERHEAD), {"big": (3_000_000, 64), "small": (10, 64),
                                                            "mid": (1_000_000, 64)})
    big, small, mid = (budget.get(n).capacity for n in ("big", "small", "mid"))
    assert small == MIN_ROWS  # a small table is always cached whole, with room for absent ids
    assert big > mid > 0 and big + mid <= 10_000
    assert CacheBudget(0, {"t": (10, 4)}).get("t") is None


def test_more_keys_than_capacity_keep_the_first():
    cache = TableCache(4, 2)
    keys = np.arange(10, dtype=np.int64)
    cache.put(keys, np.ones((10, 2), np.float32), np.ones(10, bool))
    hit, _, _ = cache.get(keys)
    assert hit.tolist() == [True] * 4 + [False] * 6


@pytest.mark.parametrize("dim", [8, 64, 100])
def test_the_charge_per_row_covers_every_array_a_cache_allocates(dim):
    """``entry_bytes`` is what the budget counts; the rows, found flags and key map a cache
    allocates for its capacity must fit in it (a few bytes of rounding aside)."""
    capacity = 50_000
    for cache in (TableCache(capacity, dim), LiveTableCache(capacity, dim, ttl_s=1.0)):
        owners = (vars(cache), vars(cache._map))  # per-slot arrays: not views, at least one entry a slot
        arrays = [v for o in owners for v in o.values()
                  if isinstance(v, np.ndarray) and v.base is None and v.size >= capacity]
        assert len(arrays) >= 5  # rows, found; the map's buckets, slots, free stack (+ the live columns)
        held = sum(a.nbytes for a in arrays)
        assert held <= capacity * cache.entry_bytes(dim) + 64, (type(cache).__name__, held / capacity)
