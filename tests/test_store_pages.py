"""Huge pages for the store's large arrays: zeroed, aligned, really on 2 MiB pages where the
kernel allows it, released with the array, and no value of a table changes."""

import gc

import numpy as np
import pytest

from recsys.features import hashing
from recsys.features.schema import TableSpec
from recsys.store.host import pages
from recsys.store.config import HostConfig, StoreConfig
from recsys.store.tables.keymap import KeyMap
from recsys.store.tables.table import EmbeddingTable

THP = pages.thp_mode() in ("always", "madvise")


def _vmstat(name: str) -> int:
    with open("/proc/vmstat") as fh:
        for line in fh:
            k, v = line.split()
            if k == name:
                return int(v)
    return 0


def _smaps(arr: np.ndarray, field: str = "AnonHugePages") -> int:
    """Bytes of ``/proc/self/smaps``'s ``field`` over the mappings ``arr`` spans (a range
    advised apart is a mapping of its own): by default those the kernel backs with huge
    pages now; ``Rss`` for all resident ones."""
    addr = arr.ctypes.data
    inside, total = False, 0
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split(None, 1)[0] if line.strip() else ""
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < addr + arr.nbytes and addr < hi
            elif inside and line.startswith(field + ":"):
                total += int(line.split()[1]) * 1024
    return total


def _on_huge_pages(arr: np.ndarray) -> int:
    return _smaps(arr)


def _mapped(addr: int) -> bool:
    with open("/proc/self/maps") as fh:
        for line in fh:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


@pytest.mark.parametrize("shape,dtype", [((300_000, 16), np.float32), ((700_000,), np.int64), ((3 << 20,), np.bool_)])
def test_zeros_is_a_zeroed_writable_contiguous_array(shape, dtype):
    a = pages.zeros(shape, dtype)
    assert a.shape == shape and a.dtype == dtype
    assert a.flags["C_CONTIGUOUS"] and a.flags["WRITEABLE"]
    assert not a.any()
    a[...] = 1
    assert a.all()
    if THP:
        assert a.ctypes.data % pages.HUGE_PAGE == 0


def test_small_arrays_and_huge_false_are_plain_numpy():
    for a in (pages.zeros((1000, 16), np.float32), pages.zeros((300_000, 16), np.float32, huge=False)):
        assert a.base is None and not a.any()


@pytest.mark.skipif(not THP, reason="the kernel's transparent huge pages are off here")
def test_the_kernel_backs_the_array_with_huge_pages():
    fallback = _vmstat("thp_fault_fallback")
    a = pages.zeros((8 << 20,), np.float32)  # 32 MiB
    a[::1024] = 1.0  # touch every 4 KiB page
    if _vmstat("thp_fault_fallback") > fallback:
        pytest.skip("the kernel had no free huge page (fragmented memory): small pages, as documented")
    assert _on_huge_pages(a) >= 16 * pages.HUGE_PAGE


@pytest.mark.skipif(not THP, reason="the kernel's transparent huge pages are off here")
def test_only_whole_huge_pages_are_huge_so_memory_follows_the_bytes():
    """An array of 3 MiB and 4 KiB: its first 2 MiB on a huge page, the rest on small pages,
    so touching all of it makes ~3 MiB resident, not the 4 MiB of two huge pages."""
    fallback = _vmstat("thp_fault_fallback")
    a = pages.zeros(((3 << 20) + 4096,), np.uint8)
    assert a.nbytes == (3 << 20) + 4096 and a.base.nbytes == a.nbytes  # the array's own bytes, not the mapping's
    a[::4096] = 1  # touch every 4 KiB page
    if _vmstat("thp_fault_fallback") > fallback:
        pytest.skip("the kernel had no free huge page (fragmented memory): small pages, as documented")
    assert _on_huge_pages(a) == pages.HUGE_PAGE
    assert a.nbytes <= _smaps(a, "Rss") < 2 * pages.HUGE_PAGE


@pytest.mark.skipif(not THP, reason="the kernel's transparent huge pages are off here")
def test_the_mapping_goes_with_the_array():
    a = pages.zeros((4 << 20,), np.int64)
    view = a[10:20]
    addr = a.ctypes.data
    del a
    gc.collect()
    assert _mapped(addr)  # a view still holds it
    del view
    gc.collect()
    assert not _mapped(addr)


def test_a_table_on_huge_pages_holds_the_same_rows():
    """Rows, optimizer state and key map on huge pages or not: every value the same, and
    the large arrays are where the setting says."""
    spec = TableSpec(dim=16, capacity=140_000)  # rows 8.5 MiB, keys and steps 2.1 MiB
    tables = {hp: EmbeddingTable("t", spec, StoreConfig(optimizer="adam", host=HostConfig(huge_pages=hp))) for hp in (True, False)}
    rng = np.random.default_rng(1)
    for step in range(4):
        keys = np.unique(hashing.hash_int64(rng.integers(0, 210_000, 70_000), "t"))  # evicts from step 3 on
        grads = rng.standard_normal((keys.shape[0], 16)).astype(np.float32)
        for t in tables.values():
            t.lookup(keys, step)
            t.apply_gradients(keys, grads, step)
    keys = np.unique(hashing.hash_int64(np.arange(210_000), "t"))
    np.testing.assert_array_equal(tables[True].peek(keys), tables[False].peek(keys))
    on, off = tables[True], tables[False]
    assert on.counters() == off.counters() and on.counters()["evictions"] > 0
    for name in off._state:
        np.testing.assert_array_equal(on._state[name], off._state[name])
    if THP:
        for arr in (on.weights_CD, on._map._rec):
            assert arr.ctypes.data % pages.HUGE_PAGE == 0
    for arr in (off.weights_CD, off._map._rec):
        assert arr.base is None or isinstance(arr.base, np.ndarray) and arr.base.base is None


def test_keymap_huge_pages_is_opt_in():
    assert KeyMap(600_000)._buckets.base is None
    m = KeyMap(600_000, huge_pages=True)  # per-slot arrays of 2.4-9.6 MB, buckets of 6 MB
    assert (m._buckets == m._buckets[0]).all() and not m.slot_key.any()
    if THP:
        for arr in (m._buckets, m._rec, m._free):
            assert arr.ctypes.data % pages.HUGE_PAGE == 0
