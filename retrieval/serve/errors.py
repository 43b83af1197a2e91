"""One JSON error shape for every failure: ``{"error": {"code", "message", "param"}}``, the handlers that turn
FastAPI's, Starlette's and the library's errors into it (counted by code), and no traceback in any body."""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from retrieval.errors import ConfigError, RetrievalError, render
from retrieval.serve.batching import Overloaded, Stopped
from retrieval.serve.metrics import Metrics
from retrieval.serve.service import NotReady

log = logging.getLogger(__name__)

HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "CONNECT"})
DOCS_ASSETS = "/docs/assets"  # Swagger UI and ReDoc, served from fastapi-offline's copies: no CDN is reachable
DOC_ROUTES = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})  # FastAPI's own pages
# On every response, errors too (the 500 of an unexpected error leaves through Starlette's outermost middleware,
# outside ours: ``error_response`` sets them itself). The CSP allows what the search page at / and the offline
# /docs and /redoc pages use: their own scripts and styles (inline ones too), data: images and fonts, and
# ReDoc's blob: worker; nothing from another origin, no plugins, and no page may frame these.
SECURITY_HEADERS = {
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "content-security-policy": (
        "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; font-src 'self' data:; worker-src 'self' blob:; connect-src 'self'; "
        "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "referrer-policy": "no-referrer",
}
FIELDS = {"ef_search": "ef"}  # library parameter -> JSON field, where they differ
STATUS_CODES = {
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    431: "headers_too_large",
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
    retry = {"Retry-After": "1"} if status in (429, 503) else {}  # every refusal that a retry can cure says when
    return JSONResponse(body, status_code=status, headers={**SECURITY_HEADERS, **retry, **(headers or {})})


def client_closed() -> ApiError:
    return ApiError(499, "client_closed", "the client closed its connection before the answer")


def shutting_down() -> ApiError:
    message = "the server is shutting down and stopped before answering this request; retry"
    return ApiError(503, "shutting_down", message)


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

    try:
        return str(json.loads(bytes(response.body))["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "unknown"


# Request names that were renamed, refused with the new name in the message: accepting both would make requests the
# OpenAPI document allows (both given) ones the server refuses, and no release promised the old name.
RENAMED = {"ef": "ef_search"}


def renamed(name: str | None) -> str:
    """What to append to "unknown parameter `name`" when ``name`` is an old name: the name it has now."""
    return f": it is `{RENAMED[name]}` now" if name in RENAMED else ""


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
        return error_response(422, "invalid_request", f"unknown field `{param}`{renamed(param)}", param)
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
