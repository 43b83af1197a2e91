"""The sliced flat scan against a float64 one-shot reference."""

from __future__ import annotations

import numpy as np
import pytest

from retrieval import scan as scan_module
from retrieval.scan import FlatScan, TopK

SCORE_ATOL = 1e-5  # float32 dot products of unit vectors against float64


def unit(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("nq", [1, 7])
def test_matches_the_exact_reference(threads: int, nq: int) -> None:
    rng = np.random.default_rng(threads * 10 + nq)
    matrix, queries = unit(rng, 20_000, 48), unit(rng, nq, 48)
    scan = FlatScan(matrix, threads=threads)
    assert len(scan.bounds) - 1 == threads  # really split into that many slices
    reference = queries.astype(np.float64) @ matrix.astype(np.float64).T
    for k in (1, 10, 500):
        scores, rows = scan.search(queries, k)
        assert scores.shape == rows.shape == (nq, k)
        expected = -np.sort(-reference, axis=1)[:, :k]
        np.testing.assert_allclose(scores, expected, atol=SCORE_ATOL)
        # the rows returned really have those scores, best first
        np.testing.assert_allclose(np.take_along_axis(reference, rows, axis=1), scores, atol=SCORE_ATOL)
        assert (np.diff(scores, axis=1) <= 0).all()


@pytest.mark.parametrize("path", ["numpy", "faiss", None])
def test_batches_match_the_exact_reference_on_either_path(path: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches (>= FEW_QUERIES) go to numpy's blocked product or FAISS's knn; None: the first batch times both."""
    monkeypatch.setattr(scan_module, "TILE_BYTES", 4 * 48 * 1000)  # 1,000-row tiles, the last of 300
    rng = np.random.default_rng(5)
    matrix, queries = unit(rng, 20_300, 48), unit(rng, 50, 48)
    scan = FlatScan(matrix, threads=2)
    scan.batch_path = path
    reference = queries.astype(np.float64) @ matrix.astype(np.float64).T
    for k in (1, 10, 500):
        scores, rows = scan.search(queries, k)
        assert scores.shape == rows.shape == (50, k) and len(set(rows[7].tolist())) == k
        np.testing.assert_allclose(scores, -np.sort(-reference, axis=1)[:, :k], atol=SCORE_ATOL)
        np.testing.assert_allclose(np.take_along_axis(reference, rows, axis=1), scores, atol=SCORE_ATOL)
    assert scan.batch_path in ("numpy", "faiss")  # settled by the first batch when it was None


def test_k_larger_than_a_slice_and_than_the_matrix() -> None:
    rng = np.random.default_rng(1)
    matrix = unit(rng, 9000, 16)
    scan = FlatScan(matrix, threads=2)
    assert len(scan.bounds) == 3
    scores, rows = scan.search(matrix[:1], 6000)  # more than either slice holds
    assert sorted(rows[0].tolist()) == sorted(set(rows[0].tolist())) and rows.min() >= 0
    assert rows[0, 0] == 0 and scores[0, 0] == pytest.approx(1.0, abs=1e-6)
    _, rows = scan.search(matrix[:1], 50_000)  # capped at n
    assert rows.shape == (1, 9000) and set(rows[0].tolist()) == set(range(9000))
    for nq, path in ((8, "numpy"), (30, "numpy"), (30, "faiss")):  # batches too: capped, never padded with -1
        scan.batch_path = path
        scores, rows = scan.search(matrix[:nq], 50_000)
        assert rows.shape == scores.shape == (nq, 9000) and rows.min() >= 0 and np.isfinite(scores).all()
        assert all(set(r.tolist()) == set(range(9000)) for r in rows)


@pytest.mark.parametrize("nq", [1, 8])  # the sliced scans, the tiled product
def test_ties_come_back_lower_row_first(nq: int) -> None:
    matrix = np.zeros((10_000, 4), dtype=np.float32)
    matrix[:, 0] = 1.0  # every row scores the same
    scan = FlatScan(matrix, threads=2)
    scan.batch_path = "numpy"
    scores, rows = scan.search(np.tile(np.array([[1, 0, 0, 0]], dtype=np.float32), (nq, 1)), 5)
    assert rows.tolist() == [[0, 1, 2, 3, 4]] * nq
    np.testing.assert_array_equal(scores, 1.0)


def test_small_matrices_are_one_slice_and_bad_matrices_are_refused() -> None:
    assert len(FlatScan(np.zeros((100, 4), dtype=np.float32), threads=2).bounds) == 2
    with pytest.raises(ValueError, match="float32"):
        FlatScan(np.zeros((100, 4), dtype=np.float64))
    with pytest.raises(ValueError, match="C-contiguous"):
        FlatScan(np.zeros((4, 100), dtype=np.float32).T)
    with pytest.raises(ValueError, match=r"\(n, d\) matrix"):
        FlatScan(np.zeros(100, dtype=np.float32))  # one vector is not a matrix


def misaligned(matrix: np.ndarray) -> np.ndarray:
    """The same values one byte off alignment, as FAISS's header leaves a flat index mapped from its file."""
    raw = np.zeros(matrix.nbytes + 1, dtype=np.uint8)
    view = np.frombuffer(raw.data, dtype=np.uint8, count=matrix.nbytes, offset=1).view(matrix.dtype)
    view = view.reshape(matrix.shape)
    view[...] = matrix
    return view


def test_tiles_of_a_misaligned_matrix_are_aligned_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """numpy multiplies misaligned arrays with its own loops, not BLAS (8x slower): every tile must be aligned."""
    monkeypatch.setattr(scan_module, "TILE_BYTES", 4 * 16 * 300)  # 300-row tiles of 16 dims
    matrix = unit(np.random.default_rng(3), 1000, 16)
    for source in (matrix, misaligned(matrix)):
        seen = []
        for first, tile in scan_module.tiles(source, 50, 1000):
            assert tile.flags.aligned and tile.flags.c_contiguous
            np.testing.assert_array_equal(tile, matrix[first : first + len(tile)])
            seen.append((first, len(tile)))
        assert seen == [(50, 300), (350, 300), (650, 300), (950, 50)]
        inner = [(first, len(tile)) for first, tile in scan_module.tiles(source, 100, 450)]  # stops at `stop`
        assert inner == [(100, 300), (400, 50)]
    assert not misaligned(matrix).flags.aligned  # the test really fed a misaligned matrix


def test_batches_over_a_misaligned_matrix_match_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scan_module, "TILE_BYTES", 4 * 48 * 700)  # tiles that do not divide the blocks
    rng = np.random.default_rng(8)
    matrix, queries = unit(rng, 12_345, 48), unit(rng, 16, 48)
    scan = FlatScan(misaligned(matrix), threads=2)
    reference = queries.astype(np.float64) @ matrix.astype(np.float64).T
    for nq in (2, 16):  # the sliced scans and the numpy product
        scores, rows = scan.search(queries[:nq], 20)
        np.testing.assert_allclose(scores, -np.sort(-reference[:nq], axis=1)[:, :20], atol=SCORE_ATOL)
        np.testing.assert_allclose(np.take_along_axis(reference[:nq], rows, axis=1), scores, atol=SCORE_ATOL)


def test_topk_streamed_in_blocks_equals_a_one_shot_top_k() -> None:
    """TopK (tune's and bench_scale's exact neighbours) over column blocks of every size around k: the same rows
    and scores as one argsort over the whole (nq, N) matrix (distinct float32 scores: no ties, exact equality)."""
    rng = np.random.default_rng(11)
    nq, k = 5, 10
    scores = rng.standard_normal((nq, 1000)).astype(np.float32)
    top = TopK(nq, k)
    first = 0
    for width in (3, 10, 1, 250, 11, 725):  # fewer than k, exactly k, one, many, k + 1, the rest
        top.push(scores[:, first : first + width].astype(np.float64), first)  # float64 in, float32 kept
        first += width
    assert first == scores.shape[1]
    got_scores, got_rows = top.result()
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(got_rows, order)
    np.testing.assert_array_equal(got_scores, np.take_along_axis(scores, order, axis=1))
    assert got_scores.dtype == np.float32 and got_rows.dtype == np.int64


def test_topk_with_fewer_rows_than_k_keeps_them_all_best_first() -> None:
    top = TopK(2, 10)
    assert top.result()[0].shape == (2, 0)
    top.push(np.array([[0.1, 0.5, 0.3], [0.9, 0.2, 0.4]]), 100)
    top.push(np.array([[0.4, 0.0], [0.1, 0.95]]), 103)
    scores, rows = top.result()
    assert rows.tolist() == [[101, 103, 102, 100, 104], [104, 100, 102, 101, 103]]
    np.testing.assert_array_equal(scores, np.float32([[0.5, 0.4, 0.3, 0.1, 0.0], [0.95, 0.9, 0.4, 0.2, 0.1]]))


def test_topk_ties_across_blocks_keep_the_lower_row() -> None:
    """Equal scores in different blocks (of at most k: inside a larger block a tie at the k-th place may go either
    way): the earlier rows win, as FAISS orders ties."""
    top = TopK(1, 2)
    for first in (4, 0, 2):  # blocks need not come in row order
        top.push(np.ones((1, 2)), first)
    assert top.result()[1].tolist() == [[0, 1]]


@pytest.mark.parametrize(
    ("policy", "path"), [({"scan": "numpy"}, "numpy"), ({"scan": "faiss"}, "faiss"), ({}, "faiss")]
)
def test_the_batch_path_follows_the_timing_policy(monkeypatch, policy: dict[str, str], path: str) -> None:
    """An injected answer is taken untimed; a deterministic policy ({} here, untimed) takes FAISS."""
    from retrieval import timing

    rng = np.random.default_rng(3)
    scan = FlatScan(unit(rng, 5000, 16), threads=1)
    monkeypatch.setattr(scan_module.FlatScan, "_numpy", lambda self, q, k: pytest.fail("timed"), raising=True)
    monkeypatch.setattr(scan_module.FlatScan, "_faiss", lambda self, q, k: pytest.fail("timed"), raising=True)
    with timing.use(timing.Policy(timed=False, answers=policy)):
        assert scan._faster_batch_path(unit(rng, 64, 16), 10) == path
