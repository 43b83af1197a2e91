"""Tests for retrieval.whitening: the kernel against the paper's reference, its variants, and save/load."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from retrieval.errors import ConfigError, IndexDirError
from retrieval.info import spectrum_summary
from retrieval.moments import RunningMoments
from retrieval.whitening import (
    DEFAULT_CENTER_REDUCED,
    DEFAULT_GAMMA,
    Drift,
    RawTransform,
    TransformSpec,
    Whitening,
    _warn_few_rows,
    kernel_drift,
    l2_normalize,
    load_transform,
)

N, D = 2000, 16

# The kernel is fitted from float64 moments; the reference uses np.cov on the same data. The two covariances
# differ by ~1e-16 relative, and eigenvectors amplify that by lam_max / (smallest eigengap), about 1e3 here,
# so 1e-9 (relative to the largest entry) leaves a wide margin while catching any formula slip.
TOL64 = 1e-9
# transform() runs in float32 (24-bit mantissa, ~6e-8 relative per operation, summed over D terms).
TOL32 = 1e-5


@pytest.fixture(scope="module")
def data() -> np.ndarray:
    """Full-rank (N >> D) anisotropic data with a large common mean and well-separated eigenvalues."""
    rng = np.random.default_rng(1338)
    rotation, _ = np.linalg.qr(rng.normal(size=(D, D)))
    scales = np.geomspace(3.0, 0.3, D)  # eigenvalues from ~9 down to ~0.09
    return (100.0 + (rng.normal(size=(N, D)) * scales) @ rotation.T).astype(np.float32)


def fit(x: np.ndarray, **kwargs) -> Whitening:
    return Whitening.fit(RunningMoments.from_array(x), **kwargs)


def align_signs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a`` with each column's sign flipped to agree with the same column of ``b``."""
    return a * np.sign(np.sum(a * b, axis=0))


def test_full_whitening_equals_the_papers_reference(data: np.ndarray) -> None:
    x = data.astype(np.float64)
    # Su et al. (2021), compute_kernel_bias: W = U / sqrt(s) from the SVD of the covariance.
    mu = x.mean(axis=0)
    u, s, _ = np.linalg.svd(np.cov(x.T, bias=True))
    reference = u / np.sqrt(s)

    whitening = fit(data, gamma=1.0, epsilon=0.0)
    assert whitening.kernel.shape == (D, D) and whitening.n == N
    np.testing.assert_allclose(whitening.mean, mu, rtol=TOL64)
    kernel = align_signs(whitening.kernel, reference)
    np.testing.assert_allclose(kernel, reference, rtol=TOL64, atol=TOL64 * np.abs(reference).max())
    np.testing.assert_allclose(whitening.eigenvalues, s, rtol=TOL64)

    y = (x - whitening.mean) @ whitening.kernel
    np.testing.assert_allclose(np.cov(y.T, bias=True), np.eye(D), atol=TOL64)


@pytest.mark.parametrize("gamma", [0.0, 0.3, 1.0])
def test_uncentred_kernel_equals_a_one_shot_second_moment_reference(data: np.ndarray, gamma: float) -> None:
    """Uncentred, the kernel comes from E[x x^T] (no mean subtracted), and so does the transform."""
    x = data.astype(np.float64)
    s, u = np.linalg.eigh(x.T @ x / len(x))  # float64 one shot: the second moment
    s, u = s[::-1], u[:, ::-1]
    reference = u[:, :6] * (s[:6] + 1e-6 * s[0]) ** (-gamma / 2)

    whitening = fit(data, dim=6, gamma=gamma, epsilon=1e-6, center=False)
    assert not whitening.center
    np.testing.assert_allclose(whitening.mean, x.mean(axis=0), rtol=TOL64)  # kept for the drift diagnostics
    np.testing.assert_allclose(whitening.eigenvalues, s, rtol=TOL64, atol=TOL64 * s[0])
    kernel = align_signs(whitening.kernel, reference)
    # The mean (100 in every coordinate) dominates the second moment: its eigengaps relative to lam_max are
    # ~1e4 smaller than the covariance's, so the eigenvectors carry ~1e-12 relative error, still far below 1e-9.
    np.testing.assert_allclose(kernel, reference, rtol=TOL64, atol=TOL64 * np.abs(reference).max())
    expected = l2_normalize(x @ whitening.kernel)  # no centring
    np.testing.assert_allclose(whitening.transform(data), expected, atol=TOL32)
    centred = fit(data, dim=6, gamma=gamma, epsilon=1e-6)
    assert not np.allclose(np.abs(centred.transform(data)), np.abs(expected), atol=1e-2)  # the flag matters


