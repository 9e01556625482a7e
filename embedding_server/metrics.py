"""Prometheus metrics of the lookup service (``prometheus-client``), one registry per app.

    recsys_serve_requests_total{route,status}    requests answered
    recsys_serve_request_seconds{route}          latency histogram
    recsys_serve_ids_per_request                 ids asked for per lookup request
    recsys_serve_cache_hits_total / _misses_total  the row cache (hit rate = hits / both)
    recsys_serve_cache_bytes                     bytes the cache holds now
    recsys_serve_backend_errors_total            requests answered 503 (backend unavailable)
    recsys_serve_version_info{version}           1 for the version served now
    recsys_serve_bad_rows_total{source}          row values read from Redis that could not be
                                                 served (wrong length, not finite; source
                                                 "published" or "live"): served as unseen ids

With ``--follow`` (live rows overlaid on the version):

    recsys_serve_live_overlay                    1 while live rows are overlaid, 0 when not
                                                 (no live manifest, or an incompatible one)
    recsys_serve_live_rows_total                 rows answered from the live namespace (one
                                                 per distinct key of a lookup)
    recsys_serve_live_cache_hits_total / _misses_total  the live row cache (misses: read from Redis)
    recsys_serve_live_cache_bytes                bytes the live row cache holds now

With several workers (``PROMETHEUS_MULTIPROC_DIR`` set) every process writes its values
to that directory and /metrics sums them over the workers.
"""

from __future__ import annotations

import os
import time

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
IDS_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 10_000, 100_000)


class Metrics:
    """The service's metrics and the ASGI middleware that counts requests."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("recsys_serve_requests", "Requests answered", ["route", "status"], registry=r)
        self.latency = Histogram("recsys_serve_request_seconds", "Request latency", ["route"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ids = Histogram("recsys_serve_ids_per_request", "Ids asked for per lookup request",
                             buckets=IDS_BUCKETS, registry=r)
        self.cache_hits = Counter("recsys_serve_cache_hits", "Row cache hits", registry=r)
        self.cache_misses = Counter("recsys_serve_cache_misses", "Row cache misses", registry=r)
        self.cache_bytes = Gauge("recsys_serve_cache_bytes", "Bytes held by the row cache", registry=r,
                                 multiprocess_mode="livesum")
        self.backend_errors = Counter("recsys_serve_backend_errors", "Requests answered 503", registry=r)
        self.version = Gauge("recsys_serve_version_info", "1 for the version served now", ["version"], registry=r,
                             multiprocess_mode="livemax")
        self.live_overlay = Gauge("recsys_serve_live_overlay", "1 while live rows are overlaid on the version",
                                  registry=r, multiprocess_mode="livemin")
        self.live_rows = Counter("recsys_serve_live_rows", "Rows answered from the live namespace", registry=r)
        self.live_hits = Counter("recsys_serve_live_cache_hits", "Live row cache hits", registry=r)
        self.live_misses = Counter("recsys_serve_live_cache_misses", "Live row cache misses (read from Redis)",
                                   registry=r)
        self.live_bytes = Gauge("recsys_serve_live_cache_bytes", "Bytes held by the live row cache", registry=r,
                                multiprocess_mode="livesum")
        self.bad_rows = Counter("recsys_serve_bad_rows", "Row values read from Redis that could not be served",
                                ["source"], registry=r)
        self._version = None
        self._bad_seen = (0, 0)
        self._seen = (0, 0)
        self._live_seen = (0, 0, 0)
        metrics = self

        class Middleware:
            def __init__(self, app: ASGIApp) -> None:
                self.app = app

            async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
                if scope["type"] != "http":
                    await self.app(scope, receive, send)
                    return
                status = 500
                t0 = time.perf_counter()

                async def send_status(message: Message) -> None:
                    nonlocal status
                    if message["type"] == "http.response.start":
                        status = message["status"]
                    await send(message)

                try:
                    await self.app(scope, receive, send_status)
                finally:
                    route = scope.get("route")
                    name = getattr(route, "path", None) or "unmatched"
                    metrics.requests.labels(name, str(status)).inc()
                    metrics.latency.labels(name).observe(time.perf_counter() - t0)

        self.middleware = Middleware

    def serving(self, version: str) -> None:
        """Record the version being served (the gauge moves only when it changes)."""
        if version != self._version:
            if self._version is not None:
                self.version.remove(self._version)
            self.version.labels(version).set(1)
            self._version = version

    def observe_backend(self, backend) -> None:
        """Bring the cache figures up to date from ``backend`` (before a scrape)."""
        stats = getattr(backend, "cache_stats", None)
        if stats is None:
            return
        hits, misses, size = stats()
        self.cache_hits.inc(hits - self._seen[0])
        self.cache_misses.inc(misses - self._seen[1])
        self._seen = (hits, misses)
        self.cache_bytes.set(size)
        bad = (getattr(backend, "bad_rows", 0), getattr(backend, "bad_live_rows", 0))
        for source, now, seen in zip(("published", "live"), bad, self._bad_seen):
            self.bad_rows.labels(source).inc(now - seen)
        self._bad_seen = bad
        live = getattr(backend, "live_stats", lambda: None)()
        if live is None:
            return
        overlaid, rows, live_hits, live_misses, live_size = live
        self.live_overlay.set(1 if overlaid else 0)
        self.live_rows.inc(rows - self._live_seen[0])
        self.live_hits.inc(live_hits - self._live_seen[1])
        self.live_misses.inc(live_misses - self._live_seen[2])
        self._live_seen = (rows, live_hits, live_misses)
        self.live_bytes.set(live_size)

    def render(self) -> tuple[bytes, str]:
        """Return the exposition text (summed over workers in multiprocess mode) and its type."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
