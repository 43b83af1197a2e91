"""The corpus: parquet (a file, a folder of files, or a glob) read in windows of rows as (ids, texts), checked
before any work is done. No ML.

A corpus is a sorted list of parquet files read one after another; rows are cut into *windows* of a fixed number
of rows that never cross a file boundary, numbered from 0 across the files. A window is one stash part and one
unit of work (a resume step locally; a task on Ray), and any range of windows can be read on its own without
reading what comes before it, so any process, given the same files, cuts exactly the same windows.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from retrieval import options
from retrieval.errors import CorpusError
from retrieval.files import not_utf8, sha256
from retrieval.text import blank

log = logging.getLogger(__name__)

DEFAULT_ID_COLUMN = "id"
PARQUET_SUFFIX = ".parquet"
GLOB_MAGIC = ("*", "?", "[")
FIRST_SHOWN = 5  # ids named in a message about bad rows


@dataclass(frozen=True)
class CorpusSpec:
    """Where the corpus is and how to read it.

    ``path`` is a parquet file, a ``.npy`` array of vectors, a folder (every ``*.parquet`` under it, hidden and
    ``_``-prefixed names skipped, as Spark and pyarrow write them) or a glob (``data/part-*.parquet``); files are
    read in sorted order. ``id_column=None`` means "the column ``id`` if the files have one, else row numbers"
    (a single file: ``0``, ``1``, ...; a folder or glob: ``<file>:<row>``, the file's path relative to the folder,
    or to the glob's fixed directory, and the row's number in that file); a column named explicitly must exist.
    ``title_column`` is prepended to the text (``title + " " + text``, as BEIR does). ``vectors_column`` names a
    list column of precomputed embeddings: rows are then not encoded. ``columns``: metadata columns kept with
    their types, for filters (``Batch.columns``).
    """

    path: Path
    text_column: str = "text"
    id_column: str | None = None
    title_column: str | None = None
    vectors_column: str | None = None
    skip_empty: bool = False
    columns: tuple[str, ...] = options.option(
        (),
        "Comma-separated parquet columns kept with their types, for `search --where` filters.",
        cli_type=str | None,
        cli_default=None,
    )

    def settings(self) -> dict[str, object]:
        """What, besides the files' bytes, decides which rows and texts come out (for fingerprints); ``columns``
        only when some are kept (a fingerprint taken before they existed stays the same)."""
        settings: dict[str, object] = {
            "text_column": self.text_column,
            "id_column": self.id_column,
            "title_column": self.title_column,
            "vectors_column": self.vectors_column,
            "skip_empty": self.skip_empty,
        }
        return settings | ({"columns": list(self.columns)} if self.columns else {})


@dataclass
class Batch:
    """Rows of one window that passed the checks; ``vectors`` only with a vectors column."""

    ids: list[str]
    texts: list[str]
    vectors: np.ndarray | None = None
    titles: list[str] | None = None  # the title column's values (also the texts' first words); None: no column
    columns: pa.Table | None = None  # the kept metadata columns (``CorpusSpec.columns``) of these rows

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class CorpusReport:
    """What a validation pass over the corpus found."""

    rows: int
    usable: int
    skipped: int
    first_skipped: list[str] = field(default_factory=list)


@dataclass
class Tally:
    """What the value checks found in some rows: one window, or several merged in row order (``add``).

    The distributed build checks windows on its workers and merges their tallies on the driver; ``conclude``
    turns a tally into a report or the error the user sees, the same for both."""

    rows: int = 0
    usable: int = 0
    first_bad: list[str] = field(default_factory=list)  # ids of unusable rows (null or empty), in row order
    nonfinite: int = 0
    first_nonfinite: list[str] = field(default_factory=list)

    def add(self, other: Tally) -> Tally:
        """Fold in the tally of the rows that come next; returns ``self``."""
        self.rows += other.rows
        self.usable += other.usable
        self.nonfinite += other.nonfinite
        self.first_bad = (self.first_bad + other.first_bad)[:FIRST_SHOWN]
        self.first_nonfinite = (self.first_nonfinite + other.first_nonfinite)[:FIRST_SHOWN]
        return self


@dataclass(frozen=True)
class SourceFile:
    """One parquet file of a corpus: where it is, the name its row ids use, its row groups' sizes."""

    path: Path
    name: str  # relative to the corpus root (posix); "" for a corpus of one file
    group_rows: tuple[int, ...]

    @property
    def rows(self) -> int:
        return sum(self.group_rows)

    def windows(self, rows: int) -> int:
        return math.ceil(self.rows / rows)


