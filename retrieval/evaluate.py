"""Dataset-level evaluation: queries + qrels against an index (IR), and sentence pairs against gold scores (STS)."""

from __future__ import annotations

import functools
import io
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from retrieval.corpus import is_id_type, is_text_type
from retrieval.docs import Docs
from retrieval.encode.spec import Encoder
from retrieval.errors import ConfigError, CorpusError
from retrieval.metrics import EvalResult, Qrels, Run, evaluate_run, sts_scores
from retrieval.moments import RunningMoments
from retrieval.progress import Progress, no_progress
from retrieval.search import Searcher, SearchParams
from retrieval.text import blank
from retrieval.whitening import RawTransform, TransformSpec, Whitening, l2_normalize

QUERY_CHUNK = 256  # queries of a --queries file read, checked and searched at a time


@dataclass(frozen=True)
class Queries:
    ids: list[str]
    texts: list[str]

    def __len__(self) -> int:
        return len(self.ids)


def _read(path: Path, columns: Sequence[str], what: str, optional: Sequence[str] = ()) -> Any:
    schema = _read_schema(path, columns, what)
    return pq.read_table(path, columns=[*columns, *(c for c in optional if c in schema.names)])


def _read_schema(path: Path, columns: Sequence[str], what: str) -> Any:
    """The schema of a parquet file that must exist and hold ``columns``; one line naming what is wrong else."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"{what} file not found: {path}")
    try:
        schema = pq.read_schema(path)
    except Exception as err:  # pyarrow raises several types for a file that is not parquet
        raise CorpusError(f"{path} is not a readable parquet file ({err})") from err
    missing = [c for c in columns if c not in schema.names]
    if missing:
        raise CorpusError(f"{path} has no column {missing[0]!r} (columns: {', '.join(schema.names)})")
    return schema


# what ``_strings`` reads: strings only (no bytes, no all-null column), in any of arrow's layouts
_strings_only = functools.partial(is_text_type, raw=False)


def _strings(values: Any) -> list[Any]:
    """A column that passed ``_strings_only`` as Python strings, whatever its layout; None for nulls, which each
    caller refuses."""
    return values.cast(pa.string()).to_pylist()


def _ids(values: Any, column: str, path: Path) -> list[Any]:
    """An id column as the corpus reads one: strings, UTF-8 bytes decoded (``str()`` gave "b'q1'", which matched
    nothing), integers as digits; None for nulls, which each caller refuses. Floats are refused, as the corpus
    refuses them: 1.0 and "1" would be two ids."""
    kind = values.type
    if pa.types.is_dictionary(kind):  # pandas' categorical: read as its values are
        values, kind = values.cast(kind.value_type), kind.value_type
    if not is_id_type(kind):
        raise CorpusError(f"column {column!r} of {path} holds {kind}: ids must be strings or integers")
    if pa.types.is_integer(kind):
        return [None if v is None else str(v) for v in values.to_pylist()]
    try:
        return values.cast(pa.string()).to_pylist()
    except (pa.ArrowInvalid, UnicodeDecodeError):
        raise CorpusError(f"column {column!r} of {path} holds bytes that are not UTF-8: store ids as text") from None


def _is_number(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind)


def _require(table: Any, column: str, path: Path, kind: Callable[[pa.DataType], bool], meaning: str) -> None:
    """Refuse a column of the wrong type in one line: ``meaning`` says what it must hold."""
    found = table.schema.field(column).type
    if not kind(found):
        raise CorpusError(f"column {column!r} of {path} holds {found}{meaning}")


def read_queries(path: Path, id_column: str = "query_id", text_column: str = "text") -> Queries:
    """Query ids (as text) and texts; every query needs an id, a unique one, and some text."""
    table = _read(path, [id_column, text_column], "queries")
    if not table.num_rows:
        raise CorpusError(f"{path} holds no queries")
    _require(table, text_column, path, _strings_only, ", not text")
    ids, texts = _ids(table.column(id_column), id_column, path), _strings(table.column(text_column))
    for row, (query, text) in enumerate(zip(ids, texts, strict=True)):
        if query is None:
            raise CorpusError(f"row {row} of {path} has a null {id_column!r}: every query needs an id")
        if text is None or blank(text):
            raise CorpusError(f"query {query} of {path} has no text (null or blank): give every query its text")
    seen: set[str] = set()
    for query in ids:
        if query in seen:
            raise CorpusError(f"query id {query!r} appears more than once in {path}: query ids must be unique")
        seen.add(query)
    return Queries(ids, texts)


def _parquet_magic(path: Path) -> bool:
    """Whether ``path`` starts as a parquet file does (b"PAR1"), whatever its name."""
    try:
        with Path(path).open("rb") as fh:
            return fh.read(4) == b"PAR1"
    except OSError:
        return False


class QueryFile:
    """The queries of ``retrieval search --queries``: a parquet file (texts in ``text_column``, default "text";
    ids from ``id_column`` when the file has one, each used once, else row numbers from 0), or a UTF-8 text file of
    one query per line (ids: line numbers from 1; blank lines skipped; ``-``: standard input), which has no
    column to name.

    Checked whole when opened, in one streamed pass (a bad row deep in the file is refused before any hit is
    printed), then read again chunk by chunk (``chunks``): memory holds one chunk whatever the file's size.
    Standard input, which cannot be read twice, is held in memory."""

    def __init__(self, path: Path, text_column: str | None = None, id_column: str = "query_id"):
        self.path, self.text_column, self.id_column = Path(path), text_column or "text", id_column
        self.where = "standard input" if str(path) == "-" else str(path)
        self._stdin = sys.stdin.buffer.read() if str(path) == "-" else None
        if self._stdin is None and self.path.suffix.lower() == ".npy":
            raise CorpusError(f"{path} is a .npy: `queries` takes query texts, one per line or in a parquet column")
        self.parquet = self._stdin is None and (self.path.suffix.lower() == ".parquet" or _parquet_magic(self.path))
        self._with_ids = False  # line numbers and row numbers are unique by construction
        if self.parquet:
            schema = _read_schema(self.path, [self.text_column], "queries")
            kind = schema.field(self.text_column).type
            if not _strings_only(kind):
                raise CorpusError(f"column {self.text_column!r} of {path} holds {kind}, not text")
            self._with_ids = id_column in schema.names
        elif self._stdin is None and not self.path.is_file():
            raise CorpusError(f"queries file not found: {path}")
        elif text_column is not None:  # a column asked of a file that has none would be silently ignored
            raise ConfigError(
                f"{self.where} is read as text, one query per line: `text_column` applies to a parquet file of queries",
                "text_column",
            )
        self.count = 0
        seen: set[str] = set()
        for chunk in self.chunks(QUERY_CHUNK):
            self.count += len(chunk)
            for query in chunk.ids if self._with_ids else ():
                if query in seen:  # hits are printed under their query id: two queries under one id are one
                    raise CorpusError(f"query id {query!r} appears more than once in {path}: query ids must be unique")
                seen.add(query)
        if not self.count:
            raise CorpusError(f"{self.where} holds no query")

    def __len__(self) -> int:
        return self.count

    def chunks(self, size: int = QUERY_CHUNK) -> Iterator[Queries]:
        """The queries in file order, at most ``size`` at a time."""
        return self._parquet_chunks(size) if self.parquet else self._line_chunks(size)

    def _parquet_chunks(self, size: int) -> Iterator[Queries]:
        columns = [self.text_column] + ([self.id_column] if self._with_ids else [])
        first = 0
        for batch in pq.ParquetFile(self.path).iter_batches(batch_size=size, columns=columns):
            texts = _strings(batch.column(self.text_column))
            if self._with_ids:
                ids = _ids(batch.column(self.id_column), self.id_column, self.path)
            else:
                ids = [str(row) for row in range(first, first + len(texts))]
            for row, (query, text) in enumerate(zip(ids, texts, strict=True), start=first):
                if query is None:
                    raise CorpusError(f"row {row} of {self.path} has a null {self.id_column!r}: give every query an id")
                if text is None or blank(text):
                    raise CorpusError(
                        f"query {query} of {self.path} has no text (null or blank): give every query its text"
                    )
            first += len(texts)
            yield Queries(ids, texts)

    def _line_chunks(self, size: int) -> Iterator[Queries]:
        ids: list[str] = []
        texts: list[str] = []
        with io.BytesIO(self._stdin) if self._stdin is not None else self.path.open("rb") as lines:
            for number, raw in enumerate(lines, start=1):
                if number == 1:
                    raw = raw.removeprefix(b"\xef\xbb\xbf")  # a BOM (Windows editors write one) is not the query's
                try:
                    line = raw.decode("utf-8").removesuffix("\n").removesuffix("\r")
                except UnicodeDecodeError:
                    raise CorpusError(
                        f"line {number} of {self.where} is not UTF-8: give one UTF-8 query per line"
                    ) from None
                if not blank(line):
                    ids.append(str(number))
                    texts.append(line)
                if len(ids) == size:
                    yield Queries(ids, texts)
                    ids, texts = [], []
        if ids:
            yield Queries(ids, texts)


def read_texts(path: Path, text_column: str = "text") -> list[str]:
    """The non-blank texts of one column: queries that need no ids (``calibrate``)."""
    table = _read(path, [text_column], "queries")
    _require(table, text_column, path, _strings_only, ", not text")
    texts = [text for text in _strings(table.column(text_column)) if text is not None and not blank(text)]
    if not texts:
        raise CorpusError(f"{path} holds no query text in column {text_column!r}")
    return texts


def read_qrels(
    path: Path, query_column: str = "query_id", doc_column: str = "doc_id", score_column: str = "score"
) -> Qrels:
    """query id -> doc id -> grade (an integer: 0 or less not relevant, higher more relevant); ids as text."""
    table = _read(path, [query_column, doc_column, score_column], "qrels")
    if table.num_rows == 0:  # every query would be "not judged", reported as a mismatch of query ids
        raise CorpusError(
            f"{path} holds no judgement (no rows): give one ({query_column}, {doc_column}, {score_column}) row per "
            "judged document"
        )
    _require(table, score_column, path, _is_number, ": relevance grades must be integers")
    columns = [_ids(table.column(c), c, path) for c in (query_column, doc_column)]
    columns.append(table.column(score_column).to_pylist())
    qrels: Qrels = {}
    for row, (q, d, s) in enumerate(zip(*columns, strict=True)):
        if q is None or d is None or s is None:
            raise CorpusError(
                f"row {row} of {path} has a null query id, doc id or grade: every judgement needs all three"
            )
        if not math.isfinite(s) or s != int(s):
            raise CorpusError(f"row {row} of {path} has the grade {s}: relevance grades must be whole numbers")
        judged, doc, grade = qrels.setdefault(q, {}), d, int(s)
        if judged.setdefault(doc, grade) != grade:
            raise CorpusError(
                f"row {row} of {path} grades doc {d!r} for query {q!r} {grade}, an earlier row {judged[doc]}: "
                "keep one judgement per (query, doc) pair"
            )
    return qrels


def read_judged(queries_path: Path, qrels_path: Path) -> tuple[Queries, Qrels]:
    """Queries and their qrels, refused when no query has a relevant judgement (files that do not belong
    together, or ids that differ in form, such as 1 and "1.0"): every metric would be undefined."""
    queries, qrels = read_queries(queries_path), read_qrels(qrels_path)
    if not any(grade > 0 for q in queries.ids for grade in qrels.get(q, {}).values()):
        if any(q in qrels for q in queries.ids):
            raise CorpusError(
                f"{qrels_path} grades no document of these queries above 0, so none is relevant: relevant "
                "documents need a grade of 1 or more"
            )
        example = next(iter(qrels), "none")
        raise CorpusError(
            f"no query of {queries_path} has a relevant judgement in {qrels_path} (query ids such as "
            f"{queries.ids[0]!r} there, {example!r} here): check that the two files belong together"
        )
    return queries, qrels


def check_judged_in(docs: Docs, judged: tuple[Queries, Qrels], where: Path | str) -> None:
    """Refuse qrels none of whose relevant documents is in the index: every metric would be 0, and a tune would
    choose on nothing. The usual cause is ids read from another column (SciFact's are in ``doc_id``)."""
    queries, qrels = judged
    relevant = {doc for q in queries.ids for doc, grade in qrels.get(q, {}).items() if grade > 0}
    if relevant and docs.count_in(relevant) == 0:
        raise CorpusError(
            f"none of the {len(relevant):,} documents judged relevant is in the index at {where} (ids such as "
            f"{min(relevant)!r} in the qrels, {docs.id(0)!r} in the index): build the index with the column "
            "that holds those ids (--id-column)"
        )


def to_run(query_ids: Sequence[str], scores: np.ndarray, rows: np.ndarray, doc_ids: Sequence[str]) -> Run:
    """FAISS output (scores, rows) as a run: query id -> doc id -> score."""
    return {
        q: {doc_ids[r]: float(s) for s, r in zip(srow, rrow, strict=True) if r >= 0}
        for q, srow, rrow in zip(query_ids, scores, rows, strict=True)
    }


def evaluate_ir(
    searcher: Searcher,
    queries: Queries,
    qrels: Qrels,
    params: SearchParams = SearchParams(k=100),
    raw_queries: np.ndarray | None = None,
) -> EvalResult:
    """Search every query (``params.k`` hits deep) and score the run against the qrels.

    ``raw_queries`` are the queries' raw encoder vectors when already computed. ``params.mode``: dense, lexical
    or hybrid (None: the index's default).
    """
    check_judged_in(searcher.docs, (queries, qrels), searcher.directory)
    raw = raw_queries
    if raw is None and searcher.mode(params) != "lexical":
        raw = searcher.encode(queries.texts)
    scores, rows = searcher.search_raw(raw, params, texts=queries.texts)
    return evaluate_run(to_run(queries.ids, scores, rows, searcher.docs.ids), qrels)


# ----- STS -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pairs:
    """Sentence pairs with gold scores, grouped by ``subset`` (one group when the file has no such column)."""

    name: str
    sentence1: list[str]
    sentence2: list[str]
    gold: np.ndarray
    subset: list[str]

    def sentences(self) -> list[str]:
        """Every distinct sentence, in first-seen order (what a "target" fit sees)."""
        return list(dict.fromkeys(self.sentence1 + self.sentence2))


def read_pairs(path: Path) -> Pairs:
    """Sentence pairs with gold scores (and an optional ``subset`` column); at least two pairs, no nulls."""
    path = Path(path)
    table = _read(path, ["sentence1", "sentence2", "score"], "pairs", optional=["subset"])
    has_subset = "subset" in table.column_names
    for column in ("sentence1", "sentence2", *(["subset"] if has_subset else [])):
        _require(table, column, path, _strings_only, ", not text")
        if table.column(column).null_count:
            raise CorpusError(f"column {column!r} of {path} has nulls: every pair needs two sentences (and a subset)")
    _require(table, "score", path, _is_number, ": gold scores must be numbers")
    gold = np.asarray(table.column("score").to_pylist(), dtype=np.float64)  # nulls become NaN
    if not np.isfinite(gold).all():
        raise CorpusError(f"column 'score' of {path} has nulls or non-finite values: every pair needs a gold score")
    if table.num_rows < 2:
        raise CorpusError(f"{path} holds {table.num_rows} pairs: a rank correlation needs at least two")
    subset = _strings(table.column("subset")) if has_subset else [path.stem] * table.num_rows
    reserved = sorted({"all", "wmean"} & set(subset))
    if reserved:
        raise CorpusError(f"{path} names a subset {reserved[0]!r}, which is reserved for the summary: rename it")
    names = np.asarray(subset)
    for name in dict.fromkeys(subset):  # a constant gold score has no ranks to correlate with: NaN, not a number
        scores = gold[names == name]
        if len(scores) < 2 or np.all(scores == scores[0]):
            what = f"subset {name!r} of {path}" if has_subset else str(path)
            raise CorpusError(
                f"{what} has {'one pair' if len(scores) < 2 else f'the same gold score ({scores[0]:g}) for every pair'}"
                ": a rank correlation needs at least two pairs with different scores"
            )
    return Pairs(
        name=path.stem,
        sentence1=_strings(table.column("sentence1")),
        sentence2=_strings(table.column("sentence2")),
        gold=gold,
        subset=subset,
    )


def pair_cosines(vectors: dict[str, np.ndarray], pairs: Pairs, transform: Whitening | RawTransform) -> np.ndarray:
    """Cosine of each pair after the transform; ``vectors`` maps sentence -> raw vector."""
    a = transform.transform(np.stack([vectors[s] for s in pairs.sentence1]))
    b = transform.transform(np.stack([vectors[s] for s in pairs.sentence2]))
    return np.einsum("ij,ij->i", l2_normalize(a), l2_normalize(b)).astype(np.float64)


def sts_result(vectors: dict[str, np.ndarray], pairs: Pairs, transform: Whitening | RawTransform) -> dict[str, float]:
    """Spearman x100 per subset, plus "wmean" (by subset size) and "all" (concatenated)."""
    cos = pair_cosines(vectors, pairs, transform)
    subsets = np.asarray(pairs.subset)
    groups = {s: (cos[subsets == s], pairs.gold[subsets == s]) for s in dict.fromkeys(pairs.subset)}
    return sts_scores(groups)


def moments_of(vectors: dict[str, np.ndarray], sentences: Sequence[str]) -> RunningMoments:
    moments = RunningMoments(next(iter(vectors.values())).shape[0])
    moments.update(np.stack([vectors[s] for s in sentences]))
    return moments


@dataclass
class StsReport:
    """Spearman x100 of each pair file, raw and transformed, and what the transform was fitted on."""

    fit: str
    transform: str
    results: list[dict[str, Any]]  # {"file", "raw": {...}, "transformed": {...}} with "wmean", "all", subsets

    def to_dict(self) -> dict[str, Any]:
        return {"fit": self.fit, "transform": self.transform, "results": self.results}


def evaluate_sts(
    sets: Sequence[Pairs],
    encoder: Encoder,
    transform: Whitening | RawTransform | TransformSpec,
    fit_sets: Sequence[Pairs] = (),
    fit_name: str = "",
    progress: Progress = no_progress,
) -> StsReport:
    """Encode every sentence once; score each set raw and transformed. A ``TransformSpec`` is fitted on
    "target": every sentence of ``sets`` and ``fit_sets``, no labels; a fitted transform is used as given."""
    sentences = list(dict.fromkeys(s for p in [*sets, *fit_sets] for s in p.sentences()))
    progress("encode", 0, len(sentences))
    raw_vectors = encoder.encode(sentences)
    progress("encode", len(sentences), len(sentences))
    vectors = dict(zip(sentences, raw_vectors, strict=True))
    if isinstance(transform, TransformSpec):
        transform = transform.fit(moments_of(vectors, sentences))
        names = ", ".join(p.name for p in [*sets, *fit_sets])
        fit_name = f"target ({len(sentences):,} sentences of {names})"
        if isinstance(transform, RawTransform):  # what a spec without dim or gamma resolves to, as in `index`
            fit_name = "nothing: the raw transform (give a dim below d, or a gamma, to fit a whitening)"
    raw = RawTransform(encoder.dim)
    results = [
        {"file": p.name, "raw": sts_result(vectors, p, raw), "transformed": sts_result(vectors, p, transform)}
        for p in sets
    ]
    return StsReport(fit_name, repr(transform), results)
