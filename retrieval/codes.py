"""Binary codes: the kernel's output centred, rotated and cut to one sign bit per dimension, searched by Hamming
distance in a FAISS binary index (flat, HNSW or IVF), behind the interface the float indexes offer.

A sign bit ignores the scale of its direction, so the sign bits of whitened (PCA) coordinates are poor codes: the
first directions carry most of the variance, yet every bit counts the same in Hamming distance. A rotation after the
kernel spreads the variance over all bits (ITQ, Gong & Lazebnik 2011). Measured on CISI with all-MiniLM-L6-v2 at 48
bytes: sign bits of whitened coordinates kept 0.58 of raw nDCG@10, after a random rotation 0.97, after ITQ 0.99
(``scripts/bench_codes.py`` compares the two rotations on every IR set). The centre, the rotation and each bit's
threshold (its median over the training rows) are learned when the index is trained and saved with its codes, so
queries get the same bits as the documents.

Hamming distance throws away the query's magnitudes too. Re-ranking a deeper list of Hamming candidates by the
query's rotated floats against the documents' +-1 bits (``asymmetric``, read from the codes FAISS holds) gained
2-4 points of nDCG@10 over Hamming distance at 48 bytes (docs/benchmarks/codes.md); ``rerank`` candidates are
re-ranked so by default.
"""

from __future__ import annotations

import io
import itertools
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.errors import IndexDirError

ROTATIONS = ("itq", "random")
ITQ_ITERATIONS = 50  # as FAISS's ITQMatrix; the probe in the notes saw no gain past it
ROTATION_SEED = 1234
MAGIC = b"PK"  # a binary index file is an .npz archive; a FAISS float index file never starts so
QUERY_CHUNK = 8  # queries whose candidates' bits are unpacked at once in an asymmetric re-rank (8 x 400 x d floats)


