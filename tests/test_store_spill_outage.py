"""Redis outages under the spill tier: ``store.spill.outage = "fail"`` (one clear error, nothing
lost, bit-exact after Redis returns) and ``"hold"`` (training goes on, evicted rows held in
memory until Redis returns), against a real redis-server stopped and restarted mid-run.

Legend: ``D`` dim. "Persistent" Redis: appendonly, so a restart keeps what was written
(an outage); without persistence a restart loses the rows (reported, never re-initialized).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from conftest import wait_until
from recsys.testing.harness import RedisServer, start_redis
from recsys.features.schema import FeatureSpec, Schema, TableSpec
from recsys.store.config import SpillConfig, StoreConfig
from recsys.store.sharded.store import ShardedEmbeddingStore
from recsys.store.spill.tier import SpillError
from recsys.store.tables.table import EmbeddingTable

pytestmark = pytest.mark.redis

D = 4


@pytest.fixture
def persistent_redis(tmp_path):
    """A redis-server with an append-only file: stopping and restarting it loses nothing."""
    server = start_redis(tmp_path / "redis-aof", "--appendonly", "yes", "--appendfsync", "always")
    yield server
    server.stop()


def cfg_for(url: str = "", spill: dict | None = None) -> StoreConfig:
    """The tests' store settings; ``spill``: keys of ``[store.spill]`` over the tests' own."""
    tier = SpillConfig(**{"url": url, "namespace": "outage", "retries": 2, "backoff_s": 0.01, "timeout_s": 1.0,
                          **(spill or {})})
    return StoreConfig(optimizer="adam", lr=0.05, spill=tier)


def grads_for(keys: np.ndarray, rows: np.ndarray, step: int) -> np.ndarray:
    phase = (keys.astype(np.float64) % 97)[:, None] + np.arange(rows.shape[1]) + step
    return (0.5 * rows + np.sin(phase)).astype(np.float32)


class Pair:
    """A spilling table and an unbounded reference trained on the same keys, compared per step."""

    def __init__(self, url: str, capacity: int = 4, **spill) -> None:
        """``spill``: keys of ``[store.spill]``."""
        self.t = EmbeddingTable("user", TableSpec(dim=D, capacity=capacity), cfg_for(url, spill))
        self.ref = EmbeddingTable("user", TableSpec(dim=D, capacity=1000), cfg_for(spill=spill))
        self.step = 0

    def train(self, keys) -> None:
        keys = np.asarray(keys, dtype=np.int64)
        got = self.t.lookup(keys, self.step)
        want = self.ref.lookup(keys, self.step)
        assert got.tobytes() == want.tobytes(), f"step {self.step}: a row differs from the reference"
        self.t.apply_gradients(keys, grads_for(keys, got, self.step), self.step)
        self.ref.apply_gradients(keys, grads_for(keys, want, self.step), self.step)
        self.step += 1

    def assert_same_state(self) -> None:
        assert self.t.state_dict().equals(self.ref.state_dict())

    def close(self) -> None:
        try:
            self.t.close()
        except SpillError:
            pass


def restart_later(server: RedisServer, delay: float) -> threading.Thread:
    th = threading.Thread(target=lambda: (time.sleep(delay), server.restart()), daemon=True)
    th.start()
    return th


# --------------------------------------------------------------------------- hold


def test_hold_trains_through_an_outage_and_loses_no_row(persistent_redis):
    p = Pair(persistent_redis.url, outage="hold", hold_timeout_s=60)
    try:
        for keys in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]):  # 1-8 spilled to Redis
            p.train(keys)
        p.t.flush()
        assert p.t.counters()["spill_stored"] == 8
        persistent_redis.stop()
        # new keys and rows in memory need no Redis: training goes on, evicted rows are held
        for keys in ([9, 13, 14], [15, 16, 17, 18], [19, 20, 9, 10]):
            p.train(keys)
        wait_until(lambda: p.t.spill.in_outage, 30, "the writer to notice the outage")
        c = p.t.counters()
        assert c["spill_outages"] == 1
        assert c["spill_pending"] >= 8  # evicted during the outage, held in memory
        p.train([13, 15])  # rows evicted during the outage come back from memory
        assert p.t.counters()["spill_buffer_hits"] >= 2
        # a row that is only in Redis: the lookup waits for Redis, then gets it bit-exact
        th = restart_later(persistent_redis, 1.0)
        t0 = time.monotonic()
        p.train([1, 2])
        waited = time.monotonic() - t0
        th.join()
        assert waited >= 0.5, "the read of a spilled row did not wait for Redis"
        for keys in ([3, 4, 5, 6], [7, 8, 21, 22], [1, 13, 17, 20]):
            p.train(keys)
        p.t.flush()
        assert not p.t.spill.in_outage and p.t.counters()["spill_pending"] == 0
        p.assert_same_state()  # every row, spilled or held, equals the never-evicting table's
    finally:
        p.close()


def test_hold_gives_up_after_hold_timeout_s_keeping_the_rows(persistent_redis):
    p = Pair(persistent_redis.url, outage="hold", hold_timeout_s=1.0)
    try:
        p.train([1, 2, 3, 4])
        p.train([5, 6, 7, 8])  # 1-4 spilled
        p.t.flush()
        persistent_redis.stop()
        p.train([9, 10, 11, 12])  # 5-8 evicted: held
        held = p.t.counters()["spill_pending"]
        assert held == 4
        inserts = p.t.counters()["inserts"]
        t0 = time.monotonic()
        with pytest.raises(SpillError) as err:
            p.t.lookup(np.array([1]), p.step)  # only in Redis
        assert 0.9 <= time.monotonic() - t0 < 30
        msg = str(err.value)
        assert "\n" not in msg
        for part in ("'user'", persistent_redis.url, "store.spill.hold_timeout_s", "No row was re-initialized",
                     "still held"):
            assert part in msg, part
        assert p.t.counters()["inserts"] == inserts  # the failed call initialized nothing
        found, block = p.t.spill.fetch(np.array([5, 6, 7, 8]), count=False)  # held rows: still served
        assert found.all()
        persistent_redis.restart()
        p.step += 1  # the failed lookup's step is skipped by both tables
        p.train([1, 5, 9, 13])
        p.t.flush()
        p.assert_same_state()
    finally:
        p.close()


def test_hold_refuses_more_held_rows_than_hold_max_rows(persistent_redis):
    p = Pair(persistent_redis.url, capacity=2, outage="hold", batch_rows=1, queue_rows=2,
             hold_max_rows=3)
    try:
        p.train([1, 2])
        persistent_redis.stop()
        p.train([3, 4])  # 1, 2 held
        with pytest.raises(SpillError, match=r"4 evicted rows .*store.spill.hold_max_rows \(3\)"):
            p.t.lookup(np.array([5, 6]), p.step)  # 3, 4 evicted: 4 held
        # nothing lost: the rows that raised are held too, and written once Redis is back
        persistent_redis.restart()
        wait_until(lambda: p.t.counters()["spill_pending"] == 0, 30, "the held rows to be written")
        p.ref.lookup(np.array([5, 6]), p.step)  # the reference makes the same (completed) lookup
        p.ref.apply_gradients(np.array([5, 6]), np.zeros((2, D), np.float32), p.step)
        p.t.apply_gradients(np.array([5, 6]), np.zeros((2, D), np.float32), p.step)
        p.step += 1
        p.train([1, 2])
        p.t.flush()
        p.assert_same_state()
    finally:
        p.close()


# --------------------------------------------------------------------------- fail


def test_fail_raises_one_line_then_resumes_bit_exact_after_redis_returns(persistent_redis):
    p = Pair(persistent_redis.url, outage="fail")
    try:
        for keys in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]):
            p.train(keys)
        p.t.flush()
        persistent_redis.stop()
        p.train([13, 9])  # a new key and a held row: no Redis needed, the eviction is buffered
        inserts = p.t.counters()["inserts"]
        with pytest.raises(SpillError) as err:
            p.t.lookup(np.array([1, 2]), p.step)
        msg = str(err.value)
        assert "\n" not in msg and persistent_redis.url in msg and "attempt(s)" in msg
        assert "store.spill.outage = 'hold'" in msg
        assert p.t.counters()["inserts"] == inserts
        persistent_redis.restart()

        def flushed() -> bool:  # the failed write of the eviction surfaces once, then the writer retries
            try:
                p.t.flush()
            except SpillError:
                return False
            return True

        wait_until(flushed, 30, "the buffered eviction to be written after the restart")
        p.train([1, 2])  # the same lookup again: the rows come back bit-exact
        p.train([3, 4, 13, 14])
        p.t.flush()
        p.assert_same_state()
    finally:
        p.close()


@pytest.mark.parametrize("mode", ["fail", "hold"])
def test_a_redis_that_lost_the_rows_is_an_error_never_a_reinitialization(redis_server, mode):
    """A restart without persistence loses spilled rows: the tier knows which it wrote."""
    p = Pair(redis_server.url, outage=mode)
    try:
        p.train([1, 2, 3, 4])
        p.train([5, 6, 7, 8])
        p.t.flush()
        redis_server.restart()  # comes back empty
        inserts = p.t.counters()["inserts"]
        with pytest.raises(SpillError) as err:
            p.t.lookup(np.array([1, 9]), p.step)
        msg = str(err.value)
        for part in ("'user'", "1 spilled row(s) are missing", redis_server.url, "outage:spill:user:",
                     "No row was re-initialized", "appendonly"):
            assert part in msg, part
        assert p.t.counters()["inserts"] == inserts
        with pytest.raises(SpillError, match="missing"):  # a checkpoint cannot be taken either
            p.t.state_dict()
    finally:
        p.close()


# --------------------------------------------------------------------------- the store


def test_store_error_names_the_run_and_its_checkpoint(redis_server, tmp_path):
    """A store of a run adds which checkpoint is intact (here: none yet) to the one line."""
    schema = Schema(dense=["d"], tables={"user": TableSpec(dim=D, capacity=2)}, sparse=[FeatureSpec(name="user")])
    store = ShardedEmbeddingStore(schema, cfg_for(redis_server.url, spill=dict(namespace="")), run_dir=tmp_path / "run",
                                  job_name="j", threaded=True)
    try:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
        import torch

        def kjt(ids):
            return KeyedJaggedTensor(keys=["user"], values=torch.tensor(ids), lengths=torch.ones(len(ids), dtype=torch.int32))

        for step, ids in enumerate(([1, 2], [3, 4])):
            store.push(store.lookup(kjt(ids), step))
        store.flush()
        store.tables["user"].flush()
        redis_server.stop()
        with pytest.raises(SpillError) as err:
            store.lookup(kjt([1, 2]), 2)
        msg = str(err.value)
        assert "\n" not in msg and redis_server.url in msg
        assert f"No checkpoint of the run {tmp_path / 'run'} was written yet" in msg
    finally:
        store.close()  # after the failure: no wait for the unreachable Redis, no second error


# --------------------------------------------------------------------------- a training job

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import test_train as tt  # noqa: E402  (the tiny job's helpers)

STEPS = 10
# tables of the tiny job made small enough to spill (a batch of 256 rows fits, the vocabulary does not)
SMALL = [f"schema.tables.{t}.capacity={300 if t[0] == 'c' else 1000}"
         for t in ("c3", "c4", "c7", "c10", "c12", "c15", "c16", "c21", "c24", "c26", "m1", "m2")]


def job_args(url: str, *extra: str) -> list[str]:
    return [f"store.spill.url='{url}'", "store.spill.retries=2", "store.spill.backoff_s=0.02",
            "store.spill.timeout_s=1.0", f"train.max_steps={STEPS}", *SMALL, *extra]


def spill_totals(store) -> dict[str, int]:
    out: dict[str, int] = {}
    for counters in store.counters().values():
        for k, v in counters.items():
            if k.startswith(("spill_", "evictions")):
                out[k] = out.get(k, 0) + v
    return out


@pytest.fixture(scope="module")
def reference_run(tiny_data, tmp_path_factory):
    """The uninterrupted run: final rows and losses of the spilling job (its own Redis and namespace)."""
    tmp = tmp_path_factory.mktemp("spill_reference")
    server = start_redis(tmp / "redis")
    try:
        trainer = tt.build(tiny_data, tmp / "run", *job_args(server.url))
        try:
            trainer.train()
            totals = spill_totals(trainer.store)
        finally:
            trainer.close()
    finally:
        server.stop()
    assert totals["evictions"] > 1000 and totals["spill_hits"] > 100, totals  # it really spills
    return tt.final_rows(tmp / "run"), tt.losses(tmp / "run")


def assert_rows_equal(got, want) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].keys() == want[name].keys(), f"table {name}: other keys"
        for k, v in want[name].items():
            assert got[name][k].tobytes() == v.tobytes(), f"table {name}, key {k}"


# ``python -m recsys.train`` whose first checkpoint save, once written, waits for the file
# ``argv[2]`` (after writing ``argv[1]``): the test stops Redis while the job has its first
# checkpoint and steps left to train, however fast or slow the host
PAUSED_AFTER_FIRST_CHECKPOINT = """
import sys, time
from pathlib import Path
from recsys.checkpoint import write
from recsys.train.__main__ import main

