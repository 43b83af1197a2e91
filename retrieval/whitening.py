"""The vector transform applied before indexing: BERT-whitening (Su et al. 2021) or the raw baseline."""

from __future__ import annotations

import logging
import os
import zipfile
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from retrieval.errors import ConfigError, IndexDirError
from retrieval.moments import RunningMoments

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1


def l2_normalize(x: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    """Scale each row to unit length, as float32; all-zero rows stay zero."""
    x = np.asarray(x, dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), np.float32(eps))


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
    """``y = (x - mean) @ kernel``, then L2-normalised.

    ``kernel = U[:, :k] * (lam + epsilon * lam_max) ** (-gamma / 2)``, where ``U`` and ``lam`` are the
    eigenvectors and eigenvalues of the covariance, largest first. ``gamma = 1`` is full whitening (the
    paper), ``gamma = 0`` a PCA rotation, values between soften it. ``epsilon``, relative to the largest
    eigenvalue, keeps rank-deficient data finite (if every row was identical, so ``lam_max == 0``, it is taken
    as absolute). ``eigenvalues`` holds all ``d`` of them, for diagnostics. Each eigenvector's sign is fixed
    so that its largest-magnitude entry is positive: the same data always gives the same kernel.
    """

    mean: np.ndarray  # (d,) float64
    kernel: np.ndarray  # (d, k) float64
    eigenvalues: np.ndarray  # (d,) float64, descending, >= 0
    gamma: float
    epsilon: float
    n: int  # rows the fit saw

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
        """Share of the total variance in the ``k`` kept directions (1.0 for data with no variance)."""
        total = float(self.eigenvalues.sum())
        return float(self.eigenvalues[: self.dim_out].sum()) / total if total > 0 else 1.0

    @classmethod
    def fit(
        cls, moments: RunningMoments, dim: int | None = None, gamma: float = 1.0, epsilon: float = 1e-6
    ) -> Whitening:
        """Fit from streamed moments; ``dim`` (default: all) is how many directions to keep."""
        return cls.fit_arrays(moments.mean, moments.covariance(), moments.n, dim, gamma, epsilon)

    @classmethod
    def fit_arrays(
        cls,
        mean: np.ndarray,
        cov: np.ndarray,
        n: int,
        dim: int | None = None,
        gamma: float = 1.0,
        epsilon: float = 1e-6,
    ) -> Whitening:
        """Fit from a mean (d,) and population covariance (d, d) estimated on ``n`` rows."""
        d = mean.shape[0]
        if cov.shape != (d, d):
            raise ValueError(f"covariance of shape {cov.shape} does not match a mean of dimension {d}")
        k = d if dim is None else dim
        if not 1 <= k <= d:
            raise ConfigError(f"--dim must be between 1 and {d} (got {k}): the kernel keeps at most d dimensions")
        if gamma < 0:
            raise ConfigError(f"--gamma must be >= 0 (got {gamma}); 1 = full whitening, 0 = PCA rotation")
        if epsilon < 0:
            raise ConfigError(f"--epsilon must be >= 0 (got {epsilon})")
        if n < 2:
            raise ConfigError(f"need at least 2 vectors to fit a whitening (got {n}); use a larger corpus")
        if n < 5 * d:
            logger.warning(
                "fitting a %d x %d covariance on only %d rows: the whitening is noisy; "
                "use a larger corpus, a smaller --gamma, or --no-whiten",
                d,
                d,
                n,
            )
        lam, u = np.linalg.eigh(np.asarray(cov, dtype=np.float64))
        lam, u = np.clip(lam[::-1], 0.0, None), u[:, ::-1]  # descending; negatives are round-off
        u = u * np.sign(u[np.abs(u).argmax(axis=0), np.arange(d)])  # largest-|entry| of each column positive
        scale = lam[0] if lam[0] > 0 else 1.0  # lam[0] == 0: every row identical; epsilon is then absolute
        lam_reg = lam[:k] + epsilon * scale
        if gamma > 0 and not lam_reg.all():
            raise ConfigError(
                f"the covariance is singular within the top {k} directions and --epsilon is 0; "
                "use --epsilon > 0 or a smaller --dim"
            )
        kernel = u[:, :k] * lam_reg ** (-gamma / 2)
        mean = np.array(mean, dtype=np.float64)  # a copy: the fit must not share the caller's array
        return cls(mean, kernel, lam, float(gamma), float(epsilon), int(n))

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

    def transform(self, x: np.ndarray, normalize: bool = True) -> np.ndarray:
        """(n, d) or (d,) raw vectors -> (n, k) float32; L2-normalised unless ``normalize=False``."""
        y = (_rows(x, self.dim_in).astype(np.float32) - self._mean32) @ self._kernel32
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
            )
        except (KeyError, ValueError) as err:
            raise IndexDirError(f"{path}: corrupt whitening transform ({err}); rebuild the index") from err

    def __repr__(self) -> str:
        return (
            f"Whitening(dim_in={self.dim_in}, dim_out={self.dim_out}, gamma={self.gamma}, "
            f"epsilon={self.epsilon}, n={self.n}, explained_variance={self.explained_variance:.4f})"
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

    def transform(self, x: np.ndarray, normalize: bool = True) -> np.ndarray:
        """(n, d) or (d,) raw vectors -> (n, d) float32; L2-normalised unless ``normalize=False``."""
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


Transform = Whitening | RawTransform


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
    except (OSError, ValueError, zipfile.BadZipFile) as err:  # a truncated .npz is a bad zip
        raise IndexDirError(f"cannot read the transform {path}: {err}; rebuild the index") from err
    version = int(data["format_version"]) if "format_version" in data else None
    if version != FORMAT_VERSION:
        raise IndexDirError(f"{path}: transform format version {version}; this version reads {FORMAT_VERSION}.")
    found = str(data["kind"]) if "kind" in data else None
    if found != kind and not (kind is None and found in ("whitening", "raw")):
        raise IndexDirError(f"{path}: transform kind {found!r}, expected {kind or 'whitening or raw'!r}")
    return data
