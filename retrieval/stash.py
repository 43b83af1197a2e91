"""The vector stash: raw encoder vectors on disk in append-only parts, with the ids and texts beside them.

A build appends one part per record batch. Each part (``part-NNNNN.npy`` + ``part-NNNNN.parquet``) is written
to a temporary name and renamed into place, then ``stash.json`` is rewritten the same way, so after a crash
the stash holds exactly the parts ``stash.json`` lists: a resumed build continues from there. Reading is by
memory map, block by block, so the whole stash is never in RAM.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from retrieval.errors import IndexDirError
from retrieval.files import write_atomic

STASH_FORMAT = 1
DTYPES = ("float32", "float16")


class VectorStash:
    """Append-only parts of raw vectors (one array per pooling) plus a docs table; see the module docstring."""

    def __init__(self, root: Path, state: dict[str, Any]):
        self.root = Path(root)
        self.state = state

    # ----- creation and opening -----------------------------------------------------------------------
    @classmethod
    def create(cls, root: Path, dim: int, poolings: list[str], dtype: str = "float32", meta: dict | None = None):
        if dtype not in DTYPES:
            raise IndexDirError(f"unknown stash dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        root.mkdir(parents=True, exist_ok=True)
        state = {
            "format": STASH_FORMAT,
            "dim": dim,
            "dtype": dtype,
            "poolings": poolings,
            "meta": meta or {},
            "parts": [],
        }
        stash = cls(root, state)
        stash._save_state()
        return stash

    @classmethod
    def open(cls, root: Path) -> VectorStash:
        path = Path(root) / "stash.json"
        if not path.is_file():
            raise IndexDirError(f"no vector stash at {root}; rebuild the index with --keep-vectors")
        state = json.loads(path.read_text())
        if state.get("format") != STASH_FORMAT:
            raise IndexDirError(f"stash at {root} has format {state.get('format')}, this version reads {STASH_FORMAT}")
        return cls(Path(root), state)

    def _save_state(self) -> None:
        write_atomic(self.root / "stash.json", json.dumps(self.state, indent=1).encode())

    # ----- properties ---------------------------------------------------------------------------------
    @property
    def dim(self) -> int:
        return int(self.state["dim"])

    @property
    def poolings(self) -> list[str]:
        return list(self.state["poolings"])

    @property
    def meta(self) -> dict[str, Any]:
        return dict(self.state["meta"])

    @property
    def parts(self) -> list[dict[str, Any]]:
        return list(self.state["parts"])

    def __len__(self) -> int:
        return sum(p["rows"] for p in self.state["parts"])

    def files(self) -> list[Path]:
        names = ["stash.json"]
        for part in self.state["parts"]:
            names += [part["docs"], *part["vectors"].values()]
        return [self.root / n for n in names]

    # ----- writing ------------------------------------------------------------------------------------
    def append(self, vectors: dict[str, np.ndarray], ids: list[str], texts: list[str], source_batches: int = 1):
        """Add one part. ``source_batches`` counts the corpus record batches it covers (for resuming)."""
        number = len(self.state["parts"])
        stem = f"part-{number:05d}"
        files = {}
        for pooling in self.poolings:
            arr = np.ascontiguousarray(vectors[pooling], dtype=self.state["dtype"])
            assert arr.shape == (len(ids), self.dim), (arr.shape, len(ids), self.dim)
            name = f"{stem}.{pooling}.npy"
            tmp = self.root / (name + ".tmp")
            with open(tmp, "wb") as fh:
                np.save(fh, arr)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.root / name)
            files[pooling] = name
        table = pa.table({"id": pa.array(ids, pa.string()), "text": pa.array(texts, pa.string())})
        tmp = self.root / f"{stem}.parquet.tmp"
        pq.write_table(table, tmp)
        os.replace(tmp, self.root / f"{stem}.parquet")
        self.state["parts"].append(
            {"rows": len(ids), "vectors": files, "docs": f"{stem}.parquet", "source_batches": source_batches}
        )
        self._save_state()

    @property
    def source_batches(self) -> int:
        return sum(p.get("source_batches", 1) for p in self.state["parts"])

    # ----- reading ------------------------------------------------------------------------------------
    def iter_parts(self, pooling: str | None = None) -> Iterator[np.ndarray]:
        """Each part's vectors as a read-only memory map (float32 or float16 as stored)."""
        pooling = pooling or self.poolings[0]
        if pooling not in self.poolings:
            raise IndexDirError(f"the stash holds poolings {', '.join(self.poolings)}, not {pooling!r}")
        for part in self.state["parts"]:
            yield np.load(self.root / part["vectors"][pooling], mmap_mode="r")

    def iter_blocks(self, block_rows: int = 65536, pooling: str | None = None) -> Iterator[np.ndarray]:
        """float32 blocks of at most ``block_rows`` rows, in row order."""
        for arr in self.iter_parts(pooling):
            for start in range(0, arr.shape[0], block_rows):
                yield np.asarray(arr[start : start + block_rows], dtype=np.float32)

    def read_rows(self, rows: np.ndarray, pooling: str | None = None) -> np.ndarray:
        """Vectors of the given global row numbers (any order), float32."""
        rows = np.asarray(rows, dtype=np.int64)
        out = np.empty((len(rows), self.dim), dtype=np.float32)
        offset = 0
        for arr in self.iter_parts(pooling):
            inside = (rows >= offset) & (rows < offset + arr.shape[0])
            if inside.any():
                out[inside] = arr[rows[inside] - offset]
            offset += arr.shape[0]
        return out

    def sample(self, n: int, seed: int = 0, pooling: str | None = None) -> np.ndarray:
        """A uniform sample of ``n`` rows (all rows when there are fewer), for training IVF quantisers."""
        total = len(self)
        if n >= total:
            return np.concatenate(list(self.iter_blocks(pooling=pooling)))
        rows = np.sort(np.random.default_rng(seed).choice(total, size=n, replace=False))
        return self.read_rows(rows, pooling)

    def iter_docs(self) -> Iterator[pa.Table]:
        for part in self.state["parts"]:
            yield pq.read_table(self.root / part["docs"])
