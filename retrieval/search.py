"""Searching an index directory: the same encoder and the same stored transform as the build, then FAISS."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from retrieval import files
from retrieval.encoder import Encoder, check_compatible, load_encoder
from retrieval.errors import ConfigError, IndexDirError
from retrieval.index import flat_vectors, load_index, set_search_params
from retrieval.manifest import DOCS_NAME, INDEX_NAME, STASH_DIR, TRANSFORM_NAME, Manifest
from retrieval.scan import FlatScan
from retrieval.stash import VectorStash
from retrieval.whitening import RawTransform, Whitening, l2_normalize, load_transform

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hit:
    """One ranked result. ``row`` is the document's position in the index."""

    rank: int
    id: str
    score: float
    text: str
    row: int


class Docs:
    """Row -> (id, text) from ``docs.parquet``: ids in memory, texts read by row group on demand."""

    def __init__(self, path: Path):
        self._file = pq.ParquetFile(path)
        self.ids: list[str] = self._file.read(columns=["id"]).column("id").to_pylist()
        sizes = [self._file.metadata.row_group(i).num_rows for i in range(self._file.num_row_groups)]
        self._starts = np.cumsum([0, *sizes])

    def __len__(self) -> int:
        return len(self.ids)

    def texts(self, rows: Sequence[int]) -> list[str]:
        out: dict[int, str] = {}
        groups = np.searchsorted(self._starts, rows, side="right") - 1
        for group in sorted(set(groups.tolist())):
            column = self._file.read_row_group(group, columns=["text"]).column("text")
            start = int(self._starts[group])
            for row in (r for r, g in zip(rows, groups, strict=True) if g == group):
                out[row] = column[row - start].as_py()
        return [out[r] for r in rows]