class Corpus:
    """A validated parquet corpus. Opening it checks the files and their columns; ``validate`` checks values.

    It holds metadata only (no open file, no rows), so it is cheap to send to another process."""

    def __init__(self, spec: CorpusSpec):
        self.spec = spec
        self.path = Path(spec.path)
        self._array: np.ndarray | None = None
        self.files: list[SourceFile] = []
        paths, root = _find_files(self.path)
        if root is None and paths[0].suffix == ".npy":  # precomputed vectors, one per row; ids are row numbers
            if spec.columns:
                raise CorpusError(f"{paths[0]} is a .npy array: it has no `columns` to keep; give a parquet corpus")
            self._open_npy(paths[0])
            return
        schemas = {}
        for path in paths:
            try:
                metadata = pq.read_metadata(path)
                schemas[path] = metadata.schema.to_arrow_schema()
            except (pa.ArrowInvalid, OSError) as err:
                raise CorpusError(
                    f"{path} is not a readable parquet file ({err}); convert it to parquet first"
                ) from err
            name = path.relative_to(root).as_posix() if root is not None else ""
            groups = tuple(metadata.row_group(i).num_rows for i in range(metadata.num_row_groups))
            self.files.append(SourceFile(path.absolute(), name, groups))  # read where it is, from any directory
        self.id_column = spec.id_column
        with_ids = [DEFAULT_ID_COLUMN in s.names for s in schemas.values()]
        if self.id_column is None and any(with_ids):
            if not all(with_ids):
                lacking = next(path for path, has in zip(schemas, with_ids, strict=True) if not has)
                raise CorpusError(
                    f"{lacking} has no column {DEFAULT_ID_COLUMN!r} where other files have one; "
                    "give every file its ids, or choose a column with `id_column`"
                )
            self.id_column = DEFAULT_ID_COLUMN
        # a vectors corpus encodes nothing, but its texts (when it has them) are still what hits show
        self.has_text = all(spec.text_column in s.names for s in schemas.values())
        self.vector_dim: int | None = None
        for path, schema in schemas.items():
            self._check_columns(path, schema)

    def _check_columns(self, path: Path, schema: pa.Schema) -> None:
        """Each named column present in this file, and of a type that can be read as what it is for."""
        spec, names = self.spec, schema.names
        wanted = {"text_column": spec.text_column, "id_column": self.id_column}
        wanted |= {"title_column": spec.title_column, "vectors_column": spec.vectors_column}
        for option, column in wanted.items():
            if column is not None and names.count(column) > 1:
                raise CorpusError(
                    f"{path} has {names.count(column)} columns named {column!r}; rename them so that one is "
                    f"the {option.removesuffix('_column')} column"
                )
            if column is not None and column not in names:
                if option == "text_column" and spec.vectors_column:
                    continue
                raise CorpusError(
                    f"{path} has no column {column!r} (columns: {', '.join(names)}); choose one with `{option}`"
                )
        for option, column, check in (
            ("text_column", spec.text_column if self.has_text else None, is_text_type),
            ("title_column", spec.title_column, is_text_type),
            ("id_column", self.id_column, is_id_type),
        ):
            if column is not None and not check(schema.field(column).type):
                kind = "strings or integers" if option == "id_column" else "text (one string per row)"
                raise CorpusError(
                    f"column {column!r} of {path} holds {schema.field(column).type}, not {kind}; "
                    f"convert it, or choose another column with `{option}`"
                )
        for column in spec.columns:
            if names.count(column) != 1:
                what = "no column" if column not in names else f"{names.count(column)} columns named"
                raise CorpusError(f"{path} has {what} {column!r} (columns: {', '.join(names)}); check `columns`")
        if spec.vectors_column:
            vtype = schema.field(spec.vectors_column).type
            value = vtype.value_type if _is_list(vtype) else None
            if value is None or not (pa.types.is_floating(value) or pa.types.is_integer(value)):
                raise CorpusError(
                    f"column {spec.vectors_column!r} of {path} holds {vtype}, not a list of numbers; "
                    "store one vector per row"
                )
            if pa.types.is_fixed_size_list(vtype):
                if self.vector_dim is not None and vtype.list_size != self.vector_dim:
                    raise CorpusError(
                        f"{path} holds {vtype.list_size}-d vectors where other files hold {self.vector_dim}-d; "
                        "every vector must have the same width"
                    )
                self.vector_dim = vtype.list_size
                if self.vector_dim == 0:
                    raise CorpusError(f"column {spec.vectors_column!r} holds empty vectors (width 0)")

    def _open_npy(self, path: Path) -> None:
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError) as err:  # EOFError: an empty file
            raise CorpusError(f"{path} is not a readable .npy array ({err}); save it with numpy.save") from err
        if array.ndim != 2:
            raise CorpusError(f"{path} holds an array of shape {array.shape}; expected 2-D (rows x dims) vectors")
        if array.shape[1] == 0:
            raise CorpusError(f"{path} holds vectors of width 0 (shape {array.shape}); store one vector per row")
        if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
            raise CorpusError(f"{path} holds {array.dtype} values; expected a float array of vectors")
        self.path, self._array, self.id_column, self.has_text = path, array, None, False
        self.vector_dim = int(array.shape[1])

    @property
    def named_files(self) -> bool:
        """A folder's files: rows without an id column are named "file:row", not numbered."""
        return any(f.name for f in self.files)

    @property
    def precomputed(self) -> bool:
        """Rows carry their own vectors (a vectors column or a .npy file): nothing to encode."""
        return self._array is not None or self.spec.vectors_column is not None

    @property
    def num_rows(self) -> int:
        if self._array is not None:
            return int(self._array.shape[0])
        return sum(f.rows for f in self.files)

    def windows(self, rows: int) -> int:
        """How many windows of ``rows`` rows the corpus has (the last of each file may be shorter)."""
        if self._array is not None:
            return math.ceil(self.num_rows / rows)
        return sum(f.windows(rows) for f in self.files)

    def fingerprint(self) -> str:
        """sha256 of the file's bytes; for several files, of their names and hashes: two corpora with the same
        fingerprint give the same rows."""
        if self._array is not None or len(self.files) == 1 and not self.files[0].name:
            return sha256(self.path if self._array is not None else self.files[0].path)
        digest = hashlib.sha256()
        for f in self.files:
            digest.update(f"{f.name}\t{sha256(f.path)}\n".encode())
        return digest.hexdigest()

    def _columns(self) -> list[str]:
        cols = [c for c in (self.id_column, self.spec.title_column) if c]
        if self.has_text:
            cols.append(self.spec.text_column)
        if self.spec.vectors_column:
            cols.append(self.spec.vectors_column)
        return cols + [c for c in self.spec.columns if c not in cols]

    def _strings(self, rb: pa.RecordBatch, column: str, first_row: int, path: Path | None = None) -> list[str | None]:
        """A text-like column as Python strings; binary is decoded as UTF-8, and refused where it is not (so is
        a column typed as strings whose bytes are not UTF-8: parquet writers need not check)."""
        values = rb.column(column)
        if pa.types.is_dictionary(values.type):
            values = values.dictionary_decode()
        try:
            return values.cast(pa.string()).to_pylist()
        except (pa.ArrowInvalid, UnicodeDecodeError):  # bytes that are not UTF-8: find the row, name it
            text_typed = pa.types.is_string(values.type) or pa.types.is_large_string(values.type)
            raw = values.cast(pa.large_binary()) if text_typed else values
            for i, value in enumerate(raw.to_pylist()):
                try:
                    value is None or bytes(value).decode("utf-8")
                except UnicodeDecodeError:
                    raise CorpusError(
                        f"column {column!r} of {path or self.path} holds bytes that are not UTF-8 text "
                        f"(row {first_row + i}); "
                        "store the texts as UTF-8 strings"
                    ) from None
            raise

    def _texts(self, rb: pa.RecordBatch, first_row: int = 0, path: Path | None = None) -> list[str | None]:
        """The texts to encode and store: the text column, each prefixed by its title when there is one. A
        vectors corpus only stores them, so a text it lacks is an empty one (its vector decides if it is used)."""
        title = self.spec.title_column
        if not self.has_text:
            if title and self.precomputed:  # titles, but no text column: the titles are what hits show
                return ["" if t is None else t for t in self._strings(rb, title, first_row, path)]
            return [""] * rb.num_rows
        texts = self._strings(rb, self.spec.text_column, first_row, path)
        if title:
            titles = self._strings(rb, title, first_row, path)
            texts = [None if t is None else f"{h or ''} {t}".strip() for h, t in zip(titles, texts, strict=True)]
        return ["" if t is None else t for t in texts] if self.precomputed else texts

    def _raw_batches(
        self, rows: int, start: int = 0, stop: int | None = None
    ) -> Iterator[tuple[list[str], list[str | None], pa.RecordBatch]]:
        """(ids, texts, record batch) of windows ``start`` to ``stop`` (exclusive) of ``rows`` rows each."""
        stop = self.windows(rows) if stop is None else stop
        if self._array is not None:  # a window of the array stands in for the record batch
            for first in range(start * rows, min(stop * rows, self.num_rows), rows):
                window = self._npy_window(first, rows)
                yield [str(i) for i in range(first, first + len(window))], [""] * len(window), window  # type: ignore[misc]
            return
        offset = 0  # the global number of each file's first window
        for source in self.files:
            count = source.windows(rows)
            first, last = max(start - offset, 0), min(stop - offset, count)
            offset += count
            if first >= last:
                continue
            row = first * rows
            for rb in _read_rows(source, row, min(last * rows, source.rows), rows, self._columns()):
                yield self._ids(source, rb, row), self._texts(rb, row, source.path), rb
                row += rb.num_rows

    def _ids(self, source: SourceFile, rb: pa.RecordBatch, first_row: int) -> list[str]:
        if not self.id_column:
            prefix = f"{source.name}:" if source.name else ""
            return [f"{prefix}{i}" for i in range(first_row, first_row + rb.num_rows)]
        ids = self._strings(rb, self.id_column, first_row, source.path)
        if any(v is None for v in ids):
            raise CorpusError(f"column {self.id_column!r} of {source.path} has null ids; every row needs an id")
        return ids  # type: ignore[return-value]

    def _npy_window(self, first: int, rows: int) -> np.ndarray:
        """Rows ``first`` to ``first + rows`` of the .npy file as float32, read rather than taken from the mapping:
        mapped pages, once touched, stay in this process, so a build would end holding the whole file."""
        array = self._array
        assert isinstance(array, np.memmap)
        count, dim = min(rows, len(array) - first), array.shape[1]
        if not array.flags.c_contiguous:  # saved in Fortran order: a row is not contiguous in the file
            window = np.asarray(array[first : first + count])
        else:
            offset = array.offset + first * dim * array.dtype.itemsize
            window = np.fromfile(self.path, dtype=array.dtype, count=count * dim, offset=offset).reshape(count, dim)
        return _float32(window, lambda row: f"row {first + row} of {self.path}")

    def _usable(self, texts: list[str | None], rb: pa.RecordBatch) -> np.ndarray:
        if self._array is not None:
            return np.ones(len(texts), dtype=bool)
        if self.spec.vectors_column:
            return np.asarray(rb.column(self.spec.vectors_column).is_valid())
        return np.array([t is not None and not blank(t) for t in texts], dtype=bool)

    def check(self, ids: list[str], texts: list[str | None], rb: pa.RecordBatch) -> Tally:
        """The value checks of one window (null or empty texts, null or non-finite vectors); no duplicates."""
        ok = self._usable(texts, rb)
        tally = Tally(rows=len(ids), usable=int(ok.sum()))
        tally.first_bad = [i for i, good in zip(ids, ok, strict=True) if not good][:FIRST_SHOWN]
        if self.precomputed:
            finite = np.isfinite(self._batch_vectors(rb, ok)).all(axis=1)
            kept = np.flatnonzero(ok)
            tally.nonfinite = int((~finite).sum())
            tally.first_nonfinite = [ids[kept[i]] for i in np.flatnonzero(~finite)[:FIRST_SHOWN]]
        return tally

    def check_windows(self, rows: int, start: int = 0, stop: int | None = None) -> Iterator[tuple[list[str], Tally]]:
        """(ids, tally) of each window from ``start`` to ``stop``: what a worker of a distributed build checks."""
        for ids, texts, rb in self._raw_batches(rows, start, stop):
            yield ids, self.check(ids, texts, rb)

    def validate(self, rows: int = 65536, min_rows: int = 2) -> CorpusReport:
        """One cheap pass over ids and texts: empty texts, duplicate ids, fewer than ``min_rows`` usable rows
        (2 to fit a transform; 1 to add to an index), non-finite vectors. Raises CorpusError.

        Memory: one window, plus 8 bytes per id for the duplicate check (``id_hashes``), never the ids."""
        hashes: list[np.ndarray] = []
        tally = Tally()
        for ids, window in self.check_windows(rows):
            tally.add(window)
            if self.id_column:  # row numbers are unique by construction
                hashes.append(id_hashes(ids))
        duplicate = self._first_duplicate(np.concatenate(hashes), rows) if hashes else None
        if duplicate is not None:
            raise self.duplicate(duplicate)
        return self.conclude(tally, min_rows)

    def duplicate(self, id_: str) -> CorpusError:
        """The error for an id seen twice, naming the file or files that hold it when the corpus has several."""
        where = ""
        if len(self.files) > 1:
            holding = self._files_holding(id_)
            where = f" (twice in {holding[0]})" if len(holding) == 1 else f" (in {holding[0]} and {holding[1]})"
        return CorpusError(
            f"duplicate id {id_!r} in column {self.id_column!r}{where}; ids must be unique "
            "(pick another --id-column, or drop it to use row numbers)"
        )

    def _files_holding(self, id_: str) -> list[str]:
        """The names of the first two files that hold ``id_`` (one name, when a single file holds it twice): a
        second pass over the id column alone, made only to word the error."""
        assert self.id_column is not None
        holding: list[str] = []
        for source in self.files:
            count = 0
            for rb in _read_rows(source, 0, source.rows, 65536, [self.id_column]):
                count += rb.column(0).to_pylist().count(id_)
            if count:
                holding.append(source.name or str(source.path))
            if count > 1 or len(holding) == 2:
                break
        return holding

    def conclude(self, tally: Tally, min_rows: int = 2) -> CorpusReport:
        """The report of a whole pass, or the error for what it found."""
        total, usable = tally.rows, tally.usable
        skipped = total - usable
        what = "null vectors" if self.spec.vectors_column else "null or empty text"
        if total == 0:
            raise CorpusError(f"{self.path} holds no rows; nothing to index")
        if tally.nonfinite:
            raise CorpusError(
                f"{tally.nonfinite} of {total} vectors contain NaN or inf (first ids: "
                f"{', '.join(tally.first_nonfinite)}); fix or drop those rows"
            )
        bad = tally.first_bad
        if skipped and not self.spec.skip_empty:
            raise CorpusError(
                f"{skipped} of {total} rows have {what} (first ids: {', '.join(bad)}); "
                "fix them or pass --skip-empty to leave them out"
            )
        if usable < min_rows:
            need = "to fit a transform" if min_rows > 1 else "to add"
            left = f" ({skipped} skipped for {what})" if skipped else ""
            raise CorpusError(f"{self.path} has {usable} usable row(s){left}; at least {min_rows} are needed {need}")
        if skipped:
            log.warning("skipping %d of %d rows with %s (first ids: %s)", skipped, total, what, ", ".join(bad))
        return CorpusReport(rows=total, usable=usable, skipped=skipped, first_skipped=bad)

    def _first_duplicate(self, hashes: np.ndarray, rows: int) -> str | None:
        """The first id (in row order) seen a second time, or None. ``hashes``: every row's ``id_hashes``; only
        when two are equal are the ids read again, and only those with a repeated hash kept as strings."""
        repeated = repeated_values(hashes)
        if not len(repeated):
            return None
        seen: set[str] = set()
        for ids, _, _ in self._raw_batches(rows):
            for i in (ids[j] for j in np.flatnonzero(np.isin(id_hashes(ids), repeated))):
                if i in seen:
                    return i
                seen.add(i)
        return None  # equal hashes of different ids

    def batches(self, rows: int, skip_batches: int = 0, stop_batches: int | None = None) -> Iterator[Batch]:
        """Usable rows in windows of ``rows`` raw rows (fewer after skipping empty ones), windows
        ``skip_batches`` (to resume a build) to ``stop_batches`` (exclusive; default: to the end). The windows
        skipped are not read."""
        for ids, texts, rb in self._raw_batches(rows, skip_batches, stop_batches):
            ok = self._usable(texts, rb)
            keep = np.flatnonzero(ok)
            vectors = self._batch_vectors(rb, ok) if self.precomputed else None
            title = self.spec.title_column
            titles = None if not title or isinstance(rb, np.ndarray) else self._strings(rb, title, 0)
            columns = None
            if self.spec.columns and not isinstance(rb, np.ndarray):
                columns = pa.Table.from_batches([rb.select(list(self.spec.columns))]).filter(pa.array(ok))
            yield Batch(
                ids=[ids[i] for i in keep],
                texts=[texts[i] or "" for i in keep],
                vectors=vectors,
                titles=None if titles is None else [titles[i] or "" for i in keep],
                columns=columns,
            )

    def _batch_vectors(self, rb: pa.RecordBatch | np.ndarray, ok: np.ndarray) -> np.ndarray:
        """The usable rows' precomputed vectors, float32 (n, d)."""
        if isinstance(rb, np.ndarray):
            return rb[ok]
        assert self.spec.vectors_column is not None
        return _vectors(rb.column(self.spec.vectors_column).filter(pa.array(ok)), self.spec.vectors_column)


