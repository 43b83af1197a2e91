"""The HTTP service (FastAPI): routes, request models, limits, one JSON error shape, API key, metrics, the page.

    GET  /search?q=...&k=10      POST /search {query | queries[], k, rescore, ef, nprobe}
    POST /embed {inputs, transformed}          GET /info    GET /metrics    POST /reload
    GET  /health (liveness, never protected)   GET /ready (loaded and warmed)    GET / (search page)

Every error, bad input or not, is ``{"error": {"code", "message", "param"}}`` with a 4xx status for what the
client can fix (422 invalid, 413 too large, 401 key, 404/405, 429 queue full) and 503/409/500 for the server's
own state; no traceback ever reaches a response. Searches and embeddings go through the service's
micro-batching engine; the route handlers only validate, wait and format.

Only this module (and the CLI's `serve`) imports fastapi: the core never does.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import re
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from concurrent.futures import Future
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from fastapi_offline import FastAPIOffline
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import retrieval
from retrieval.errors import ConfigError, RetrievalError, render
from retrieval.search import SearchParams
from retrieval.serve.batching import BatchStats, Overloaded, Stopped
from retrieval.serve.service import NotReady, ServeOptions, Service, bound_onednn_caches
from retrieval.serve.telemetry import Counter, Gauge, Histogram, Registry
from retrieval.text import blank, valid_unicode

log = logging.getLogger(__name__)

Answer = TypeVar("Answer")
API_KEY_ENV = "RETRIEVAL_API_KEY"
STATIC = Path(__file__).parent / "static"
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "CONNECT"})
DOCS_ASSETS = "/docs/assets"  # Swagger UI and ReDoc, served from fastapi-offline's copies: no CDN is reachable
DOC_ROUTES = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})  # FastAPI's own pages
INT_PARAMS = frozenset({"k", "rescore", "ef", "nprobe"})  # GET /search's whole-number parameters
FIELDS = {"ef_search": "ef"}  # library parameter -> JSON field, where they differ
STATUS_CODES = {
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
    499: "client_closed",  # nginx's status for a client that closed its connection first: counted, never sent
}


def field_name(param: str) -> str:
    return FIELDS.get(param, param)


class ApiError(Exception):
    """An error response: HTTP status, a stable code, one line for people, the field it is about."""

    def __init__(
        self, status: int, code: str, message: str, param: str | None = None, headers: Any = None, **extra: Any
    ):
        super().__init__(message)
        self.status, self.code, self.message, self.param, self.headers = status, code, message, param, headers
        self.extra = extra  # more top-level fields of the body, beside "error"

    def response(self) -> JSONResponse:
        return error_response(self.status, self.code, self.message, self.param, self.headers, **self.extra)


def error_response(
    status: int, code: str, message: str, param: str | None = None, headers: Any = None, **extra: Any
) -> JSONResponse:
    body = {"error": {"code": code, "message": message, "param": param}, **extra}
    return JSONResponse(body, status_code=status, headers=headers)


# ----- request and response models (also what /docs shows) -----------------------------------------------------
class SearchRequest(BaseModel):
    """One query (`query`) or a batch (`queries`); knobs left out take the index's defaults."""

    model_config = ConfigDict(extra="forbid", strict=True)
    query: str | None = Field(None, description="One query text.", examples=["how do whitening transforms work"])
    queries: list[str] | None = Field(None, description="Several query texts, answered in order.")
    k: int | None = Field(None, description="Hits per query (default 10, or the server's `max_k` when lower).")
    rescore: int | None = Field(None, description="Re-rank this many candidates by the full stashed vectors.")
    ef: int | None = Field(None, description="HNSW search beam width (efSearch) for this request.")
    nprobe: int | None = Field(None, description="IVF lists probed for this request.")


class EmbedRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    inputs: str | list[str] = Field(..., description="A text or a list of texts.", examples=[["a text", "another"]])
    transformed: bool = Field(
        False, description="False: the encoder's raw vectors; true: whitened + L2-normalised, the index's space."
    )


class HitOut(BaseModel):
    rank: int
    id: str
    score: float
    text: str


class QueryResult(BaseModel):
    hits: list[HitOut]


class SearchResponse(BaseModel):
    results: list[QueryResult] = Field(..., description="One per query, in the order asked.")
    generation: int = Field(..., description="The index version that answered.")
    took_ms: float


class EmbedResponse(BaseModel):
    embeddings: list[list[float]]
    dim: int
    transformed: bool
    generation: int


class ReadyResponse(BaseModel):
    ready: bool
    generation: int = Field(..., description="The index version being served.")


class InfoResponse(BaseModel):
    ready: bool
    index: dict[str, Any] | None = Field(
        ..., description="The serving version: what `retrieval info --json` shows (null while loading)."
    )
    server: dict[str, Any] = Field(..., description="The server: reloads, limits, batching, threads.")


class ReloadResponse(BaseModel):
    reloaded: bool = Field(..., description="False when the directory holds the version already served: nothing read.")
    generation: int = Field(..., description="The index version now served.")
    seconds: float


class ErrorBody(BaseModel):
    code: str
    message: str
    param: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody


