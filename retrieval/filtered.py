"""Dense search over only the rows a filter keeps: FAISS's per-call ID selector, or exact scoring of those rows.

A flat index scores every row by blocked products and drops the rows the filter leaves out before the top k
(FAISS's flat search with a selector scores row by row, without BLAS: 13x the unfiltered time at half the rows
kept), or, when it keeps few rows, searches with an ``IDSelectorBitmap``, which skips the others; both exact.
HNSW and IVF take the same selector, with their beam or probe count widened as the share of rows kept falls
(``Rule.widened``). When the filter keeps so few rows that scoring them all costs less than the widened search
(``Rule.exact``), those rows are scored exactly instead, as Qdrant switches to a full scan under a cardinality
threshold. What a filter's searches reuse (its rows, its bitmap, the kept rows' vectors) is made once per filter
(``Kept``), not per query.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from retrieval.codes import search_extras
from retrieval.index import list_count, search_parameters
from retrieval.scan import FlatScan

FEW_QUERIES = 8  # fewer queries than this are multiplied on one BLAS thread
FLAT_SELECTOR_SHARE = 0.02  # a flat index searches with the selector below this share kept, else blocked products
# The kept rows' vectors a filter holds for exact scoring, at most (20,000 rows of 1,536 dims): beyond it they are
# gathered for each search. A searcher bounds what all its filters hold together (``search.KEPT_BYTES``).
CACHED_VECTOR_BYTES = 128 << 20


@dataclass(frozen=True)
class Rule:
    """How one kind of index searches a filter. Exact scoring of the kept rows when they are at most
    ``exact_share`` of the index, or at most ``exact_rows`` rows that are at most ``rows_share`` of it; else
    FAISS's selector search, its knob (HNSW's efSearch, IVF's nprobe) widened to knob x share ** -``power``, and
    at least to what holds ``per_k`` x k kept rows in expectation (a beam of per_k k / share rows; lists holding
    per_k k / share rows), at most ``cap`` times."""

    exact_rows: int
    exact_share: float
    power: float
    per_k: float
    cap: float
    rows_share: float = 1.0

    def exact(self, kept: int, n: int) -> bool:
        """Whether a filter keeping ``kept`` of ``n`` rows is searched by scoring those rows exactly."""
        return kept <= self.exact_share * n or kept <= min(self.exact_rows, self.rows_share * n)

    def widened(self, value: int, k: int, share: float, rows_per_unit: float, most: int) -> int:
        """The knob for a search of ``k`` rows keeping ``share`` of the index: ``value`` widened, at most
        ``most`` (every row, every list); ``rows_per_unit``: the rows one unit of the knob reaches (1 for a
        beam, the rows of a list for nprobe)."""
        want = max(value * share**-self.power, self.per_k * k / (share * rows_per_unit))
        return int(min(math.ceil(min(want, value * self.cap)), most))


# Measured at 1M rows with the spectrum of real MiniLM vectors (scripts/bench_hybrid.py filters, one thread;
# docs/benchmarks/hybrid.md, results/hybrid/filters-1m.json), each p50 against the same index's unfiltered p50:
# - exact scoring of gathered rows costs ~0.1 us a row: 9,981 rows 1.2-1.3 ms, 19,835 rows 2.2 ms, while HNSW's
#   unfiltered search takes ~1.1 ms and IVF's (1,024 lists, nprobe 32) ~2.4 ms. At 2% kept (19,835 rows) exact
#   scoring and IVF's selector search cost about the same (0.87x against 1.04x); HNSW's selector search took 7.3x
#   there where exact scoring took 1.85x, and 9.5-12x at 1% and below, where exact scoring took 0.36-1.09x; at 5%
#   exact scoring took 4.3x (HNSW) and 2.0x (IVF), the selector search 2.1x and 1.2x. So both kinds switch at
#   20,000 rows, HNSW also at 1% of any larger index. IVF's unfiltered search is cheaper on a smaller index
#   (lists of fewer rows): at 100k rows (results/hybrid/filters-100k.json) exact scoring of 10,194 rows took
#   1.85x, the selector search 1.2x, and the two met at 5% (1.15x, 1.27x): IVF's rows switch is also at most 5%.
# - HNSW's beam: at 10% kept efSearch 128 reached recall@10 0.946 against exact search over the kept rows; a beam
#   of 2 k / share (200 rows) 0.967 at 1.3x, 3 k / share 0.979 at 1.7x. Its walk is the unfiltered one (the
#   selector only keeps rows out of the results), so at half the rows kept it needs no widening (0.978, as
#   unfiltered).
# - IVF's lists: nprobe x share ** -0.5 kept recall@10 >= 0.975 at every share from 50% to 0.1% (1.55x, 1.3x,
#   1.0x at 50%, 10%, 1%), where x 1 / share cost 2.1x, 3.4x, 2.9x, and no widening lost recall (0.94 at 10%,
#   0.88 at 1%). At 0.1% it probes every list (1.6x): exact scoring is 10x cheaper. ``per_k`` is a floor for
#   indexes probing few lists of few rows (on these rows it never binds): on 16-d rows without clumps, 64 lists,
#   nprobe 1, 1% kept, share ** -0.5 alone reached recall@10 0.56 (tests/test_hybrid.py).
RULES = {
    "hnsw": Rule(exact_rows=20_000, exact_share=0.01, power=0.0, per_k=2.0, cap=16.0),
    "ivf": Rule(exact_rows=20_000, exact_share=0.001, power=0.5, per_k=10.0, cap=1024.0, rows_share=0.05),
}


def rule_for(index: Any) -> Rule:
    """The rule for this index's kind: IVF's for inverted lists, else HNSW's."""
    return RULES["ivf"] if list_count(index) is not None else RULES["hnsw"]


