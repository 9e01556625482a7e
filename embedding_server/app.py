"""The lookup service: an ASGI app (FastAPI) built by ``create_app(settings, backend)``.

Routes (OpenAPI at /docs and /openapi.json):

    POST /v1/lookup        {"feature", "ids", "pooling", "arm"} -> {"embeddings", "found", "version"}
    POST /v1/lookup/batch  {"lookups": [...]}                    -> {"results": [...], "version"}
    GET  /v1/tables        served tables, their dims, features, rows and arm, and the version
    GET  /healthz          the process is up
    GET  /readyz           the backend answers and a version is loaded (503 otherwise); with a
                           token configured, the reason only for a caller that sends it
    GET  /metrics          Prometheus text format

``Accept: application/octet-stream`` on the lookups returns float32 rows in the binary
layout of ``embedding_server.binary_body``. Ids are raw ids, hashed exactly as training hashed
them (``Catalog.keys``); an id never trained gets the vector ``recsys eval`` uses for an
unseen key, with ``found: false``. ``"arm": "wide"`` asks for the wide arm's weights of a
``model.wide`` job instead of the embeddings: one dim-1 row per id (0 for an unseen id),
pooled like the embeddings; a version without them answers 422 saying so. Every response
is read from one version (one snapshot per request); with ``--follow`` the live rows of a
training job are overlaid on it and ``version`` says so (``<version>+live@<step>``,
``embedding_server.overlay``). Errors: 4xx naming the request field (never 5xx for bad
input), 401 without the bearer token when one is configured, 413 past the id, lookup or
body limits, 503 when the backend cannot answer (the body says why; the service recovers by
itself). The lookups that end in 200 are answered by ``embedding_server.fastpath`` in front
of the app (same handlers, without the framework's per-request stack).
"""

from __future__ import annotations

import contextlib
import gc
import hmac
import logging
import os
from typing import Literal

import numpy as np
import orjson
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from embedding_server import fastpath, overlay
from embedding_server import binary_body as wire
from embedding_server.backends import BackendUnavailable, Snapshot, backend_from_settings
from embedding_server.catalog import IdError
from embedding_server.fastpath import FrontedApp
from embedding_server.metrics import Metrics
from embedding_server.settings import ServeSettings
from recsys.store.tables.dedup import unique_inverse

log = logging.getLogger(__name__)
_F32_MAX = float(np.finfo(np.float32).max)

Pooling = Literal["none", "sum", "mean"]
Arm = Literal["embedding", "wide"]


# --------------------------------------------------------------------------- request / response models


class LookupRequest(BaseModel):
    """Embeddings of raw ids of one feature."""

    model_config = ConfigDict(extra="forbid")
    feature: StrictStr = Field(description="a served sparse feature (GET /v1/tables lists them)")
    ids: list[StrictInt | StrictStr] = Field(description="raw ids: ints for int64 features, strings for string ones")
    pooling: Pooling = Field("none", description="none: one vector per id; sum or mean: one vector for all ids")
    arm: Arm = Field("embedding", description="embedding: the feature's embeddings; wide: the wide arm's scalar "
                                              "weights of a model trained with model.wide = true (dim-1 rows)")


class BatchRequest(BaseModel):
    """Several lookups answered from one version in one round trip."""

    model_config = ConfigDict(extra="forbid")
    lookups: list[LookupRequest] = Field(description="lookups, answered in order")


class LookupResponse(BaseModel):
    embeddings: list[list[float]] = Field(description="one vector per id, or one pooled vector")
    found: list[bool] = Field(description="per id: it has a trained row (false: the unseen-key vector)")
    version: str = Field(description="the published version every vector comes from; '<version>+live@<step>' "
                                     "when live rows (--follow) were served, step: the newest among them")


class BatchResult(BaseModel):
    feature: str
    arm: Literal["wide"] | None = Field(None, description="'wide' on a lookup of the wide arm's weights; absent "
                                                          "on embedding lookups")
    embeddings: list[list[float]]
    found: list[bool]