def test_truncation_keeps_the_top_directions(data: np.ndarray) -> None:
    full = fit(data)
    k = 5
    top = fit(data, dim=k)
    assert top.kernel.shape == (D, k) and (top.dim_in, top.dim_out) == (D, k)
    np.testing.assert_array_equal(top.kernel, full.kernel[:, :k])
    np.testing.assert_array_equal(top.eigenvalues, full.eigenvalues)
    lam = full.eigenvalues
    assert np.all(np.diff(lam) <= 0)
    assert top.explained_variance == pytest.approx(lam[:k].sum() / lam.sum(), rel=1e-12)
    assert full.explained_variance == pytest.approx(1.0, rel=1e-12)
    assert top.transform(data).shape == (N, k)


def test_gamma_zero_is_an_orthonormal_rotation(data: np.ndarray) -> None:
    kernel = fit(data, gamma=0.0).kernel
    np.testing.assert_allclose(kernel.T @ kernel, np.eye(D), atol=TOL64)


def test_soft_whitening_scales_columns_by_lambda_to_minus_a_quarter(data: np.ndarray) -> None:
    rotation = fit(data, gamma=0.0, epsilon=0.0)
    soft = fit(data, gamma=0.5, epsilon=0.0)
    np.testing.assert_allclose(soft.kernel, rotation.kernel * rotation.eigenvalues**-0.25, rtol=1e-12)


