"""Choosing the transform: sweep pooling x k x gamma (the raw baseline included) over stashed vectors, never
re-encoding the corpus; pick the best on a dev split, report it on test.

IR: each candidate re-transforms the index's stash block by block and searches it exactly (the blocked top-k
of ``scan.TopK``: memory is one block, whatever N), so the numbers are those a flat index with that transform
would give. STS: the sentences are encoded once per pooling and every candidate re-transforms those vectors.
A candidate is a ``TransformSpec``: ``TransformSpec.raw(pooling)`` is "keep raw", and it can win.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.encoder import EncoderSpec, MultiPoolingEncoder, from_info
from retrieval.errors import ConfigError
from retrieval.evaluate import Pairs, Queries, moments_of, sts_result, to_run
from retrieval.indexdir import IndexDir
from retrieval.metrics import Qrels, evaluate_run
from retrieval.progress import Progress, no_progress
from retrieval.scan import TopK
from retrieval.stash import VectorStash
from retrieval.whitening import TransformSpec

log = logging.getLogger(__name__)

DEFAULT_GAMMAS = (0.0, 0.25, 0.5, 0.75, 1.0)
TIMING_QUERIES = 30  # single-query flat searches timed per candidate


def default_dims(d: int) -> list[int]:
    return [k for k in (d, 512, 384, 256, 128, 64) if k <= d]


def candidates(poolings: Sequence[str], dims: Sequence[int], gammas: Sequence[float], d: int) -> list[TransformSpec]:
    """The raw baseline of each pooling, then the grid of whitenings."""
    for k in dims:
        TransformSpec(dim=k).check(d)
    for gamma in gammas:
        TransformSpec(gamma=gamma).check(d)
    grid = [TransformSpec(dim=d, whiten=False, pooling=p) for p in poolings]
    grid += [
        TransformSpec(dim=k, gamma=g, pooling=p)
        for p, k, g in itertools.product(poolings, sorted(set(dims), reverse=True), gammas)
    ]
    return grid


@dataclass
class Trial:
    candidate: TransformSpec
    dev: dict[str, float]
    test: dict[str, float] = field(default_factory=dict)
    search_ms: float | None = None

    @property
    def dim(self) -> int:
        assert self.candidate.dim is not None
        return self.candidate.dim

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.candidate.to_dict(),
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
    raw: Trial | None  # the raw baseline of the chosen pooling
    corpus_rows_encoded: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "best": self.best.to_dict(),
            "raw": self.raw.to_dict() if self.raw else None,
            "corpus_rows_encoded": self.corpus_rows_encoded,
            "trials": [t.to_dict() for t in self.trials],
        }


def pick(trials: Sequence[Trial], metric: str) -> Trial:
    """Best dev score; ties go to the smaller dimension, then to raw, then to the smaller gamma (cheaper, gentler)."""
    return max(
        trials,
        key=lambda t: (round(t.dev[metric], 6), -t.dim, not t.candidate.whiten, -t.candidate.gamma),
    )


def _result(trials: list[Trial], metric: str) -> TuneResult:
    best = pick(trials, metric)
    pooling = best.candidate.pooling
    raw = next((t for t in trials if not t.candidate.whiten and t.candidate.pooling == pooling), None)
    return TuneResult(metric, trials, best, raw)


# ----- IR ---------------------------------------------------------------------------------------------------
def tune_index(
    directory: Path,
    dev: tuple[Queries, Qrels],
    test: tuple[Queries, Qrels] | None = None,
    poolings: Sequence[str] | None = None,
    dims: Sequence[int] | None = None,
    gammas: Sequence[float] = DEFAULT_GAMMAS,
    metric: str = "nDCG@10",
    progress: Progress = no_progress,
) -> TuneResult:
    """Sweep the stash of the index at ``directory``: the queries are encoded by the index's own encoder (every
    pooling in one pass), the corpus comes from the stash, which is verified first."""
    index_dir = IndexDir(directory)
    manifest = index_dir.manifest()
    if not manifest.encoder.encodes_text:
        raise ConfigError("IR tuning needs a text encoder to encode the queries: this index was built from vectors")
    stash = index_dir.stash("tune")
    stash.verify(full=True)
    pools = list(poolings or stash.poolings)
    for pooling in pools:
        stash.check_pooling(pooling)
    grid = candidates(pools, list(dims or default_dims(stash.dim)), gammas, stash.dim)
    encoder = from_info(manifest.encoder.with_pooling(pools[0]))
    encoded: dict[int, dict[str, np.ndarray]] = {}

    def query_vectors(pooling: str, queries: Queries) -> np.ndarray:
        if id(queries) not in encoded:  # each split once, for all poolings
            encoded[id(queries)] = encoder.encode_poolings(queries.texts, pools)
        return encoded[id(queries)][pooling]

    doc_ids = index_dir.docs().ids  # the stash's rows, looked up per hit: never every id in memory
    return tune_ir(
        stash, doc_ids, query_vectors, dev, test, grid, metric, on_trial=lambda t: progress("tune", 1, len(grid))
    )


def tune_ir(
    stash: VectorStash,
    doc_ids: Sequence[str],
    query_vectors: Callable[[str, Queries], np.ndarray],
    dev: tuple[Queries, Qrels],
    test: tuple[Queries, Qrels] | None,
    grid: Sequence[TransformSpec],
    metric: str = "nDCG@10",
    depth: int = 100,
    on_trial: Callable[[Trial], None] | None = None,
) -> TuneResult:
    """Evaluate every candidate on dev (and test), choose on dev only. ``query_vectors(pooling, queries)``
    returns raw query vectors: queries are encoded, the corpus never is (it comes from the stash)."""
    splits = {"dev": dev} | ({"test": test} if test is not None else {})
    moments = {p: stash.moments(p) for p in dict.fromkeys(str(c.pooling) for c in grid)}
    raw_queries = {(p, name): query_vectors(p, split[0]) for p in moments for name, split in splits.items()}
    depth = min(depth, len(stash))
    trials = []
    for cand in grid:
        assert cand.pooling is not None
        transform = cand.fit(moments[cand.pooling])
        queries = {name: transform.transform(raw_queries[(cand.pooling, name)]) for name in splits}
        tops = {name: TopK(len(q), depth) for name, q in queries.items()}
        start, search_ms = 0, None
        for block in stash.iter_blocks(pooling=cand.pooling):
            docs = transform.transform(block)
            for name, q in queries.items():
                tops[name].push(q @ docs.T, start)
            if search_ms is None:
                search_ms = _single_query_ms(docs, queries["dev"]) * len(stash) / len(docs)
            start += len(docs)
        scores = {
            name: evaluate_run(to_run(split[0].ids, *tops[name].result(), doc_ids), split[1]).metrics
            for name, split in splits.items()
        }
        trial = Trial(cand, dev=scores["dev"], test=scores.get("test", {}), search_ms=search_ms)
        trials.append(trial)
        if on_trial:
            on_trial(trial)
    return _result(trials, metric)


def _single_query_ms(docs: np.ndarray, queries: np.ndarray) -> float:
    """Median milliseconds of one exact top-10 search over ``docs`` (FAISS flat, one query at a time)."""
    import faiss

    times = []
    for i in range(TIMING_QUERIES + 3):
        query = np.ascontiguousarray(queries[i % len(queries)][None, :], dtype=np.float32)
        start = time.perf_counter()
        faiss.knn(query, docs, 10, faiss.METRIC_INNER_PRODUCT)
        times.append(time.perf_counter() - start)
    return float(np.median(times[3:]) * 1000)


# ----- STS --------------------------------------------------------------------------------------------------
def tune_pairs(
    dev: Pairs,
    test: Pairs | None = None,
    fit_sets: Sequence[Pairs] = (),
    encoder: EncoderSpec = EncoderSpec(),
    poolings: Sequence[str] = ("mean",),
    dims: Sequence[int] | None = None,
    gammas: Sequence[float] = DEFAULT_GAMMAS,
    metric: str = "all",
    progress: Progress = no_progress,
) -> TuneResult:
    """Encode every sentence of the pair files once per pooling (one pass), fit on all of them ("target", no
    labels), sweep the grid, choose on ``dev``."""
    sets = [dev, *([test] if test else []), *fit_sets]
    sentences = list(dict.fromkeys(s for p in sets for s in p.sentences()))
    model = EncoderSpec(encoder.model, poolings[0], encoder.max_length, encoder.batch_size, encoder.precision).load()
    if len(poolings) > 1 and not isinstance(model, MultiPoolingEncoder):
        raise ConfigError("this encoder cannot pool several ways in one pass", "pooling")
    raw = model.encode_poolings(sentences, poolings, on_batch=lambda n: progress("encode", n, len(sentences)))
    vectors = {p: dict(zip(sentences, raw[p], strict=True)) for p in poolings}
    grid = candidates(poolings, list(dims or default_dims(model.dim)), gammas, model.dim)
    return tune_sts(vectors, sentences, dev, test, grid, metric)


def tune_sts(
    vectors: dict[str, dict[str, np.ndarray]],
    fit_sentences: Sequence[str],
    dev: Pairs,
    test: Pairs | None,
    grid: Sequence[TransformSpec],
    metric: str = "all",
    on_trial: Callable[[Trial], None] | None = None,
) -> TuneResult:
    """``vectors[pooling][sentence]`` -> raw vector. The transform is fitted on ``fit_sentences`` (no labels)."""
    moments = {p: moments_of(v, fit_sentences) for p, v in vectors.items()}
    trials = []
    for cand in grid:
        assert cand.pooling is not None
        transform = cand.fit(moments[cand.pooling])
        trial = Trial(cand, dev=sts_result(vectors[cand.pooling], dev, transform))
        if test is not None:
            trial.test = sts_result(vectors[cand.pooling], test, transform)
        trials.append(trial)
        if on_trial:
            on_trial(trial)
    return _result(trials, metric)
