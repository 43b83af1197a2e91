"""The indexing job: the one place where corpus, encoder, moments, whitening, stash and FAISS are wired together.

Pass 1 streams the corpus in record batches, encodes each, appends the raw vectors to the on-disk stash and
folds them into running moments. The kernel is fitted from the moments alone. Pass 2 streams the stash through
the kernel into a FAISS inner-product index. Everything is assembled in a hidden work directory beside the
target and renamed into place only when complete (``files.publish``).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from retrieval import files
from retrieval.corpus import Batch, Corpus, CorpusSpec
from retrieval.encoder import Encoder
from retrieval.errors import ConfigError, CorpusError, RetrievalError
from retrieval.index import (
    IndexSpec,
    create_index,
    default_search_params,
    describe,
    save_index,
    set_search_params,
    train,
    train_size,
)
from retrieval.manifest import (
    DOCS_NAME,
    INDEX_NAME,
    MOMENTS_NAME,
    STASH_DIR,
    TRANSFORM_NAME,
    Manifest,
    is_index_dir,
)
from retrieval.moments import RunningMoments
from retrieval.stash import VectorStash
from retrieval.whitening import RawTransform, Whitening

log = logging.getLogger(__name__)

# Chosen on SciFact's train queries with all-MiniLM-L6-v2, mean pooling: best dev nDCG@10 at k = 384, 256 and 128
# (README, "Choosing the default gamma"; `retrieval tune`). Full whitening (1.0) costs ~6% there.
DEFAULT_GAMMA = 0.25
DEFAULT_EPSILON = 1e-6
WINDOW_ROWS = 2048  # corpus rows per record batch: one stash part, one resume step
BLOCK_ROWS = 65536  # stash rows per block in pass 2

# progress(stage, rows_done_now, rows_total): called as work advances, for the CLI's bars.
Progress = Callable[[str, int, int], None]


def no_progress(stage: str, advance: int, total: int) -> None:
    return None


@dataclass(frozen=True)
class TransformSpec:
    """The transform fitted after pass 1: W = U[:, :dim] * (lambda + epsilon * lambda_max) ** (-gamma / 2).

    ``whiten=False`` is the raw baseline: L2-normalised encoder output, no centring, no kernel.
    ``pooling`` chooses which stashed pooling to fit on (default: the first).
    """

    dim: int | None = None
    gamma: float = DEFAULT_GAMMA
    epsilon: float = DEFAULT_EPSILON
    whiten: bool = True
    pooling: str | None = None

    def check(self, d: int) -> None:
        if self.dim is not None and not 1 <= self.dim <= d:
            raise ConfigError(f"--dim must be between 1 and the encoder's dimension {d} (got {self.dim})")
        if not self.whiten and self.dim not in (None, d):
            raise ConfigError(f"--no-whiten keeps all {d} dimensions; drop --dim or drop --no-whiten")
        if self.gamma < 0:
            raise ConfigError(f"--gamma must be >= 0 (got {self.gamma}); 1 = full whitening, 0 = PCA rotation")
        if self.epsilon < 0:
            raise ConfigError(f"--epsilon must be >= 0 (got {self.epsilon})")

    def fit(self, moments: RunningMoments) -> Whitening | RawTransform:
        if not self.whiten:
            return RawTransform(moments.dim)
        return Whitening.fit(moments, dim=self.dim, gamma=self.gamma, epsilon=self.epsilon)


@dataclass(frozen=True)
class BuildOptions:
    """How the job runs, as opposed to what it computes."""

    keep_vectors: bool = True
    stash_dtype: str = "float32"
    extra_poolings: tuple[str, ...] = ()
    overwrite: bool = False
    resume: bool = False
    window_rows: int = WINDOW_ROWS


class Timer:
    """Wall time per stage, in seconds, in the order the stages ran."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def stage(self, name: str) -> _Stage:
        return _Stage(self, name)