def is_text_type(kind: pa.DataType, raw: bool = True) -> bool:
    """Strings, in any of arrow's layouts (pandas writes a categorical column as a dictionary of strings). With
    ``raw`` (a corpus's text and title), also bytes, read as UTF-8, and a column of nulls only (empty texts);
    without (the queries and pairs of an evaluation), strings only."""
    if pa.types.is_dictionary(kind):
        return is_text_type(kind.value_type, raw)
    strings = pa.types.is_string(kind) or pa.types.is_large_string(kind) or str(kind) == "string_view"
    if not raw:
        return strings
    return (
        strings
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
        or pa.types.is_null(kind)
        or str(kind) == "binary_view"
    )


def is_id_type(kind: pa.DataType) -> bool:
    """Ids are strings (or bytes that are UTF-8) or integers; a float id (1.0 vs "1") is refused as ambiguous."""
    return (is_text_type(kind) and not pa.types.is_null(kind)) or pa.types.is_integer(kind)


def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_fixed_size_list(kind) or pa.types.is_list(kind) or pa.types.is_large_list(kind)


def id_hashes(ids: Sequence[str]) -> np.ndarray:
    """64-bit hashes of ids (Python's string hash: stable within one process), 8 bytes per id where a set of the
    strings costs ~100. For finding repeated ids in bounded memory: equal hashes are then checked on the strings."""
    return np.fromiter((hash(i) for i in ids), dtype=np.int64, count=len(ids))


