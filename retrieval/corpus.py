"""The corpus: a parquet file read in record batches as (ids, texts), checked before any work is done. No ML."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from retrieval.errors import CorpusError
from retrieval.files import sha256

log = logging.getLogger(__name__)

DEFAULT_ID_COLUMN = "id"


@dataclass(frozen=True)
class CorpusSpec:
    """Where the corpus is and how to read it.

    ``id_column=None`` means "the column ``id`` if the file has one, else row numbers"; a column named
    explicitly must exist. ``title_column`` is prepended to the text (``title + " " + text``, as BEIR does).
    ``vectors_column`` names a fixed-size list column of precomputed embeddings: rows are then not encoded.
    """

    path: Path
    text_column: str = "text"
    id_column: str | None = None
    title_column: str | None = None
    vectors_column: str | None = None
    skip_empty: bool = False

    def settings(self) -> dict[str, object]:
        """What, besides the file's bytes, decides which rows and texts come out (for fingerprints)."""
        return {
            "text_column": self.text_column,
            "id_column": self.id_column,
            "title_column": self.title_column,
            "vectors_column": self.vectors_column,
            "skip_empty": self.skip_empty,
        }


@dataclass
class Batch:
    """Rows of one record batch that passed the checks; ``vectors`` only with a vectors column."""

    ids: list[str]
    texts: list[str]
    vectors: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class CorpusReport:
    """What a validation pass over the corpus found."""

    rows: int
    usable: int
    skipped: int
    first_skipped: list[str] = field(default_factory=list)