class _Stage:
    def __init__(self, timer: Timer, name: str):
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        elapsed = time.perf_counter() - self.start
        self.timer.seconds[self.name] = round(self.timer.seconds.get(self.name, 0.0) + elapsed, 4)


def build_index(
    corpus: CorpusSpec,
    encoder: Encoder | None,
    out: Path,
    transform: TransformSpec = TransformSpec(),
    index: IndexSpec = IndexSpec(),
    options: BuildOptions = BuildOptions(),
    progress: Progress = no_progress,
) -> Manifest:
    """Build a complete index directory at ``out`` and return its manifest.

    ``encoder`` may be None only when ``corpus.vectors_column`` supplies precomputed vectors.
    Nothing is written at ``out`` unless the whole build succeeds; one process at a time builds at ``out``.
    """
    out = Path(out)
    with files.writing(out):
        return _build(corpus, encoder, out, transform, index, options, progress)


def _build(
    corpus: CorpusSpec,
    encoder: Encoder | None,
    out: Path,
    transform: TransformSpec,
    index: IndexSpec,
    options: BuildOptions,
    progress: Progress,
) -> Manifest:
    timer = Timer()
    empty_dir = out.is_dir() and not out.is_symlink() and not any(out.iterdir())  # nothing to lose: build there
    if out.exists() and not empty_dir and not options.overwrite:
        raise ConfigError(f"{out} already exists; pass --overwrite to replace it, or --out to build elsewhere")
    if out.exists() and not empty_dir and not is_index_dir(out):
        # --overwrite replaces an index this tool built, never a user's folder or file: refuse, touch nothing
        what = (
            "a symbolic link"
            if out.is_symlink()
            else "a file"
            if not out.is_dir()
            else "a directory that is not a retrieval index"
        )
        raise ConfigError(
            f"{out} is {what}; --overwrite only replaces an index built by retrieval: choose another --out"
        )
    with timer.stage("validate"):
        source = Corpus(corpus)
        report = source.validate()
        d = _input_dim(source, encoder)
        transform.check(d)
    poolings = _poolings(encoder, transform, options)
    fit_pooling = transform.pooling or poolings[0]
    if fit_pooling not in poolings:
        raise ConfigError(f"cannot fit on pooling {fit_pooling!r}: this build stashes {', '.join(poolings)}")
    work = files.work_dir(out)
    stash, skip = _open_stash(work, source, encoder, d, poolings, options)

    def on_batch(n: int) -> None:
        progress("encode", n, report.usable)

    try:
        moments = RunningMoments(d)
        with timer.stage("encode"):
            for block in stash.iter_blocks(pooling=fit_pooling):  # rows a resumed build already has
                moments.update(block)
            progress("encode", len(stash), report.usable)
            for batch in source.batches(options.window_rows, skip_batches=skip):
                vectors = encode_batch(batch, source, encoder, poolings, d, on_batch)
                stash.append(vectors, batch.ids, batch.texts)
                # the moments see the vectors as stored (float16 stash included), as a resumed build reads them
                stored = np.asarray(vectors[fit_pooling], dtype=options.stash_dtype)
                moments.update(stored.astype(np.float32, copy=False))
                if batch.vectors is not None:
                    progress("encode", len(batch), report.usable)
        manifest = write_artifacts(work, stash, moments, transform, index, timer, progress)
    except RetrievalError:
        shutil.rmtree(work, ignore_errors=True)
        raise
    column = corpus.vectors_column or Path(corpus.path).name
    manifest.encoder = encoder.describe() if encoder else {"kind": "vectors", "column": column, "dim": d}
    manifest.corpus = {
        "path": str(Path(corpus.path).resolve()),
        "rows": report.rows,
        "indexed": report.usable,
        "skipped": report.skipped,
        "sha256": stash.meta["corpus_sha256"],
        **corpus.settings(),
    }
    if not options.keep_vectors:
        shutil.rmtree(work / STASH_DIR)
        manifest.stash = None
        manifest.files = {k: v for k, v in manifest.files.items() if not k.startswith(STASH_DIR + "/")}
    with timer.stage("write"):
        manifest.timings = timer.seconds
        manifest.save(work)
        files.publish(work, out)
    manifest.timings = timer.seconds
    log.info("built %s: %d rows, %d -> %d dims", out, manifest.n, d, manifest.transform["k"])
    return manifest


