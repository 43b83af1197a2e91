"""The routes: /search and /embed through the engine's micro-batches, /health, /ready, /info, /metrics,
/reload, and the search page at /."""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse

import retrieval
from retrieval.options import described, values
from retrieval.search import SearchParams
from retrieval.serve.errors import ApiError, client_closed, shutting_down
from retrieval.serve.metrics import Metrics
from retrieval.serve.middleware import ADMISSION_KEY, TIMING_KEY
from retrieval.serve.openai_compat import openai_routes
from retrieval.serve.requests import check_query_string, disconnected, parse_filter, query_texts, search_params
from retrieval.serve.schemas import (
    BODY_ERRORS,
    ERRORS,
    JSON_401,
    RERANK_TEXT,
    EmbedRequest,
    EmbedResponse,
    InfoResponse,
    ReadyResponse,
    ReloadResponse,
    SearchRequest,
    SearchResponse,
    WholeNumberText,
    default_k,
    errors,
)
from retrieval.serve.service import ServeOptions, Service

Answer = TypeVar("Answer")
STATIC = Path(__file__).parent / "static"


def search_routes(api: APIRouter, service: Service) -> None:
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
        gone = asyncio.ensure_future(disconnected(request))
        try:
            either: set[asyncio.Future[Any]] = {waiting, gone}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            waiting.cancel()
            if not service.stopping:
                raise
            raise shutting_down() from None
        finally:
            gone.cancel()
        if not waiting.done():
            waiting.cancel()  # cancels ``future`` too: wrap_future passes a cancellation on to what it wraps
            raise client_closed()
        result = waiting.result()
        if hasattr(result, "waited"):  # for the answer's Server-Timing (middleware.Admit)
            request.scope[TIMING_KEY] = (result.waited, getattr(result, "ran", 0.0))
        return result

    def encodes() -> None:
        """Refuse texts for an index built from vectors (and 503 before queueing when nothing is loaded yet)."""
        if service.searcher().encoder is None:
            raise ApiError(422, "no_encoder", "this index was built from precomputed vectors: it has no encoder")

    async def run_search(request: Request, texts: list[str], params: SearchParams) -> JSONResponse:
        start = time.perf_counter()
        encodes()
        admission = request.scope.get(ADMISSION_KEY)
        result = await answer(request, service.batcher.submit_search(texts, params, admission=admission))
        results = [
            {"hits": [{"rank": h.rank, "id": h.id, "score": h.score, "text": h.text, "title": h.title} for h in hits]}
            for hits in result.hits
        ]
        took = round((time.perf_counter() - start) * 1000, 3)
        return JSONResponse({"results": results, "generation": result.generation, "took_ms": took})

    search_doc = (
        "Hits (rank, id, score, text) for each query, best first. A filter over the columns the index kept: "
        'POST `filter` as {"and": [...]}, {"or": [...]}, {"not": {...}} or {"column": ..., "op": ..., '
        '"value": ...} (op: =, !=, <, <=, >, >=, in, not in, is null, is not null); GET `where` as text, e.g. '
        "year >= 2020 and source = 'pubmed'. A filter naming a column the index did not keep, a value of the wrong "
        "type or a syntax error is a 422 naming it."
    )

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
            WholeNumberText | None,
            Query(description="Hits per query (default 10, or the server's `max_k` when lower)."),
        ] = None,
        rescore: Annotated[WholeNumberText | None, Query(description="Re-rank this many candidates.")] = None,
        ef_search: Annotated[WholeNumberText | None, Query(description="HNSW search beam width.")] = None,
        nprobe: Annotated[WholeNumberText | None, Query(description="IVF lists probed.")] = None,
        rerank: Annotated[WholeNumberText | None, Query(description=RERANK_TEXT)] = None,
        mode: Annotated[
            Literal["dense", "lexical", "hybrid"] | None, Query(description="dense, lexical or hybrid.")
        ] = None,
        where: Annotated[str | None, Query(include_in_schema=False)] = None,  # see search_doc and schemas.SearchRequest
    ) -> JSONResponse:
        check_query_string(request)
        texts = query_texts([q], "q", options)
        params = search_params(service, k, rescore, ef_search, nprobe, mode, parse_filter(where, None), rerank)
        return await run_search(request, texts, params)

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
        where = parse_filter(None, body.filter)
        params = search_params(
            service, body.k, body.rescore, body.ef_search, body.nprobe, body.mode, where, body.rerank
        )
        return await run_search(request, texts, params)

    openai_routes(api, service, answer, encodes)

    @api.post(
        "/embed",
        response_model=EmbedResponse,
        responses=BODY_ERRORS,
        summary="Vectors of texts, by the index's own encoder",
    )
    async def embed(request: Request, body: EmbedRequest) -> JSONResponse:
        texts = query_texts([body.inputs] if isinstance(body.inputs, str) else body.inputs, "inputs", options)
        encodes()
        admission = request.scope.get(ADMISSION_KEY)
        result = await answer(request, service.batcher.submit_embed(texts, body.transformed, admission=admission))
        vectors = result.vectors
        return JSONResponse(
            {
                "embeddings": vectors.tolist(),
                "dim": int(vectors.shape[1]),
                "transformed": body.transformed,
                "generation": result.generation,
            }
        )


