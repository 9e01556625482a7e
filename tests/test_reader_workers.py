"""Worker processes kept from epoch to epoch: same processes, exactly once, early ends that
give every credit back, a worker killed with SIGKILL, and workers that end with their reader's
process."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from recsys.io import reader as reader_module
from recsys.io import reader_workers
from recsys.io.reader import ParquetReader
from conftest import wait_until
from reader_data import ids_of, make_schema, write_dataset

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("workers") / "data")


def worker_pids() -> set[int]:
    return {p.pid for p in multiprocessing.active_children() if p.name.startswith("recsys-reader-slot")}


def interrupt_once(monkeypatch, owner, name: str) -> dict:
    """Patch ``owner.name`` to raise KeyboardInterrupt on its next call once ``calls["armed"]``
    is set (then disarm); return ``calls``."""
    calls = {"armed": False}
    method = getattr(owner, name)

    def interrupted(self, *args):
        if calls["armed"]:
            calls["armed"] = False
            raise KeyboardInterrupt
        return method(self, *args)

    monkeypatch.setattr(owner, name, interrupted)
    return calls


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_workers_are_kept_across_epochs_and_read_each_exactly_once(data, start_method):
    with ParquetReader(data.config(num_workers=2, batch_size=4, start_method=start_method), make_schema()) as r:
        assert worker_pids() == set()  # nothing starts before the first epoch
        first = sorted(ids_of(list(r)))
        pids = worker_pids()
        assert len(pids) == 2
        for epoch in (1, 2):
            assert r.epoch == epoch
            assert sorted(ids_of(list(r))) == data.row_ids
            assert worker_pids() == pids
    assert first == data.row_ids
    assert worker_pids() == set()


def test_kept_workers_give_the_same_batches_as_new_ones_each_epoch(data):
    """Epoch 2 of a kept pool equals epoch 2 of a reader resumed at the start of epoch 2."""
    cfg = data.config(num_workers=2, batch_size=4)
    with ParquetReader(cfg, make_schema()) as r:
        list(r)
        state = ParquetReader.merge_states([r.state_dict()])
        kept = [ids_of([b]) for b in r]
    with ParquetReader(cfg, make_schema()) as fresh:
        fresh.load_state_dict(state)
        new = [ids_of([b]) for b in fresh]
    assert kept == new and len(kept) > 10


@pytest.mark.timeout(180)  # a lost credit hangs the reader: fail sooner than the suite's 600 s
def test_ending_epochs_early_returns_every_credit(data):
    """Stopping after one batch, many times over: every stop drains what the workers sent,
    so the same two processes go on (a lost credit would leave a worker waiting for a ring
    slot forever) and the epoch still delivers each row once."""
    # prefetch=1: two credits per worker, so a single lost one stalls it
    with ParquetReader(data.config(num_workers=2, batch_size=4, prefetch=1), make_schema()) as r:
        seen: list[int] = []
        pids = None
        for _ in range(12):
            it = iter(r)
            seen += ids_of([next(it)])
            it.close()
            pids = pids or worker_pids()
            assert worker_pids() == pids
        seen += ids_of(list(r))
        assert sorted(seen) == data.row_ids
        assert r.epoch == 1
        assert sorted(ids_of(list(r))) == data.row_ids
        assert worker_pids() == pids


def test_a_worker_killed_mid_epoch_raises_and_the_next_epoch_resumes_exactly_once(data):
    with ParquetReader(data.config(num_workers=2, batch_size=4), make_schema()) as r:
        it = iter(r)
        seen = ids_of([next(it), next(it)])
        victim = min(worker_pids())
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(RuntimeError, match=r"reader worker of slot \d \(pid \d+\) was killed by SIGKILL"):
            while True:
                seen += ids_of([next(it)])
        assert victim not in worker_pids()
        seen += ids_of(list(r))  # new workers read what was not delivered
        assert len(worker_pids()) == 2
    assert sorted(seen) == data.row_ids


def test_an_error_in_a_worker_reaches_the_caller_with_its_traceback(data, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("converter broke")

    monkeypatch.setattr(reader_module.UnitConverter, "convert", broken)  # the fork inherits it
    with ParquetReader(data.config(num_workers=2, batch_size=4), make_schema()) as r:
        with pytest.raises(ValueError, match="converter broke") as info:
            list(r)
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert "in the reader worker of slot" in notes and 'raise ValueError("converter broke")' in notes
        pids = worker_pids()
        with pytest.raises(ValueError, match="converter broke"):  # the same workers, still broken
            list(r)
        assert worker_pids() == pids and len(pids) == 2


def test_workers_end_when_the_readers_process_is_killed(data, tmp_path):
    """The reader's process dies without closing anything; its workers notice and exit."""
    script = tmp_path / "reader.py"
    script.write_text(textwrap.dedent(f"""
        import multiprocessing, sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from reader_data import make_schema
        from recsys.io.config import ReaderConfig
        from recsys.io.reader import ParquetReader
        r = ParquetReader(ReaderConfig(paths=[{str(data.root)!r}], batch_size=4, num_workers=2,
                                       passthrough=["row_id"]), make_schema())
        it = iter(r)
        next(it)  # workers now wait for credits: the caller stopped consuming
        print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
        time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    deadline = time.monotonic() + 60  # they check every 0.2-1 s; the bound only stops a hang
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (an orphan is reaped by init; a zombie counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class CountingRing(reader_workers._Ring):
    """A worker's ring that counts, in shared memory, the times the worker asked whether its
    reader is gone (``orphaned``: while it waits for a credit, and while idle between runs).
    Pickled by reference, so a forkserver worker imports this module to run it."""

    def __init__(self, mp_context, slots: int, slot_bytes: int) -> None:
        super().__init__(mp_context, slots, slot_bytes)
        self.checks = mp_context.RawValue("i", 0)

    def orphaned(self) -> bool:
        self.checks.value += 1
        return super().orphaned()


def rings(r: ParquetReader) -> list:
    return [w.ring for w in r._pool._workers.values()]


def wait_full(r: ParquetReader) -> None:
    """Wait until every worker holds all its credits: each then waits for one."""
    wait_until(lambda: all(ring.free.get_value() == 0 for ring in rings(r)), 60, "the workers to fill their credits")


def test_forkserver_workers_wait_for_a_slow_consumer_and_between_epochs(data, monkeypatch):
    """A forkserver worker's parent is the server, not the reader's process: a worker must
    not take that for its reader being gone, while it waits for a credit or for a plan."""
    monkeypatch.setattr(reader_workers, "_Ring", CountingRing)
    with ParquetReader(data.config(num_workers=2, batch_size=4, prefetch=1, start_method="forkserver"),
                       make_schema()) as r:
        it = iter(r)
        seen = ids_of([next(it)])
        wait_full(r)  # both workers wait for a credit...
        before = [ring.checks.value for ring in rings(r)]
        wait_until(lambda: all(ring.checks.value >= n + 2 for ring, n in zip(rings(r), before)), 60,
                   "each waiting worker to check for its reader twice")  # ...and found it there
        seen += ids_of(list(it))
        pids = worker_pids()
        before = [ring.checks.value for ring in rings(r)]  # idle between epochs
        wait_until(lambda: all(ring.checks.value >= n + 2 for ring, n in zip(rings(r), before)), 60,
                   "each idle worker to check for its reader twice")
        assert worker_pids() == pids and all(w.proc.is_alive() for w in r._pool._workers.values())
        assert sorted(seen) == data.row_ids
        assert sorted(ids_of(list(r))) == data.row_ids
        assert worker_pids() == pids


def test_an_interrupted_drain_leaves_no_stale_batches(data, monkeypatch):
    """Ctrl-C while an early end drains the workers: the pool is not reused half-drained (its
    old items would pass for the next epoch's), and the state stays exactly once."""
    calls = interrupt_once(monkeypatch, reader_workers.WorkerPool, "_recv")
    with ParquetReader(data.config(num_workers=2, batch_size=4, prefetch=1), make_schema()) as r:
        it = iter(r)
        seen = ids_of([next(it), next(it)])
        wait_full(r)  # the drain has items to take from every worker
        calls["armed"] = True
        with pytest.raises(KeyboardInterrupt):
            it.close()
        seen += ids_of(list(r))
        assert sorted(seen) == data.row_ids
        assert sorted(ids_of(list(r))) == data.row_ids


@pytest.mark.timeout(180)  # a lost credit hangs the reader: fail sooner than the suite's 600 s
def test_credits_lost_to_interruptions_are_back_at_the_next_epoch(data, monkeypatch):
    """An interruption between an item's receipt and its credit's release, once per credit
    (prefetch 1: three), then whole epochs: each epoch starts with every credit."""
    calls = interrupt_once(monkeypatch, reader_workers._Ring, "receive")
    with ParquetReader(data.config(num_workers=1, batch_size=4, prefetch=1), make_schema()) as r:
        for _ in range(3):
            it = iter(r)
            next(it)
            calls["armed"] = True
            with pytest.raises(KeyboardInterrupt):
                next(it)
            it.close()
        list(r)  # the rest of epoch 0
        assert sorted(ids_of(list(r))) == data.row_ids


def test_a_worker_that_died_between_epochs_is_replaced_before_the_next(data):
    with ParquetReader(data.config(num_workers=2, batch_size=4), make_schema()) as r:
        list(r)
        victim = min(multiprocessing.active_children(), key=lambda p: p.pid)
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(60)  # until it can be reaped (/proc shows a zombie while its threads still exit)
        assert victim.exitcode == -signal.SIGKILL
        assert sorted(ids_of(list(r))) == data.row_ids  # nothing was read yet: no error
        victim = victim.pid
        assert victim not in worker_pids() and len(worker_pids()) == 2


def test_workers_end_on_sigterm_though_the_parent_handles_it(data):
    """The trainer handles SIGTERM (a graceful stop); a forked worker must not inherit that."""
    previous = signal.signal(signal.SIGTERM, lambda *args: None)
    try:
        with ParquetReader(data.config(num_workers=2, batch_size=4), make_schema()) as r:
            it = iter(r)
            next(it)
            procs = [p for p in multiprocessing.active_children() if p.name.startswith("recsys-reader-slot")]
            for p in procs:
                os.kill(p.pid, signal.SIGTERM)
            for p in procs:
                p.join(60)
            assert [p.exitcode for p in procs] == [-signal.SIGTERM] * 2
            it.close()  # quietly: the epoch's end finds them gone
    finally:
        signal.signal(signal.SIGTERM, previous)
