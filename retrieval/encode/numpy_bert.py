"""A BERT encoder in numpy, for the queries of a one-shot search: no torch, no transformers.

A one-shot ``retrieval search`` spent ~3 s of CPU importing torch and transformers to encode one query (the
import of ``transformers``' BERT code alone pulls in torch.distributed and torch._dynamo), against ~0.1 s for
everything else at 1M documents. This module runs the same model without them: the model folder's own weights
(``model.safetensors``, read by the safetensors library), its own tokenizer (``tokenizer.json``, run by the
tokenizers library that transformers' fast tokenizers wrap) and BertModel's forward pass written out in float32
(embeddings, then per layer self-attention + residual + LayerNorm, GELU feed-forward + residual + LayerNorm),
pooled as the index's encoder pools. It encodes what the index's encoder record names, nothing else: ``load``
returns None for any other architecture or setting (the caller then loads the transformers encoder as before).
tests/test_numpy_bert.py holds it to the transformers model in fp32, on a random BERT and on all-MiniLM-L6-v2.

An index encoded in bf16 gets its queries in float32 here too. The transformers encoder does no better: its
single-text path is, after its first few queries, a trace that timing picked in fp32 on this CPU, and agreed
with the batch-encoded bf16 vectors of the same 43 SciFact texts to cosine 0.99993 at worst, as this module did
(a numpy emulation of every bf16 rounding reached 0.99997: not worth its code). tests/test_numpy_bert.py holds
the bound (0.9998) on MiniLM.

An index encoded in int8 (``retrieval.encode.int8``) gets its queries in float32 here as well: int8 vectors agree
with fp32 to cosine 0.99 at worst (checked when the int8 model is made), and an fp32 query is the model's own
vector, not a second rounding. tests/test_int8.py searches an int8 index this way, without importing torch.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path

import numpy as np

from retrieval.encode.models import resolve_model, weights_sha256
from retrieval.encode.spec import POOLINGS, EncoderInfo

log = logging.getLogger(__name__)


def load(info: EncoderInfo) -> NumpyBert | None:
    """The numpy encoder for an index's encoder record, or None where this module does not implement it."""
    if info.kind != "transformers" or info.pooling not in POOLINGS or not info.max_length:
        return None
    path = info.model_path
    folder = Path(path) if path and Path(path).is_dir() else resolve_model(str(info.model))
    if folder is None:
        return None
    try:
        reason = _unsupported(folder)
        if reason is None:
            return NumpyBert(folder, info)
    except (ImportError, OSError, KeyError, ValueError) as err:  # missing library, unreadable or unexpected files
        reason = str(err)
    log.info("queries go through transformers: %s", reason)
    return None


def _unsupported(folder: Path) -> str | None:
    """Why ``folder`` is not a model this module computes exactly (None: it is)."""
    if not (folder / "model.safetensors").is_file() or not (folder / "tokenizer.json").is_file():
        return f"{folder} has no model.safetensors and tokenizer.json"
    config = json.loads((folder / "config.json").read_text())
    wanted = {"model_type": "bert", "position_embedding_type": "absolute", "hidden_act": "gelu"}
    for key, value in wanted.items():
        if config.get(key, "absolute" if key == "position_embedding_type" else None) != value:
            return f"{key} is {config.get(key)!r}, not {value!r}"
    settings = folder / "tokenizer_config.json"
    asked = json.loads(settings.read_text()) if settings.is_file() else {}
    normalizer = json.loads((folder / "tokenizer.json").read_text()).get("normalizer") or {}
    # transformers builds the BERT normalizer from tokenizer_config's settings (these defaults when absent);
    # this module uses tokenizer.json's as it is: they must agree, or the two paths tokenise differently
    pairs = {"lowercase": ("do_lower_case", True), "strip_accents": ("strip_accents", None)}
    pairs["handle_chinese_chars"] = ("tokenize_chinese_chars", True)
    if normalizer.get("type") != "BertNormalizer" or any(
        normalizer.get(key) != asked.get(name, default) for key, (name, default) in pairs.items()
    ):
        return "tokenizer.json's normalizer is not the BERT one its tokenizer_config asks for"
    return None


