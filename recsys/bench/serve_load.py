"""The load generator of ``recsys bench serve``, run as its own process (no torch).

    python -m recsys.bench.serve_load SPEC_JSON   → prints one JSON result line

SPEC: ``{"target": "http" | "redis", "url", "requests", "ids_per_request", "concurrency",
"num_ids", "zipf", "seed", "rate" (requests/s; 0 = closed loop, as fast as answered),
"binary", "feature", "table", "version", "namespace", "buckets"}``.

Ids follow a bounded Zipf law over ``num_ids`` raw ids (``recsys.io.zipf``: rank k drawn
with probability about ∝ 1/k^zipf, ranks mapped to ids by a fixed permutation). Every target gets the same
request sequence. ``http`` sends lookups to the service over keep-alive HTTP/1.1
connections (a minimal client: httpx would cost more CPU than the server it measures);
``redis`` sends one MGET of the same rows' Redis keys per request (names built before
the clock starts): the limit the service is compared with.

Closed loop (``rate`` 0): ``concurrency`` connections each send their next request when
the last is answered; gives the maximum sustainable throughput. Open loop (``rate`` > 0):
request i is due at ``i / rate`` seconds; its latency counts from when it was due, so
queueing behind a slow answer is measured (no coordinated omission).
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import time
from urllib.parse import urlsplit

import numpy as np

from recsys.io.zipf import zipf_ranks


POPULARITY_SEED = 0
"""Seeds the permutation from Zipf ranks to ids: one popularity order for every run and
round (a round's ``seed`` draws other requests from the same law), as a service's traffic
keeps its hot ids from one second to the next."""


def zipf_ids(num_ids: int, count: int, s: float, seed: int) -> np.ndarray:
    """Return ``count`` raw ids in ``[0, num_ids)`` drawn from a bounded Zipf law
    (``recsys.io.zipf``): ``seed`` draws the ranks, and rank k is always the same id
    (``POPULARITY_SEED``)."""
    ranks = zipf_ranks(np.random.default_rng(seed), count, num_ids, s)
    return np.random.default_rng(POPULARITY_SEED).permutation(num_ids)[ranks]


class HttpConnection:
    """One keep-alive HTTP/1.1 connection that POSTs and reads Content-Length bodies."""

    def __init__(self, reader, writer, host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host

    @classmethod
    async def open(cls, url: str) -> "HttpConnection":
        parts = urlsplit(url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        return cls(reader, writer, f"{parts.hostname}:{parts.port}")

    async def post(self, path: str, body: bytes, accept: str) -> tuple[int, bytes]:
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Accept: {accept}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        self.writer.write(head + body)
        status_line = await self.reader.readline()
        status = int(status_line.split()[1])
        length = 0
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        self.writer.close()


async def _run(spec: dict) -> dict:
    n, per = spec["requests"], spec["ids_per_request"]
    ids = zipf_ids(spec["num_ids"], n * per, spec["zipf"], spec["seed"]).reshape(n, per)
    if spec["target"] == "http":
        feature = spec["feature"]
        bodies = [json.dumps({"feature": feature, "ids": row.tolist()}).encode() for row in ids]
        accept = "application/octet-stream" if spec["binary"] else "application/json"
        conns = [await HttpConnection.open(spec["url"]) for _ in range(spec["concurrency"])]

        async def send(conn, i):
            status, body = await conn.post("/v1/lookup", bodies[i], accept)
            if status != 200:
                raise RuntimeError(f"HTTP {status}: {body[:300]!r}")
            return len(body)

        def close(conn):
            conn.close()
    else:
        import redis.asyncio as aredis

        from recsys.redisio import published as layout
        from recsys.features import hashing

        keys = hashing.hash_int64(ids.reshape(-1), spec["table"]).reshape(n, per)
        names = [layout.row_keys(spec["namespace"], spec["version"], spec["table"], row, spec["buckets"])
                 for row in keys]
        conns = [aredis.Redis.from_url(spec["url"], single_connection_client=True)
                 for _ in range(spec["concurrency"])]

        async def send(conn, i):
            values = await conn.mget(names[i])
            return sum(len(v) for v in values if v is not None)

        def close(conn):
            pass

    for i in range(min(20, n)):  # warm-up: connections, caches of the code paths (not timed)
        await send(conns[i % len(conns)], i)
    latencies = np.zeros(n)
    # no garbage collection while the clock runs: the generator's own collections (pauses of
    # 20-30 ms over the request lists, measured 2026-11-28) would count as the target's latency
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        elapsed = await _timed(spec, n, send, conns, latencies)
    finally:
        gc.enable()
        gc.unfreeze()
    for c in conns:
        close(c)
        if spec["target"] == "redis":
            await c.aclose()
    return {"requests": n, "keys": n * per, "seconds": elapsed, "keys_per_s": n * per / elapsed,
            "requests_per_s": n / elapsed, "p50_ms": float(np.percentile(latencies, 50) * 1e3),
            "p99_ms": float(np.percentile(latencies, 99) * 1e3), "rate": spec.get("rate", 0)}


async def _timed(spec: dict, n: int, send, conns: list, latencies: np.ndarray) -> float:
    """Send the ``n`` requests (closed or open loop, see the module doc), writing each one's
    latency into ``latencies``; return the seconds they took."""
    rate = spec.get("rate", 0)
    t0 = time.perf_counter()
    if not rate:  # closed loop: each connection sends its next request when answered
        todo = iter(range(n))

        async def worker(conn):
            for i in todo:
                start = time.perf_counter()
                await send(conn, i)
                latencies[i] = time.perf_counter() - start

        await asyncio.gather(*(worker(c) for c in conns))
    else:  # open loop: request i is due at t0 + i / rate, whether or not a connection is free
        pool: asyncio.Queue = asyncio.Queue()
        for c in conns:
            pool.put_nowait(c)

        async def one(i, due):
            conn = await pool.get()
            try:
                await send(conn, i)
            finally:
                pool.put_nowait(conn)
            latencies[i] = time.perf_counter() - due

        tasks = []
        for i in range(n):
            due = t0 + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, due)))
        await asyncio.gather(*tasks)
    return time.perf_counter() - t0


def main() -> None:
    spec = json.loads(sys.argv[1])
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    print(json.dumps(asyncio.run(_run(spec))))


if __name__ == "__main__":
    main()
