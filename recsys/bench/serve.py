"""``recsys bench serve``: the lookup service against raw Redis MGETs of the same rows.

One run, side by side, on this machine:

1. a real ``redis-server`` on a free loopback port (no persistence);
2. a checkpoint of one table, ``rows`` x 64 float32 (1 M rows; quick: 100 k), written by the
   store's own ``state_dict`` and ``recsys.checkpoint.write.save``;
3. ``recsys export`` of it (rows/s, Redis bytes per row);
4. the load generator (``recsys.bench.serve_load``, its own process) sends the same
   request sequence — Zipf ids, 256 per request, ``concurrency`` connections — to
   (a) ``recsys serve --redis --workers 2`` (binary responses; JSON, 1 worker and
       ``--no-fast-path``, every lookup through the full app, too, as figures),
   (b) ``recsys serve --checkpoint --workers 2`` (the embedded default),
   (c) raw redis-py MGETs of the same rows' keys (the limit);
   closed loop for the maximum throughput, then open loop at half of it for p50/p99.

Each target first gets one untimed warm-up pass (its figure is kept as the cold-cache
one), as a running service would be warm: every pass draws from one popularity order
(``serve_load.POPULARITY_SEED``), so the ids hot in the warm-up stay hot in the rounds.
Every figure is a median over ``repeats`` rounds (targets interleaved within each round,
so drift on a shared machine hits all of them alike), with the spread (min, max).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from recsys.bench import comparison, paired_ratio
from recsys.testing.harness import start_redis, start_service, stop_process

DIM = 64
TABLE = "item"
IDS_PER_REQUEST = 256
ZIPF = 1.05
WORKERS = 2  # one per core: the service and the embedded mode as deployed here (1 worker: a figure too)


def _write_checkpoint(root: Path, rows: int) -> Path:
    """Return a checkpoint of one ``rows`` x DIM table of trained-looking rows (the store's format)."""
    from recsys import config as config_mod
    from recsys.features import hashing
    from recsys.features.schema import TableSpec
    from recsys.store.config import StoreConfig
    from recsys.store.tables.table import EmbeddingTable
    from recsys.checkpoint import write as ckpt

    job = config_mod.from_dict(config_mod.JobConfig, {
        "name": "bench_serve",
        "schema": {"label": "label", "tables": {TABLE: {"dim": DIM, "capacity": rows}},
                   "sparse": [{"name": TABLE, "kind": "int64"}]},
    }, "bench serve job")
    table = EmbeddingTable(TABLE, TableSpec(dim=DIM, capacity=rows), StoreConfig())
    keys = hashing.hash_int64(np.arange(rows, dtype=np.int64), TABLE)
    rng = np.random.default_rng(0)
    for start in range(0, rows, 100_000):  # insert every row, then move each off its initial vector
        part = keys[start : start + 100_000]
        table.lookup(part, step=0)
        table.apply_gradients(part, rng.standard_normal((part.shape[0], DIM), dtype=np.float32), step=0)
    return ckpt.save(root / "checkpoints", 1, sparse={TABLE: table.state_dict()}, dense={},
                     meta={"config": config_mod.dumps(job), "reader": {}}, keep_last=1)


def _load(spec: dict) -> dict:
    out = subprocess.run([sys.executable, "-m", "recsys.bench.serve_load", json.dumps(spec)],
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"load generator failed ({spec['target']} {spec['url']}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {name: float(value) for name, value in
            (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))}


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def measure(quick: bool = False, data: Path | None = None) -> dict:
    """Run the serving benchmark; return comparisons and figures (see the module doc)."""
    from embedding_server import export as publish
    from recsys.redisio.client import connect

    rows = 100_000 if quick else 1_000_000
    requests = 400 if quick else 2000
    repeats = 1 if quick else 6
    concurrency = 8
    work = Path(tempfile.mkdtemp(prefix="recsys-bench-serve-", dir=data))
    procs = []
    try:
        redis_server = start_redis(work)
        redis_url = redis_server.url
        procs.append(redis_server.proc)
        t0 = time.perf_counter()
        ckpt = _write_checkpoint(work, rows)
        build_s = time.perf_counter() - t0
        client = connect(redis_url)
        used0 = int(client.info("memory")["used_memory"])
        export = publish.export(ckpt, redis_url, publish.ExportSettings(version="bench"), progress=False)
        bytes_per_row = (int(client.info("memory")["used_memory"]) - used0) / rows
        client.close()
        services = {}
        for name, args in (("service", ["--redis", redis_url, "--workers", str(WORKERS)]),
                           ("service_1_worker", ["--redis", redis_url]),
                           ("service_no_fast_path", ["--redis", redis_url, "--workers", str(WORKERS),
                                                     "--no-fast-path"]),
                           ("embedded", ["--checkpoint", str(ckpt), "--workers", str(WORKERS)])):
            proc, url = start_service(args, work / f"{name}.log")
            procs.append(proc)
            services[name] = url
        base = {"requests": requests, "ids_per_request": IDS_PER_REQUEST, "concurrency": concurrency,
                "num_ids": rows, "zipf": ZIPF, "seed": 0, "feature": TABLE, "table": TABLE, "version": "bench",
                "namespace": "recsys", "buckets": export_buckets(), "binary": True}
        targets = {  # each round runs them in this order; ratios pair a round's figures
            "raw_redis": {**base, "target": "redis", "url": redis_url},
            "service": {**base, "target": "http", "url": services["service"]},
            "service_json": {**base, "target": "http", "url": services["service"], "binary": False},
            "service_1_worker": {**base, "target": "http", "url": services["service_1_worker"]},
            "service_no_fast_path": {**base, "target": "http", "url": services["service_no_fast_path"]},
            "embedded": {**base, "target": "http", "url": services["embedded"]},
        }
        # warm-up: one untimed pass per target (other draws of the same ids' law), as a running
        # service would be; the cold pass's figure is kept too
        cold = {name: _load({**spec, "seed": 999}) for name, spec in targets.items()}
        before = _metrics(services["service"])
        closed: dict[str, list[dict]] = {k: [] for k in targets}
        for r in range(repeats):
            for name, spec in targets.items():
                closed[name].append(_load({**spec, "seed": r}))
        kps = {k: _summary([x["keys_per_s"] for x in v]) for k, v in closed.items()}
        # open loop at half the maximum each target sustained
        open_loop = {}
        for name in ("service", "embedded", "raw_redis"):
            rate = 0.5 * kps[name]["median"] / IDS_PER_REQUEST
            res = [_load({**targets[name], "rate": rate, "seed": 100 + r}) for r in range(repeats)]
            open_loop[name] = {"rate_requests_per_s": rate, "p50_ms": _summary([x["p50_ms"] for x in res]),
                               "p99_ms": _summary([x["p99_ms"] for x in res])}
        m = _metrics(services["service"])
        hits, misses = (m.get(f"recsys_serve_cache_{k}_total", 0.0) - before.get(f"recsys_serve_cache_{k}_total", 0.0)
                        for k in ("hits", "misses"))
    finally:
        for proc in reversed(procs):
            stop_process(proc)
        shutil.rmtree(work, ignore_errors=True)
    def paired_to(name, base="raw_redis"):  # per-round ratios: both sides of a round ran back to back
        return paired_ratio([1 / x["keys_per_s"] for x in closed[name]], [1 / x["keys_per_s"] for x in closed[base]])

    return {
        "comparisons": [
            comparison("service vs raw redis MGET", kps["service"]["median"], kps["raw_redis"]["median"], "keys/s",
                       **paired_to("service")),
            comparison("embedded vs raw redis MGET", kps["embedded"]["median"], kps["raw_redis"]["median"], "keys/s",
                       **paired_to("embedded")),
            comparison("service JSON vs binary", kps["service_json"]["median"], kps["service"]["median"], "keys/s"),
            comparison("service 1 worker vs raw redis MGET", kps["service_1_worker"]["median"],
                       kps["raw_redis"]["median"], "keys/s", **paired_to("service_1_worker")),
            comparison("service: lookups' hot path vs the full app", kps["service"]["median"],
                       kps["service_no_fast_path"]["median"], "keys/s",
                       **paired_to("service", "service_no_fast_path")),
        ],
        "keys_per_s": kps,
        "keys_per_s_cold_cache": {k: v["keys_per_s"] for k, v in cold.items()},
        "latency_at_half_max": open_loop,
        "cache_hit_rate": hits / (hits + misses) if hits + misses else float("nan"),  # timed rounds only
        "export": {"rows": export["rows"], "rows_per_s": export["rows_per_s"], "seconds": export["seconds"],
                   "redis_bytes_per_row": bytes_per_row, "payload_bytes_per_row": DIM * 4},
        "setup": {"rows": rows, "dim": DIM, "requests": requests, "ids_per_request": IDS_PER_REQUEST,
                  "concurrency": concurrency, "zipf": ZIPF, "repeats": repeats, "workers": WORKERS,
                  "checkpoint_build_s": build_s, "cpus": os.cpu_count()},
        "targets": {"service_vs_raw": 0.8, "service_1_worker_vs_raw": 0.6, "p99_ms_max": 5.0},
    }


def export_buckets() -> int:
    """Return the buckets ``recsys export`` uses by default."""
    from embedding_server.export import ExportSettings

    return ExportSettings().buckets
