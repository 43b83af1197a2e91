"""The lexical side of an index: BM25 over stemmed terms (bm25s + PyStemmer), built from per-window term counts.

Pass 1 hands each window's texts to ``TermCounts.of`` (its own small vocabulary, each document's term counts and
length); ``TermStats`` merges windows in row order by term string, exactly (integers only), on whichever process
gathers them. The BM25 matrix is computed once, at the end, from the merged counts (``bm25_matrix``: bm25s's
Lucene variant, checked against ``bm25s.BM25.index`` on the same texts), and served by bm25s (``LexicalIndex``).
The per-document counts are kept beside it, so ``add`` and ``remove`` re-derive the matrix without re-reading a
single text, and ``refit`` (which changes only the dense side) keeps it as it is.

    lexical/  data/indices/indptr.csc.index.npy, vocab.index.json, params.index.json   bm25s's own files
              counts.indptr.npy, counts.terms.npy, counts.values.npy                   per-document term counts
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.errors import ConfigError, IndexDirError

log = logging.getLogger(__name__)

TOKEN_PATTERN = r"(?u)\b\w\w+\b"  # bm25s's default: words of two or more letters or digits
COUNT_FILES = ("counts.indptr.npy", "counts.terms.npy", "counts.values.npy")
BM25_FILES = ("data.csc.index.npy", "indices.csc.index.npy", "indptr.csc.index.npy", "vocab.index.json")
BM25_PARAMS = "params.index.json"
FILES = (*BM25_FILES, BM25_PARAMS, *COUNT_FILES)


@dataclass(frozen=True)
class LexicalSpec:
    """How texts become terms and terms become scores: what the manifest records, and the query side reuses.

    ``stopwords``: bm25s's list by language ("en") or "none"; ``stemmer``: a PyStemmer (Snowball) language, or
    "none". ``k1``, ``b``: BM25's term-frequency saturation and length normalisation (bm25s's defaults)."""

    stopwords: str = "en"
    stemmer: str = "english"
    k1: float = 1.5
    b: float = 0.75
    method: str = "lucene"
    token_pattern: str = TOKEN_PATTERN
    lowercase: bool = True

    def check(self) -> None:
        if not 0 < self.k1 <= 10:
            raise ConfigError(f"`k1` must be in (0, 10] (got {self.k1})", "k1")
        if not 0 <= self.b <= 1:
            raise ConfigError(f"`b` must be between 0 and 1 (got {self.b})", "b")
        if self.method != "lucene":
            raise ConfigError(f"`method` {self.method!r}: only BM25's lucene variant is built", "method")
        if self.stemmer != "none":
            import Stemmer

            if self.stemmer not in Stemmer.algorithms():
                raise ConfigError(
                    f"unknown `stemmer` {self.stemmer!r}; choose none or one of {', '.join(Stemmer.algorithms())}",
                    "stemmer",
                )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LexicalSpec:
        return cls(**data)


class Analyzer:
    """Texts -> terms, as bm25s tokenizes (lower case, the token pattern, stop words) then PyStemmer stems.

    A PyStemmer object is not safe to share between threads: queries from several threads take a lock."""

    def __init__(self, spec: LexicalSpec):
        self.spec = spec
        self._stemmer = None
        if spec.stemmer != "none":
            import Stemmer

            self._stemmer = Stemmer.Stemmer(spec.stemmer)
        self._stopwords: str | list[str] = [] if spec.stopwords == "none" else spec.stopwords
        self._lock = threading.Lock()

    def tokenize(self, texts: Sequence[str]) -> tuple[list[list[int]], dict[str, int]]:
        """Each text's term ids in a vocabulary of these texts alone, and that vocabulary (term -> id)."""
        import bm25s

        with self._lock:
            tokenized = bm25s.tokenize(
                list(texts),
                lower=self.spec.lowercase,
                token_pattern=self.spec.token_pattern,
                stopwords=self._stopwords,
                stemmer=self._stemmer,
                return_ids=True,
                show_progress=False,
            )
        return tokenized.ids, tokenized.vocab

    def terms(self, text: str) -> list[str]:
        """One text's terms, in order, repeats kept (a query's)."""
        ids, vocab = self.tokenize([text])
        names = {i: term for term, i in vocab.items()}
        return [names[i] for i in ids[0]]


