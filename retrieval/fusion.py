"""Fusing a dense and a lexical ranking into one: reciprocal rank (RRF) or a convex mix of min-max scores.

Each side hands over its best ``depth`` candidates per query (rows -1 where it found fewer). RRF scores a document
``w / (rrf_k + rank_dense) + (1 - w) / (rrf_k + rank_lexical)`` (Cormack et al. 2009; a side that did not find it
adds nothing); the convex mix ``w * minmax(dense) + (1 - w) * minmax(lexical)`` over each side's own candidates
(a side that did not find it adds its minimum, 0). ``w`` is the dense side's weight.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from retrieval.errors import ConfigError
from retrieval.options import option

METHODS = ("convex", "rrf")
MODES = ("dense", "lexical", "hybrid")


@dataclass(frozen=True)
class FusionSpec:
    """How a hybrid search fuses: ``method`` (convex or rrf), the dense side's ``weight``, RRF's ``rrf_k``, and
    how many candidates each side contributes (``depth``, at least the k asked for).

    Defaults chosen on SciFact's 809 train queries with all-MiniLM-L6-v2 (``scripts/bench_hybrid.py ir``): the convex
    mix at dense weight 0.4 scored nDCG@10 0.7299, 0.5 0.7297, RRF 0.7165 (docs/benchmarks/hybrid.md)."""

    method: str = option("convex", f"Hybrid: fuse by {' or '.join(METHODS)}.", flag_decls=("--fusion",))
    weight: float = option(0.4, "Hybrid: the dense side's weight, 0-1.", flag_decls=("--fusion-weight",))
    rrf_k: int = 60
    depth: int = 100

    def check(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"unknown `fusion` {self.method!r}; choose one of {', '.join(METHODS)}", "fusion")
        if not 0.0 <= self.weight <= 1.0:
            raise ConfigError(f"`fusion_weight` must be between 0 and 1 (got {self.weight})", "fusion_weight")
        if not 1 <= self.rrf_k <= 10_000:
            raise ConfigError(f"`rrf_k` must be between 1 and 10,000 (got {self.rrf_k})", "rrf_k")
        if not 1 <= self.depth <= 10_000:
            raise ConfigError(f"`fusion_depth` must be between 1 and 10,000 (got {self.depth})", "fusion_depth")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FusionSpec:
        return cls(**data)


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ConfigError(f"unknown `mode` {mode!r}; choose one of {', '.join(MODES)}", "mode")


def _minmax(scores: np.ndarray) -> np.ndarray:
    """Scores scaled to [0, 1] over the found candidates (all 1 when they are equal)."""
    low, high = float(scores.min()), float(scores.max())
    return np.ones_like(scores) if high <= low else (scores - low) / (high - low)


def fuse(
    dense: tuple[np.ndarray, np.ndarray], lexical: tuple[np.ndarray, np.ndarray], spec: FusionSpec, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """(scores, rows) of each query's best ``k`` after fusing the two sides' (scores, rows); rows -1 and scores
    -inf past the documents either side found. Ties keep the dense side's order, then the lexical side's."""
    (d_scores, d_rows), (l_scores, l_rows) = dense, lexical
    queries = len(d_rows)
    out_scores = np.full((queries, k), -np.inf, dtype=np.float32)
    out_rows = np.full((queries, k), -1, dtype=np.int64)
    for q in range(queries):
        fused: dict[int, float] = {}
        for side_scores, side_rows, weight in (
            (d_scores[q], d_rows[q], spec.weight),
            (l_scores[q], l_rows[q], 1 - spec.weight),
        ):
            found = side_rows >= 0
            rows = side_rows[found]
            if not len(rows):
                continue
            if spec.method == "rrf":
                parts = weight / (spec.rrf_k + np.arange(1, len(rows) + 1, dtype=np.float64))
            else:
                parts = weight * _minmax(side_scores[found].astype(np.float64))
            for row, part in zip(rows.tolist(), parts.tolist(), strict=True):
                fused[row] = fused.get(row, 0.0) + part
        best = sorted(fused.items(), key=lambda item: -item[1])[:k]  # stable: first seen (dense) first on ties
        for i, (row, score) in enumerate(best):
            out_rows[q, i], out_scores[q, i] = row, score
    return out_scores, out_rows
