"""The admission sketch (``store.min_count > 1``) travels with the checkpoint: a resume at the
same world size equals the uninterrupted run; at another world size the merged sketch never
undercounts a key.

Legend: ``W`` world size, ``D`` dim.
"""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pytest
import torch

from dist_utils import run_distributed
from recsys.features import hashing
from recsys.store.config import StoreConfig
from recsys.store.tables.keymap import FrequencySketch, merge_sketch_states
from recsys.store.sharded.store import ShardedEmbeddingStore
from store_data import random_kjts, three_feature_schema

D = 4


def cfg(**kw) -> StoreConfig:
    return StoreConfig(**{"optimizer": "adagrad", "lr": 0.1, "min_count": 3, **kw})


def through_torch_save(payload: dict) -> dict:
    """The checkpoint's way: torch.save, then torch.load(weights_only=True)."""
    buf = io.BytesIO()
    torch.save(payload, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def step_store(store: ShardedEmbeddingStore, kjt, step: int) -> None:
    lookup = store.lookup(kjt, step)
    (lookup.pooled(3) ** 2).sum().backward()
    store.push(lookup)


def states_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].equals(b[name]), name


@pytest.mark.parametrize("staleness", [0, 1])
def test_store_resume_with_a_look_ahead_equals_the_uninterrupted_store(staleness):
    """Saved while the next step's lookup is under way (its key work done, as in the trainer),
    restored into a new store: the rest of the run equals the uninterrupted one exactly."""
    kjts = random_kjts(24, vocab=60, seed=3)
    schema = three_feature_schema(D, 40)  # small: evictions and re-admissions happen
    cut = 11
    full = ShardedEmbeddingStore(schema, cfg(staleness=staleness), threaded=True)
    for step, kjt in enumerate(kjts):
        if step == cut and staleness > 0:
            # the trainer's checkpoint at s > 0: the look-ahead is withdrawn and redone after
            # the save, seeing every push, as the first lookup of a resumed run does
            ahead = full.submit_lookup(kjt, step)
            full.flush(through_step=step - 1)
            full.cancel(ahead.result())
        step_store(full, kjt, step)
    full.flush()
    want = full.state_dict()
    assert sum(c["rejected"] for c in full.counters().values()) > 50  # admission really rejects
    full.close()

    first = ShardedEmbeddingStore(schema, cfg(staleness=staleness), threaded=True)
    for step in range(cut):
        step_store(first, kjts[step], step)
    ahead = first.submit_lookup(kjts[cut], cut)  # the trainer's look-ahead of the next step
    first.flush(through_step=cut - 1)
    rows = first.state_dict()
    admission = through_torch_save(first.admission_state_dict())["admission"]
    first.cancel(ahead.result())
    first.close()

    resumed = ShardedEmbeddingStore(schema, cfg(staleness=staleness), threaded=True)
    resumed.load_state_dict(rows, admission=admission)
    for step in range(cut, len(kjts)):
        step_store(resumed, kjts[step], step)
    resumed.flush()
    states_equal(resumed.state_dict(), want)
    resumed.close()

    # without the sketch (what a checkpoint held before): the resumed run admits differently
    forgetful = ShardedEmbeddingStore(schema, cfg(staleness=staleness), threaded=True)
    forgetful.load_state_dict(rows)
    for step in range(cut, len(kjts)):
        step_store(forgetful, kjts[step], step)
    forgetful.flush()
    assert any(not forgetful.state_dict()[n].equals(want[n]) for n in want)
    forgetful.close()


def test_a_withdrawn_and_redone_lookup_counts_its_sightings_once():
    kjts = random_kjts(6, vocab=40, seed=5)
    once = ShardedEmbeddingStore(three_feature_schema(D, 1000), cfg(min_count=2))
    twice = ShardedEmbeddingStore(three_feature_schema(D, 1000), cfg(min_count=2))
    for step, kjt in enumerate(kjts):
        if step == 3:
            twice.cancel(twice.lookup(kjt, step))  # withdrawn (a checkpoint at s > 0), then redone
        step_store(once, kjt, step)
        step_store(twice, kjt, step)
    states_equal(twice.state_dict(), once.state_dict())
    a, b = once.admission_state_dict()["admission"], twice.admission_state_dict()["admission"]
    for name in a["tables"]:
        assert torch.equal(a["tables"][name]["cells"], b["tables"][name]["cells"])


# --------------------------------------------------------------------------- other world sizes


def test_merged_sketch_never_undercounts_at_any_width():
    rng = np.random.default_rng(0)
    keys = rng.integers(-(1 << 62), 1 << 62, 3000)
    counts = rng.integers(1, 6, 3000)
    owner = hashing.owner_of(keys, 3)
    cap = 5
    shards = []
    for r in range(3):
        sk = FrequencySketch(2048, cap=cap)
        for k, c in zip(keys[owner == r], counts[owner == r]):
            for _ in range(c):
                sk.add(np.array([k]))
        shards.append({**sk.state(), "step": 7 if r else 6, "step_keys": keys[owner == r][:5]})
    for width in (64, 2048, 16384):  # narrower (folded), the same, wider (repeated)
        merged = merge_sketch_states(shards, width, cap)
        sk = FrequencySketch(width, cap=cap)
        sk.load_state(merged)
        # the count after one more sighting, as admission asks it: never below the true one
        assert (sk.estimate_next(keys) >= np.minimum(counts + 1, cap)).all(), width
        assert merged["step"] == 7
        assert set(merged["step_keys"].tolist()) == set(np.concatenate([s["step_keys"] for s in shards[1:]]).tolist())
    same = merge_sketch_states(shards[:1], 2048, cap)
    np.testing.assert_array_equal(same["cells"], shards[0]["cells"])  # one input, same width: itself
    with pytest.raises(ValueError, match="power of two"):
        merge_sketch_states(shards, 1000, cap)


