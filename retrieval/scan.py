"""Exact top-k over a flat matrix: the fastest of FAISS's paths and numpy's, behind one ``search``.

A few queries: FAISS answers them with a fused scan + heap (no score array written out), but with nq = 1 its
OpenMP path keeps one core busy and the other waiting, and at nq = 1 two OpenMP threads measured slower than
one. Splitting the rows into one contiguous slice per core, scanning each slice in its own thread with a
single-threaded FAISS call (FAISS releases the GIL), and merging the per-slice top-k, reaches the memory
bandwidth of both cores (scripts/bench_scale.py reports the scan rate).

Many queries: a matrix product, compute-bound. FAISS's BLAS path runs it with the BLAS its wheel bundles; on
an AMD EPYC that took 6x longer than numpy's own BLAS for the same product at 256 or 384 dims (and was as fast
at 768), so the first batch's first queries are answered both ways, twice, and the faster serves every batch:
numpy's product tile by tile into FAISS's heaps, or FAISS's ``knn``.

numpy's product goes through BLAS only for aligned arrays, and a flat index memory-mapped from its file is not:
FAISS's header puts the vectors 45 bytes into the file. On such a matrix numpy fell back to its own loops,
8x slower (100k x 128, 16 queries: 95 ms against 12 ms). So the product runs tile by tile, ``TILE_BYTES`` of
rows at a time, each tile copied into an aligned scratch first when the matrix is misaligned: a tile stays in
cache while it is multiplied, and the copy costs less than the cache misses it saves. Each tile's scores go
straight into one FAISS heap per query (``float_minheap_array_t.addn``, ids implicit), so no (queries x rows)
score matrix, nor ``argpartition``'s int64 copy of it, is ever made: a batch of 32 held 38 MB of temporaries
for a 100k index, which the allocator kept; now one tile's scores. It is also faster: 100k x 128, k 50, 16 / 32
queries: 11.4 / 17.6 ms against 15.7 / 25.1 ms for whole-block scores and ``argpartition``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import faiss
import numpy as np

from retrieval import timing

# Fewer queries than this: sliced scans. Each query is one pass over the matrix (memory-bound), so from a few
# queries on one matrix product is cheaper: a served 100k x 128 index (mapped), nq 1/2/3/4/8/16: sliced
# 3.1/6.3/9.2/13.2/23.6/47.9 ms, numpy 5.2/9.0/10.6/12.9/14.9/14.9 ms (one BLAS thread, as the service runs it).
FEW_QUERIES = 4
# FAISS's own switch to BLAS (distance_compute_blas_threshold): below it its knn scans once per query too, so
# such batches always take numpy's product.
FAISS_BLAS_QUERIES = 20
MIN_SLICE_ROWS = 4096  # smaller slices are not worth a thread hand-off
CALIBRATION_QUERIES = 64  # queries of the first batch that time the two batch paths
# Rows multiplied at a time: 2k / 8k / 32k rows of 128 dims (1 / 4 / 16 MiB), 16 queries: 10.6 / 10.6 / 15.2 ms
# per 100k rows with the aligned copy, against 14.7 ms for one product over the whole aligned matrix.
TILE_BYTES = 4 << 20

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _pool_threads() -> int:
    return max(1, min(os.cpu_count() or 1, faiss.omp_get_max_threads()))


def _scan_pool() -> ThreadPoolExecutor:
    """One process-wide pool; each of its threads runs FAISS single-threaded (the OpenMP setting is per thread)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(
                _pool_threads(),
                thread_name_prefix="retrieval-scan",
                initializer=faiss.omp_set_num_threads,
                initargs=(1,),
            )
        return _pool


