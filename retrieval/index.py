"""The FAISS side: index kinds, training on a sample, adding in blocks, search knobs, save and load."""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import faiss

from retrieval.codes import MAGIC, ROTATIONS, SCALAR_BYTES, BinaryIndex, binary_factory, is_binary_file
from retrieval.errors import ConfigError, IndexDirError
from retrieval.files import WRITE_ERRNOS
from retrieval.options import option
from retrieval.whitening import l2_normalize

log = logging.getLogger(__name__)

KINDS = ("flat", "hnsw", "ivf")
CODES = ("fp32", "fp16", "sq8", "sq4", "binary")
# What each code is called in FAISS's index_factory after "HNSW32_" (or alone, for flat) and after "IVF1024,"
_SQ = {"fp32": "Flat", "fp16": "SQfp16", "sq8": "SQ8", "sq4": "SQ4"}
DEFAULT_ROTATION = "itq"
# Hamming candidates a binary index re-ranks from their codes by default (codes.BinaryIndex.asymmetric, blended
# with codes.RawDecoder's estimate for whitened codes); chosen in docs/benchmarks/codes.md (scripts/bench_codes.py)
RERANK_DEPTH = 400
REFINE_K_FACTOR = 16  # a Refine(...) step re-ranks 16 k candidates of the compressed index exactly
MAX_KNOB = 1 << 24  # no count-like knob (lists, beam widths, training rows) is sensible beyond this
ADD_CHUNK_BYTES = 1 << 25  # a flat index read for adding comes from its file 32 MiB at a time


