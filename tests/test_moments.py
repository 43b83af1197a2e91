"""Tests for retrieval.moments: streamed and merged moments equal the one-shot float64 reference."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from retrieval.errors import ConfigError, IndexDirError
from retrieval.moments import RunningMoments

N, D, RANK = 500, 32, 8

# Streaming only reorders float64 sums of the same float32 inputs: a few ulps per step, far below 1e-9
# relative. atol is scaled to the largest entry because near-zero off-diagonal entries have no useful rtol.
RTOL = 1e-9


@pytest.fixture(scope="module")
def data() -> np.ndarray:
    """Anisotropic, low intrinsic rank, large common mean: the shape of raw BERT vectors."""
    rng = np.random.default_rng(1338)
    scales = np.geomspace(10.0, 0.01, D)
    x = 100.0 + (rng.normal(size=(N, RANK)) @ rng.normal(size=(RANK, D))) * scales
    return (x + 1e-3 * rng.normal(size=(N, D))).astype(np.float32)


def reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x64 = x.astype(np.float64)
    return x64.mean(axis=0), np.cov(x64.T, bias=True)


def assert_matches(moments: RunningMoments, x: np.ndarray) -> None:
    mean, cov = reference(x)
    assert moments.n == x.shape[0]
    np.testing.assert_allclose(moments.mean, mean, rtol=RTOL, atol=RTOL * np.abs(mean).max())
    np.testing.assert_allclose(moments.covariance(), cov, rtol=RTOL, atol=RTOL * np.abs(cov).max())


@pytest.mark.parametrize("batch", [1, 7, N])  # 7 does not divide 500: a short last batch
def test_streamed_equals_one_shot(data: np.ndarray, batch: int) -> None:
    moments = RunningMoments(D)
    for start in range(0, N, batch):
        moments.update(data[start : start + batch])
    assert_matches(moments, data)


@pytest.mark.parametrize("offset", [1e3, 1e6])
def test_a_large_common_offset_costs_no_precision(offset: float, tmp_path) -> None:
    """Against an exact (long double) reference, whatever the offset: rows one at a time, shards merged, and a
    save and load half-way. Kept whole, a mean of 1e6 rounds by ~1e-10 at every update: 5e-11 relative error."""
    x = np.random.default_rng(2).normal(size=(400, 8)) + offset
    xl = x.astype(np.longdouble)
    exact = (xl - xl.mean(axis=0)).T @ (xl - xl.mean(axis=0)) / len(x)

    def error(moments: RunningMoments) -> float:
        diff = np.asarray(moments.covariance(), np.longdouble) - exact
        return float(np.linalg.norm(diff) / np.linalg.norm(exact))

    assert error(RunningMoments.from_array(x)) < 1e-14  # one batch: the one-shot computation
    rows = RunningMoments(8)
    for i, row in enumerate(x):
        rows.update(row[None])
        if i == 200:
            rows.save(tmp_path / "m.npz")
            rows = RunningMoments.load(tmp_path / "m.npz")
    merged = RunningMoments(8)
    for part in np.array_split(x, 13)[::-1]:
        merged.merge(RunningMoments.from_array(part))
    assert error(rows) < 1e-14 and error(merged) < 1e-14
    for moments in (rows, merged):  # the mean to within an ulp or two of the exact one
        assert np.abs(np.asarray(moments.mean, np.longdouble) - xl.mean(axis=0)).max() <= 4e-16 * offset


def test_moments_saved_before_shift_and_offset_were_kept_still_load(data: np.ndarray, tmp_path) -> None:
    moments = RunningMoments.from_array(data)
    np.savez(tmp_path / "old.npz", format_version=np.int64(1), n=np.int64(moments.n), mean=moments.mean, m2=moments.m2)
    old = RunningMoments.load(tmp_path / "old.npz")
    np.testing.assert_array_equal(old.mean, moments.mean)
    np.testing.assert_array_equal(old.covariance(), moments.covariance())
    assert_matches(old.merge(RunningMoments.from_array(data)), np.concatenate([data, data]))


def test_from_array_and_float16_input(data: np.ndarray) -> None:
    assert_matches(RunningMoments.from_array(data), data)
    half = data[:50, :4].astype(np.float16) - np.float16(100)  # any float dtype, accumulated in float64
    assert_matches(RunningMoments.from_array(half), half)


def test_merge_of_unequal_shards_equals_one_shot(data: np.ndarray) -> None:
    shards = [data[:123], data[123:123], data[123:]]  # the middle shard is empty
    merged = RunningMoments(D)
    for shard in shards:
        part = RunningMoments(D)
        for start in range(0, shard.shape[0], 50):
            part.update(shard[start : start + 50])
        assert merged.merge(part) is merged
    assert_matches(merged, data)


def test_merging_empty_shards_keeps_nothing_and_then_everything(data: np.ndarray) -> None:
    """A worker that saw no rows merges into a driver that has none yet: still empty, no division by zero."""
    merged = RunningMoments(D).merge(RunningMoments(D))
    assert merged.n == 0
    np.testing.assert_array_equal(merged.m2, np.zeros((D, D)))
    assert_matches(merged.merge(RunningMoments.from_array(data)), data)


def test_empty_batch_is_a_no_op(data: np.ndarray) -> None:
    moments = RunningMoments.from_array(data)
    before = moments.m2.copy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "mean of empty slice" noise either
        moments.update(np.empty((0, D), dtype=np.float32))
    assert moments.n == N
    np.testing.assert_array_equal(moments.m2, before)


def test_save_load_round_trip_is_exact(data: np.ndarray, tmp_path) -> None:
    moments = RunningMoments.from_array(data)
    path = tmp_path / "moments.npz"
    moments.save(path)
    loaded = RunningMoments.load(path)
    assert loaded.n == moments.n and loaded.dim == D
    with np.load(path) as saved:  # the mean other readers take from the file
        np.testing.assert_array_equal(saved["mean"], moments.mean)
    np.testing.assert_array_equal(loaded.mean, moments.mean)
    np.testing.assert_array_equal(loaded.m2, moments.m2)


def test_load_refuses_another_format_version(tmp_path) -> None:
    path = tmp_path / "moments.npz"
    with open(path, "wb") as fh:
        np.savez(fh, format_version=2, n=0, mean=np.zeros(2), m2=np.zeros((2, 2)))
    with pytest.raises(IndexDirError, match="format version 2"):
        RunningMoments.load(path)


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"n": -1, "mean": np.zeros(2), "m2": np.zeros((2, 2))}, "inconsistent moments"),
        ({"n": 3, "mean": np.zeros(2), "m2": np.zeros((3, 3))}, "inconsistent moments"),
        ({"n": 3, "mean": np.zeros(2)}, "cannot read moments"),  # no m2
    ],
)
def test_load_refuses_inconsistent_or_incomplete_files(tmp_path, arrays: dict, message: str) -> None:
    path = tmp_path / "moments.npz"
    with open(path, "wb") as fh:
        np.savez(fh, format_version=1, **arrays)
    with pytest.raises(IndexDirError, match=message):
        RunningMoments.load(path)


def test_load_refuses_a_truncated_file(data: np.ndarray, tmp_path) -> None:
    path = tmp_path / "moments.npz"
    RunningMoments.from_array(data).save(path)
    path.write_bytes(path.read_bytes()[:100])  # a bad zip
    with pytest.raises(IndexDirError, match="cannot read moments"):
        RunningMoments.load(path)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_input_is_refused(bad: float) -> None:
    x = np.ones((4, 3), dtype=np.float32)
    x[2, 1:] = bad  # two bad values, one bad row
    moments = RunningMoments(3)
    with pytest.raises(ConfigError, match=r"NaN or inf values \(1 of 4 rows"):
        moments.update(x)
    assert moments.n == 0  # nothing was folded in


def test_wrong_shape_is_a_programming_error() -> None:
    with pytest.raises(ValueError):
        RunningMoments(0)
    with pytest.raises(ValueError):
        RunningMoments(3).update(np.ones((2, 4)))
    with pytest.raises(ValueError):
        RunningMoments(3).update(np.ones((2, 1)))  # would broadcast silently into every coordinate
    with pytest.raises(ValueError):
        RunningMoments.from_array(np.ones(3))
    with pytest.raises(ValueError):
        RunningMoments(3).update(np.ones(3))
    with pytest.raises(ValueError):
        RunningMoments(3).merge(RunningMoments(4))


def test_covariance_of_nothing_is_refused() -> None:
    with pytest.raises(ConfigError, match="no vectors"):
        RunningMoments(3).covariance()


def test_repr() -> None:
    assert repr(RunningMoments.from_array(np.ones((2, 3)))) == "RunningMoments(dim=3, n=2)"