@pytest.mark.parametrize("saved_capacity,loaded_capacity", [(3000, 100), (100, 3000)])
def test_sketch_loads_into_another_capacity_never_undercounting(saved_capacity, loaded_capacity):
    """Another capacity means another sketch width: the saved sketch is folded or repeated."""
    kjts = random_kjts(8, vocab=60, seed=2)
    saved = ShardedEmbeddingStore(three_feature_schema(D, saved_capacity), cfg())
    for step, kjt in enumerate(kjts):
        step_store(saved, kjt, step)
    saved.flush()
    rows, admission = saved.state_dict(), through_torch_save(saved.admission_state_dict())["admission"]
    loaded = ShardedEmbeddingStore(three_feature_schema(D, loaded_capacity), cfg())
    loaded.load_state_dict(rows, admission=admission)
    probe = np.arange(60, dtype=np.int64)
    for name in ("user", "item"):
        a, b = saved.tables[name].admission_state(), loaded.tables[name].admission_state()
        assert a["cells"].shape != b["cells"].shape
        before, after = FrequencySketch(a["cells"].shape[1], cap=3), FrequencySketch(b["cells"].shape[1], cap=3)
        before.load_state(a)
        after.load_state(b)
        assert (after.estimate_next(probe) >= before.estimate_next(probe)).all(), name
        assert (before.estimate_next(probe) > 1).any()
        assert b["step"] == a["step"] == len(kjts) - 1
    states_equal(loaded.state_dict(), rows)


def _two_rank_sketches(rank, world, kjts):
    store = ShardedEmbeddingStore(three_feature_schema(D, 400), cfg())
    for step, kjt in enumerate(kjts):
        step_store(store, kjt, step)
    store.flush()
    payload = store.admission_state_dict()
    rows = store.state_dict()
    store.close()
    return payload, rows


@pytest.mark.multiproc
@pytest.mark.slow
def test_sketch_saved_at_two_ranks_loads_at_one_never_undercounting():
    kjts = random_kjts(10, vocab=300, seed=9)
    (payload, rows0), (empty, rows1) = run_distributed(_two_rank_sketches, 2, kjts)
    assert empty == {} and payload["admission"]["world_size"] == 2
    admission = through_torch_save(payload)["admission"]
    rows = {n: pa.concat_tables([rows0[n], rows1[n]]) for n in rows0}
    one = ShardedEmbeddingStore(three_feature_schema(D, 400), cfg())
    one.load_state_dict(rows, admission=admission)
    probe = np.arange(300, dtype=np.int64)  # every id the batches can hold (the store's keys here)
    owner = hashing.owner_of(probe, 2)
    for name in ("user", "item"):
        state = one.tables[name].admission_state()
        merged = FrequencySketch(state["cells"].shape[1], cap=3)
        merged.load_state(state)
        saved = admission["tables"][name]
        for r in range(2):
            shard = FrequencySketch(saved["cells"].shape[2], cap=3)
            shard.load_state({"cells": saved["cells"][r].numpy(), "recorded": int(saved["recorded"][r])})
            mine = probe[owner == r]
            assert (merged.estimate_next(mine) >= shard.estimate_next(mine)).all(), (name, r)
            assert (shard.estimate_next(mine) > 1).any(), "the shard saw none of its keys"
    states_equal(one.state_dict(), {n: t.sort_by("key") for n, t in rows.items()})
    one.close()


# --------------------------------------------------------------------------- the trainer


@pytest.mark.parametrize("staleness", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_training_resume_with_admission_equals_the_uninterrupted_run(tiny_data, tmp_path, staleness):
    """min_count = 2 on the tiny job: resumed from the step-4 checkpoint, the run ends with the
    uninterrupted run's rows and losses (before, the resume forgot every sighting count)."""
    import test_train as tt

    extra = ("store.min_count=2", f"store.staleness={staleness}", "train.max_steps=10",
             "train.checkpoint.every_steps=4", "train.checkpoint.keep_last=5")
    tt.run(tiny_data, tmp_path / "full", *extra)
    ckpt4 = tmp_path / "full" / "checkpoints" / "step-00000004"
    dense = torch.load(ckpt4 / "dense.pt", weights_only=True)
    assert dense["admission"]["world_size"] == 1 and "c3" in dense["admission"]["tables"]
    tt.run(tiny_data, tmp_path / "resumed", *extra, resume=ckpt4)
    full, resumed = tt.losses(tmp_path / "full"), tt.losses(tmp_path / "resumed")
    assert sorted(resumed) == list(range(5, 11))
    assert all(resumed[s] == full[s] for s in resumed)
    want, got = tt.final_rows(tmp_path / "full"), tt.final_rows(tmp_path / "resumed")
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].keys() == want[name].keys(), f"table {name}: other rows admitted"
        for k in want[name]:
            assert got[name][k].tobytes() == want[name][k].tobytes(), (name, k)
