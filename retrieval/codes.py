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

That cosine is the whitened space's, and real questions on some collections prefer the raw space's (NPL loses
1-2 points under whitening even with 8-bit codes). An index trained with its raw rows (``train(..., raw=...)``, as
every build does) also learns a ``RawDecoder``: each bit's mean value on either side of its threshold, mapped back
through the rotation and the kernel's pseudo-inverse, estimates a row's raw vector from its bits, and two 8-bit
scalars a row (its raw length and the length its decoded deviation misses) put the estimate at the right scale.
Hamming candidates are then re-ranked by the estimated raw cosine to the query's raw vector, still one lookup per
bit. Blended with the whitened cosine, at 48 bytes (368 bits and the 2 scalar bytes) it beat the raw sign bits by
2.3 points of nDCG@10 or more on every IR set, where the whitened cosine alone had +1.8 on NPL
(docs/benchmarks/codes.md).
"""

from __future__ import annotations

import io
import itertools
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.errors import IndexDirError
from retrieval.whitening import Whitening

ROTATIONS = ("itq", "random")
ITQ_ITERATIONS = 50  # as FAISS's ITQMatrix; the probe in the notes saw no gain past it
ROTATION_SEED = 1234
MAGIC = b"PK"  # a binary index file is an .npz archive; a FAISS float index file never starts so
QUERY_CHUNK = 8  # queries whose candidates' bits are unpacked at once in an asymmetric re-rank (8 x 400 x d floats)
SCALAR_BYTES = 2  # a raw decoder's per-row scalars: the raw length and the deviation's scale, 8-bit logarithms
SCALAR_MARGIN = 0.1  # each scalar's log-range over the training rows, widened by this share on either side
# A re-rank with a raw decoder mixes the two estimates (``blend``): the whitened asymmetric cosine's weight, chosen
# on the IR dev basket between the whitened cosine alone (best on CISI and CACM, weakest on NPL) and the raw
# estimate alone (the reverse, and lower on average); see docs/benchmarks/codes.md
WHITENED_WEIGHT = 0.4


def best_k(scores: np.ndarray, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` best (n, m) candidates of each query by score, best first; ties keep their given order. Indexed
    directly: np.take_along_axis costs 6 us a call to build its index (2 us here), paid on every single query."""
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    queries = np.arange(len(order))[:, None]
    return scores[queries, order], rows[queries, order]


def binary_factory(kind: str, m: int, nlist: int) -> str:
    """FAISS's ``index_binary_factory`` string for a kind: BFlat, BHNSW<m>, BIVF<nlist>."""
    return {"flat": "BFlat", "hnsw": f"BHNSW{m}", "ivf": f"BIVF{nlist}"}[kind]


