"""Precision choice: whether this CPU computes bf16 and int8 natively, which CPU a choice was made on, and precision
"auto"'s decision: bf16 or int8 only where it is faster here and agrees with fp32.

Native bf16 is ~2x fp32 on some CPUs and ~0.6x on others with the same ``avx512_bf16`` flag, so the flag alone
cannot decide: the candidates are timed on a few rows of a real batch, through ``timing.policy`` (site
``precision``; fp32 when the policy is deterministic).
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

from retrieval import timing
from retrieval.encode.pooling import pool_one
from retrieval.encode.spec import POOLINGS

log = logging.getLogger(__name__)

# bf16 must agree with fp32 at least this well (cosine of pooled vectors) to be chosen by precision "auto".
BF16_MIN_COSINE = 0.999
# int8 likewise (``retrieval.encode.int8``: it rounds activations to 8 bits, bf16 keeps 8 bits of mantissa).
INT8_MIN_COSINE = 0.99
# Whether "auto" weighs int8 at all (where the CPU has int8 dot products). "auto" promises vectors that agree with
# fp32 to BF16_MIN_COSINE whatever the CPU; int8's agree to about 0.99 at worst (min cosine on 1,000 MiniLM STS-B
# sentences, docs/benchmarks/encode.md), so an index built with "auto" would hold other vectors on one CPU than on
# another. int8 stays opt-in (``--precision int8``), where it is the faster one.
INT8_IN_AUTO = False


def cpu_model() -> str:
    """This CPU's model name (what a measured precision choice is valid for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_supports_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_supports_int8() -> bool:
    """Whether this CPU has int8 dot-product instructions (AVX-512 VNNI, AVX-VNNI or AMX int8)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & flags)


def min_cosine(expected: Any, got: Any, torch: Any) -> float:
    """The smallest cosine between matching rows of two (n, d) tensors."""
    return float(torch.nn.functional.cosine_similarity(expected.float(), got.float(), dim=1).min().item())


def fastest_agreeing(ways: dict[str, Callable[[], Any]], torch: Any) -> str:
    """Settle precision "auto": each way ("fp32" and any of "bf16", "int8") returns the pooled vectors of the same
    few rows. A way whose vectors stray from fp32's (min cosine below BF16_MIN_COSINE or INT8_MIN_COSINE) is
    dropped; the others are warmed up, then timed twice, interleaved, and the fastest wins. A policy that fixes
    the choice is followed, untimed (fp32 when it names a way that was dropped)."""
    bounds = {"fp32": 1.0, "bf16": BF16_MIN_COSINE, "int8": INT8_MIN_COSINE}
    with torch.inference_mode():  # as the encoding it stands for: no autograd graph to time or to keep
        fixed = timing.policy().fixed("precision", "fp32")
        if fixed == "fp32":
            return "fp32"
        vectors = {name: way() for name, way in ways.items() if fixed is None or name in ("fp32", fixed)}
        agreeing = {"fp32": ways["fp32"]}
        for name in vectors.keys() - {"fp32"}:
            cos = min_cosine(vectors["fp32"], vectors[name], torch)
            if cos >= bounds[name]:
                agreeing[name] = ways[name]
            else:
                log.info("precision auto: not %s (its min cosine to fp32 is %.5f)", name, cos)
        if fixed is not None:
            chosen = fixed if fixed in agreeing else "fp32"
        elif len(agreeing) == 1:
            chosen = "fp32"
        else:  # every way has just run once: that was the warm-up
            chosen = timing.policy().fastest("precision", agreeing, default="fp32", rounds=2)
    log.info("precision auto: %s", chosen)
    return chosen


def agree(expected: tuple[Any, Any], got: tuple[Any, Any], bf16: bool, torch: Any) -> bool:
    """A trace's (first, last) token states against the eager fp32 model's, for one text."""
    if not bf16:
        return all(torch.allclose(a, b.float(), rtol=1e-4, atol=1e-4) for a, b in zip(expected, got, strict=True))
    cosines = [
        torch.nn.functional.cosine_similarity(
            pool_one(p, expected[0][0], expected[1][0]), pool_one(p, got[0][0].float(), got[1][0].float()), dim=0
        )
        for p in POOLINGS
    ]
    return min(float(c) for c in cosines) >= BF16_MIN_COSINE
