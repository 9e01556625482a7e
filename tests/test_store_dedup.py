"""Batch indexing: every table's ids deduplicated in one pass, rows for pooling."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recsys.store.tables.dedup import index_batch, unique_blocks, unique_inverse
from recsys.store.sharded.exchange import route
from recsys.features.hashing import owner_of


def _reference(values, feat_off, lengths_FB, tables, single):
    """Per table: np.unique-style first-appearance dedup over its features in order."""
    uniq, base, row_of = [], [0], {}
    for feats in tables:
        seen = {}
        for f in feats:
            for i in range(feat_off[f], feat_off[f + 1]):
                k = int(values[i])
                if k not in seen:
                    seen[k] = base[-1] + len(seen)
                row_of[i] = seen[k]
        uniq.extend(seen)
        base.append(base[-1] + len(seen))
    B = lengths_FB.shape[1]
    pad = base[-1]
    single_idx = np.full((B, sum(single)), pad, dtype=np.int64)
    multi = []
    col = 0
    for f in range(len(single)):
        pos = feat_off[f]
        if single[f]:
            for b in range(B):
                if lengths_FB[f, b]:
                    single_idx[b, col] = row_of[pos]
                pos += lengths_FB[f, b]
            col += 1
        else:
            multi.extend(row_of[i] for i in range(feat_off[f], feat_off[f + 1]))
    return np.array(uniq, dtype=np.int64), np.array(base), single_idx, np.array(multi, dtype=np.int64)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_index_batch_matches_a_per_table_reference(data):
    F = data.draw(st.integers(1, 5))
    B = data.draw(st.integers(0, 6))
    single = [data.draw(st.booleans()) for _ in range(F)]
    # features to tables: some tables shared by several features (in schema order)
    n_tables = data.draw(st.integers(1, F))
    table_of = [min(f, n_tables - 1) if f < n_tables else data.draw(st.integers(0, n_tables - 1)) for f in range(F)]
    tables = [[f for f in range(F) if table_of[f] == t] for t in range(n_tables)]
    lengths_FB = np.array([[data.draw(st.integers(0, 1 if single[f] else 4)) for _ in range(B)] for f in range(F)],
                          dtype=np.int64).reshape(F, B)
    feat_off = np.concatenate([[0], np.cumsum(lengths_FB.sum(axis=1))]).astype(np.int64)
    # small id range, so ids repeat within and across tables (the same id in two tables is two keys)
    values = np.array(data.draw(st.lists(st.integers(-3, 5), min_size=int(feat_off[-1]), max_size=int(feat_off[-1]))),
                      dtype=np.int64)
    tf_idx = np.array([f for feats in tables for f in feats], dtype=np.int64)
    tf_ptr = np.cumsum([0] + [len(feats) for feats in tables]).astype(np.int64)
    single_col = np.full(F, -1, dtype=np.int64)
    single_col[[f for f in range(F) if single[f]]] = np.arange(sum(single))
    multi_dst = np.full(F, -1, dtype=np.int64)
    at = 0
    for f in range(F):
        if not single[f]:
            multi_dst[f] = at
            at += int(feat_off[f + 1] - feat_off[f])
    got = index_batch(values, feat_off, lengths_FB, tf_ptr, tf_idx, single_col, multi_dst, at)
    want = _reference(values, feat_off, lengths_FB, tables, single)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_index_batch_names_a_single_hot_feature_with_two_ids():
    lengths = np.array([[1, 2]], dtype=np.int64)
    with pytest.raises(ValueError, match="feature 'user' is single-hot but a sample of the batch holds more"):
        index_batch(np.array([4, 5, 6]), np.array([0, 3]), lengths, np.array([0, 1]), np.array([0]),
                    np.array([0]), np.array([-1]), 0, names=["user"])


def test_unique_inverse_first_appearance():
    keys = np.array([5, -1, 5, 7, -1, 0], dtype=np.int64)
    uniq, inv = unique_inverse(keys)
    np.testing.assert_array_equal(uniq, [5, -1, 7, 0])
    np.testing.assert_array_equal(uniq[inv], keys)


def _first_seen(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(keys, return_inverse=True)`` reordered to first appearance."""
    sorted_uniq, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    order = np.argsort(first)  # sorted position -> first-seen position
    rank = np.empty_like(order)
    rank[order] = np.arange(order.shape[0])
    return sorted_uniq[order], rank[inverse.reshape(-1)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.integers(-4, 4), st.integers(-(2**63), 2**63 - 1)), max_size=300))