class RawDecoder:
    """A binary code's estimate of the raw vector it came from, and of its cosine to a raw query.

    The transform is ``y = normalize(z)``, ``z = (x - mu) W`` for a centred kernel, ``z = x W`` for an uncentred
    one; the bits are ``b = (y - c) R - t > 0``. Each bit decodes to its mean over
    the training rows on its side of the threshold, and back through R and the kernel's pseudo-inverse the bits
    give the part of a row that they code: ``dev = base + b . steps``. Centred, ``x = mu + |z| y W+``: the
    ``offset`` mu is exact and dev (the centre c included) estimates the direction of ``x - mu``. Uncentred,
    ``x = |z| (c + (y - c)) W+``: the offset ``c W+`` is exact up to the row's scale and dev estimates the
    direction of ``(y - c) W+``. Two scalars per row restore what the bits lose, with ``s`` 1 (centred) or ``|z|``:
    ``alpha = s / |x|`` and ``beta = |x / s - offset| / |dev|``, each an 8-bit logarithm on a range learned from
    the training rows (``bounds``; later rows are clipped to it). The estimated cosine to a query q is then
    ``alpha (q . offset + beta (q . base + b . (steps q))) / |q|``: linear in the bits, as the asymmetric score
    is. (W+ only spans the kept directions: below full dimension the estimate misses the rest, as the kernel
    does.)"""

    def __init__(self, offset: np.ndarray, base: np.ndarray, steps: np.ndarray, bounds: np.ndarray, centred: bool):
        self.offset = np.asarray(offset, dtype=np.float32)  # (d_in,)
        self.base = np.asarray(base, dtype=np.float32)  # (d_in,) dev of a row with every bit clear
        self.steps = np.asarray(steps, dtype=np.float32)  # (bits, d_in) what each set bit adds to dev
        self.bounds = np.asarray(bounds, dtype=np.float32)  # (2, 2): log alpha's and log beta's (low, high)
        self.centred = bool(centred)  # the kernel subtracts the mean: each row's scale s is 1
        self._tables: tuple[np.ndarray, np.ndarray] | None = None  # ``values``' levels, for these bounds

    @classmethod
    def fit(cls, index: BinaryIndex, transform: Whitening, sample: np.ndarray, raw: np.ndarray) -> RawDecoder:
        """Learn the decoder of ``index`` (trained) on the training rows: ``sample`` transformed by ``transform``,
        ``raw`` as they came."""
        assert index.matrix is not None and index.centre is not None and index.thresholds is not None
        centred, mean = transform.center, np.asarray(transform.mean, np.float64)
        back = np.linalg.pinv(np.asarray(transform.kernel, np.float64))  # (k, d_in): the kernel's space -> raw
        rotated = index.rotated(sample)
        bits = rotated > 0
        # each bit's mean on either side of its threshold (the threshold itself where a side is empty)
        high = np.where(bits, rotated, 0).sum(axis=0) / np.maximum(bits.sum(axis=0), 1)
        low = np.where(bits, 0, rotated).sum(axis=0) / np.maximum((~bits).sum(axis=0), 1)
        cleared = (low + index.thresholds) @ index.matrix.T  # a row with no bit set, less the centre
        if centred:
            offset, base = mean, (cleared + index.centre) @ back
        else:
            offset, base = index.centre @ back, cleared @ back
        steps = (high - low)[:, None] * (index.matrix.T.astype(np.float64) @ back)
        decoder = cls(offset, base, steps, np.zeros((2, 2)), centred)
        raw = np.asarray(raw, dtype=np.float32)
        logs = decoder._logs(raw, transform.transform(raw, normalize=False), bits)
        low_end, high_end = logs.min(axis=0), logs.max(axis=0)
        spread = np.maximum(high_end - low_end, 1e-3)
        decoder.bounds = np.stack([low_end - SCALAR_MARGIN * spread, high_end + SCALAR_MARGIN * spread], axis=1)
        return decoder

    def _logs(self, raw: np.ndarray, unnormalised: np.ndarray, bits: np.ndarray) -> np.ndarray:
        """(n, 2) log alpha, log beta of rows with these ``raw`` vectors, their transform before normalising
        (``z``) and unpacked ``bits`` (n, bits)."""
        tiny = np.finfo(np.float32).tiny
        scale = np.ones(len(raw), np.float32) if self.centred else np.linalg.norm(unnormalised, axis=1)
        scale = np.maximum(scale, tiny)
        dev = self.base + bits.astype(np.float32) @ self.steps
        length = np.maximum(np.linalg.norm(raw, axis=1), tiny)
        spread = np.maximum(np.linalg.norm(raw / scale[:, None] - self.offset, axis=1), tiny)
        dev_length = np.maximum(np.linalg.norm(dev, axis=1), tiny)
        return np.stack([np.log(scale) - np.log(length), np.log(spread) - np.log(dev_length)], axis=1)

    def scalars(self, raw: np.ndarray, unnormalised: np.ndarray, packed: np.ndarray) -> np.ndarray:
        """The (n, SCALAR_BYTES) uint8 scalars of rows with these ``raw`` vectors, their transform before
        normalising and their ``packed`` codes."""
        bits = np.unpackbits(packed, axis=1)[:, : len(self.steps)].astype(bool)
        logs = self._logs(np.asarray(raw, dtype=np.float32), unnormalised, bits)
        low, high = self.bounds[:, 0], self.bounds[:, 1]
        return np.clip(np.rint((logs - low) / (high - low) * 255), 0, 255).astype(np.uint8)

    def values(self, scalars: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(alpha, beta) of uint8 ``scalars`` (..., 2), by a table of the 256 levels of each."""
        if self._tables is None or self._tables[1] is not self.bounds:
            low, high = self.bounds[:, 0:1], self.bounds[:, 1:2]
            self._tables = (np.exp(low + np.arange(256, dtype=np.float32) / 255 * (high - low)), self.bounds)
        table = self._tables[0]
        return table[0][scalars[..., 0]], table[1][scalars[..., 1]]

    def per_bit(self, raw: np.ndarray) -> np.ndarray:
        """(n, bits): what each set bit adds to a candidate's ``q . dev`` for raw queries (n, d_in)."""
        return np.asarray(raw, dtype=np.float32) @ self.steps.T

    def scores(self, raw: np.ndarray, codes: np.ndarray, scalars: np.ndarray, found: np.ndarray) -> np.ndarray:
        """(n, m) estimated raw cosines of raw queries (n, d_in) to candidates with packed ``codes`` (n, m, bytes)
        and ``scalars`` (n, m, 2); -inf where not ``found``."""
        return self.estimate(raw, bit_dots(codes, self.per_bit(raw)[:, :, None])[:, :, 0], scalars, found)

    def estimate(self, raw: np.ndarray, dots: np.ndarray, scalars: np.ndarray, found: np.ndarray) -> np.ndarray:
        """``scores`` from the candidates' ``dots`` (n, m): their set bits summed over ``per_bit``."""
        raw = np.asarray(raw, dtype=np.float32)
        lengths = np.sqrt(np.einsum("ij,ij->i", raw, raw))
        lengths[lengths == 0] = 1.0
        alpha, beta = self.values(scalars)
        scores = dots + (raw @ self.base)[:, None]
        scores *= beta
        scores += (raw @ self.offset)[:, None]
        scores *= alpha
        scores /= lengths[:, None]
        scores[~found] = -np.inf
        return scores

    def arrays(self) -> dict[str, np.ndarray]:
        return {
            "raw_offset": self.offset,
            "raw_base": self.base,
            "raw_steps": self.steps,
            "raw_bounds": self.bounds,
            "raw_centred": np.array(self.centred),
        }

    @classmethod
    def from_arrays(cls, saved: Any) -> RawDecoder | None:
        """The decoder an index file holds, or None (files written before, or an index trained without raw rows)."""
        if "raw_steps" not in saved:
            return None
        parts = (saved["raw_offset"], saved["raw_base"], saved["raw_steps"], saved["raw_bounds"])
        return cls(*parts, bool(saved["raw_centred"]))


def bit_dots(codes: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """(n, m, c): each of n queries' ``c`` weight vectors (n, bits, c) summed over the set bits of its m packed
    ``codes`` (n, m, bits / 8): the bits unpacked and multiplied, a chunk of queries at a time (3x faster than
    gathering bits / 8 partial sums from byte tables: 0.027 against 0.081 ms for 400 codes of 48 bytes)."""
    n, m, _ = codes.shape
    out = np.empty((n, m, weights.shape[2]), dtype=np.float32)
    for start in range(0, n, QUERY_CHUNK):
        stop = min(start + QUERY_CHUNK, n)
        bits = np.unpackbits(codes[start:stop], axis=2).astype(np.float32)  # (q, m, bits)
        out[start:stop] = np.matmul(bits, weights[start:stop])
    return out


def blend(whitened: np.ndarray, raw: np.ndarray, found: np.ndarray, weight: float = WHITENED_WEIGHT) -> np.ndarray:
    """Each query's candidates (n, m) scored by both estimates, mixed: ``weight`` of the whitened asymmetric
    cosine and the rest of the estimated raw cosine, each standardised over the query's ``found`` candidates,
    then put back on the raw estimate's scale (its mean and spread), so a score still reads as a raw cosine.
    -inf where not ``found``."""
    if found.all():  # no -inf to leave out (the usual case): the moments over every candidate
        centred_w = whitened - whitened.mean(axis=1, keepdims=True)
        mean_r = raw.mean(axis=1, keepdims=True)
        centred_r = raw - mean_r
        spread_w = np.sqrt(np.einsum("ij,ij->i", centred_w, centred_w) / whitened.shape[1])[:, None]
        spread_r = np.sqrt(np.einsum("ij,ij->i", centred_r, centred_r) / raw.shape[1])[:, None]
        spread_w[spread_w == 0] = 1.0
        # mean_r + spread_r (weight z_w + (1 - weight) z_r), without the division by spread_r and back
        centred_w *= weight * spread_r / spread_w
        centred_r *= 1 - weight
        return (mean_r + centred_r + centred_w).astype(np.float32)
    count = np.maximum(found.sum(axis=1, keepdims=True), 1)

    def moments(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        kept = np.where(found, scores, 0)
        mean = kept.sum(axis=1, keepdims=True) / count
        spread = np.sqrt(np.where(found, (kept - mean) ** 2, 0).sum(axis=1, keepdims=True) / count)
        return mean, np.where(spread > 0, spread, 1)

    (mean_w, spread_w), (mean_r, spread_r) = moments(whitened), moments(raw)
    with np.errstate(invalid="ignore"):  # -inf less a mean where not found: replaced below
        mixed = weight * (whitened - mean_w) / spread_w + (1 - weight) * (raw - mean_r) / spread_r
    out = (mean_r + spread_r * mixed).astype(np.float32)
    out[~found] = -np.inf
    return out


class BinaryIndex:
    """Sign-bit codes of centred, rotated vectors in a FAISS binary index.

    ``search`` returns scores, not Hamming distances: ``cos(pi h / bits)``, the angle a Hamming distance ``h``
    estimates (Charikar's SimHash), so higher is better as for the inner-product indexes; or, when ``rerank``
    (the attribute, or the call's) exceeds k, that many Hamming candidates re-ranked: by the estimated raw cosine
    (``RawDecoder``) when the index has a decoder and the call gives the queries' ``raw`` vectors, else by the
    cosine between the query's rotated floats and the +-1 bits (``asymmetric``). The stash re-scores the
    candidates by default (``RescoreRecord``)."""

    def __init__(
        self,
        binary: Any,
        rotation: str,
        centre: np.ndarray | None = None,
        matrix: np.ndarray | None = None,
        thresholds: np.ndarray | None = None,
        rerank: int = 0,
        decoder: RawDecoder | None = None,
        scalars: np.ndarray | None = None,
    ):
        self.binary = binary
        self.rotation = rotation
        self.centre = centre  # (d,) float32, learned by train
        self.matrix = matrix  # (d, d) float32 orthogonal, learned (ITQ) or drawn (random) by train
        # (d,) float32: each rotated coordinate's median over the training rows (zeros in files written before)
        self.thresholds = thresholds
        self.rerank = rerank  # Hamming candidates re-ranked asymmetrically by default (0: Hamming only)
        self.decoder = decoder  # learned by train when given the raw rows
        # (ntotal, SCALAR_BYTES) uint8: each row's scalars for the decoder, in row order (None without one)
        self.scalars = scalars if scalars is not None or decoder is None else np.zeros((0, SCALAR_BYTES), np.uint8)
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

    def train(self, sample: np.ndarray, raw: np.ndarray | None = None, transform: Any = None) -> None:
        """Learn the centre, rotation and thresholds on ``sample`` (transformed rows), then the binary index's own
        lists; given the same rows ``raw`` and the ``transform`` that made ``sample`` of them, the raw decoder too
        (``RawDecoder``: from then on every ``add`` takes the rows' raw vectors)."""
        sample = np.asarray(sample, dtype=np.float32)
        if self.matrix is None:
            self.centre = sample.mean(axis=0).astype(np.float32)
            self.matrix = fit_rotation(sample - self.centre, self.rotation)
            # a bit set for half the rows carries the most; the mean splits a skewed coordinate unevenly
            self.thresholds = np.median((sample - self.centre) @ self.matrix, axis=0).astype(np.float32)
        # raw vectors' codes need no decoder: their asymmetric cosine already estimates the raw one (and on a
        # narrow cone of raw vectors, the decoded estimate ranked worse)
        if raw is not None and isinstance(transform, Whitening) and self.decoder is None:
            assert self.ntotal == 0, "a raw decoder is learned before the index holds rows"
            self.decoder = RawDecoder.fit(self, transform, sample, raw)
            self.scalars = np.zeros((0, SCALAR_BYTES), np.uint8)
        if not self.binary.is_trained:
            self.binary.train(self.codes(sample))

    def add(self, vectors: np.ndarray, raw: np.ndarray | None = None, unnormalised: np.ndarray | None = None) -> None:
        """Add transformed rows; an index with a raw decoder also takes their ``raw`` vectors and their transform
        before normalising (``transform(raw, normalize=False)``), for its scalars."""
        codes = self.codes(vectors)
        if self.decoder is not None:
            if raw is None or unnormalised is None or not len(raw) == len(unnormalised) == len(codes):
                raise ValueError("this binary index re-ranks by raw cosine: add its rows with their raw vectors")
            assert self.scalars is not None
            self.scalars = np.concatenate([self.scalars, self.decoder.scalars(raw, unnormalised, codes)])
        self._lists = None
        self.binary.add(codes)

    def merge_from(self, shard: BinaryIndex) -> None:
        """Append ``shard``'s rows (an IVF copy of this trained index), numbered after this index's own."""
        if self.scalars is not None:
            assert shard.scalars is not None, "a shard of an index with a raw decoder has its scalars"
            self.scalars = np.concatenate([self.scalars, shard.scalars])
        self._lists = None
        self.binary.merge_from(shard.binary, self.ntotal)

    def search(
        self,
        vectors: np.ndarray,
        k: int,
        params: Any = None,
        rerank: int | None = None,
        raw: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(scores, rows) of the best ``k``: by Hamming distance (``rerank`` 0), or among the best
        ``max(k, rerank)`` by Hamming distance (``rerank`` None: this index's) by the estimated raw cosine to the
        queries' ``raw`` vectors (an index with a decoder, given them) or by ``asymmetric``."""
        depth = self.rerank if rerank is None else rerank
        wide = max(k, min(depth, self.ntotal)) if depth else k
        rotated = self.rotated(vectors)
        packed = np.packbits(rotated > 0, axis=1)
        if depth and self._reconstructs(params):
            rows, codes = self._search_and_reconstruct(packed, wide)
        else:
            distances, rows = self.binary.search(packed, wide, params=params)
            if not depth:
                scores = np.cos(np.pi * distances.astype(np.float32) / self.d).astype(np.float32)
                scores[rows < 0] = -np.inf
                return scores, rows
            codes = self._codes_at(rows)
        return best_k(self._rerank_scores(rotated, raw, rows, codes), rows, k)

    def asymmetric(self, vectors: np.ndarray, rows: np.ndarray, raw: np.ndarray | None = None) -> np.ndarray:
        """(n, m) scores of each query's candidate ``rows`` (n, m; -1: none, scored -inf): with the queries' ``raw``
        vectors and a decoder, the estimated raw cosine (``RawDecoder``); else the cosine between the query's
        ``rotated`` floats r and a row's +-1 bits b, ``r . b / (|r| sqrt(d))``."""
        return self._rerank_scores(self.rotated(np.atleast_2d(vectors)), raw, rows, self._codes_at(rows))

    def _rerank_scores(
        self, rotated: np.ndarray, raw: np.ndarray | None, rows: np.ndarray, codes: np.ndarray
    ) -> np.ndarray:
        found = rows >= 0
        if raw is None or self.decoder is None:
            return self._scores(rotated, codes, found)
        assert self.scalars is not None
        raw = np.atleast_2d(np.asarray(raw, dtype=np.float32))
        # both estimates from one unpacking of the bits: the rotated query's weights and the decoder's
        weights = np.empty((len(raw), self.d, 2), dtype=np.float32)
        np.multiply(rotated, 2, out=weights[:, :, 0])
        weights[:, :, 1] = self.decoder.per_bit(raw)
        dots = bit_dots(codes, weights)
        every = bool(found.all())
        scalars = self.scalars[rows] if every else self.scalars[np.where(found, rows, 0)]
        estimated = self.decoder.estimate(raw, dots[:, :, 1], scalars, found)
        # the blend standardises the whitened side, so an affine map of it per query changes nothing: with every
        # candidate found, its raw dot products stand in for the cosines (one pass fewer over the candidates)
        whitened = dots[:, :, 0] if every else self._whitened(rotated, dots[:, :, 0], found)
        return blend(whitened, estimated, found)

    def _codes_at(self, rows: np.ndarray) -> np.ndarray:
        """The packed codes (n, m, d / 8) of candidate ``rows`` (n, m; -1: zeros)."""
        n, m = rows.shape
        found = rows >= 0
        codes = np.zeros((n, m, self.code_size), dtype=np.uint8)
        codes[found] = self.codes_of(rows[found])
        return codes

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

    def _scores(self, rotated: np.ndarray, codes: np.ndarray, found: np.ndarray) -> np.ndarray:
        """``asymmetric``'s scores of (n, m) candidates from their packed ``codes`` (n, m, d / 8); -inf where not
        ``found``. With b_j in {0, 1}, r . (2b - 1) = 2 (b . r) - sum(r) (``bit_dots``)."""
        return self._whitened(rotated, bit_dots(codes, 2 * rotated[:, :, None])[:, :, 0], found)

    def _whitened(self, rotated: np.ndarray, dots: np.ndarray, found: np.ndarray) -> np.ndarray:
        """The asymmetric cosines from ``dots`` (n, m), each candidate's set bits summed over 2 r."""
        norms = np.linalg.norm(rotated, axis=1) * np.sqrt(self.d)
        norms[norms == 0] = 1.0  # a query on every threshold: every score 0, not NaN
        scores = ((dots - rotated.sum(axis=1, keepdims=True)) / norms[:, None]).astype(np.float32)
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
        """Drop the rows; the centre, rotation, thresholds, decoder and any IVF lists stay trained."""
        self._lists = None
        if self.scalars is not None:
            self.scalars = self.scalars[:0]
        self.binary.reset()

    # ----- save and load --------------------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        import faiss

        assert self.matrix is not None and self.centre is not None
        arrays: dict[str, np.ndarray] = {
            "binary": faiss.serialize_index_binary(self.binary),
            "centre": self.centre,
            "matrix": self.matrix,
            "thresholds": np.zeros(self.d, np.float32) if self.thresholds is None else self.thresholds,
            "rotation": np.array(self.rotation),
        }
        if self.decoder is not None:
            assert self.scalars is not None
            arrays |= self.decoder.arrays() | {"scalars": self.scalars}
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)  # type: ignore[arg-type]  # the stubs take every keyword for allow_pickle
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
                decoder = RawDecoder.from_arrays(saved)  # older files, or trained without raw rows: none
                scalars = saved["scalars"] if decoder is not None else None
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
        if decoder is not None and (
            decoder.steps.shape[0] != d
            or decoder.offset.shape != decoder.base.shape
            or decoder.steps.shape[1:] != decoder.base.shape
            or decoder.bounds.shape != (2, 2)
            or scalars is None
            or scalars.shape != (int(binary.ntotal), SCALAR_BYTES)
        ):
            raise IndexDirError(
                f"binary index {name} holds a raw decoder that does not fit it; rebuild with --overwrite"
            )
        shift = None if thresholds is None else thresholds.astype(np.float32)
        index = cls(binary, rotation, centre.astype(np.float32), matrix.astype(np.float32), shift)
        index.decoder, index.scalars = decoder, None if scalars is None else scalars.astype(np.uint8)
        return index

    @classmethod
    def load(cls, path: Path) -> BinaryIndex:
        return cls.from_bytes(Path(path).read_bytes(), str(path))


def search_extras(index: Any, raw: np.ndarray | None = None, rerank: int | None = None) -> dict[str, Any]:
    """The keyword arguments of a search that only a ``BinaryIndex`` takes: this call's ``rerank`` depth and the
    queries' ``raw`` vectors (each where given); none for a FAISS index."""
    if not isinstance(index, BinaryIndex):
        return {}
    return ({} if rerank is None else {"rerank": rerank}) | ({} if raw is None else {"raw": np.atleast_2d(raw)})


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
