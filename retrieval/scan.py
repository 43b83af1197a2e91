"""Exact top-k over a flat matrix for a few queries: one FAISS scan per core over its own slice of the rows.

FAISS answers a handful of queries with a fused scan + heap (no score array written out), but with nq = 1 its
OpenMP path keeps one core busy and the other waiting, and at nq = 1 two OpenMP threads measured slower than
one. Splitting the rows into one contiguous slice per core, scanning each slice in its own thread with a
single-threaded FAISS call (FAISS releases the GIL), and merging the per-slice top-k, reaches the memory
bandwidth of both cores (scripts/bench_scale.py reports the scan rate). Many queries at once go to FAISS's own
BLAS path instead, which is compute-bound and already uses every core.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import faiss
import numpy as np

FEW_QUERIES = 20  # FAISS's own switch to BLAS (distance_compute_blas_threshold); below it the scan is memory-bound
MIN_SLICE_ROWS = 4096  # smaller slices are not worth a thread hand-off

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

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, rows), each (nq, k), best first; k is capped at the number of rows."""
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        k = min(k, self.matrix.shape[0])
        slices = list(zip(self.bounds[:-1].tolist(), self.bounds[1:].tolist(), strict=True))

        def scan(bounds: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
            start, stop = bounds
            scores, rows = faiss.knn(queries, self.matrix[start:stop], min(k, stop - start), faiss.METRIC_INNER_PRODUCT)
            return scores, rows + start

        if len(slices) == 1:
            return _scan_pool().submit(scan, slices[0]).result()
        parts = list(_scan_pool().map(scan, slices))
        scores = np.concatenate([p[0] for p in parts], axis=1)
        rows = np.concatenate([p[1] for p in parts], axis=1)
        order = np.lexsort((rows, -scores), axis=1)[:, :k]  # ties: lower row first, as FAISS orders them
        return np.take_along_axis(scores, order, axis=1), np.take_along_axis(rows, order, axis=1)
