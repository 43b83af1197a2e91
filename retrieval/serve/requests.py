"""What a request must be before the engine sees it: the API key, a JSON body read once (no repeated keys, not
compressed, not too many texts), query strings, texts and search knobs within the server's limits."""

from __future__ import annotations

import asyncio
import hmac
import json
import urllib.parse
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect

from retrieval.errors import ConfigError, render
from retrieval.filters import Filter, FilterError, from_json, parse
from retrieval.search import SearchParams
from retrieval.serve.errors import ApiError, client_closed, field_name, renamed, shutting_down
from retrieval.serve.schemas import WHOLE_DIGITS, default_k, param_bounds
from retrieval.serve.service import ServeOptions, Service
from retrieval.text import blank, valid_unicode

INT_PARAMS = frozenset({"k", "rescore", "ef_search", "nprobe", "rerank"})  # GET /search's whole-number parameters


def search_params(
    service: Service,
    k: int | None,
    rescore: int | None,
    ef_search: int | None,
    nprobe: int | None,
    mode: str | None = None,
    where: Filter | None = None,
    rerank: int | None = None,
) -> SearchParams:
    """The search knobs of a request, each checked against the server's bounds (``param_bounds``): 422 naming
    the field otherwise. A ``k`` left out is never one the server refuses (``default_k``). A mode the index
    cannot serve and a filter over columns it did not keep (or of the wrong type) are 422s too, found now."""
    options = service.options
    k = default_k(options) if k is None else k
    given = {"k": k, "rescore": rescore, "ef_search": ef_search, "nprobe": nprobe, "rerank": rerank}
    for name, (low, high) in param_bounds(options).items():
        value = given[name]
        if value is not None and not low <= value <= high:
            raise ApiError(422, "invalid_param", f"`{name}` must be between {low} and {high} (got {value})", name)
    if rescore and service.ready and service.searcher().manifest.stash is None:
        raise ApiError(422, "invalid_param", "this index kept no raw-vector stash: `rescore` must be 0", "rescore")
    params = SearchParams(k=k, ef_search=ef_search, nprobe=nprobe, mode=mode, where=where, rerank=rerank)
    if rescore is not None:  # None: the library's default depth
        params = replace(params, rescore=rescore)
    try:
        params.check()
        if service.ready:
            searcher = service.searcher()
            searcher.mode(params)
            searcher.mask(where)
    except FilterError as err:
        raise ApiError(422, "invalid_filter", render(err, field_name), "filter") from err
    except ConfigError as err:
        raise ApiError(422, "invalid_param", render(err, field_name), field_name(err.param or "") or None) from err
    return params


def parse_filter(text: str | None, data: dict[str, Any] | None) -> Filter | None:
    """A request's filter: GET's ``where`` text or POST's ``filter`` object, as one structure; 422 naming it."""
    try:
        if text is not None:
            return parse(text)
        return from_json(data) if data is not None else None
    except FilterError as err:
        raise ApiError(
            422, "invalid_filter", render(err, field_name), "where" if text is not None else "filter"
        ) from err


def query_texts(values: list[str], name: str, options: ServeOptions) -> list[str]:
    """The texts of field ``name``, each checked (not empty, valid UTF-8, within the length limit) and not more
    than the batch limit: 4xx naming the field and item otherwise."""
    if not values:
        raise ApiError(422, "empty_query", f"`{name}` holds no text", name)
    if len(values) > options.max_queries:
        # 422, not 413: the spec states the limit as maxItems, so more is a request the schema refuses
        raise ApiError(
            422, "too_many_queries", f"`{name}` holds {len(values)} texts; the limit is {options.max_queries}", name
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
        if name in INT_PARAMS and not WHOLE_DIGITS.fullmatch(value):  # JSON Schema's integers, as POST takes:
            # Python's int() (which FastAPI uses) also takes " 5", "+5", "1_0"
            message = f"`{name}` must be a whole number in digits (got {value[:40]!r})"
            raise ApiError(422, "invalid_request", message, name)
    unknown = sorted(set(request.query_params) - {"q", "mode", "where", *INT_PARAMS})
    if unknown:
        raise ApiError(422, "invalid_request", f"unknown parameter `{unknown[0]}`{renamed(unknown[0])}", unknown[0])
    twice = next((name for name in request.query_params if len(request.query_params.getlist(name)) > 1), None)
    if twice is not None:  # which of two values would count is a guess: refused
        several = "; POST /search takes several queries" if twice == "q" else ""
        raise ApiError(422, "invalid_request", f"give `{twice}` once{several}", twice)


class ReadRequest(Request):
    """A request whose body was read and parsed before FastAPI's handler: it hands on those bytes and that JSON
    (the client's connection, for ``disconnected``, stays the original's)."""

    def __init__(self, request: Request, body: bytes, parsed: Any):
        super().__init__(request.scope, request.receive)
        self._read, self._parsed = body, parsed

    async def body(self) -> bytes:
        return self._read

    async def json(self) -> Any:
        return self._parsed


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
                if parsed is not NOT_JSON:  # parsed once: FastAPI reads the body through body() and json()
                    _check_batch_size(parsed, request.app.state.service.options)
                    request = ReadRequest(request, body, parsed)
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
        raise client_closed() from None
    except asyncio.CancelledError:
        if not request.app.state.service.stopping:
            raise
        raise shutting_down() from None


def _check_batch_size(parsed: Any, options: ServeOptions) -> None:
    """Refuse too many texts before the body is validated: validating a million wrong-typed items took seconds
    of the event loop (pydantic reports each), during which no request was answered, /health included."""
    if isinstance(parsed, dict):
        for name in ("queries", "inputs"):
            if isinstance(parsed.get(name), list) and len(parsed[name]) > options.max_queries:
                query_texts(parsed[name], name, options)  # raises 422 too_many_queries, as after validation


async def disconnected(request: Request) -> None:
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


def _has_key(request: Request, key: bytes) -> bool:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key)
