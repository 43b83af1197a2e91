"""Request and response models (what /docs shows), the error responses each route declares, and the server's
limits written into the OpenAPI spec."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

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


class SearchRequest(BaseModel):
    """One query (`query`) or a batch (`queries`); knobs left out take the index's defaults."""

    model_config = ConfigDict(extra="forbid", strict=True)
    query: str | None = Field(None, description="One query text.", examples=["how do whitening transforms work"])
    queries: list[str] | None = Field(None, description="Several query texts, answered in order.")
    k: WholeNumber | None = Field(None, description="Hits per query (default 10, or the server's `max_k` when lower).")
    rescore: WholeNumber | None = Field(None, description="Re-rank this many candidates by the full stashed vectors.")
    ef_search: WholeNumber | None = Field(None, description="HNSW search beam width (efSearch) for this request.")
    nprobe: WholeNumber | None = Field(None, description="IVF lists probed for this request.")
    mode: Literal["dense", "lexical", "hybrid"] | None = Field(
        None, description="dense, lexical or hybrid (default: hybrid where the index has a lexical part)."
    )
    # Left out of the OpenAPI document (the route's description gives its form): whether a filter can run depends
    # on the columns this index kept, which no schema states, and a generated request naming another column would
    # be "valid" yet refused.
    filter: SkipJsonSchema[dict[str, Any] | None] = None


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
    }


def document_limits(
    app: FastAPI, options: ServeOptions, dimensions: Callable[[], tuple[int, int] | None] = lambda: None
) -> None:
    """Write the limits the handlers enforce into the OpenAPI spec (they are this server's options, not fixed in
    the models): k, rescore, ef_search and nprobe bounds, text lengths, batch sizes; and ``widest()``, the most
    ``dimensions`` /v1/embeddings offers for the index being served (None while none is: the spec is written
    again when it changes)."""
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

    written_for: list[tuple[int, int] | None] = []  # the ``dimensions()`` the cached spec states

    def openapi() -> dict[str, Any]:
        dims = dimensions()
        if written_for != [dims]:
            app.openapi_schema = None
        if app.openapi_schema is None:
            schema = generate()  # FastAPI's, kept in app.openapi_schema: written into once per index width
            written_for[:] = [dims]
            models = schema["components"]["schemas"]
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
