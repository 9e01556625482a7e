"""Reader resume: exactly-once across cuts, bit-identical continuation, resizes, bad states."""

from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import torch

from recsys.io.reader import ParquetReader
from reader_data import ids_of, make_schema, write_dataset


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("resume") / "data", files=3, row_groups=3)


def reader(data, rank=0, world_size=1, **cfg):
    cfg.setdefault("shuffle_buffer", 3)
    return ParquetReader(data.config(**cfg), make_schema(), rank=rank, world_size=world_size)


def take(r, k):
    """Return the next k batches of r, then stop iterating (the reader stays usable)."""
    it = iter(r)
    out = [next(it) for _ in range(k)]
    it.close()
    return out


def roundtrip(state):
    return json.loads(json.dumps(state))


def same_batches(a, b):
    return len(a) == len(b) and all(
        torch.equal(x.dense, y.dense)
        and torch.equal(x.labels, y.labels)
        and torch.equal(x.sparse.values(), y.sparse.values())
        and torch.equal(x.sparse.lengths(), y.sparse.lengths())
        and torch.equal(x.extra["row_id"], y.extra["row_id"])
        for x, y in zip(a, b)
    )


def test_resume_at_many_cut_points_continues_identically(data):
    with reader(data) as r:
        full = list(r)
    n = len(full)
    assert n > 6
    for cut in sorted({0, 1, 2, 5, n // 2, n - 1, n}):
        with reader(data) as r:
            before = take(r, cut)
            state = roundtrip(r.state_dict())
        assert sum(state["consumed"].values()) == sum(b.size for b in before)
        with reader(data) as r2:
            r2.load_state_dict(state)
            assert r2.epoch == 0
            after = list(r2)
            if cut == n:  # the epoch was all delivered: iterating again reads the next one
                assert r2.epoch == 2 and sorted(ids_of(after)) == data.row_ids
                continue
            assert r2.epoch == 1
        assert same_batches(before + after, full), f"cut after {cut} batches"
        assert sorted(ids_of(before + after)) == data.row_ids


def test_chained_resumes_and_drop_last(data):
    with reader(data, drop_last=True, batch_size=24) as r:
        full = list(r)
        dropped = r.stats["dropped_rows"]
    got, state = [], None
    for step in (3, 1, 4, 100):
        with reader(data, drop_last=True, batch_size=24) as r:
            if state is not None:
                r.load_state_dict(state)
            it = iter(r)
            for _ in range(step):
                try:
                    got.append(next(it))
                except StopIteration:
                    break
            it.close()
            state = roundtrip(r.state_dict())
    assert same_batches(got, full)
    assert len(ids_of(got)) + dropped == len(data.rows)


@pytest.mark.multiproc
def test_resume_with_workers_same_layout_is_identical(data):
    cfg = dict(num_workers=2, prefetch=3, batch_size=8)
    with reader(data, **cfg) as r:
        full = list(r)
    n = len(full)
    for cut in (1, n // 2 + 1, n - 1):
        with reader(data, **cfg) as r:
            before = take(r, cut)  # workers have read ahead: their rows must not count
            state = roundtrip(r.state_dict())
        assert sum(state["consumed"].values()) == sum(b.size for b in before)
        with reader(data, **cfg) as r2:
            r2.load_state_dict(state)
            after = list(r2)
        assert same_batches(before + after, full), f"cut after {cut}"


@pytest.mark.multiproc
def test_prefetched_rows_are_not_lost(data):
    """Stop early with deep prefetch, resume in another layout: still every row once."""
    with reader(data, num_workers=2, prefetch=4, batch_size=4) as r:
        before = take(r, 3)
        state = roundtrip(r.state_dict())
    with reader(data, num_workers=0) as r2:
        r2.load_state_dict(state)
        after = list(r2)
    ids = ids_of(before) + ids_of(after)
    assert sorted(ids) == data.row_ids


def merged_after(data, world_size, takes, **cfg):
    """Each rank takes its batches; return (batches read, merged JSON state)."""
    got, states = [], []
    for rank, k in enumerate(takes):
        with reader(data, rank, world_size, **cfg) as r:
            got += take(r, k)
            states.append(roundtrip(r.state_dict()))
    return got, roundtrip(ParquetReader.merge_states(states))


def read_rest(data, state, world_size, **cfg):
    got = []
    for rank in range(world_size):
        with reader(data, rank, world_size, **cfg) as r:
            r.load_state_dict(state)
            got += list(r)
            assert r.epoch == 1
    return got


@pytest.mark.multiproc
def test_resume_2_ranks_with_workers_on_1_rank_without(data):
    before, state = merged_after(data, 2, [3, 1], num_workers=2)
    assert state["ranks"] == [0, 1]
    after = read_rest(data, state, 1, num_workers=0)
    assert sorted(ids_of(before + after)) == data.row_ids


@pytest.mark.multiproc
def test_resume_1_rank_on_3_ranks_with_workers(data):
    before, state = merged_after(data, 1, [5], num_workers=0)
    after = read_rest(data, state, 3, num_workers=2)
    assert sorted(ids_of(before + after)) == data.row_ids


def test_resize_twice_in_one_epoch(data):
    """2 ranks → 3 ranks → 1 rank, reading a little at each size (generations 1 and 2)."""
    before, state = merged_after(data, 2, [2, 3])
    mid, state = merged_after_loaded(data, state, 3, [1, 2, 0])
    assert state["generation"] == 1
    after = read_rest(data, state, 1)
    assert sorted(ids_of(before + mid + after)) == data.row_ids


def merged_after_loaded(data, state, world_size, takes):
    got, states = [], []
    for rank, k in enumerate(takes):
        with reader(data, rank, world_size) as r:
            r.load_state_dict(state)
            got += take(r, k)
            states.append(roundtrip(r.state_dict()))
    return got, roundtrip(ParquetReader.merge_states(states))


def test_merge_when_one_rank_already_finished_its_epoch(data):
    with reader(data, 0, 2) as r0:
        done0 = list(r0)  # rank 0 reads its whole share and moves to epoch 1
        s0 = roundtrip(r0.state_dict())
        assert s0["epoch"] == 1
    with reader(data, 1, 2) as r1:
        part1 = take(r1, 2)
        s1 = roundtrip(r1.state_dict())
    state = ParquetReader.merge_states([s0, s1])
    assert state["epoch"] == 0
    with reader(data) as r:
        r.load_state_dict(state)
        rest = list(r)
        assert r.epoch == 1
        next_epoch = list(r)
    assert sorted(ids_of(done0 + part1 + rest)) == data.row_ids
    assert sorted(ids_of(next_epoch)) == data.row_ids


def test_drifted_ranks_resume_identically(data):
    """Rank 0 went on into epoch 1 while rank 1 is still in epoch 0: both continue exactly."""
    with reader(data, 0, 2) as r0:
        full0 = list(r0) + list(r0)  # its share of epochs 0 and 1
    with reader(data, 1, 2) as r1:
        full1 = list(r1)
    with reader(data, 0, 2) as r0:
        a0 = list(r0) + take(r0, 2)
        s0 = roundtrip(r0.state_dict())
    with reader(data, 1, 2) as r1:
        a1 = take(r1, 1)
        s1 = roundtrip(r1.state_dict())
    state = roundtrip(ParquetReader.merge_states([s0, s1]))
    assert (state["epoch"], len(state["later"])) == (0, 1)
    with reader(data, 0, 2) as r0, reader(data, 1, 2) as r1:
        r0.load_state_dict(state)
        r1.load_state_dict(state)
        assert (r0.epoch, r1.epoch) == (1, 0)
        b0, b1 = list(r0), list(r1)
        # now rank 1 stands at its (unread) share of epoch 1 and rank 0 at epoch 2
        again = ParquetReader.merge_states([roundtrip(r0.state_dict()), roundtrip(r1.state_dict())])
        assert (again["epoch"], len(again["later"])) == (1, 1)
        assert again["slots"][0]["done"] and again["slots"][1] == {**again["slots"][1], "batches": 0, "done": False}
    assert same_batches(a0 + b0, full0)
    assert same_batches(a1 + b1, full1)


def test_resume_in_a_later_epoch(data):
    with reader(data) as r:
        list(r)
        e1 = take(r, 4)
        state = roundtrip(r.state_dict())
    assert state["epoch"] == 1
    with reader(data, 0, 2) as a, reader(data, 1, 2) as b:
        a.load_state_dict(state)
        b.load_state_dict(state)
        rest = list(a) + list(b)
    assert sorted(ids_of(e1 + rest)) == data.row_ids


def test_load_state_rejects_bad_states(data, tmp_path):
    with reader(data) as r:
        take(r, 2)
        good = roundtrip(r.state_dict())
    with reader(data, 0, 2) as r0:
        take(r0, 1)
        rank0 = roundtrip(r0.state_dict())
    with reader(data) as r:
        with pytest.raises(ValueError, match="version 99 is not supported"):
            r.load_state_dict({**good, "version": 99})
        with pytest.raises(ValueError, match="lacks 'consumed'"):
            r.load_state_dict({k: v for k, v in good.items() if k != "consumed"})
        with pytest.raises(ValueError, match=r"rank\(s\) \[0\] of 2 only; .*merge_states"):
            r.load_state_dict(rank0)
        with pytest.raises(ValueError, match="seed=0"):
            ParquetReader(data.config(seed=5), make_schema()).load_state_dict(good)
    # another file set: one file fewer, or one more
    other = tmp_path / "other"
    shutil.copytree(data.root, other)
    (other / "part-02.parquet").unlink()
    with ParquetReader(data.config(paths=[str(other)]), make_schema()) as r:
        with pytest.raises(ValueError, match=r"different file set \(units only in the state: \['part-02.parquet#0'"):
            r.load_state_dict(good)
    write_dataset(other / "more", files=1, seed=3)
    with ParquetReader(data.config(paths=[str(other)]), make_schema()) as r:
        with pytest.raises(ValueError, match="different file set"):
            r.load_state_dict(good)
    with pytest.raises(ValueError, match="cover ranks 0..1 once each"):
        ParquetReader.merge_states([rank0, rank0])


def test_moved_data_set_keeps_its_state(data, tmp_path):
    """Unit keys are relative: the same files under another directory resume fine."""
    with reader(data) as r:
        before = take(r, 3)
        state = roundtrip(r.state_dict())
    moved = tmp_path / "moved"
    shutil.copytree(data.root, moved)
    with ParquetReader(data.config(paths=[str(moved)], shuffle_buffer=3), make_schema()) as r:
        r.load_state_dict(state)
        after = list(r)
    assert sorted(ids_of(before + after)) == data.row_ids


def steps(r, k, seen):
    """Take k batches as a step-based trainer does (on into the next epochs), noting each
    row under the epoch it came from in ``seen``."""
    it = iter(r)
    for _ in range(k):
        try:
            batch = next(it)
        except StopIteration:
            it = iter(r)
            try:
                batch = next(it)
            except StopIteration:  # this rank has no rows in that epoch at all
                break
        seen.setdefault(r.epoch, []).extend(ids_of([batch]))
    it.close()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    phases=st.lists(
        st.tuples(st.integers(1, 3), st.lists(st.integers(0, 12), min_size=3, max_size=3)),
        min_size=1, max_size=4,
    ),
    batch_size=st.sampled_from([5, 16, 40]),
    shuffle_buffer=st.integers(1, 4),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
)
def test_any_sequence_of_resizes_reads_every_row_once(data, phases, batch_size, shuffle_buffer, shuffle, drop_last):
    """Ranks resized at random points, drifting into later epochs: per epoch, every row once
    (with drop_last: at most once, and only short tails missing)."""
    cfg = dict(batch_size=batch_size, shuffle_buffer=shuffle_buffer, shuffle=shuffle, drop_last=drop_last)
    seen: dict[int, list[int]] = {}
    state = None
    for world, takes in phases:
        states = []
        for rank in range(world):
            with reader(data, rank, world, **cfg) as r:
                if state is not None:
                    r.load_state_dict(state)
                steps(r, takes[rank], seen)
                states.append(roundtrip(r.state_dict()))
        state = roundtrip(ParquetReader.merge_states(states))
    last = max(seen, default=0)
    with reader(data, **cfg) as r:
        r.load_state_dict(state)
        while r.epoch <= last:
            for batch in r:
                seen.setdefault(r.epoch, []).extend(ids_of([batch]))
    for epoch in range(last + 1):
        ids = sorted(seen.get(epoch, []))
        if not drop_last:
            assert ids == data.row_ids, f"epoch {epoch}"
        else:
            assert len(set(ids)) == len(ids) and set(ids) <= set(data.row_ids), f"epoch {epoch}"