class Corpus:
    """A validated parquet corpus. Opening it checks the file and its columns; ``validate`` checks values."""

    def __init__(self, spec: CorpusSpec):
        self.spec = spec
        path = Path(spec.path)
        if not path.exists():
            raise CorpusError(f"corpus file not found: {path}")
        if path.is_dir():
            raise CorpusError(f"corpus path is a directory, not a parquet file: {path}")
        self._array: np.ndarray | None = None
        if path.suffix == ".npy":  # precomputed vectors, one per row; ids are row numbers, no text
            self._open_npy(path)
            return
        try:
            self._file = pq.ParquetFile(path)
        except (pa.ArrowInvalid, OSError) as err:
            raise CorpusError(f"{path} is not a readable parquet file ({err}); convert it to parquet first") from err
        self.path = path
        names = self._file.schema_arrow.names
        self.id_column = spec.id_column
        if self.id_column is None and DEFAULT_ID_COLUMN in names:
            self.id_column = DEFAULT_ID_COLUMN
        wanted = {"text_column": spec.text_column, "id_column": self.id_column}
        wanted |= {"title_column": spec.title_column, "vectors_column": spec.vectors_column}
        for option, column in wanted.items():
            if column is not None and column not in names:
                if option == "text_column" and spec.vectors_column:
                    continue
                raise CorpusError(
                    f"{path} has no column {column!r} (columns: {', '.join(names)}); choose one with `{option}`"
                )
        self.has_text = spec.text_column in names and not spec.vectors_column
        schema = self._file.schema_arrow
        for option, column, check in (
            ("text_column", spec.text_column if self.has_text else None, _is_text),
            ("title_column", spec.title_column, _is_text),
            ("id_column", self.id_column, _is_id),
        ):
            if column is not None and not check(schema.field(column).type):
                kind = "strings or integers" if option == "id_column" else "text (one string per row)"
                raise CorpusError(
                    f"column {column!r} of {path} holds {schema.field(column).type}, not {kind}; "
                    f"convert it, or choose another column with `{option}`"
                )
        self.vector_dim: int | None = None
        if spec.vectors_column:
            vtype = schema.field(spec.vectors_column).type
            value = vtype.value_type if _is_list(vtype) else None
            if value is None or not (pa.types.is_floating(value) or pa.types.is_integer(value)):
                raise CorpusError(
                    f"column {spec.vectors_column!r} holds {vtype}, not a list of numbers; store one vector per row"
                )
            if pa.types.is_fixed_size_list(vtype):
                self.vector_dim = vtype.list_size
                if self.vector_dim == 0:
                    raise CorpusError(f"column {spec.vectors_column!r} holds empty vectors (width 0)")

    def _open_npy(self, path: Path) -> None:
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as err:
            raise CorpusError(f"{path} is not a readable .npy array ({err}); save it with numpy.save") from err
        if array.ndim != 2:
            raise CorpusError(f"{path} holds an array of shape {array.shape}; expected 2-D (rows x dims) vectors")
        if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
            raise CorpusError(f"{path} holds {array.dtype} values; expected a float array of vectors")
        self.path, self._array, self.id_column, self.has_text = path, array, None, False
        self.vector_dim = int(array.shape[1])

    @property
    def precomputed(self) -> bool:
        """Rows carry their own vectors (a vectors column or a .npy file): nothing to encode."""
        return self._array is not None or self.spec.vectors_column is not None

    @property
    def num_rows(self) -> int:
        if self._array is not None:
            return int(self._array.shape[0])
        return int(self._file.metadata.num_rows)

    def fingerprint(self) -> str:
        """sha256 of the file's bytes: two corpora with the same fingerprint give the same rows."""
        return sha256(self.path)

    def _columns(self) -> list[str]:
        cols = [c for c in (self.id_column, self.spec.title_column) if c]
        if self.has_text:
            cols.append(self.spec.text_column)
        if self.spec.vectors_column:
            cols.append(self.spec.vectors_column)
        return cols

    def _strings(self, rb: pa.RecordBatch, column: str, first_row: int) -> list[str | None]:
        """A text-like column as Python strings; binary is decoded as UTF-8, and refused where it is not."""
        values = rb.column(column)
        if pa.types.is_dictionary(values.type):
            values = values.dictionary_decode()
        try:
            return values.cast(pa.string()).to_pylist()
        except pa.ArrowInvalid:  # binary that is not UTF-8: find the row, name it
            for i, value in enumerate(values.to_pylist()):
                try:
                    value is None or bytes(value).decode("utf-8")
                except UnicodeDecodeError:
                    raise CorpusError(
                        f"column {column!r} of {self.path} holds bytes that are not UTF-8 text (row {first_row + i}); "
                        "store the texts as UTF-8 strings"
                    ) from None
            raise

    def _texts(self, rb: pa.RecordBatch, first_row: int = 0) -> list[str | None]:
        if not self.has_text:
            return [""] * rb.num_rows
        texts = self._strings(rb, self.spec.text_column, first_row)
        if self.spec.title_column:
            titles = self._strings(rb, self.spec.title_column, first_row)
            texts = [None if t is None else f"{h or ''} {t}".strip() for h, t in zip(titles, texts, strict=True)]
        return texts

    def _raw_batches(self, rows: int) -> Iterator[tuple[list[str], list[str | None], pa.RecordBatch]]:
        if self._array is not None:  # a window of the memory-mapped array stands in for the record batch
            for start in range(0, self.num_rows, rows):
                window = np.asarray(self._array[start : start + rows], dtype=np.float32)
                yield [str(i) for i in range(start, start + len(window))], [""] * len(window), window  # type: ignore[misc]
            return
        start = 0
        for rb in self._record_batches(rows):
            if self.id_column:
                ids = self._strings(rb, self.id_column, start)
                if any(v is None for v in ids):
                    raise CorpusError(f"column {self.id_column!r} has null ids; every row needs an id")
            else:
                ids = [str(i) for i in range(start, start + rb.num_rows)]
            texts = self._texts(rb, start)
            start += rb.num_rows
            yield ids, texts, rb  # type: ignore[misc]

    def _record_batches(self, rows: int) -> Iterator[pa.RecordBatch]:
        """The file's record batches; a file that breaks part-way (corrupt pages, truncated) is one clear error."""
        batches = self._file.iter_batches(batch_size=rows, columns=self._columns())
        done = 0
        while True:
            try:
                rb = next(batches)
            except StopIteration:
                return
            except (OSError, pa.ArrowException) as err:
                raise CorpusError(
                    f"{self.path} cannot be read after row {done:,} ({err}); the file is corrupt or truncated: "
                    "write it again"
                ) from err
            done += rb.num_rows
            yield rb

    def _usable(self, texts: list[str | None], rb: pa.RecordBatch) -> np.ndarray:
        if self._array is not None:
            return np.ones(len(texts), dtype=bool)
        if self.spec.vectors_column:
            return np.asarray(rb.column(self.spec.vectors_column).is_valid())
        return np.array([t is not None and t.strip() != "" for t in texts], dtype=bool)

    def validate(self, rows: int = 65536, min_rows: int = 2) -> CorpusReport:
        """One cheap pass over ids and texts: empty texts, duplicate ids, fewer than ``min_rows`` usable rows
        (2 to fit a transform; 1 to add to an index), non-finite vectors. Raises CorpusError.

        Memory: one record batch, plus 8 bytes per id for the duplicate check (``id_hashes``), never the ids."""
        hashes: list[np.ndarray] = []
        total = usable = nonfinite = 0
        bad: list[str] = []
        first_nonfinite: list[str] = []
        for ids, texts, rb in self._raw_batches(rows):
            ok = self._usable(texts, rb)
            if self.precomputed:
                finite = np.isfinite(self._batch_vectors(rb, ok)).all(axis=1)
                kept = np.flatnonzero(ok)
                nonfinite += int((~finite).sum())
                first_nonfinite += [ids[kept[i]] for i in np.flatnonzero(~finite)[: 5 - len(first_nonfinite)]]
            total += len(ids)
            usable += int(ok.sum())
            bad.extend(i for i, good in zip(ids, ok, strict=True) if not good and len(bad) < 5)
            if self.id_column:  # row numbers are unique by construction
                hashes.append(id_hashes(ids))
        duplicate = self._first_duplicate(np.concatenate(hashes), rows) if hashes else None
        if duplicate is not None:
            raise CorpusError(
                f"duplicate id {duplicate!r} in column {self.id_column!r}; ids must be unique "
                "(pick another --id-column, or drop it to use row numbers)"
            )
        skipped = total - usable
        what = "null vectors" if self.spec.vectors_column else "null or empty text"
        if total == 0:
            raise CorpusError(f"{self.path} holds no rows; nothing to index")
        if nonfinite:
            raise CorpusError(
                f"{nonfinite} of {total} vectors contain NaN or inf (first ids: {', '.join(first_nonfinite)}); "
                "fix or drop those rows"
            )
        if skipped and not self.spec.skip_empty:
            raise CorpusError(
                f"{skipped} of {total} rows have {what} (first ids: {', '.join(bad)}); "
                "fix them or pass --skip-empty to leave them out"
            )
        if skipped:
            log.warning("skipping %d of %d rows with %s (first ids: %s)", skipped, total, what, ", ".join(bad))
        if usable < min_rows:
            need = "to fit a transform" if min_rows > 1 else "to add"
            raise CorpusError(f"{self.path} has {usable} usable row(s); at least {min_rows} are needed {need}")
        return CorpusReport(rows=total, usable=usable, skipped=skipped, first_skipped=bad)

    def _first_duplicate(self, hashes: np.ndarray, rows: int) -> str | None:
        """The first id (in row order) seen a second time, or None. ``hashes``: every row's ``id_hashes``; only
        when two are equal are the ids read again, and only those with a repeated hash kept as strings."""
        ordered = np.sort(hashes)
        repeated = np.unique(ordered[1:][ordered[1:] == ordered[:-1]])
        if not len(repeated):
            return None
        seen: set[str] = set()
        for ids, _, _ in self._raw_batches(rows):
            for i in (ids[j] for j in np.flatnonzero(np.isin(id_hashes(ids), repeated))):
                if i in seen:
                    return i
                seen.add(i)
        return None  # equal hashes of different ids

    def batches(self, rows: int, skip_batches: int = 0) -> Iterator[Batch]:
        """Usable rows in record batches of ``rows`` raw rows (fewer after skipping); the first
        ``skip_batches`` record batches are read but not returned (to resume a build)."""
        for n, (ids, texts, rb) in enumerate(self._raw_batches(rows)):
            if n < skip_batches:
                continue
            ok = self._usable(texts, rb)
            keep = np.flatnonzero(ok)
            vectors = self._batch_vectors(rb, ok) if self.precomputed else None
            yield Batch(
                ids=[ids[i] for i in keep],
                texts=[texts[i] or "" for i in keep],
                vectors=vectors,
            )

    def _batch_vectors(self, rb: pa.RecordBatch | np.ndarray, ok: np.ndarray) -> np.ndarray:
        """The usable rows' precomputed vectors, float32 (n, d)."""
        if isinstance(rb, np.ndarray):
            return rb[ok]
        assert self.spec.vectors_column is not None
        return _vectors(rb.column(self.spec.vectors_column).filter(pa.array(ok)), self.spec.vectors_column)