def _input_dim(source: Corpus, encoder: Encoder | None) -> int:
    if source.precomputed:
        if source.vector_dim is not None:
            return source.vector_dim
        first = next(iter(source.batches(1024)))
        assert first.vectors is not None
        return int(first.vectors.shape[1])
    if encoder is None:
        raise ConfigError("no encoder given and no --vectors-column: nothing can turn the texts into vectors")
    return encoder.dim


def _poolings(encoder: Encoder | None, transform: TransformSpec, options: BuildOptions) -> list[str]:
    if encoder is None or not hasattr(encoder, "pooling"):
        if options.extra_poolings:
            raise ConfigError("--extra-pooling needs a transformers encoder")
        return ["vectors"]
    poolings = [encoder.pooling, *[p for p in options.extra_poolings if p != encoder.pooling]]
    if len(poolings) > 1 and not hasattr(encoder, "encode_poolings"):
        raise ConfigError("this encoder cannot capture several poolings in one pass")
    return poolings


def _open_stash(
    work: Path, source: Corpus, encoder: Encoder | None, d: int, poolings: list[str], options: BuildOptions
) -> tuple[VectorStash, int]:
    """A fresh stash in the work directory, or, with ``resume``, the one an interrupted build left there."""
    meta = {
        "corpus_sha256": source.fingerprint(),
        "corpus": source.spec.settings(),
        "encoder": encoder.describe() if encoder else None,
        "window_rows": options.window_rows,
    }
    stash_dir = work / STASH_DIR
    if options.resume and (stash_dir / "stash.json").is_file():
        stash = VectorStash.open(stash_dir)
        found = _flat(stash.meta) | {"poolings": stash.poolings, "stash_dtype": stash.state["dtype"]}
        wanted = _flat(json.loads(json.dumps(meta))) | {"poolings": poolings, "stash_dtype": options.stash_dtype}
        changed = [key for key in wanted if found.get(key) != wanted[key]]
        if changed:
            settings = [key for key in changed if key != "corpus_sha256"]
            what = "; ".join(
                (["the corpus file has changed"] if "corpus_sha256" in changed else [])
                + ([f"{', '.join(settings)} changed"] if settings else [])
            )
            raise ConfigError(
                f"cannot resume the unfinished build in {work}: {what} since it started; "
                "run again without --resume to start over"
            )
        _drop_unlisted(stash)
        log.info("resuming: %d rows (%d record batches) already encoded", len(stash), stash.source_batches)
        return stash, stash.source_batches
    if options.resume:
        log.warning("nothing to resume in %s; starting a fresh build", work)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    return VectorStash.create(stash_dir, d, poolings, options.stash_dtype, meta), 0


def _flat(meta: dict[str, Any]) -> dict[str, Any]:
    """The stash fingerprint with the corpus-reading settings (--text-column, ...) as top-level keys."""
    return {k: v for k, v in meta.items() if k != "corpus"} | dict(meta.get("corpus") or {})


def _drop_unlisted(stash: VectorStash) -> None:
    """Remove what a killed build left half-written: files in the stash that ``stash.json`` does not list."""
    listed = set(stash.files())
    for path in stash.root.iterdir():
        if path not in listed:
            path.unlink()


