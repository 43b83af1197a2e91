"""Precision choice: whether this CPU computes bf16 natively, which CPU a choice was made on, and precision
"auto"'s decision: bf16 only where it is faster here and agrees with fp32.

Native bf16 is ~2x fp32 on some CPUs and ~0.6x on others with the same ``avx512_bf16`` flag, so the flag alone
cannot decide: both ways are timed on a few rows of a real batch, through ``timing.policy`` (site ``precision``;
fp32 when the policy is deterministic).
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


def bf16_is_faster(fp32: Callable[[], Any], bf16: Callable[[], Any], torch: Any) -> bool:
    """Settle precision "auto": ``fp32`` and ``bf16`` each return the pooled vectors of the same few rows; each
    is warmed up, then timed twice, interleaved. bf16 wins only where it is faster and its vectors agree with
    fp32's (min cosine >= BF16_MIN_COSINE). A policy that fixes the choice is followed, untimed."""
    vectors: dict[str, Any] = {}

    def keeping(name: str, way: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            got = way()
            vectors.setdefault(name, got)

        return run

    with torch.inference_mode():  # as the encoding it stands for: no autograd graph to time or to keep
        ways = {"fp32": keeping("fp32", fp32), "bf16": keeping("bf16", bf16)}
        chosen = timing.policy().fastest("precision", ways, default="fp32", rounds=2, warm_up=1)
    if chosen == "bf16" and vectors:  # timed: it must agree too
        cos = torch.nn.functional.cosine_similarity(vectors["fp32"], vectors["bf16"], dim=1).min().item()
        if cos < BF16_MIN_COSINE:
            log.info("precision auto: fp32 (bf16 is faster, but its min cosine to fp32 is %.5f)", cos)
            return False
    log.info("precision auto: %s", chosen)
    return chosen == "bf16"


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
