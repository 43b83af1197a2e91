"""Pass 1, one record batch at a time: encode it, write it to the stash, fold it into the moments (and its texts'
term counts into the lexical statistics), report.

The same unit serves a build, an ``add`` and each worker of a distributed build; only where a part goes
differs (``write``: the stash's next part locally, a uniquely named unregistered part on a worker, which the
driver's Ingest then ``adopt``s).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import pyarrow.parquet as pq

from retrieval.corpus import Batch
from retrieval.docs import ColumnsWriter
from retrieval.encode.spec import Encoder, MultiPoolingEncoder
from retrieval.errors import ConfigError, CorpusError
from retrieval.lexical import Analyzer, TermStats
from retrieval.moments import RunningMoments
from retrieval.progress import Progress, no_progress
from retrieval.stash import Part, Titles, VectorStash


class PartWriter(Protocol):
    """write(vectors per pooling, ids, texts, titles=...) -> the written part"""

    def __call__(
        self, vectors: dict[str, np.ndarray], ids: Sequence[str], texts: Sequence[str], *, titles: Titles = None
    ) -> Part: ...


def poolings_for(encoder: Encoder | None, extra: Sequence[str] = ()) -> list[str]:
    """The poolings a stash keeps: the encoder's own first, then ``extra``; "vectors" for precomputed input."""
    if encoder is None:
        if extra:
            raise ConfigError("`extra_pooling` needs a transformers encoder", "extra_pooling")
        return ["vectors"]
    own = encoder.info().pooling or "vectors"
    poolings = [own, *[p for p in extra if p != own]]
    if len(poolings) > 1 and not isinstance(encoder, MultiPoolingEncoder):
        raise ConfigError("this encoder cannot capture several poolings in one pass", "extra_pooling")
    return poolings


def encode_batch(
    batch: Batch, encoder: Encoder | None, poolings: Sequence[str], d: int, on_batch: Callable[[int], None]
) -> dict[str, np.ndarray]:
    """One batch's raw vectors per pooling: the input's own vectors, or the encoder's; NaN/inf refused."""
    if batch.vectors is not None:
        if batch.vectors.shape[1] != d and len(batch):
            raise CorpusError(
                f"the input holds {batch.vectors.shape[1]}-d vectors where earlier rows had {d}; "
                "every vector must have the same width"
            )
        vectors = {poolings[0]: batch.vectors}
        on_batch(len(batch))
    elif isinstance(encoder, MultiPoolingEncoder):
        vectors = encoder.encode_poolings(batch.texts, poolings, on_batch=on_batch)
    else:
        assert encoder is not None
        vectors = {poolings[0]: encoder.encode(batch.texts)}
        on_batch(len(batch))
    for pooling, array in vectors.items():
        bad = ~np.isfinite(array).all(axis=1)
        if bad.any():
            first = [batch.ids[i] for i in np.flatnonzero(bad)[:5]]
            raise CorpusError(
                f"{int(bad.sum())} vectors ({pooling}) contain NaN or inf (first ids: {', '.join(first)}); "
                "fix the input vectors or the encoder"
            )
    return vectors


def part_texts(stash: VectorStash, part: Part) -> list[str]:
    """The texts of one registered part of ``stash``, in row order."""
    return pq.read_table(stash.root / part.docs, columns=["text"])["text"].to_pylist()


class Ingest:
    """Pass 1 over a stream of batches into ``stash``: each call encodes one batch, writes it as a part, folds the
    ``pooling`` vectors (as stored: a float16 stash is folded in float16, as a resumed build reads it back)
    into ``moments`` and returns them as float32. With an ``analyzer``, each batch's texts are counted into
    ``terms`` too (``lexical_seconds``: the time that took)."""

    def __init__(
        self,
        stash: VectorStash,
        encoder: Encoder | None,
        pooling: str,
        total: int,
        progress: Progress = no_progress,
        write: PartWriter | None = None,
        analyzer: Analyzer | None = None,
        columns: ColumnsWriter | None = None,
    ):
        self.stash, self.encoder, self.pooling = stash, encoder, pooling
        self.moments = RunningMoments(stash.dim)
        self.analyzer = analyzer
        self.terms = TermStats() if analyzer is not None else None
        self.lexical_seconds = 0.0
        self.columns = columns  # where each batch's kept metadata columns go, when it has some
        self.parts: list[Part] = []
        self._write = write or stash.append
        self._on_batch = lambda n: progress("encode", n, total)

    def adopt(self, parts: Sequence[Part], moments: Sequence[RunningMoments]) -> None:
        """Take in parts that other processes encoded and wrote (a distributed build's workers), in row order:
        register them and fold in their moments, as ``__call__`` does for a batch it encodes itself (term counts:
        from each part's texts, read back here)."""
        self.stash.register(parts)
        for part, part_moments in zip(parts, moments, strict=True):
            self.moments.merge(part_moments)
            if self.analyzer is not None:
                self.count_terms(part_texts(self.stash, part))
            self.parts.append(part)
            self._on_batch(part.rows)

    def count_terms(self, texts: Sequence[str]) -> None:
        """Fold these texts' term counts into ``terms`` (rows already in the stash, on a resume)."""
        if self.analyzer is None or self.terms is None:
            return
        start = time.perf_counter()
        self.terms.add_texts(texts, self.analyzer)
        self.lexical_seconds += time.perf_counter() - start

    def __call__(self, batch: Batch, ids: Sequence[str] | None = None) -> np.ndarray:
        vectors = encode_batch(batch, self.encoder, self.stash.poolings, self.stash.dim, self._on_batch)
        self.parts.append(self._write(vectors, batch.ids if ids is None else ids, batch.texts, titles=batch.titles))
        self.count_terms(batch.texts)
        if self.columns is not None and batch.columns is not None:
            self.columns.write(batch.columns)
        stored = self.stash.stored(vectors[self.pooling])  # the moments of what the stash gives back
        self.moments.update(stored)
        return stored