@dataclass(frozen=True)
class IndexSpec:
    """Which FAISS index to build over the transformed vectors (inner product on L2-normalised rows).

    ``kind`` is flat, hnsw, ivf (lists of 16-bit floats), or any FAISS ``index_factory`` string for what follows
    the transform (``HNSW32``, ``IVF4096,SQ8``, ``IVF1024,PQ32x8,Refine(Flat)``...). ``None`` knobs get defaults
    from N. ``codes`` (flat, hnsw and ivf only): what the index keeps of each vector: 32- or 16-bit floats, 8- or
    4-bit scalar codes (a range per dimension), or one sign bit per dimension (``binary``: Hamming distance after
    a ``rotation``, ITQ or random, learned with the index; ``codes.BinaryIndex``); None: the kind's default
    (fp16 for ivf, fp32 otherwise).
    """

    kind: str = option(
        "flat",
        "flat, hnsw, ivf, or a FAISS index_factory string (HNSW32, IVF1024,SQ8, ...).",
        flag_decls=("--index-type",),
    )
    m: int = option(32, "HNSW: neighbours per node.", flag_decls=("--m",))
    ef_construction: int = option(200, "HNSW: build-time beam width.")
    ef_search: int = option(128, "HNSW: default search beam width.")
    nlist: int | None = option(None, "IVF: lists.", default_help="~4 sqrt(N), at most N/39")
    nprobe: int | None = option(None, "IVF: lists probed per query.", default_help="~sqrt(nlist)")
    train_size: int | None = option(None, "IVF/PQ: training sample rows.")
    codes: str | None = option(
        None,
        f"What the index keeps of each vector: {', '.join(CODES)} (flat, hnsw, ivf; binary: 1 bit a dimension, "
        "Hamming distance, re-scored from the stash).",
        default_help="fp16 for ivf, else fp32",
    )
    rotation: str | None = option(
        None, f"Binary codes: the rotation after the kernel, {', '.join(ROTATIONS)}.", default_help="itq"
    )
    rerank: int | None = option(
        None,
        "Binary codes: re-rank this many Hamming candidates by the query's floats against the codes' bits "
        "(whitened codes: blended with the raw cosine estimated from the bits); 0: Hamming distance only.",
        default_help=str(RERANK_DEPTH),
    )

    @property
    def code(self) -> str | None:
        """The codes this spec builds: ``codes``, else the kind's default (None for a factory string)."""
        if self.kind not in KINDS:
            return None
        # IVF lists of 16-bit floats: half the bytes of 32-bit ones to read per probed list. 1M real rows, 4,000
        # lists, nprobe 48: the same recall@10 (0.956 at 256 dims, 0.958 at 128), single queries 1.4x and
        # batches 1.6-1.8x faster, half the memory (docs/benchmarks/scale.md).
        return self.codes or ("fp16" if self.kind == "ivf" else "fp32")

    @property
    def binary(self) -> bool:
        return self.code == "binary"

    @property
    def rerank_used(self) -> int:
        """Hamming candidates re-ranked from their codes (``rerank``, else ``RERANK_DEPTH``); 0 for other codes."""
        return (RERANK_DEPTH if self.rerank is None else self.rerank) if self.binary else 0

    @property
    def rotation_used(self) -> str | None:
        """The rotation of binary codes (``rotation``, else ``DEFAULT_ROTATION``); None for other codes."""
        return (self.rotation or DEFAULT_ROTATION) if self.binary else None

    def factory(self, n: int) -> str:
        code = self.code
        if code is None:
            return self.kind
        if code == "binary":
            return binary_factory(self.kind, self.m, self.nlist_for(n))
        if self.kind == "flat":
            return _SQ[code]
        if self.kind == "hnsw":
            return f"HNSW{self.m}" if code == "fp32" else f"HNSW{self.m}_{_SQ[code]}"
        return f"IVF{self.nlist_for(n)},{_SQ[code]}"

    def nlist_for(self, n: int) -> int:
        """About 4 sqrt(N) lists, and never so many that a list gets fewer than ~39 training points."""
        if self.nlist is not None:
            return self.nlist
        return max(1, min(int(4 * math.sqrt(n)), n // 39))

    def knobs_that_apply(self) -> set[str]:
        """The knobs this kind reads: HNSW's for an HNSW graph, IVF's for inverted lists (a factory string
        names its own M and list count, so only the search-time and build-time beams and nprobe apply)."""
        named = {"flat": set(), "hnsw": {"m", "ef_construction", "ef_search"}, "ivf": {"nlist", "nprobe", "train_size"}}
        if self.kind in named:
            return named[self.kind] | {"codes"} | ({"rotation", "rerank", "train_size"} if self.binary else set())
        return (
            ({"ef_construction", "ef_search"} if "HNSW" in self.kind else set())
            | ({"nprobe"} if "IVF" in self.kind else set())
            | {"train_size"}
        )

    def check_given(self, given: dict[str, Any]) -> None:
        """Refuse a knob given for a kind that does not read it (None: not given): it would be accepted and
        do nothing."""
        applies = self.knobs_that_apply()
        for name, value in given.items():
            if value is not None and name not in applies:
                kind = self.kind if self.kind in KINDS else f"{self.kind!r}"
                raise ConfigError(f"`{name}` does nothing for a {kind} index; drop it, or change `index_type`", name)

    def check(self) -> None:
        """Refuse knobs FAISS would abort on or silently misuse, before any work is done."""
        if not self.kind.strip():
            raise ConfigError(
                "`index_type` is empty; use flat, hnsw, ivf or a FAISS index_factory string", "index_type"
            )
        if "NSG" in self.kind:  # FAISS builds an NSG graph once, over every row: no windows, no `retrieval add`
            raise ConfigError(
                f"index type {self.kind!r}: NSG graphs cannot take rows in batches or be added to; use hnsw",
                "index_type",
            )
        self._check_codes()
        if not 2 <= self.m <= 512:
            raise ConfigError(f"`m` (HNSW neighbours per node) must be between 2 and 512 (got {self.m})", "m")
        knobs = {"ef_construction": self.ef_construction, "ef_search": self.ef_search, "nlist": self.nlist}
        knobs |= {"nprobe": self.nprobe, "train_size": self.train_size}
        for name, value in knobs.items():
            if value is not None and not 1 <= value <= MAX_KNOB:
                raise ConfigError(f"`{name}` must be between 1 and {MAX_KNOB:,} (got {value})", name)
        if self.rerank is not None and not 0 <= self.rerank <= MAX_KNOB:
            raise ConfigError(f"`rerank` must be between 0 and {MAX_KNOB:,} (got {self.rerank})", "rerank")

    def _check_codes(self) -> None:
        if self.codes is not None and self.codes not in CODES:
            raise ConfigError(f"unknown `codes` {self.codes!r}; choose one of {', '.join(CODES)}", "codes")
        if self.codes is not None and self.kind not in KINDS:
            raise ConfigError(
                f"`codes` applies to the flat, hnsw and ivf kinds; the index_factory string {self.kind!r} names its "
                "own codes: drop `codes`, or use `index_type` flat, hnsw or ivf",
                "codes",
            )
        if self.rotation is not None and self.rotation not in ROTATIONS:
            raise ConfigError(f"unknown `rotation` {self.rotation!r}; choose one of {', '.join(ROTATIONS)}", "rotation")
        if self.rotation is not None and not self.binary:
            raise ConfigError("`rotation` applies only to `codes` binary; drop it, or use binary codes", "rotation")
        if self.rerank is not None and not self.binary:
            raise ConfigError("`rerank` applies only to `codes` binary; drop it, or use binary codes", "rerank")

    def check_dim(self, dim: int) -> None:
        """Refuse codes that cannot hold ``dim``-dimensional vectors (binary codes pack 8 dimensions a byte)."""
        if self.binary and dim % 8:
            raise ConfigError(
                f"binary codes pack 8 dimensions a byte: the index's `dim` must be a multiple of 8 (got {dim})", "dim"
            )

    def bytes_per_vector(self, dim: int, scalars: int = 0) -> float | None:
        """The bytes of one vector's code in the index (graph links and list ids aside); None for factory strings.
        ``scalars``: a binary index's bytes a row beside its bits (``codes.RawDecoder``'s, where it has one)."""
        sizes = {"fp32": 4.0, "fp16": 2.0, "sq8": 1.0, "sq4": 0.5, "binary": 0.125}
        return None if self.code is None else sizes[self.code] * dim + (scalars if self.code == "binary" else 0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> IndexSpec:
        return cls(**data)


def create_index(spec: IndexSpec, dim: int, n: int) -> Any:
    """An empty index of ``spec`` over ``dim``-d vectors, sized for ``n`` rows: a FAISS inner-product index, or
    for binary codes a ``codes.BinaryIndex`` (which offers the same train / add / search / reset)."""
    import faiss

    factory = spec.factory(n)
    if spec.binary:
        spec.check_dim(dim)
        assert spec.rotation_used is not None
        binary = BinaryIndex.create(factory, dim, spec.rotation_used, spec.ef_construction)
        binary.rerank = spec.rerank_used
        return binary
    try:
        index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as err:
        raise ConfigError(
            f"FAISS cannot build index type {factory!r} at {dim} dimensions ({str(err).splitlines()[0]}); use flat, "
            "hnsw, ivf or a valid index_factory string such as HNSW32 or IVF1024,SQ8",
            "index_type",
        ) from err
    hnsw = _hnsw(index)
    if hnsw is not None:
        hnsw.efConstruction = spec.ef_construction
    coarse = _coarse_hnsw(index)
    if coarse is not None:
        # An HNSW over the centroids ("IVF65536_HNSW32,Flat") also files every added row in a list: at FAISS's
        # efSearch of 16 it filed rows in the wrong list often enough that 1M real rows at 8,000 lists never
        # reached recall@10 0.95 (0.931 with 1,024 lists probed). A search probing more lists widens it anyway.
        coarse.efConstruction, coarse.efSearch = spec.ef_construction, spec.ef_search
    refine = faiss.downcast_index(index)
    if isinstance(refine, faiss.IndexRefine):
        # FAISS's k_factor of 1 re-ranks only the base index's own top k: the order changes, the recall cannot
        refine.k_factor = REFINE_K_FACTOR
    return index


def train_size(index: faiss.Index, spec: IndexSpec, n: int) -> int:
    """How many rows to train on: 0 when the index needs no training."""
    if index.is_trained:
        return 0
    if spec.train_size is not None:
        return min(spec.train_size, n)
    ivf = _ivf(index)
    lists = ivf.nlist if ivf is not None else 256
    # k-means wants >= 39 points per centroid (FAISS warns below); more costs time linearly for little gain.
    return min(n, max(50 * lists, 10_000))


def check_buildable(spec: IndexSpec, dim: int, n: int) -> None:
    """Refuse, before any encoding, an index FAISS cannot build at this width, cannot train on ``n`` rows, or
    cannot add rows to (``IDMap`` wants ids of its own)."""
    spec.check_dim(dim)
    index = create_index(spec, dim, n)
    rows = train_size(index, spec, n)
    _check_training_rows(index, rows)
    if index.is_trained and not isinstance(index, BinaryIndex):
        try:
            index.add(np.zeros((1, dim), dtype=np.float32))  # a throwaway index: only whether FAISS accepts it
        except RuntimeError as err:
            raise ConfigError(
                f"FAISS cannot add rows to index type {spec.factory(n)!r} ({str(err).splitlines()[0]}); use flat, "
                "hnsw, ivf or another index_factory string",
                "index_type",
            ) from err


def _check_training_rows(index: faiss.Index, rows: int) -> None:
    ivf = _ivf(index)
    if ivf is not None and rows < ivf.nlist:
        raise ConfigError(
            f"IVF with {ivf.nlist} lists needs at least that many training rows (got {rows}); "
            "lower `nlist` or use `index_type` flat",
            "nlist",
        )
    pq = getattr(_core(index), "pq", None)
    if pq is not None and rows < 1 << pq.nbits:
        raise ConfigError(
            f"a product quantizer of {pq.nbits} bits needs at least {1 << pq.nbits} training rows (got {rows}); "
            "use fewer bits (such as PQ8x4), more rows, or `index_type` flat",
            "index_type",
        )


def train(index: faiss.Index, sample: np.ndarray, raw: np.ndarray | None = None, transform: Any = None) -> None:
    """Train ``index`` on ``sample`` (transformed rows); a binary index given the same rows ``raw`` and the
    ``transform`` also learns to estimate raw cosines (``codes.RawDecoder``), and then adds rows by ``add_rows``."""
    _check_training_rows(index, sample.shape[0])
    try:
        if isinstance(index, BinaryIndex):
            index.train(np.ascontiguousarray(sample, dtype=np.float32), raw, transform)
        else:
            index.train(np.ascontiguousarray(sample, dtype=np.float32))
    except RuntimeError as err:  # what FAISS refuses that the checks above do not foresee: one line, not a trace
        raise ConfigError(f"FAISS could not train the index ({str(err).splitlines()[0]})", "index_type") from err


def add_rows(index: Any, transform: Any, raw: np.ndarray) -> None:
    """Add raw rows to ``index`` through ``transform``. The rows are checked finite first (an index of NaN or inf
    vectors is never written); a binary index with a raw decoder also takes the raw rows, for its per-row
    scalars."""
    unnormalised = transform.transform(raw, normalize=False)
    vectors = l2_normalize(unnormalised)  # transform.transform(raw), with the lengths a binary index needs
    if not np.isfinite(vectors).all():
        raise ConfigError(
            "the transform gives non-finite vectors on this data; use a larger `epsilon` or a smaller `gamma`",
            "epsilon",
        )
    if isinstance(index, BinaryIndex) and index.decoder is not None:
        index.add(vectors, np.asarray(raw, dtype=np.float32), unnormalised)
    else:
        index.add(vectors)


class FaissProduct:
    """``rows @ matrix`` in float32 by the BLAS the FAISS wheel bundles, which runs on FAISS's OpenMP pool.

    numpy's OpenBLAS keeps a pool of its own, whose threads spin for a while after each threaded product: a
    query batch's transform by numpy, then FAISS's search on OpenMP threads, had the two pools fighting for the
    cores. At 1M rows, batches of 16-256 queries took 1.05-1.3x as long on HNSW and 1.2-1.6x on IVF, up to 1.7x
    without re-scoring (``scripts/bench_batches.py``, docs/benchmarks/batches.md). FAISS's BLAS is slower per
    product (a fifth to a third of numpy's rate), which costs microseconds on a query batch: use it for queries,
    not a corpus."""

    def __init__(self, matrix: np.ndarray):
        import faiss

        d_in, d_out = matrix.shape
        self.shape = (d_in, d_out)
        self._linear = faiss.LinearTransform(d_in, d_out, False)
        faiss.copy_array_to_vector(np.ascontiguousarray(matrix.T, dtype=np.float32).ravel(), self._linear.A)
        self._linear.is_trained = True

    def __call__(self, rows: np.ndarray) -> np.ndarray:
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        if rows.ndim != 2 or rows.shape[1] != self.shape[0]:
            raise ValueError(f"rows of shape {rows.shape} cannot multiply a {self.shape[0]} x {self.shape[1]} matrix")
        if rows.shape[0] == 0:  # BLAS refuses an empty product
            return np.empty((0, self.shape[1]), dtype=np.float32)
        return self._linear.apply(rows)


def set_search_params(index: faiss.Index, ef_search: int | None = None, nprobe: int | None = None) -> None:
    """Store default search-time knobs in the index (what a build saves); ignore those it does not have."""
    hnsw = _hnsw(index)
    if ef_search is not None and hnsw is not None:
        hnsw.efSearch = int(ef_search)
    ivf = _ivf(index)
    if nprobe is not None and ivf is not None:
        ivf.nprobe = int(min(nprobe, ivf.nlist))


def search_parameters(
    index: faiss.Index, ef_search: int | None = None, nprobe: int | None = None, selector: Any = None
) -> Any:
    """FAISS's per-call search parameters for these knobs and ``selector`` (a FAISS ``IDSelector``: only the rows
    it holds are searched), or None when there is nothing to set.

    Passed to ``index.search(..., params=...)``, they leave the shared index untouched, so concurrent callers
    with different knobs cannot race (setting ``efSearch``/``nprobe`` on the index itself would)."""
    import faiss

    fx: Any = faiss  # the stubs lack the SearchParameters constructors' keywords
    top = index.binary if isinstance(index, BinaryIndex) else faiss.downcast_index(index)
    if isinstance(top, faiss.IndexPreTransform):  # "RR16,IVF...", "OPQ...", "PCA...": the knobs are the inner's
        inner = search_parameters(top.index, ef_search, nprobe, selector)
        if inner is None:
            return None
        params = fx.SearchParametersPreTransform(index_params=inner)
        params.referenced = inner  # as for Refine below: keep the inner parameters alive with ``params``
        return params
    if isinstance(top, faiss.IndexRefine):
        base = search_parameters(top.base_index, ef_search, nprobe, selector)
        if base is None:
            return None
        params = fx.IndexRefineSearchParameters(k_factor=top.k_factor, base_index_params=base)
        params.referenced = base  # the C++ object points at ``base``: keep it alive as long as ``params``
        return params
    extra = {} if selector is None else {"sel": selector}
    if isinstance(top, (faiss.IndexHNSW, faiss.IndexBinaryHNSW)) and (ef_search is not None or selector is not None):
        return fx.SearchParametersHNSW(efSearch=int(top.hnsw.efSearch if ef_search is None else ef_search), **extra)
    if isinstance(top, (faiss.IndexIVF, faiss.IndexBinaryIVF)) and (nprobe is not None or selector is not None):
        return fx.SearchParametersIVF(nprobe=int(min(top.nprobe if nprobe is None else nprobe, top.nlist)), **extra)
    return fx.SearchParameters(**extra) if selector is not None else None


def default_search_params(index: faiss.Index, spec: IndexSpec) -> dict[str, int]:
    params: dict[str, int] = {}
    if _hnsw(index) is not None:
        params["ef_search"] = spec.ef_search
    ivf = _ivf(index)
    if ivf is not None:
        # at most every list: FAISS probes no more, and `info` showed nprobe 100 beside nlist=8 nprobe=8
        params["nprobe"] = min(ivf.nlist, spec.nprobe or max(1, int(round(math.sqrt(ivf.nlist)))))
    return params


def describe(index: faiss.Index) -> dict[str, Any]:
    """What ``retrieval info`` shows of a FAISS index."""
    import faiss

    core = index.binary if isinstance(index, BinaryIndex) else index
    info: dict[str, Any] = {"class": type(core).__name__, "ntotal": int(index.ntotal), "dim": int(index.d)}
    if isinstance(index, BinaryIndex):
        info |= {"rotation": index.rotation, "code_bytes": index.code_size}
        info |= {"scalar_bytes": SCALAR_BYTES} if index.decoder is not None else {}
    hnsw = _hnsw(index)
    if hnsw is not None:
        info |= {
            "M": int(hnsw.nb_neighbors(1)),
            "efConstruction": int(hnsw.efConstruction),
            "efSearch": int(hnsw.efSearch),
        }
    ivf = _ivf(index)
    if ivf is not None:
        info |= {"nlist": int(ivf.nlist), "nprobe": int(ivf.nprobe)} | list_sizes(ivf)
    if isinstance(index, BinaryIndex):
        return info
    core = _core(index)
    storage = faiss.downcast_index(core.storage) if isinstance(core, faiss.IndexHNSW) else core
    if isinstance(storage, (faiss.IndexFlat, faiss.IndexScalarQuantizer, faiss.IndexIVF)):
        info["code_bytes"] = int(storage.code_size)
    refine = faiss.downcast_index(index)
    if isinstance(refine, faiss.IndexRefine):
        info["k_factor"] = int(refine.k_factor)
    return info


def flat_vectors(index: faiss.Index) -> np.ndarray | None:
    """A zero-copy, read-only (ntotal, d) view of a flat inner-product index's vectors, or None for other kinds.

    The view keeps the index alive (a bare ``rev_swig_ptr`` would dangle once the index is freed).
    """
    import faiss

    if isinstance(index, BinaryIndex):
        return None
    flat = faiss.downcast_index(index)  # index_factory("Flat") gives IndexFlat; read_index gives IndexFlatIP
    if not isinstance(flat, faiss.IndexFlat) or flat.metric_type != faiss.METRIC_INNER_PRODUCT or not flat.ntotal:
        return None
    view = faiss.rev_swig_ptr(flat.get_xb(), flat.ntotal * flat.d).reshape(flat.ntotal, flat.d)
    vectors = np.asarray(_Owned(view, index))  # the original object owns the C++ index; the downcast does not
    vectors.flags.writeable = False  # a searcher's index is a read-only shared mapping: a write would crash
    return vectors


def one_query_twin(index: faiss.Index) -> faiss.Index | None:
    """For an IVF index of float or scalar-quantised lists (the ``ivf`` kind, ``IVF4000,SQfp16``...): a twin that
    searches one query's lists on every OpenMP thread, sharing the original's quantizer and lists (nothing
    copied); None for every other index.

    FAISS spreads an IVF search over queries (``parallel_mode`` 0), so a single query runs on one core while the
    other waits. Over its lists instead (mode 1) one query ran 1.35-1.6x faster on two cores, but batches of 16
    ran at half the speed (per-query barriers): the mode is a field of the index, not a search parameter, so a
    searcher keeps both and sends single queries to the twin, which holds the original alive."""
    import faiss

    if isinstance(index, BinaryIndex):
        return None
    ivf = faiss.downcast_index(index)
    twin: Any
    if type(ivf) is faiss.IndexIVFFlat:
        twin = faiss.IndexIVFFlat(ivf.quantizer, ivf.d, ivf.nlist, ivf.metric_type)
    elif type(ivf) is faiss.IndexIVFScalarQuantizer:
        qtype, residual = ivf.sq.qtype, ivf.by_residual
        twin = faiss.IndexIVFScalarQuantizer(ivf.quantizer, ivf.d, ivf.nlist, qtype, ivf.metric_type, residual)
        twin.sq = ivf.sq  # a copy of the trained ranges
    else:
        return None
    lists = ivf.invlists
    assert lists is not None  # a trained IVF index always has its lists
    twin.replace_invlists(lists, False)
    twin.ntotal, twin.is_trained, twin.nprobe = ivf.ntotal, True, ivf.nprobe
    twin.parallel_mode = 1
    # the quantizer and lists are the original's: it must outlive the twin. ``index`` is the proxy that owns it
    # (a downcast proxy such as ``ivf`` does not)
    twin.referenced_objects = [index]
    return twin


class _Owned:
    """Exposes ``view``'s memory to numpy while holding ``owner``: the array made from it keeps both alive."""

    def __init__(self, view: np.ndarray, owner: Any):
        self.__array_interface__ = view.__array_interface__
        self.owner = owner


def save_index(index: faiss.Index, path: Path) -> None:
    """``faiss.write_index``; a failed write (a full disk) raised as the ``OSError`` it was, not FAISS's
    ``RuntimeError``, so writers report it in one line and clean up as for any other write."""
    import faiss

    if isinstance(index, BinaryIndex):
        index.save(path)  # an OSError as it was
        return
    try:
        faiss.write_index(index, str(path))
    except RuntimeError as err:  # FAISS's message ends with strerror(errno): "... (No space left on device)"
        said = str(err)
        code = next((code for code in WRITE_ERRNOS if os.strerror(code) in said), None)
        if code is None:
            raise IndexDirError(f"FAISS could not write {path} ({said.splitlines()[0]})") from err
        raise OSError(code, os.strerror(code), str(path)) from err


def load_index(path: Path, mmap: bool = False) -> Any:
    """Read a saved index. ``mmap``: flat storage (a flat index's vectors, HNSW's) is mapped from the file rather
    than read into memory (FAISS's IO_FLAG_MMAP_IFC): loading costs nothing whatever the size, pages come in as
    searches touch them, and processes share them through the page cache. Such an index is read-only: adding to
    it aborts the process (FAISS cannot grow a mapped array), so only searchers map."""
    import faiss

    flags = getattr(faiss, "IO_FLAG_MMAP_IFC", 0) if mmap else 0  # FAISS >= 1.11; older ones read it all
    if is_binary_file(path):  # binary codes: read whole (they are what RAM is meant to hold)
        return BinaryIndex.load(path)
    try:
        return faiss.read_index(str(path), flags)
    except RuntimeError as err:
        raise IndexDirError(f"cannot read FAISS index {path}: it is corrupt; rebuild with --overwrite") from err


def load_for_adding(path: Path, rows: int) -> Any:
    """Read a saved index that ``rows`` more rows will be added to, holding its vectors once.

    A flat index read whole and then appended to holds its vectors twice for a moment: FAISS grows the array by
    copying it, so ``add`` would peak at about twice the index. Here a flat index's vectors go from the file,
    a chunk at a time, into an array that already has room for the new rows (a vector's capacity survives
    shrinking it), so later ``add`` calls never move it. The file is read, not mapped: its pages stay in the
    page cache, not in this process. A flat index's vectors are the last bytes of its file (FAISS's layout);
    the first and last rows are checked against the mapped index, and any other kind is read whole (IVF
    appends list by list, so no whole copy; HNSW's storage would need its graph copied out of the mapping too).
    """
    import faiss

    mapped = load_index(path, mmap=True)
    if isinstance(mapped, BinaryIndex):
        return mapped
    flat: Any = faiss.downcast_index(mapped)
    if type(flat) not in (faiss.IndexFlat, faiss.IndexFlatIP, faiss.IndexFlatL2) or not flat.ntotal:
        return load_index(path)
    n, d = flat.ntotal, flat.d
    grown = faiss.IndexFlat(d, flat.metric_type)
    grown.codes.resize((n + rows) * flat.code_size)  # allocated once, for every row it will hold
    grown.codes.resize(0)
    chunk = np.empty((max(1, ADD_CHUNK_BYTES // flat.code_size), d), dtype=np.float32)
    with open(path, "rb") as f:
        f.seek(path.stat().st_size - n * flat.code_size)
        for start in range(0, n, len(chunk)):
            block = chunk[: min(len(chunk), n - start)]
            if f.readinto(block.data.cast("B")) != block.nbytes:
                raise IndexDirError(f"cannot read FAISS index {path}: it is truncated; rebuild with --overwrite")
            for row in {0, n - 1} & {start, start + len(block) - 1}:
                if not np.array_equal(block[row - start], flat.reconstruct(row)):
                    log.warning("%s: vectors not where FAISS keeps them; reading the index whole", path)
                    return load_index(path)
            grown.add(block)
    return grown


def serialize(index: Any) -> np.ndarray:
    """An index as bytes (uint8), for another process: FAISS's serialisation, or a binary index's file."""
    import faiss

    if isinstance(index, BinaryIndex):
        return np.frombuffer(index.to_bytes(), dtype=np.uint8)
    return faiss.serialize_index(index)


def deserialize(data: np.ndarray) -> Any:
    """The index ``serialize`` gave: an owned copy."""
    import faiss

    if bytes(data[: len(MAGIC)]) == MAGIC:
        return BinaryIndex.from_bytes(np.asarray(data).tobytes())
    return faiss.deserialize_index(data)


def mergeable(index: Any) -> bool:
    """Whether shards of this index, filled apart, can be merged (``merge``): IVF lists, float or binary."""
    import faiss

    if isinstance(index, BinaryIndex):
        return isinstance(index.binary, faiss.IndexBinaryIVF)
    return isinstance(faiss.downcast_index(index), faiss.IndexIVF)


def merge(into: Any, shard: Any) -> None:
    """Append ``shard``'s rows to ``into`` (both IVF copies of one trained index), numbered after its own."""
    if isinstance(into, BinaryIndex):
        into.merge_from(shard)
    else:
        into.merge_from(shard, into.ntotal)


def list_sizes(ivf: Any) -> dict[str, Any]:
    """How an IVF index's rows fill its lists: empty lists and the largest (``remove`` empties lists the index
    keeps; ``refit`` trains lists for the rows left), and FAISS's imbalance factor (1: even)."""
    sizes = [int(ivf.invlists.list_size(i)) for i in range(ivf.nlist)]
    imbalance = float(ivf.invlists.imbalance_factor()) if ivf.ntotal else 0.0
    return {"empty_lists": sizes.count(0), "largest_list": max(sizes), "imbalance": round(imbalance, 3)}


def list_count(index: faiss.Index) -> int | None:
    """An IVF index's number of lists (None for any other kind)."""
    ivf = _ivf(index)
    return None if ivf is None else int(ivf.nlist)


def _core(index: faiss.Index) -> Any:
    """The index that holds the codes and the knobs, under any pre-transform (RR, OPQ, PCA) and Refine."""
    import faiss

    if isinstance(index, BinaryIndex):
        return index.binary
    index = faiss.downcast_index(index)
    while isinstance(index, (faiss.IndexPreTransform, faiss.IndexRefine)):
        inner = index.index if isinstance(index, faiss.IndexPreTransform) else index.base_index
        index = faiss.downcast_index(inner)
    return index


def _hnsw(index: faiss.Index) -> Any:
    core = _core(index)
    return core.hnsw if hasattr(core, "hnsw") else None


def _coarse_hnsw(index: faiss.Index) -> Any:
    """The HNSW graph of an IVF index's coarse quantizer, if it has one."""
    import faiss

    ivf = _ivf(index)
    if ivf is None or isinstance(index, BinaryIndex):
        return None
    quantizer = faiss.downcast_index(ivf.quantizer)
    return quantizer.hnsw if isinstance(quantizer, faiss.IndexHNSW) else None


def _ivf(index: faiss.Index) -> Any:
    import faiss

    if isinstance(index, BinaryIndex):
        return index.binary if isinstance(index.binary, faiss.IndexBinaryIVF) else None
    try:
        return faiss.extract_index_ivf(index)
    except RuntimeError:
        return None


# FAISS factory parts that keep less than the vectors they are given: a PCA, product or 4-8-bit scalar quantisers,
# binary codes. Measured (QA, random 48-d vectors, raw transform): "PCA8,HNSW16" recall@10 0.31 against exact
# cosine, 0.95 re-scoring 50 candidates from the stash. 16-bit scalar codes (the `ivf` kind) lose next to nothing.
# Product, residual and additive quantisers (PQ, OPQ, RQ, PRQ, LSQ, PLSQ) are all lossy.
LOSSY = re.compile(r"PCA|PQ|RQ|LSQ|SQ[468](?![0-9])|LSH|RaBitQ")
EXACT_REFINE = re.compile(r"RFlat|Refine\((Flat|SQfp16|SQbf16)\)")  # RFlat: FAISS's short Refine(Flat)


def trained_on_rows(factory: str) -> bool:
    """Whether an index from this factory string has parts trained on its rows (IVF lists, quantiser codes),
    which ``add`` and ``remove`` keep and ``refit`` trains again."""
    return "IVF" in factory or bool(LOSSY.search(factory))


def lossy_codes(factory: str) -> bool:
    """Whether an index built from this factory string ranks by approximate scores the stash could correct:
    lossy codes with no exact (or 16-bit) ``Refine`` after them, or a PCA (a refine works in the reduced
    space)."""
    return "PCA" in factory or (bool(LOSSY.search(factory)) and not EXACT_REFINE.search(factory))
