"""KeyMap (64-bit key → slot, exact LRU) and FrequencySketch, against plain-Python references.

Legend: ``N`` keys in a call.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recsys.store.tables import keymap
from recsys.store.tables.keymap import FrequencySketch, KeyMap

MASK = (1 << 64) - 1
I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
# every corner of the int64 range is a valid key; 0 and -1 especially
UNIVERSE = [0, -1, 1, 2, 3, 7, I64_MAX, I64_MIN, I64_MIN + 1, 0x5555555555555555, -0x2AAAAAAAAAAAAAAB, 1 << 40]


class RefMap:
    """The documented policy, spelled out with a dict: key -> last-access step."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.last: dict[int, int] = {}
        self.clock: int | None = None

    def _place(self, keys: list[int], steps: list[int]):
        distinct = list(dict.fromkeys(keys))
        if len(distinct) > self.capacity:
            raise ValueError("overflow")
        new = [k for k in distinct if k not in self.last]
        need = len(new) - (self.capacity - len(self.last))
        evicted = []
        if need > 0:
            protected = set(distinct)
            order = sorted((s, k & MASK, k) for k, s in self.last.items() if k not in protected)
            evicted = [(k, s) for s, _, k in order[:need]]
            for k, _ in evicted:
                del self.last[k]
        for k, s in zip(keys, steps):
            self.last[k] = s
        return new, evicted

    def lookup(self, keys, step):
        if self.clock is not None and step < self.clock:
            raise ValueError("step went back")
        out = self._place(keys, [step] * len(keys))
        self.clock = step
        return out

    def assign(self, keys, steps):
        return self._place(keys, steps)

    def remove(self, keys):
        return [self.last.pop(k, None) is not None for k in keys]


def check_same(km: KeyMap, ref: RefMap) -> None:
    keys, slots, steps = km.items()
    assert dict(zip(keys.tolist(), steps.tolist())) == ref.last
    assert len(km) == len(ref.last) == len(set(slots.tolist()))
    found = km.find(np.array(UNIVERSE, dtype=np.int64))
    for k, s in zip(UNIVERSE, found.tolist()):
        assert (s >= 0) == (k in ref.last)
        if s >= 0:
            assert km.slot_key[s] == k


ops = st.lists(
    st.one_of(
        st.tuples(st.just("lookup"), st.lists(st.sampled_from(UNIVERSE), max_size=8), st.integers(0, 2)),
        st.tuples(st.just("assign"), st.lists(st.sampled_from(UNIVERSE), max_size=5, unique=True), st.integers(-3, 6)),
        st.tuples(st.just("remove"), st.lists(st.sampled_from(UNIVERSE), max_size=4), st.just(0)),
        st.tuples(st.just("back"), st.lists(st.sampled_from(UNIVERSE), max_size=3), st.integers(1, 3)),
    ),
    max_size=40,
)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(capacity=st.integers(1, 7), pool_fraction=st.sampled_from([0.01, 0.3, 1.0]), ops=ops, seed=st.integers(0, 9))
def test_keymap_matches_reference(capacity, pool_fraction, ops, seed):
    km, ref = KeyMap(capacity, pool_fraction=pool_fraction), RefMap(capacity)
    rng = np.random.default_rng(seed)
    step = 0
    for op, keys, arg in ops:
        arr = np.array(keys, dtype=np.int64)
        if op in ("lookup", "back"):
            step = step + arg if op == "lookup" else step - arg
            try:
                want_new, want_evicted = ref.lookup(keys, step)
            except ValueError:
                with pytest.raises(ValueError):
                    km.lookup(arr, step)
                step = ref.clock if ref.clock is not None else step
                check_same(km, ref)
                continue
            upd = km.lookup(arr, step)
            assert upd.new_keys_M.tolist() == want_new
            assert sorted(zip(upd.evicted_keys_K.tolist(), upd.evicted_steps_K.tolist())) == sorted(want_evicted)
            assert upd.hits == sum(1 for k in keys if k not in want_new)
            assert (km.slot_key[upd.slots_N] == arr).all()
            assert sorted(upd.new_slots_M.tolist()) == sorted(set(upd.slots_N[np.isin(arr, want_new)].tolist()))
        elif op == "assign":
            steps = (arg + rng.integers(-2, 3, size=len(keys))).tolist()
            try:
                want_new, want_evicted = ref.assign(keys, steps)
            except ValueError:
                with pytest.raises(ValueError):
                    km.assign(arr, np.array(steps, dtype=np.int64))
                check_same(km, ref)
                continue
            upd = km.assign(arr, np.array(steps, dtype=np.int64))
            assert upd.new_keys_M.tolist() == want_new
            assert sorted(zip(upd.evicted_keys_K.tolist(), upd.evicted_steps_K.tolist())) == sorted(want_evicted)
        else:
            want = ref.remove(keys)
            got = km.remove(arr)
            assert (got >= 0).tolist() == want
        check_same(km, ref)