ERROR_TEXTS = {
    401: "Missing or wrong API key",
    409: "The new version was refused; the old one serves on",
    413: "Body or batch too large",
    415: "Body not sent as JSON (Content-Type), or compressed (Content-Encoding)",
    422: "Invalid request",
    429: "Too many queries waiting",
    503: "Index not loaded yet, or shutting down",
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The error responses of a route, for the OpenAPI spec (client generators type only the statuses listed)."""
    return {code: {"model": ErrorResponse, "description": ERROR_TEXTS[code]} for code in codes}


ERRORS = errors(401, 413, 422, 429, 503)
BODY_ERRORS = errors(401, 413, 415, 422, 429, 503)  # a route that reads a JSON body
# A route whose own responses are not JSON (/metrics): FastAPI would give a `model` its media type, so the error is
# given by reference (the search and embed routes put ErrorResponse among the spec's schemas).
JSON_401: dict[int | str, dict[str, Any]] = {
    401: {
        "description": ERROR_TEXTS[401],
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }
}


# ----- metrics -----------------------------------------------------------------------------------------------
class Metrics:
    LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
    BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

    def __init__(self, service: Service):
        self.registry = r = Registry()
        self.requests = Counter(r, "retrieval_requests_total", "HTTP requests by route, method and status.")
        self.errors = Counter(r, "retrieval_errors_total", "Error responses by code.")
        self.latency = Histogram(
            r, "retrieval_request_duration_seconds", "Time to answer a request, by route.", self.LATENCY_BUCKETS
        )
        self.batch_size = Histogram(r, "retrieval_batch_size", "Queries per engine batch.", self.BATCH_BUCKETS)
        self.batch_seconds = Histogram(
            r, "retrieval_batch_duration_seconds", "Time to encode and search one batch.", self.LATENCY_BUCKETS
        )
        self.queue_wait = Histogram(
            r, "retrieval_queue_wait_seconds", "Time the oldest job of a batch waited.", self.LATENCY_BUCKETS
        )
        self.queries = Counter(r, "retrieval_queries_total", "Texts encoded by the engine (searches and embeds).")
        Gauge(r, "retrieval_queue_queries", "Queries waiting for the engine.", lambda: service.batcher.queued)
        Gauge(r, "retrieval_ready", "1 once an index version is loaded and warmed.", lambda: float(service.ready))
        Gauge(r, "retrieval_index_generation", "Generation of the serving index version.", lambda: _generation(service))
        Gauge(r, "retrieval_index_documents", "Documents in the serving index version.", lambda: _documents(service))
        Gauge(
            r, "retrieval_index_loads_ok", "Index versions loaded, the first included.", lambda: _loads(service, "ok")
        )
        Gauge(r, "retrieval_index_loads_failed", "Index versions refused.", lambda: _loads(service, "failed"))

    def on_batch(self, stats: BatchStats) -> None:
        self.batch_size.observe(stats.queries)
        self.batch_seconds.observe(stats.seconds)
        self.queue_wait.observe(stats.waited)
        self.queries.inc(amount=stats.queries)


def _generation(service: Service) -> float | None:
    searcher = service.serving  # not `ready`: a scrape while stopping still says which version is draining
    return None if searcher is None else float(searcher.manifest.generation)


def _loads(service: Service, result: str) -> float:
    return float(service.reloads[result])


def _documents(service: Service) -> float | None:
    searcher = service.serving
    return None if searcher is None else float(searcher.manifest.n)


class ObserveRequests:
    """Pure ASGI middleware: counts every response by route template and status, and times it."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), 500

        async def observed(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observed)
        finally:
            path = route_label(scope)
            method = scope["method"] if scope["method"] in HTTP_METHODS else "other"  # h11 passes any token on
            self.metrics.requests.inc({"route": path, "method": method, "status": str(status)})
            self.metrics.latency.observe(time.perf_counter() - start, {"route": path})


class HeadAsGet:
    """Pure ASGI middleware: HEAD is answered as GET would be, without the body (RFC 9110 9.3.2). FastAPI's
    routes take only the methods they name, so an uptime check's ``HEAD /health`` would otherwise be a 405."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        as_get = {**scope, "method": "GET"}  # a copy: the server's own scope still says HEAD
        try:
            await self.app(as_get, receive, headers_only)
        finally:
            if "route" in as_get:  # for ObserveRequests, outside this one
                scope["route"] = as_get["route"]


class RequireHost:
    """Pure ASGI middleware: an HTTP/1.1 request without a ``Host`` header is refused with 400 (RFC 9112 3.2:
    a server MUST), as JSON like every error; uvicorn passed it on and it was answered."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("http_version") == "1.1":
            if not any(name == b"host" for name, _ in scope["headers"]):
                message = "an HTTP/1.1 request needs a Host header (RFC 9112 3.2)"
                await error_response(400, "missing_host", message)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def route_label(scope: Scope) -> str:
    """A request's route template, one of a bounded set: never the raw path (one label per URL asked for)."""
    route = scope.get("route")  # set by FastAPI's routes; /openapi.json is Starlette's, and a mount sets none
    if getattr(route, "path", None):
        return str(route.path)  # type: ignore[union-attr]
    if scope["path"] in DOC_ROUTES:
        return str(scope["path"])
    return DOCS_ASSETS if scope["path"].startswith(DOCS_ASSETS + "/") else "unmatched"


class LimitBody:
    """Pure ASGI middleware: a request body larger than ``max_bytes`` (by its Content-Length, or as it streams
    in) ends in 413 before it is parsed. Raised as an HTTPException from ``receive``, which FastAPI passes on to
    the error handlers, so the 413 has the same JSON shape as every other error."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        received = 0

        async def limited() -> Message:
            nonlocal received
            if declared.isdigit() and int(declared) > self.max_bytes:
                raise StarletteHTTPException(413)
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise StarletteHTTPException(413)
            return message

        await self.app(scope, limited, send)


# ----- the app -----------------------------------------------------------------------------------------------
def default_k(options: ServeOptions) -> int:
    """Hits for a request that gives no ``k``: 10, or the server's ``max_k`` when that is lower."""
    return min(10, options.max_k)


def param_bounds(options: ServeOptions) -> dict[str, tuple[int, int]]:
    """The inclusive range of each numeric search parameter: what the handlers enforce and the spec states."""
    return {
        "k": (1, options.max_k),
        "rescore": (0, options.max_rescore),
        "ef": (1, options.max_knob),
        "nprobe": (1, options.max_knob),
    }


def document_limits(app: FastAPI, options: ServeOptions) -> None:
    """Write the limits the handlers enforce into the OpenAPI spec (they are this server's options, not fixed in
    the models): k, rescore, ef and nprobe bounds, text lengths, batch sizes."""
    # Refused as empty too: a text of whitespace alone (a pattern is searched for anywhere in the string)
    text = {"minLength": 1, "maxLength": options.max_query_chars, "pattern": r"\S"}
    bounds: dict[str, dict[str, Any]] = {
        **{name: {"minimum": low, "maximum": high} for name, (low, high) in param_bounds(options).items()},
        "q": text,
        "query": text,
        "queries": {"minItems": 1, "maxItems": options.max_queries, "items": text},
        "inputs": {"minItems": 1, "maxItems": options.max_queries, "items": text} | text,
    }

    def constrain(schema: dict[str, Any], limits: dict[str, Any]) -> None:
        for branch in schema.get("anyOf", [schema]):  # a union: each branch takes the limits of its type
            kind = branch.get("type")
            for key, value in limits.items():
                if key == "items" and kind == "array":
                    branch.setdefault("items", {}).update(value)
                elif key != "items" and (kind == "array") == key.endswith("Items") and kind != "null":
                    branch[key] = value

    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()  # FastAPI's, kept in app.openapi_schema: written into once
            for model in ("SearchRequest", "EmbedRequest"):
                for name, prop in schema["components"]["schemas"][model]["properties"].items():
                    constrain(prop, bounds.get(name, {}))
            search = schema["components"]["schemas"]["SearchRequest"]
            search["properties"]["k"]["default"] = default_k(options)
            search["oneOf"] = [  # exactly one of the two given, as a text and as a list (null is "not given")
                {"required": ["query"], "properties": {"query": {"type": "string"}}},
                {"required": ["queries"], "properties": {"queries": {"type": "array"}}},
            ]
            for parameter in schema["paths"]["/search"]["get"]["parameters"]:
                constrain(parameter["schema"], bounds.get(parameter["name"], {}))
                if parameter["name"] == "k":
                    parameter["schema"]["default"] = default_k(options)
            return schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def check_api_key(key: str | None) -> None:
    """Refuse a key no client could send: it travels in an HTTP header (printable ASCII, no surrounding space)."""
    if key is not None and not (key.isascii() and key.isprintable() and key.strip() == key != ""):
        raise ConfigError("`api_key` must be printable ASCII without surrounding spaces (it travels in an HTTP header)")


def search_params(
    service: Service, k: int | None, rescore: int | None, ef: int | None, nprobe: int | None
) -> SearchParams:
    """The search knobs of a request, each checked against the server's bounds (``param_bounds``): 422 naming
    the field otherwise. A ``k`` left out is never one the server refuses (``default_k``)."""
    options = service.options
    k = default_k(options) if k is None else k
    given = {"k": k, "rescore": rescore, "ef": ef, "nprobe": nprobe}
    for name, (low, high) in param_bounds(options).items():
        value = given[name]
        if value is not None and not low <= value <= high:
            raise ApiError(422, "invalid_param", f"`{name}` must be between {low} and {high} (got {value})", name)
    if rescore and service.ready and service.searcher().manifest.stash is None:
        raise ApiError(422, "invalid_param", "this index kept no raw-vector stash: `rescore` must be 0", "rescore")
    extra = {} if rescore is None else {"rescore": rescore}  # None: the library's default depth
    params = SearchParams(k=k, ef_search=ef, nprobe=nprobe, **extra)
    try:
        params.check()
    except ConfigError as err:
        raise ApiError(422, "invalid_param", render(err, field_name), field_name(err.param or "") or None) from err
    return params


def query_texts(values: list[str], name: str, options: ServeOptions) -> list[str]:
    """The texts of field ``name``, each checked (not empty, valid UTF-8, within the length limit) and not more
    than the batch limit: 4xx naming the field and item otherwise."""
    if not values:
        raise ApiError(422, "empty_query", f"`{name}` holds no text", name)
    if len(values) > options.max_queries:
        raise ApiError(
            413, "too_many_queries", f"`{name}` holds {len(values)} texts; the limit is {options.max_queries}", name
        )
    for i, text in enumerate(values):
        where = f"`{name}`" if len(values) == 1 and name in ("query", "q") else f"`{name}` item {i}"
        if not valid_unicode(text):
            raise ApiError(422, "invalid_text", f"{where} holds a lone surrogate: send valid UTF-8 text", name)
        if blank(text):
            raise ApiError(422, "empty_query", f"{where} is empty (only whitespace or invisible characters)", name)
        if len(text) > options.max_query_chars:
            raise ApiError(
                422,
                "query_too_long",
                f"{where} has {len(text):,} characters; the limit is {options.max_query_chars:,}",
                name,
            )
    return values


def check_query_string(request: Request) -> None:
    """Refuse a GET /search query string whose parameters are unknown, repeated, or not UTF-8 once
    percent-decoded (Starlette decodes those to U+FFFD, which would be searched; a POST body that is not UTF-8
    is refused the same way)."""
    raw = request.scope.get("query_string", b"").decode("latin-1")
    for name, value in urllib.parse.parse_qsl(raw, keep_blank_values=True, errors="surrogateescape"):
        if not valid_unicode(name + value):
            param = name if valid_unicode(name) else None  # never echo what cannot be encoded
            where = f"`{param}`" if param else "a parameter name"
            message = f"{where} is not UTF-8 once percent-decoded: percent-encode UTF-8 text"
            raise ApiError(422, "invalid_text", message, param)
        if name in INT_PARAMS and not re.fullmatch(r"-?[0-9]+", value):  # strict, as POST is: Python's int()
            # (which FastAPI uses) also takes " 5", "+5", "1_0"; "5.0" and "5.000" came in through pydantic
            message = f"`{name}` must be a whole number in digits (got {value[:40]!r})"
            raise ApiError(422, "invalid_request", message, name)
    unknown = sorted(set(request.query_params) - {"q", *INT_PARAMS})
    if unknown:
        raise ApiError(422, "invalid_request", f"unknown parameter `{unknown[0]}`", unknown[0])
    twice = next((name for name in request.query_params if len(request.query_params.getlist(name)) > 1), None)
    if twice is not None:  # which of two values would count is a guess: refused
        several = "; POST /search takes several queries" if twice == "q" else ""
        raise ApiError(422, "invalid_request", f"give `{twice}` once{several}", twice)


def create_app(service: Service, api_key: str | None = None, manage: bool = True) -> FastAPI:
    """The FastAPI app serving ``service``. ``manage``: start the service with the app and stop it after.
    ``api_key``: when set, every route but /health (and the static page and the API docs, which hold no index
    data) needs ``Authorization: Bearer <key>``."""
    check_api_key(api_key)
    options = service.options
    metrics = Metrics(service)
    service.on_batch = metrics.on_batch

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage:
            service.start()
        try:
            yield
        finally:
            if manage:
                await asyncio.to_thread(service.stop, app.state.stop_timeout)

    app = FastAPIOffline(
        title="retrieval",
        version=retrieval.__version__,
        description="Whitened dense retrieval: search an index directory over HTTP.",
        lifespan=lifespan,
        static_url=DOCS_ASSETS,
    )
    document_limits(app, options)
    app.state.service = service
    app.state.stop_timeout = 30.0  # seconds the engine gets to drain its queue at shutdown; 0 after a forced quit
    app.state.metrics = metrics
    app.add_middleware(HeadAsGet)
    app.add_middleware(LimitBody, max_bytes=options.max_body_bytes)
    app.add_middleware(RequireHost)
    app.add_middleware(ObserveRequests, metrics=metrics)
    install_error_handlers(app, metrics)
    app.state.api_key = api_key.encode() if api_key else None
    # Every route on it needs the key; the spec says so (as HTTP bearer) when a key is set. KeyedRoute checks it.
    bearer = [Depends(HTTPBearer(auto_error=False, description="The server's API key"))] if api_key else []
    api = APIRouter(route_class=KeyedRoute, dependencies=bearer)

    _search_routes(api, service)
    _state_routes(app, api, service, metrics)
    _page_route(app, options)
    app.include_router(api)
    return app


def _search_routes(api: APIRouter, service: Service) -> None:
    """POST/GET /search and POST /embed: texts checked here, queued for the engine's micro-batches."""
    options = service.options

    async def answer(request: Request, future: Future[Answer]) -> Answer:
        """The engine's answer, unless the client closes its connection first: then its queued texts are
        withdrawn (the engine skips a cancelled request), not encoded for nobody. Under overload clients time out
        and retry, and each abandoned request used to cost a full encoding: the queue filled with them and every
        live request after timed out too. On SIGTERM uvicorn lets requests finish for ``--shutdown-timeout``
        seconds, then cancels them: one still waiting gets the JSON 503 ``shutting_down`` rather than uvicorn's
        plain-text 500 and a logged traceback (other cancellations pass on)."""
        waiting = asyncio.wrap_future(future)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            either: set[asyncio.Future[Any]] = {waiting, gone}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            waiting.cancel()
            if not service.stopping:
                raise
            raise _shutting_down() from None
        finally:
            gone.cancel()
        if not waiting.done():
            waiting.cancel()  # cancels ``future`` too: wrap_future passes a cancellation on to what it wraps
            raise _client_closed()
        return waiting.result()

    def encodes() -> None:
        """Refuse texts for an index built from vectors (and 503 before queueing when nothing is loaded yet)."""
        if service.searcher().encoder is None:
            raise ApiError(422, "no_encoder", "this index was built from precomputed vectors: it has no encoder")

    async def run_search(request: Request, texts: list[str], params: SearchParams) -> JSONResponse:
        start = time.perf_counter()
        encodes()
        result = await answer(request, service.batcher.submit_search(texts, params))
        results = [
            {"hits": [{"rank": h.rank, "id": h.id, "score": h.score, "text": h.text} for h in hits]}
            for hits in result.hits
        ]
        took = round((time.perf_counter() - start) * 1000, 3)
        return JSONResponse({"results": results, "generation": result.generation, "took_ms": took})

    search_doc = "Hits (rank, id, score, text) for each query, best first."

    @api.get(
        "/search",
        response_model=SearchResponse,
        responses=ERRORS,
        summary="Search with one query",
        description=search_doc,
    )
    async def search_get(
        request: Request,
        q: Annotated[str, Query(description="The query text.")],
        k: Annotated[
            int | None, Query(description="Hits per query (default 10, or the server's `max_k` when lower).")
        ] = None,
        rescore: Annotated[int | None, Query(description="Re-rank this many candidates.")] = None,
        ef: Annotated[int | None, Query(description="HNSW search beam width.")] = None,
        nprobe: Annotated[int | None, Query(description="IVF lists probed.")] = None,
    ) -> JSONResponse:
        check_query_string(request)
        texts = query_texts([q], "q", options)
        return await run_search(request, texts, search_params(service, k, rescore, ef, nprobe))

    @api.post(
        "/search",
        response_model=SearchResponse,
        responses=BODY_ERRORS,
        summary="Search with one query or a batch",
        description=search_doc,
    )
    async def search_post(request: Request, body: SearchRequest) -> JSONResponse:
        if (body.query is None) == (body.queries is None):
            raise ApiError(422, "invalid_request", "give either `query` (one text) or `queries` (a list)", "query")
        if body.query is not None:
            texts = query_texts([body.query], "query", options)
        else:
            texts = query_texts(body.queries or [], "queries", options)
        return await run_search(request, texts, search_params(service, body.k, body.rescore, body.ef, body.nprobe))

    @api.post(
        "/embed",
        response_model=EmbedResponse,
        responses=BODY_ERRORS,
        summary="Vectors of texts, by the index's own encoder",
    )
    async def embed(request: Request, body: EmbedRequest) -> JSONResponse:
        texts = query_texts([body.inputs] if isinstance(body.inputs, str) else body.inputs, "inputs", options)
        encodes()
        result = await answer(request, service.batcher.submit_embed(texts, body.transformed))
        vectors = result.vectors
        return JSONResponse(
            {
                "embeddings": vectors.tolist(),
                "dim": int(vectors.shape[1]),
                "transformed": body.transformed,
                "generation": result.generation,
            }
        )


def _state_routes(app: FastAPI, api: APIRouter, service: Service, metrics: Metrics) -> None:
    """/health (on ``app``: it never needs the key), /ready, /info, /metrics and POST /reload."""

    @app.get("/health", summary="Liveness: the process answers (never needs the API key)")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @api.get(
        "/ready",
        response_model=ReadyResponse,
        summary="Readiness: an index version is loaded and warmed",
        responses=errors(401, 503),
    )
    async def ready() -> JSONResponse:
        if service.stopping:  # a balancer stops sending here while the engine drains what it holds
            raise ApiError(503, "shutting_down", "the server is shutting down", ready=False)
        if not service.ready:
            raise ApiError(503, "not_ready", service.last_error or "the index is still loading", ready=False)
        return JSONResponse({"ready": True, "generation": service.searcher().manifest.generation})

    @api.get(
        "/info",
        response_model=InfoResponse,
        summary="What is served: `retrieval info` as JSON, and the server",
        responses=errors(401),
    )
    async def info() -> JSONResponse:
        return JSONResponse(describe(service))

    @api.get("/metrics", summary="Prometheus text format", response_class=PlainTextResponse, responses=JSON_401)
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.registry.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @api.post(
        "/reload",
        response_model=ReloadResponse,
        summary="Load the index directory's current version now",
        responses=errors(401, 409, 503),
    )
    async def reload() -> JSONResponse:
        try:
            outcome = await asyncio.to_thread(service.reload)
        except asyncio.CancelledError:  # the shutdown timeout ran out during a load: JSON, not uvicorn's 500
            if not service.stopping:
                raise
            raise _shutting_down() from None
        if service.stopping and not outcome.reloaded:
            raise _shutting_down()
        if outcome.error is not None:
            message = f"the new version was refused; still serving generation {outcome.generation}: {outcome.error}"
            raise ApiError(409, "reload_refused", message, generation=outcome.generation)
        # reloaded false: the directory holds the version served; nothing was read
        body = {"reloaded": outcome.reloaded, "generation": outcome.generation, "seconds": round(outcome.seconds, 3)}
        return JSONResponse(body)


def _page_route(app: FastAPI, options: ServeOptions) -> None:
    # The page is one static file; the server writes its own k limit into the k box, so it never offers a k
    # the server refuses (and needs no request, which the API key would refuse, to learn it).
    page_html = (STATIC / "index.html").read_text(encoding="utf-8")
    page_html = page_html.replace("__MAX_K__", str(options.max_k)).replace("__K__", str(default_k(options)))

    @app.get("/", include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(page_html)


class KeyedRoute(APIRoute):
    """A route that needs ``app.state.api_key`` (when set) as ``Authorization: Bearer <key>``, checked before
    FastAPI reads the body: a request without the key learns nothing, not even whether its JSON parses."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            key: bytes | None = request.app.state.api_key
            if key is not None and not _has_key(request, key):
                # RFC 6750 3.1: a key that was sent and is wrong is an invalid token; none sent, just the scheme
                wrong = ' error="invalid_token"' if "authorization" in request.headers else ""
                raise ApiError(
                    401,
                    "unauthorized",
                    "missing or wrong API key: send `Authorization: Bearer <key>`",
                    headers={"WWW-Authenticate": "Bearer" + wrong},
                )
            if self.body_field is not None:  # a route that reads a body (POST /reload takes none: not read)
                body = await _body(request)
                _check_content_type(request, body)
                parsed = _parse_refusing_repeated_keys(body)
                if parsed is not NOT_JSON:  # parsed once: Starlette's Request.json() returns what it cached here,
                    request._json = parsed  # which is what FastAPI reads the body with
                    _check_batch_size(parsed, request.app.state.service.options)
            return await handler(request)

        return checked


def _check_content_type(request: Request, body: bytes) -> None:
    """Refuse a body sent as something other than JSON (415, RFC 9110 15.5.16), or compressed: it would be read
    as bytes that are not UTF-8. FastAPI reads no body without a Content-Type (its strict default). Content-Encoding
    is a list, possibly over several header lines (RFC 9110 5.3): only ``identity`` entries mean none."""
    given = request.headers.get("content-type")
    if given is None and body:
        raise ApiError(415, "unsupported_media_type", "send the body as JSON with `Content-Type: application/json`")
    if given is not None:
        media = given.split(";", 1)[0].strip().lower()
        if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
            shown = media[:60] if media.isprintable() else "?"  # headers arrive as latin-1: always text
            message = f"send the body as JSON with `Content-Type: application/json` (got {shown!r})"
            raise ApiError(415, "unsupported_media_type", message)
    codings = [c.strip().lower() for line in request.headers.getlist("content-encoding") for c in line.split(",")]
    compressed = [c for c in codings if c not in ("", "identity")]
    if compressed:
        shown = compressed[0][:40] if compressed[0].isprintable() else "?"
        message = f"send the body uncompressed (Content-Encoding {shown!r})"
        raise ApiError(415, "unsupported_media_type", message, headers={"Accept-Encoding": "identity"})


async def _body(request: Request) -> bytes:
    """The request's body as sent: the client closing mid-body is a 499 (not a logged internal error), and the
    shutdown timeout running out while it is read is the JSON 503 ``shutting_down`` (not uvicorn's plain-text
    500)."""
    try:
        return await request.body()
    except ClientDisconnect:
        raise _client_closed() from None
    except asyncio.CancelledError:
        if not request.app.state.service.stopping:
            raise
        raise _shutting_down() from None


def _check_batch_size(parsed: Any, options: ServeOptions) -> None:
    """Refuse too many texts before the body is validated: validating a million wrong-typed items took seconds
    of the event loop (pydantic reports each), during which no request was answered, /health included."""
    if isinstance(parsed, dict):
        for name in ("queries", "inputs"):
            if isinstance(parsed.get(name), list) and len(parsed[name]) > options.max_queries:
                query_texts(parsed[name], name, options)  # raises 413 too_many_queries, as after validation


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed its connection: an ASGI server answers a receive after the whole body
    (a GET's empty one included) once the client goes. One that answers with more body messages instead, or a
    receive that raises, cannot tell: then never (not a busy loop, and never a false 499)."""
    try:
        for _ in range(2):  # a GET's body has not been read: its first message is that empty body
            if (await request.receive())["type"] == "http.disconnect":
                return
    except Exception:  # noqa: BLE001 - e.g. LimitBody's 413 for a GET declaring a large body it never reads: no
        pass  # news of the client, which is still there
    await asyncio.Event().wait()


def _client_closed() -> ApiError:
    return ApiError(499, "client_closed", "the client closed its connection before the answer")


def _shutting_down() -> ApiError:
    message = "the server is shutting down and stopped before answering this request; retry"
    return ApiError(503, "shutting_down", message)


class _Repeated(Exception):
    def __init__(self, key: str):
        self.key = key


NOT_JSON = object()


def _parse_refusing_repeated_keys(body: bytes) -> Any:
    """The JSON body, refused if it gives a key twice: the parser keeps the last, and which one the client meant
    is a guess (as a query parameter given twice is refused). ``NOT_JSON`` for anything that is not JSON, which
    is left to FastAPI to report."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in items:
            if not valid_unicode(key):  # never echoed; pydantic took it for a body that is not an object
                raise ApiError(422, "invalid_text", "a key holds a lone surrogate: send valid UTF-8 text")
            if key in seen:
                raise _Repeated(key)
            seen[key] = value
        return seen

    try:
        return json.loads(body, object_pairs_hook=pairs)
    except _Repeated as repeated:
        name = repeated.key if valid_unicode(repeated.key) else None  # never echo what cannot be encoded
        message = f"give `{name}` once" if name else "a key is given twice"
        raise ApiError(422, "invalid_request", message, name) from None
    except (ValueError, RecursionError):  # not JSON, or nested too deep to read: FastAPI's error says so
        return NOT_JSON


def describe(service: Service) -> dict[str, Any]:
    """/info: the serving version (what `retrieval info` shows, as fields and as its summary lines) and the
    server's own state (reloads, the last refused version, limits, engine settings)."""
    options = service.options
    server = {
        "retrieval": retrieval.__version__,
        "directory": str(service.directory),
        "ready": service.ready,
        "loaded_at": service.loaded_at,
        "loads": dict(service.reloads),
        "last_reload_error": service.last_error,
        "last_reload_error_at": service.last_error_at,
        "watch_interval_s": options.watch_interval,
        "limits": {
            "max_queries": options.max_queries,
            "max_query_chars": options.max_query_chars,
            "max_k": options.max_k,
            "max_rescore": options.max_rescore,
            "max_ef_nprobe": options.max_knob,
            "max_body_bytes": options.max_body_bytes,
            "max_queue": options.max_queue,
        },
        "batching": {
            "max_batch": options.max_batch,
            "max_wait_ms": options.max_wait_ms,
            "fill_wait_ms": options.fill_wait_ms,
        },
        "threads": {
            "torch": options.torch_threads,
            "torch_auto": service.threads.describe() if service.threads is not None else None,
            "faiss": options.faiss_threads,
            "blas": options.blas_threads,
            "engine_workers": options.engine_workers,
            "cpus": os.cpu_count(),
        },
    }
    searcher = service.serving  # while stopping too: the version draining what is in flight
    if searcher is None:
        return {"ready": False, "index": None, "server": server}
    m = searcher.manifest
    spec = m.transform.spec
    index = {
        "generation": m.generation,
        "created": m.created,
        "updated": m.updated,
        "model": m.encoder.model,
        "pooling": m.encoder.pooling,
        "max_length": m.encoder.max_length,
        "precision": m.encoder.precision_used or m.encoder.precision,
        "transform": m.transform.kind,
        "d": m.transform.d,
        "k": m.transform.k,
        "gamma": spec.gamma if m.transform.kind == "whitening" else None,
        "n": m.n,
        "index_kind": m.index.kind,
        "factory": m.index.factory,
        "search_defaults": m.index.search,
        "stash": m.stash is not None,
        "versions": m.versions,
        **searcher.describe(),  # summary, spectrum, drift: as `retrieval info --json` has them
    }
    return {"ready": service.ready, "index": index, "server": server}


def install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Every error as ``{"error": {"code", "message", "param"}}``; counted by code; no traceback in a body."""

    def counted(handler: Callable[[Request, Any], JSONResponse]) -> Callable[[Request, Any], Awaitable[JSONResponse]]:
        async def wrapped(request: Request, exc: Any) -> JSONResponse:
            response = handler(request, exc)
            code = getattr(exc, "code", None) or _code_of(response)
            metrics.errors.inc({"code": code})
            return response

        return wrapped

    def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    def validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_response(exc.errors())

    def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:  # FastAPI's "error parsing the body": JSON that json.loads could not read
            return error_response(422, "invalid_json", f"the body is not valid JSON ({_unreadable(exc.__cause__)})")
        code = STATUS_CODES.get(exc.status_code, "http_error")
        message = {
            404: f"no route {request.url.path}; see /docs",
            405: f"{request.method} is not allowed on {request.url.path}; see /docs",
            413: f"the request body is larger than {_max_body(request)} bytes",
        }.get(exc.status_code, str(exc.detail))
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:  # Starlette names only the first route of the path (GET of /search's GET and POST)
            headers = {"Allow": _allowed(request)}
        return error_response(exc.status_code, code, message, headers=headers)

    def library_error(request: Request, exc: RetrievalError) -> JSONResponse:
        if isinstance(exc, Overloaded):
            return error_response(429, "overloaded", f"{exc}; retry shortly", headers={"Retry-After": "1"})
        if isinstance(exc, (NotReady, Stopped)):
            return error_response(503, "not_ready" if isinstance(exc, NotReady) else "shutting_down", str(exc))
        if isinstance(exc, ConfigError):
            param = field_name(exc.param) if exc.param else None
            return error_response(422, "invalid_param", render(exc, field_name), param)
        log.error("%s %s failed: %s", request.method, request.url.path, exc)
        return error_response(500, "index_error", render(exc, field_name))

    def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(500, "internal", "internal error; the server logged it")

    app.add_exception_handler(ApiError, counted(api_error))  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, counted(validation))  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, counted(http_error))  # type: ignore[arg-type]
    app.add_exception_handler(RetrievalError, counted(library_error))  # type: ignore[arg-type]
    app.add_exception_handler(Exception, counted(unexpected))


def _has_key(request: Request, key: bytes) -> bool:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key)


def _allowed(request: Request) -> str:
    """The methods some route takes at the request's path (asked of the routes: included routers are nested;
    HEAD wherever GET is, as ``HeadAsGet`` answers it)."""

    # Under a mount (the docs' assets) the scope's root_path has grown by the mount's path: the app's routes
    # must see the path as the app does, or none matches and Allow comes out empty
    top = {**request.scope, "root_path": request.scope.get("app_root_path", request.scope.get("root_path", ""))}

    def takes(method: str) -> bool:
        if method == "HEAD":
            method = "GET"
        for route in request.app.routes:
            if route.matches({**top, "method": method})[0] is Match.FULL:
                # the docs' static files, a mount, match any method but answer GET only
                return method == "GET" or getattr(route, "path", None) != DOCS_ASSETS
        return False

    return ", ".join(method for method in sorted(HTTP_METHODS) if takes(method))


def _unreadable(cause: BaseException | None) -> str:
    if isinstance(cause, UnicodeDecodeError):
        return "not UTF-8 text"
    if isinstance(cause, RecursionError):
        return "nested too deeply"
    if isinstance(cause, ValueError):  # Python reads at most 4,300 digits of an integer
        return "a number has too many digits"
    return "unreadable"


def _max_body(request: Request) -> str:
    service = getattr(request.app.state, "service", None)
    return f"{service.options.max_body_bytes:,}" if service is not None else "the limit of"


def _code_of(response: JSONResponse) -> str:
    import json

    try:
        return str(json.loads(bytes(response.body))["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "unknown"


def validation_response(errors: Any) -> JSONResponse:
    """pydantic's list of errors as one message about the first, naming the field as the client spelled it."""
    errors = list(errors)
    first: dict[str, Any] = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = list(first.get("loc", ()))
    if loc and loc[0] in ("body", "query", "path", "header"):  # where it was: not part of the field's name
        loc = loc[1:]
    param = next((str(p) for p in loc if isinstance(p, str)), None)
    kind, msg = first.get("type", ""), str(first.get("msg", "invalid"))
    if kind == "json_invalid":
        return error_response(422, "invalid_json", f"the body is not valid JSON ({first.get('ctx', {}).get('error')})")
    if kind == "extra_forbidden":
        return error_response(422, "invalid_request", f"unknown field `{param}`", param)
    if kind == "missing" and param is None:  # the body itself
        return error_response(422, "invalid_request", "the body is missing: send a JSON object")
    if kind == "missing":
        return error_response(422, "invalid_request", f"`{param}` is required", param)
    if param is None:
        message = f"the body must be a JSON object, sent as Content-Type: application/json ({msg})"
        return error_response(422, "invalid_request", message)
    path = [p for i, p in enumerate(loc) if isinstance(p, int) or i == 0]  # drops union tags such as "str"
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    at = f" (at {where})" if where != param else ""
    return error_response(422, "invalid_request", f"`{param}`: {msg}{at}", param)


def run(
    directory: Path,
    options: ServeOptions,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    shutdown_timeout: int = 30,
    log_level: str = "info",
) -> None:
    """Serve until SIGINT/SIGTERM: uvicorn stops accepting, lets requests in flight finish (up to
    ``shutdown_timeout`` seconds), then the app's lifespan drains the engine."""
    import uvicorn

    bound_onednn_caches()  # before the service imports torch
    service = Service(directory, options)
    app = create_app(service, api_key=api_key or os.environ.get(API_KEY_ENV) or None)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            service.begin_shutdown()  # from the signal on: not ready, and a request cancelled at the timeout gets 503
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets: Any = None) -> None:
            await super().shutdown(sockets)
            # A second Ctrl-C before uvicorn reached the app's shutdown: it skips it, and the lifespan, cancelled
            # at exit, logged a traceback. It ends now, the engine's queue dropped (its threads are daemons): a
            # forced quit does not wait. Not twice: a Ctrl-C during the app's shutdown finds it done.
            finished = getattr(self.lifespan, "shutdown_event", None)
            if self.force_exit and finished is not None and not finished.is_set():
                app.state.stop_timeout = 0.0
                await self.lifespan.shutdown()

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=shutdown_timeout,
        access_log=False,
        server_header=False,
        ws="none",  # no WebSocket route: an upgrade request is answered as plain HTTP (JSON errors), not 403
    )
    server = Server(config)
    try:
        server.run()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (``Terminated``), re-raised by uvicorn once it has shut down
        pass  # the way a server is meant to stop: exit 0
    if not server.started:  # e.g. the port is taken: uvicorn logged why; its exit status, as uvicorn.run gives
        raise SystemExit(3)