def best_k(scores: np.ndarray, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` best (n, m) candidates of each query by score, best first; ties keep their given order. Indexed
    directly: np.take_along_axis costs 6 us a call to build its index (2 us here), paid on every single query."""
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    queries = np.arange(len(order))[:, None]
    return scores[queries, order], rows[queries, order]


def binary_factory(kind: str, m: int, nlist: int) -> str:
    """FAISS's ``index_binary_factory`` string for a kind: BFlat, BHNSW<m>, BIVF<nlist>."""
    return {"flat": "BFlat", "hnsw": f"BHNSW{m}", "ivf": f"BIVF{nlist}"}[kind]


class BinaryIndex:
    """Sign-bit codes of centred, rotated vectors in a FAISS binary index.

    ``search`` returns scores, not Hamming distances: ``cos(pi h / bits)``, the angle a Hamming distance ``h``
    estimates (Charikar's SimHash), so higher is better as for the inner-product indexes; or, when ``rerank``
    (the attribute, or the call's) exceeds k, the cosine between the query's rotated floats and the +-1 bits of
    that many Hamming candidates (``asymmetric``). The stash re-scores the candidates by default
    (``RescoreRecord``)."""

    def __init__(
        self,
        binary: Any,
        rotation: str,
        centre: np.ndarray | None = None,
        matrix: np.ndarray | None = None,
        thresholds: np.ndarray | None = None,
        rerank: int = 0,
    ):
        self.binary = binary
        self.rotation = rotation
        self.centre = centre  # (d,) float32, learned by train
        self.matrix = matrix  # (d, d) float32 orthogonal, learned (ITQ) or drawn (random) by train
        # (d,) float32: each rotated coordinate's median over the training rows (zeros in files written before)
        self.thresholds = thresholds
        self.rerank = rerank  # Hamming candidates re-ranked asymmetrically by default (0: Hamming only)
        self._lists: tuple[Any, ...] | None = None  # an IVF index's codes by row (``codes_of``), made on first use

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

    def rotated(self, vectors: np.ndarray) -> np.ndarray:
        """``vectors`` (n, d) centred, rotated and shifted by the bits' thresholds: a bit is set where this is > 0."""
        assert self.matrix is not None and self.centre is not None, "a binary index is trained before use"
        rotated = (np.asarray(vectors, dtype=np.float32) - self.centre) @ self.matrix
        return rotated if self.thresholds is None else rotated - self.thresholds

    def codes(self, vectors: np.ndarray) -> np.ndarray:
        """The packed sign bits of ``vectors`` (n, d) -> (n, d / 8) uint8."""
        return np.packbits(self.rotated(vectors) > 0, axis=1)

    def train(self, sample: np.ndarray) -> None:
        """Learn the centre, rotation and thresholds on ``sample`` (transformed rows), then the binary index's own
        lists."""
        sample = np.asarray(sample, dtype=np.float32)
        if self.matrix is None:
            self.centre = sample.mean(axis=0).astype(np.float32)
            self.matrix = fit_rotation(sample - self.centre, self.rotation)
            # a bit set for half the rows carries the most; the mean splits a skewed coordinate unevenly
            self.thresholds = np.median((sample - self.centre) @ self.matrix, axis=0).astype(np.float32)
        if not self.binary.is_trained:
            self.binary.train(self.codes(sample))

    def add(self, vectors: np.ndarray) -> None:
        self._lists = None
        self.binary.add(self.codes(vectors))

    def merge_from(self, shard: BinaryIndex) -> None:
        """Append ``shard``'s rows (an IVF copy of this trained index), numbered after this index's own."""
        self._lists = None
        self.binary.merge_from(shard.binary, self.ntotal)

    def search(
        self, vectors: np.ndarray, k: int, params: Any = None, rerank: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(scores, rows) of the best ``k``: by Hamming distance (``rerank`` 0), or by ``asymmetric`` among the best
        ``max(k, rerank)`` by Hamming distance (``rerank`` None: this index's)."""
        depth = self.rerank if rerank is None else rerank
        wide = max(k, min(depth, self.ntotal)) if depth else k
        rotated = self.rotated(vectors)
        packed = np.packbits(rotated > 0, axis=1)
        if depth and self._reconstructs(params):
            rows, codes = self._search_and_reconstruct(packed, wide)
            scores = self._scores(rotated, codes, rows >= 0)
        else:
            distances, rows = self.binary.search(packed, wide, params=params)
            if not depth:
                scores = np.cos(np.pi * distances.astype(np.float32) / self.d).astype(np.float32)
                scores[rows < 0] = -np.inf
                return scores, rows
            scores = self._asymmetric(rotated, rows)
        return best_k(scores, rows, k)

    def asymmetric(self, vectors: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """(n, m) scores of each query's candidate ``rows`` (n, m; -1: none, scored -inf): the cosine between the
        query's ``rotated`` floats r and a row's +-1 bits b, ``r . b / (|r| sqrt(d))``."""
        return self._asymmetric(self.rotated(np.atleast_2d(vectors)), rows)

    def _reconstructs(self, params: Any) -> bool:
        """Whether a search with ``params`` can take its candidates' codes from FAISS's own search: an IVF index
        searched at its own ``nprobe``, every row eligible (FAISS's search_and_reconstruct takes no parameters)."""
        import faiss

        if not isinstance(self.binary, faiss.IndexBinaryIVF):
            return False
        if params is None:
            return True
        plain = isinstance(params, faiss.SearchParametersIVF) and params.sel is None and not params.max_codes
        return plain and int(params.nprobe) == int(self.binary.nprobe)

    def _search_and_reconstruct(self, packed: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows (n, k), their codes (n, k, d / 8)) of the best ``k`` by Hamming distance: the codes copied out of
        the lists during the search, where a search then ``codes_of`` gathers them again list by list (0.39 ms
        against 0.54 ms a query at 1M rows, nprobe 32, k 400; ties at the k-th distance may differ)."""
        import faiss

        n = len(packed)
        packed = np.ascontiguousarray(packed)
        distances = np.empty((n, k), dtype=np.int32)
        rows = np.empty((n, k), dtype=np.int64)
        codes = np.empty((n, k, self.code_size), dtype=np.uint8)  # a -1 row's bytes: FAISS's filler, scored -inf
        self.binary.search_and_reconstruct(
            n, faiss.swig_ptr(packed), k, faiss.swig_ptr(distances), faiss.swig_ptr(rows), faiss.swig_ptr(codes)
        )
        return rows, codes

    def _asymmetric(self, rotated: np.ndarray, rows: np.ndarray) -> np.ndarray:
        n, m = rows.shape
        found = rows >= 0
        codes = np.zeros((n, m, self.code_size), dtype=np.uint8)
        codes[found] = self.codes_of(rows[found])
        return self._scores(rotated, codes, found)

    def _scores(self, rotated: np.ndarray, codes: np.ndarray, found: np.ndarray) -> np.ndarray:
        """``asymmetric``'s scores of (n, m) candidates from their packed ``codes`` (n, m, d / 8); -inf where not
        ``found``. With b_j in {0, 1}, r . (2b - 1) = 2 (b . r) - sum(r): the bits unpacked and multiplied by the
        query's floats, a chunk of queries at a time (3x faster than gathering d/8 partial sums from byte tables:
        0.027 against 0.081 ms for 400 codes of 48 bytes)."""
        n, m, size = codes.shape
        norms = np.linalg.norm(rotated, axis=1) * np.sqrt(self.d)
        norms[norms == 0] = 1.0  # a query on every threshold: every score 0, not NaN
        scores = np.empty((n, m), dtype=np.float32)
        for start in range(0, n, QUERY_CHUNK):
            chunk = rotated[start : start + QUERY_CHUNK]
            bits = np.unpackbits(codes[start : start + len(chunk)], axis=2).astype(np.float32)  # (q, m, d)
            dots = np.matmul(bits, (2 * chunk)[:, :, None])[:, :, 0] - chunk.sum(axis=1, keepdims=True)
            scores[start : start + len(chunk)] = dots / norms[start : start + len(chunk), None]
        scores[~found] = -np.inf
        return scores

    def codes_of(self, rows: np.ndarray) -> np.ndarray:
        """The packed codes FAISS holds for ``rows`` (m,) -> (m, d / 8) uint8, read in place: a flat index's code
        array, an HNSW graph's flat storage, or an IVF index's lists (through a map of each row's list and place,
        made once: 8 bytes a row)."""
        import faiss

        rows = np.asarray(rows, dtype=np.int64)
        if not len(rows):
            return np.zeros((0, self.code_size), dtype=np.uint8)
        top = self.binary
        if isinstance(top, faiss.IndexBinaryIVF):
            return self._ivf_codes(rows)
        flat: Any = faiss.downcast_IndexBinary(top.storage) if isinstance(top, faiss.IndexBinaryHNSW) else top
        assert isinstance(flat, faiss.IndexBinaryFlat), f"no codes to read in {type(flat).__name__}"
        stored = getattr(flat, "xb")  # noqa: B009 - the stubs lack IndexBinaryFlat's code array
        array = faiss.rev_swig_ptr(stored.data(), flat.ntotal * flat.code_size).reshape(flat.ntotal, -1)
        return array[rows]

    def _ivf_codes(self, rows: np.ndarray) -> np.ndarray:
        import faiss

        if self._lists is None:
            lists = self.binary.invlists
            sizes = np.array([lists.list_size(i) for i in range(self.binary.nlist)], dtype=np.int64)
            ids = [
                faiss.rev_swig_ptr(lists.get_ids(i), int(n)) if n else np.zeros(0, np.int64)
                for i, n in enumerate(sizes)
            ]
            codes = [
                faiss.rev_swig_ptr(lists.get_codes(i), int(n) * self.code_size).reshape(int(n), -1)
                if n
                else np.zeros((0, self.code_size), np.uint8)
                for i, n in enumerate(sizes)
            ]
            where = np.empty(self.ntotal, dtype=np.int64)  # a row's list << 32 | its place in the list
            for number, held in enumerate(ids):
                where[held] = (number << 32) | np.arange(len(held), dtype=np.int64)
            self._lists = (where, codes)
        where, codes = self._lists
        order = np.argsort(where[rows], kind="stable")  # the rows grouped by list: one slice per list, no masks
        place = where[rows[order]]
        number, offset = place >> 32, place & 0xFFFFFFFF
        bounds = [0, *(np.flatnonzero(np.diff(number)) + 1).tolist(), len(rows)]
        out = np.empty((len(rows), self.code_size), dtype=np.uint8)
        for start, stop in itertools.pairwise(bounds):
            out[order[start:stop]] = codes[number[start]][offset[start:stop]]
        return out

    def reset(self) -> None:
        """Drop the rows; the centre, rotation, thresholds and any IVF lists stay trained."""
        self._lists = None
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
            thresholds=np.zeros(self.d, np.float32) if self.thresholds is None else self.thresholds,
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
                thresholds = saved["thresholds"] if "thresholds" in saved else None  # older files: zero
        except (OSError, ValueError, KeyError, RuntimeError, zipfile.BadZipFile) as err:
            raise IndexDirError(f"cannot read binary index {name}: it is corrupt; rebuild with --overwrite") from err
        d = int(binary.d)
        if (
            rotation not in ROTATIONS
            or centre.shape != (d,)
            or matrix.shape != (d, d)
            or (thresholds is not None and thresholds.shape != (d,))
        ):
            raise IndexDirError(f"binary index {name} does not hold a {d}-bit rotation; rebuild with --overwrite")
        shift = None if thresholds is None else thresholds.astype(np.float32)
        return cls(binary, rotation, centre.astype(np.float32), matrix.astype(np.float32), shift)

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
