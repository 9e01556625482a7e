"""The store's large arrays on 2 MiB pages (Linux transparent huge pages, THP).

Every hot kernel of the store reads or writes rows at random positions of arrays of tens
of megabytes: the key map's buckets and per-slot arrays, a table's rows and its optimizer
state. With 4 KiB pages nearly every such access also misses the TLB (a 64 MiB table spans
16 k pages, far more than the TLB holds) and waits for a page walk too. On 2 MiB pages the
same array is 32 pages, and a random access seldom waits for a page walk: gathers and row-wise
optimizer updates over such tables run markedly faster (docs/benchmarks-history.md has the
figures, on random rows and inside training, where hot rows make the gain smaller).

``zeros`` maps such arrays privately and anonymously, aligned to 2 MiB, and asks the
kernel for huge pages with ``madvise(MADV_HUGEPAGE)``: that is enough where
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` or ``always``. Where the kernel has
THP off (``never``), cannot give a huge page (fragmented memory) or is not Linux, the
array is the same zeroed array on small pages. The numbers are the same either way; only
the speed of random access changes.

Only an array's whole 2 MiB pages are huge: the part past the last one (up to 2 MiB less
4 KiB) stays on small pages, so memory grows with the array's bytes, not in 2 MiB steps: a
huge last page would be resident whole once touched, up to 2 MiB more per array, tens of MB
over a store of many tables. Arrays below 2 MiB stay on small pages (nothing to gain).
"""

from __future__ import annotations

import mmap
import sys

import numpy as np

HUGE_PAGE = 2 << 20
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"

_mode: str | None = None


def thp_mode() -> str:
    """Return the kernel's THP setting: ``always``, ``madvise`` or ``never`` ("" if unknown)."""
    global _mode
    if _mode is None:
        _mode = ""
        if sys.platform == "linux" and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                with open(THP_SETTING) as fh:
                    text = fh.read()
            except OSError:
                text = ""
            if "[" in text:
                _mode = text.split("[", 1)[1].split("]", 1)[0]
    return _mode


def zeros(shape, dtype, huge: bool = True) -> np.ndarray:
    """Return a zeroed C-contiguous array, on huge pages when ``huge`` and the array spans
    at least one 2 MiB page (and the kernel allows it), else ``np.zeros``."""
    dtype = np.dtype(dtype)
    shape = tuple(int(s) for s in np.atleast_1d(shape))
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if not huge or nbytes < HUGE_PAGE or thp_mode() not in ("always", "madvise"):
        return np.zeros(shape, dtype)
    # one huge page more than needed, so the array can start on a 2 MiB boundary (the
    # slack before it is never touched, so never backed by memory)
    size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE + HUGE_PAGE
    try:
        region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        start = (-np.frombuffer(region, dtype=np.uint8, count=1).ctypes.data) % HUGE_PAGE
        whole = nbytes // HUGE_PAGE * HUGE_PAGE
        region.madvise(mmap.MADV_HUGEPAGE, start, whole)
        if hasattr(mmap, "MADV_NOHUGEPAGE") and start + whole < size:
            # the part past the last whole huge page stays on small pages: a huge page
            # there would hold up to 2 MiB that no row uses (with THP ``always`` too)
            region.madvise(mmap.MADV_NOHUGEPAGE, start + whole, size - start - whole)
    except (OSError, ValueError):
        return np.zeros(shape, dtype)
    # fresh anonymous memory reads as zeros; the array keeps ``region`` alive (through its
    # base), so the mapping goes with the array
    return np.frombuffer(region, dtype=np.uint8, count=nbytes, offset=start).view(dtype).reshape(shape)
