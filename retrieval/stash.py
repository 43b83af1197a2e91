"""The vector stash: raw encoder vectors on disk in append-only parts, with the ids and texts beside them.

A part is one ``.npy`` per pooling plus a ``.parquet`` of (id, text), each written to a temporary name and
renamed into place, with its size and sha256 taken as it is written. ``stash.json`` lists the registered
parts, in row order, with those checksums; it is rewritten atomically after each registration, so after a crash
the stash holds exactly the parts ``stash.json`` lists and a resumed build continues from there. Parts can be
written by one process and registered by another (``write_part`` then ``register``: the distributed build's
workers write, its driver registers). Reading is by memory map, opened once per part, so the whole stash is
never in RAM; ``verify`` checks the parts against their checksums before a writer builds on them.

An int8 stash keeps each part's vectors as each row's length and 8-bit codes of its direction with a range per
dimension (``quantize``): a quarter of float32's bytes, the codes memory-mapped and decoded to float32 only for the
rows read. Its parts carry two more files, ``<stem>.<pooling>.scale.npy`` (each dimension's low end and step) and
``<stem>.<pooling>.norms.npy`` (each row's length), and its ``stash.json`` format 4, which older versions refuse
rather than read codes as vectors. Format 3 (codes of the vectors themselves, no lengths) is still read.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import threading
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from retrieval.errors import ConfigError, CorpusError, IndexDirError
from retrieval.files import inside, more_open_files, part_fingerprint, sha256, write_atomic
from retrieval.moments import RunningMoments

STASH_FORMAT = 2
CODED_FORMAT = 3  # an int8 stash of codes of the vectors: parts with scale files (read, no longer written)
NORMED_FORMAT = 4  # an int8 stash of codes of each row's direction: parts with scale and norms files
READ_FORMATS = (STASH_FORMAT, CODED_FORMAT, NORMED_FORMAT)
STATE_NAME = "stash.json"
DTYPES = ("float32", "float16", "int8")
BLOCK_ROWS = 65536  # rows per block when streaming the stash
PRECISION_LOST = 1e-3  # float16 rounding error, as a share of a part's spread, refused (embeddings: ~1e-7)
PRECISION_ROWS = (64, 1024)  # parts of fewer rows are not judged; of more, the first 1,024
Titles = Sequence[str | None] | None  # a part's titles, row by row; None: the corpus had no title column


def titles_of(docs: pa.Table) -> list[str | None] | None:
    """The title column of a part's (id, text[, title]) table, or None without one."""
    return docs["title"].to_pylist() if "title" in docs.column_names else None


# int8 rounding error refused above this share of a part's spread: 255 steps over each dimension's range of the
# rows' directions leave ~1e-4 for sentence embeddings; rows that all point almost the same way, but for a few
# pointing elsewhere, leave the others' differences within one step
PRECISION_LOST_INT8 = 1e-2


