"""Golden vectors pin the hashing forever; numba kernels must equal the pure-Python reference."""

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from recsys.features import hashing

INTS = [0, 1, -1, 42, 2**31, 2**63 - 1, -(2**63), 1234567890123]
STRS = ["", "a", "abcdefgh", "abcdefghi", "ünïcødé 🙂", "x" * 100]

# Frozen. If one of these changes, every trained model and served embedding is orphaned.
GOLDEN_SALTS = {"item": 16780643328944559372, "": 10616074799439803362, "user_id": 16037040523788200276}
GOLDEN_INT_ITEM = [
    -4783211138842614654, 513779663186517434, 9050617929488660616, -6310879824029476205,
    1786575631733319969, -9221844251914640264, 9183141018872554234, 4864336340301098404,
]
GOLDEN_STR_ITEM = [
    4506336183001428010, 1160737337897691776, 6068388959049422840,
    3850026763447175215, -4346426875330969028, 8404314118194454635,
]
GOLDEN_FOLD_1000 = [962, 434, 616, 411, 969, 352, 234, 404]
GOLDEN_OWNER_3 = [2, 1, 0, 0, 1, 1, 2, 2]


def test_golden_salts():
    for name, salt in GOLDEN_SALTS.items():
        assert hashing.table_salt(name) == salt


def test_golden_int_keys():
    keys = hashing.hash_int64(np.array(INTS, dtype=np.int64), "item")
    assert keys.dtype == np.int64
    assert keys.tolist() == GOLDEN_INT_ITEM
    assert hashing.hash_int64_reference(INTS, "item") == GOLDEN_INT_ITEM


def test_golden_string_keys():
    assert hashing.hash_string_list(STRS, "item").tolist() == GOLDEN_STR_ITEM
    assert hashing.hash_string_reference(STRS, "item") == GOLDEN_STR_ITEM


def test_golden_fold_and_owner():
    keys = np.array(GOLDEN_INT_ITEM, dtype=np.int64)
    assert hashing.fold(keys, 1000).tolist() == GOLDEN_FOLD_1000
    assert hashing.owner_of(keys, 3).tolist() == GOLDEN_OWNER_3


def test_salt_separates_tables_and_numeric_salt_matches_name():
    v = np.arange(100, dtype=np.int64)
    a, b = hashing.hash_int64(v, "a"), hashing.hash_int64(v, "b")
    assert not np.any(a == b)
    assert np.array_equal(a, hashing.hash_int64(v, hashing.table_salt("a")))


def test_int_hash_is_collision_free_within_a_table():
    v = np.random.default_rng(0).integers(-(2**63), 2**63 - 1, size=200_000, dtype=np.int64)
    v = np.unique(v)
    assert np.unique(hashing.hash_int64(v, "t")).size == v.size


def test_random_ints_and_strings_match_reference():
    rng = np.random.default_rng(1)
    v = rng.integers(-(2**63), 2**63 - 1, size=500, dtype=np.int64)
    assert hashing.hash_int64(v, "x").tolist() == hashing.hash_int64_reference(v.tolist(), "x")
    strs = ["".join(chr(c) for c in rng.integers(32, 0x2FFF, size=n)) for n in rng.integers(0, 40, 300)]
    assert hashing.hash_string_list(strs, "x").tolist() == hashing.hash_string_reference(strs, "x")


def test_arrow_string_buffers_hash_like_python_strings():
    strs = ["alpha", "", "β-gamma", "delta" * 5]
    for arr in (pa.array(strs, pa.string()), pa.array(strs, pa.large_string())):
        width = np.int32 if arr.type == pa.string() else np.int64
        offsets = np.frombuffer(arr.buffers()[1], dtype=width)[: len(arr) + 1]
        data = np.frombuffer(arr.buffers()[2], dtype=np.uint8)
        assert hashing.hash_strings(offsets, data, "t").tolist() == hashing.hash_string_reference(strs, "t")


def test_bad_input_is_rejected_clearly():
    with pytest.raises(TypeError, match="integer array"):
        hashing.hash_int64(np.array([1.5]), "t")
    with pytest.raises(ValueError, match="num_rows"):
        hashing.fold(np.array([1], dtype=np.int64), 0)
    with pytest.raises(ValueError, match="world_size"):
        hashing.owner_of(np.array([1], dtype=np.int64), 0)


def test_owner_spreads_keys_evenly():
    keys = hashing.hash_int64(np.arange(100_000, dtype=np.int64), "t")
    counts = np.bincount(hashing.owner_of(keys, 4), minlength=4)
    assert counts.min() > 0.95 * counts.max()


def test_hashing_stays_torch_free():
    # The lookup service imports recsys.features.hashing; it must not drag torch in.
    code = "import sys, recsys.features.hashing, recsys.features.schema, recsys.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_hex_into_writes_each_keys_uint64_digits_at_the_column_and_refuses_a_short_buffer():
    keys = np.array([0, 5, -1, -(1 << 63), 0x0123456789ABCDEF], dtype=np.int64)
    out = np.full((keys.shape[0], 20), ord("x"), dtype=np.uint8)
    hashing.hex_into(keys, out, 3)
    want = [b"xxx" + f"{int(k) & ((1 << 64) - 1):016x}".encode() + b"x" for k in keys]
    assert [bytes(row) for row in out] == want
    with pytest.raises(ValueError, match="uint8"):
        hashing.hex_into(keys, out, 5)