def encode_batch(
    batch: Batch,
    source: Corpus,
    encoder: Encoder | None,
    poolings: list[str],
    d: int,
    on_batch: Callable[[int], None],
) -> dict[str, np.ndarray]:
    """One batch's raw vectors per pooling: the input's own vectors, or the encoder's; NaN/inf refused."""
    if batch.vectors is not None:
        vectors = {poolings[0]: batch.vectors}
        if batch.vectors.shape[1] != d and len(batch):
            raise CorpusError(
                f"column {source.spec.vectors_column!r} holds {batch.vectors.shape[1]}-d vectors where earlier rows "
                f"had {d}; every vector must have the same width"
            )
    elif hasattr(encoder, "encode_poolings"):
        vectors = encoder.encode_poolings(batch.texts, poolings, on_batch=on_batch)  # type: ignore[union-attr]
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


def write_artifacts(
    work: Path,
    stash: VectorStash,
    moments: RunningMoments,
    spec: TransformSpec,
    index_spec: IndexSpec,
    timer: Timer,
    progress: Progress,
) -> Manifest:
    """Fit, fill the index from the stash, and write everything but the manifest into ``work``."""
    pooling = spec.pooling or stash.poolings[0]
    with timer.stage("fit"):
        transform = spec.fit(moments)
    with timer.stage("index"):
        faiss_index = fill_index(stash, transform, index_spec, pooling, progress)
    with timer.stage("write"):
        transform.save(work / TRANSFORM_NAME)
        moments.save(work / MOMENTS_NAME)
        save_index(faiss_index, work / INDEX_NAME)
        write_docs(stash, work / DOCS_NAME)
    stash_files = [str(p.relative_to(work)) for p in stash.files()] if stash.root.parent == work else []
    return Manifest(
        encoder={},
        corpus={},
        transform=transform_record(transform, spec, pooling),
        index={
            "type": index_spec.kind,
            "factory": index_spec.factory(len(stash)),
            "spec": index_spec.to_dict(),
            "metric": "inner_product",
            "search": default_search_params(faiss_index, index_spec),
            "ntotal": int(faiss_index.ntotal),
            "faiss": describe(faiss_index),
        },
        stash={"dtype": stash.state["dtype"], "poolings": stash.poolings, "rows": len(stash)},
        files={name: {} for name in [TRANSFORM_NAME, MOMENTS_NAME, INDEX_NAME, DOCS_NAME, *stash_files]},
    )


def transform_record(transform: Whitening | RawTransform, spec: TransformSpec, pooling: str) -> dict[str, Any]:
    record: dict[str, Any] = {
        "kind": "whitening" if isinstance(transform, Whitening) else "raw",
        "pooling": pooling,
        "d": transform.dim_in,
        "k": transform.dim_out,
        "normalize": True,
        "spec": asdict(spec),
    }
    if isinstance(transform, Whitening):
        record |= {
            "gamma": transform.gamma,
            "epsilon": transform.epsilon,
            "n_fit": transform.n,
            "explained_variance": float(transform.explained_variance),
        }
    return record


def fill_index(
    stash: VectorStash,
    transform: Whitening | RawTransform,
    spec: IndexSpec,
    pooling: str,
    progress: Progress = no_progress,
) -> Any:
    """Pass 2: train on a transformed sample where the index needs it, then add the stash block by block."""
    n = len(stash)
    index = create_index(spec, transform.dim_out, n)
    sample_rows = train_size(index, spec, n)
    if sample_rows:
        train(index, transform.transform(stash.sample(sample_rows, pooling=pooling)))
    for block in stash.iter_blocks(BLOCK_ROWS, pooling=pooling):
        index.add(transform.transform(block))
        progress("index", block.shape[0], n)
    set_search_params(index, **default_search_params(index, spec))
    return index


def write_docs(stash: VectorStash, path: Path) -> None:
    """Row -> (id, text) for display, one row group per stash part, streamed."""
    writer = None
    try:
        for table in stash.iter_docs():
            if writer is None:
                writer = pq.ParquetWriter(path, table.schema)
            writer.write_table(table)
    finally:
        if writer is not None:
            writer.close()
