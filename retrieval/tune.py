"""Choosing the transform: sweep pooling x k x gamma over stashed vectors (never re-encoding the corpus),
pick the best on a dev split, report it on test.

IR: the candidates re-transform the index's stash and search it exactly (flat inner product), so the numbers
are those a flat index with that transform would give. STS: the sentences are encoded once per pooling and
every candidate re-transforms those vectors.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from retrieval.evaluate import Pairs, Queries, moments_of, sts_result, to_run
from retrieval.metrics import Qrels, evaluate_run
from retrieval.moments import RunningMoments
from retrieval.stash import VectorStash
from retrieval.whitening import RawTransform, Whitening

log = logging.getLogger(__name__)

DEFAULT_GAMMAS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class Candidate:
    """One transform to try. ``gamma=None`` is the raw baseline (no centring, no kernel, all dims)."""

    pooling: str
    dim: int
    gamma: float | None

    @property
    def label(self) -> str:
        return (
            f"{self.pooling} raw d={self.dim}" if self.gamma is None else f"{self.pooling} k={self.dim} g={self.gamma}"
        )

    def fit(self, moments: RunningMoments, epsilon: float) -> Whitening | RawTransform:
        if self.gamma is None:
            return RawTransform(moments.dim)
        return Whitening.fit(moments, dim=self.dim, gamma=self.gamma, epsilon=epsilon)


@dataclass
class Trial:
    candidate: Candidate
    dev: dict[str, float]
    test: dict[str, float] = field(default_factory=dict)
    search_ms: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self.candidate),
            "label": self.candidate.label,
            "dev": self.dev,
            "test": self.test,
            "search_ms": self.search_ms,
        }


@dataclass
class TuneResult:
    metric: str
    trials: list[Trial]
    best: Trial
    raw: Trial | None
    corpus_rows_encoded: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "best": self.best.to_dict(),
            "raw": self.raw.to_dict() if self.raw else None,
            "corpus_rows_encoded": self.corpus_rows_encoded,
            "trials": [t.to_dict() for t in self.trials],
        }


def candidates(poolings: Sequence[str], dims: Sequence[int], gammas: Sequence[float], d: int) -> list[Candidate]:
    """The grid, plus the raw baseline of each pooling (always evaluated, for reference)."""
    grid = [Candidate(p, d, None) for p in poolings]
    grid += [Candidate(p, k, g) for p, k, g in itertools.product(poolings, sorted(set(dims), reverse=True), gammas)]
    return grid


def pick(trials: Sequence[Trial], metric: str) -> Trial:
    """Best dev score; ties go to the smaller dimension, then the smaller gamma (cheaper, gentler)."""
    return max(trials, key=lambda t: (round(t.dev[metric], 6), -t.candidate.dim, -(t.candidate.gamma or 0.0)))


def _result(trials: list[Trial], metric: str) -> TuneResult:
    """The dev choice among the transforms (raw only if nothing else was tried), and its pooling's raw trial."""
    best = pick([t for t in trials if t.candidate.gamma is not None] or trials, metric)
    raw = next((t for t in trials if t.candidate.gamma is None and t.candidate.pooling == best.candidate.pooling), None)
    return TuneResult(metric, trials, best, raw)


# ----- IR ---------------------------------------------------------------------------------------------------
def tune_ir(
    stash: VectorStash,
    doc_ids: Sequence[str],
    query_vectors: Callable[[str, Queries], np.ndarray],
    dev: tuple[Queries, Qrels],
    test: tuple[Queries, Qrels] | None,
    grid: Sequence[Candidate],
    metric: str = "nDCG@10",
    epsilon: float = 1e-6,
    depth: int = 100,
    on_trial: Callable[[Trial], None] | None = None,
) -> TuneResult:
    """Evaluate every candidate on dev (and test), choose on dev only. ``query_vectors(pooling, queries)``
    returns raw query vectors: queries are encoded, the corpus never is (it comes from the stash)."""
    moments: dict[str, RunningMoments] = {}
    cache: dict[tuple[str, str], np.ndarray] = {}

    def queries_raw(pooling: str, split: Queries, name: str) -> np.ndarray:
        if (pooling, name) not in cache:
            cache[(pooling, name)] = query_vectors(pooling, split)
        return cache[(pooling, name)]

    trials = []
    for cand in grid:
        if cand.pooling not in moments:
            moments[cand.pooling] = RunningMoments(stash.dim)
            for block in stash.iter_blocks(pooling=cand.pooling):
                moments[cand.pooling].update(block)
        transform = cand.fit(moments[cand.pooling], epsilon)
        docs = np.concatenate([transform.transform(b) for b in stash.iter_blocks(pooling=cand.pooling)])
        trial = Trial(
            cand, dev=_ir_scores(docs, transform, queries_raw(cand.pooling, dev[0], "dev"), dev, doc_ids, depth)
        )
        if test is not None:
            trial.test = _ir_scores(docs, transform, queries_raw(cand.pooling, test[0], "test"), test, doc_ids, depth)
        trial.search_ms = _single_query_ms(docs)
        trials.append(trial)
        if on_trial:
            on_trial(trial)
    return _result(trials, metric)


def _ir_scores(
    docs: np.ndarray,
    transform: Whitening | RawTransform,
    raw_queries: np.ndarray,
    split: tuple[Queries, Qrels],
    doc_ids: Sequence[str],
    depth: int,
) -> dict[str, float]:
    queries, qrels = split
    scores = transform.transform(raw_queries) @ docs.T
    depth = min(depth, docs.shape[0])
    rows = np.argpartition(-scores, depth - 1, axis=1)[:, :depth]
    top = np.take_along_axis(scores, rows, axis=1)
    return evaluate_run(to_run(queries.ids, top, rows, doc_ids), qrels).metrics


def _single_query_ms(docs: np.ndarray, repeats: int = 30) -> float:
    """Median milliseconds of one exact top-10 search over ``docs`` (FAISS flat, one query at a time)."""
    import faiss

    index = faiss.IndexFlatIP(docs.shape[1])
    index.add(np.ascontiguousarray(docs))
    queries = np.ascontiguousarray(docs[:repeats])
    times = []
    for i in range(len(queries) + 3):
        start = time.perf_counter()
        index.search(queries[i % len(queries)][None, :], 10)
        times.append(time.perf_counter() - start)
    return float(np.median(times[3:]) * 1000)


# ----- STS --------------------------------------------------------------------------------------------------
def tune_sts(
    vectors: dict[str, dict[str, np.ndarray]],
    fit_sentences: Sequence[str],
    dev: Pairs,
    test: Pairs | None,
    grid: Sequence[Candidate],
    metric: str = "all",
    epsilon: float = 1e-6,
    on_trial: Callable[[Trial], None] | None = None,
) -> TuneResult:
    """``vectors[pooling][sentence]`` -> raw vector. The transform is fitted on ``fit_sentences`` (no labels)."""
    moments = {p: moments_of(v, fit_sentences) for p, v in vectors.items()}
    trials = []
    for cand in grid:
        transform = cand.fit(moments[cand.pooling], epsilon)
        trial = Trial(cand, dev=sts_result(vectors[cand.pooling], dev, transform))
        if test is not None:
            trial.test = sts_result(vectors[cand.pooling], test, transform)
        trials.append(trial)
        if on_trial:
            on_trial(trial)
    return _result(trials, metric)
