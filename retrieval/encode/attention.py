"""Chunked attention for the bf16 encoder on a CPU: two batched matrix products and a softmax over a few
sequences at a time, instead of PyTorch's fused CPU kernel (scaled_dot_product_attention).

Measured on SciFact passages (16 x 256 tokens, all-MiniLM-L6-v2 in bf16, AMD EPYC with AVX-512 bf16, 2 threads):
the fused kernel ran attention at ~110 GFLOP/s, 15 ms a layer and a third of the forward pass, while the linear
layers ran at the machine's bf16 matrix rate. With heads of 32 dimensions its tiles are tiny products; here the
scores of two sequences (2 x 12 x 256 x 256 in bf16, ~3 MB: they stay in cache) are one product, one softmax and
one product, 8 ms a layer. The vectors agree with fp32 as the fused kernel's do (min cosine 0.99993 on those
passages, both ways). Whether it is faster on the CPU at hand is timed, not assumed (``TransformerEncoder``).

It is registered with transformers under ``NAME`` (``register``) and chosen per model with
``model.set_attn_implementation(NAME)``, which only models written against transformers' attention interface
accept (BERT and most encoders are; MPNet has its own attention code and keeps it).
"""

from __future__ import annotations

import logging
from typing import Any

from retrieval import timing

log = logging.getLogger(__name__)

NAME = "retrieval_chunked"
# Attention scores per chunk: 2 sequences of 12 heads x 256 x 256 at most; 3 MB in bf16.
CHUNK_SCORES = 2 * 12 * 256 * 256


def chunked_attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Any, None]:
    """softmax(q k^T * scaling + mask) v, for inference: ``query``, ``key``, ``value`` are (batch, heads, length,
    head dim); ``attention_mask`` is None, additive (batch, 1, length, length) in the states' dtype, or boolean
    (True: attend). Returns (batch, length, heads, head dim), as transformers' attention functions do, and no
    attention weights."""
    import torch

    batch, heads, length, dim = query.shape
    if scaling is None:
        scaling = dim**-0.5
    out = query.new_empty((batch, length, heads, dim))
    step = max(1, CHUNK_SCORES // (heads * length * key.shape[2]))
    for start in range(0, batch, step):
        rows = slice(start, start + step)
        scores = torch.matmul((query[rows] * scaling).contiguous(), key[rows].transpose(-1, -2).contiguous())
        if attention_mask is not None:
            mask = attention_mask[rows]
            if mask.dtype == torch.bool:
                scores.masked_fill_(~mask, torch.finfo(scores.dtype).min)
            else:
                scores.add_(mask)
        probabilities = torch.softmax(scores, dim=-1)
        out[rows] = torch.matmul(probabilities, value[rows].contiguous()).transpose(1, 2)
    return out, None


_registered: bool | None = None


def register() -> bool:
    """Register ``chunked_attention`` with transformers (once), with transformers' eager masks (additive, in the
    model's dtype). False where this transformers has no attention interface to register with."""
    global _registered
    if _registered is None:
        try:
            from transformers import AttentionInterface
            from transformers.masking_utils import AttentionMaskInterface, eager_mask
        except ImportError as err:
            log.info("chunked attention unavailable: %s", err)
            _registered = False
        else:
            AttentionInterface.register(NAME, chunked_attention)
            AttentionMaskInterface.register(NAME, eager_mask)
            _registered = True
    return _registered


def takes_chunked(model: Any) -> bool:
    """Whether ``model`` runs SDPA through transformers' attention interface, so chunked attention can replace it
    (a model set to another implementation, such as eager, keeps it)."""
    can_set = getattr(model, "_can_set_attn_implementation", None)
    config = getattr(model, "config", None)
    return bool(
        can_set is not None and getattr(config, "_attn_implementation", None) == "sdpa" and can_set() and register()
    )


def use_chunked(model: Any) -> None:
    model.set_attn_implementation(NAME)


# (heads, head dim, length) -> whether chunked attention was the faster here, timed once per process
_FASTER: dict[tuple[int, int, int], bool] = {}


def faster_here(model: Any, length: int, rows: int = 4) -> bool:
    """Whether chunked attention beats ``model``'s SDPA kernel on this CPU, for bf16 rows of ``length`` tokens with
    padding masked, as the encoder calls each: random states of the model's shape, both warmed up, then timed
    three times interleaved, best of each (a few milliseconds, once per shape and process). False for a model
    that cannot take it. A policy that fixes the choice (``timing.policy``, site ``attention``) is followed,
    untimed."""
    if not takes_chunked(model):
        return False
    fixed = timing.policy().fixed("attention", "sdpa")
    if fixed is not None:
        return fixed == "chunked"
    config = model.config
    heads = int(config.num_attention_heads)
    dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    key = (heads, dim, length)
    if key not in _FASTER:
        _FASTER[key] = _time(heads, dim, length, rows)
    return _FASTER[key]


def _time(heads: int, dim: int, length: int, rows: int) -> bool:
    import torch
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(rows, heads, length, dim, generator=generator).to(torch.bfloat16) for _ in range(3))
    allowed = torch.ones(rows, 1, length, length, dtype=torch.bool)
    allowed[1:, :, :, length - length // 8 :] = False  # some rows padded
    additive = torch.zeros(allowed.shape, dtype=torch.bfloat16).masked_fill_(~allowed, torch.finfo(torch.bfloat16).min)
    ways = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2).contiguous(),
        "chunked": lambda: chunked_attention(None, q, k, v, additive),
    }
    with torch.inference_mode():
        chosen = timing.policy().fastest("attention", ways, default="sdpa", rounds=3, warm_up=1)
    log.info("attention for bf16 rows of %d tokens: %s", length, chosen)
    return chosen == "chunked"
