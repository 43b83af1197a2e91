"""The vector transform applied before indexing: BERT-whitening (Su et al. 2021) or the raw baseline."""

from __future__ import annotations

import functools
import logging
import math
import os
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from typing import Any

import numpy as np

from retrieval.errors import ConfigError, IndexDirError
from retrieval.moments import RunningMoments
from retrieval.options import option

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2 added ``center``; version 1 files are read as centred kernels

Product = Callable[[np.ndarray], np.ndarray]  # rows (n, d) float32 -> rows @ kernel (n, k) float32

READS_VERSIONS = (1, 2)

# The kernel used with a reduced `dim`: the gamma and centring with the smallest worst-case loss against raw at
# k = d/3 over the dev basket of both models (SciFact train, stdlib pseudo-queries, STS-B dev, STS12-16;
# scripts/choose_defaults.py, docs/defaults.md): gamma 0.3, uncentred (fitted on the second moment
# E[x x^T], nothing subtracted), -3.05% on its worst task and -0.03% on average, against -3.58% and -0.56% for the
# centred gamma 0.3 used before (and better at d/2 and d/6 too). Without a reduced `dim` no transform applies:
# every centred full-rank gamma lost >= 2% on some dev task. A full-rank kernel, when asked for, centres.
DEFAULT_GAMMA = 0.3
DEFAULT_CENTER_REDUCED = False
DEFAULT_EPSILON = 1e-6
NORM_FLOOR = 1e-18  # float32 norms below this lost precision to underflowing squares: taken in float64
# Kernel drift above which `retrieval info` advises a refit: 10% relative change of the whitened covariance, or a
# top-k subspace whose mean squared principal cosine fell below 0.9.
DRIFT_REFIT = 0.1
OVERLAP_REFIT = 0.9


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """Scale each row to unit length, as float32; all-zero rows stay zero. Rows whose float32 norm is not exact
    (squares of entries above ~1e19 overflow: every such row came out 0; below ~1e-19 they underflow) are
    normalised again in float64; the others, every embedding, stay on the float32 path."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(over="ignore", under="ignore"):  # np.linalg.norm's own sum of squares, without its checks
        norms = np.sqrt(np.add.reduce(x * x, axis=-1, keepdims=True))
    if not norms.size or (norms.min() > NORM_FLOOR and norms.max() < np.inf):  # NaN fails both: the slow path
        return x / norms
    odd = ~((norms > NORM_FLOOR) & (norms < np.inf))  # zero, underflowed, overflowed (or NaN): at least one row
    rows = x.reshape(-1, x.shape[-1])
    out = rows / np.where(odd, np.float32(1), norms).reshape(-1, 1)
    odd = odd.reshape(-1)
    wide = rows[odd].astype(np.float64)
    wide_norms = np.linalg.norm(wide, axis=1, keepdims=True)
    out[odd] = np.divide(wide, wide_norms, out=np.zeros_like(wide), where=wide_norms > 0)
    return out.reshape(x.shape)


@functools.cache
def _warn_few_rows(d: int, n: int) -> None:
    """Once per process and shape: a sweep fits dozens of kernels on the same rows (`tune`, then `refit` on
    --apply), and one line says all there is to say."""
    logger.warning(
        "fitting a %d x %d covariance on only %d rows: the whitening is noisy; "
        "use a larger corpus, a smaller gamma, or no whitening",
        d,
        d,
        n,
    )


def _rows(x: np.ndarray, dim: int) -> np.ndarray:
    """``x`` as a 2-D batch of ``dim``-vectors (a single 1-D vector becomes one row)."""
    x = np.asarray(x)
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2 or x.shape[1] != dim:
        raise ValueError(f"expected vectors of dimension {dim}, got shape {x.shape}")
    return x


@dataclass(frozen=True, eq=False)
class Whitening:
    """``y = (x - mean) @ kernel``, then L2-normalised; ``y = x @ kernel`` when ``center`` is False.

    ``kernel = U[:, :k] * (lam + epsilon * lam_max) ** (-gamma / 2)``, where ``U`` and ``lam`` are the
    eigenvectors and eigenvalues of the covariance (of the second moment ``E[x x^T]`` = covariance + mean
    mean^T when ``center`` is False), largest first. ``mean`` is the fitted data's mean either way (the drift
    diagnostics compare against it). ``gamma = 1`` is full whitening (the paper), ``gamma = 0`` a PCA rotation,
    values between soften it. ``epsilon``, relative to the largest eigenvalue, keeps rank-deficient data finite
    (if every row was identical, so ``lam_max == 0``, it is taken as absolute). ``eigenvalues`` holds all ``d``
    of them, for diagnostics. Each eigenvector's sign is fixed so that its largest-magnitude entry is positive:
    the same data always gives the same kernel.
    """

    mean: np.ndarray  # (d,) float64
    kernel: np.ndarray  # (d, k) float64
    eigenvalues: np.ndarray  # (d,) float64, descending, >= 0
    gamma: float
    epsilon: float
    n: int  # rows the fit saw
    center: bool = True

    def __post_init__(self) -> None:
        d = self.mean.shape[0]
        if self.mean.shape != (d,) or self.kernel.ndim != 2 or self.kernel.shape[0] != d:
            raise ValueError(f"mean {self.mean.shape} and kernel {self.kernel.shape} do not fit together")
        if self.eigenvalues.shape != (d,):
            raise ValueError(f"expected {d} eigenvalues, got shape {self.eigenvalues.shape}")

    @property
    def dim_in(self) -> int:
        return self.kernel.shape[0]

    @property
    def dim_out(self) -> int:
        return self.kernel.shape[1]

    @property
    def explained_variance(self) -> float:
        """Share of the total variance in the ``k`` kept directions (1.0 for data with no variance); for an
        uncentred kernel, of the second moment ``E[x x^T]``'s trace."""
        total = float(self.eigenvalues.sum())
        return float(self.eigenvalues[: self.dim_out].sum()) / total if total > 0 else 1.0

    @classmethod
    def fit(
        cls,
        moments: RunningMoments,
        dim: int | None = None,
        gamma: float = 1.0,
        epsilon: float = 1e-6,
        center: bool = True,
    ) -> Whitening:
        """Fit from streamed moments; ``dim`` (default: all) is how many directions to keep."""
        return cls.fit_arrays(moments.mean, moments.covariance(), moments.n, dim, gamma, epsilon, center)

    @classmethod
    def fit_arrays(
        cls,
        mean: np.ndarray,
        cov: np.ndarray,
        n: int,
        dim: int | None = None,
        gamma: float = 1.0,
        epsilon: float = 1e-6,
        center: bool = True,
    ) -> Whitening:
        """Fit from a mean (d,) and population covariance (d, d) estimated on ``n`` rows; uncentred (``center``
        False), the kernel comes from the second moment, covariance + mean mean^T."""
        d = mean.shape[0]
        if cov.shape != (d, d):
            raise ValueError(f"covariance of shape {cov.shape} does not match a mean of dimension {d}")
        k = d if dim is None else dim
        if not 1 <= k <= d:
            raise ConfigError(
                f"`dim` must be between 1 and {d} (got {k}): the kernel keeps at most d dimensions", "dim"
            )
        TransformSpec(dim=k, gamma=gamma, epsilon=epsilon).check(d)
        if n < 2:
            raise ConfigError(f"need at least 2 vectors to fit a whitening (got {n}); use a larger corpus")
        mean = np.array(mean, dtype=np.float64)  # a copy: the fit must not share the caller's array
        moment = np.asarray(cov, dtype=np.float64)
        if not center:
            moment = moment + np.outer(mean, mean)
        lam, u = np.linalg.eigh(moment)
        lam, u = np.clip(lam[::-1], 0.0, None), u[:, ::-1]  # descending; negatives are round-off
        u = u * np.sign(u[np.abs(u).argmax(axis=0), np.arange(d)])  # largest-|entry| of each column positive
        scale = lam[0] if lam[0] > 0 else 1.0  # lam[0] == 0: every row identical; epsilon is then absolute
        lam_reg = lam[:k] + epsilon * scale
        # Below d ulps of the largest, an eigenvalue is round-off of a zero one: raised to -gamma/2 it would
        # amplify noise by ~1e7 (only an `epsilon` of about 0 lets one through)
        floor = d * np.finfo(np.float64).eps
        if gamma > 0 and (lam_reg <= floor * scale).any():
            given = "is 0" if epsilon == 0 else f"({epsilon:g}) is within round-off of 0 (at most {floor:.1e})"
            raise ConfigError(
                f"the covariance is singular within the top {k} directions and `epsilon` {given}; "
                f"use a larger `epsilon` (the default is {DEFAULT_EPSILON:g}) or a smaller `dim`",
                "epsilon",
            )
        kernel = u[:, :k] * lam_reg ** (-gamma / 2)
        # Queries and documents are transformed in float32: each column's largest entry must be a normal float32
        # (vectors at a scale of 1e-20 whitened with gamma 2 give entries of 1e40, which would turn into inf/NaN)
        reach = np.abs(kernel).max(axis=0)
        for entry in (reach.max(), reach.min()):
            if not np.finfo(np.float32).tiny <= entry <= np.finfo(np.float32).max:
                raise ConfigError(
                    f"whitening with gamma {gamma:g} needs kernel entries of {entry:.1e}, outside float32's range: "
                    f"the vectors' scale (largest eigenvalue {scale:.1e}) is too extreme; "
                    "rescale the vectors (e.g. to unit norm) or use a smaller gamma",
                    "gamma",
                )
        if n < 5 * d:  # after the refusals above: a fit that is refused needs no warning first
            _warn_few_rows(d, n)
        return cls(mean, kernel, lam, float(gamma), float(epsilon), int(n), bool(center))

    @cached_property
    def _mean32(self) -> np.ndarray:
        return self.mean.astype(np.float32)

    @cached_property
    def _kernel32(self) -> np.ndarray:
        return self.kernel.astype(np.float32)

    @cached_property
    def _offset32(self) -> np.ndarray:
        # The part of the mean that float32 cannot hold, pushed through the kernel: subtracting it after the
        # product makes the float32 transform as exact as centring in float64 (it matters for a large mean).
        return ((self.mean - self._mean32) @ self.kernel).astype(np.float32)

    def transform(self, x: np.ndarray, normalize: bool = True, product: Product | None = None) -> np.ndarray:
        """(n, d) or (d,) raw vectors -> (n, k) float32; L2-normalised unless ``normalize=False``.

        ``product``: what computes ``rows @ kernel`` in float32 (default numpy's); a searcher passes FAISS's
        (``index.FaissProduct``) so that the query's product runs in the thread pool FAISS then searches with."""
        x32 = _rows(x, self.dim_in).astype(np.float32)
        multiply = product or (lambda rows: rows @ self._kernel32)
        if not self.center:
            y = multiply(x32)
        else:
            y = multiply(x32 - self._mean32)
            y -= self._offset32
        return l2_normalize(y) if normalize else y

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write an ``.npz`` (no pickle) to exactly ``path``; ``load`` reads it back bit for bit."""
        with open(path, "wb") as fh:
            np.savez(
                fh,
                format_version=np.int64(FORMAT_VERSION),
                kind=np.str_("whitening"),
                mean=self.mean,
                kernel=self.kernel,
                eigenvalues=self.eigenvalues,
                gamma=np.float64(self.gamma),
                epsilon=np.float64(self.epsilon),
                n=np.int64(self.n),
                center=np.bool_(self.center),
            )

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Whitening:
        return cls._decode(_read(path, "whitening"), path)

    @classmethod
    def _decode(cls, data: dict[str, np.ndarray], path: str | os.PathLike[str]) -> Whitening:
        try:
            return cls(
                data["mean"].astype(np.float64),
                data["kernel"].astype(np.float64),
                data["eigenvalues"].astype(np.float64),
                float(data["gamma"]),
                float(data["epsilon"]),
                int(data["n"]),
                bool(data["center"]) if "center" in data else True,  # version 1 kernels were all centred
            )
        except (KeyError, ValueError) as err:
            raise IndexDirError(f"{path}: corrupt whitening transform ({err}); rebuild the index") from err

    def truncated(self, k: int) -> Whitening:
        """The same kernel keeping only its first ``k`` directions (the largest variances): what ``--dim k`` would
        have fitted from the same moments, gamma and epsilon, without refitting."""
        if not 1 <= k <= self.dim_out:
            raise ConfigError(f"`dimensions` must be between 1 and {self.dim_out} (got {k})", "dimensions")
        return replace(self, kernel=self.kernel[:, :k]) if k < self.dim_out else self

    def __repr__(self) -> str:
        return (
            f"Whitening(dim_in={self.dim_in}, dim_out={self.dim_out}, gamma={self.gamma}, "
            f"epsilon={self.epsilon}, n={self.n}, center={self.center}, "
            f"explained_variance={self.explained_variance:.4f})"
        )


@dataclass(frozen=True)
class RawTransform:
    """The ``--no-whiten`` baseline: the encoder's vectors, L2-normalised; no centring, no kernel."""

    dim: int

    @property
    def dim_in(self) -> int:
        return self.dim

    @property
    def dim_out(self) -> int:
        return self.dim

    def transform(self, x: np.ndarray, normalize: bool = True, product: Product | None = None) -> np.ndarray:
        """(n, d) or (d,) raw vectors -> (n, d) float32; L2-normalised unless ``normalize=False``. There is no
        kernel, so no ``product``."""
        y = _rows(x, self.dim).astype(np.float32)
        return l2_normalize(y) if normalize else y

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "wb") as fh:
            np.savez(fh, format_version=np.int64(FORMAT_VERSION), kind=np.str_("raw"), dim=np.int64(self.dim))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RawTransform:
        return cls._decode(_read(path, "raw"), path)

    @classmethod
    def _decode(cls, data: dict[str, np.ndarray], path: str | os.PathLike[str]) -> RawTransform:
        try:
            return cls(int(data["dim"]))
        except KeyError as err:
            raise IndexDirError(f"{path}: corrupt raw transform ({err}); rebuild the index") from err