def repeated_values(hashes: np.ndarray) -> np.ndarray:
    """The values that occur more than once in ``hashes``, sorted: the ids worth reading again as strings."""
    ordered = np.sort(hashes)
    return np.unique(ordered[1:][ordered[1:] == ordered[:-1]])


def _find_files(path: Path) -> tuple[list[Path], Path | None]:
    """The files ``path`` names, sorted, and the root their names are relative to (None for a single file); a
    name that is not UTF-8 is refused (ids, the manifest and pyarrow hold names as text)."""
    files, root = _matching_files(path)
    for found in files:
        shown = not_utf8(found)
        if shown is not None:
            raise CorpusError(f"the corpus file name {shown} is not UTF-8: rename the file")
    return files, root


def _matching_files(path: Path) -> tuple[list[Path], Path | None]:
    if path.is_dir():
        found = sorted(
            p
            for p in path.rglob(f"*{PARQUET_SUFFIX}")
            if p.is_file()
            and not any(part.startswith((".", "_")) for part in p.relative_to(path).parts)
            and not _in_an_index(p, path)
        )
        if not found:
            raise CorpusError(f"corpus folder {path} holds no {PARQUET_SUFFIX} files")
        return found, path
    if path.exists() or not any(c in str(path) for c in GLOB_MAGIC):
        if not path.exists():
            raise CorpusError(f"corpus file not found: {path}")
        return [path], None
    root = _glob_root(path)
    globbed = (Path(p) for p in glob.glob(str(path), recursive=True))
    matches = sorted(p for p in globbed if p.is_file() and not _in_an_index(p, root))
    if not matches:
        raise CorpusError(f"no file matches the corpus pattern {path}")
    return matches, root