class Kept:
    """The rows one filter keeps in one index, and what its searches reuse: FAISS's bitmap selector over them, their
    numbers and their vectors for exact scoring (each made on first use, then shared by every search with this
    filter; safe between threads)."""

    def __init__(self, mask: np.ndarray):
        mask = np.asarray(mask, dtype=bool)
        mask.flags.writeable = False
        self.mask = mask
        self.count = int(np.count_nonzero(mask))
        self._rows: np.ndarray | None = None
        self._selector: tuple[Any, np.ndarray] | None = None
        self._scan: FlatScan | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.count

    @property
    def share(self) -> float:
        return self.count / max(len(self.mask), 1)

    @property
    def rows(self) -> np.ndarray:
        """The kept rows' numbers, ascending."""
        with self._lock:
            if self._rows is None:
                self._rows = np.flatnonzero(self.mask)
                self._rows.flags.writeable = False
            return self._rows

    @property
    def nbytes(self) -> int:
        """The memory this filter holds: its mask, and whatever of its rows, bitmap and vectors it has made."""
        held = [self.mask, self._rows, None if self._selector is None else self._selector[1]]
        held.append(None if self._scan is None else self._scan.matrix)
        return sum(array.nbytes for array in held if array is not None)

    def selector(self) -> Any:
        """A FAISS ``IDSelectorBitmap`` over the kept rows (it reads a bitmap this object keeps alive)."""
        with self._lock:
            if self._selector is None:
                self._selector = selector(self.mask)
            return self._selector[0]

    def scan(self, vectors_of: Callable[[np.ndarray], np.ndarray]) -> FlatScan:
        """An exact scan of the kept rows' vectors in the index's space, ``vectors_of(rows)`` (its rows numbered
        0..len - 1, in the order of ``rows``): kept for the next search when they take at most
        ``CACHED_VECTOR_BYTES``."""
        with self._lock:
            if self._scan is not None:
                return self._scan
            if self._rows is None:
                self._rows = np.flatnonzero(self.mask)
                self._rows.flags.writeable = False
            vectors = np.ascontiguousarray(vectors_of(self._rows), dtype=np.float32)
            vectors.flags.writeable = False
            scan = FlatScan(vectors)
            if vectors.nbytes <= CACHED_VECTOR_BYTES:
                self._scan = scan
            return scan