def quantize(vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int8 codes of ``vectors`` (n, d), their scale (2, d) float32 and each row's length (n,) float32.

    Each row is divided by its length and the directions are coded: 255 steps spanning each dimension's range over
    these rows (a constant dimension: step 1, every code the same), rounded to the nearest. Cosine re-scoring
    needs only the direction, and coding the rows as they are gave a short row the steps set by the long ones:
    its relative error grew with the spread of the lengths (1.5 to 8.5 among CACM's MiniLM vectors). Coding
    directions cut the rms error of a re-scored cosine by 1.1-1.8x on the four IR sets, for 4 bytes a row."""
    vectors = np.asarray(vectors, dtype=np.float32)
    n, d = vectors.shape
    if not n:
        return np.empty((0, d), dtype=np.int8), np.stack([np.zeros(d), np.ones(d)]).astype(np.float32), np.empty(0)
    norms = np.sqrt(np.einsum("ij,ij->i", vectors, vectors, dtype=np.float64))
    unit = vectors / np.where(norms > 0, norms, 1.0)[:, None]  # a zero row stays zero
    low, high = unit.min(axis=0), unit.max(axis=0)
    step = (high - low) / 255
    step[step <= 0] = 1.0
    codes = np.clip(np.rint((unit - low) / step), 0, 255) - 128
    return codes.astype(np.int8), np.stack([low, step]).astype(np.float32), norms.astype(np.float32)


def dequantize(codes: np.ndarray, scale: np.ndarray, norms: np.ndarray | None = None) -> np.ndarray:
    """float32 vectors of int8 ``codes``, their ``scale`` and row lengths (``quantize``; None: a format-3 part,
    whose codes are of the vectors themselves)."""
    decoded = scale[0] + (np.asarray(codes, dtype=np.float32) + 128) * scale[1]
    if norms is not None:
        decoded *= np.asarray(norms, dtype=np.float32)[:, None]
    return decoded.astype(np.float32, copy=False)


def in_range(rows: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """``starts`` (each part's first global row, and the total last), once ``rows`` are checked to be in range."""
    if len(rows) and (rows.min() < 0 or rows.max() >= starts[-1]):
        raise IndexError(f"stash rows must be in [0, {starts[-1]})")
    return starts


@dataclass(frozen=True)
class PreadTable:
    """What ``pread`` re-scoring needs of every part of one pooling, as arrays: the part count it was made for,
    each part's first global row (and the total last), its kept descriptor and where its rows start in the file,
    the stored dtype; an int8 stash's scales (2, parts, d) and every row's length (1 in a format-3 part)."""

    parts: int
    starts: np.ndarray
    descriptors: np.ndarray
    offsets: np.ndarray
    dtype: np.dtype
    scales: np.ndarray | None
    lengths: np.ndarray | None


@dataclass(frozen=True)
class Part:
    """One written part: its rows, its files (pooling -> .npy name, and the docs .parquet), their checksums."""

    rows: int
    vectors: dict[str, str]
    docs: str
    source_batches: int = 1
    checksums: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {bytes, sha256, sampled_sha256}
    scales: dict[str, str] = field(default_factory=dict)  # pooling -> .scale.npy name (int8 stashes only)
    norms: dict[str, str] = field(default_factory=dict)  # pooling -> .norms.npy name (int8, format 4 on)

    @property
    def names(self) -> list[str]:
        return [self.docs, *self.vectors.values(), *self.scales.values(), *self.norms.values()]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Part:
        return cls(
            rows=int(data["rows"]),
            vectors=dict(data["vectors"]),
            docs=str(data["docs"]),
            source_batches=int(data.get("source_batches", 1)),
            checksums=dict(data.get("checksums", {})),
            scales=dict(data.get("scales", {})),
            norms=dict(data.get("norms", {})),
        )


class VectorStash:
    """Append-only parts of raw vectors (one array per pooling) plus a docs table; see the module docstring."""

    def __init__(self, root: Path, state: dict[str, Any]):
        self.root = Path(root)
        self.state = state
        self._parts = [Part.from_dict(p) for p in state["parts"]]
        self._maps: dict[tuple[str, int], np.ndarray] = {}
        self._scales: dict[tuple[str, int], tuple[np.ndarray, np.ndarray | None]] = {}
        self._files: dict[tuple[str, int], tuple[int, int, np.dtype]] = {}  # pread: descriptor, data offset, dtype
        self._tables: dict[str, PreadTable] = {}  # pread: every part's file and scale at once, per pooling
        self._maps_lock = threading.Lock()

    # ----- creation and opening -----------------------------------------------------------------------
    @classmethod
    def create(
        cls, root: Path, dim: int, poolings: Sequence[str], dtype: str = "float32", meta: dict | None = None
    ) -> VectorStash:
        if dtype not in DTYPES:
            raise ConfigError(f"unknown `stash_dtype` {dtype!r}; choose one of {', '.join(DTYPES)}", "stash_dtype")
        root.mkdir(parents=True, exist_ok=True)
        version = NORMED_FORMAT if dtype == "int8" else STASH_FORMAT
        state = {"format": version, "dim": dim, "dtype": dtype, "poolings": list(poolings), "meta": meta or {}}
        stash = cls(root, state | {"parts": []})
        stash._save_state()
        return stash

    @classmethod
    def open(cls, root: Path) -> VectorStash:
        path = Path(root) / STATE_NAME
        if not path.is_file():
            raise IndexDirError(f"no vector stash at {root}; rebuild the index keeping its vectors")
        try:
            state = json.loads(path.read_text())
            version = state.get("format")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as err:
            raise IndexDirError(f"{path} is unreadable ({err}); rebuild the index") from err
        if version not in READ_FORMATS:
            raise IndexDirError(
                f"the stash at {root} has format {version}; this version reads format "
                f"{' or '.join(map(str, READ_FORMATS))}"
            )
        stash = cls(Path(root), state)
        for part in stash._parts:  # a name from a file is never trusted to point outside the stash
            for name in part.names:
                if not inside(stash.root, name):
                    raise IndexDirError(f"{path} names a part file outside the stash ({name!r}); rebuild the index")
        return stash

    def _save_state(self) -> None:
        self.state["parts"] = [p.to_dict() for p in self._parts]
        if any(p.norms for p in self._parts):  # a format-3 stash that gained parts of directions
            self.state["format"] = NORMED_FORMAT
        write_atomic(self.root / STATE_NAME, json.dumps(self.state, indent=1).encode())

    # ----- properties ---------------------------------------------------------------------------------
    @property
    def dim(self) -> int:
        return int(self.state["dim"])

    @property
    def dtype(self) -> str:
        return str(self.state["dtype"])

    @property
    def poolings(self) -> list[str]:
        return list(self.state["poolings"])

    @property
    def meta(self) -> dict[str, Any]:
        return dict(self.state["meta"])

    @property
    def parts(self) -> list[Part]:
        return list(self._parts)

    def __len__(self) -> int:
        return sum(p.rows for p in self._parts)

    @property
    def source_batches(self) -> int:
        return sum(p.source_batches for p in self._parts)

    def files(self) -> list[Path]:
        """``stash.json`` and every part file, as paths."""
        return [self.root / STATE_NAME] + [self.root / name for part in self._parts for name in part.names]

    # ----- writing ------------------------------------------------------------------------------------
    def write_part(
        self,
        stem: str,
        vectors: dict[str, np.ndarray],
        ids: Sequence[str],
        texts: Sequence[str],
        source_batches: int = 1,
        *,
        titles: Titles = None,
    ) -> Part:
        """Write one part's files under ``stem`` (unique per writer) without registering it; returns its record.
        ``titles``: the corpus's title column, kept beside the texts (which begin with them) for hits to show.

        Writing the same stem again replaces the files with identical bytes, so a retried writer is harmless."""
        checksums: dict[str, dict[str, Any]] = {}
        names, scales, norms = {}, {}, {}
        for pooling in self.poolings:
            self._check_range(vectors[pooling], ids)
            array, coded = self._encode(vectors[pooling])
            self._check_precision(vectors[pooling], array if coded is None else dequantize(array, *coded))
            if array.shape != (len(ids), self.dim):
                raise ValueError(f"part {stem}: vectors {array.shape} for {len(ids)} rows of dimension {self.dim}")
            names[pooling] = f"{stem}.{pooling}.npy"
            checksums[names[pooling]] = self._write(names[pooling], _npy(array))
            if coded is not None:
                scales[pooling], norms[pooling] = f"{stem}.{pooling}.scale.npy", f"{stem}.{pooling}.norms.npy"
                checksums[scales[pooling]] = self._write(scales[pooling], _npy(coded[0]))
                checksums[norms[pooling]] = self._write(norms[pooling], _npy(coded[1]))
        table = pa.table({"id": pa.array(list(ids), pa.string()), "text": pa.array(list(texts), pa.string())})
        if titles is not None:
            table = table.append_column("title", pa.array(list(titles), pa.string()))
        buffer = io.BytesIO()
        pq.write_table(table, buffer)
        checksums[f"{stem}.parquet"] = self._write(f"{stem}.parquet", buffer.getvalue())
        return Part(len(ids), names, f"{stem}.parquet", source_batches, checksums, scales, norms)

    def _encode(self, vectors: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
        """The array a part file holds, and its scale and row lengths (int8 only)."""
        if self.dtype == "int8":
            codes, scale, norms = quantize(vectors)
            return codes, (scale, norms)
        return np.ascontiguousarray(vectors, dtype=self.dtype), None

    def stored(self, vectors: np.ndarray) -> np.ndarray:
        """``vectors`` (one part's) as this stash gives them back: float32 after its rounding."""
        array, coded = self._encode(vectors)
        return array.astype(np.float32, copy=False) if coded is None else dequantize(array, *coded)

    def _check_range(self, vectors: np.ndarray, ids: Sequence[str]) -> None:
        """Refuse values a 16-bit stash cannot hold: cast, they became inf, and the build failed later on "NaN or
        inf values" in vectors that had none."""
        if self.dtype != "float16":
            return
        beyond = np.abs(vectors) > np.finfo(np.float16).max
        rows = np.flatnonzero(beyond.any(axis=1))
        if len(rows):
            first = rows[0]
            value = float(vectors[first][beyond[first]][0])
            held = "1 row holds" if len(rows) == 1 else f"{len(rows):,} rows hold"
            raise CorpusError(
                f"{held} values beyond the float16 stash's range (+-65,504; first: id {ids[first]!r}, {value:g}): "
                "scale the vectors, or build the index with a float32 stash (`index --stash-dtype float32`)"
            )

    def _check_precision(self, vectors: np.ndarray, stored: np.ndarray) -> None:
        """Refuse rows a 16-bit stash would blur into each other: float16 keeps ~3 significant digits, so vectors
        that differ by less than that from their common value (a spread of 1e-2 about 1e4), or that are below its
        smallest step (~6e-8), came back identical or zero, and the index built from them was all zeros. Judged
        on the first rows of a part of many (a few near-duplicate rows, such as a small add, say nothing of the
        corpus): the rounding error's energy against their spread about their mean, ~1e-7 for sentence
        embeddings; refused above 1e-3. An int8 stash spans each dimension's range of the rows'
        directions in 255 steps, so a few rows pointing far from the rest make the steps too coarse for every
        other row: judged row by row (error against the row's spread about the median row), the typical row's
        loss refused above 1e-2."""
        if self.dtype == "float32" or len(vectors) < PRECISION_ROWS[0]:
            return
        sample = np.asarray(vectors[: PRECISION_ROWS[1]], dtype=np.float32)
        rounded = sample - stored[: PRECISION_ROWS[1]].astype(np.float32)
        if self.dtype == "int8":
            centred = sample - np.median(sample, axis=0)
            spreads, errors = (centred * centred).sum(axis=1), (rounded * rounded).sum(axis=1)
            moved = spreads > 0  # identical rows stay identical: nothing is lost
            error, spread = (
                (float(np.median(errors[moved])), float(np.median(spreads[moved]))) if moved.any() else (0, 0)
            )
            limit = PRECISION_LOST_INT8
        else:
            centred = sample - sample.mean(axis=0)
            spread, error, limit = float(np.vdot(centred, centred)), float(np.vdot(rounded, rounded)), PRECISION_LOST
        if spread > 0 and error > limit * spread:
            raise CorpusError(
                f"a {self.dtype} stash would round these vectors' differences away (rounding error "
                f"{error / spread:.1e} of their spread; values up to {np.abs(sample).max():.3g}): build the index "
                "with a float32 stash (`index --stash-dtype float32`)"
            )

    def _write(self, name: str, data: bytes) -> dict[str, Any]:
        write_atomic(self.root / name, data)
        sampled = part_fingerprint(self.root / name)  # read back from the page cache: the same bytes
        return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "sampled_sha256": sampled}

    def register(self, parts: Sequence[Part]) -> None:
        """Append written parts, in the given order (their row order), and save ``stash.json``."""
        for part in parts:
            if set(part.vectors) != set(self.poolings):
                raise ValueError(f"part {part.docs} holds poolings {sorted(part.vectors)}, not {self.poolings}")
        self._parts.extend(parts)
        self._save_state()

    def append(
        self,
        vectors: dict[str, np.ndarray],
        ids: Sequence[str],
        texts: Sequence[str],
        source_batches: int = 1,
        *,
        titles: Titles = None,
    ) -> Part:
        """Write and register the next part. ``source_batches`` counts the corpus record batches it covers."""
        part = self.write_part(self._next_stem(), vectors, ids, texts, source_batches, titles=titles)
        self.register([part])
        return part

    def merge_tail(self, rows: int) -> None:
        """Merge the trailing parts into one while their rows together fit ``rows`` and the largest part, and
        delete their files. Every ``add`` writes a part, so a stash grown by small adds had a part per add, and a
        reader holds a descriptor per part (``_map``): 150 one-row adds were 155 parts and 155 open files. With
        this after each add, parts grow with the rows, not with the adds, and an add copies at most that many
        earlier rows: never the build's full parts, nor every part a ``remove`` rewrote shorter."""
        if not self._parts:
            return
        short = min(rows, max(p.rows for p in self._parts))
        tail, total = 0, 0  # the merged part stays within ``short`` rows: parts a ``remove`` rewrote shorter
        while tail < len(self._parts) and total + self._parts[-1 - tail].rows <= short:  # are not all copied again
            total += self._parts[-1 - tail].rows
            tail += 1
        if tail < 2:
            return
        first = len(self._parts) - tail
        merged = self._parts[first:]
        # an int8 stash's rows are coded again on the merged rows' ranges (within a step of their values)
        vectors = {
            pooling: np.concatenate([self._decoded(pooling, n) for n in range(first, len(self._parts))])
            for pooling in self.poolings
        }
        docs = pa.concat_tables(self.iter_docs(first), promote_options="default")  # parts with titles and without
        ids, texts, titles = docs["id"].to_pylist(), docs["text"].to_pylist(), titles_of(docs)
        batches = sum(p.source_batches for p in merged)
        part = self.write_part(self._next_stem(), vectors, ids, texts, batches, titles=titles)
        with self._maps_lock:
            self._maps = {key: array for key, array in self._maps.items() if key[1] < first}
            self._scales = {key: scale for key, scale in self._scales.items() if key[1] < first}
            stale = [descriptor for key, (descriptor, *_) in self._files.items() if key[1] >= first]
            self._files = {key: opened for key, opened in self._files.items() if key[1] < first}
            self._tables = {}
        for descriptor in stale:  # a number at or past ``first`` names the merged part from now on
            os.close(descriptor)
        self._parts[first:] = [part]
        self._save_state()
        for old in merged:
            for name in old.names:
                (self.root / name).unlink()

    def _next_stem(self) -> str:
        """``part-NNNNN`` numbered past every registered part: the part count in a stash only ever appended to,
        but a ``remove`` that emptied a part leaves fewer parts than numbers, and a reused name would overwrite one.
        """
        numbers = [int(m.group(1)) for part in self._parts if (m := re.match(r"part-(\d+)", part.docs))]
        return f"part-{max(numbers, default=len(self._parts) - 1) + 1:05d}"

    # ----- checking -----------------------------------------------------------------------------------
    def verify(self, full: bool = True, docs: bool = False, sampled: str | None = None) -> None:
        """Every part file present with its recorded size, and (``full``) its recorded sha256; ``docs``: the sha256
        of the (id, text) files even when not ``full`` (for a writer that reads those and only links the vectors);
        ``sampled``: the sampled hash (``files.part_fingerprint``) of that pooling's vectors, where the part
        recorded one (parts written before it was kept: sizes only), for a reader that maps them."""
        for part in self._parts:
            for name in part.names:
                path = self.root / name
                record = part.checksums.get(name)
                if record is None or not path.is_file():
                    raise IndexDirError(f"stash file {path} is missing or unrecorded; rebuild the index")
                hashed = full or (docs and name == part.docs)
                bad = path.stat().st_size != record["bytes"] or (hashed and sha256(path) != record["sha256"])
                if not (bad or hashed) and sampled and name == part.vectors.get(sampled) and "sampled_sha256" in record:
                    bad = part_fingerprint(path) != record["sampled_sha256"]
                if bad:
                    raise IndexDirError(f"stash file {path} is corrupt (checksum mismatch); rebuild the index")

    # ----- reading ------------------------------------------------------------------------------------
    def check_pooling(self, pooling: str | None) -> str:
        pooling = pooling or self.poolings[0]
        if pooling not in self.poolings:
            raise ConfigError(
                f"the stash holds poolings {', '.join(self.poolings)}, not {pooling!r}; "
                "build with `extra_pooling` to keep more",
                "pooling",
            )
        return pooling

    def _map(self, pooling: str, number: int, keep: bool = True) -> np.ndarray:
        """Part ``number``'s vectors as a read-only memory map.

        ``keep``: opened once and kept, for random access (re-scoring). Otherwise a map of the caller's own, unmapped
        when it is dropped (streaming passes): a kept map's pages stay in the process's resident set, so a pass
        over kept maps would end holding the whole stash (as page cache charged to it), however it is read."""
        key = (pooling, number)
        with self._maps_lock:
            if key in self._maps:
                return self._maps[key]
        part = self._parts[number]
        path = self.root / part.vectors[pooling]
        try:
            for attempt in (1, 2):  # each kept map holds a descriptor: past the soft limit, raise it and retry once
                try:  # (whichever thread raised it)
                    array = np.load(path, mmap_mode="r", allow_pickle=False)
                    break
                except OSError as err:
                    if err.errno != errno.EMFILE or attempt == 2:
                        raise
                    more_open_files()
        except (OSError, ValueError, EOFError) as err:  # EOFError: an empty file
            advice = ""
            if getattr(err, "errno", None) == errno.EMFILE:
                advice = f"; the stash has {len(self._parts):,} parts and re-scoring keeps each open: raise `ulimit -n`"
            raise IndexDirError(f"cannot read stash part {part.vectors[pooling]}: {err}{advice}") from err
        if array.shape != (part.rows, self.dim):
            raise IndexDirError(f"stash part {part.vectors[pooling]} has shape {array.shape}; rebuild")
        if not keep:
            return array
        with self._maps_lock:
            return self._maps.setdefault(key, array)

    def _scale(self, pooling: str, number: int) -> tuple[np.ndarray, np.ndarray | None] | None:
        """Part ``number``'s int8 scale (2, d) and row lengths (None in a format-3 part), read once and kept;
        None for a float stash."""
        if self.dtype != "int8":
            return None
        key = (pooling, number)
        with self._maps_lock:
            if key in self._scales:
                return self._scales[key]
        coded = self._read_scale(pooling, number)
        with self._maps_lock:
            return self._scales.setdefault(key, coded)

    def _read_scale(self, pooling: str, number: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Part ``number``'s int8 scale and row lengths, read from its files (not kept)."""
        part = self._parts[number]
        name, norms_name = part.scales.get(pooling), part.norms.get(pooling)
        try:
            scale = np.load(self.root / name, allow_pickle=False) if name else None
            norms = np.load(self.root / norms_name, allow_pickle=False) if norms_name else None
        except (OSError, ValueError, EOFError) as err:
            raise IndexDirError(f"cannot read stash part {name}: {err}; rebuild the index") from err
        if scale is None or scale.shape != (2, self.dim) or (norms is not None and norms.shape != (part.rows,)):
            raise IndexDirError(f"stash part {part.docs} has no valid int8 scale; rebuild the index")
        return scale.astype(np.float32), None if norms is None else norms.astype(np.float32)

    def _decoded(self, pooling: str, number: int, rows: Any = slice(None), keep: bool = False) -> np.ndarray:
        """float32 rows of part ``number`` (all, a slice or an index array), decoded where the stash is int8."""
        array = np.asarray(self._map(pooling, number, keep))[rows]
        coded = self._scale(pooling, number)
        if coded is None:
            return np.asarray(array, dtype=np.float32)
        scale, norms = coded
        return dequantize(array, scale, None if norms is None else norms[rows])

    def iter_parts(self, pooling: str | None = None) -> Iterator[np.ndarray]:
        """Each part's vectors as a read-only memory map (float32, float16 or int8 codes as stored), kept open."""
        pooling = self.check_pooling(pooling)
        for number in range(len(self._parts)):
            yield self._map(pooling, number)

    def iter_blocks(self, block_rows: int = BLOCK_ROWS, pooling: str | None = None) -> Iterator[np.ndarray]:
        """float32 blocks (copies) of at most ``block_rows`` rows, in row order, never crossing a part. A streaming
        pass: each part is mapped only while it is read, so memory is one block whatever the stash's size."""
        pooling = self.check_pooling(pooling)
        for number in range(len(self._parts)):
            rows = self._parts[number].rows
            for start in range(0, rows, block_rows):
                yield np.array(self._decoded(pooling, number, slice(start, start + block_rows)), dtype=np.float32)

    def _opened(self, pooling: str, number: int) -> tuple[int, int, np.dtype]:
        """Part ``number``'s vector file for ``pread``: a descriptor kept open, where its rows start, their dtype."""
        key = (pooling, number)
        with self._maps_lock:
            if key in self._files:
                return self._files[key]
        part = self._parts[number]
        path = self.root / part.vectors[pooling]
        try:
            with open(path, "rb") as f:
                version = np.lib.format.read_magic(f)
                header = (
                    np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                )
                shape, fortran, dtype = header(f)
                offset = f.tell()
            try:
                descriptor = os.open(path, os.O_RDONLY)
            except OSError as err:  # a descriptor kept per part, as a kept map holds one: the same limit
                if err.errno != errno.EMFILE:
                    raise
                more_open_files()
                descriptor = os.open(path, os.O_RDONLY)
        except (OSError, ValueError) as err:
            raise IndexDirError(f"cannot read stash part {part.vectors[pooling]}: {err}") from err
        if shape != (part.rows, self.dim) or fortran:
            os.close(descriptor)
            raise IndexDirError(f"stash part {part.vectors[pooling]} has shape {shape}; rebuild")
        with self._maps_lock:
            if key in self._files:  # another thread opened it meanwhile
                os.close(descriptor)
            else:
                self._files[key] = (descriptor, offset, np.dtype(dtype))
            return self._files[key]

    def cache(self, pooling: str | None = None) -> int:
        """Ask the kernel to read every part of ``pooling`` into the page cache (``posix_fadvise`` WILLNEED, through
        the descriptors ``pread`` reads keep): re-scoring by pread then finds its rows there rather than on disk,
        and this process's resident memory is unchanged. Returns the bytes asked for (0 where the system has no
        such advice)."""
        pooling = self.check_pooling(pooling)
        advise = getattr(os, "posix_fadvise", None)
        if advise is None:
            return 0
        size = 0
        table = self._pread_table(pooling)
        for part, descriptor, offset in zip(
            self._parts, table.descriptors.tolist(), table.offsets.tolist(), strict=True
        ):
            length = part.rows * self.dim * table.dtype.itemsize
            advise(descriptor, offset, length, os.POSIX_FADV_WILLNEED)
            size += length
        return size

    def close(self) -> None:
        """Close the descriptors ``pread`` reads keep open (maps close when dropped)."""
        with self._maps_lock:
            files, self._files, self._tables = list(self._files.values()), {}, {}
        for descriptor, *_ in files:
            os.close(descriptor)

    def __del__(self) -> None:
        for descriptor, *_ in getattr(self, "_files", {}).values():
            try:
                os.close(descriptor)
            except OSError:
                pass

    def read_rows(
        self, rows: np.ndarray, pooling: str | None = None, keep: bool = True, pread: bool = False
    ) -> np.ndarray:
        """Vectors of the given global row numbers (any order), float32. ``keep=False`` reads through maps that
        are dropped afterwards (a one-off read such as a training sample), not the kept ones. ``pread``: read the
        rows from the files by ``os.pread`` rather than through maps, so that the pages read do not stay in this
        process's resident set (random re-scoring reads at 1M rows touched every page of a 366 MiB mapped stash
        within a few hundred queries); the same bytes, decoded alike: the same floats."""
        pooling = self.check_pooling(pooling)
        if pread:
            return self._read_by_pread(np.asarray(rows, dtype=np.int64), pooling)
        rows = np.asarray(rows, dtype=np.int64)
        starts = in_range(rows, np.cumsum([0] + [p.rows for p in self._parts]))
        out = np.empty((len(rows), self.dim), dtype=np.float32)
        numbers = np.searchsorted(starts, rows, side="right") - 1
        for number in np.unique(numbers):
            inside_part = numbers == number  # np.asarray: index the plain array, not the memmap subclass
            out[inside_part] = self._decoded(pooling, int(number), rows[inside_part] - starts[number], keep)
        return out

    def _pread_table(self, pooling: str) -> PreadTable:
        """Every part's descriptor, data offset and (int8) scale and row lengths, gathered once per pooling (and
        again when parts are added or merged), so that a read does no work per part in Python."""
        with self._maps_lock:
            table = self._tables.get(pooling)
        if table is not None and table.parts == len(self._parts):
            return table
        opened = [self._opened(pooling, number) for number in range(len(self._parts))]
        dtypes = {dtype for *_, dtype in opened}
        if len(dtypes) > 1:
            raise IndexDirError(f"the stash's parts hold {pooling} vectors as {sorted(map(str, dtypes))}; rebuild")
        scales = lengths = None
        if self.dtype == "int8":
            coded = [self._read_scale(pooling, number) for number in range(len(self._parts))]
            scales = np.stack([scale for scale, _ in coded], axis=1)  # (2, parts, d)
            lengths = np.concatenate(
                [
                    np.ones(part.rows, np.float32) if norms is None else norms
                    for part, (_, norms) in zip(self._parts, coded, strict=True)
                ]
                or [np.zeros(0, np.float32)]
            )
        table = PreadTable(
            len(self._parts),
            np.cumsum([0] + [part.rows for part in self._parts]),
            np.array([descriptor for descriptor, *_ in opened], dtype=np.int64),
            np.array([offset for _, offset, _ in opened], dtype=np.int64),
            dtypes.pop() if dtypes else np.dtype(np.float32),
            scales,
            lengths,
        )
        with self._maps_lock:
            self._tables[pooling] = table
        return table

    def _read_by_pread(self, rows: np.ndarray, pooling: str) -> np.ndarray:
        """Rows as stored, read by ``os.pread`` in ascending order (a run of consecutive rows of one part in one
        call), nothing mapped: the page cache holds them, not this process; then decoded at once. Re-scoring reads
        100-400 random rows of a stash of hundreds of parts, nearly a part each: every step but the system call is
        done on arrays (``_pread_table``); per part in Python, the work cost several times the system calls."""
        table = self._pread_table(pooling)
        starts = in_range(rows, table.starts)
        if not len(rows):
            return np.empty((0, self.dim), dtype=np.float32)
        order = np.argsort(rows, kind="stable")
        ordered = rows[order]
        numbers = np.searchsorted(starts, ordered, side="right") - 1
        size = self.dim * table.dtype.itemsize
        firsts = np.flatnonzero(np.concatenate([[True], (np.diff(ordered) != 1) | (np.diff(numbers) != 0)]))
        runs = numbers[firsts]
        where = table.offsets[runs] + (ordered[firsts] - starts[runs]) * size
        lengths = (np.diff(np.append(firsts, len(rows))) * size).tolist()
        # os.pread's bytes, joined once: a third faster than os.preadv into slices of one buffer (100 rows)
        chunks = [
            os.pread(descriptor, length, offset)
            for descriptor, length, offset in zip(
                table.descriptors[runs].tolist(), lengths, where.tolist(), strict=True
            )
        ]
        joined = b"".join(chunks)
        if len(joined) != len(rows) * size:  # a short read: the part whose file ends early, named
            at = next(
                at for at, (chunk, length) in enumerate(zip(chunks, lengths, strict=True)) if len(chunk) != length
            )
            raise IndexDirError(f"stash part {self._parts[int(runs[at])].vectors[pooling]} is truncated; rebuild")
        stored = np.frombuffer(joined, dtype=table.dtype).reshape(len(rows), self.dim)
        if table.scales is not None and table.lengths is not None:
            decoded = dequantize(stored, table.scales[:, numbers], table.lengths[ordered])
        else:
            decoded = stored.astype(np.float32)
        out = np.empty_like(decoded)
        out[order] = decoded
        return out

    def sample(self, n: int, seed: int = 0, pooling: str | None = None) -> np.ndarray:
        """A uniform sample of ``n`` rows (all rows when there are fewer), for training IVF quantisers."""
        total = len(self)
        if n >= total:
            return np.concatenate(list(self.iter_blocks(pooling=pooling)))
        rows = np.sort(np.random.default_rng(seed).choice(total, size=n, replace=False))
        return self.read_rows(rows, pooling, keep=False)

    def moments(self, pooling: str | None = None) -> RunningMoments:
        """Exact moments of every stashed vector of one pooling, streamed block by block."""
        moments = RunningMoments(self.dim)
        for block in self.iter_blocks(pooling=pooling):
            moments.update(block)
        return moments

    def iter_docs(self, first: int = 0) -> Iterator[pa.Table]:
        """Each part's (id, text) table, in row order, from part ``first`` on; (id, text, title) where the corpus
        had a title column."""
        for part in self._parts[first:]:
            yield pq.read_table(self.root / part.docs)

    def has_titles(self) -> bool:
        """Whether any part kept a title column (read from the parts' parquet footers only)."""
        return any("title" in pq.read_schema(self.root / part.docs).names for part in self._parts)

    def iter_ids(self) -> Iterator[list[str]]:
        """Each part's ids, in row order: one part's in memory at a time."""
        for part in self._parts:
            yield pq.read_table(self.root / part.docs, columns=["id"])["id"].to_pylist()

    def ids(self) -> list[str]:
        """Every row's id, in row order (all of them in memory: ``iter_ids`` streams them)."""
        return [i for ids in self.iter_ids() for i in ids]


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()
