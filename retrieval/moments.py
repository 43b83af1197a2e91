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
    its own mean before its scatter is taken. Shards combine the same way. The mean is kept as a fixed ``shift``
    (the first row seen) plus an ``offset`` from it: rows minus the shift are small numbers with all their digits,
    so a large common mean costs no precision (a mean of 1e6 kept whole would round by ~1e-10 at every update,
    and that error would pile up in the scatter). The result equals the one-shot float64 computation up to
    rounding, whatever the offset, the batch sizes or the order of merges.
    """

    def __init__(self, dim: int):
        if dim < 1:
            raise ValueError(f"dim must be >= 1 (got {dim})")
        self.n = 0
        self.shift = np.zeros(dim, dtype=np.float64)
        self.offset = np.zeros(dim, dtype=np.float64)  # mean - shift
        self.m2 = np.zeros((dim, dim), dtype=np.float64)

    @property
    def dim(self) -> int:
        return self.shift.shape[0]

    @property
    def mean(self) -> np.ndarray:
        return self.shift + self.offset

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
        if self.n == 0:
            self.shift, self.offset = x[0].astype(np.float64), np.zeros(self.dim)
        xc = x.astype(np.float64) - self.shift
        offset = xc.mean(axis=0)
        xc -= offset
        self._combine(x.shape[0], offset, xc.T @ xc)

    def merge(self, other: RunningMoments) -> RunningMoments:
        """Fold ``other`` (e.g. another shard's moments) into this one, in place; returns ``self``."""
        if other.dim != self.dim:
            raise ValueError(f"cannot merge moments of dimension {other.dim} into dimension {self.dim}")
        if self.n == 0:
            self.shift, self.offset = other.shift.copy(), other.offset.copy()
            self.m2, self.n = other.m2.copy(), other.n
            return self
        # shifts are rows of the same data: their difference is exact when they are close (Sterbenz)
        self._combine(other.n, other.offset + (other.shift - self.shift), other.m2)
        return self

    @classmethod
    def of(cls, n: int, shift: np.ndarray, offset: np.ndarray, m2: np.ndarray) -> RunningMoments:
        """Moments from their parts (``n``, ``shift``, ``offset``, ``m2``), as another process sent them."""
        moments = cls(len(shift))
        moments.n = int(n)
        moments.shift, moments.offset = (np.asarray(a, dtype=np.float64).copy() for a in (shift, offset))
        moments.m2 = np.asarray(m2, dtype=np.float64).copy()
        return moments

    def _combine(self, n_b: int, offset_b: np.ndarray, m2_b: np.ndarray) -> None:
        """Fold in ``n_b`` rows whose mean is ``self.shift + offset_b`` and scatter ``m2_b``."""
        if n_b == 0:
            return
        n_a, n = self.n, self.n + n_b
        delta = offset_b - self.offset
        self.offset = self.offset + delta * (n_b / n)
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
        """Write an ``.npz`` (no pickle) to exactly ``path``; ``load`` reads it back bit for bit. ``mean`` is
        what readers use; ``shift`` and ``offset`` keep its every digit for later updates (files without them,
        written before they were kept, read as a shift of ``mean``)."""
        with open(path, "wb") as fh:
            np.savez(
                fh,
                format_version=np.int64(FORMAT_VERSION),
                n=np.int64(self.n),
                mean=self.mean,
                m2=self.m2,
                shift=self.shift,
                offset=self.offset,
            )

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RunningMoments:
        try:
            with np.load(path, allow_pickle=False) as data:
                version, n, mean, m2 = int(data["format_version"]), int(data["n"]), data["mean"], data["m2"]
                shift, offset = (data["shift"], data["offset"]) if "shift" in data else (mean, np.zeros_like(mean))
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as err:  # truncated: a bad zip; empty: EOF
            raise IndexDirError(f"cannot read moments from {path}: {err}; rebuild the index") from err
        if version != FORMAT_VERSION:
            raise IndexDirError(f"{path}: moments format version {version}; this version reads {FORMAT_VERSION}")
        d = mean.shape[0] if mean.ndim == 1 else -1
        if mean.ndim != 1 or m2.shape != (d, d) or shift.shape != (d,) or offset.shape != (d,) or n < 0:
            raise IndexDirError(f"{path}: inconsistent moments (mean {mean.shape}, m2 {m2.shape}, n {n})")
        return cls.of(n, shift, offset, m2)

    def __repr__(self) -> str:
        return f"RunningMoments(dim={self.dim}, n={self.n})"
