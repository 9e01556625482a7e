"""Background threads under SCHED_IDLE only while nobody waits for them (recsys.runtime.priority)."""

from __future__ import annotations

import os
import queue
import sys
import threading

import pytest

from recsys.runtime import priority

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread policies are Linux's")


def policy_of(thread: threading.Thread) -> int | None:
    """Return ``thread``'s scheduling policy (``os.SCHED_*``), or None if it ended."""
    try:
        return os.sched_getscheduler(thread.native_id)
    except OSError:
        return None


def _nice(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/stat") as fh:
        stat = fh.read()
    return int(stat[stat.rindex(")") + 2 :].split()[16])


@pytest.fixture
def quiet_host(monkeypatch):
    """A load watch that always finds the host's other processes idle (the tests' own host
    may be busy with anything)."""
    monkeypatch.setattr(priority, "WATCH", priority.LoadWatch(host_cpu_s=lambda: 0.0, own_cpu_s=lambda: 0.0))


@pytest.fixture
def member():
    """A thread named like the store's worker, at nice 3, parked until the test ends."""
    ready, done = threading.Event(), threading.Event()

    def body():
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _nice(threading.get_native_id()) + 3)
        ready.set()
        done.wait()

    t = threading.Thread(target=body, name="store-worker")
    t.start()
    ready.wait()
    yield t
    done.set()
    t.join()
    priority.enable(False)


def test_lower_and_raise_switch_the_policy_and_keep_the_nice_value(member):
    nice = _nice(member.native_id)
    bystander = threading.current_thread()
    priority.STORE.lower()  # not enabled: nothing happens
    assert os.sched_getscheduler(member.native_id) == os.SCHED_OTHER
    priority.enable(True)
    priority.STORE.lower()
    assert priority.STORE.low
    assert os.sched_getscheduler(member.native_id) == os.SCHED_IDLE
    assert policy_of(bystander) == os.SCHED_OTHER  # only the group's threads
    priority.STORE.raise_()
    assert not priority.STORE.low
    assert os.sched_getscheduler(member.native_id) == os.SCHED_OTHER
    assert _nice(member.native_id) == nice
    priority.STORE.lower()
    priority.enable(False)  # turning it off raises the group
    assert os.sched_getscheduler(member.native_id) == os.SCHED_OTHER


def test_a_thread_that_ended_is_skipped():
    t = threading.Thread(target=lambda: None, name="store-lane_0")
    t.start()
    t.join()
    priority.enable(True)
    try:
        priority.STORE.lower()  # no error for the ended thread
        assert t not in priority.STORE.members()
    finally:
        priority.enable(False)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from reader_data import write_dataset

    return write_dataset(tmp_path_factory.mktemp("reader") / "data")


def test_the_reader_raises_its_threads_while_its_consumer_waits(data, monkeypatch):
    """A consumer that finds no batch ready waits with the reader's threads at the normal
    policy, and puts them back under SCHED_IDLE once it has the batch."""
    from reader_data import make_schema

    from recsys.io.reader import ParquetReader

    seen = []
    real_get = queue.Queue.get

    def get(self, *args, **kwargs):
        if kwargs.get("timeout") is not None:  # the blocking wait of the consumer
            seen.append({t.name: policy_of(t) for t in priority.READER.members()})
        return real_get(self, *args, **kwargs)

    r = ParquetReader(data.config(prefetch=1, batch_size=4), make_schema())
    priority.enable(True)
    try:
        it = iter(r)
        next(it)
        priority.READER.lower()
        monkeypatch.setattr(queue.Queue, "get_nowait", lambda self: (_ for _ in ()).throw(queue.Empty()))
        monkeypatch.setattr(queue.Queue, "get", get)
        next(it)
        monkeypatch.undo()
        assert seen and all(policies and set(policies.values()) == {os.SCHED_OTHER} for policies in seen)
        assert priority.READER.low
        assert {policy_of(t) for t in priority.READER.members()} == {os.SCHED_IDLE}
    finally:
        priority.enable(False)
        r.close()


