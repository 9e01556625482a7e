"""The lookups' hot path: ``POST /v1/lookup`` and ``/v1/lookup/batch`` answered by a plain
ASGI layer in front of the app, without the framework's per-request machinery (its
middleware chain, routing, dependencies, ``Request`` and ``Response`` objects).

It answers only what ends in 200: the body read whole within the body limit, the bearer
token (when one is configured) right, the route's own handler (the same function the
FastAPI route calls) returning. Anything else (a bad or oversized body, a missing token, an
unknown feature, too many ids, a backend error, a client gone) is replayed, body and all,
through the full app, which answers it exactly as it would have without this layer: the
same status, body, headers and metrics. A request the fast path answers is counted in the
same metrics (``recsys_serve_requests_total{route, status="200"}``, the latency histogram,
the ids per request) as the app's middleware counts it. The OpenAPI schema is the app's:
the routes stay declared there.

The layer sits in front of the whole app (``FrontedApp``), not among its middleware: the
framework wraps every user middleware in five layers of its own (its ``__call__``s, the
server-error and exception-telemetry middleware, its body limit), which cost every lookup
CPU time a profile of a worker shows plainly, for nothing the fast path uses. With
FastAPI's own OpenTelemetry instrumentation on, the layer steps aside (``FrontedApp``).

``recsys bench serve`` measures what it gains: the keys/s of the service answering through
this layer against the same service answering through the full app (``--no-fast-path``):
BENCHMARKS.md, "Lookup service"; earlier runs: docs/benchmarks-history.md.
"""

from __future__ import annotations

import contextvars
import time
from typing import Awaitable, Callable

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["FastLookup", "FrontedApp", "failure"]

_FAILURE: contextvars.ContextVar[Exception | None] = contextvars.ContextVar("recsys_fast_path_failure", default=None)


def failure() -> Exception | None:
    """Return what the fast path's handler raised for the request the app is answering now
    (None: nothing, or the request did not come through the fast path). The app may answer
    with it rather than ask again what just failed: a backend that timed out once should
    not make the request wait for a second timeout."""
    return _FAILURE.get()

Handler = Callable[[bytes, bool], Awaitable[tuple[bytes, str, int]]]
"""(body, binary response wanted) -> (response body, media type, ids asked for); raises
on anything that is not a 200."""


class FastLookup:
    """The ASGI layer of the module doc, in front of ``app``."""

    def __init__(self, app: ASGIApp, routes: dict[str, Handler], metrics, token_ok: Callable[[bytes], bool],
                 max_bytes: int, binary_media_type: bytes) -> None:
        self.app, self.routes, self.metrics = app, routes, metrics
        self.token_ok, self.max_bytes, self.binary = token_ok, max_bytes, binary_media_type
        self.answered = 0  # requests this layer answered itself (the rest went through the app)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = None
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.routes.get(scope["path"])
        if handler is None:
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        auth = accept = None  # the first of each header, as the app reads them
        too_long = False
        for name, value in scope["headers"]:
            if name == b"authorization" and auth is None:
                auth = value
            elif name == b"accept" and accept is None:
                accept = value
            elif name == b"content-length":
                too_long = too_long or (value.isdigit() and int(value) > self.max_bytes)
        received: list[Message] = []  # replayed as they came if the app must answer
        complete = False
        if not too_long:
            size = 0
            while True:
                message = await receive()
                received.append(message)
                if message["type"] != "http.request":  # the client went away: the app sees it too
                    break
                size += len(message.get("body", b""))
                if size > self.max_bytes:
                    break
                if not message.get("more_body", False):
                    complete = True
                    break
        failed = None
        if complete and self.token_ok(auth or b""):
            try:
                body, media_type, ids = await handler(b"".join(m.get("body", b"") for m in received),
                                                      self.binary in (accept or b""))
            except Exception as exc:  # noqa: BLE001 - the app answers it, in its own words
                body, failed = None, exc
            if body is not None:
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-length", str(len(body)).encode()),
                                        (b"content-type", media_type.encode())]})
                await send({"type": "http.response.body", "body": body})
                m, route = self.metrics, scope["path"]
                m.requests.labels(route, "200").inc()
                m.latency.labels(route).observe(time.perf_counter() - t0)
                m.ids.observe(ids)
                self.answered += 1
                return

        async def replay() -> Message:
            return received.pop(0) if received else await receive()

        token = _FAILURE.set(failed)
        try:
            await self.app(scope, replay, send)
        finally:
            _FAILURE.reset(token)


class FrontedApp(FastAPI):
    """A FastAPI app with an optional ``FastLookup`` in front of its whole stack (``front``).

    When FastAPI's own OpenTelemetry instrumentation is on (a tracer or meter provider is
    configured; read at the first request), the layer steps aside and every request goes
    through the app, so each one is traced and measured there as before."""

    fast: FastLookup | None = None
    _instrumented: bool | None = None

    def front(self, routes: dict[str, Handler], **kw) -> FastLookup:
        """Answer ``routes`` by a ``FastLookup`` (``kw``: its other arguments) before the app."""
        self.fast = FastLookup(self.full, routes, **kw)
        return self.fast

    async def full(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app without the layer in front."""
        await super().__call__(scope, receive, send)

    def instrumented(self) -> bool:
        """Return whether FastAPI's native telemetry would wrap a request now."""
        native = getattr(self, "_native_telemetry", None)  # FastAPI >= 0.165; older ones have none
        return bool(native is not None and native.enabled())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.fast is not None and scope["type"] == "http":
            if self._instrumented is None:
                self._instrumented = self.instrumented()
            if not self._instrumented:
                await self.fast(scope, receive, send)
                return
        await super().__call__(scope, receive, send)
