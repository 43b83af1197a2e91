"""Row -> (id, text[, title]) of an index, and its kept metadata columns: uncompressed Arrow IPC files, memory-mapped.

Any row's id and text is one lookup into the map (no row group to decompress per query, which cost a service
7 ms of a 13 ms search when the texts were in parquet), threads share it without locks, and it is never read
whole into RAM: the page cache holds what searches touch.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import overload

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from retrieval.errors import CorpusError, IndexDirError
from retrieval.files import touch_pages

SCHEMA = pa.schema([("id", pa.string()), ("text", pa.string())])
TITLED = SCHEMA.append(pa.field("title", pa.string()))  # an index built with a title column


def write_docs(tables: Iterable[pa.Table], path: Path, titled: bool = False) -> int:
    """Write (id, text) tables, in row order, as one Arrow IPC file; returns the number of rows. ``titled``: with
    their title column too (null for a table without one: rows added without a title column)."""
    schema = TITLED if titled else SCHEMA
    rows = 0
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for table in tables:
            if titled and "title" not in table.column_names:
                table = table.append_column("title", pa.nulls(table.num_rows, pa.string()))
            writer.write_table(table.select(schema.names).cast(schema))
            rows += table.num_rows
    return rows


class ColumnsWriter:
    """The kept metadata columns of every row, written window by window in row order (``columns.arrow``). The
    first window fixes each column's type; later windows (other files, an ``add``) are cast to it or refused."""

    def __init__(self, path: Path, schema: pa.Schema | None = None):
        self.path, self.schema = path, schema
        self.rows = 0
        self._sink: pa.OSFile | None = None
        self._writer: pa.ipc.RecordBatchFileWriter | None = None

    def write(self, table: pa.Table) -> None:
        if self.schema is None:
            self.schema = table.schema
        if self._writer is None:
            self._sink = pa.OSFile(str(self.path), "wb")
            self._writer = pa.ipc.new_file(self._sink, self.schema)
        if table.schema != self.schema:
            try:
                table = table.select(self.schema.names).cast(self.schema)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, KeyError) as err:
                kept = ", ".join(f"{f.name} ({f.type})" for f in self.schema)
                raise CorpusError(f"these rows' metadata columns do not match the index's: {kept} ({err})") from err
        self._writer.write_table(table)
        self.rows += table.num_rows

    def close(self) -> None:
        if self._writer is None and self.schema is not None:  # no rows at all: still a valid, empty file
            self.write(self.schema.empty_table())
        if self._writer is not None:
            self._writer.close()
        if self._sink is not None:
            self._sink.close()


def read_columns(path: Path) -> pa.Table:
    """The kept metadata columns, memory-mapped (a filter reads them where they lie)."""
    try:
        return pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
    except (OSError, pa.ArrowInvalid) as err:
        raise IndexDirError(f"cannot read {path}: {err}; rebuild the index") from err


class Docs:
    """The docs file of an index, memory-mapped; ``id(row)``, ``texts(rows)``, ``titles(rows)``."""

    def __init__(self, path: Path):
        try:
            table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
        except (OSError, pa.ArrowInvalid) as err:
            raise IndexDirError(f"cannot read {path}: {err}; rebuild the index") from err
        if table.schema not in (SCHEMA, TITLED):
            raise IndexDirError(f"{path} holds {table.schema.names}, not (id, text[, title]); rebuild the index")
        self._ids = table.column("id")
        self._texts = table.column("text")
        self._titles = table.column("title") if table.schema == TITLED else None
        # each chunk's first row, as a Python list: one hit's lookup is a bisect (~0.2 us), where a scalar
        # np.searchsorted costs several microseconds, and 10 hits look up 20-30 times
        self._starts = np.cumsum([0] + [len(chunk) for chunk in self._ids.chunks]).tolist()

    def __len__(self) -> int:
        return len(self._ids)

    def _columns(self) -> list[pa.ChunkedArray]:
        return [self._ids, self._texts] + ([] if self._titles is None else [self._titles])

    @property
    def nbytes(self) -> int:
        return int(sum(column.nbytes for column in self._columns()))

    def prefault(self) -> int:
        """Make every page of the ids and texts resident (hits would bring them in one request at a time)."""
        return sum(
            touch_pages(buffer)
            for column in self._columns()
            for chunk in column.chunks
            for buffer in chunk.buffers()
            if buffer is not None
        )

    def _locate(self, row: int) -> tuple[int, int]:
        if not 0 <= row < len(self):
            raise IndexError(f"row {row} is outside the {len(self)} documents")
        chunk = bisect.bisect_right(self._starts, row) - 1
        return chunk, row - self._starts[chunk]

    def id(self, row: int) -> str:
        chunk, offset = self._locate(row)
        return str(self._ids.chunk(chunk)[offset].as_py())

    def texts(self, rows: Sequence[int]) -> list[str]:
        return [text for _, text, _ in self.records(rows)]

    def records(self, rows: Sequence[int]) -> list[tuple[str, str, str | None]]:
        """(id, text, title) of each row (title None without a title column): one lookup a row, for hits."""
        out = []
        for row in rows:
            chunk, offset = self._locate(int(row))
            title = None if self._titles is None else self._titles.chunk(chunk)[offset].as_py()
            out.append(
                (str(self._ids.chunk(chunk)[offset].as_py()), str(self._texts.chunk(chunk)[offset].as_py()), title)
            )
        return out

    def titles(self, rows: Sequence[int]) -> list[str | None] | None:
        """The rows' titles (None for a row without one); None for an index built without a title column."""
        return None if self._titles is None else [title for *_, title in self.records(rows)]

    def count_in(self, ids: Collection[str]) -> int:
        """How many rows have one of ``ids`` (one vectorised pass over the mapped ids, none turned into Python)."""
        if not ids:
            return 0
        return int(pc.sum(pc.is_in(self._ids, value_set=pa.array(sorted(ids), pa.string()))).as_py() or 0)

    @property
    def ids(self) -> DocIds:
        """Every id, in row order, as a read-only sequence over the map: ``ids[row]`` is one lookup, and the ids
        are never all turned into Python strings (a list of 1M ids is ~80 MB)."""
        return DocIds(self)


class DocIds(Sequence[str]):
    """Row -> id of a ``Docs``, looked up on access. Equal to any sequence holding the same ids in the same order."""

    def __init__(self, docs: Docs):
        self._docs = docs

    def __len__(self) -> int:
        return len(self._docs)

    @overload
    def __getitem__(self, row: int) -> str: ...

    @overload
    def __getitem__(self, row: slice) -> list[str]: ...

    def __getitem__(self, row: int | slice) -> str | list[str]:
        if isinstance(row, slice):
            return [self._docs.id(r) for r in range(len(self))[row]]
        row = operator.index(row)
        if not -len(self) <= row < len(self):
            raise IndexError(f"row {row} is outside the {len(self)} documents")
        return self._docs.id(row % len(self))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str) or len(other) != len(self):
            return False
        return all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]
