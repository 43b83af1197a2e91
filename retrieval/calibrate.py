"""Search knobs measured on the user's queries: the smallest efSearch (HNSW) or nprobe (IVF) whose recall@10
reaches a target.

A build sets these by rule of thumb (efSearch 128; about sqrt(nlist) lists probed), and no rule holds for every
corpus and every kind of query. On real text the rule's recall@10 ranged from 0.83 to 0.91 for IVF at 100k rows
and from 0.96 to 0.99 where it probed or searched more than it needed to (docs/benchmarks/calibrate.md).
``retrieval calibrate INDEX --queries q.parquet`` measures instead: the queries are encoded and
transformed as a search does, their exact neighbours in the index's space come from one streamed pass over the
stash, and the knob grows along a grid until recall@10 reaches the target.

Recall is of the search as it is served. An index that re-scores (reduced, with its stash: the top 50 candidates
re-ranked at full dimension by default) is measured the same way: its top ``rescore`` candidates, re-scored,
against the exact top ``rescore`` in the index's space, re-scored alike. That is the knob's own effect on what
users get: the loss of the reduction itself is in both and cancels. Measured on real text, the re-scored top 10
come from deep in the candidates, which an approximate search finds less often than its own top 10: the value
chosen in the index's space served recall 0.947-0.950 against a target of 0.95, the value chosen as served
0.948-0.967 (docs/benchmarks/calibrate.md).

Why queries and not the corpus's own rows: measured, rows of the corpus make a knob look far better than it is.
An HNSW search for a vector that is itself a node of the graph finds it and, through its links, its neighbours:
efSearch 16 gave recall 0.98-0.99 on corpus rows at 100k and 0.81-0.87 on held-out queries.

A hybrid search (``mode`` hybrid, the default where the index has a lexical part and the queries are texts) is
measured as served too: the knob decides which of the dense side's candidates (the fusion's depth, 100 by default)
reach the fusion with BM25's, so recall@10 is of the fused top 10, against the fusion of the exact dense candidates
with the same BM25 side. A lexical search reads no knob: there is nothing to calibrate.

Rows whose exact score ties the k-th neighbour's count as found (as ann-benchmarks counts), so duplicated
documents do not make the measure depend on which of equal rows a search returns.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from retrieval.codes import search_extras
from retrieval.errors import ConfigError
from retrieval.fusion import FusionSpec, fuse
from retrieval.index import _hnsw, _ivf, search_parameters
from retrieval.manifest import Calibration
from retrieval.stash import BLOCK_ROWS

if TYPE_CHECKING:
    import faiss

    from retrieval.stash import VectorStash
    from retrieval.whitening import RawTransform, Whitening

log = logging.getLogger(__name__)

K = 10
MAX_QUERIES = 1000  # more are sampled down (seeded): recall@10 over 10,000 neighbours, a standard error ~0.003
TIE_TOLERANCE = 1e-5  # scores within this of the k-th exact score are ties (float32 sums over a few hundred dims)
EXTRA = 22  # exact neighbours kept beyond k, so that rows tied with the k-th are seen
EF_GRID = (16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 384, 512, 768, 1024, 1536, 2048)
PLATEAU = 0.002  # when the target is out of reach: the smallest knob within this of the best recall seen


@dataclass(frozen=True)
class Served:
    """How the index's searches are served: their top ``depth`` candidates re-ranked by ``rerank``, (candidate
    rows of the queries, k) -> (scores, rows) of the best k, best first (``update.served_as`` builds it)."""

    depth: int
    rerank: Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]


def fused(
    dense: Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]],
    lexical: tuple[np.ndarray, np.ndarray],
    fusion: FusionSpec,
    depth: int,
) -> Served:
    """Hybrid searches as served: each query's ``depth`` dense candidates, their best ``fusion.depth`` by ``dense``
    ((candidate rows, k) -> (scores, rows): the index's scores, or the re-scoring), fused with the query's lexical
    (scores, rows) as ``Searcher`` fuses them."""
    return Served(depth, lambda rows, k: fuse(dense(rows, fusion.depth), lexical, fusion, k))


def knob_of(index: faiss.Index) -> str | None:
    """The knob that trades speed for recall in this index: HNSW's beam width, else IVF's lists probed, else None
    (a flat index is exact; an IVF whose coarse quantizer is an HNSW is tuned by its nprobe)."""
    if _hnsw(index) is not None:
        return "ef_search"
    if _ivf(index) is not None:
        return "nprobe"
    return None


def grid(knob: str, index: faiss.Index) -> list[int]:
    """The values tried, smallest first: steps of a quarter to a half, up to every list for IVF."""
    if knob == "ef_search":
        return list(EF_GRID)
    nlist = int(_ivf(index).nlist)
    values, value = [], 1
    while value < nlist:
        values.append(value)
        value = max(value + 1, int(round(value * 1.25)))
    return values + [nlist]


def query_sample(n: int) -> np.ndarray:
    """Which of ``n`` queries are measured: all of them up to ``MAX_QUERIES``, else a seeded sorted sample."""
    if n <= MAX_QUERIES:
        return np.arange(n)
    return np.sort(np.random.default_rng(0).choice(n, MAX_QUERIES, replace=False))


def check_target(target: float) -> None:
    if not 0 < target <= 1:  # also refuses NaN
        raise ConfigError(f"`target_recall` must be above 0 and at most 1 (got {target})", "target_recall")


def exact_neighbours(
    stash: VectorStash,
    transform: Whitening | RawTransform,
    queries: np.ndarray,
    pooling: str | None = None,
    keep: int = K + EXTRA,
    block_rows: int = BLOCK_ROWS,
) -> tuple[np.ndarray, np.ndarray]:
    """The ``keep`` best stash rows (and scores) by inner product in the transformed space for each of ``queries``
    (already transformed). One pass over the stash, a block at a time; each tile's scores go into
    ``scan.Heaps``, as a flat scan's do, so memory is a block and a tile, not queries x rows. Returns
    (scores, rows), best first; rows -1 (score -inf) where the corpus has fewer rows."""
    from retrieval.scan import Heaps, tiles  # imports FAISS: only when calibrating

    queries = np.ascontiguousarray(queries, dtype=np.float32)
    heaps = Heaps(len(queries), keep)
    start = 0
    for block in stash.iter_blocks(block_rows, pooling=pooling):
        vectors = np.ascontiguousarray(transform.transform(block), dtype=np.float32)
        for first, tile in tiles(vectors, 0, len(vectors)):
            heaps.add(queries @ tile.T, start + first)
        start += len(block)
    scores, rows = heaps.result()
    scores[rows < 0] = -np.inf
    return scores, rows


def recall_with_ties(found: np.ndarray, rows: np.ndarray, scores: np.ndarray, k: int = K) -> float:
    """Mean fraction of each query's k exact neighbours found, where a found row whose exact score reaches the
    k-th neighbour's counts (``rows``/``scores``: exact_neighbours' output; ``found``: a search's rows)."""
    hits = wanted = 0
    for query in range(len(found)):
        real = rows[query] >= 0
        need = min(k, int(real.sum()))
        if need == 0:
            continue
        kth = scores[query, need - 1]
        accepted = set(rows[query][real & (scores[query] >= kth - TIE_TOLERANCE)].tolist())
        hits += min(need, len(accepted.intersection(found[query, :k].tolist())))
        wanted += need
    return hits / wanted if wanted else 1.0


def search_with(
    index: faiss.Index, queries: np.ndarray, knob: str, value: int, k: int = K, raw: np.ndarray | None = None
) -> np.ndarray:
    """The rows ``index`` finds for ``queries`` with ``knob`` at ``value`` (this call only). ``raw``: the
    queries' raw vectors, which a binary index re-ranks its candidates by as a search does (its raw decoder)."""
    _, found = index.search(queries, k, params=search_parameters(index, **{knob: value}), **search_extras(index, raw))
    return found


def exact_served(
    stash: VectorStash,
    transform: Whitening | RawTransform,
    queries: np.ndarray,
    pooling: str | None = None,
    served: Served | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The truth recall is measured against: the exact neighbours in the index's space, or with ``served``, the
    exact top ``served.depth`` re-ranked as a search re-ranks them; (scores, rows), best first."""
    depth = max(K, served.depth) if served else K
    scores, exact = exact_neighbours(stash, transform, queries, pooling, keep=max(K + EXTRA, depth))
    return served.rerank(exact[:, :depth], depth) if served else (scores, exact)


def served_rows(
    index: faiss.Index,
    queries: np.ndarray,
    knob: str,
    value: int,
    served: Served | None = None,
    raw: np.ndarray | None = None,
) -> np.ndarray:
    """The top 10 rows a search with ``knob`` at ``value`` serves: the index's, or with ``served``, its top
    ``served.depth`` re-ranked (``raw``: as ``search_with``)."""
    if served is None:
        return search_with(index, queries, knob, value, raw=raw)
    return served.rerank(search_with(index, queries, knob, value, max(K, served.depth), raw), K)[1]


def calibrate(
    index: faiss.Index,
    stash: VectorStash,
    transform: Whitening | RawTransform,
    queries: np.ndarray,
    target: float,
    source: str = "",
    pooling: str | None = None,
    served: Served | None = None,
    raw: np.ndarray | None = None,
) -> Calibration:
    """The smallest knob value of ``index`` (filled with every stash row, in order) whose recall@10 on
    ``queries`` (already transformed) reaches ``target``; when none does, the smallest within PLATEAU of the best
    (logged). With ``served`` (the index's re-scoring of these queries' candidates): recall@10 of searches that
    re-score their top ``served.depth`` candidates, against the exact top ``served.depth`` re-scored. ``raw``: the
    queries' raw vectors, by which a binary index with a raw decoder re-ranks as it does when serving."""
    check_target(target)
    knob = knob_of(index)
    if knob is None:
        raise ConfigError("a flat index searches exactly: it has no knob to calibrate (use --index-type hnsw or ivf)")
    if len(queries) == 0:
        raise ConfigError("no queries to calibrate on: give a file with at least one query", "queries")
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    scores, exact = exact_served(stash, transform, queries, pooling, served)
    rescore, rows = (served.depth if served else 0), int(index.ntotal)
    curve: list[tuple[int, float]] = []
    for value in grid(knob, index):
        recall = recall_with_ties(served_rows(index, queries, knob, value, served, raw), exact, scores)
        curve.append((value, round(recall, 4)))
        if recall >= target:
            return Calibration(knob, value, round(recall, 4), target, len(queries), source, True, curve, rescore, rows)
    best = max(recall for _, recall in curve)
    value, recall = next(point for point in curve if point[1] >= best - PLATEAU)
    log.warning(
        "this index reaches recall@10 %.3f at most on these queries (target %.2f): %s %d, past which it gains "
        "under %.3f",
        best, target, knob, value, PLATEAU,
    )  # fmt: skip
    return Calibration(knob, value, recall, target, len(queries), source, False, curve, rescore, rows)