class BatchResponse(BaseModel):
    results: list[BatchResult]
    version: str


class TableInfoOut(BaseModel):
    name: str
    dim: int
    features: list[str]
    rows: int
    arm: Arm = Field(description="embedding, or wide: the wide arm's weights of the features (lookups with "
                                 "arm 'wide')")


class TablesResponse(BaseModel):
    tables: list[TableInfoOut]
    version: str


class DenseRequest(BaseModel):
    """Raw dense values to transform as the job's reader did (``schema.dense_transform``)."""

    model_config = ConfigDict(extra="forbid")
    values: dict[StrictStr, list[float | None]] = Field(
        description="every dense column of the job: one value per row (null: a missing value)")


class DenseResponse(BaseModel):
    columns: list[str] = Field(description="the dense columns, in the model's input order")
    dense: list[list[float]] = Field(description="per row, the model's dense input (recsys.features.dense): a number, a "
                                                 "quantile bucket id or a numeric-embedding position per column")
    version: str


class ErrorItem(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ErrorResponse(BaseModel):
    detail: list[ErrorItem] | str


_ERRORS = {code: {"model": ErrorResponse} for code in (401, 413, 422, 503)}
_BINARY = {"content": {wire.MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
           "description": "JSON, or with Accept: application/octet-stream the binary layout of embedding_server.binary_body"}


def _json_body(model: type[BaseModel]) -> dict:
    """Return the OpenAPI request body of a route that parses ``model`` itself."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


async def _parse(request: Request, model: type[BaseModel]):
    """Return the request's JSON body validated as ``model``; 422 naming the field otherwise."""
    return _validated(await request.body(), model)


def _validated(raw: bytes, model: type[BaseModel]):
    """Return the JSON body ``raw`` validated as ``model``; 422 naming the field otherwise.

    The lookups parse their body here (one ``model_validate_json``) instead of through
    FastAPI's body dependency: measured ~25 % more requests/s on a bare route, and the
    lookup is the hot path. The errors keep FastAPI's shape (``loc`` starts with "body")."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        detail = [{"loc": ["body", *err["loc"]], "msg": err["msg"], "type": err["type"]}
                  for err in exc.errors(include_url=False, include_context=False, include_input=False)]
        raise HTTPException(422, detail=detail) from None


def _first(names: list[str], shown: int = 10) -> str:
    """Return ``names`` listed, at most ``shown`` of them, with how many more there are."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{names[:shown]}{more}"


def _field_error(status: int, loc: list, msg: str, kind: str) -> HTTPException:
    return HTTPException(status, detail=[{"loc": loc, "msg": msg, "type": kind}])


# --------------------------------------------------------------------------- body limit


class BodyLimit:
    """Answer 413 to a request whose body passes ``max_bytes`` (declared or streamed).

    The body is read here first (the app reads all of it anyway), so an oversized chunked
    body is refused before any handler sees it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await self._reject(send)
                return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._reject(send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, send: Send) -> None:
        body = orjson.dumps({"detail": [{"loc": ["body"], "msg": f"request body larger than {self.max_bytes} bytes",
                                         "type": "body_too_large"}]})
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


# --------------------------------------------------------------------------- the app


def create_app(settings: ServeSettings, backend=None) -> FastAPI:
    """Return the lookup service for ``settings`` (``backend``: built from them when None)."""
    backend = backend if backend is not None else backend_from_settings(settings)
    token = settings.token()
    metrics = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await backend.start()
        # Everything built so far (the app, its libraries, the first version's catalog) lives
        # as long as the process: frozen, out of the collector's sight, so a full collection
        # reads only what came after. Measured on one worker: a full collection while serving
        # stalled it 115 ms without this, 34 ms with it (one in 12,000 requests each).
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            await backend.close()

    app = FrontedApp(title="recsys embedding lookup", version="1", lifespan=lifespan,
                  description=__doc__.split("\n\n")[0])
    app.state.backend = backend
    app.state.metrics = metrics

    def token_ok(given: bytes) -> bool:
        """Whether the Authorization header's value ``given`` carries the token (or none is set)."""
        if token is None:
            return True
        scheme, _, value = given.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(value.strip(), token.encode())

    def has_token(request: Request) -> bool:
        return token_ok(request.headers.get("authorization", "").encode("latin-1"))

    async def authorized(request: Request) -> None:
        if not has_token(request):
            raise HTTPException(401, detail=[{"loc": ["header", "authorization"],
                                              "msg": "a valid bearer token is required", "type": "unauthorized"}],
                                headers={"WWW-Authenticate": "Bearer"})

    guarded = [Depends(authorized)] if token is not None else []  # no per-request cost without a token

    @app.exception_handler(BackendUnavailable)
    async def unavailable(request: Request, exc: BackendUnavailable):
        metrics.backend_errors.inc()
        return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": "1"})

    async def snapshot() -> Snapshot:
        failed = fastpath.failure()
        if isinstance(failed, BackendUnavailable):  # the fast path just asked: one wait, not two
            raise failed
        snap = await backend.snapshot()
        metrics.serving(snap.version)
        return snap

    async def answer(snap: Snapshot, lookups: list[LookupRequest], batched: bool,
                     observe: bool = True) -> tuple[list[tuple[np.ndarray, np.ndarray]], str]:
        """Return (vectors, found) per lookup, all read by ``snap`` in one backend call, and the
        response's version string (naming the newest live step served, if any). ``observe``:
        count the ids in the metrics now (the fast path counts them once it has answered)."""
        total = sum(len(lk.ids) for lk in lookups)
        if observe:
            metrics.ids.observe(total)
        if total > settings.max_ids:
            raise _field_error(413, ["body", "lookups"] if batched else ["body", "ids"],
                               f"{total} ids in one request, at most {settings.max_ids} allowed", "too_many_ids")
        cat = snap.catalog
        prepared = []
        for j, lk in enumerate(lookups):
            loc = ["body", "lookups", j] if batched else ["body"]
            try:
                feat = cat.feature(lk.feature)
            except KeyError as exc:
                raise _field_error(422, [*loc, "feature"], exc.args[0], "unknown_feature") from None
            try:
                table = cat.table(feat, lk.arm)
            except LookupError as exc:
                raise _field_error(422, [*loc, "arm"], exc.args[0], "arm_not_served") from None
            try:
                keys = cat.keys(feat, lk.ids, table)
            except IdError as exc:
                raise _field_error(422, [*loc, "ids", exc.index], str(exc), "id_type") from None
            uniq, inverse = unique_inverse(keys)
            prepared.append((table, uniq, inverse))
        fetched, live_step = await backend.rows(snap, [(table.name, uniq) for table, uniq, _ in prepared])
        out = []
        for lk, (table, uniq, inverse), (vec, found) in zip(lookups, prepared, fetched):
            if not found.all():
                vec[~found] = table.defaults(uniq[~found])
            vec, found = vec[inverse], found[inverse]
            if lk.pooling != "none":
                pooled = vec.sum(axis=0, keepdims=True, dtype=np.float32)
                if lk.pooling == "mean" and vec.shape[0]:
                    pooled /= np.float32(vec.shape[0])
                vec = pooled
            out.append((vec, found))
        return out, overlay.version_string(snap.version, live_step)

    def wants_binary(request: Request) -> bool:
        return wire.MEDIA_TYPE in request.headers.get("accept", "")

    def media_type(binary: bool) -> str:
        return wire.MEDIA_TYPE if binary else "application/json"

    async def lookup_answer(raw: bytes, binary: bool, observe: bool = True) -> tuple[bytes, str, int]:
        """Return the response body, media type and ids of a /v1/lookup body (the route and
        the fast path, ``embedding_server.fastpath``, answer with it); raises otherwise."""
        body = _validated(raw, LookupRequest)
        snap = await snapshot()
        ((vec, found),), version = await answer(snap, [body], batched=False, observe=observe)
        if binary:
            return wire.encode(version, [(vec, found)]), media_type(binary), len(body.ids)
        return (orjson.dumps({"embeddings": vec, "found": found, "version": version},
                             option=orjson.OPT_SERIALIZE_NUMPY), media_type(binary), len(body.ids))

    async def batch_answer(raw: bytes, binary: bool, observe: bool = True) -> tuple[bytes, str, int]:
        """``lookup_answer`` of a /v1/lookup/batch body."""
        body = _validated(raw, BatchRequest)
        if len(body.lookups) > settings.max_lookups:  # before any of them is resolved or read
            raise _field_error(413, ["body", "lookups"], f"{len(body.lookups)} lookups in one request, at most "
                               f"{settings.max_lookups} allowed", "too_many_lookups")
        snap = await snapshot()
        results, version = await answer(snap, body.lookups, batched=True, observe=observe)
        ids = sum(len(lk.ids) for lk in body.lookups)
        if binary:
            return wire.encode(version, results), media_type(binary), ids
        payload = {"results": [{"feature": lk.feature, "arm": lk.arm, "embeddings": vec, "found": found}
                               if lk.arm != "embedding" else {"feature": lk.feature, "embeddings": vec, "found": found}
                               for lk, (vec, found) in zip(body.lookups, results)], "version": version}
        return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY), media_type(binary), ids

    @app.post("/v1/lookup", response_model=LookupResponse, dependencies=guarded,
              responses={200: _BINARY, **_ERRORS}, openapi_extra=_json_body(LookupRequest))
    async def lookup(request: Request) -> Response:
        """Return the embeddings of raw ids of one feature (with arm 'wide': the wide arm's weights)."""
        body, kind, _ = await lookup_answer(await request.body(), wants_binary(request))
        return Response(body, media_type=kind)

    @app.post("/v1/lookup/batch", response_model=BatchResponse, dependencies=guarded,
              responses={200: _BINARY, **_ERRORS}, openapi_extra=_json_body(BatchRequest))
    async def lookup_batch(request: Request) -> Response:
        """Return the embeddings (or wide weights) of several lookups, all from one version."""
        body, kind, _ = await batch_answer(await request.body(), wants_binary(request))
        return Response(body, media_type=kind)

    @app.post("/v1/dense", response_model=DenseResponse, dependencies=guarded, responses=_ERRORS,
              openapi_extra=_json_body(DenseRequest))
    async def dense(request: Request) -> Response:
        """Return raw dense values transformed exactly as training and ``recsys eval`` did."""
        body = await _parse(request, DenseRequest)
        snap = await snapshot()
        transform = snap.catalog.dense_transform()
        if transform is None:
            raise _field_error(422, ["body", "values"], "the served version has no dense columns", "no_dense")
        columns = transform.columns
        missing = [c for c in columns if c not in body.values]
        extra = sorted(set(body.values) - set(columns))
        if missing or extra:
            # a body may name ~10^5 unknown columns: the message names the first few, not all of them
            what = f"missing {missing}" if missing else f"unknown {_first(extra)}"
            raise _field_error(422, ["body", "values"], f"{what}; expected exactly the dense columns {columns}",
                               "dense_columns")
        sizes = {len(body.values[c]) for c in columns}
        if len(sizes) != 1:
            raise _field_error(422, ["body", "values"], f"every column needs one value per row, found lengths "
                               f"{ {c: len(body.values[c]) for c in columns} }", "dense_rows")
        rows = sizes.pop()
        if rows * len(columns) > settings.max_ids:
            raise _field_error(413, ["body", "values"], f"{rows * len(columns)} values in one request, at most "
                               f"{settings.max_ids} allowed", "too_many_ids")
        raw = {}
        for c in columns:
            v = np.array([np.nan if x is None else x for x in body.values[c]], dtype=np.float64)
            bad = np.flatnonzero(~np.isfinite(v) & ~np.isnan(v) | (np.abs(np.nan_to_num(v)) > _F32_MAX))
            if bad.size:
                raise _field_error(422, ["body", "values", c, int(bad[0])], "a finite number within float32 range "
                                   f"or null, found {v[bad[0]]!r}", "dense_value")
            raw[c] = v
        out = transform.transform(raw)
        return Response(orjson.dumps({"columns": columns, "dense": out, "version": snap.version},
                                     option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json")

    @app.get("/v1/tables", response_model=TablesResponse, dependencies=guarded, responses=_ERRORS)
    async def tables() -> dict:
        """Return the served tables (dim, features reading them, rows, arm) and the version."""
        snap = await snapshot()
        cat = snap.catalog
        return {"version": snap.version, "tables": [
            {"name": t.name, "dim": t.dim, "rows": t.rows, "arm": t.arm,
             "features": [f.name for f in cat.features.values() if f.table == t.hashed_as]}
            for t in cat.tables.values()]}

    @app.get("/healthz")
    async def healthz() -> dict:
        """Return ok while the process serves HTTP."""
        return {"status": "ok"}

    @app.get("/readyz", responses={503: {"model": ErrorResponse}})
    async def readyz(request: Request) -> JSONResponse:
        """Return 200 when the backend answers and a version is loaded, else 503; the reason
        (paths, URLs) only to a caller with the bearer token when one is configured."""
        ready, why = backend.status()
        body = {"ready": ready, "detail": why, "backend": backend.name} if has_token(request) else {"ready": ready}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics", dependencies=guarded, responses=_ERRORS)
    async def metrics_route() -> Response:
        """Return the Prometheus metrics of this process (of all workers with --workers > 1)."""
        metrics.observe_backend(backend)
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (LookupRequest, BatchRequest, DenseRequest):  # the bodies parsed by hand (see _parse)
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(js.pop("$defs", {}))
                components[model.__name__] = js
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(metrics.middleware)
    if settings.fast_path:  # in front of it all: the lookups that end in 200 skip the stack (embedding_server.fastpath)
        fast = {"/v1/lookup": lambda raw, binary: lookup_answer(raw, binary, observe=False),
                "/v1/lookup/batch": lambda raw, binary: batch_answer(raw, binary, observe=False)}
        app.front(fast, metrics=metrics, token_ok=token_ok, max_bytes=settings.max_body_bytes,
                  binary_media_type=wire.MEDIA_TYPE.encode())
    return app


def create_app_from_env() -> FastAPI:
    """Return the app for the ``RECSYS_SERVE_*`` settings (what uvicorn workers call)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return create_app(ServeSettings.from_env())


def uvicorn_tls(settings: ServeSettings) -> dict:
    """Return uvicorn's TLS arguments for ``settings`` (none without a certificate)."""
    if not settings.ssl_certfile:
        return {}
    return {"ssl_certfile": settings.ssl_certfile, "ssl_keyfile": settings.ssl_keyfile}


def serve(settings: ServeSettings) -> None:
    """Run the service until interrupted (uvicorn; ``settings.workers`` processes)."""
    import uvicorn

    from embedding_server.coalesce import CoalescingHttpToolsProtocol

    os.environ.update(settings.to_env())
    metrics_dir = None
    if settings.workers > 1 and "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        import tempfile

        metrics_dir = tempfile.mkdtemp(prefix="recsys-serve-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    try:
        # a response's head and body in one write (embedding_server.coalesce)
        args = {"log_level": "info", "access_log": False, "http": CoalescingHttpToolsProtocol, **uvicorn_tls(settings)}
        if settings.workers > 1:  # each worker on its own socket: embedding_server.workers says why
            from embedding_server.workers import run_workers

            code = run_workers(settings.workers, settings.host, settings.port, args)
            if code:
                raise SystemExit(code)
        else:
            uvicorn.run(create_app_from_env(), host=settings.host, port=settings.port, **args)
    finally:
        if metrics_dir is not None:
            import shutil

            shutil.rmtree(metrics_dir, ignore_errors=True)
