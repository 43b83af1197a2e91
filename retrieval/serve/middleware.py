"""Pure ASGI middleware: request metrics, HEAD as GET, the Host header HTTP/1.1 requires, the header and body size
limits, admission to the engine before a body is read, and the security headers of every response."""

from __future__ import annotations

import hmac
import time

from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from retrieval.serve.batching import Batcher, Overloaded, Stopped
from retrieval.serve.errors import DOC_ROUTES, DOCS_ASSETS, HTTP_METHODS, SECURITY_HEADERS, error_response
from retrieval.serve.metrics import Metrics

# The routes whose requests the engine answers: admitted (``Admit``) before their body is read.
ENGINE_ROUTES = frozenset(
    {("GET", "/search"), ("HEAD", "/search"), ("POST", "/search"), ("POST", "/embed"), ("POST", "/v1/embeddings")}
)
ROUTE_KEY = "retrieval.route"  # the scope key naming the route of a request answered before routing (metrics)
ADMISSION_KEY = "retrieval.admission"  # ... holding the request's ``Admission``, for the handler's submission
TIMING_KEY = "retrieval.timing"  # ... where the handler leaves (seconds queued, seconds in the engine)


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
    if ROUTE_KEY in scope:  # refused before routing (``Admit``): one of ENGINE_ROUTES
        return str(scope[ROUTE_KEY])
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


# What one request's headers may hold: nginx answers 400 beyond 4 x 8 KB of header lines, Apache beyond 100 fields.
# Beyond these a request is answered 431 before any route reads it: a 200 KB header or 5,000 headers were answered
# 200, each one parsed into every dict of headers the request's handlers built.
MAX_HEADERS = 100
MAX_HEADER_BYTES = 32 * 1024


class LimitHeaders:
    """Pure ASGI middleware: a request with more than ``max_count`` header fields, or more than ``max_bytes``
    of names and values together, gets 431 Request Header Fields Too Large (RFC 6585 5), as JSON like every
    error. uvicorn's httptools parser sets no such limit, and its h11 one only on the bytes."""

    def __init__(self, app: ASGIApp, max_count: int = MAX_HEADERS, max_bytes: int = MAX_HEADER_BYTES):
        self.app, self.max_count, self.max_bytes = app, max_count, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = scope["headers"]
            size = sum(len(name) + len(value) for name, value in headers)
            if len(headers) > self.max_count or size > self.max_bytes:
                message = (
                    f"the request has {len(headers):,} header fields of {size:,} bytes; the server takes at most "
                    f"{self.max_count:,} fields and {self.max_bytes:,} bytes"
                )
                await error_response(431, "headers_too_large", message)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class SecurityHeaders:
    """Pure ASGI middleware: every response says how a browser may use it (``SECURITY_HEADERS``: no MIME
    sniffing, no framing, scripts and styles from the server itself only), unless a route set its own."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS.items():
                    if name not in headers:
                        headers[name] = value
            await send(message)

        await self.app(scope, receive, secured)


class Admit:
    """Pure ASGI middleware: a request for the engine (``ENGINE_ROUTES``) is admitted (``Batcher.admit``) before
    its body is read, or refused at once with 429 and ``Retry-After`` when the work already ahead of it exceeds
    the server's budget (``--max-queue-ms``); a request without the API key the server needs passes on to its
    401. An admitted request counts as work ahead of later ones until its handler submits it to the engine.

    Its answers carry ``Server-Timing`` (``app``: from here to the answer; ``queue`` and ``engine``: the seconds
    the handler reports under ``TIMING_KEY``), so a client can tell where the time of a request went, and what
    came before the app (the server's event loop, the network) as its own measure less ``app``."""

    def __init__(self, app: ASGIApp, batcher: Batcher, metrics: Metrics):
        self.app, self.batcher, self.metrics = app, batcher, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"]) not in ENGINE_ROUTES or not _keyed(scope):
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        try:
            admission = self.batcher.admit()
        except (Overloaded, Stopped) as err:
            scope[ROUTE_KEY] = scope["path"]
            if isinstance(err, Overloaded):
                code, message, status = "overloaded", f"{err}; retry shortly", 429
            else:
                code, message, status = "shutting_down", str(err), 503
            self.metrics.errors.inc({"code": code})
            await error_response(status, code, message)(scope, receive, send)
            return
        scope[ADMISSION_KEY] = admission

        async def timed(message: Message) -> None:
            if message["type"] == "http.response.start":
                parts = [f"app;dur={(time.perf_counter() - start) * 1000:.2f}"]
                waited, ran = scope.get(TIMING_KEY, (None, None))
                if waited is not None:
                    parts += [f"queue;dur={waited * 1000:.2f}", f"engine;dur={ran * 1000:.2f}"]
                MutableHeaders(scope=message).append("Server-Timing", ", ".join(parts))
            await send(message)

        try:
            await self.app(scope, receive, timed)
        finally:
            admission.release()  # nothing if the handler submitted it


def _keyed(scope: Scope) -> bool:
    """The request carries the API key the server needs (or it needs none)."""
    key: bytes | None = scope["app"].state.api_key if "app" in scope else None
    if key is None:
        return True
    given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
    scheme, _, token = given.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)