def _is_text(kind: pa.DataType) -> bool:
    if pa.types.is_dictionary(kind):
        return _is_text(kind.value_type)
    return (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
        or pa.types.is_null(kind)
        or str(kind) in ("string_view", "binary_view")
    )


def _is_id(kind: pa.DataType) -> bool:
    """Ids are strings (or bytes that are UTF-8) or integers; a float id (1.0 vs "1") is refused as ambiguous."""
    return (_is_text(kind) and not pa.types.is_null(kind)) or pa.types.is_integer(kind)


def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_fixed_size_list(kind) or pa.types.is_list(kind) or pa.types.is_large_list(kind)


def id_hashes(ids: Sequence[str]) -> np.ndarray:
    """64-bit hashes of ids (Python's string hash: stable within one process), 8 bytes per id where a set of the
    strings costs ~100. For finding repeated ids in bounded memory: equal hashes are then checked on the strings."""
    return np.fromiter((hash(i) for i in ids), dtype=np.int64, count=len(ids))


def _vectors(column: pa.Array, name: str) -> np.ndarray:
    """A list column as a float32 matrix; ragged lists are refused."""
    if len(column) == 0:
        return np.zeros((0, 0), dtype=np.float32)
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    if lengths.max() == 0:
        raise CorpusError(f"column {name!r} holds empty vectors (lists of length 0); store one vector per row")
    if lengths.min() != lengths.max():
        raise CorpusError(f"column {name!r} holds vectors of different lengths ({lengths.min()}..{lengths.max()})")
    flat = column.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    return flat.reshape(len(column), int(lengths[0]))
