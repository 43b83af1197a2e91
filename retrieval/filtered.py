"""Dense search over only the rows a filter keeps: FAISS's per-call ID selector, or exact scoring of those rows.

A flat index scores every row by blocked products and drops the rows the filter leaves out before the top k
(FAISS's flat search with a selector scores row by row, without BLAS: 13x the unfiltered time at half the rows
kept), or, when it keeps few rows, searches with an ``IDSelectorBitmap``, which skips the others; both exact.
HNSW and IVF take the same selector, with their beam or probe count widened by the share of rows kept (a graph
walk or a list scan sees that share of candidates pass). When the filter keeps so few rows that the graph or the
lists would miss them (``exact_below``), those rows are scored exactly instead, from the stash, as Qdrant
switches to a full scan under a cardinality threshold.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from retrieval.index import list_count, search_parameters

# At or below this many kept rows, or this share of the index, an HNSW or IVF index's filtered search scores the
# kept rows exactly. Measured by scripts/bench_hybrid.py (docs/benchmarks/hybrid.md): at 1M rows (IVF, one thread)
# exact scoring of 9,981 kept rows read from the stash took 11.9x the unfiltered p50 where the selector search
# took 1.6-2.6x at recall@10 1.00, and 988 rows 1.5x; at 20,000 rows the selector's HNSW beam needed 100+ ms for
# 194 kept rows where exact scoring took 0.6 ms.
EXACT_ROWS = 1_000
EXACT_SHARE = 0.001
# An approximate filtered search widens its knob by 1 / share kept, at most this many times. HNSW: FAISS's beam
# holds efSearch visited nodes, kept or not, so it is widened for the share the filter drops, within a cap (each
# step costs a walk of that many more nodes); IVF: a probed list's rows that the selector leaves out cost a bitmap
# test, not a distance, so probing 1 / share as many lists scores about as many rows as the unfiltered search
# does, and the cap is every list.
EF_WIDEN_CAP = 16.0
NPROBE_WIDEN_CAP = 1024.0
FEW_QUERIES = 8  # fewer queries than this are multiplied on one BLAS thread
FLAT_SELECTOR_SHARE = 0.02  # a flat index searches with the selector below this share kept, else blocked products


def exact_below(kept: int, n: int) -> bool:
    """Whether a filter keeping ``kept`` of ``n`` rows is searched by scoring those rows exactly."""
    return kept <= EXACT_ROWS or kept <= EXACT_SHARE * n


def selector(mask: np.ndarray) -> tuple[Any, np.ndarray]:
    """A FAISS ``IDSelectorBitmap`` over the rows ``mask`` keeps, and the bitmap it reads (keep both alive for
    as long as the selector is used)."""
    import faiss

    bits = np.packbits(np.asarray(mask, dtype=bool), bitorder="little")
    return faiss.IDSelectorBitmap(len(mask), faiss.swig_ptr(bits)), bits


def exact_top(vectors: np.ndarray, rows: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, rows) of each query's best ``k`` of ``rows``, whose vectors (in the index's space) are
    ``vectors``: inner products by FAISS's exact ``knn`` (its BLAS, on the pool FAISS searches with: numpy's own
    threads fought it, 50 ms for 1,500 rows on two busy cores); ``k`` columns, -1 / -inf past the rows there are."""
    import faiss

    scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
    found = np.full((len(queries), k), -1, dtype=np.int64)
    take = min(k, len(rows))
    if take == 0:
        return scores, found
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    best_scores, best = faiss.knn(
        queries, np.ascontiguousarray(vectors, dtype=np.float32), take, faiss.METRIC_INNER_PRODUCT
    )
    scores[:, :take], found[:, :take] = best_scores, rows[best]
    return scores, found


def scan_masked(vectors: np.ndarray, queries: np.ndarray, k: int, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact top ``k`` of every row of ``vectors`` that ``mask`` keeps: inner products tile by tile as the flat
    scan computes them (``scan.tiles``: aligned, so BLAS multiplies them; a mapped index's rows need not be), the
    rows left out set to -inf before they reach the heaps; -1 / -inf past the rows kept."""
    from threadpoolctl import threadpool_limits

    from retrieval.scan import Heaps, _best_first, tiles

    queries = np.ascontiguousarray(queries, dtype=np.float32)
    heaps = Heaps(len(queries), k)
    # a few queries' products on one BLAS thread: numpy's pool waking for each tile cost 5x on two busy cores
    with threadpool_limits(1 if len(queries) < FEW_QUERIES else None, user_api="blas"):
        for first, tile in tiles(vectors, 0, len(vectors)):
            scores = queries @ tile.T
            scores[:, ~mask[first : first + len(tile)]] = -np.inf
            heaps.add(scores, first)
    scores, rows = _best_first(*heaps.result(), k)
    rows = np.where(np.isneginf(scores), -1, rows)
    return scores, rows


def search_filtered(
    index: Any,
    queries: np.ndarray,
    k: int,
    mask: np.ndarray,
    ef_search: int | None,
    nprobe: int | None,
    vectors_of: Callable[[np.ndarray], np.ndarray] | None,
    flat: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    """(scores, rows) of each query's best ``k`` rows among those ``mask`` keeps. ``vectors_of(rows)`` gives rows'
    vectors in the index's space for exact scoring (None: this index cannot, and the selector search is widened to
    span every row instead); ``flat``: a flat index's vectors (None for any other kind)."""
    rows = np.flatnonzero(mask)
    n = int(index.ntotal)
    if flat is not None and len(rows) > FLAT_SELECTOR_SHARE * n:
        return scan_masked(flat, queries, k, mask)
    if flat is None and vectors_of is not None and exact_below(len(rows), n):
        return exact_top(vectors_of(rows), rows, queries, k)
    take = min(k, len(rows))
    scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
    found = np.full((len(queries), k), -1, dtype=np.int64)
    if take == 0:
        return scores, found
    chosen, bits = selector(mask)  # ``bits``, which the selector reads, lives until the search has returned
    share = len(rows) / max(n, 1)
    spans = vectors_of is None  # no exact scoring to fall back on: the knobs span every row instead
    if ef_search is not None:
        widen = math.inf if spans else min(EF_WIDEN_CAP, 1 / share)
        ef_search = int(min(max(ef_search * widen, take), n))
    if nprobe is not None:
        widen = math.inf if spans else min(NPROBE_WIDEN_CAP, 1 / share)
        nprobe = int(min(math.ceil(nprobe * widen), list_count(index) or nprobe))
    params = search_parameters(index, ef_search=ef_search, nprobe=nprobe, selector=chosen)
    got_scores, got_rows = index.search(np.ascontiguousarray(queries, dtype=np.float32), take, params=params)
    scores[:, :take], found[:, :take] = got_scores, got_rows
    return scores, found
