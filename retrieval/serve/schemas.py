"""Request and response models (what /docs shows), the error responses each route declares, and the server's
limits written into the OpenAPI spec."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

import pyarrow as pa
from fastapi import FastAPI
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from retrieval import filters
from retrieval.serve.service import ServeOptions
from retrieval.text import visible_pattern

WHOLE_DIGITS = re.compile(r"-?[0-9]+(\.0*)?")  # a query string's whole number: 5, -5, 5.0 (JSON Schema's integer)


def _whole(value: Any) -> Any:
    """JSON Schema's ``integer`` is any number without a fractional part, so 48.0 is one: taken as 48. Everything
    else goes on to strict validation unchanged (a bool, the string "48", 48.5: refused)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _whole_text(value: Any) -> Any:
    """A query string's whole number, as digits with at most a zero fraction ("48", "-3", "48.0"): an int; other
    text is left for validation to refuse (" 5", "+5", "1_0" and "5.5" are not JSON Schema integers)."""
    return int(value.split(".")[0]) if isinstance(value, str) and WHOLE_DIGITS.fullmatch(value) else value


WholeNumber = Annotated[int, BeforeValidator(_whole)]  # in a JSON body
WholeNumberText = Annotated[int, BeforeValidator(_whole_text)]  # in a query string


FILTER_TEXT = (
    'Keep only documents whose metadata columns match: {"and": [...]}, {"or": [...]}, {"not": {...}} or '
    '{"column", "op", "value"}, over the columns the served index kept (GET /info `index.columns`); at most '
    f"{filters.MAX_DEPTH} deep and {filters.MAX_NODES:,} conditions."
)


RERANK_TEXT = "Binary codes: Hamming candidates re-ranked by the query's floats against the codes' bits (0: off)."


class SearchRequest(BaseModel):
    """One query (`query`) or a batch (`queries`); knobs left out take the index's defaults."""

    model_config = ConfigDict(extra="forbid", strict=True)
    query: str | None = Field(None, description="One query text.", examples=["how do whitening transforms work"])
    queries: list[str] | None = Field(None, description="Several query texts, answered in order.")
    k: WholeNumber | None = Field(None, description="Hits per query (default 10, or the server's `max_k` when lower).")
    rescore: WholeNumber | None = Field(None, description="Re-rank this many candidates by the full stashed vectors.")
    ef_search: WholeNumber | None = Field(None, description="HNSW search beam width (efSearch) for this request.")
    nprobe: WholeNumber | None = Field(None, description="IVF lists probed for this request.")
    rerank: WholeNumber | None = Field(None, description=RERANK_TEXT)
    mode: Literal["dense", "lexical", "hybrid"] | None = Field(
        None, description="dense, lexical or hybrid (default: hybrid where the index has a lexical part)."
    )
    # Checked by ``filters.from_json`` and against the served index's columns (exact 422s); the OpenAPI document
    # states its grammar over those columns (``document_limits``), which the model cannot know.
    filter: dict[str, Any] | None = Field(None, description=FILTER_TEXT)


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
    title: str | None = Field(None, description="The title column of an index built with one (`text` starts with it).")


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
    413: "Body too large",
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


def default_k(options: ServeOptions) -> int:
    """Hits for a request that gives no ``k``: 10, or the server's ``max_k`` when that is lower."""
    return min(10, options.max_k)


def param_bounds(options: ServeOptions) -> dict[str, tuple[int, int]]:
    """The inclusive range of each numeric search parameter: what the handlers enforce and the spec states."""
    return {
        "k": (1, options.max_k),
        "rescore": (0, options.max_rescore),
        "ef_search": (1, options.max_ef_nprobe),
        "nprobe": (1, options.max_ef_nprobe),
        "rerank": (0, options.max_ef_nprobe),
    }


