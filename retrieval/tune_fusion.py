"""Choosing how a hybrid index fuses its two rankings: each candidate fusion scored on dev queries with qrels.

Every candidate (RRF, and the convex mix at several dense weights) searches the same encoded queries; the best
on dev is chosen (ties: the earlier in the grid), the test split, if given, only reported, with the dense and
lexical sides alone beside it. ``update.set_fusion`` records the choice in the manifest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from retrieval.encode.spec import Encoder
from retrieval.errors import ConfigError
from retrieval.evaluate import Queries, evaluate_ir
from retrieval.fusion import FusionSpec
from retrieval.metrics import Qrels
from retrieval.progress import Progress, no_progress
from retrieval.search import Searcher, SearchParams

GRID = (FusionSpec("rrf", weight=0.5), *(FusionSpec("convex", weight=w) for w in (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)))
DEPTH = 100  # hits per query scored (nDCG@10 and Recall@100 both read them)


@dataclass(frozen=True)
class FusionTrial:
    """One candidate (``fusion`` None: a side alone, named by ``mode``) and its scores on dev (and test)."""

    mode: str
    fusion: FusionSpec | None
    dev: dict[str, float]
    test: dict[str, float] | None = None

    @property
    def label(self) -> str:
        if self.fusion is None:
            return f"{self.mode} alone"
        if self.fusion.method == "rrf":
            return f"rrf (k={self.fusion.rrf_k})"
        return f"convex, dense weight {self.fusion.weight:.1f}"


@dataclass
class FusionResult:
    metric: str
    trials: list[FusionTrial] = field(default_factory=list)

    @property
    def best(self) -> FusionTrial:
        fused = [t for t in self.trials if t.fusion is not None]
        return max(fused, key=lambda t: t.dev[self.metric])  # max keeps the first of equals: the grid's order


def tune_fusion(
    directory: Path,
    dev: tuple[Queries, Qrels],
    test: tuple[Queries, Qrels] | None = None,
    metric: str = "nDCG@10",
    grid: tuple[FusionSpec, ...] = GRID,
    encoder: Encoder | None = None,
    progress: Progress = no_progress,
) -> FusionResult:
    """Score every fusion of ``grid`` (and each side alone) on ``dev`` (and ``test``) queries."""
    searcher = Searcher.load(directory, encoder=encoder)
    if searcher.loaded.lexical is None:
        raise ConfigError(
            f"{directory} has no lexical index: there is no fusion to tune; rebuild it with `lexical`", "mode"
        )
    splits = [(dev, searcher.encode(dev[0].texts))]
    if test is not None:
        splits.append((test, searcher.encode(test[0].texts)))
    result = FusionResult(metric)
    candidates = [("dense", None), ("lexical", None), *(("hybrid", f) for f in grid)]
    for mode, fusion in candidates:
        params = SearchParams(k=DEPTH, mode=mode, fusion=fusion)
        scores = [evaluate_ir(searcher, q, qrels, params, raw_queries=raw).metrics for (q, qrels), raw in splits]
        if metric not in scores[0]:
            raise ConfigError(f"unknown `metric` {metric!r}; choose one of {', '.join(scores[0])}", "metric")
        result.trials.append(FusionTrial(mode, fusion, scores[0], scores[1] if len(scores) > 1 else None))
        progress("tune", 1, len(candidates))
    return result
