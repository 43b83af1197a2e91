"""Searching an index directory: the same encoder and the same stored transform as the build, then FAISS.

A ``Searcher`` holds one whole version of an index (``indexdir.load``) and is safe to share between threads:
search knobs go to FAISS per call (never set on the shared index), the encoder locks only its tokenizer (and
its first-call decisions) while forward passes run side by side, and the docs and the stash are read-only
memory maps.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.codes import best_k, search_extras
from retrieval.encode.spec import Encoder
from retrieval.encode.transformer import from_info
from retrieval.errors import ConfigError, IndexDirError
from retrieval.files import available_memory, touch_pages
from retrieval.filtered import Kept, Rule, search_filtered, wider_knobs
from retrieval.filters import Filter, evaluate
from retrieval.fusion import MODES, FusionSpec, check_mode, fuse
from retrieval.index import FaissProduct, flat_vectors, list_count, one_query_twin, search_parameters
from retrieval.indexdir import Loaded, Verify, load
from retrieval.options import option
from retrieval.scan import FlatScan
from retrieval.stash import VectorStash
from retrieval.text import blank, valid_unicode
from retrieval.whitening import RawTransform, Whitening, l2_normalize

log = logging.getLogger(__name__)

MAX_K = 10_000  # hits per query: past this a caller wants an export, not a search
KEPT_FILTERS = 16  # filters whose rows a searcher keeps evaluated (with their bitmaps and gathered vectors)
KEPT_BYTES = 512 << 20  # what those filters hold together, at most (a 1M-row index's 20,000-row filter: 31 MiB)
STASH_READS = ("map", "pread")
PREFAULT_SHARE = 0.25  # warm-up makes docs and stash resident only when they take at most this share of free memory


@dataclass(frozen=True)
class SearchParams:
    """What one search asks for. ``rescore``: re-rank this many candidates of the (reduced) index (at least
    ``k``) at full dimension, from the raw vectors kept in the stash; 0: off; None: the index's default, which is
    ``RESCORE_DEPTH`` when the index kept its stash and is reduced (k < d, or lossy FAISS codes), else off
    (``Manifest.rescoring``).
    ``ef_search`` / ``nprobe``: HNSW / IVF knobs for this call (None: the index's defaults). ``rerank``: binary
    codes' Hamming candidates re-ranked from their codes before any re-scoring (None: the index's ``rerank``).
    ``mode``: dense, lexical or hybrid (None: hybrid where the index has a lexical part, else dense); ``fusion``:
    how hybrid fuses (None: the index's recorded choice); ``where``: a metadata filter (``retrieval.filters``),
    applied inside the search."""

    k: int = 10
    rescore: int | None = None
    ef_search: int | None = None
    nprobe: int | None = None
    mode: str | None = option(
        None, f"{', '.join(MODES)}.", default_help="hybrid where the index has a lexical part, else dense"
    )
    rerank: int | None = option(
        None,
        "Binary codes: re-rank this many Hamming candidates by the query's floats against the codes' bits "
        "(whitened codes: blended with the estimated raw cosine), before any re-scoring; 0: Hamming only.",
        default_help="the index's",
    )
    fusion: FusionSpec | None = None  # the command line's --fusion and --fusion-weight: FusionSpec's fields
    where: Filter | None = option(
        None,
        "Keep only rows matching this filter over the index's --columns, e.g. \"year >= 2020 and source = "
        "'pubmed'\" (=, !=, <, <=, >, >=, in (...), not in (...), is null, is not null; and, or, not, parentheses).",
        cli_type=str | None,
    )

    def check(self) -> None:
        if self.mode is not None:
            check_mode(self.mode)
        if self.fusion is not None:
            self.fusion.check()
        for name, value, low in (("k", self.k, 1), ("rescore", self.rescore, 0), ("rerank", self.rerank, 0)):
            if name != "k" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_K:
                raise ConfigError(f"`{name}` must be an integer between {low} and {MAX_K:,} (got {value!r})", name)
        for name, knob in (("ef_search", self.ef_search), ("nprobe", self.nprobe)):
            if knob is not None and (isinstance(knob, bool) or not isinstance(knob, int) or not 1 <= knob <= 1 << 20):
                raise ConfigError(f"`{name}` must be an integer between 1 and {1 << 20:,} (got {knob!r})", name)


def check_queries(queries: Sequence[str]) -> None:
    """Refuse what cannot be a query: not a string, or nothing but whitespace (which would still "match")."""
    for i, query in enumerate(queries):
        if not isinstance(query, str):
            raise ConfigError(f"`query` {i} is {type(query).__name__}, not text", "query")
        if not valid_unicode(query):
            raise ConfigError(f"`query` {i} holds a lone surrogate (an undecodable byte?): give UTF-8 text", "query")
        if blank(query):
            raise ConfigError(
                "`query` is empty (only whitespace or invisible characters): give some text to search for", "query"
            )


def _faiss_product(transform: Whitening | RawTransform | None) -> FaissProduct | None:
    return FaissProduct(transform.kernel) if isinstance(transform, Whitening) else None


@dataclass(frozen=True)
class Hit:
    """One ranked result. ``row`` is the document's position in the index. ``title``: the corpus's title column
    (which ``text`` begins with), when the index was built with one; else None."""

    rank: int
    id: str
    score: float
    text: str
    row: int
    title: str | None = None


class Searcher:
    """A loaded index directory. ``Searcher.load(dir).search("query", SearchParams(k=5))`` -> list of Hit."""

    def __init__(self, loaded: Loaded, encoder: Encoder | None, stash_reads: str = "map"):
        if stash_reads not in STASH_READS:
            raise ConfigError(f"`stash_reads` must be one of {', '.join(STASH_READS)} (got {stash_reads!r})")
        self.stash_reads = stash_reads  # how re-scoring reads the stash's rows (``VectorStash.read_rows``)
        self.loaded = loaded
        self.directory = loaded.directory.path
        self.manifest = loaded.manifest
        self.transform = loaded.transform
        self.index = loaded.index
        self.docs = loaded.docs
        self.encoder = encoder
        flat = flat_vectors(self.index)
        self._scan = FlatScan(flat) if flat is not None else None
        self._one_query = one_query_twin(self.index)  # an IVF index's twin for single queries, on every core
        self._stash_lock = threading.Lock()
        self._kept: dict[Filter, Kept] = {}  # the last few filters' rows, evaluated once each
        self._kept_lock = threading.Lock()
        self.filter_rule: Rule | None = None  # which path a filtered search takes (None: ``filtered.RULES``)
        self._described: dict[str, Any] | None = None  # `describe()`, read and computed once
        # Queries searched by FAISS (HNSW, IVF...) are multiplied by FAISS's BLAS, on the pool it then searches
        # with (``index.FaissProduct``); a flat scan's own products are numpy's, and so are its queries'.
        self._query_product = _faiss_product(self.transform) if self._scan is None else None
        self._rescore_product = _faiss_product(loaded.rescorer) if self._scan is None else None

    @classmethod
    def load(
        cls,
        directory: Path | str,
        encoder: Encoder | None = None,
        verify: Verify | bool = "full",
        batch_size: int = 32,
        stash_reads: str = "map",
    ) -> Searcher:
        """Open one whole version of an index directory, check its files, and prepare its encoder.

        ``verify``: "full" checks every file's sha256, "quick" sizes and sampled hashes (what a one-shot CLI
        search does), "none" nothing. Pass ``encoder`` to reuse one already loaded (it must match the index's
        model, pooling and max length); leave it None to load the one the manifest names. Indexes of
        precomputed vectors need no encoder. ``stash_reads``: "map" reads re-scored rows through memory maps (the
        pages stay resident: fastest once warm), "pread" by ``os.pread`` (the process holds only what it
        allocates: a large stash stays in the page cache, not in this process's resident set).
        """
        level: Verify = ("full" if verify else "none") if isinstance(verify, bool) else verify
        loaded = load(directory, level)
        info = loaded.manifest.encoder
        if encoder is not None:
            info.check_query(encoder.info())
        elif info.kind == "transformers":
            encoder = from_info(info, batch_size=batch_size)
        return cls(loaded, encoder, stash_reads)

    def warm_up(self, prefault: bool = True) -> int:
        """Settle all lazy state now rather than on a user's first request: the encoder's precision and
        single-query trace, the flat batch path, the stash's memory maps; then run one search.

        ``prefault``: also make the pages of the files that requests read a few rows of at a time (the stash when
        this index re-scores, the docs) resident now, when they take at most ``PREFAULT_SHARE`` of the memory
        available: a server then starts at the memory it will keep, and no early request waits on page faults.
        A stash read by pread is not made resident in this process (that is what pread is for): the kernel is
        asked to bring it into the page cache instead, so that early re-scoring reads do not wait on the disk.
        Returns the bytes made resident in this process."""
        warm = getattr(self.encoder, "warm_up", None)
        if warm is not None:
            warm()
        if self._scan is not None:
            probe = l2_normalize(np.random.default_rng(0).normal(size=(64, self.transform.dim_out)))
            self._scan.search(probe, 10)
        parts = []
        if self.manifest.stash is not None:  # the memory maps (opened at load when this index re-scores)
            parts = list(self.stash().iter_parts(self.manifest.transform.pooling))
        rescored = parts if self.manifest.rescoring.depth > 0 and self.stash_reads == "map" else []
        touched = 0
        if prefault:
            size = self.docs.nbytes + sum(part.nbytes for part in rescored)
            available = available_memory()
            if available is not None and size <= PREFAULT_SHARE * available:
                touched = self.docs.prefault() + sum(touch_pages(part) for part in rescored)
                log.info("%s: %d MiB of docs and stash made resident", self.directory, touched >> 20)
            else:
                log.info("%s: %d MiB of docs and stash left to load on demand", self.directory, size >> 20)
            if parts and not rescored and self.manifest.rescoring.depth > 0:  # read by pread
                cached = sum(part.nbytes for part in parts)
                if available is not None and cached <= PREFAULT_SHARE * available:
                    self.stash().cache(self.manifest.transform.pooling)
                    log.info("%s: %d MiB of stash asked into the page cache", self.directory, cached >> 20)
        if self.encoder is not None:
            self.search("warm-up query")
        return touched

    # ----- the query side ---------------------------------------------------------------------------------
    def encode(self, queries: Sequence[str]) -> np.ndarray:
        """Raw encoder vectors for the queries, by the index's own encoder."""
        if self.encoder is None:
            raise ConfigError(
                "this index was built from precomputed vectors: it has no encoder for text queries; search it with "
                "query vectors (Searcher.search_vectors in Python)"
            )
        return self.encoder.encode(list(queries))

    def project(self, raw: np.ndarray, dims: int | None = None) -> np.ndarray:
        """Raw encoder vectors in the index's space (the kernel, then L2-normalised), keeping only its first
        ``dims`` directions, the ones of largest variance (all of them by default): a principled shorter
        embedding for any encoder. An index of raw vectors has no directions to drop: only its full width."""
        transform = self.transform
        if dims is not None and dims != transform.dim_out:
            if not isinstance(transform, Whitening):
                raise ConfigError(
                    f"`dimensions` must be {transform.dim_out}: this index keeps raw vectors, with no whitening "
                    "kernel to shorten (build it with `dim` to get shorter embeddings)",
                    "dimensions",
                )
            transform = transform.truncated(dims)
        return transform.transform(raw)

    def token_counts(self, texts: Sequence[str]) -> list[int]:
        """Tokens the encoder reads of each text (after truncation), special tokens included; an encoder without
        a tokenizer (a test's, precomputed vectors) counts whitespace-separated words."""
        count = getattr(self.encoder, "count_tokens", None)
        return list(count(texts)) if count is not None else [len(text.split()) for text in texts]

    def search(self, query: str, params: SearchParams = SearchParams()) -> list[Hit]:
        return self.search_batch([query], params)[0]

    def search_batch(self, queries: Sequence[str], params: SearchParams = SearchParams()) -> list[list[Hit]]:
        params.check()
        check_queries(queries)
        raw = self.encode(queries) if self.mode(params) != "lexical" else None
        return self.hits(*self.search_raw(raw, params, texts=queries))

    def mode(self, params: SearchParams) -> str:
        """The mode a search with ``params`` runs in: its own, else hybrid where this index has a lexical part."""
        if params.mode is None:
            return "hybrid" if self.loaded.lexical is not None else "dense"
        check_mode(params.mode)
        if params.mode != "dense" and self.loaded.lexical is None:
            raise ConfigError(
                f"{self.directory} has no lexical index: search it with `mode` dense, or rebuild it with `lexical`",
                "mode",
            )
        return params.mode

    def mask(self, where: Filter | None) -> np.ndarray | None:
        """The rows ``where`` keeps (None: every row), evaluated over the index's kept columns."""
        return None if where is None else self.kept(where).mask

    def kept(self, where: Filter) -> Kept:
        """The rows ``where`` keeps and what searches with it reuse (``filtered.Kept``), evaluated once for each of
        the last ``KEPT_FILTERS`` filters used, which together hold at most ``KEPT_BYTES`` (the least recently
        used dropped first; the filter in use is always kept)."""
        with self._kept_lock:
            kept = self._kept.pop(where, None)
            if kept is not None:
                self._kept[where] = kept  # most recently used last
        if kept is None:
            kept = Kept(evaluate(where, self.loaded.columns))
        with self._kept_lock:
            self._kept[where] = self._kept.pop(where, kept)  # a filter two threads evaluated at once: one is kept
            kept = self._kept[where]
            held = sum(other.nbytes for other in self._kept.values())
            while len(self._kept) > 1 and (len(self._kept) > KEPT_FILTERS or held > KEPT_BYTES):
                held -= self._kept.pop(next(iter(self._kept))).nbytes
        return kept

    def search_vectors(self, raw: np.ndarray, params: SearchParams = SearchParams()) -> list[list[Hit]]:
        """Search with raw encoder-space vectors (they get the index's transform)."""
        return self.hits(*self.search_raw(raw, params))

    def search_raw(
        self, raw: np.ndarray | None, params: SearchParams = SearchParams(), texts: Sequence[str] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(scores, rows) for raw encoder-space query vectors (and their ``texts``, which lexical and hybrid
        searches need; a lexical one needs no vectors), ``min(k, N)`` columns wide; rows are -1 where fewer were
        found (an approximate index even with its knobs widened, a filter keeping fewer rows, a lexical search
        with fewer documents sharing a term). Without ``texts``, the default mode is dense."""
        params.check()
        mode = "dense" if params.mode is None and texts is None else self.mode(params)  # vectors alone: dense
        if mode != "dense" and texts is None:
            raise ConfigError(f"a `mode` {mode} search needs the query texts, not only their vectors", "mode")
        kept = None if params.where is None else self.kept(params.where)
        mask = None if kept is None else kept.mask
        k = min(params.k, self.index.ntotal)
        lexical = self.loaded.lexical
        if mode == "lexical":
            assert lexical is not None and texts is not None
            return lexical.search(texts, k, mask)
        assert raw is not None
        if mode == "dense":
            return self._dense(raw, params, kept)
        assert lexical is not None and texts is not None
        fusion = params.fusion or self.manifest.fusing
        depth = max(params.k, fusion.depth)
        dense = self._dense(raw, replace(params, k=depth), kept)
        return fuse(dense, lexical.search(texts, depth, mask), fusion, k)

    def _dense(self, raw: np.ndarray, params: SearchParams, kept: Kept | None) -> tuple[np.ndarray, np.ndarray]:
        raw = np.atleast_2d(np.asarray(raw, dtype=np.float32))
        if raw.shape[1] != self.transform.dim_in:
            raise ConfigError(f"query vectors have {raw.shape[1]} dims; this index takes {self.transform.dim_in}")
        if not np.isfinite(raw).all():
            raise ConfigError("query vectors contain NaN or inf")
        rescore = self.rescore_depth(params)
        if rescore and self.manifest.stash is None:  # checked against the version that serves this very call
            raise ConfigError(
                f"{self.directory} kept no raw-vector stash, so it cannot re-score: search with `rescore` 0, "
                "or rebuild it keeping its vectors (the default)",
                "rescore",
            )
        depth = max(params.k, rescore)
        # one query: numpy's product, measured 3% faster than FAISS's at batch 1, where no pools fight
        vectors = self.transform.transform(raw, product=self._query_product if len(raw) > 1 else None)
        if kept is None:
            scores, rows = self.search_transformed(
                vectors, depth, params.ef_search, params.nprobe, params.rerank, raw=raw
            )
        else:
            scores, rows = self._search_filtered(vectors, depth, params, kept, raw)
        if rescore:
            scores, rows = self._rescore(raw, rows, params.k)
        return scores[:, : params.k], rows[:, : params.k]

    def rescore_depth(self, params: SearchParams) -> int:
        """How many candidates a search with ``params`` re-scores: its own ``rescore``, else the index's default."""
        return self.manifest.rescoring.depth if params.rescore is None else params.rescore

    def search_transformed(
        self,
        vectors: np.ndarray,
        k: int = 10,
        ef_search: int | None = None,
        nprobe: int | None = None,
        rerank: int | None = None,
        raw: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(scores, rows) for query vectors already in the index's space. Knobs left unset take the index's
        defaults; they apply to this call only (FAISS search parameters; a binary index's ``rerank``), so
        concurrent callers never race. ``raw``: the queries' raw vectors, by which a binary index re-ranks its
        Hamming candidates when it can (``codes.RawDecoder``)."""
        k = min(k, self.index.ntotal)
        if self._scan is not None:
            return self._scan.search(vectors, k)
        defaults = self.manifest.index.search
        index = self._one_query if self._one_query is not None and len(vectors) == 1 else self.index
        ef_search = defaults.get("ef_search") if ef_search is None else ef_search
        nprobe = defaults.get("nprobe") if nprobe is None else nprobe
        if k == self.index.ntotal:  # every document asked for: an approximate search reached 126-443 of 450
            ef_search = None if ef_search is None else max(ef_search, k)  # a beam that holds them all
            # every list: a build has at least one row per list, but `remove` can leave fewer rows than lists
            nprobe = None if nprobe is None else max(nprobe, k, list_count(index) or 0)
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        searched: Any = index  # a FAISS index, or a binary one that also takes this call's ``rerank``
        every = search_extras(index, raw, rerank)  # the short queries' rows of it on each retry
        extra = dict(every)
        params = search_parameters(index, ef_search=ef_search, nprobe=nprobe)
        scores, rows = searched.search(vectors, k, params=params, **extra)
        # Fewer than k found (the probed lists held fewer rows, the beam reached fewer): those queries again, with
        # the knob doubled until they fill or it spans the index; a user asking for k of N >= k documents gets k.
        short = np.flatnonzero((rows < 0).any(axis=1))
        while len(short) and (wider := wider_knobs(index, ef_search, nprobe)) is not None:
            ef_search, nprobe = wider
            params = search_parameters(index, ef_search=ef_search, nprobe=nprobe)
            if "raw" in every:
                extra["raw"] = every["raw"][short]
            scores[short], rows[short] = searched.search(vectors[short], k, params=params, **extra)
            short = short[(rows[short] < 0).any(axis=1)]
        return scores, rows

    def _search_filtered(
        self, vectors: np.ndarray, k: int, params: SearchParams, kept: Kept, raw: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``search_transformed`` over only the rows ``kept`` holds (``filtered.search_filtered``)."""
        defaults = self.manifest.index.search
        ef_search = defaults.get("ef_search") if params.ef_search is None else params.ef_search
        nprobe = defaults.get("nprobe") if params.nprobe is None else params.nprobe
        vectors_of = None
        if self.manifest.stash is not None:
            stash, pooling = self.stash(), self.manifest.transform.pooling

            def vectors_of(rows: np.ndarray) -> np.ndarray:
                return self.transform.transform(stash.read_rows(rows, pooling))

        k = min(k, self.index.ntotal)
        flat = self._scan.matrix if self._scan is not None else None
        index = self._one_query if self._one_query is not None and len(vectors) == 1 else self.index
        return search_filtered(index, vectors, k, kept, ef_search, nprobe, vectors_of, flat, self.filter_rule, raw)

    def stash(self) -> VectorStash:
        """This version's raw-vector stash, its parts memory-mapped (``Loaded.open_stash``)."""
        if self.manifest.stash is None:
            raise IndexDirError(f"{self.directory} kept no raw-vector stash; rebuild it keeping its vectors")
        with self._stash_lock:
            return self.loaded.open_stash()

    def _rescore(self, raw: np.ndarray, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        scorer = self.loaded.rescorer or RawTransform(self.transform.dim_in)
        pooling = self.manifest.transform.pooling
        pread = self.stash_reads == "pread"
        return rescore(self.stash(), scorer, raw, rows, k, pooling, product=self._rescore_product, pread=pread)

    def hits(self, scores: np.ndarray, rows: np.ndarray) -> list[list[Hit]]:
        out = []
        for score_row, row_ids in zip(scores, rows, strict=True):
            keep = [int(r) for r in row_ids if r >= 0]
            out.append(
                [
                    Hit(rank=i + 1, id=d, score=float(s), text=t, row=r, title=h)
                    for i, (r, s, (d, t, h)) in enumerate(zip(keep, score_row, self.docs.records(keep), strict=False))
                ]
            )
        return out

    def describe(self) -> dict[str, Any]:
        """What ``retrieval info`` shows of the loaded version, for the service's /info: ``{"summary",
        "spectrum", "drift"}`` (no drift once the directory has been replaced: its moments are another version's)."""
        from retrieval.info import describe

        if self._described is None:
            report = describe(self.manifest, self.transform, self.loaded.moments)
            if report["drift"] or not isinstance(self.transform, Whitening):  # kept once complete
                self._described = report
            return report
        return self._described


def rescore(
    stash: VectorStash,
    scorer: Whitening | RawTransform,
    raw: np.ndarray,
    rows: np.ndarray,
    k: int,
    pooling: str | None = None,
    product: FaissProduct | None = None,
    pread: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Re-rank each query's candidate ``rows`` by ``scorer`` (the full-dimension scorer: raw cosine unless the
    index records a full-rank transform) of their stashed vectors; (scores, rows) of the best ``k``. Every
    query's candidates are read in one pass over the stash (``pread``: by ``os.pread``, not its maps); a query's
    -1 rows (fewer candidates than asked) score -inf and stay last."""
    queries = scorer.transform(raw, product=product)
    found = rows >= 0
    if found.all():  # every query's candidates all found (the rule): one product per query, no masks
        vectors = scorer.transform(stash.read_rows(rows.ravel(), pooling, pread=pread), product=product)
        scores = np.matmul(vectors.reshape(*rows.shape, -1), queries[:, :, None])[:, :, 0]
    else:
        scores = np.full(rows.shape, -np.inf, dtype=np.float32)
        vectors = scorer.transform(stash.read_rows(rows[found], pooling, pread=pread), product=product)
        scores[found] = np.einsum("ij,ij->i", vectors, np.repeat(queries, found.sum(axis=1), axis=0))
    return best_k(scores, rows, k)