def document_limits(
    app: FastAPI,
    options: ServeOptions,
    dimensions: Callable[[], tuple[int, int] | None] = lambda: None,
    columns: Callable[[], pa.Schema | None] = lambda: None,
) -> None:
    """Write the limits the handlers enforce into the OpenAPI spec (they are this server's options, not fixed in
    the models): k, rescore, ef_search and nprobe bounds, text lengths, batch sizes; ``dimensions()``, the range
    of ``dimensions`` /v1/embeddings offers for the index being served, and ``columns()``, the metadata columns
    it kept, which are what a `filter` may name (both None while no index is served: the spec is written again
    when they change)."""
    # Refused as empty too: a text of whitespace or of characters the tokenizer drops alone (a pattern is searched
    # for anywhere in the string: it finds one character that is kept)
    text = {"minLength": 1, "maxLength": options.max_query_chars, "pattern": visible_pattern()}
    bounds: dict[str, dict[str, Any]] = {
        **{name: {"minimum": low, "maximum": high} for name, (low, high) in param_bounds(options).items()},
        "q": text,
        "query": text,
        "queries": {"minItems": 1, "maxItems": options.max_queries, "items": text},
        "inputs": {"minItems": 1, "maxItems": options.max_queries, "items": text} | text,
        "input": {"minItems": 1, "maxItems": options.max_queries, "items": text} | text,
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

    written_for: list[Any] = []  # the ``dimensions()`` and ``columns()`` the cached spec states

    def openapi() -> dict[str, Any]:
        dims, kept = dimensions(), columns()
        if written_for != [dims, kept]:
            app.openapi_schema = None
        if app.openapi_schema is None:
            schema = generate()  # FastAPI's, kept in app.openapi_schema: written into once per served index
            written_for[:] = [dims, kept]
            models = schema["components"]["schemas"]
            document_filter(models, kept)
            document_links(schema["paths"])
            for model in ("SearchRequest", "EmbedRequest", "EmbeddingsRequest"):
                for name, prop in models.get(model, {}).get("properties", {}).items():
                    constrain(prop, bounds.get(name, {}))
            if "EmbeddingsRequest" in models:
                limits = {"minimum": 1} if dims is None else {"minimum": dims[0], "maximum": dims[1]}
                constrain(models["EmbeddingsRequest"]["properties"]["dimensions"], limits)
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


def document_filter(models: dict[str, Any], kept: pa.Schema | None) -> None:
    """SearchRequest's ``filter`` as the filter grammar over the columns ``kept`` (any column while no index is
    served); an index that kept none takes no filter: only null."""
    field = models["SearchRequest"]["properties"]["filter"]
    description = field.get("description", "")
    if kept is not None and len(kept) == 0:
        field.clear()
        field.update({"type": "null", "description": description + " This index kept no columns: none."})
        return
    models.update(filters.json_schema(kept))
    field.clear()
    field.update({"anyOf": [{"$ref": "#/components/schemas/Filter"}, {"type": "null"}], "description": description})


# OpenAPI links: what one operation's answer tells a client to send next (schemathesis follows them in its
# stateful phase). Each: (source path, method) -> name -> (target path, method, request body or None, description).
LINKS: dict[tuple[str, str], dict[str, tuple[str, str, dict[str, Any] | None, str]]] = {
    ("/reload", "post"): {
        "ServedVersion": ("/info", "get", None, "What is served now, the version the reload put in place."),
    },
    ("/info", "get"): {
        "EmbedAtFullWidth": (
            "/v1/embeddings",
            "post",
            {"dimensions": "$response.body#/index/dim"},
            "The most `dimensions` the served index offers: its kernel's directions.",
        ),
        "SearchInDefaultMode": (
            "/search",
            "post",
            {"mode": "$response.body#/index/default_mode"},
            "A search in the mode the index answers by default.",
        ),
    },
    ("/v1/models", "get"): {
        "EmbedWithServedModel": (
            "/v1/embeddings",
            "post",
            {"model": "$response.body#/data/0/id"},
            "Embeddings by the model listed.",
        ),
    },
    ("/search", "post"): {
        "ServingVersion": ("/info", "get", None, "The index version that answered (`generation`), described."),
    },
}


def document_links(paths: dict[str, Any]) -> None:
    """Write ``LINKS`` into the spec's 200 responses; a request body given is merged into a generated one."""
    for (path, method), links in LINKS.items():
        response = paths[path][method]["responses"]["200"]
        for name, (target, target_method, body, description) in links.items():
            pointer = target.replace("~", "~0").replace("/", "~1")
            link: dict[str, Any] = {"operationRef": f"#/paths/{pointer}/{target_method}", "description": description}
            if body is not None:
                link["requestBody"] = body
                link["x-schemathesis"] = {"merge_body": True}
            response.setdefault("links", {})[name] = link
