"""Keep freed heap memory in the process instead of handing it back to the kernel (glibc).

A training step allocates and frees the same large arrays every step: the batch's rows, its
pooled embeddings and their gradients (10-30 MB each at batch 4096). With glibc's default
settings many of those come back from the kernel as fresh pages, and every fresh page costs
a page fault at its first write: on a 2-core VM, 13 k-66 k faults per 10 steps of the store
benchmark, and the rounds that paid them ran up to 1.7x slower than the rounds that did not.
How much a fault costs depends on the host (a VM's memory, huge-page compaction), which made
the store's speed depend on the host too. With the thresholds below, freed blocks stay in
malloc's arenas and the next step reuses them: ~0 faults per round.

The price is that the process keeps up to ``trim_threshold`` of freed memory (resident
memory stays near the peak of a step instead of falling between steps). Settings are
process-wide and only affect later allocations and frees. On a C library other than glibc
this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 256 << 20  # blocks below this come from the arenas (glibc default: 128 KiB, dynamic up to 32 MiB)
TRIM_THRESHOLD = 1 << 30  # free memory at an arena's top kept before it is returned

_lock = threading.Lock()
_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds once per process; return whether they are set."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _set_thresholds()
        return _applied


def _set_thresholds() -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        log.debug("no mallopt in this C library: freed memory is returned as it likes")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if not ok:
        log.debug("mallopt refused the store's thresholds")
    return ok