def load_transform(path: str | os.PathLike[str]) -> Whitening | RawTransform:
    """Load whichever transform ``path`` holds."""
    data = _read(path)
    cls = Whitening if str(data["kind"]) == "whitening" else RawTransform
    return cls._decode(data, path)


def _read(path: str | os.PathLike[str], kind: str | None = None) -> dict[str, np.ndarray]:
    """Every array of a transform file, once its format version and kind are checked (None: either)."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            data = {name: npz[name] for name in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:  # truncated: a bad zip; empty: EOF
        raise IndexDirError(f"cannot read the transform {path}: {err}; rebuild the index") from err
    version = int(data["format_version"]) if "format_version" in data else None
    if version not in READS_VERSIONS:
        raise IndexDirError(
            f"{path}: transform format version {version}; this version reads {', '.join(map(str, READS_VERSIONS))}."
        )
    found = str(data["kind"]) if "kind" in data else None
    if found not in ((kind,) if kind is not None else ("whitening", "raw")):  # no kind at all: not a transform
        raise IndexDirError(f"{path}: transform kind {found!r}, expected {kind or 'whitening or raw'!r}")
    return data


@dataclass(frozen=True)
class TransformSpec:
    """What to fit after pass 1, and one candidate of a tuning sweep.

    Whitening keeps ``W = U[:, :dim] * (lambda + epsilon * lambda_max) ** (-gamma / 2)``; ``whiten=False`` is the
    raw baseline (L2-normalised encoder output, no centring, no kernel, every dimension). ``pooling`` chooses
    which stashed pooling to fit on (None: the index's first).

    Left as None, ``whiten`` follows the defaults chosen in docs/defaults.md: whiten when
    ``dim`` reduces the dimension or a ``gamma`` is given, else keep the raw vectors (at full dimension a transform
    cost quality on the dev basket and buys no speed); ``gamma`` None is ``DEFAULT_GAMMA``; ``center`` None
    centres a full-rank kernel and not a reduced one (``DEFAULT_CENTER_REDUCED``). ``resolve(d)`` fills them in;
    the manifest records the resolved spec.
    """

    dim: int | None = option(
        None, "Output dimension: whitens down to it.", default_help="the encoder's own, raw vectors"
    )
    gamma: float | None = option(
        None,
        "Eigenvalue power: W = U_dim diag(lambda^(-gamma/2)); 1 whitens, 0 only rotates; given, it whitens.",
        default_help=f"{DEFAULT_GAMMA:g} with --dim",
    )
    epsilon: float = option(DEFAULT_EPSILON, "Added to eigenvalues, relative to the largest.")
    whiten: bool | None = None  # the CLI's --no-whiten (index) and --whiten/--no-whiten (refit)
    pooling: str | None = None  # index: the encoder's --pooling; refit: the stashed pooling
    center: bool | None = option(
        None,
        "Fit the kernel on x - mean (the paper) or on x as it is (the second moment).",
        flag_decls=("--center/--no-center",),
        default_help="centred at full dimension, uncentred with --dim",
    )

    @classmethod
    def raw(cls, pooling: str | None = None) -> TransformSpec:
        return cls(whiten=False, pooling=pooling)

    @property
    def whitens(self) -> bool | None:
        """Whether this spec whitens, when that is known without the encoder's dimension (None: it depends)."""
        if self.whiten is not None:
            return self.whiten
        return True if self.gamma is not None else None if self.dim is not None else False

    def resolve(self, d: int) -> TransformSpec:
        """This spec for an encoder of dimension ``d``, every default filled in: raw keeps all ``d`` dimensions
        (and no gamma); whitening gets ``dim`` (default ``d``) and ``gamma`` (default ``DEFAULT_GAMMA``)."""
        whiten = self.whitens
        if whiten is None:
            whiten = self.dim is not None and self.dim < d
        if not whiten:
            return replace(self, dim=d, gamma=None, whiten=False, center=None)
        gamma = DEFAULT_GAMMA if self.gamma is None else self.gamma
        dim = self.dim or d
        center = (DEFAULT_CENTER_REDUCED if dim < d else True) if self.center is None else self.center
        return replace(self, dim=dim, gamma=gamma, whiten=True, center=center)

    @property
    def label(self) -> str:
        """Short name for tables: ``mean raw`` or ``mean k=128 g=0.25``."""
        pooling = f"{self.pooling} " if self.pooling else ""
        if self.whitens is False:
            return f"{pooling}raw"
        gamma = DEFAULT_GAMMA if self.gamma is None else self.gamma
        centring = {None: "", True: " centred", False: " uncentred"}[self.center]
        return f"{pooling}k={self.dim or 'd'} g={gamma:g}{centring}"

    def check(self, d: int | None = None) -> None:
        """Refuse what cannot give finite, meaningful vectors, before any work is done (``dim`` against the
        encoder's dimension ``d`` once it is known)."""
        if self.dim is not None and (isinstance(self.dim, bool) or not isinstance(self.dim, (int, np.integer))):
            raise ConfigError(f"`dim` must be a whole number (got {self.dim!r})", "dim")
        if self.dim is not None and self.dim < 1:
            raise ConfigError(f"`dim` must be at least 1 (got {self.dim})", "dim")
        if self.dim is not None and d is not None and self.dim > d:
            raise ConfigError(f"`dim` must be between 1 and the encoder's dimension {d} (got {self.dim})", "dim")
        if self.whiten is False and self.dim is not None and d is not None and self.dim != d:
            raise ConfigError(f"the raw transform keeps all {d} dimensions; drop `dim` or whiten", "dim")
        raw = self.whitens is False or (self.whitens is None and d is not None and not self.resolve(d).whiten)
        if raw and self.center is not None:
            raise ConfigError(
                "the raw transform has no kernel to centre; drop `center`, or whiten (`gamma`, or a `dim` below d)",
                "center",
            )
        if self.whiten is False and self.gamma is not None:
            raise ConfigError("the raw transform has no eigenvalues to raise; drop `gamma` or whiten", "gamma")
        if self.gamma is not None and not (math.isfinite(self.gamma) and 0 <= self.gamma <= 2):
            raise ConfigError(
                f"`gamma` must be between 0 and 2 (got {self.gamma}); 1 = full whitening, 0 = PCA rotation", "gamma"
            )
        if not (math.isfinite(self.epsilon) and 0 <= self.epsilon <= 1):
            raise ConfigError(
                f"`epsilon` must be between 0 and 1 (got {self.epsilon}), relative to the largest eigenvalue",
                "epsilon",
            )

    def fit(self, moments: RunningMoments) -> Whitening | RawTransform:
        self.check(moments.dim)  # a `dim` past d would otherwise resolve to... nothing asked for
        spec = self.resolve(moments.dim)
        if not spec.whiten:
            return RawTransform(moments.dim)
        assert spec.gamma is not None and spec.center is not None
        return Whitening.fit(moments, dim=spec.dim, gamma=spec.gamma, epsilon=spec.epsilon, center=spec.center)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransformSpec:
        spec = cls(**{key: data[key] for key in ("dim", "gamma", "epsilon", "whiten", "pooling") if key in data})
        if "center" in data:
            return replace(spec, center=data["center"])
        # Recorded before ``center`` existed: every whitening then centred (None would now resolve otherwise).
        return replace(spec, center=True) if data.get("whiten") else spec


@dataclass(frozen=True)
class Drift:
    """How far a stored kernel is from a fresh fit on the current moments (after rows were added).

    ``covariance_drift``: ||W^T S W - D||_F / ||D||_F, where S is the current second moment about the kernel's
    origin (covariance plus the mean shift; about zero for an uncentred kernel), W the stored kernel and
    D = W^T S_fit W its value at fit time (diagonal; ~identity for gamma = 1). ``subspace_overlap``: mean squared
    cosine of the principal angles between the stored top-k eigenvectors and those of a fresh fit (1 = same
    subspace; always 1 when k = d).
    ``mean_shift``: how far the mean moved, in whitened units relative to the spread at fit time.
    """

    rows_at_fit: int
    rows_now: int
    covariance_drift: float
    mean_shift: float
    subspace_overlap: float
    max_principal_angle_deg: float

    @property
    def rows_added(self) -> int:
        """Net rows since the fit: negative when more were removed than added."""
        return self.rows_now - self.rows_at_fit

    @property
    def refit_advised(self) -> bool:
        return self.covariance_drift > DRIFT_REFIT or self.subspace_overlap < OVERLAP_REFIT

    def describe(self) -> str:
        """One line for ``retrieval info``."""
        line = (
            f"{self.covariance_drift:.3f} (whitened covariance, relative), subspace overlap "
            f"{self.subspace_overlap:.3f}; {self.rows_now:,} rows now, {self.rows_at_fit:,} at the fit"
        )
        return line + ("; consider `retrieval refit`" if self.refit_advised else "")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"rows_added": self.rows_added, "refit_advised": self.refit_advised}