saved, go = Path(sys.argv[1]), Path(sys.argv[2])
save = write.save

def save_then_wait(*args, **kwargs):
    path = save(*args, **kwargs)
    if not saved.exists():
        saved.write_text(str(path))
        deadline = time.monotonic() + 180
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    return path

write.save = save_then_wait
sys.exit(main(sys.argv[3:]))
"""


def test_training_job_fails_in_one_line_and_resumes_exactly_from_the_intact_checkpoint(
        tiny_data, tmp_path, reference_run):
    """store.spill.outage = "fail": Redis stopped mid-run; the job retries, then exits 2 with one
    line (which Redis, what failed, which checkpoint is intact); the checkpoint loads, and a
    resume after Redis returns (empty: no persistence) ends with the uninterrupted rows."""
    server = start_redis(tmp_path / "redis")
    run_dir = tmp_path / "run"
    saved, go = tmp_path / "first-checkpoint", tmp_path / "go"
    cmd = [sys.executable, "-c", PAUSED_AFTER_FIRST_CHECKPOINT, str(saved), str(go),
           "--config", str(tt.JOB), "--run-dir", str(run_dir)]
    for o in tt.overrides(tiny_data, *job_args(server.url, "train.checkpoint.every_steps=2")):
        cmd += ["--set", o]
    proc = subprocess.Popen(cmd, cwd=tt.ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    from recsys.checkpoint import read as checkpoint_files

    try:
        wait_until(lambda: saved.exists() or proc.poll() is not None, 180, "the first checkpoint")
        assert proc.poll() is None, "the job ended before its first checkpoint"
        server.stop()
        stopped = time.monotonic()
        go.touch()  # the job goes on from its first checkpoint, Redis gone
        out, err = proc.communicate(timeout=180)
        exit_s = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
        server.stop()
    assert proc.returncode == 2, out[-2000:] + err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("recsys train:")]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    line = errors[0]
    latest = checkpoint_files.latest(run_dir / "checkpoints")
    step = checkpoint_files.load_meta(latest)["step"]
    assert 2 <= step < STEPS
    for part in ("spill tier of table", server.url, "failed after 3 attempt(s)",
                 f"The latest complete checkpoint, {latest} (step {step}), is intact", f"--run-dir {run_dir}"):
        assert part in line, (part, line)
    # the checkpoint named is complete and loads: its rows include every spilled one
    assert checkpoint_files.incomplete(latest) is None
    sparse = checkpoint_files.load_sparse(latest)
    assert sum(t.num_rows for t in sparse.values()) > 0
    # Redis comes back (empty); the same run directory resumes from that checkpoint
    server.restart()
    try:
        tt.run(tiny_data, run_dir, *job_args(server.url))
    finally:
        server.stop()
    want_rows, want_losses = reference_run
    got_losses = tt.losses(run_dir)
    assert [s for s in got_losses if s > step] == list(range(step + 1, STEPS + 1))
    for s in range(step + 1, STEPS + 1):
        assert got_losses[s] == want_losses[s], f"step {s}"
    assert_rows_equal(tt.final_rows(run_dir), want_rows)
    print(json.dumps({"redis_stop_to_exit_s": round(exit_s, 2), "checkpoint_step": step}))


class OutageSource:
    """The job's reader, stopping Redis when batch ``stop_at`` is fetched and restarting it
    ``outage_s`` later from another thread (training goes on meanwhile)."""

    def __init__(self, reader, server: RedisServer, stop_at: int, outage_s: float) -> None:
        self.reader, self.server, self.stop_at, self.outage_s = reader, server, stop_at, outage_s
        self.fetched = 0
        self.fetched_while_down = 0
        self.down = False
        self.restarter: threading.Thread | None = None

    def __iter__(self):
        for batch in self.reader:
            self.fetched += 1
            if self.fetched == self.stop_at:
                self.server.stop()
                self.down = True
                self.restarter = threading.Thread(target=self._restart, daemon=True)
                self.restarter.start()
            elif self.down:
                self.fetched_while_down += 1
            yield batch

    def _restart(self) -> None:
        time.sleep(self.outage_s)
        self.server.restart()
        self.down = False

    def __getattr__(self, name):
        return getattr(self.reader, name)

    @staticmethod
    def merge_states(states):
        from recsys.io.reader import ParquetReader

        return ParquetReader.merge_states(states)


def test_training_job_holds_through_an_outage_and_ends_with_the_uninterrupted_rows(
        tiny_data, tmp_path, reference_run):
    """store.spill.outage = "hold": Redis stopped at step 4 for 3 s; the job goes on (reads of rows
    only in Redis wait for it), finishes, and its rows and losses equal the uninterrupted run's."""
    from recsys.config import load_job
    from recsys.io.reader import ParquetReader

    server = start_redis(tmp_path / "redis", "--appendonly", "yes", "--appendfsync", "always")
    extra = job_args(server.url, "store.spill.outage='hold'", "store.spill.hold_timeout_s=120")
    job = load_job(tt.JOB, tt.overrides(tiny_data, *extra))
    source = OutageSource(ParquetReader(job.data.train, job.schema), server, stop_at=4, outage_s=3.0)
    try:
        trainer = tt.build(tiny_data, tmp_path / "run", *extra, source=source)
        try:
            result = trainer.train()
            totals = spill_totals(trainer.store)
        finally:
            trainer.close()
        source.restarter.join(timeout=30)
    finally:
        server.stop()
    assert result["step"] == STEPS
    assert totals["spill_outages"] >= 1 and totals["spill_errors"] > 0, totals
    want_rows, want_losses = reference_run
    assert tt.losses(tmp_path / "run") == want_losses
    assert_rows_equal(tt.final_rows(tmp_path / "run"), want_rows)
    print(json.dumps({"batches_fetched_while_redis_was_down": source.fetched_while_down, **totals}))