def test_long_zipf_run_matches_reference():
    """Many batches through a small map: pool refills, wrap-around probes, deletions."""
    rng = np.random.default_rng(0)
    capacity = 60
    km, ref = KeyMap(capacity, pool_fraction=0.1), RefMap(capacity)
    universe = rng.integers(I64_MIN, I64_MAX, size=400, dtype=np.int64)
    for step in range(300):
        n = int(rng.integers(1, 40))
        ranks = np.minimum(rng.zipf(1.3, size=n), 400) - 1
        keys = universe[ranks]
        want_new, want_evicted = ref.lookup(keys.tolist(), step // 2)
        upd = km.lookup(keys, step // 2)
        assert upd.new_keys_M.tolist() == want_new
        assert sorted(upd.evicted_keys_K.tolist()) == sorted(k for k, _ in want_evicted)
        if step % 37 == 0:  # rows leave and come back with old steps
            gone = keys[:3]
            ref.remove(gone.tolist())
            km.remove(gone)
            back = np.unique(gone)
            ref.assign(back.tolist(), [0] * len(back))
            km.assign(back, np.zeros(len(back), dtype=np.int64))
    check_same(km, ref)


def test_keys_crowding_one_bucket_with_one_tag_match_reference():
    """Buckets keep a slot code and a few hash bits, not the key: keys whose home is one of
    two buckets and whose tag bits agree each need the slot's key to be told apart, and
    every deletion shifts a long run. Lookups, evictions, removes and assigns through such a
    cluster (a call's pending keys shifted by its own evictions included) keep the policy."""
    import recsys.store.tables.keymap as keymap

    capacity = 24
    nb_u = np.uint64(int(keymap.BUCKETS_PER_SLOT * capacity) + 1)
    rng = np.random.default_rng(5)
    cand = rng.integers(I64_MIN, I64_MAX, size=400_000, dtype=np.int64)
    crowd = [int(k) for k in cand
             if keymap._home(k, nb_u) in (3, 4) and keymap._tag_of(keymap._hash(k)) == 0][:60]
    assert len(crowd) == 60
    km, ref = KeyMap(capacity, pool_fraction=0.2), RefMap(capacity)
    for step in range(200):
        keys = [crowd[i] for i in rng.integers(0, 60, size=int(rng.integers(1, 12)))]
        want_new, want_evicted = ref.lookup(keys, step)
        upd = km.lookup(np.array(keys, dtype=np.int64), step)
        assert upd.new_keys_M.tolist() == want_new
        assert sorted(upd.evicted_keys_K.tolist()) == sorted(k for k, _ in want_evicted)
        if step % 7 == 0:
            gone = [crowd[i] for i in rng.integers(0, 60, size=3)]
            assert (km.remove(np.array(gone, dtype=np.int64)) >= 0).tolist() == ref.remove(gone)
            back = list(dict.fromkeys(gone))
            want_new, want_evicted = ref.assign(back, [step - 1] * len(back))
            upd = km.assign(np.array(back, dtype=np.int64), np.full(len(back), step - 1, dtype=np.int64))
            assert sorted(upd.evicted_keys_K.tolist()) == sorted(k for k, _ in want_evicted)
        check_same_keys(km, ref, crowd)


def check_same_keys(km: KeyMap, ref: RefMap, universe: list[int]) -> None:
    keys, slots, steps = km.items()
    assert dict(zip(keys.tolist(), steps.tolist())) == ref.last
    found = km.find(np.array(universe, dtype=np.int64))
    assert [s >= 0 for s in found.tolist()] == [k in ref.last for k in universe]
    assert (km.slot_key[found[found >= 0]] == np.array(universe)[found >= 0]).all()


def test_call_ids_that_wrap_keep_the_policy():
    """The per-slot call ids are int32: a map whose call counter wraps mid-run (forced here
    instead of 2**31 calls) still protects each call's keys and evicts what the reference does."""
    rng = np.random.default_rng(1)
    capacity = 12
    km, ref = KeyMap(capacity, pool_fraction=0.25), RefMap(capacity)
    km._call_id = keymap._CALL_ID_MAX - 5
    universe = rng.integers(I64_MIN, I64_MAX, size=40, dtype=np.int64)
    wrapped = False
    for step in range(30):
        keys = universe[rng.integers(0, 40, size=int(rng.integers(1, capacity + 1)))]
        want_new, want_evicted = ref.lookup(keys.tolist(), step)
        upd = km.lookup(keys, step)
        wrapped |= km._call_id < 10
        assert upd.new_keys_M.tolist() == want_new
        assert sorted(upd.evicted_keys_K.tolist()) == sorted(k for k, _ in want_evicted)
        check_same(km, ref)
    assert wrapped


def test_corner_keys_are_ordinary_keys():
    km = KeyMap(8)
    keys = np.array([0, -1, I64_MIN, I64_MAX, 1], dtype=np.int64)
    upd = km.lookup(keys, 0)
    assert upd.hits == 0 and len(km) == 5
    assert km.find(keys).tolist() == upd.slots_N.tolist()
    assert km.find(np.array([2, -2], dtype=np.int64)).tolist() == [-1, -1]
    # uint64 input is the same bit pattern
    as_u64 = keys.view(np.uint64)
    assert km.find(as_u64).tolist() == upd.slots_N.tolist()
    assert km.remove(np.array([0], dtype=np.int64)).tolist() == [upd.slots_N[0]]
    assert km.find(keys).tolist() == [-1, *upd.slots_N[1:].tolist()]


def test_eviction_order_is_step_then_unsigned_key():
    km = KeyMap(4)
    km.lookup(np.array([5, -1, 3], dtype=np.int64), 10)  # -1 is the largest uint64
    km.lookup(np.array([9], dtype=np.int64), 11)
    km.lookup(np.array([3], dtype=np.int64), 12)  # 3 is now the newest
    upd = km.lookup(np.array([100, 101, 102], dtype=np.int64), 13)
    assert sorted(zip(upd.evicted_keys_K.tolist(), upd.evicted_steps_K.tolist())) == [(-1, 10), (5, 10), (9, 11)]
    upd = km.lookup(np.array([200], dtype=np.int64), 14)  # 5 < -1 as uint64: -1 is newer
    km2 = KeyMap(4)
    km2.lookup(np.array([5, -1, 3, 9], dtype=np.int64), 10)
    assert km2.lookup(np.array([100], dtype=np.int64), 11).evicted_keys_K.tolist() == [3]
    assert km2.lookup(np.array([101], dtype=np.int64), 11).evicted_keys_K.tolist() == [5]
    assert km2.lookup(np.array([102], dtype=np.int64), 11).evicted_keys_K.tolist() == [9]
    assert km2.lookup(np.array([103], dtype=np.int64), 11).evicted_keys_K.tolist() == [-1]
    assert sorted(upd.new_slots_M.tolist()) == sorted(upd.evicted_slots_K.tolist())


def test_keys_of_the_current_call_are_never_evicted():
    km = KeyMap(3)
    km.lookup(np.array([1, 2, 3], dtype=np.int64), 0)
    upd = km.lookup(np.array([1, 4], dtype=np.int64), 0)  # same step: only 2, 3 may go; 2 < 3
    assert upd.evicted_keys_K.tolist() == [2]
    upd = km.lookup(np.array([3, 1, 5], dtype=np.int64), 0)  # 4 is the only candidate
    assert upd.evicted_keys_K.tolist() == [4]


def test_overflow_raises_and_leaves_map_unchanged():
    km = KeyMap(3)
    km.lookup(np.array([1, 2], dtype=np.int64), 0)
    before = [a.copy() for a in km.items()]
    with pytest.raises(ValueError, match="4 distinct keys but the map holds at most 3"):
        km.lookup(np.array([1, 7, 8, 9, 7], dtype=np.int64), 1)
    with pytest.raises(ValueError, match="distinct keys"):
        km.assign(np.array([5, 6, 7, 8], dtype=np.int64), np.zeros(4, dtype=np.int64))
    after = km.items()
    for a, b in zip(before, after):
        assert a.tolist() == b.tolist()
    assert km.find(np.array([7, 8, 9], dtype=np.int64)).tolist() == [-1, -1, -1]
    # repeated keys count once: three distinct keys fit
    upd = km.lookup(np.array([7, 7, 8, 9, 9, 9], dtype=np.int64), 1)
    assert upd.new_keys_M.tolist() == [7, 8, 9]
    assert upd.slots_N[0] == upd.slots_N[1] and upd.slots_N[3] == upd.slots_N[5]


def test_steps_must_not_decrease():
    km = KeyMap(2)
    assert km.clock is None
    km.lookup(np.array([1], dtype=np.int64), 5)
    with pytest.raises(ValueError, match="step 4 is before the previous lookup's step 5"):
        km.lookup(np.array([1], dtype=np.int64), 4)
    assert km.clock == 5


def test_bad_inputs():
    with pytest.raises(ValueError, match="capacity"):
        KeyMap(0)
    km = KeyMap(2)
    with pytest.raises(ValueError, match="1-D"):
        km.find(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(TypeError, match="int64"):
        km.find(np.array([1.5]))
    with pytest.raises(ValueError, match="one step per key"):
        km.assign(np.array([1, 2]), np.array([0]))


def test_large_random_inserts_and_deletes_match_a_set():
    rng = np.random.default_rng(1)
    km = KeyMap(50_000)
    keys = np.unique(rng.integers(I64_MIN, I64_MAX, size=40_000, dtype=np.int64))
    rng.shuffle(keys)
    upd = km.lookup(keys, 0)
    assert upd.new_keys_M.shape[0] == keys.shape[0]
    gone = keys[::3]
    assert (km.remove(gone) >= 0).all()
    kept = np.setdiff1d(keys, gone)
    assert (km.find(kept) >= 0).all()
    assert (km.find(gone) == -1).all()
    assert (km.slot_key[km.find(kept)] == kept).all()
    assert len(km) == kept.shape[0]


# --------------------------------------------------------------------------- sketch


def test_sketch_counts_without_undercounting_and_ages():
    sk = FrequencySketch(width=1024, cap=5)
    keys = np.arange(200, dtype=np.int64) * 7919 - 1000
    for i in range(1, 4):
        assert (sk.estimate_next(keys) == i).all()  # nothing recorded by estimate_next
        assert (sk.add(keys) == i).all()  # 200 keys in 4×1024 cells: no full collision
    assert (sk.add(keys[:1]) == 4).all() and (sk.add(keys[:1]) == 5).all()
    assert (sk.add(keys[:1]) == 5).all()  # saturates at cap
    # aging: after 10·width sightings every count is halved
    filler = np.arange(10**6, 10**6 + sk.reset_every - sk.recorded, dtype=np.int64)
    sk.add(filler)
    assert sk.recorded == 0
    assert sk.estimate_next(keys[:1])[0] <= 5 // 2 + 1
    state = sk.state()
    other = FrequencySketch(width=1024, cap=5)
    other.load_state(state)
    assert (other.estimate_next(keys) == sk.estimate_next(keys)).all()
    with pytest.raises(ValueError, match="shape"):
        FrequencySketch(width=64, cap=5).load_state(state)


def test_find_with_hints_equals_find_whatever_the_hints():
    km = KeyMap(64)
    rng = np.random.default_rng(3)
    first = rng.integers(-50, 50, 40)
    hints = km.lookup(first, 0).slots_N  # right hints, then the map moves on
    for step in range(1, 6):
        km.lookup(rng.integers(-50, 50, 40), step)  # evicts and reuses slots
    km.remove(first[:5])
    keys = np.concatenate([first, [999, -999]])  # two keys never seen
    for h in (np.concatenate([hints, [-1, 3]]),  # stale hints, one pointing at another key
              rng.integers(-1, 64, keys.shape[0]),  # random slots
              km.find(keys)):  # exact hints
        np.testing.assert_array_equal(km.find(keys, h), km.find(keys))
    with pytest.raises(ValueError, match="hints of shape"):
        km.find(keys, hints)


def test_hints_are_trusted_only_while_no_key_left_its_slot():
    """``find(keys, hints, departures)`` returns the hints unread only while ``departures``
    is unchanged and every key had a slot; over random lookups, assigns and removes (small
    capacity: many evictions) it always equals a plain ``find``."""
    rng = np.random.default_rng(11)
    km = KeyMap(48, pool_fraction=0.25)
    trusted = checked = 0
    step = 0
    held: list[tuple[np.ndarray, np.ndarray, int]] = []  # (keys, slots, departures) of earlier lookups
    for _ in range(400):
        op = rng.integers(0, 10)
        keys = np.unique(rng.integers(-60, 60, rng.integers(1, 20)))
        if op < 6:
            step += int(rng.integers(0, 2))
            slots = km.lookup(keys, step).slots_N
            held.append((keys, slots, km.departures))
            held = held[-5:]
        elif op < 8:
            km.assign(keys, np.full(keys.shape[0], max(step - int(rng.integers(0, 3)), 0), dtype=np.int64))
        else:
            km.remove(keys[: rng.integers(0, keys.shape[0] + 1)])
        for k, hints, dep in held:
            got = km.find(k, hints, dep)
            np.testing.assert_array_equal(got, km.find(k))
            if got is hints:
                trusted += 1
            else:
                checked += 1
    assert trusted > 50 and checked > 50  # both paths ran
    # a hint of -1 (no slot then) is always checked: the key may have one now
    km2 = KeyMap(8)
    km2.lookup(np.array([5]), 0)
    np.testing.assert_array_equal(km2.find(np.array([5]), np.array([-1]), km2.departures), [km2.find(np.array([5]))[0]])


def test_a_call_reads_only_the_pool_entries_it_takes_or_passes_over():
    """Evicting k keys reads k entries of the eviction pool (plus any stale ones it passes
    over), not the whole pool: the service's row cache evicts ~30 keys a request from a pool
    of ~90 k entries. Each call evicts exactly the oldest keys, as the reference says."""
    cap = 10_000
    km = KeyMap(cap, pool_fraction=0.25)
    km.lookup(np.arange(cap, dtype=np.int64), 1)  # full; every key at step 1
    km.lookup(np.arange(cap, cap + 5, dtype=np.int64), 2)  # the scan: a pool of 2,500 (step 1)
    assert km._pool_slots.shape[0] == cap // 4 and km._pool_pos == 5
    km.lookup(np.arange(5, 15, dtype=np.int64), 3)  # touches ten pool entries: stale now
    assert km._pool_pos == 5
    update = km.lookup(np.arange(cap + 5, cap + 8, dtype=np.int64), 4)
    assert km._pool_pos == 18  # passed over the ten touched, took three
    np.testing.assert_array_equal(np.sort(update.evicted_keys_K), [15, 16, 17])  # (step 1, key) order


def test_distinct_and_has_repeats_agree_with_numpy():
    """``distinct`` is ``np.unique`` (sorted distinct values) and ``has_repeats`` tells
    whether any value repeats, on sorted, unsorted, empty, one-element and uint64 input."""
    from recsys.store.tables.keymap import distinct, has_repeats

    rng = np.random.default_rng(3)
    cases = [np.empty(0, np.int64), np.array([7], np.int64), np.arange(10, dtype=np.int64),
             np.array([3, 3], np.int64), np.array([5, -1, 5, 2], np.int64),
             rng.integers(-(2**63), 2**63 - 1, 1000), rng.integers(0, 50, 200),
             np.sort(rng.integers(0, 50, 200)), rng.integers(0, 2**64 - 1, 100, dtype=np.uint64)]
    for values in cases:
        np.testing.assert_array_equal(distinct(values), np.unique(values))
        assert distinct(values).dtype == values.dtype
        assert has_repeats(values) == (np.unique(values).shape[0] != values.shape[0])


@pytest.mark.parametrize("capacity", [1, 1000, 1024, 1025, 65_537])
def test_memory_per_slot_does_not_depend_on_the_capacity(capacity):
    """26 bytes a slot at any capacity (buckets of a 4-byte code, 2.5 a slot; key and meta
    word 16), plus a free stack that filling the map never writes (so never backs with
    memory), and a full map at 40 % of its buckets still finds every key."""
    km = KeyMap(capacity)
    assert km._buckets.nbytes + km._rec.nbytes <= 26 * capacity + 4
    keys = np.random.default_rng(capacity).integers(I64_MIN, I64_MAX, size=capacity, dtype=np.int64)
    km.lookup(keys, 0)
    assert len(km) == capacity and (km.slot_key[km.find(keys)] == keys).all()
    assert not km._free.any()  # untouched: the slots came from the fresh end
    km.remove(keys[:3])
    assert len(km) == capacity - min(3, capacity) and km._n_free == min(3, capacity)


def test_steps_outside_32_bits_are_refused_and_change_nothing():
    """The map stores a step in 32 bits of a slot's meta word: a step outside them raises
    a clear error before the map changes; the extremes inside them round-trip."""
    km = KeyMap(8)
    keys = np.array([1, 2, 3], dtype=np.int64)
    km.assign(keys, np.array([keymap.STEP_MIN, -1, keymap.STEP_MAX], dtype=np.int64))
    np.testing.assert_array_equal(km.items()[2][np.argsort(km.items()[0])], [keymap.STEP_MIN, -1, keymap.STEP_MAX])
    with pytest.raises(ValueError, match=r"lookup: step 2147483648 is outside"):
        km.lookup(np.array([4], dtype=np.int64), keymap.STEP_MAX + 1)
    with pytest.raises(ValueError, match=r"assign: step -2147483649 is outside"):
        km.assign(np.array([5], dtype=np.int64), np.array([keymap.STEP_MIN - 1]))
    assert len(km) == 3 and (km.find(np.array([4, 5], dtype=np.int64)) == -1).all()
    upd = km.lookup(np.array([4], dtype=np.int64), keymap.STEP_MAX)
    assert upd.new_keys_M.tolist() == [4] and km.steps_of(upd.slots_N).tolist() == [keymap.STEP_MAX]