# An index directory holds this file (``indexdir.MANIFEST``); its stash's parts are parquet files, which a corpus
# folder holding the index (``index data/ --out data/idx``) must not read as corpus files.
INDEX_MANIFEST = "manifest.json"


def _in_an_index(path: Path, root: Path) -> bool:
    """Whether ``path``, a file found under ``root``, lies inside an index directory kept in the corpus folder."""
    folder = path.parent
    while folder != root and root in folder.parents:
        if (folder / INDEX_MANIFEST).is_file():
            log.info("leaving out %s: it belongs to the index directory %s", path, folder)
            return True
        folder = folder.parent
    return False


def _glob_root(pattern: Path) -> Path:
    """The directory part of a glob before its first wildcard (``data/2024`` for ``data/2024/*/part-*.parquet``)."""
    parts = pattern.parts
    fixed = next(i for i, part in enumerate(parts) if any(c in part for c in GLOB_MAGIC))
    return Path(*parts[:fixed]) if fixed else Path(".")


def _read_rows(source: SourceFile, start: int, stop: int, rows: int, columns: list[str]) -> Iterator[pa.RecordBatch]:
    """Rows ``start`` to ``stop`` of a file in record batches of ``rows`` rows (the last may be shorter).

    Only the row groups that hold those rows are read; a window that starts inside a row group re-cuts the
    batches pyarrow gives from that group's first row."""
    bounds = np.cumsum((0, *source.group_rows))
    groups = [g for g in range(len(source.group_rows)) if bounds[g] < stop and bounds[g + 1] > start]
    if not groups:
        return
    first = int(bounds[groups[0]])
    try:
        # pre_buffer off: with it, memory grew with every window read (2.2 GB after 850k rows of 384-d
        # vectors, read window by window; 0.65 GB without), and reads are local files, where it gains nothing
        with pq.ParquetFile(source.path, pre_buffer=False) as reader:
            batches = reader.iter_batches(batch_size=rows, row_groups=groups, columns=columns)
            yield from _recut(batches, start - first, rows, stop - start)
    except FileNotFoundError as err:  # gone since the corpus was opened, or not there for this process
        raise CorpusError(f"{source.path} is no longer there ({err}); every reader must see the corpus") from err
    except (OSError, pa.ArrowException) as err:  # a file that breaks part-way: corrupt pages, truncated
        raise CorpusError(
            f"{source.path} cannot be read from row {first:,} on ({err}); the file is corrupt or truncated: "
            "write it again"
        ) from err