def state_routes(app: FastAPI, api: APIRouter, service: Service, metrics: Metrics) -> None:
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
            raise shutting_down() from None
        if service.stopping and not outcome.reloaded:
            raise shutting_down()
        if outcome.error is not None:
            message = f"the new version was refused; still serving generation {outcome.generation}: {outcome.error}"
            raise ApiError(409, "reload_refused", message, generation=outcome.generation)
        # reloaded false: the directory holds the version served; nothing was read
        body = {"reloaded": outcome.reloaded, "generation": outcome.generation, "seconds": round(outcome.seconds, 3)}
        return JSONResponse(body)


def page_route(app: FastAPI, options: ServeOptions) -> None:
    # The page is one static file; the server writes its own k limit into the k box, so it never offers a k
    # the server refuses (and needs no request, which the API key would refuse, to learn it).
    page_html = (STATIC / "index.html").read_text(encoding="utf-8")
    page_html = page_html.replace("__MAX_K__", str(options.max_k)).replace("__K__", str(default_k(options)))

    @app.get("/", include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(page_html)


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
        **{group: grouped(options, group) for group in ("limits", "batching")},
        "options": values(options),  # each option with its value, default and help, from ServeOptions' fields
        "threads": {
            "torch": options.torch_threads,
            "torch_auto": service.threads.describe() if service.threads is not None else None,
            "faiss": options.faiss_threads,
            "blas": options.blas_threads,
            "engine_workers": options.engine_workers,
            "cpus": os.cpu_count(),
        },
        "admission": admission_state(service),
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
        "dim": m.transform.dim,
        "gamma": spec.gamma if m.transform.kind == "whitening" else None,
        "n": m.n,
        "index_kind": m.index.kind,
        "factory": m.index.factory,
        "search_defaults": m.index.search,
        "stash": m.stash is not None,
        "rescore_depth": m.rescoring.depth,  # candidates re-scored by default; 0: off
        "versions": m.versions,
        **searcher.describe(),  # summary, spectrum, drift: as `retrieval info --json` has them
        # what the search page offers controls for: the search modes, and a filter per kept column
        "modes": ["dense", "lexical", "hybrid"] if m.lexical is not None else ["dense"],
        "default_mode": "hybrid" if m.lexical is not None else "dense",
        "columns": [{"name": name, "type": kind} for name, kind in m.columns.items()],
    }
    return {"ready": service.ready, "index": index, "server": server}


def admission_state(service: Service) -> dict[str, Any]:
    """What admission to the engine sees now: the queries queued, the requests admitted and not yet submitted,
    the engine's measured pace, the work ahead of a new request in ms at that pace against the budget, and the
    requests refused so far (``edge``: before their body was read; ``queue``: at submission)."""
    batcher = service.batcher
    return {
        "queued_queries": batcher.queued,
        "admitted_requests": batcher.pending,
        "pace_ms_per_query": round(batcher.pace * 1000, 3),
        "expected_wait_ms": round(batcher.expected_wait() * 1000, 3),
        "max_queue_ms": service.options.max_queue_ms,
        "refused": dict(batcher.refused),
    }


def grouped(options: ServeOptions, group: str) -> dict[str, Any]:
    """The server's options of one group (``limits``, ``batching``), as their fields declare them."""
    return {
        item.name: getattr(options, item.name)
        for item in described(ServeOptions)
        if item.metadata.get("group") == group
    }
