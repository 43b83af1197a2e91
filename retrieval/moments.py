"""RunningMoments: exact streaming mean and covariance of vectors, in float64, mergeable across shards."""

from __future__ import annotations

import logging
import os
import zipfile

import numpy as np

from retrieval.errors import ConfigError, IndexDirError

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1


class RunningMoments:
    """Count, mean and scatter matrix ``m2 = sum((x - mean) (x - mean)^T)`` of every row seen so far.

    Batches are folded in with the pairwise update of Chan, Golub and LeVeque (1979): each batch is centred on
    its own mean before its scatter is taken, so a large common mean costs no precision, and the result equals
    the one-shot float64 computation up to rounding whatever the batch sizes. Shards combine the same way.
    """

    def __init__(self, dim: int):
        if dim < 1:
            raise ValueError(f"dim must be >= 1 (got {dim})")
        self.n = 0
        self.mean = np.zeros(dim, dtype=np.float64)
        self.m2 = np.zeros((dim, dim), dtype=np.float64)

    @property
    def dim(self) -> int:
        return self.mean.shape[0]

    def update(self, x: np.ndarray) -> None:
        """Fold in a batch ``x`` of shape (b, dim); b may be 0."""
        x = np.asarray(x)
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(f"expected a batch of shape (b, {self.dim}), got {x.shape}")
        if x.shape[0] == 0:
            return
        bad = ~np.isfinite(x).all(axis=1)
        if bad.any():
            raise ConfigError(
                f"vectors contain NaN or inf values ({int(bad.sum())} of {x.shape[0]} rows in a batch); "
                "check the input vectors or the encoder"
            )
        xc = x.astype(np.float64)
        mean = xc.mean(axis=0)
        xc -= mean
        self._combine(x.shape[0], mean, xc.T @ xc)

    def merge(self, other: RunningMoments) -> RunningMoments:
        """Fold ``other`` (e.g. another shard's moments) into this one, in place; returns ``self``."""
        if other.dim != self.dim:
            raise ValueError(f"cannot merge moments of dimension {other.dim} into dimension {self.dim}")
        self._combine(other.n, other.mean, other.m2)
        return self

    def _combine(self, n_b: int, mean_b: np.ndarray, m2_b: np.ndarray) -> None:
        if n_b == 0:
            return
        n_a, n = self.n, self.n + n_b
        delta = mean_b - self.mean
        self.mean = self.mean + delta * (n_b / n)
        self.m2 = self.m2 + m2_b + np.outer(delta, delta) * (n_a * n_b / n)
        self.n = n

    @classmethod
    def from_array(cls, x: np.ndarray) -> RunningMoments:
        x = np.asarray(x)
        if x.ndim != 2:
            raise ValueError(f"expected a 2-D array, got shape {x.shape}")
        moments = cls(x.shape[1])
        moments.update(x)
        return moments

    def covariance(self) -> np.ndarray:
        """Population covariance ``m2 / n`` (as ``np.cov(X.T, bias=True)``), float64 (dim, dim)."""
        if self.n == 0:
            raise ConfigError(
                "no vectors were seen, so there is no covariance to fit; check that the corpus is not empty"
            )
        return self.m2 / self.n

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write an ``.npz`` (no pickle) to exactly ``path``; ``load`` reads it back bit for bit."""
        with open(path, "wb") as fh:
            np.savez(fh, format_version=np.int64(FORMAT_VERSION), n=np.int64(self.n), mean=self.mean, m2=self.m2)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RunningMoments:
        try:
            with np.load(path, allow_pickle=False) as data:
                version, n, mean, m2 = int(data["format_version"]), int(data["n"]), data["mean"], data["m2"]
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as err:  # truncated: a bad zip; empty: EOF
            raise IndexDirError(f"cannot read moments from {path}: {err}; rebuild the index") from err
        if version != FORMAT_VERSION:
            raise IndexDirError(f"{path}: moments format version {version}; this version reads {FORMAT_VERSION}")
        if mean.ndim != 1 or m2.shape != (mean.shape[0], mean.shape[0]) or n < 0:
            raise IndexDirError(f"{path}: inconsistent moments (mean {mean.shape}, m2 {m2.shape}, n {n})")
        moments = cls(mean.shape[0])
        moments.n, moments.mean, moments.m2 = n, mean.astype(np.float64), m2.astype(np.float64)
        return moments

    def __repr__(self) -> str:
        return f"RunningMoments(dim={self.dim}, n={self.n})"
