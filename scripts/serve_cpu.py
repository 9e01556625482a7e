"""CPU per request of the lookup service (Redis backend, one worker) under the bench's load,
for this checkout and others, alternated in one run.

    cd /tmp && /work/main/.venv/bin/python /work/main/scripts/serve_cpu.py [VARIANT ...]

Run it from a directory outside the checkout, so that ``PYTHONPATH`` decides which code
each service runs. A VARIANT is ``new`` (this environment's code) or comma-separated
environment settings for one service, say ``PYTHONPATH=/tmp/base`` (a ``git worktree add
/tmp/base <commit>``); default: ``new``.

One loopback Redis holds 1 M rows × 64 float32 (exported as ``recsys bench serve`` does);
each variant is a ``recsys serve --redis`` of one worker. After one warm-up pass each, every
round sends the bench's load (2000 requests of 256 Zipf ids over 8 connections, binary) to
raw Redis MGETs, then to each service in turn, and reads the CPU time the service's
processes and Redis spent (psutil). Prints per variant the median keys/s, service ms of CPU
per request and Redis ms of CPU per request over the rounds (``ROUNDS``, default 4), with
the CPU model.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

import psutil

from embedding_server import export as publish
from recsys.bench import serve as bench
from recsys.bench import cpu_info
from recsys.testing.harness import start_redis, start_service, stop_process


def _cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its children."""
    p = psutil.Process(pid)
    return sum(sum(q.cpu_times()[:2]) for q in [p] + p.children(recursive=True))


def main(variants: list[str]) -> None:
    rows, requests, rounds = 1_000_000, 2000, int(os.environ.get("ROUNDS", "4"))
    work = Path(tempfile.mkdtemp(prefix="serve-cpu-"))
    procs = []
    try:
        rs = start_redis(work)
        procs.append(rs.proc)
        publish.export(bench._write_checkpoint(work, rows), rs.url, publish.ExportSettings(version="bench"),
                       progress=False)
        services = {}
        for i, v in enumerate(variants):
            extra = dict(kv.split("=", 1) for kv in v.split(",")) if "=" in v else {}
            saved = {k: os.environ.get(k) for k in extra}
            os.environ.update(extra)
            try:
                proc, url = start_service(["--redis", rs.url], work / f"service-{i}.log")
            finally:
                for k, val in saved.items():
                    if val is None:
                        os.environ.pop(k)
                    else:
                        os.environ[k] = val
            procs.append(proc)
            services[v] = (proc.pid, url)
        load = {"requests": requests, "ids_per_request": bench.IDS_PER_REQUEST, "concurrency": 8, "num_ids": rows,
                "zipf": bench.ZIPF, "feature": bench.TABLE, "table": bench.TABLE, "version": "bench",
                "namespace": "recsys", "buckets": bench.export_buckets(), "binary": True}
        raw = {**load, "target": "redis", "url": rs.url}
        for _, url in services.values():
            bench._load({**load, "target": "http", "url": url, "seed": 999})
        bench._load({**raw, "seed": 999})
        res: dict[str, list[tuple[float, float, float]]] = {v: [] for v in ["raw Redis", *services]}
        for r in range(rounds):
            targets = [("raw Redis", None, raw)] + [(v, pid, {**load, "target": "http", "url": url})
                                                   for v, (pid, url) in services.items()]
            for name, pid, spec in targets:
                s0 = _cpu_s(pid) if pid else 0.0
                r0 = _cpu_s(rs.proc.pid)
                x = bench._load({**spec, "seed": r})
                res[name].append((x["keys_per_s"], ((_cpu_s(pid) - s0) if pid else 0.0) / requests * 1e3,
                                  (_cpu_s(rs.proc.pid) - r0) / requests * 1e3))
        cpu = cpu_info()
        print(f"serve CPU per request on {cpu['model']}, {cpu['cores']} cores, SIMD {' '.join(cpu['simd'])}, "
              f"numba target {cpu.get('numba_target', '?')}; medians of {rounds} rounds")
        for name, xs in res.items():
            med = [statistics.median(x[i] for x in xs) for i in range(3)]
            print(f"{name:32s} keys/s {med[0] / 1e3:7.1f}k  service ms/req {med[1]:.3f}  redis ms/req {med[2]:.3f}  "
                  f"rounds (k keys/s) {[round(x[0] / 1e3) for x in xs]}")
    finally:
        for p in reversed(procs):
            stop_process(p)


if __name__ == "__main__":
    main(sys.argv[1:] or ["new"])
