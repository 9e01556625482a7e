"""The prefetch hint: emitted as an instruction, changes no value, refuses what it cannot hint."""

import numpy as np
import pytest
from numba import njit
from numba.core.errors import TypingError

from recsys.store.host.prefetch import prefetch


@njit
def _sum_rows_hinted(a, idx):
    acc = 0.0
    for i in range(idx.shape[0]):
        if i + 2 < idx.shape[0]:
            prefetch(a, idx[i + 2])
        acc += a[idx[i]].sum()
    return acc


@njit
def _hint_1d(a, i):
    prefetch(a, i)
    return a[i]


def test_prefetch_changes_no_value_on_1d_and_2d_arrays():
    rng = np.random.default_rng(0)
    a2 = rng.random((1000, 16)).astype(np.float32)
    idx = rng.integers(0, 1000, 300)
    assert _sum_rows_hinted(a2, idx) == pytest.approx(float(a2[idx].astype(np.float64).sum()), rel=1e-5)
    a1 = np.arange(50, dtype=np.int64)
    assert _hint_1d(a1, np.int32(7)) == 7


def test_prefetch_is_an_instruction_in_the_kernel():
    a2 = np.zeros((64, 16), dtype=np.float32)
    _sum_rows_hinted(a2, np.arange(10))
    (asm,) = _sum_rows_hinted.inspect_asm().values()
    assert "prefetch" in asm.lower()


def test_prefetch_refuses_non_arrays():
    @njit
    def bad(x):
        prefetch(x, 0)

    with pytest.raises(TypingError):
        bad(3.0)