def test_epsilon_is_relative_to_the_largest_eigenvalue(data: np.ndarray) -> None:
    plain, shrunk = fit(data, epsilon=0.0), fit(data, epsilon=0.1)
    lam = plain.eigenvalues
    expected = plain.kernel * np.sqrt(lam / (lam + 0.1 * lam[0]))
    np.testing.assert_allclose(shrunk.kernel, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rows", [8, 16, 40])  # N < D, N == D, and N > D but of rank 8
def test_rank_deficient_data_stays_finite(rows: int) -> None:
    rng = np.random.default_rng(7)
    base = 100.0 + rng.normal(size=(8, D)).astype(np.float32)
    x = base[rng.integers(0, 8, size=rows)]  # duplicate rows: rank <= 7 after centring
    whitening = fit(x, gamma=1.0)
    assert np.isfinite(whitening.kernel).all()
    assert np.all(whitening.eigenvalues >= 0)
    y = whitening.transform(x)
    assert np.isfinite(y).all()


def test_identical_rows_stay_finite() -> None:
    x = np.full((10, 4), 3.0, dtype=np.float32)
    whitening = fit(x)
    assert np.isfinite(whitening.kernel).all() and whitening.explained_variance == 1.0
    np.testing.assert_array_equal(whitening.transform(x), np.zeros((10, 4), np.float32))


def test_singular_covariance_without_epsilon_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    x = np.array([[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]], dtype=np.float32)  # rank 1
    with caplog.at_level(logging.WARNING), pytest.raises(ConfigError, match="singular.* `epsilon` is 0;"):
        fit(x, epsilon=0.0)
    assert not caplog.records  # refused in one line: the few-rows warning comes only with a kernel
    assert fit(x, dim=1, epsilon=0.0).dim_out == 1  # the kept direction alone is fine
    # a positive epsilon within round-off of 0 is not "0": the message names it and the floor (d ulps)
    with pytest.raises(ConfigError, match=r"`epsilon` \(1e-17\) is within round-off of 0 \(at most 4.4e-16\)"):
        fit(x, epsilon=1e-17)


@pytest.mark.parametrize("scale", [1e-20, 1e19])
def test_a_kernel_outside_float32_is_refused_not_turned_into_nan(scale: float) -> None:
    """Queries and documents are transformed in float32: gamma 2 on vectors at 1e-20 needs kernel entries of
    ~1e40 (inf in float32, NaN vectors after), at 1e19 entries of ~1e-38 (subnormal). Refused, naming the cause;
    gamma 1 on the same vectors fits, and gives the unit-scale data's vectors (whitening is scale-free)."""
    x = np.random.default_rng(3).normal(size=(400, 16))
    with pytest.raises(ConfigError, match="outside float32's range.*rescale the vectors"):
        fit(x * scale, dim=8, gamma=2.0)
    scaled = fit(x * scale, dim=8, gamma=1.0)
    np.testing.assert_allclose(scaled.transform(x * scale), fit(x, dim=8, gamma=1.0).transform(x), atol=2e-5)


@pytest.mark.parametrize("seed", range(6))
def test_round_off_eigenvalues_count_as_zero(seed: int) -> None:
    """Rank-3 data in 16 dims kept at 8: directions 4-8 are null, their eigenvalues round-off of either sign
    (~1e-16 of the largest; a negative one is clipped to an exact 0, a positive one was let through). With
    epsilon 0 they must be refused as singular, not raised to -gamma/2 (a ~1e7 gain on noise); the top 3
    directions alone fit cleanly."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(500, 3)) @ rng.normal(size=(3, 16))
    with pytest.raises(ConfigError, match="singular"):
        fit(x, dim=8, gamma=1.0, epsilon=0.0)
    top = fit(x, dim=3, gamma=1.0, epsilon=0.0)
    y = top.transform(x, normalize=False).astype(np.float64)
    np.testing.assert_allclose(np.cov(y.T, bias=True), np.eye(3), atol=1e-4)


def test_a_spec_with_dim_past_d_is_refused_at_fit() -> None:
    moments = RunningMoments.from_array(np.random.default_rng(0).normal(size=(100, 8)))
    with pytest.raises(ConfigError, match="between 1 and the encoder's dimension 8"):
        TransformSpec(dim=64).fit(moments)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dim": 0}, "`dim` must be between 1 and 16"),
        ({"dim": D + 1}, "`dim` must be between 1 and 16"),
        ({"gamma": -0.5}, "`gamma`"),
        ({"epsilon": -1e-6}, "`epsilon`"),
    ],
)
def test_bad_options_are_refused(data: np.ndarray, kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        fit(data, **kwargs)


@pytest.mark.parametrize("dim", [8.0, True, "8"])
def test_a_dim_that_is_not_a_whole_number_is_refused(dim: object) -> None:
    with pytest.raises(ConfigError, match="`dim` must be a whole number"):
        TransformSpec(dim=dim).check(D)  # type: ignore[arg-type]
    TransformSpec(dim=np.int64(8)).check(D)  # numpy's integers are whole numbers


def test_too_few_rows_are_refused() -> None:
    with pytest.raises(ConfigError, match="at least 2"):
        fit(np.ones((1, 3)))
    with pytest.raises(ConfigError):
        Whitening.fit(RunningMoments(3))


def test_few_rows_log_a_warning(data: np.ndarray, caplog: pytest.LogCaptureFixture) -> None:
    _warn_few_rows.cache_clear()  # warned once per process and shape: another test may have fitted this one
    with caplog.at_level(logging.WARNING, logger="retrieval.whitening"):
        fit(data[: 5 * D])
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="retrieval.whitening"):
        fit(data[: 5 * D - 1])
    assert "only 79 rows" in caplog.text and "no whitening" in caplog.text


def test_the_few_rows_warning_comes_once_per_shape(data: np.ndarray, caplog: pytest.LogCaptureFixture) -> None:
    """A sweep fits dozens of kernels on the same rows (`tune` printed the same line 24 times): one line each."""
    _warn_few_rows.cache_clear()
    with caplog.at_level(logging.WARNING, logger="retrieval.whitening"):
        for gamma in (0.0, 0.3, 1.0):
            for dim in (D, 4):
                fit(data[:50], dim=dim, gamma=gamma)
        fit(data[:60])
        fit(data[:50])
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert messages[0].startswith(f"fitting a {D} x {D} covariance on only 50 rows")
    assert messages[1].startswith(f"fitting a {D} x {D} covariance on only 60 rows")


def test_transform_centres_whitens_and_normalises(data: np.ndarray) -> None:
    whitening = fit(data, dim=10)
    x = data.astype(np.float64)
    expected = (x - whitening.mean) @ whitening.kernel

    raw = whitening.transform(data, normalize=False)
    assert raw.dtype == np.float32 and raw.shape == (N, 10)
    np.testing.assert_allclose(raw, expected, rtol=TOL32, atol=TOL32 * np.abs(expected).max())

    y = whitening.transform(data)
    assert y.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(y, axis=1), 1.0, atol=1e-6)  # float32 rounding of a unit norm
    unit = expected / np.linalg.norm(expected, axis=1, keepdims=True)
    np.testing.assert_allclose(y, unit, atol=TOL32)

    one = whitening.transform(data[3])
    assert one.shape == (1, 10)
    np.testing.assert_array_equal(one, whitening.transform(data[3:4]))
    with pytest.raises(ValueError):
        whitening.transform(data[:, :5])


def test_l2_normalize_keeps_zero_rows_zero() -> None:
    x = np.array([[3.0, 4.0], [0.0, 0.0]])
    y = l2_normalize(x)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, np.array([[0.6, 0.8], [0.0, 0.0]], dtype=np.float32))


@pytest.mark.parametrize("scale", [1e-30, 1e-14, 1.0, 1e20, 1e37])
def test_l2_normalize_gives_unit_rows_at_any_float32_scale(scale: float) -> None:
    """Norms in float32 overflowed above ~1e19 per entry (every row came out 0) and a 1e-12 floor left rows of
    1e-14 short of unit length: the result must be the float64 reference at every scale float32 holds."""
    x = (np.random.default_rng(5).normal(size=(20, 32)) * scale).astype(np.float32)
    reference = x.astype(np.float64) / np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True)
    np.testing.assert_allclose(l2_normalize(x), reference, atol=1e-7)  # float32 rounding of the result only


def test_raw_transform_only_normalises(data: np.ndarray) -> None:
    raw = RawTransform(D)
    assert (raw.dim_in, raw.dim_out) == (D, D)
    np.testing.assert_array_equal(raw.transform(data), l2_normalize(data))
    np.testing.assert_array_equal(raw.transform(data, normalize=False), data)
    assert raw.transform(data[0]).shape == (1, D)


def test_deterministic_signs(data: np.ndarray) -> None:
    first = fit(data, dim=8)
    np.testing.assert_array_equal(fit(data, dim=8).kernel, first.kernel)
    permuted = data[np.random.default_rng(3).permutation(N)]
    kernel = fit(permuted, dim=8).kernel  # summed in another order: equal up to rounding, same signs
    np.testing.assert_allclose(kernel, first.kernel, rtol=TOL64, atol=TOL64 * np.abs(first.kernel).max())
    top = np.abs(first.kernel).argmax(axis=0)
    assert np.all(first.kernel[top, np.arange(8)] > 0)


def test_whitening_round_trip_is_exact(data: np.ndarray, tmp_path) -> None:
    whitening = fit(data, dim=6, gamma=0.5, epsilon=1e-4)
    path = tmp_path / "transform.npz"
    whitening.save(path)
    for loaded in (Whitening.load(path), load_transform(path)):
        assert isinstance(loaded, Whitening)
        for name in ("mean", "kernel", "eigenvalues"):
            np.testing.assert_array_equal(getattr(loaded, name), getattr(whitening, name))
        assert (loaded.gamma, loaded.epsilon, loaded.n) == (0.5, 1e-4, N)
        np.testing.assert_array_equal(loaded.transform(data), whitening.transform(data))
    uncentred = fit(data, dim=6, gamma=0.5, center=False)
    uncentred.save(path)
    loaded = Whitening.load(path)
    assert not loaded.center
    np.testing.assert_array_equal(loaded.transform(data), uncentred.transform(data))


def test_version_1_transforms_load_as_centred(data: np.ndarray, tmp_path) -> None:
    """Indexes written before ``center`` existed (format version 1, no such key) were all centred."""
    whitening = fit(data, dim=6, gamma=0.5)
    path = tmp_path / "v1.npz"
    arrays = {"mean": whitening.mean, "kernel": whitening.kernel, "eigenvalues": whitening.eigenvalues}
    scalars = {"gamma": np.float64(0.5), "epsilon": np.float64(whitening.epsilon), "n": np.int64(N)}
    with open(path, "wb") as fh:
        np.savez(fh, format_version=np.int64(1), kind=np.str_("whitening"), **arrays, **scalars)
    loaded = load_transform(path)
    assert isinstance(loaded, Whitening) and loaded.center
    np.testing.assert_array_equal(loaded.transform(data), whitening.transform(data))
    # ... and so were the specs their manifests recorded: refit must not switch them to the new default.
    recorded = {"dim": 6, "gamma": 0.5, "epsilon": 1e-6, "whiten": True, "pooling": "mean"}
    assert TransformSpec.from_dict(recorded).resolve(D).center is True
    assert TransformSpec.from_dict({"dim": D, "gamma": None, "whiten": False}).center is None


def test_uncentred_drift_is_zero_on_the_fitted_data_and_grows_with_a_shift(data: np.ndarray) -> None:
    """The drift of an uncentred kernel is measured about zero, where it was fitted, not about the mean."""
    moments = RunningMoments.from_array(data)
    kernel = Whitening.fit(moments, dim=6, gamma=0.5, center=False)
    same = kernel_drift(kernel, moments)
    assert same.covariance_drift < 1e-9 and same.subspace_overlap > 1 - 1e-9 and same.mean_shift < 1e-9
    moved = RunningMoments.from_array(data + np.float32(5.0))
    shifted = kernel_drift(kernel, moved)
    assert shifted.covariance_drift > 0.01 and shifted.mean_shift > 0


def test_raw_round_trip(tmp_path) -> None:
    path = tmp_path / "transform.npz"
    RawTransform(D).save(path)
    assert load_transform(path) == RawTransform(D)
    with pytest.raises(IndexDirError, match="kind 'raw'"):
        Whitening.load(path)


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"format_version": 1, "kind": "mystery"}, "kind 'mystery'"),
        ({"format_version": 3, "kind": "raw", "dim": 3}, "format version 3"),
        ({"kind": "raw", "dim": 3}, "format version None"),
        ({"format_version": 1, "n": 3, "mean": np.zeros(2)}, "kind None"),  # moments.npz, given as a transform
    ],
)
def test_unknown_files_are_refused(tmp_path, arrays: dict, message: str) -> None:
    path = tmp_path / "transform.npz"
    with open(path, "wb") as fh:
        np.savez(fh, **arrays)
    with pytest.raises(IndexDirError, match=message):
        load_transform(path)


def test_missing_file_is_refused(tmp_path) -> None:
    with pytest.raises(IndexDirError, match="cannot read"):
        load_transform(tmp_path / "absent.npz")


# ----- the defaults: raw without a dim, whitening with DEFAULT_GAMMA below it -------------------------------
def test_transform_spec_defaults_resolve_against_the_encoder_dimension() -> None:
    raw = TransformSpec(dim=16, gamma=None, whiten=False)
    assert TransformSpec().resolve(16) == raw  # no dim: the raw vectors
    assert TransformSpec(dim=16).resolve(16) == raw  # a "reduction" to d reduces nothing
    reduced = TransformSpec(dim=8, gamma=DEFAULT_GAMMA, whiten=True, center=DEFAULT_CENTER_REDUCED)
    assert TransformSpec(dim=8).resolve(16) == reduced and DEFAULT_CENTER_REDUCED is False
    assert TransformSpec(dim=8, center=True).resolve(16).center is True  # asked for
    full = TransformSpec(dim=16, gamma=0.5, whiten=True, center=True)  # full rank: centred, as the paper
    assert TransformSpec(gamma=0.5).resolve(16) == full  # asked for
    assert TransformSpec(whiten=True).resolve(16) == TransformSpec(
        dim=16, gamma=DEFAULT_GAMMA, whiten=True, center=True
    )
    assert TransformSpec(dim=8, gamma=1.0, whiten=False).whitens is False
    assert (TransformSpec().whitens, TransformSpec(dim=8).whitens, TransformSpec(gamma=0.0).whitens) == (
        False,
        None,
        True,
    )
    assert TransformSpec(dim=8).label == f"k=8 g={DEFAULT_GAMMA:g}" and TransformSpec().label == "raw"
    assert TransformSpec(dim=8, center=False).label == f"k=8 g={DEFAULT_GAMMA:g} uncentred"
    with pytest.raises(ConfigError, match="raw transform keeps all 16 dimensions"):
        TransformSpec(dim=8, whiten=False).check(16)
    with pytest.raises(ConfigError, match="no kernel to centre"):
        TransformSpec(whiten=False, center=False).check(16)
    TransformSpec(dim=8).check(16)  # whiten None with a dim: fine


def test_transform_spec_fit_follows_the_resolved_spec() -> None:
    x = np.random.default_rng(0).normal(size=(200, 16)) * np.linspace(3, 0.1, 16) + 5
    moments = RunningMoments.from_array(x)
    assert isinstance(TransformSpec().fit(moments), RawTransform)
    reduced = TransformSpec(dim=8).fit(moments)
    assert isinstance(reduced, Whitening) and (reduced.dim_out, reduced.gamma) == (8, DEFAULT_GAMMA)
    assert reduced.center is DEFAULT_CENTER_REDUCED
    assert TransformSpec(dim=8, center=True).fit(moments).center  # type: ignore[union-attr]


# ----- mutation-testing gaps: bounds, the round-off threshold, float32 centring, drift numbers ----------------
def test_gamma_zero_needs_no_epsilon_on_singular_data() -> None:
    """A PCA rotation raises nothing to a negative power: null directions are fine with epsilon 0."""
    x = np.array([[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]], dtype=np.float32)  # rank 1
    kernel = fit(x, gamma=0.0, epsilon=0.0).kernel
    np.testing.assert_allclose(kernel.T @ kernel, np.eye(2), atol=TOL64)


def test_eigenvalues_within_d_ulps_of_the_largest_count_as_zero() -> None:
    """A diagonal covariance has exact eigenvalues: 1e-15 (4.5 ulps of 1, below d = 16 ulps) is round-off of a
    zero, so epsilon 0 refuses it; 1e-13 (450 ulps) is a real, if small, direction."""
    d = 16
    for tiny, refused in [(1e-15, True), (1e-13, False)]:
        cov = np.diag(np.r_[1.0, 0.5, np.full(d - 2, tiny)])
        if refused:
            with pytest.raises(ConfigError, match="singular"):
                Whitening.fit_arrays(np.zeros(d), cov, 1000, dim=3, gamma=1.0, epsilon=0.0)
        else:
            kernel = Whitening.fit_arrays(np.zeros(d), cov, 1000, dim=3, gamma=1.0, epsilon=0.0).kernel
            np.testing.assert_allclose(np.abs(kernel).max(axis=0), [1.0, 0.5**-0.5, tiny**-0.5], rtol=1e-12)


def test_float32_transform_is_exact_for_a_large_mean() -> None:
    """A mean of ~1e4 loses ~5e-4 per coordinate in float32 (half an ulp); the transform puts that back, so it
    matches float64 centring to float32 rounding of the unit-scale result (1e-5), not to ~1e-3."""
    rng = np.random.default_rng(5)
    x = (1e4 + np.pi + rng.normal(size=(400, 8))).astype(np.float32)
    whitening = fit(x, gamma=1.0)
    expected = (x.astype(np.float64) - whitening.mean) @ whitening.kernel
    y = whitening.transform(x, normalize=False)
    np.testing.assert_allclose(y, expected, atol=1e-5 * np.abs(expected).max())


def test_gamma_and_epsilon_bounds() -> None:
    x = np.random.default_rng(0).normal(size=(200, 4)) * [3.0, 2.0, 1.0, 0.5]
    full = fit(x, gamma=2.0, epsilon=1.0)  # both upper bounds are allowed
    rotation = fit(x, gamma=0.0)
    lam = rotation.eigenvalues
    np.testing.assert_allclose(full.kernel, rotation.kernel / (lam + lam[0]), rtol=1e-12)
    with pytest.raises(ConfigError, match="`gamma` must be between 0 and 2"):
        fit(x, gamma=2.5)
    with pytest.raises(ConfigError, match="`epsilon` must be between 0 and 1"):
        fit(x, epsilon=1.5)
    with pytest.raises(ConfigError, match="no eigenvalues to raise"):
        TransformSpec(gamma=0.5, whiten=False).check(4)


def test_fit_arrays_copies_the_callers_mean() -> None:
    mean, cov = np.full(3, 2.0), np.diag([3.0, 2.0, 1.0])
    whitening = Whitening.fit_arrays(mean, cov, 100)
    mean[:] = 0.0
    np.testing.assert_array_equal(whitening.mean, np.full(3, 2.0))


def test_a_transform_file_with_mismatched_shapes_is_refused(data: np.ndarray, tmp_path) -> None:
    whitening = fit(data, dim=6)
    path = tmp_path / "transform.npz"
    whitening.save(path)
    arrays = dict(np.load(path))
    arrays["kernel"] = arrays["kernel"][:-1]  # 15 x 6 for a 16-dimensional mean
    with open(path, "wb") as fh:
        np.savez(fh, **arrays)
    with pytest.raises(IndexDirError, match="corrupt whitening"):
        load_transform(path)


def test_drift_numbers_equal_a_one_shot_reference(data: np.ndarray) -> None:
    """Mean shift, principal angles and overlap against an independent float64 computation: the stored top-k
    eigenvectors against those of the new data's covariance, after a rotation that mixes kept and dropped
    directions and a shift of the mean."""
    k, gamma, eps = 4, 0.5, 1e-6
    x = data.astype(np.float64)
    transform = fit(data, dim=k, gamma=gamma, epsilon=eps)
    rng = np.random.default_rng(11)
    turn, _ = np.linalg.qr(np.eye(D) + 0.3 * rng.normal(size=(D, D)))
    new = (x - x.mean(axis=0)) @ turn + x.mean(axis=0) + 0.2
    drift = kernel_drift(transform, RunningMoments.from_array(new))

    def top(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lam, u = np.linalg.eigh(np.cov(a.T, bias=True))
        return lam[::-1], u[:, ::-1][:, :k]

    lam, u_old = top(x)
    _, u_new = top(new)
    cosines = np.linalg.svd(u_old.T @ u_new, compute_uv=False)
    at_fit = lam[:k] ** (1 - gamma) / (1 + eps * lam[0] / lam[:k]) ** gamma
    shift = new.mean(axis=0) - x.mean(axis=0)
    assert drift.subspace_overlap == pytest.approx(np.mean(cosines**2), rel=1e-8)
    assert drift.max_principal_angle_deg == pytest.approx(np.degrees(np.arccos(cosines.min())), rel=1e-6)
    assert drift.mean_shift == pytest.approx(np.linalg.norm(shift @ transform.kernel) / np.sqrt(at_fit.sum()))
    assert 0.1 < drift.subspace_overlap < 0.9 and drift.max_principal_angle_deg > 30  # a real change


@pytest.mark.parametrize("center", [True, False])
def test_covariance_drift_equals_a_one_shot_reference(data: np.ndarray, center: bool) -> None:
    """The new data's second moment about the kernel's origin (the fit's mean, or zero), seen through the kernel,
    against the fit's own, in float64: a centred kernel's drift must see a moved mean too."""
    k, gamma, eps = 4, 0.5, 1e-6
    x = data.astype(np.float64)
    transform = fit(data, dim=k, gamma=gamma, epsilon=eps, center=center)
    turn, _ = np.linalg.qr(np.eye(D) + 0.3 * np.random.default_rng(11).normal(size=(D, D)))
    new = (x - x.mean(axis=0)) @ turn + x.mean(axis=0) + 0.2
    drift = kernel_drift(transform, RunningMoments.from_array(new))
    origin = x.mean(axis=0) if center else np.zeros(D)
    w = transform.kernel.astype(np.float64)
    at_fit = w.T @ ((x - origin).T @ (x - origin) / len(x)) @ w
    now = w.T @ ((new - origin).T @ (new - origin) / len(new)) @ w
    expected = np.linalg.norm(now - at_fit) / np.linalg.norm(np.diag(at_fit))
    assert drift.covariance_drift == pytest.approx(expected, rel=1e-6) and expected > 1e-3  # a real change


def test_the_spectrum_summary_of_a_known_spectrum() -> None:
    """12 eigenvalues summing to 17: cumulative shares 8/17, 12/17, 14/17, 15/17, 16/17, ... (info, /info)."""
    lam = np.array([8, 4, 2, 1, 1, 0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.015625])
    summary = spectrum_summary(lam, k=2)
    shares = np.cumsum(lam) / lam.sum()
    assert summary["top"] == lam[:10].tolist() and summary["lambda_k"] == 4 and summary["lambda_min"] == 0.015625
    assert summary["explained_at_k"] == pytest.approx(12 / 17)
    first_reaching = {q: int(np.argmax(shares >= q)) + 1 for q in (0.5, 0.9, 0.99)}  # dims needed, counted from 1
    assert first_reaching == {0.5: 2, 0.9: 5, 0.99: 8}  # 12/17 >= 0.5; 16/17 >= 0.9; 16.875/17 >= 0.99
    assert (summary["dims_for_50pct"], summary["dims_for_90pct"], summary["dims_for_99pct"]) == (2, 5, 8)


def test_refit_is_advised_on_either_threshold() -> None:
    def drift(covariance: float, overlap: float) -> bool:
        return Drift(100, 200, covariance, 0.0, overlap, 0.0).refit_advised

    assert not drift(0.05, 0.95)
    assert drift(0.2, 0.95) and drift(0.05, 0.5)


def test_a_given_product_replaces_numpys_and_nothing_else(data: np.ndarray) -> None:
    """``product`` computes only rows @ kernel: centring before it and the float32 offset after it stay the
    transform's (centred and uncentred kernels alike); a raw transform has no kernel and ignores it."""
    seen = []
    for center in (True, False):
        whitening = fit(data, dim=5, gamma=0.5, center=center)

        def product(rows: np.ndarray, kernel: np.ndarray = whitening.kernel) -> np.ndarray:
            seen.append(rows.copy())
            return (rows.astype(np.float64) @ kernel).astype(np.float32)

        got = whitening.transform(data[:20], product=product)
        np.testing.assert_allclose(got, whitening.transform(data[:20]), atol=1e-6)
        centred = data[:20].astype(np.float32) - (whitening.mean.astype(np.float32) if center else 0)
        np.testing.assert_array_equal(seen.pop(), centred)
    raw = RawTransform(data.shape[1])
    np.testing.assert_array_equal(raw.transform(data[:3], product=lambda rows: 1 / 0), raw.transform(data[:3]))
