"""The HTTP service's app (FastAPI), assembled from its parts, and ``run`` (uvicorn).

    GET  /search?q=...&k=10      POST /search {query | queries[], k, rescore, ef_search, nprobe, mode, filter}
    POST /embed {inputs, transformed}          GET /info    GET /metrics    POST /reload
    GET  /health (liveness, never protected)   GET /ready (loaded and warmed)    GET / (search page)

Every error, bad input or not, is ``{"error": {"code", "message", "param"}}`` with a 4xx status for what the
client can fix (422 invalid, 413 too large, 431 headers too large, 401 key, 404/405, 429 queue full) and
503/409/500 for the server's own state; no traceback ever reaches a response. Searches and embeddings go
through the service's micro-batching engine; the route handlers only validate, wait and format.

Only this package (and the CLI's `serve`) imports fastapi: the core never does.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI
from fastapi.security import HTTPBearer
from fastapi_offline import FastAPIOffline

import retrieval
from retrieval import runtime
from retrieval.errors import ConfigError
from retrieval.serve.errors import DOCS_ASSETS, install_error_handlers
from retrieval.serve.metrics import Metrics
from retrieval.serve.middleware import (
    Admit,
    HeadAsGet,
    LimitBody,
    LimitHeaders,
    ObserveRequests,
    RequireHost,
    SecurityHeaders,
)
from retrieval.serve.openai_compat import dimension_range
from retrieval.serve.requests import KeyedRoute
from retrieval.serve.routes import page_route, search_routes, state_routes
from retrieval.serve.schemas import document_limits
from retrieval.serve.service import ServeOptions, Service

log = logging.getLogger(__name__)

API_KEY_ENV = "RETRIEVAL_API_KEY"


def check_api_key(key: str | None) -> None:
    """Refuse a key no client could send: it travels in an HTTP header (printable ASCII, no surrounding space)."""
    if key is not None and not (key.isascii() and key.isprintable() and key.strip() == key != ""):
        raise ConfigError("`api_key` must be printable ASCII without surrounding spaces (it travels in an HTTP header)")


def api_key_in_use(given: str | None) -> str | None:
    """The key the server requires: ``given``, else ``RETRIEVAL_API_KEY``. A key set empty or blank, from either
    source, is refused: it turned authentication off without a word."""
    key = given if given is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        source = f"{API_KEY_ENV} is set" if given is None else "`api_key` is"
        raise ConfigError(
            f"{source} empty, which would leave the API open: give a key, or unset {API_KEY_ENV} to serve without one",
            "api_key",
        )
    check_api_key(key)
    return key


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
    document_limits(app, options, lambda: dimension_range(service), service.kept_columns)
    app.state.service = service
    app.state.stop_timeout = 30.0  # seconds the engine gets to drain its queue at shutdown; 0 after a forced quit
    app.state.metrics = metrics
    app.add_middleware(HeadAsGet)
    app.add_middleware(LimitBody, max_bytes=options.max_body_bytes)
    app.add_middleware(Admit, batcher=service.batcher, metrics=metrics)  # before the body is read
    app.add_middleware(RequireHost)
    app.add_middleware(LimitHeaders)  # before anything reads a header
    app.add_middleware(ObserveRequests, metrics=metrics)
    app.add_middleware(SecurityHeaders)
    install_error_handlers(app, metrics)
    app.state.api_key = api_key.encode() if api_key else None
    # Every route on it needs the key; the spec says so (as HTTP bearer) when a key is set. KeyedRoute checks it.
    bearer = [Depends(HTTPBearer(auto_error=False, description="The server's API key"))] if api_key else []
    api = APIRouter(route_class=KeyedRoute, dependencies=bearer)

    search_routes(api, service)
    state_routes(app, api, service, metrics)
    page_route(app, options)
    app.include_router(api)
    return app


def listen(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A socket listening on ``host``:``port`` (0: any free port), or a one-line ConfigError: an unknown host, a
    port in use, an address not of this machine. Bound before anything is loaded: a server that cannot listen
    used to load the model, announce itself, and only then fail in uvicorn's log."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as err:
        raise ConfigError(
            f"cannot resolve `host` {host!r} ({err.strerror}): give an address or name of this machine "
            "(127.0.0.1 for this machine only, 0.0.0.0 for every interface)",
            "host",
        ) from err
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
        sock.bind(address)
        sock.listen(backlog)
    except OSError as err:
        sock.close()
        reason = {
            errno.EADDRINUSE: "choose another `port`, or stop what listens there (0: any free port)",
            errno.EADDRNOTAVAIL: "it is not an address of this machine: choose another `host`",
            errno.EACCES: "ports below 1024 need privileges: choose another `port`",
        }.get(err.errno or 0, "choose another `host` or `port`")
        raise ConfigError(f"cannot listen on {host}:{port} ({err.strerror}): {reason}", "port") from err
    return sock


def url_of(host: str, sock: socket.socket) -> str:
    """The address a client uses: the host as given, the port the socket got (``port`` 0 asks for any)."""
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{sock.getsockname()[1]}/"


def run(
    directory: Path,
    options: ServeOptions,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    shutdown_timeout: int = 30,
    log_level: str = "info",
    announce: Callable[[str], None] | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM: uvicorn stops accepting, lets requests in flight finish (up to
    ``shutdown_timeout`` seconds), then the app's lifespan drains the engine.

    The API key (``api_key``, else ``RETRIEVAL_API_KEY``) is checked and the socket bound before anything is
    loaded; then ``announce`` is called with the URL served (the port the socket got, for ``port`` 0)."""
    import uvicorn

    key = api_key_in_use(api_key)
    sock = listen(host, port)
    try:
        if announce is not None:
            announce(url_of(host, sock))
        runtime.tune_process(serving=True)  # before the service imports torch
        service = Service(directory, options)
        app = create_app(service, api_key=key)

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: Any) -> None:
                service.begin_shutdown()  # from the signal on: not ready; a request cancelled at the timeout: 503
                super().handle_exit(sig, frame)

            async def shutdown(self, sockets: Any = None) -> None:
                await super().shutdown(sockets)
                # A second Ctrl-C before uvicorn reached the app's shutdown: it skips it, and the lifespan,
                # cancelled at exit, logged a traceback. It ends now, the engine's queue dropped (its threads are
                # daemons): a forced quit does not wait. Not twice: a Ctrl-C during the app's shutdown finds it done.
                finished = getattr(self.lifespan, "shutdown_event", None)
                if self.force_exit and finished is not None and not finished.is_set():
                    app.state.stop_timeout = 0.0
                    await self.lifespan.shutdown()

        config = uvicorn.Config(
            app,
            log_level=log_level,
            timeout_graceful_shutdown=shutdown_timeout,
            access_log=False,
            server_header=False,
            ws="none",  # no WebSocket route: an upgrade request is answered as plain HTTP (JSON errors), not 403
        )
        server = Server(config)
        try:
            server.run(sockets=[sock])  # the socket bound above: uvicorn serves it as it is
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM (``Terminated``), re-raised by uvicorn once it has shut down
            pass  # the way a server is meant to stop: exit 0
        if not server.started:  # the app failed to start: uvicorn logged why; its exit status, as uvicorn.run gives
            raise SystemExit(3)
    finally:
        sock.close()