# ----- per-window statistics, merged exactly ------------------------------------------------------------
@dataclass(frozen=True)
class TermCounts:
    """Term counts of consecutive documents: CSR by document over ``terms`` (``indptr``: len docs + 1)."""

    terms: list[str]
    indptr: np.ndarray  # int64
    term_ids: np.ndarray  # int32, ascending within each document
    counts: np.ndarray  # int32

    @property
    def docs(self) -> int:
        return len(self.indptr) - 1

    @classmethod
    def of(cls, texts: Sequence[str], analyzer: Analyzer) -> TermCounts:
        ids, vocab = analyzer.tokenize(texts)
        indptr = [0]
        keys: list[np.ndarray] = []
        counts: list[np.ndarray] = []
        for doc in ids:
            unique, count = np.unique(np.asarray(doc, dtype=np.int64), return_counts=True)
            keys.append(unique)
            counts.append(count)
            indptr.append(indptr[-1] + len(unique))
        names = [""] * len(vocab)
        for term, i in vocab.items():
            names[i] = term
        return cls(
            names,
            np.asarray(indptr, dtype=np.int64),
            np.concatenate(keys).astype(np.int32) if keys else np.zeros(0, np.int32),
            np.concatenate(counts).astype(np.int32) if counts else np.zeros(0, np.int32),
        )


def doc_lengths(indptr: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Each document's length in terms (stop words left out), as BM25 normalises by it: the sum of its counts."""
    total = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    return total[indptr[1:]] - total[indptr[:-1]]


@dataclass
class TermStats:
    """Term counts of every document so far, in row order, over one growing vocabulary: windows merged by term
    string (new terms take the next ids, sorted, so the result does not depend on hash order)."""

    terms: list[str] = field(default_factory=list)
    _ids: dict[str, int] = field(default_factory=dict)
    _indptr: list[np.ndarray] = field(default_factory=list)
    _term_ids: list[np.ndarray] = field(default_factory=list)
    _counts: list[np.ndarray] = field(default_factory=list)
    docs: int = 0
    _postings: int = 0

    def add(self, window: TermCounts) -> None:
        for term in sorted(set(window.terms) - self._ids.keys()):
            self._ids[term] = len(self.terms)
            self.terms.append(term)
        remap = np.asarray([self._ids[term] for term in window.terms], dtype=np.int32)
        term_ids = remap[window.term_ids] if len(window.term_ids) else window.term_ids
        self._indptr.append(window.indptr[1:] + self._postings)
        self._term_ids.append(term_ids)
        self._counts.append(window.counts)
        self.docs += window.docs
        self._postings += len(window.term_ids)

    def add_texts(self, texts: Sequence[str], analyzer: Analyzer) -> None:
        self.add(TermCounts.of(texts, analyzer))

    def counts(self) -> TermCounts:
        """Everything merged: one CSR by document over ``terms``, the terms in sorted order, so the result is the
        same however the rows were cut into windows (a local build's windows are not a Ray build's)."""
        indptr = np.concatenate([np.zeros(1, np.int64), *self._indptr])
        term_ids = np.concatenate([np.zeros(0, np.int32), *self._term_ids])
        counts = np.concatenate([np.zeros(0, np.int32), *self._counts])
        order = sorted(range(len(self.terms)), key=self.terms.__getitem__)
        rank = np.empty(len(order), dtype=np.int32)
        rank[order] = np.arange(len(order), dtype=np.int32)
        ids = rank[term_ids] if len(term_ids) else term_ids
        doc = np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))
        keep = np.lexsort((ids, doc))  # ascending term ids within each document again
        return TermCounts([self.terms[i] for i in order], indptr, ids[keep], counts[keep])

    @classmethod
    def of(cls, counts: TermCounts) -> TermStats:
        """Statistics that continue from saved counts (``add`` appends new windows to an index's)."""
        stats = cls()
        stats.terms = list(counts.terms)
        stats._ids = {term: i for i, term in enumerate(counts.terms)}
        stats._indptr = [counts.indptr[1:].astype(np.int64)]
        stats._term_ids = [np.asarray(counts.term_ids, dtype=np.int32)]
        stats._counts = [np.asarray(counts.counts, dtype=np.int32)]
        stats.docs, stats._postings = counts.docs, int(counts.indptr[-1])
        return stats


def take_rows(counts: TermCounts, keep: np.ndarray) -> TermCounts:
    """The counts of rows ``keep`` (ascending), the vocabulary unchanged (``remove``)."""
    starts, stops = counts.indptr[keep], counts.indptr[keep + 1]
    sizes = stops - starts
    picks = np.repeat(starts - np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes) + np.arange(int(sizes.sum()))
    indptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return TermCounts(counts.terms, indptr, counts.term_ids[picks], counts.counts[picks])