def test_unique_inverse_is_numpys_unique_in_first_seen_order(values):
    """What a live push and a served request rely on: each key once, in the order first seen,
    and each key's index among them; ``np.unique(return_inverse=True)`` up to that order."""
    keys = np.array(values, dtype=np.int64)
    uniq, inverse = unique_inverse(keys)
    want_uniq, want_inverse = _first_seen(keys)
    np.testing.assert_array_equal(uniq, want_uniq)
    np.testing.assert_array_equal(inverse, want_inverse)
    assert uniq.dtype == inverse.dtype == np.int64


def test_unique_inverse_takes_uint64_bit_patterns_and_refuses_other_input():
    rng = np.random.default_rng(4)
    for keys in (np.empty(0, np.int64), np.array([9], np.int64), np.repeat(np.array([3, -1, 7]), 5),
                 np.array([0, -1, 2**63 - 1, -(2**63), 0, -1], np.int64), rng.integers(0, 3000, 10_000)):
        uniq, inverse = unique_inverse(keys)
        want_uniq, want_inverse = _first_seen(keys)
        np.testing.assert_array_equal(uniq, want_uniq)
        np.testing.assert_array_equal(inverse, want_inverse)
    bits = rng.integers(0, 2**64 - 1, 100, dtype=np.uint64)
    uniq, inverse = unique_inverse(np.concatenate([bits, bits[::-1]]))
    np.testing.assert_array_equal(uniq, bits.view(np.int64))
    np.testing.assert_array_equal(uniq[inverse], np.concatenate([bits, bits[::-1]]).view(np.int64))
    with pytest.raises(ValueError, match="keys must be a 1-D array"):
        unique_inverse(np.zeros((2, 2), np.int64))
    with pytest.raises(TypeError, match="keys must be int64"):
        unique_inverse(np.array([1.5]))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(0, 5), st.data())
def test_unique_blocks_is_each_tables_unique_inverse_over_its_blocks(W, T, data):
    """Keys in [W, T] blocks, rank-major (what an owner receives): each table's keys are
    deduplicated across the ranks' blocks in block order, as ``unique_inverse`` of the
    concatenation of its blocks would, and the inverse maps every key back."""
    counts = np.array(data.draw(st.lists(st.lists(st.integers(0, 12), min_size=T, max_size=T),
                                         min_size=W, max_size=W)), dtype=np.int64).reshape(W, T)
    keys = np.array(data.draw(st.lists(st.integers(-4, 8), min_size=int(counts.sum()), max_size=int(counts.sum()))),
                    dtype=np.int64)
    uniq, base, inverse = unique_blocks(keys, counts)
    ends = np.cumsum(counts.reshape(-1))
    blocks = np.split(keys, ends[:-1]) if ends.shape[0] else []
    assert base.shape == (T + 1,) and base[0] == 0
    for t in range(T):
        want, _ = unique_inverse(np.concatenate([blocks[r * T + t] for r in range(W)] + [np.empty(0, np.int64)]))
        np.testing.assert_array_equal(uniq[base[t] : base[t + 1]], want)
    np.testing.assert_array_equal(uniq[inverse], keys)
    for t in range(T):  # a key's inverse stays inside its own table's range
        for r in range(W):
            at = inverse[ends[r * T + t] - counts[r, t] : ends[r * T + t]]
            assert ((at >= base[t]) & (at < base[t + 1])).all()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.lists(st.integers(0, 20), min_size=0, max_size=5), st.data())
def test_route_orders_keys_by_owner_then_table_keeping_their_order(W, sizes, data):
    base = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    keys = np.array(data.draw(st.lists(st.integers(-2**63, 2**63 - 1), min_size=int(base[-1]),
                                       max_size=int(base[-1]))), dtype=np.int64)
    send_keys, dest, counts = route(keys, base, W)
    owner = owner_of(keys, W)
    want_dest = [i for r in range(W) for t in range(len(sizes)) for i in range(base[t], base[t + 1]) if owner[i] == r]
    np.testing.assert_array_equal(dest, np.array(want_dest, dtype=np.int64))
    np.testing.assert_array_equal(send_keys, keys[dest])
    assert counts.shape == (W, len(sizes))
    for t in range(len(sizes)):
        np.testing.assert_array_equal(counts[:, t], np.bincount(owner[base[t] : base[t + 1]], minlength=W))
