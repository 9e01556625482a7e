"""``recsys bench live``: live pushes (``[publish]``) measured for real — freshness and cost.

One run, on this machine, with a real ``redis-server`` (no persistence):

**Freshness**, at ``every_s`` = 1 and 5: a version is published (``recsys export`` of a
one-step checkpoint), ``recsys serve --redis --follow NS`` serves it with the live rows
overlaid (its default live-row TTL), and a training job (in this process, ``publish.every_s``
set) trains while a prober thread asks the service for a fixed set of raw ids (drawn from
the training rows, so frequent ids are drawn more often), one id per request, round robin.
The trainer's store records, for every applied push, when it was applied and which probe
keys it updated. A probe sees a key change when the ``live@<step>`` its response names goes
up; the figure is the time from the *first* optimizer step that changed the key after the
row served before (the change that waited longest) to that response, over all changes seen
after a settling period. It includes everything a ranker sees: the push interval, the
snapshot, the Redis write, the service's TTL and refresh, and half a probe cycle on
average (the cycle time is reported).

**Cost**: the same job with live pushes (``every_s`` = 1, then 5) and without, run alternately as
``recsys train`` processes (order swapped each pair), samples/s from their
``metrics.jsonl`` windows after a warm-up window; the ratio on/off per pair, its median
and min–max. Redis runs on the same machine, so its CPU (reported per run, CPU seconds per
second) is part of the cost here; it would not be with Redis on its own host. The same
pairs run a second time against a Redis at nice 19, standing in for one on its own host:
it takes only CPU the job leaves idle, so those ratios show the trainer's own cost of
pushing. A starved Redis answers later, so snapshots may coalesce more: each "on" run
reports the rows it wrote and the snapshots it coalesced, to compare the two. A third set
of pairs runs both sides with ``OMP_WAIT_POLICY=PASSIVE``: torch's OpenMP workers then
sleep when idle instead of spinning, so the push thread's and Redis's CPU no longer stalls
a spinning 2-thread team on this 2-core host; the difference between the first and the
third sets is that amplification, not the pushes' own work.

Data: the bench train data (quick: the 160 k-row set; full: the ``small`` set). No
assertions on timings.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from recsys.bench import comparison

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "jobs" / "synthetic_small.toml"
FEATURE = "c1"  # an int64 feature of the job (its raw ids are the probe's)
NICED_REDIS = 19  # the nice value of the Redis that stands in for one on its own host


def _job_sets(root: Path, batch: int, *extra: str) -> list[str]:
    return [f"data.train.paths=['{root / 'train'}']", f"data.eval.paths=['{root / 'eval'}']",
            f"data.train.batch_size={batch}", "data.eval.batch_size=8192", "train.progress='none'",
            "train.checkpoint.every_steps=0", "train.eval.every=0", "train.runtime.threads=2", *extra]


def _probe_ids(root: Path, n: int, seed: int = 0) -> np.ndarray:
    """``n`` distinct raw ids of FEATURE drawn from the training rows (frequent ids more often)."""
    import pyarrow.parquet as pq

    first = sorted((root / "train").glob("*.parquet"))[0]
    ids = pq.read_table(first, columns=[FEATURE]).column(FEATURE).to_numpy()
    rng = np.random.default_rng(seed)
    out: list[int] = []
    for i in rng.permutation(ids.shape[0]):
        v = int(ids[i])
        if v not in out:
            out.append(v)
        if len(out) == n:
            break
    return np.array(out, dtype=np.int64)


class Prober(threading.Thread):
    """Asks the service for each probe id in turn; records (time, id index, live step) when
    the live step it names for an id changes."""

    def __init__(self, url: str, ids: np.ndarray) -> None:
        super().__init__(daemon=True)
        host, port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=10)
        self.ids = ids
        self.seen: dict[int, int] = {}
        self.changes: list[tuple[float, int, int, int]] = []  # (time, id index, previous step, step)
        self.requests = 0
        self.stop = threading.Event()
        self.started = time.monotonic()
        self.errors = 0

    def _step(self, raw: int) -> int:
        body = json.dumps({"feature": FEATURE, "ids": [raw]})
        self.conn.request("POST", "/v1/lookup", body, {"Content-Type": "application/json"})
        reply = json.loads(self.conn.getresponse().read())
        self.requests += 1
        version = reply.get("version", "")
        return int(version.rsplit("live@", 1)[1]) if "+live@" in version else -1

    def run(self) -> None:
        while not self.stop.is_set():
            for i, raw in enumerate(self.ids.tolist()):
                try:
                    step = self._step(raw)
                except (OSError, http.client.HTTPException, ValueError):
                    self.errors += 1
                    self.conn.close()
                    time.sleep(0.05)
                    continue
                t = time.monotonic()
                before = self.seen.get(i, -1)
                if step > before:
                    self.changes.append((t, i, before, step))
                    self.seen[i] = step


def _freshness(root: Path, work: Path, url: str, every_s: float, duration_s: float, batch: int,
               probes: int) -> dict:
    from embedding_server import export as publish
    from recsys.features import hashing
    from recsys.testing.harness import start_service, stop_process
    from recsys.config import load_job
    from recsys.train.loop import Trainer, setup_env

    ns = f"live-{every_s:g}".replace(".", "_")
    # a published version to overlay: a one-step run, exported
    env = setup_env("cpu")
    first = Trainer(load_job(JOB, _job_sets(root, batch, "train.max_steps=1")), work / f"published-{ns}", env)
    try:
        first.train()
    finally:
        first.close()
    publish.export(work / f"published-{ns}", url,
                   publish.ExportSettings(namespace=f"pub-{ns}"), progress=False)

    job = load_job(JOB, _job_sets(root, batch, "train.epochs=100", "train.log_every=50",
                                  f"publish.redis='{url}'", f"publish.every_s={every_s}",
                                  f"publish.namespace='{ns}'", "publish.takeover=true"))
    service, http_url = start_service(["--redis", url, "--namespace", f"pub-{ns}", "--follow", ns,
                                       "--workers", "1"], work / f"serve-{ns}.log")
    ids = _probe_ids(root, probes)
    table = next(f.table for f in job.schema.sparse if f.name == FEATURE)
    keys = hashing.hash_int64(ids, table)  # the reader's key of each raw id (the table is not fixed-size)
    index = {int(k): i for i, k in enumerate(keys.tolist())}
    applied: dict[int, float] = {}
    updates: dict[int, list[int]] = {i: [] for i in range(len(ids))}
    trainer = Trainer(job, work / f"live-{ns}", env)
    pub = trainer.store.publisher
    forward = pub.after_push

    def after_push(step, parts):  # on the store's op sequence, in step order
        applied[step] = time.monotonic()
        for name, k in parts:
            if name == table and k.shape[0]:
                for key in np.intersect1d(k, keys, assume_unique=False).tolist():
                    updates[index[int(key)]].append(step)
        forward(step, parts)

    pub.after_push = after_push
    prober = Prober(http_url, ids)

    def stop_later():
        time.sleep(duration_s)
        os.kill(os.getpid(), signal.SIGTERM)  # the trainer checkpoints and returns

    prober.start()
    threading.Thread(target=stop_later, daemon=True).start()
    t0 = time.monotonic()
    try:
        result = trainer.train()
    finally:
        prober.stop.set()
        prober.join(timeout=30)
        trainer.close()
        stop_process(service)
    settle = t0 + 2 * every_s + 3.0  # the service sees the live manifest within its refresh
    samples = []
    for t, i, before, step in prober.changes:
        if before < 0 or t < settle:
            continue
        changed = [u for u in updates[i] if before < u <= step]
        if changed:
            samples.append(t - applied[changed[0]])
    cycle = (time.monotonic() - prober.started) / max(1, prober.requests) * len(ids)
    out = {"every_s": every_s, "live_ttl_s": 1.0, "refresh_s": 1.0, "probe_ids": len(ids),
           "probe_cycle_s": round(cycle, 4), "changes_seen": len(samples), "probe_errors": prober.errors,
           "steps": result.get("step"), "duration_s": duration_s}
    if samples:
        q = np.percentile(samples, [50, 99])
        out.update(p50_s=round(float(q[0]), 3), p99_s=round(float(q[1]), 3), max_s=round(max(samples), 3))
    return out


def _throughput(metrics: Path, skip_steps: int, batch: int) -> float:
    """Samples/s over the windows of ``metrics.jsonl`` after ``skip_steps`` (``batch`` rows per step)."""
    rows = seconds = 0.0
    last = None
    for line in metrics.read_text().splitlines():
        r = json.loads(line)
        if "throughput/samples_per_s" not in r:
            continue
        if last is not None and r["step"] > skip_steps and r["throughput/samples_per_s"] > 0:
            n = (r["step"] - last) * batch
            rows += n
            seconds += n / r["throughput/samples_per_s"]
        last = r["step"]
    return rows / seconds if seconds else float("nan")


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cost(root: Path, work: Path, url: str, pairs: int, steps: int, batch: int, window: int,
          redis_pid: int, every_s: float = 1.0, redis_nice: int = 0, omp_passive: bool = False) -> dict:
    from recsys.testing.harness import records

    runs: dict[str, list[float]] = {"on": [], "off": []}
    redis_cpu: dict[str, list[float]] = {"on": [], "off": []}  # Redis CPU s per wall s of each run
    pushed = []  # per "on" run: rows written, snapshots coalesced
    for p in range(pairs):
        for side in (("on", "off") if p % 2 == 0 else ("off", "on")):
            run_dir = work / f"cost-{every_s:g}-nice{redis_nice}{'-passive' if omp_passive else ''}-{side}-{p}"
            extra = [f"publish.redis='{url}'", f"publish.every_s={every_s}", "publish.namespace='live-cost'",
                     "publish.takeover=true"] if side == "on" else []
            cmd = [sys.executable, "-m", "recsys.cli", "train", "--config", str(JOB), "--run-dir", str(run_dir)]
            for o in _job_sets(root, batch, f"train.max_steps={steps}", f"train.log_every={window}",
                               "train.schedule.warmup_steps=0", *extra):
                cmd += ["--set", o]
            cpu0, t0 = _cpu_s(redis_pid), time.monotonic()
            env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"} if omp_passive else None
            out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
            redis_cpu[side].append(round((_cpu_s(redis_pid) - cpu0) / (time.monotonic() - t0), 4))
            if out.returncode:
                raise RuntimeError(f"the {side} run failed:\n{out.stderr[-3000:]}")
            runs[side].append(_throughput(run_dir / "metrics.jsonl", window, batch))
            if side == "on":
                event = next((r for r in records(run_dir) if r.get("event") == "publish"), {})
                pushed.append({k: event.get(k) for k in ("rows", "pushes", "coalesced", "errors", "rows_plain",
                                                         "rows_guarded", "snapshot_ms")})
    ratios = [a / b for a, b in zip(runs["on"], runs["off"])]
    return {"every_s": every_s, "redis_nice": redis_nice, "omp_wait_policy": "PASSIVE" if omp_passive else "default",
            "samples_per_s": runs, "redis_cpu_per_s": redis_cpu,
            "pushed": pushed, "ratios": [round(r, 4) for r in ratios],
            "median_ratio": round(statistics.median(ratios), 4), "min_ratio": round(min(ratios), 4),
            "max_ratio": round(max(ratios), 4), "pairs": pairs, "steps": steps, "batch_size": batch,
            "window_steps": window}


def measure(quick: bool, data: Path | None) -> dict:
    from recsys.bench.train import ensure_data
    from recsys.testing.harness import start_redis

    root = ensure_data(quick, data)
    work = Path(tempfile.mkdtemp(prefix="recsys-bench-live-"))
    server = start_redis(work)
    url = server.url
    servers = [server]
    try:
        # the same Redis at nice 19 stands in for one on its own host: it gets only the CPU
        # the job leaves idle (the job's throughput then shows the trainer's own cost of pushing)
        (work / "niced").mkdir()
        niced = start_redis(work / "niced", nice=NICED_REDIS)
        niced_url = niced.url
        servers.append(niced)
        batch = 1024 if quick else 4096
        shape = dict(pairs=3 if quick else 5, steps=400 if quick else 420, batch=batch, window=25 if quick else 60)
        cost = [_cost(root, work, url, redis_pid=server.proc.pid, every_s=every_s, **shape)
                for every_s in (1.0, 5.0)]
        cost += [_cost(root, work, niced_url, redis_pid=niced.proc.pid, every_s=every_s, redis_nice=NICED_REDIS,
                       **shape)
                 for every_s in (1.0, 5.0)]
        # both sides with OpenMP workers that sleep when idle instead of spinning: what the
        # pushes cost when their CPU is not amplified by stalling a spinning 2-thread team
        cost += [_cost(root, work, url, redis_pid=server.proc.pid, every_s=every_s, omp_passive=True, **shape)
                 for every_s in (1.0, 5.0)]
        fresh = [_freshness(root, work, url, every_s, duration_s=(25.0 if quick else 60.0) + 4 * every_s,
                            batch=batch, probes=16) for every_s in (1.0, 5.0)]
    finally:
        for each in servers:
            each.proc.kill()
            each.proc.wait()
    comparisons = [comparison(f"training samples/s, live pushes on (every_s = {c['every_s']:g}) vs off"
                              + (f", Redis at nice {c['redis_nice']}" if c["redis_nice"] else "")
                              + (", OMP_WAIT_POLICY=PASSIVE" if c["omp_wait_policy"] == "PASSIVE" else ""),
                              statistics.median(c["samples_per_s"]["on"]), statistics.median(c["samples_per_s"]["off"]),
                              "samples/s", median_paired_ratio=c["median_ratio"],
                              spread=[c["min_ratio"], c["max_ratio"]]) for c in cost]
    return {"comparisons": comparisons, "cost": cost, "freshness": fresh, "data": str(root), "work": str(work)}