class NumpyBert:
    """An ``Encoder`` (dim, encode, info) computing BertModel + pooling in float32 numpy, one text at a time."""

    def __init__(self, folder: Path, info: EncoderInfo):
        from safetensors.numpy import load_file
        from tokenizers import Tokenizer

        config = json.loads((folder / "config.json").read_text())
        self.heads = int(config["num_attention_heads"])
        self.eps = float(config.get("layer_norm_eps", 1e-12))
        self.layers = int(config["num_hidden_layers"])
        self.pooling = str(info.pooling)
        self.max_length = int(info.max_length or 0)
        self._dim = int(config["hidden_size"])
        weights = load_file(str(folder / "model.safetensors"))
        if not any(key.startswith("embeddings.") for key in weights):  # saved from a model with a head: bert.*
            weights = {key.removeprefix("bert."): value for key, value in weights.items()}
        self.w = {key: np.ascontiguousarray(value, dtype=np.float32) for key, value in weights.items()}
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.no_padding()  # tokenizer.json may ask for fixed padding: a query is encoded unpadded
        self.tokenizer.enable_truncation(self.max_length)
        self._info = replace(
            info,
            model_path=str(folder),
            weights_sha256=weights_sha256(folder),
            precision="fp32",
            precision_used="fp32",
            precision_cpu=None,
        )

    @property
    def dim(self) -> int:
        return self._dim

    def info(self) -> EncoderInfo:
        return self._info

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        with _one_blas_thread():
            for i, encoding in enumerate(self.tokenizer.encode_batch(list(texts))):
                out[i] = self._pooled(np.asarray(encoding.ids, dtype=np.int64))
        return out

    # ----- BertModel, one unpadded sequence ---------------------------------------------------------------
    def _pooled(self, ids: np.ndarray) -> np.ndarray:
        w = self.w
        x = w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][: len(ids)]
        x = self._norm(x + w["embeddings.token_type_embeddings.weight"][0], "embeddings.LayerNorm")
        first = None
        for layer in range(self.layers):
            x = self._layer(x, f"encoder.layer.{layer}.")
            if first is None:
                first = x
        if self.pooling == "cls":
            return x[0]
        if self.pooling == "mean":
            return x.mean(axis=0)
        assert first is not None
        return (first.mean(axis=0) + x.mean(axis=0)) / 2  # first-last-avg: hidden_states[1] and [-1]

    def _layer(self, x: np.ndarray, p: str) -> np.ndarray:
        n, d = x.shape
        h = self.heads
        q, k, v = (self._dense(x, f"{p}attention.self.{name}") for name in ("query", "key", "value"))
        q, k, v = (t.reshape(n, h, d // h).transpose(1, 0, 2) for t in (q, k, v))  # (heads, n, d/h)
        scores = q @ k.transpose(0, 2, 1) / np.float32(math.sqrt(d // h))
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        context = (scores / scores.sum(axis=-1, keepdims=True)) @ v
        context = context.transpose(1, 0, 2).reshape(n, d)
        x = self._norm(self._dense(context, f"{p}attention.output.dense") + x, f"{p}attention.output.LayerNorm")
        inner = _gelu(self._dense(x, f"{p}intermediate.dense"))
        return self._norm(self._dense(inner, f"{p}output.dense") + x, f"{p}output.LayerNorm")

    def _dense(self, x: np.ndarray, name: str) -> np.ndarray:
        return x @ self.w[f"{name}.weight"].T + self.w[f"{name}.bias"]

    def _norm(self, x: np.ndarray, name: str) -> np.ndarray:
        mean = x.mean(axis=-1, keepdims=True)
        var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
        return (x - mean) / np.sqrt(var + np.float32(self.eps)) * self.w[f"{name}.weight"] + self.w[f"{name}.bias"]


def _one_blas_thread() -> AbstractContextManager[object]:
    """One BLAS thread for a query's small products: two threads took 10x longer on a busy 2-core machine (a
    thread waits for the other at every product)."""
    from threadpoolctl import threadpool_limits

    return threadpool_limits(1, user_api="blas")


def _gelu(x: np.ndarray) -> np.ndarray:
    """The exact GELU, x Phi(x) = x (1 + erf(x / sqrt 2)) / 2, with erf to 1.2e-7 (numpy has no erf)."""
    return x * (1.0 + _erf(x / np.float32(math.sqrt(2.0)))) / 2


def _erf(x: np.ndarray) -> np.ndarray:
    """erf by Numerical Recipes' erfc Chebyshev fit (fractional error < 1.2e-7 everywhere), in float64."""
    z = np.abs(x.astype(np.float64))
    t = 1.0 / (1.0 + 0.5 * z)
    coefficients = (
        -1.26551223,
        1.00002368,
        0.37409196,
        0.09678418,
        -0.18628806,
        0.27886807,
        -1.13520398,
        1.48851587,
        -0.82215223,
        0.17087277,
    )
    poly = np.zeros_like(t)
    for c in reversed(coefficients[1:]):
        poly = t * (c + poly)
    erfc = t * np.exp(-z * z + coefficients[0] + poly)
    return np.where(x >= 0, 1.0 - erfc, erfc - 1.0).astype(np.float32)