class Searcher:
    """A loaded index directory. ``Searcher.load(dir).search("query", k)`` -> list of Hit."""

    def __init__(
        self,
        directory: Path,
        manifest: Manifest,
        transform: Whitening | RawTransform,
        index: Any,
        docs: Docs,
        encoder: Encoder | None,
    ):
        self.directory = directory
        self.manifest = manifest
        self.transform = transform
        self.index = index
        self.docs = docs
        self.encoder = encoder
        flat = flat_vectors(index)
        self._scan = FlatScan(flat) if flat is not None else None
        self._stash: VectorStash | None = None

    @classmethod
    def load(cls, directory: Path, encoder: Encoder | None = None, verify: bool = True, batch_size: int = 32):
        """Open an index directory, check its files, and prepare the encoder it was built with.

        Pass ``encoder`` to reuse one already loaded (it must match the index's model, pooling and max
        length); leave it None to load the one the manifest names. Vector-only indexes need no encoder.
        """
        directory = Path(directory)
        files.recover(directory)
        manifest = Manifest.load(directory)
        if verify:
            manifest.verify(directory, [TRANSFORM_NAME, INDEX_NAME, DOCS_NAME])
        transform = load_transform(directory / TRANSFORM_NAME)
        index = load_index(directory / INDEX_NAME)
        if index.ntotal != manifest.n or index.d != transform.dim_out:
            raise IndexDirError(f"{directory}: the FAISS index does not match its manifest; rebuild the index")
        if encoder is not None:
            check_compatible(manifest.encoder, encoder.describe())
        elif manifest.encoder.get("kind") == "transformers":
            encoder = load_encoder(manifest.encoder, batch_size=batch_size)
        return cls(directory, manifest, transform, index, Docs(directory / DOCS_NAME), encoder)

    # ----- the query side ---------------------------------------------------------------------------------
    def encode(self, queries: Sequence[str]) -> np.ndarray:
        """Raw encoder vectors for the queries, by the index's own encoder."""
        if self.encoder is None:
            raise ConfigError("this index was built from precomputed vectors; search it with search_vectors()")
        return self.encoder.encode(list(queries))

    def search(self, query: str, k: int = 10, **params: Any) -> list[Hit]:
        return self.search_batch([query], k, **params)[0]

    def search_batch(self, queries: Sequence[str], k: int = 10, **params: Any) -> list[list[Hit]]:
        return self.hits(*self.search_raw(self.encode(queries), k, **params))

    def search_vectors(self, raw: np.ndarray, k: int = 10, **params: Any) -> list[list[Hit]]:
        """Search with raw encoder-space vectors (they get the index's transform)."""
        return self.hits(*self.search_raw(raw, k, **params))

    def search_raw(
        self,
        raw: np.ndarray,
        k: int = 10,
        rescore: int = 0,
        ef_search: int | None = None,
        nprobe: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(scores, rows) for raw encoder-space query vectors; rows are -1 where fewer than k were found.

        ``rescore=N`` fetches the top N candidates from the (reduced) index and re-ranks them by cosine
        between the full raw vectors kept in the stash, returning the top k of those.
        """
        raw = np.atleast_2d(np.asarray(raw, dtype=np.float32))
        if raw.shape[1] != self.transform.dim_in:
            raise ConfigError(f"query vectors have {raw.shape[1]} dims; this index takes {self.transform.dim_in}")
        if k < 1:
            raise ConfigError(f"-k must be at least 1 (got {k})")
        depth = max(k, rescore)
        scores, rows = self.search_transformed(self.transform.transform(raw), depth, ef_search, nprobe)
        if rescore:
            scores, rows = self._rescore(raw, rows, k)
        return scores[:, :k], rows[:, :k]

    def search_transformed(
        self,
        vectors: np.ndarray,
        k: int = 10,
        ef_search: int | None = None,
        nprobe: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """(scores, rows) for query vectors already in the index's space."""
        k = min(k, self.index.ntotal)
        if self._scan is not None:
            return self._scan.search(vectors, k)
        # knobs left unset go back to the index's defaults, not to whatever the previous call asked for
        defaults = self.manifest.index.get("search", {})
        set_search_params(
            self.index,
            ef_search=defaults.get("ef_search") if ef_search is None else ef_search,
            nprobe=defaults.get("nprobe") if nprobe is None else nprobe,
        )
        return self.index.search(np.ascontiguousarray(vectors, dtype=np.float32), k)

    def _rescore(self, raw: np.ndarray, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        if self._stash is None:
            self._stash = stash_of(self.directory)
        pooling = self.manifest.transform.get("pooling")
        queries = l2_normalize(raw)
        out_scores = np.full((len(rows), k), -np.inf, dtype=np.float32)
        out_rows = np.full((len(rows), k), -1, dtype=np.int64)
        for i, candidates in enumerate(rows):
            candidates = candidates[candidates >= 0]
            docs = l2_normalize(self._stash.read_rows(candidates, pooling))
            scores = docs @ queries[i]
            order = np.argsort(-scores, kind="stable")[:k]
            out_scores[i, : len(order)] = scores[order]
            out_rows[i, : len(order)] = candidates[order]
        return out_scores, out_rows

    def hits(self, scores: np.ndarray, rows: np.ndarray) -> list[list[Hit]]:
        out = []
        for score_row, id_row in zip(scores, rows, strict=True):
            keep = [int(r) for r in id_row if r >= 0]
            texts = self.docs.texts(keep)
            out.append(
                [
                    Hit(rank=i + 1, id=self.docs.ids[r], score=float(s), text=t, row=r)
                    for i, (r, s, t) in enumerate(zip(keep, score_row, texts, strict=False))
                ]
            )
        return out


def stash_of(directory: Path) -> VectorStash:
    """The raw-vector stash kept in an index directory (for re-scoring, tuning and re-fitting)."""
    path = Path(directory) / STASH_DIR
    if not (path / "stash.json").is_file():
        raise IndexDirError(
            f"{directory} kept no raw vectors; rebuild it without --no-keep-vectors to re-fit, tune or re-score"
        )
    return VectorStash.open(path)
