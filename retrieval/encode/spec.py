"""What an encoder is and how it is named: the ``Encoder`` protocols, ``EncoderSpec`` (how to load one) and
``EncoderInfo`` (the typed identity a manifest records), with the poolings and precisions they accept."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from retrieval.errors import ConfigError

if TYPE_CHECKING:
    from retrieval.encode.transformer import TransformerEncoder

POOLINGS = ("mean", "cls", "first-last-avg")
PRECISIONS = ("auto", "fp32", "bf16", "int8")
DEFAULT_MODEL = "all-MiniLM-L6-v2"


@dataclass(frozen=True)
class EncoderSpec:
    """How to load a transformers encoder: what the CLI options, the service and the Ray workers pass around."""

    model: str = DEFAULT_MODEL
    pooling: str = "mean"
    max_length: int | None = None
    batch_size: int = 32
    precision: str = "auto"

    def check(self) -> None:
        if self.pooling not in POOLINGS:
            raise ConfigError(f"unknown `pooling` {self.pooling!r}; choose one of {', '.join(POOLINGS)}", "pooling")
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"unknown `precision` {self.precision!r}; choose one of {', '.join(PRECISIONS)}", "precision"
            )
        if self.batch_size < 1:
            raise ConfigError(f"`batch_size` must be at least 1 (got {self.batch_size})", "batch_size")
        if self.max_length is not None and self.max_length < 1:
            raise ConfigError(f"`max_length` must be at least 1 (got {self.max_length})", "max_length")

    def load(self) -> TransformerEncoder:
        """The transformers encoder this spec describes (imports torch and transformers)."""
        from retrieval.encode.transformer import TransformerEncoder

        return TransformerEncoder(self.model, self.pooling, self.max_length, self.batch_size, self.precision)


@dataclass(frozen=True)
class EncoderInfo:
    """An encoder's identity, as the manifest records it: a query must be encoded exactly as the corpus was.

    ``kind`` is "transformers" (rebuilt from this record by ``from_info``), "vectors" (precomputed input: no
    text encoder) or another encoder's own name. ``precision`` is what was asked; ``precision_used`` what the
    build measured and ran, on ``precision_cpu``: "auto" keeps that choice on the same CPU and decides again on
    another.
    """

    kind: str
    dim: int
    model: str | None = None
    model_path: str | None = None
    architecture: str | None = None
    revision: str | None = None
    weights_sha256: str | None = None
    pooling: str | None = None
    max_length: int | None = None
    precision: str = "auto"
    precision_used: str | None = None
    precision_cpu: str | None = None  # the CPU ``precision_used`` was measured on
    column: str | None = None  # kind "vectors": where the vectors came from

    @property
    def encodes_text(self) -> bool:
        return self.kind != "vectors"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EncoderInfo:
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})

    def with_pooling(self, pooling: str) -> EncoderInfo:
        return replace(self, pooling=pooling)

    def check_query(self, query: EncoderInfo) -> None:
        """Refuse to encode queries differently from the corpus this record describes."""
        checks = {
            "model": (_model_identity(self), _model_identity(query)),
            "pooling": (self.pooling, query.pooling),
            "max_length": (self.max_length, query.max_length),
        }
        for what, (built, asked) in checks.items():
            if built != asked:
                shown = (self._show_model(), query._show_model()) if what == "model" else (repr(built), repr(asked))
                raise ConfigError(
                    f"the index was built with {what} {shown[0]} but the query encoder uses {shown[1]}; "
                    "search with the index's own encoder (leave `model`, `pooling` and `max_length` unset)",
                    what,
                )

    def _show_model(self) -> str:
        return f"{self.model!r} (weights {str(self.weights_sha256)[:12]})"


def _model_identity(info: EncoderInfo) -> object:
    """Weights hash when the model is a local folder, else hub name and revision."""
    return info.weights_sha256 or (info.model, info.revision)


@runtime_checkable
class Encoder(Protocol):
    """Anything that turns texts into raw (unnormalised) float32 vectors of a fixed width."""

    @property
    def dim(self) -> int: ...

    def encode(self, texts: Sequence[str]) -> np.ndarray: ...

    def info(self) -> EncoderInfo:
        """What the manifest records so a query can be encoded the same way."""
        ...


@runtime_checkable
class MultiPoolingEncoder(Encoder, Protocol):
    """An encoder that pools one forward pass several ways (to stash extra poolings for ``tune``)."""

    def encode_poolings(
        self, texts: Sequence[str], poolings: Sequence[str], on_batch: Callable[[int], None] | None = None
    ) -> dict[str, np.ndarray]: ...