def _train_watching(data, run_dir, *extra) -> tuple[list[dict[str, int]], list[int]]:
    """Train; return the background threads' policies at each forward (by thread name) and
    the store worker's own policy as each push starts its work."""
    from test_train import build

    from recsys.store.sharded.store import ShardedEmbeddingStore

    in_forward, in_push = [], []
    real_push = ShardedEmbeddingStore._do_push

    def watched_push(self, *args, **kwargs):
        in_push.append(policy_of(threading.current_thread()))
        return real_push(self, *args, **kwargs)

    # patched before the store is built: the store hands its schedule its bound work
    ShardedEmbeddingStore._do_push = watched_push
    try:
        trainer = build(data, run_dir, *extra)
    finally:
        ShardedEmbeddingStore._do_push = real_push
    forward = trainer.ddp.forward

    def watched_forward(*args, **kwargs):
        in_forward.append({t.name: policy_of(t) for t in priority.STORE.members() + priority.READER.members()})
        return forward(*args, **kwargs)

    trainer.ddp.forward = watched_forward
    try:
        trainer.train()
    finally:
        trainer.close()
    return in_forward, in_push


def test_training_lowers_the_store_and_reader_only_for_the_dense_phase(tiny_data, tmp_path, quiet_host):
    """During the forward the store's worker and the reader's threads are under SCHED_IDLE;
    the push raises the store's worker before its work starts (the next lookup waits for
    it); after the run both groups are back under the normal policy."""
    in_forward, in_push = _train_watching(tiny_data, tmp_path / "run", "train.max_steps=6")
    assert len(in_forward) > 6 and len(in_push) == 6  # 6 steps, then the final evaluation's batches
    for policies in in_forward[:6]:
        assert "store-worker" in policies and any(n.startswith("recsys-reader-") for n in policies)
        assert set(policies.values()) == {os.SCHED_IDLE}
    for policies in in_forward[6:]:  # an evaluation waits for both throughout
        assert set(policies.values()) == {os.SCHED_OTHER}
    assert set(in_push) == {os.SCHED_OTHER}
    assert not priority.STORE.enabled and not priority.STORE.low and not priority.READER.low


def test_training_without_idle_background_never_lowers(tiny_data, tmp_path, quiet_host):
    in_forward, _ = _train_watching(tiny_data, tmp_path / "run", "train.max_steps=3", "train.runtime.idle_background=false")
    assert len(in_forward) > 3 and {p for seen in in_forward for p in seen.values()} == {os.SCHED_OTHER}


def test_training_on_a_busy_host_does_not_lower(tiny_data, tmp_path, monkeypatch):
    """Other processes busy on every core: lowering would push the background work into
    the step's waits, so the trainer leaves both groups under the normal policy."""
    ticks = iter(range(10**6))  # one (fake) second per check
    host = iter(range(0, 10**6, 2))  # and two cores' worth of other work in it
    busy = priority.LoadWatch(interval_s=0.5, host_cpu_s=lambda: float(next(host)), own_cpu_s=lambda: 0.0,
                              clock=lambda: float(next(ticks)))
    monkeypatch.setattr(priority, "WATCH", busy)
    in_forward, _ = _train_watching(tiny_data, tmp_path / "run", "train.max_steps=4")
    assert busy.busy and busy.others_cores == pytest.approx(2.0)
    # before the first full interval the host counts as quiet
    assert set(in_forward[0].values()) == {os.SCHED_IDLE}
    assert {p for seen in in_forward[1:4] for p in seen.values()} == {os.SCHED_OTHER}


def test_load_watch_hysteresis():
    t, host, own = [0.0], [0.0], [0.0]
    w = priority.LoadWatch(interval_s=1.0, busy_above=0.5, quiet_below=0.25,
                           host_cpu_s=lambda: host[0], own_cpu_s=lambda: own[0], clock=lambda: t[0])

    def second(others: float, ours: float = 1.5) -> bool:
        t[0] += 1.0
        own[0] += ours
        host[0] += ours + others
        return w.others_busy()

    assert not w.others_busy()  # no interval yet
    assert not second(0.4)  # below busy_above
    assert second(0.6)
    assert w.others_cores == pytest.approx(0.6)
    assert second(0.3)  # still above quiet_below
    assert not second(0.2)
    t[0] += 0.5
    host[0] += 5.0  # within the interval: not sampled
    assert not w.others_busy()


def test_load_watch_sees_a_busy_process():
    """The real counters: a child process spinning for a while counts as other load."""
    import subprocess
    import time

    w = priority.LoadWatch(interval_s=0.0)
    w.others_busy()
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"])
    try:
        time.sleep(1.0)
        assert w.others_busy(), w.others_cores
        assert w.others_cores > 0.5
    finally:
        child.wait()
