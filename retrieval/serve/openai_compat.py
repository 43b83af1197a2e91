"""OpenAI's embeddings dialect: ``POST /v1/embeddings`` and ``GET /v1/models``, so the clients people already have
(the official ``openai`` package, LangChain's OpenAIEmbeddings, anything that speaks to text-embeddings-inference,
Infinity or vLLM) work against the served index's encoder.

``dimensions`` works for any encoder: the index's whitening kernel orders its directions by variance, so keeping
its first ``dimensions`` columns (then L2-normalising) is the principled shorter embedding that a Matryoshka-trained
model gets from truncation. Without it the answer is the model's own embedding, L2-normalised, as OpenAI's are.
Requests go through the same micro-batching engine as /search and /embed.
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from datetime import datetime
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from retrieval.serve.errors import ApiError
from retrieval.serve.middleware import ADMISSION_KEY
from retrieval.serve.requests import query_texts
from retrieval.serve.schemas import BODY_ERRORS, ERRORS, WholeNumber
from retrieval.serve.service import Service
from retrieval.whitening import Whitening, l2_normalize


class EmbeddingsRequest(BaseModel):
    """OpenAI's embeddings request. Token arrays (``input`` as integers) are not taken: send text."""

    model_config = ConfigDict(extra="forbid", strict=True)
    input: str | list[str] = Field(..., description="A text or a list of texts.", examples=[["a text", "another"]])
    model: str = Field(
        ...,
        description="Taken whatever it names, as text-embeddings-inference takes it: this server has one model, "
        "and the answer's `model` names it (GET /v1/models lists it).",
    )
    dimensions: WholeNumber | None = Field(
        None,
        description="Keep this many directions of the index's whitening kernel (largest variance first), then "
        "L2-normalise; left out: the model's own embedding, L2-normalised.",
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: lists of numbers; base64: little-endian float32 bytes, base64-encoded."
    )
    user: str | None = Field(None, description="Accepted for compatibility; not used.")


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: Usage


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


def served_model(service: Service) -> Model:
    """The one model this server embeds with: the index's encoder, named as its manifest names it (503 while
    nothing is loaded); ``created`` is when the index was first built."""
    manifest = service.searcher().manifest
    try:
        created = int(datetime.fromisoformat(manifest.created).timestamp())
    except ValueError:
        created = 0
    return Model(id=manifest.encoder.model or manifest.encoder.kind, created=created, owned_by="retrieval")


def dimension_range(service: Service) -> tuple[int, int] | None:
    """The ``dimensions`` the served index offers: 1 to its kernel's directions, or a raw index's width alone;
    None while nothing is served."""
    if not service.ready:
        return None
    transform = service.searcher().transform
    return (1 if isinstance(transform, Whitening) else transform.dim_out, transform.dim_out)


def check_dimensions(service: Service, dims: int | None) -> None:
    """400 naming the limit: more directions than the kernel keeps, or a shorter raw index."""
    if dims is None:
        return
    transform = service.searcher().transform
    if isinstance(transform, Whitening):
        if not 1 <= dims <= transform.dim_out:
            raise ApiError(
                400,
                "invalid_dimensions",
                f"`dimensions` must be between 1 and {transform.dim_out}, the directions the served index's "
                f"whitening kernel keeps (got {dims})",
                "dimensions",
            )
    elif dims != transform.dim_out:
        raise ApiError(
            400,
            "invalid_dimensions",
            f"`dimensions` must be {transform.dim_out} (or left out): the served index keeps raw vectors, with no "
            "whitening kernel to shorten (build it with --dim for shorter embeddings)",
            "dimensions",
        )


def encoded(vectors: np.ndarray, encoding_format: str) -> list[Any]:
    if encoding_format == "base64":
        little = vectors.astype("<f4", copy=False)
        return [base64.b64encode(row.tobytes()).decode("ascii") for row in little]
    return vectors.tolist()


def openai_routes(
    api: APIRouter,
    service: Service,
    answer: Callable[[Request, Future[Any]], Awaitable[Any]],
    encodes: Callable[[], None],
) -> None:
    """/v1/embeddings and /v1/models on ``api`` (the keyed router: the API key is OpenAI's ``api_key``).
    ``answer`` waits for the engine as /search does; ``encodes`` refuses an index without an encoder."""
    options = service.options

    @api.post(
        "/v1/embeddings",
        response_model=EmbeddingsResponse,
        responses=BODY_ERRORS | {400: {"description": "`dimensions` beyond what the served index offers"}},
        summary="Embeddings in OpenAI's format (any encoder gets `dimensions` from the index's kernel)",
    )
    async def embeddings(request: Request, body: EmbeddingsRequest) -> JSONResponse:
        texts = query_texts([body.input] if isinstance(body.input, str) else body.input, "input", options)
        encodes()
        model = served_model(service)
        check_dimensions(service, body.dimensions)
        future = service.batcher.submit_embed(
            texts,
            transformed=body.dimensions is not None,
            dims=body.dimensions,
            admission=request.scope.get(ADMISSION_KEY),
            count_tokens=True,  # in the engine thread, with the batch: not another thread's hop from here
        )
        result = await answer(request, future)
        vectors = result.vectors if body.dimensions is not None else l2_normalize(result.vectors)
        tokens = sum(result.tokens or ())
        data = [
            {"object": "embedding", "index": i, "embedding": vector}
            for i, vector in enumerate(encoded(vectors, body.encoding_format))
        ]
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "model": model.id,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    @api.get("/v1/models", response_model=ModelList, responses=ERRORS, summary="The served model, OpenAI's format")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [served_model(service).model_dump()]})
