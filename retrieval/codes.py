"""Binary codes: the kernel's output centred, rotated and cut to one sign bit per dimension, searched by Hamming
distance in a FAISS binary index (flat, HNSW or IVF), behind the interface the float indexes offer.

A sign bit ignores the scale of its direction, so the sign bits of whitened (PCA) coordinates are poor codes: the
first directions carry most of the variance, yet every bit counts the same in Hamming distance. A rotation after the
kernel spreads the variance over all bits (ITQ, Gong & Lazebnik 2011). Measured on CISI with all-MiniLM-L6-v2 at 48
bytes: sign bits of whitened coordinates kept 0.58 of raw nDCG@10, after a random rotation 0.97, after ITQ 0.99
(``scripts/bench_codes.py`` compares the two rotations on every IR set). The centre and the rotation are learned
when the index is trained and saved with its codes, so queries get the same bits as the documents.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.errors import IndexDirError

ROTATIONS = ("itq", "random")
ITQ_ITERATIONS = 50  # as FAISS's ITQMatrix; the probe in the notes saw no gain past it
ROTATION_SEED = 1234
MAGIC = b"PK"  # a binary index file is an .npz archive; a FAISS float index file never starts so


def binary_factory(kind: str, m: int, nlist: int) -> str:
    """FAISS's ``index_binary_factory`` string for a kind: BFlat, BHNSW<m>, BIVF<nlist>."""
    return {"flat": "BFlat", "hnsw": f"BHNSW{m}", "ivf": f"BIVF{nlist}"}[kind]


class BinaryIndex:
    """Sign-bit codes of centred, rotated vectors in a FAISS binary index.

    ``search`` returns scores, not Hamming distances: ``cos(pi h / bits)``, the angle a Hamming distance ``h``
    estimates (Charikar's SimHash), so higher is better as for the inner-product indexes; the stash re-scores the
    candidates by default (``RescoreRecord``)."""

    def __init__(self, binary: Any, rotation: str, centre: np.ndarray | None = None, matrix: np.ndarray | None = None):
        self.binary = binary
        self.rotation = rotation
        self.centre = centre  # (d,) float32, learned by train
        self.matrix = matrix  # (d, d) float32 orthogonal, learned (ITQ) or drawn (random) by train

    @classmethod
    def create(cls, factory: str, dim: int, rotation: str, ef_construction: int | None = None) -> BinaryIndex:
        import faiss

        binary = faiss.index_binary_factory(dim, factory)
        if ef_construction is not None and hasattr(binary, "hnsw"):
            binary.hnsw.efConstruction = ef_construction
        return cls(binary, rotation)

    # ----- the float index's interface ----------------------------------------------------------------------
    @property
    def d(self) -> int:
        return int(self.binary.d)

    @property
    def ntotal(self) -> int:
        return int(self.binary.ntotal)

    @property
    def is_trained(self) -> bool:
        return self.matrix is not None and bool(self.binary.is_trained)

    @property
    def code_size(self) -> int:
        return int(self.binary.code_size)

    def codes(self, vectors: np.ndarray) -> np.ndarray:
        """The packed sign bits of ``vectors`` (n, d) -> (n, d / 8) uint8."""
        assert self.matrix is not None and self.centre is not None, "a binary index is trained before use"
        rotated = (np.asarray(vectors, dtype=np.float32) - self.centre) @ self.matrix
        return np.packbits(rotated > 0, axis=1)

    def train(self, sample: np.ndarray) -> None:
        """Learn the centre and rotation on ``sample`` (transformed rows), then the binary index's own lists."""
        sample = np.asarray(sample, dtype=np.float32)
        if self.matrix is None:
            self.centre = sample.mean(axis=0).astype(np.float32)
            self.matrix = fit_rotation(sample - self.centre, self.rotation)
        if not self.binary.is_trained:
            self.binary.train(self.codes(sample))

    def add(self, vectors: np.ndarray) -> None:
        self.binary.add(self.codes(vectors))

    def search(self, vectors: np.ndarray, k: int, params: Any = None) -> tuple[np.ndarray, np.ndarray]:
        distances, rows = self.binary.search(self.codes(vectors), k, params=params)
        scores = np.cos(np.pi * distances.astype(np.float32) / self.d).astype(np.float32)
        scores[rows < 0] = -np.inf
        return scores, rows

    def reset(self) -> None:
        """Drop the rows; the centre, rotation and any IVF lists stay trained."""
        self.binary.reset()

    # ----- save and load --------------------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        import faiss

        assert self.matrix is not None and self.centre is not None
        buffer = io.BytesIO()
        np.savez(
            buffer,
            binary=faiss.serialize_index_binary(self.binary),
            centre=self.centre,
            matrix=self.matrix,
            rotation=np.array(self.rotation),
        )
        return buffer.getvalue()

    def save(self, path: Path) -> None:
        Path(path).write_bytes(self.to_bytes())

    @classmethod
    def from_bytes(cls, data: bytes, name: str = "binary index") -> BinaryIndex:
        import faiss

        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as saved:
                binary = faiss.deserialize_index_binary(np.ascontiguousarray(saved["binary"]))
                rotation, centre, matrix = str(saved["rotation"]), saved["centre"], saved["matrix"]
        except (OSError, ValueError, KeyError, RuntimeError, zipfile.BadZipFile) as err:
            raise IndexDirError(f"cannot read binary index {name}: it is corrupt; rebuild with --overwrite") from err
        d = int(binary.d)
        if rotation not in ROTATIONS or centre.shape != (d,) or matrix.shape != (d, d):
            raise IndexDirError(f"binary index {name} does not hold a {d}-bit rotation; rebuild with --overwrite")
        return cls(binary, rotation, centre.astype(np.float32), matrix.astype(np.float32))

    @classmethod
    def load(cls, path: Path) -> BinaryIndex:
        return cls.from_bytes(Path(path).read_bytes(), str(path))


def is_binary_file(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def fit_rotation(centred: np.ndarray, method: str) -> np.ndarray:
    """A (d, d) orthogonal matrix R for codes ``sign(x R)``: a random one, or ITQ's, learned on ``centred`` rows.

    ITQ alternates the bits B = sign(V R) and the rotation closest to mapping V onto them (orthogonal Procrustes:
    V^T B = U S W^T, R = U W^T), from the random rotation. FAISS's ``ITQMatrix`` does the same, but took 184 s for
    1,460 x 384 rows where numpy's SVDs took 27 s (one thread each, on a loaded machine)."""
    d = centred.shape[1]
    q, r = np.linalg.qr(np.random.default_rng(ROTATION_SEED).standard_normal((d, d)))
    rotation = q * np.sign(np.diag(r))
    if method == "random":
        return rotation.astype(np.float32)
    if method != "itq":
        raise ValueError(f"unknown rotation {method!r}")
    v = np.asarray(centred, dtype=np.float32)
    for _ in range(ITQ_ITERATIONS):
        bits = np.where(v @ rotation.astype(np.float32) >= 0, 1.0, -1.0).astype(np.float32)
        u, _, wt = np.linalg.svd((v.T @ bits).astype(np.float64))
        rotation = u @ wt
    return np.ascontiguousarray(rotation, dtype=np.float32)
