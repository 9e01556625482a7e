"""The spill tier's key index against a Python set: every sequence of adds, removes and
lookups (growth, its drain, backward-shift deletion in runs of colliding keys) answers as the
set does; churn at a steady size never grows or rebuilds it; a growth's drain is spread over
the calls after it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recsys.store.spill import index as spill_index
from recsys.store.spill.index import KeyIndex

KEYS = st.integers(-(2**63), 2**63 - 1)


def _check(index: KeyIndex, model: set[int], probe: list[int]) -> None:
    assert index.size == len(model)
    assert sorted(index.keys().tolist()) == sorted(model)
    asked = np.array(probe + sorted(model), dtype=np.int64)
    np.testing.assert_array_equal(index.contains(asked), [k in model for k in asked.tolist()])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "remove"]),
                          st.lists(st.one_of(st.integers(0, 300), KEYS), max_size=60)), max_size=40))
def test_answers_as_a_set_does(ops):
    _replay(ops)


@pytest.mark.slow  # make test-slow, in CI: keeps make test under 20 minutes
@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "add", "remove"]), st.lists(st.integers(0, 400), max_size=4)),
                min_size=100, max_size=300))
def test_answers_as_a_set_does_in_the_middle_of_a_growth(ops):
    """Two old slots drained and 32 faulted in per call: a growth past 64 keys (below, every
    batch is a bulk add) spans tens of calls, so keys are added again, removed and looked up
    while the next table fills and the old one drains (in ~60 % of 200 such calls)."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in (("DRAIN_MIN", 2), ("DRAIN_PER_KEY", 0), ("FAULT_MIN_BYTES", 9 * 32),
                            ("FAULT_BYTES_PER_KEY", 0)):
            mp.setattr(spill_index, name, value)
        _replay(ops)


def _replay(ops) -> None:
    index, model = KeyIndex(), set()
    for op, keys in ops:
        arr = np.array(keys, dtype=np.int64)
        if op == "add":
            index.add(arr)
            model.update(keys)
        else:
            index.remove(arr)
            model.difference_update(keys)
        _check(index, model, keys[:5])


@pytest.mark.slow  # make test-slow, in CI: keeps make test under 20 minutes
def test_growth_is_spread_over_the_calls_around_it_and_loses_nothing(monkeypatch):
    """Past PREPARE_LOAD the next table is faulted in a share per call, then drained into a
    share per call; every answer stays the set's, and no call rebuilds the index."""
    monkeypatch.setattr(spill_index, "DRAIN_MIN", 64)
    monkeypatch.setattr(spill_index, "FAULT_MIN_BYTES", 4096)
    rebuilds = []
    rebuild = KeyIndex._rebuild
    monkeypatch.setattr(KeyIndex, "_rebuild", lambda self, need: (rebuilds.append(need), rebuild(self, need)))
    rng = np.random.default_rng(0)
    base = rng.integers(-(2**63), 2**63 - 1, 20_000, dtype=np.int64)
    index = KeyIndex(base)  # a bulk add: built at once
    assert len(rebuilds) == 1 and not index.preparing and not index.draining
    rebuilds.clear()
    model = set(base.tolist())
    slots = index.slots
    phases, step = [], 0
    while len(phases) < 3 or phases[-1] != "idle":
        step += 1
        held = np.array(sorted(model), dtype=np.int64)
        new = np.concatenate([rng.integers(-(2**63), 2**63 - 1, 100, dtype=np.int64),
                              rng.choice(held, 10)])  # some held already: maybe not yet drained
        gone = rng.choice(held, 30, replace=False)
        index.add(new)
        index.remove(gone)
        model.update(new.tolist())
        model.difference_update(gone.tolist())
        phase = "preparing" if index.preparing else "draining" if index.draining else "idle"
        if not phases or phases[-1] != phase:
            phases.append(phase)
            assert index.slots == (3 * slots if phase != "idle" else slots if len(phases) == 1 else 2 * slots)
        if step % 25 == 0 or phase != "idle":
            _check(index, model, new[:3].tolist() + gone[:3].tolist())
    assert phases == ["idle", "preparing", "draining", "idle"] and not rebuilds
    assert index.size == len(model) <= spill_index.PREPARE_LOAD * index.slots


def test_churn_at_a_steady_size_never_grows_it():
    rng = np.random.default_rng(1)
    live = rng.integers(-(2**63), 2**63 - 1, 50_000, dtype=np.int64)
    index = KeyIndex(live)
    slots = index.slots
    for _ in range(200):  # 2 M adds and removes: 40 times the live keys
        new = rng.integers(-(2**63), 2**63 - 1, 10_000, dtype=np.int64)
        index.remove(live[:10_000])
        index.add(new)
        live = np.concatenate([live[10_000:], new])
        assert index.slots == slots and not index.draining and not index.preparing
    assert index.size == 50_000
    assert index.contains(live).all() and sorted(index.keys().tolist()) == sorted(live.tolist())
    assert index.size <= spill_index.PREPARE_LOAD * slots