def kernel_drift(transform: Whitening, moments: RunningMoments) -> Drift:
    """The ``Drift`` of ``transform`` against ``moments`` (see ``Drift``). ConfigError when it is undefined: the
    kernel was fitted on rows with no spread (every ratio would divide by 0), or a fresh fit of the current rows
    with the kernel's settings is refused (it says why: what a `refit` with them would say)."""
    k, w, lam = transform.dim_out, transform.kernel, transform.eigenvalues
    scale = lam[0] if lam[0] > 0 else 1.0
    at_fit = lam[:k] * (lam[:k] + transform.epsilon * scale) ** (-transform.gamma)  # diag of W^T Sigma_fit W
    if not at_fit.sum() > 0:
        raise ConfigError("the kernel was fitted on identical rows (no spread): drift against it is undefined")
    shift = moments.mean - transform.mean
    offset = shift if transform.center else moments.mean  # the current mean about the kernel's origin
    now = w.T @ (moments.covariance() + np.outer(offset, offset)) @ w
    covariance_drift = float(np.linalg.norm(now - np.diag(at_fit)) / np.linalg.norm(at_fit))
    try:
        with _quiet():  # the build already warned about a small N; info must not repeat it on every call
            fresh = Whitening.fit(
                moments, dim=k, gamma=transform.gamma, epsilon=transform.epsilon, center=transform.center
            )
    except ConfigError as refused:
        raise ConfigError(
            f"a refit of the current rows with the kernel's settings would be refused: {refused}"
        ) from None
    old_basis = w / np.linalg.norm(w, axis=0)
    new_basis = fresh.kernel / np.linalg.norm(fresh.kernel, axis=0)
    cosines = np.clip(np.linalg.svd(old_basis.T @ new_basis, compute_uv=False), 0.0, 1.0)
    return Drift(
        rows_at_fit=transform.n,
        rows_now=moments.n,
        covariance_drift=covariance_drift,
        mean_shift=float(np.linalg.norm(shift @ w) / np.sqrt(at_fit.sum())),
        subspace_overlap=float(np.mean(cosines**2)),
        max_principal_angle_deg=float(np.degrees(np.arccos(cosines.min()))),
    )


@contextmanager
def _quiet() -> Iterator[None]:
    """This module's warnings silenced for a block."""
    previous = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(previous)