# ----- the BM25 matrix ------------------------------------------------------------------------------------
def bm25_matrix(counts: TermCounts, spec: LexicalSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """bm25s's score matrix (CSC by term: data float32, doc indices int32, indptr int64) for these counts:
    idf = ln(1 + (N - df + 0.5) / (df + 0.5)), tf / (k1 (1 - b + b |d| / avgdl) + tf), in float64."""
    n, width = counts.docs, len(counts.terms)
    lengths = doc_lengths(counts.indptr, counts.counts).astype(np.float64)
    average = float(lengths.mean()) if n else 1.0
    docs = np.repeat(np.arange(n, dtype=np.int64), np.diff(counts.indptr))
    df = np.bincount(counts.term_ids, minlength=width).astype(np.float64)
    idf = np.log1p((n - df + 0.5) / (df + 0.5))
    tf = counts.counts.astype(np.float64)
    norm = spec.k1 * (1 - spec.b + spec.b * lengths[docs] / (average or 1.0))
    scores = idf[counts.term_ids] * tf / (norm + tf)
    order = np.lexsort((docs, counts.term_ids))
    indptr = np.concatenate([[0], np.cumsum(np.bincount(counts.term_ids, minlength=width))]).astype(np.int64)
    return scores[order].astype(np.float32), docs[order].astype(np.int32), indptr


# ----- saved, loaded, searched ----------------------------------------------------------------------------
def save(directory: Path, counts: TermCounts, spec: LexicalSpec) -> None:
    """Write the BM25 matrix (bm25s's files) and the per-document counts into ``directory`` (created)."""
    import bm25s

    directory.mkdir(parents=True, exist_ok=True)
    data, indices, indptr = bm25_matrix(counts, spec)
    retriever = bm25s.BM25(k1=spec.k1, b=spec.b, method=spec.method)
    retriever.scores = {"data": data, "indices": indices, "indptr": indptr, "num_docs": counts.docs}
    retriever.vocab_dict = {term: i for i, term in enumerate(counts.terms)}
    retriever.nonoccurrence_array = None  # the lucene variant scores absent terms 0
    retriever.save(str(directory), show_progress=False)
    for name, array in zip(COUNT_FILES, (counts.indptr, counts.term_ids, counts.counts), strict=True):
        np.save(directory / name, array)


def load_counts(directory: Path) -> TermCounts:
    """The per-document counts saved in ``directory``, with the vocabulary in id order."""
    try:
        vocab = json.loads((directory / "vocab.index.json").read_text())
        arrays = [np.load(directory / name) for name in COUNT_FILES]
    except (OSError, ValueError) as err:
        raise IndexDirError(f"cannot read the lexical index in {directory} ({err}); rebuild the index") from err
    terms = [""] * len(vocab)
    for term, i in vocab.items():
        terms[i] = term
    return TermCounts(terms, arrays[0].astype(np.int64), arrays[1].astype(np.int32), arrays[2].astype(np.int32))


def size_of(directory: Path) -> int:
    return sum((directory / name).stat().st_size for name in FILES)


class LexicalIndex:
    """A saved BM25 index, memory-mapped, searched by bm25s; safe to share between threads."""

    def __init__(self, directory: Path, spec: LexicalSpec):
        import bm25s

        self.spec = spec
        self.analyzer = Analyzer(spec)
        try:
            self._bm25 = bm25s.BM25.load(str(directory), mmap=True, show_progress=False)
        except (OSError, ValueError, KeyError) as err:
            raise IndexDirError(f"cannot read the lexical index in {directory} ({err}); rebuild the index") from err
        self._vocab: dict[str, int] = self._bm25.vocab_dict

    @property
    def n(self) -> int:
        return int(self._bm25.scores["num_docs"])

    def search(self, queries: Sequence[str], k: int, mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(scores, rows) of each query's best ``k`` documents that share a term with it (and that ``mask``, one
        bool per row, keeps): ``k`` columns, rows -1 and scores -inf where fewer documents match."""
        k = max(1, min(k, self.n))
        weights = None if mask is None else np.asarray(mask, dtype=np.float32)
        scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
        rows = np.full((len(queries), k), -1, dtype=np.int64)
        for i, query in enumerate(queries):
            terms = [term for term in self.analyzer.terms(query) if term in self._vocab]
            if not terms:
                continue
            found, score = top_positive(self._bm25.get_scores(terms, weight_mask=weights), k)
            scores[i, : len(found)], rows[i, : len(found)] = score, found
        return scores, rows


def top_positive(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, scores) of the ``k`` best positive ``scores``, best first, ties lower row first; zero is no shared
    term, or filtered out (a score multiplied by 0). The selection runs over the positive scores alone: most of a
    query's scores are zero, and numpy's ``argpartition`` over an array mostly of one value is 25x slower than
    over distinct values (100k documents: 15 ms a query against 0.6 ms), the cost of every hybrid search."""
    rows = np.flatnonzero(scores > 0)
    values = scores[rows]
    if len(rows) > k:
        kth = np.partition(values, len(values) - k)[len(values) - k]
        keep = values >= kth  # ties at the k-th score: all of them, cut below in row order
        rows, values = rows[keep], values[keep]
    order = np.lexsort((rows, -values))[:k]
    return rows[order], values[order].astype(np.float32, copy=False)


def iter_texts(tables: Iterable[Any]) -> Iterable[list[str]]:
    """The ``text`` column of each (id, text) table (a stash's parts), as lists."""
    for table in tables:
        yield table["text"].to_pylist()