def wider_knobs(index: Any, ef_search: int | None, nprobe: int | None) -> tuple[int | None, int | None] | None:
    """The knobs doubled, each up to what spans the index (efSearch N, nprobe every list); None when both do."""
    lists = list_count(index) or 0
    wider_ef = None if ef_search is None else min(2 * ef_search, max(ef_search, index.ntotal))
    wider_nprobe = None if nprobe is None else min(2 * nprobe, max(nprobe, lists))
    return None if (wider_ef, wider_nprobe) == (ef_search, nprobe) else (wider_ef, wider_nprobe)


def selector(mask: np.ndarray) -> tuple[Any, np.ndarray]:
    """A FAISS ``IDSelectorBitmap`` over the rows ``mask`` keeps, and the bitmap it reads (keep both alive for
    as long as the selector is used)."""
    import faiss

    bits = np.packbits(np.asarray(mask, dtype=bool), bitorder="little")
    return faiss.IDSelectorBitmap(len(mask), faiss.swig_ptr(bits)), bits


def exact_top(scan: FlatScan, rows: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, rows) of each query's best ``k`` of ``rows``, whose vectors ``scan`` holds in that order (the flat
    scan's paths: one query a slice per core, a batch one product); ``k`` columns, -1 / -inf past the rows there
    are."""
    scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
    found = np.full((len(queries), k), -1, dtype=np.int64)
    take = min(k, len(rows))
    if take == 0:
        return scores, found
    best_scores, best = scan.search(np.ascontiguousarray(queries, dtype=np.float32), take)
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
    kept: Kept,
    ef_search: int | None,
    nprobe: int | None,
    vectors_of: Callable[[np.ndarray], np.ndarray] | None,
    flat: np.ndarray | None,
    rule: Rule | None = None,
    raw: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(scores, rows) of each query's best ``k`` rows among those ``kept`` holds. ``vectors_of(rows)`` gives
    rows' vectors in the index's space for exact scoring (None: this index cannot, and the selector search is
    widened to span every row instead); ``flat``: a flat index's vectors (None for any other kind); ``raw``: the
    queries' raw vectors, for a binary index's re-rank (``codes.RawDecoder``)."""
    n = int(index.ntotal)
    if flat is not None and len(kept) > FLAT_SELECTOR_SHARE * n:
        return scan_masked(flat, queries, k, kept.mask)
    rule = rule or rule_for(index)
    if flat is None and vectors_of is not None and rule.exact(len(kept), n):
        return exact_top(kept.scan(vectors_of), kept.rows, queries, k)
    take = min(k, len(kept))
    scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
    found = np.full((len(queries), k), -1, dtype=np.int64)
    if take == 0:
        return scores, found
    lists = list_count(index) or 0
    if vectors_of is None:  # no exact scoring to fall back on: the knobs span every row instead
        ef_search = None if ef_search is None else n
        nprobe = None if nprobe is None else max(nprobe, lists)
    else:
        if ef_search is not None:
            ef_search = rule.widened(max(ef_search, take), take, kept.share, 1.0, n)
        if nprobe is not None:
            nprobe = rule.widened(nprobe, take, kept.share, n / max(lists, 1), max(lists, nprobe))
    chosen = kept.selector()
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    params = search_parameters(index, ef_search=ef_search, nprobe=nprobe, selector=chosen)
    every = search_extras(index, raw)  # the short queries' rows of it on each retry
    extra = dict(every)
    scores[:, :take], found[:, :take] = index.search(queries, take, params=params, **extra)
    # Fewer than ``take`` found (the probed lists or the beam held fewer kept rows): those queries again, the knob
    # doubled until they fill or it spans the index, as an unfiltered search does
    short = np.flatnonzero((found[:, :take] < 0).any(axis=1))
    while len(short) and (wider := wider_knobs(index, ef_search, nprobe)) is not None:
        ef_search, nprobe = wider
        params = search_parameters(index, ef_search=ef_search, nprobe=nprobe, selector=chosen)
        if "raw" in every:
            extra = {"raw": every["raw"][short]}
        scores[short, :take], found[short, :take] = index.search(queries[short], take, params=params, **extra)
        short = short[(found[short, :take] < 0).any(axis=1)]
    return scores, found