def _recut(batches: Iterable[pa.RecordBatch], skip: int, rows: int, total: int) -> Iterator[pa.RecordBatch]:
    """The ``total`` rows after the first ``skip`` of a stream of record batches, cut into batches of ``rows``."""
    pending: list[pa.RecordBatch] = []
    have = 0
    for batch in batches:
        if skip >= batch.num_rows:
            skip -= batch.num_rows
            continue
        if skip:
            batch, skip = batch.slice(skip), 0
        pending.append(batch)
        have += batch.num_rows
        while total and have >= min(rows, total):
            take = min(rows, total)
            if len(pending) == 1 and pending[0].num_rows == take:  # pyarrow's batch is the window: no copy
                out, pending = pending[0], []
            else:
                table = pa.Table.from_batches(pending)
                out = table.slice(0, take).combine_chunks().to_batches()[0]
                pending = table.slice(take).combine_chunks().to_batches()
            have -= take
            total -= take
            yield out
        if not total:
            return
    if total and have:
        yield pa.Table.from_batches(pending).slice(0, total).combine_chunks().to_batches()[0]


def _vectors(column: pa.Array, name: str) -> np.ndarray:
    """A list column as a float32 matrix; ragged lists are refused."""
    if len(column) == 0:
        return np.zeros((0, 0), dtype=np.float32)
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    if lengths.max() == 0:
        raise CorpusError(f"column {name!r} holds empty vectors (lists of length 0); store one vector per row")
    if lengths.min() != lengths.max():
        raise CorpusError(f"column {name!r} holds vectors of different lengths ({lengths.min()}..{lengths.max()})")
    flat = column.flatten().to_numpy(zero_copy_only=False).reshape(len(column), int(lengths[0]))
    return _float32(flat, lambda row: f"column {name!r}")


def _float32(vectors: np.ndarray, where: Callable[[int], str]) -> np.ndarray:
    """``vectors`` as float32, refused in one line when a finite value is beyond float32's range (the cast would
    make it inf, reported as if the input held one). ``where(row)`` names the first such row for the message."""
    if vectors.dtype.itemsize > 4 and vectors.dtype.kind == "f":
        big = np.isfinite(vectors) & (np.abs(vectors) > np.finfo(np.float32).max)
        if big.any():
            row, col = np.argwhere(big)[0]
            raise CorpusError(
                f"{where(int(row))} holds {vectors[row, col]:.3g}, beyond float32's range (±3.4e38): vectors are "
                "indexed as float32; rescale them (e.g. to unit length)"
            )
    return vectors.astype(np.float32, copy=False)