class FlatScan:
    """Exact inner-product top-k over ``matrix`` (n, d) float32, C-contiguous; the matrix is not copied."""

    def __init__(self, matrix: np.ndarray, threads: int | None = None):
        if matrix.dtype != np.float32 or not matrix.flags.c_contiguous or matrix.ndim != 2:
            raise ValueError("FlatScan needs a C-contiguous float32 (n, d) matrix")
        self.matrix = matrix
        threads = threads or _pool_threads()
        parts = max(1, min(threads, matrix.shape[0] // MIN_SLICE_ROWS))
        self.bounds = np.linspace(0, matrix.shape[0], parts + 1).astype(np.int64)
        self.batch_path: str | None = None  # "numpy" or "faiss" once the first batch has timed both
        self._calibrating = threading.Lock()

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, rows), each (nq, k), best first; k is capped at the number of rows."""
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        k = min(k, self.matrix.shape[0])
        if queries.shape[0] < FEW_QUERIES:
            return self._sliced(queries, k)
        if queries.shape[0] < FAISS_BLAS_QUERIES:
            return self._numpy(queries, k)
        if self.batch_path is None:
            with self._calibrating:  # concurrent first batches: one times, the others wait for its choice
                if self.batch_path is None:
                    self.batch_path = self._faster_batch_path(queries[:CALIBRATION_QUERIES], k)
        return self._numpy(queries, k) if self.batch_path == "numpy" else self._faiss(queries, k)

    def _faster_batch_path(self, sample: np.ndarray, k: int) -> str:
        """Each batch path twice on ``sample``, interleaved (the first run of either pays for warming up), as the
        timing policy says (``timing.policy``: site ``scan``, FAISS when untimed)."""
        paths = {"faiss": lambda: self._faiss(sample, k), "numpy": lambda: self._numpy(sample, k)}
        return timing.policy().fastest("scan", paths, default="faiss", rounds=2)

    def _faiss(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return faiss.knn(queries, self.matrix, k, faiss.METRIC_INNER_PRODUCT)

    def _numpy(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """numpy's product tile by tile (``tiles``), each tile's scores pushed into FAISS's per-query heaps."""
        heaps = Heaps(queries.shape[0], k)
        for first, tile in tiles(self.matrix, 0, self.matrix.shape[0]):
            heaps.add(queries @ tile.T, first)
        return _best_first(*heaps.result(), k)  # heaps give tied scores higher row first; FAISS, lower first

    def _sliced(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        slices = list(zip(self.bounds[:-1].tolist(), self.bounds[1:].tolist(), strict=True))

        def scan(bounds: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
            start, stop = bounds
            scores, rows = faiss.knn(queries, self.matrix[start:stop], min(k, stop - start), faiss.METRIC_INNER_PRODUCT)
            return scores, rows + start

        if len(slices) == 1:
            return _scan_pool().submit(scan, slices[0]).result()
        parts = list(_scan_pool().map(scan, slices))
        return _best_first(
            np.concatenate([p[0] for p in parts], axis=1), np.concatenate([p[1] for p in parts], axis=1), k
        )


def tiles(matrix: np.ndarray, start: int, stop: int) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, rows) for ``matrix[start:stop]`` in tiles of about ``TILE_BYTES``, every one aligned, so
    numpy multiplies it with BLAS: a misaligned matrix's tiles are copies in one reused buffer (use each tile
    before asking for the next)."""
    rows = max(1, TILE_BYTES // max(1, matrix.strides[0]))
    scratch = None if matrix.flags.aligned else np.empty((min(rows, stop - start), matrix.shape[1]), matrix.dtype)
    for first in range(start, stop, rows):
        tile = matrix[first : min(stop, first + rows)]
        if scratch is not None:
            copy = scratch[: len(tile)]
            np.copyto(copy, tile)
            tile = copy
        yield first, tile


class Heaps:
    """The k largest scores per query and their rows, kept in one FAISS min-heap per query: scores arrive a
    (queries x rows) tile at a time, so no (queries x all rows) matrix is ever made."""

    def __init__(self, nq: int, k: int):
        self.scores = np.empty((nq, k), dtype=np.float32)
        self.rows = np.empty((nq, k), dtype=np.int64)
        self._heaps = faiss.float_minheap_array_t()
        self._heaps.nh, self._heaps.k = nq, k
        self._heaps.val, self._heaps.ids = faiss.swig_ptr(self.scores), faiss.swig_ptr(self.rows)
        self._heaps.heapify()  # empty places: row -1, the lowest float

    def add(self, scores: np.ndarray, first_row: int) -> None:
        """Scores of rows ``first_row, first_row + 1, ...`` for every query."""
        scores = np.ascontiguousarray(scores, dtype=np.float32)
        # FAISS's bundled .pyi leaves out the id offset j0
        self._heaps.addn(scores.shape[1], faiss.swig_ptr(scores), first_row)  # type: ignore[call-arg]

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """(scores, rows), best first; call once, when every tile is in."""
        self._heaps.reorder()
        return self.scores, self.rows


class TopK:
    """Exact top-k of (nq, N) scores that arrive in column blocks: memory is one block plus (nq, 2k), however
    large N grows. Rows tied at the k-th place inside a block may be kept where FAISS would keep a lower row."""

    def __init__(self, nq: int, k: int):
        self.k = k
        self.scores = np.full((nq, 0), -np.inf, dtype=np.float32)
        self.rows = np.full((nq, 0), -1, dtype=np.int64)

    def push(self, scores: np.ndarray, first_row: int) -> None:
        """Scores of rows ``first_row, first_row + 1, ...`` for every query."""
        if scores.shape[1] > self.k:
            top = np.argpartition(scores, -self.k, axis=1)[:, -self.k :]
            scores = np.take_along_axis(scores, top, axis=1)
        else:
            top = np.broadcast_to(np.arange(scores.shape[1]), scores.shape)
        merged = np.concatenate([self.scores, scores.astype(np.float32, copy=False)], axis=1)
        rows = np.concatenate([self.rows, top + first_row], axis=1)
        self.scores, self.rows = _best_first(merged, rows, self.k)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """(scores, rows), best first; fewer than k columns when fewer rows were pushed."""
        return self.scores, self.rows


def _best_first(scores: np.ndarray, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best of each row of candidates, best first; ties: lower row first, as FAISS orders them."""
    order = np.lexsort((rows, -scores), axis=1)[:, :k]
    return np.take_along_axis(scores, order, axis=1), np.take_along_axis(rows, order, axis=1)
