"""Background threads that take only the cores a training step leaves idle.

A training step on CPU keeps both cores of a small host busy with the dense model's torch
threads, and the store's worker and the reader's threads run beside them: the next batch's
key work, Parquet decode, hashing. A torch parallel region waits for its slowest thread, so
a background thread holding a core for even a fraction of a millisecond stalls the whole
region. Nice values only shrink the background thread's share; Linux's ``SCHED_IDLE``
policy goes further: such a thread runs only when no normal thread wants the core, and a
normal thread that wakes takes the core back at once.

``SCHED_IDLE`` alone would be unsafe: on a host whose cores are all busy with other work,
an idle-policy thread gets almost no time, and a step that waits for it would wait nearly
forever (measured on 2 cores with two busy loops at nice 0: a step of 67 ms took 2.2 s).
So a group is lowered only while nobody waits for it, and is raised back to the normal
policy (its nice value unchanged) by whoever is about to wait:

- ``STORE``: the store's worker and lanes. The trainer lowers them for the dense forward
  and backward (they then do the next batch's key work, which nothing waits for); the
  store raises them as soon as anything is submitted to them (the push, whose work the
  next lookup waits for, a flush, a checkpoint) and before its worker is stopped.
- ``READER``: the reader's threads. The trainer lowers them with the store's; the reader
  raises them while its consumer waits for a batch that is not ready, and lowers them
  again once the batch is there. They stay low while the store's worker applies the push,
  so the two do not share the core the step waits on.

Even raised on every wait, idle-policy threads slow a step down when other processes keep
every core busy: the work they would have done beside the dense phase then all lands in
the waits (measured on 2 cores with two busy loops at nice 0: 190 ms steps against 71 ms
without lowering). ``dense_phase`` therefore lowers only while the host's other processes
use little CPU (``LoadWatch``: under half a core, measured each second from /proc/stat
against this process's own CPU time; lowering resumes below a quarter of a core).

Membership is by thread name prefix (threads of this process only, alive ones only), so a
thread that starts later joins its group by its name. A new thread inherits its creator's
policy. Off Linux, or when the kernel refuses, nothing happens.
"""

from __future__ import annotations

import os
import sys
import threading
import time

STORE_PREFIXES = ("store-worker", "store-lane")
READER_PREFIXES = ("recsys-reader-",)

_SUPPORTED = sys.platform == "linux" and hasattr(os, "SCHED_IDLE")


class IdleGroup:
    """The threads of this process whose names start with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        self.prefixes = prefixes
        self.enabled = False
        """Whether ``lower`` does anything (the trainer turns it on, ``train.runtime.idle_background``)."""
        self._low = False
        self._lock = threading.Lock()

    @property
    def low(self) -> bool:
        """Whether the group was lowered and not raised since."""
        return self._low

    def members(self) -> list[threading.Thread]:
        return [t for t in threading.enumerate()
                if t.native_id is not None and t.is_alive() and t.name.startswith(self.prefixes)]

    def lower(self) -> None:
        """Put every member under ``SCHED_IDLE`` (if enabled)."""
        if self.enabled and _SUPPORTED:
            with self._lock:
                self._low = True
                self._set(os.SCHED_IDLE)

    def raise_(self) -> None:
        """Put every member back under the normal policy (``SCHED_OTHER``, nice unchanged);
        cheap when the group is not low."""
        if self._low:
            with self._lock:
                if self._low:
                    self._low = False
                    self._set(os.SCHED_OTHER)

    def _set(self, policy: int) -> None:
        param = os.sched_param(0)
        for t in self.members():
            try:
                os.sched_setscheduler(t.native_id, policy, param)
            except OSError:  # the thread ended meanwhile, or the kernel refuses
                pass


class LoadWatch:
    """Whether other processes keep this host's cores busy: CPU time of the whole host
    (/proc/stat) minus this process's own (``os.times``), per second of wall time, sampled
    at most every ``interval_s``. Busy above ``busy_above`` cores, quiet again below
    ``quiet_below`` (hysteresis); quiet until the first full interval."""

    def __init__(self, interval_s: float = 1.0, busy_above: float = 0.5, quiet_below: float = 0.25,
                 host_cpu_s=None, own_cpu_s=None, clock=None) -> None:
        self.interval_s, self.busy_above, self.quiet_below = interval_s, busy_above, quiet_below
        self._host = host_cpu_s or _host_cpu_s
        self._own = own_cpu_s or _own_cpu_s
        self._clock = clock or time.monotonic
        self.busy = False
        self.others_cores = 0.0
        """Cores the other processes used over the last interval."""
        self._last: tuple[float, float, float] | None = None

    def others_busy(self) -> bool:
        now = self._clock()
        if self._last is not None and now - self._last[0] < self.interval_s:
            return self.busy
        host, own = self._host(), self._own()
        if host is None:
            return False
        if self._last is not None:
            t0, host0, own0 = self._last
            self.others_cores = max(0.0, (host - host0) - (own - own0)) / (now - t0)
            if self.busy:
                self.busy = self.others_cores >= self.quiet_below
            else:
                self.busy = self.others_cores > self.busy_above
        self._last = (now, host, own)
        return self.busy


def _host_cpu_s() -> float | None:
    """Return the CPU seconds every core of the host spent running anything (user, nice,
    system, irq, softirq; not idle, iowait or steal), or None where /proc/stat is missing."""
    try:
        with open("/proc/stat") as fh:
            fields = fh.readline().split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


STORE = IdleGroup(STORE_PREFIXES)
READER = IdleGroup(READER_PREFIXES)
WATCH = LoadWatch()


def dense_phase() -> None:
    """Called by the trainer before the dense forward: nothing waits for the store's and
    the reader's threads until the push, so lower both, unless other processes keep the
    host busy (then make sure both run under the normal policy)."""
    if not STORE.enabled or not _SUPPORTED:
        return
    if WATCH.others_busy():
        raise_all()
    else:
        STORE.lower()
        READER.lower()


def raise_all() -> None:
    """Put both groups under the normal policy (whoever is about to wait for both)."""
    STORE.raise_()
    READER.raise_()


def enable(on: bool) -> None:
    """Turn lowering on or off for both groups (off raises them)."""
    STORE.enabled = READER.enabled = on
    if not on:
        raise_all()

