"""The indexing job: the one place where corpus, encoder, moments, whitening, stash and FAISS are wired together.

Pass 1 (``ingest``) streams the corpus in record batches, encodes each, appends the raw vectors to the on-disk
stash and folds them into running moments. The kernel is fitted from the moments alone. Pass 2 streams the stash
through the kernel into a FAISS inner-product index. Everything is assembled in a hidden work directory beside
the target and renamed into place only when complete (``files.publish``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from retrieval import files
from retrieval.corpus import Corpus, CorpusReport, CorpusSpec
from retrieval.docs import ColumnsWriter
from retrieval.encode.spec import POOLINGS, Encoder, EncoderInfo
from retrieval.errors import ConfigError, IndexDirError, RetrievalError
from retrieval.index import (
    IndexSpec,
    add_rows,
    check_buildable,
    create_index,
    default_search_params,
    describe,
    set_search_params,
    train,
)
from retrieval.index import train_size as training_rows
from retrieval.indexdir import (
    COLUMNS,
    OWN_NAMES,
    STASH,
    IndexDir,
    column_types,
    is_index_dir,
    save_docs,
    save_faiss_index,
    save_lexical,
    save_moments,
    save_transform,
    write_manifest,
)
from retrieval.ingest import Ingest, poolings_for
from retrieval.lexical import Analyzer, LexicalSpec
from retrieval.manifest import Calibration, CorpusRecord, IndexRecord, Manifest, StashRecord, TransformRecord
from retrieval.moments import RunningMoments
from retrieval.options import option
from retrieval.progress import Progress, Timer, no_progress
from retrieval.stash import BLOCK_ROWS, DTYPES, STATE_NAME, VectorStash
from retrieval.whitening import RawTransform, TransformSpec, Whitening

log = logging.getLogger(__name__)

WINDOW_ROWS = 2048  # corpus rows per record batch: one stash part, one resume step
RAY_WINDOW_ROWS = (512, 65536)  # rows per window of a distributed build: see ``window_rows``


@dataclass(frozen=True)
class BuildOptions:
    """How the job runs, as opposed to what it computes."""

    keep_vectors: bool = option(True, "Keep the raw-vector stash (for refit/tune/rescore).")
    stash_dtype: str = option("float32", f"Stash precision: {', '.join(DTYPES)}.")
    extra_poolings: tuple[str, ...] = ()  # the CLI's --extra-pooling, repeatable
    overwrite: bool = option(False, "Replace an existing index (only once the new one is done).")
    resume: bool = option(False, "Continue an interrupted build of the same corpus and settings.")
    window_rows: int = WINDOW_ROWS  # sized for the corpus: ``window_rows``
    # the BM25 part beside the dense index; None: dense only (the command line's --no-lexical)
    lexical: LexicalSpec | None = option(
        LexicalSpec(),
        "Also build a BM25 index of the texts (English stop words and stemmer), for hybrid search.",
        cli_type=bool,
        cli_default=True,
    )

    def check(self) -> None:
        if self.lexical is not None:
            self.lexical.check()
        if self.stash_dtype not in DTYPES:
            raise ConfigError(
                f"unknown `stash_dtype` {self.stash_dtype!r}; choose one of {', '.join(DTYPES)}", "stash_dtype"
            )
        if self.window_rows < 1:
            raise ConfigError(f"`window_rows` must be at least 1 (got {self.window_rows})", "window_rows")
        for pooling in self.extra_poolings:
            if pooling not in POOLINGS:
                raise ConfigError(
                    f"unknown `extra_pooling` {pooling!r}; choose from {', '.join(POOLINGS)}", "extra_pooling"
                )


def window_rows(rows: int, distributed: bool = True) -> int:
    """Corpus rows per window (one stash part, one resume step) for a build of ``rows`` rows.

    Distributed: a power of two near rows / 2048, within RAY_WINDOW_ROWS: small enough that a small corpus gives
    every worker several windows (5,183 SciFact passages: 11 windows of 512 where the local default of 2,048 gives
    3, one worker idle a third of the time), large enough that a big one stays at a few thousand stash parts
    (100M rows: 1,526 of 65,536; each part is files, a registration and a d x d moments matrix on the driver).
    Local: ``WINDOW_ROWS``, grown past 4M rows as the distributed size grows, so a big build stays at a few
    thousand parts too (each registration rewrites stash.json: 100M rows in 2,048-row windows would be 48,828
    parts and hours of rewriting). It depends on the corpus alone, so a resumed build cuts the same windows.
    """
    low, high = RAY_WINDOW_ROWS
    sized = min(high, max(low, 1 << max(0, math.ceil(math.log2(max(rows, 1) / 2048)))))
    return sized if distributed else max(WINDOW_ROWS, sized)


class Engine(Protocol):
    """Where pass 1 runs when not in this process (``retrieval.distributed.RayEngine``).

    ``validate`` checks the whole corpus as ``Corpus.validate`` does. ``ingest`` encodes windows ``skip`` onwards
    of ``window_rows`` rows elsewhere and hands each window's part to ``ingest.adopt`` in window order, so the
    stash and the moments end as the local loop leaves them."""

    def validate(self, source: Corpus) -> CorpusReport: ...

    def ingest(self, source: Corpus, ingest: Ingest, skip: int, window_rows: int) -> None: ...

    def fill(self, index: Any, stash: VectorStash, transform: Whitening | RawTransform, pooling: str | None) -> Any:
        """Pass 2's adds, in parallel where that pays: the trained ``index`` filled with every stash row in
        row order, or None to leave it to the local loop."""
        ...


def build_index(
    corpus: CorpusSpec,
    encoder: Encoder | None,
    out: Path,
    transform: TransformSpec = TransformSpec(),
    index: IndexSpec = IndexSpec(),
    options: BuildOptions = BuildOptions(),
    progress: Progress = no_progress,
    engine: Engine | None = None,
) -> Manifest:
    """Build a complete index directory at ``out`` and return its manifest.

    ``encoder`` may be None only when the corpus supplies precomputed vectors. Nothing is written at ``out``
    unless the whole build succeeds; one process at a time builds at ``out``. ``engine`` runs the corpus passes
    (and a large IVF index's adds) on a Ray cluster; the verdicts, fit, index, manifest and publish are the same.
    """
    if os.path.islink(out) and not os.path.exists(out):
        raise ConfigError(
            f"{out} is a symbolic link to {os.readlink(out)}, which does not exist: a build would create it there; "
            "remove the link, or point it at an index or an empty folder",
            "out",
        )
    out = files.resolved(out)
    check_target(out, options.overwrite)
    options.check()
    index.check()
    if transform.dim is not None:
        index.check_dim(transform.dim)
    if index.binary and not options.keep_vectors:
        raise ConfigError(
            "binary codes rank by Hamming distance and are re-scored from the stash: keep the vectors, or choose "
            "other `codes`",
            "keep_vectors",
        )
    with files.write_errors(out), files.writing(out):
        check_target(out, options.overwrite)  # again under the lock, which may have put back an interrupted publish
        return _build(corpus, encoder, out, transform, index, options, progress, engine)


def check_target(out: Path, overwrite: bool) -> None:
    """Refuse a target that exists, unless ``overwrite`` and it is an index this tool built (never a user's
    folder or file: refused, untouched). An empty folder has nothing to lose and is built into."""
    out = files.resolved(out)  # a link to an index: the index it names is what gets replaced
    empty_dir = out.is_dir() and not any(out.iterdir())
    if not out.exists() or empty_dir:
        return
    if not overwrite:
        raise ConfigError(f"{out} already exists; pass `overwrite` to replace it, or choose another `out`", "overwrite")
    if not is_index_dir(out):
        what = "a file" if not out.is_dir() else "a directory"
        raise ConfigError(
            f"{out} is {what}, not a retrieval index; `overwrite` only replaces an index built by retrieval: "
            "choose another `out`",
            "out",
        )


def _build(
    corpus: CorpusSpec,
    encoder: Encoder | None,
    out: Path,
    transform: TransformSpec,
    index: IndexSpec,
    options: BuildOptions,
    progress: Progress,
    engine: Engine | None = None,
) -> Manifest:
    timer = Timer()
    with timer.stage("validate"):
        source = Corpus(corpus)
        report = engine.validate(source) if engine else source.validate()
        d = input_dim(source, encoder)
        transform.check(d)
        poolings = poolings_for(encoder if not source.precomputed else None, options.extra_poolings)
        fit_pooling = transform.pooling or poolings[0]
        if fit_pooling not in poolings:
            raise ConfigError(
                f"cannot fit on pooling {fit_pooling!r}: this build stashes {', '.join(poolings)}", "pooling"
            )
        check_buildable(index, transform.dim or d, report.usable)
    work = files.work_dir(out)
    stash, skip = _open_stash(work, source, encoder, d, poolings, options)  # a refused resume keeps its work
    window_rows = int(stash.meta.get("window_rows") or options.window_rows)  # a resume keeps the windows it began
    try:
        analyzer = Analyzer(options.lexical) if options.lexical is not None else None
        columns = ColumnsWriter(work / COLUMNS) if corpus.columns else None
        ingest = Ingest(stash, encoder, fit_pooling, report.usable, progress, analyzer=analyzer, columns=columns)
        with timer.stage("encode"):
            for block in stash.iter_blocks(pooling=fit_pooling):  # rows a resumed build already has
                ingest.moments.update(block)
            if analyzer is not None:
                for table in stash.iter_docs():
                    ingest.count_terms(table["text"].to_pylist())
            if columns is not None:  # read here, never encoded: the windows a resumed build already has, and
                # with an engine every window (its workers return stash parts and moments, not metadata)
                for batch in source.batches(window_rows, stop_batches=skip if engine is None else None):
                    assert batch.columns is not None
                    columns.write(batch.columns)
            progress("encode", len(stash), report.usable)
            if engine is None:
                for batch in source.batches(window_rows, skip_batches=skip):
                    ingest(batch)
            else:  # the same windows, encoded by the engine's workers and adopted here in window order
                engine.ingest(source, ingest, skip, window_rows)
            if columns is not None:
                columns.close()
        spec = replace(transform, pooling=fit_pooling)
        transform_record, index_record = write_version(
            work, stash, ingest.moments, spec, index, timer, progress, engine
        )
        lexical = None
        if ingest.terms is not None and options.lexical is not None:
            with timer.stage("lexical"):
                lexical = save_lexical(work, ingest.terms.counts(), options.lexical)
            # the tokenizing was timed inside "encode": moved here, so the two stages add up to the wall time
            timer.seconds["encode"] = round(timer.seconds["encode"] - ingest.lexical_seconds, 4)
            timer.seconds["lexical"] = round(timer.seconds["lexical"] + ingest.lexical_seconds, 4)
    except (RetrievalError, OSError):  # a user's error or a full disk: nothing to resume, nothing left behind
        shutil.rmtree(work, ignore_errors=True)
        raise
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM as the CLI raises it
        log.warning("stopped: the encoded parts are kept in %s; rerun with --resume to continue", work)
        raise
    info = encoder.info() if encoder else EncoderInfo(kind="vectors", dim=d, column=corpus.vectors_column)
    manifest = Manifest(
        encoder=info,
        transform=transform_record,
        index=index_record,
        corpus=CorpusRecord(
            path=str(Path(corpus.path).resolve()),
            rows=report.rows,
            indexed=report.usable,
            skipped=report.skipped,
            sha256=stash.meta["corpus_sha256"],
            settings=corpus.settings(),
        ),
        stash=StashRecord.of(stash) if options.keep_vectors else None,
        generation=_replaced_generation(out) + 1,
        lexical=lexical,
        columns=column_types(columns.schema) if columns is not None else {},
    )
    if not options.keep_vectors:
        shutil.rmtree(work / STASH)
    with timer.stage("write"):
        manifest = write_manifest(work, replace(manifest, timings=timer.seconds))
        files.publish(work, out, OWN_NAMES)
    log.info("built %s: %d rows, %d -> %d dims", out, manifest.n, d, manifest.transform.dim)
    return replace(manifest, timings=timer.seconds)


def _replaced_generation(out: Path) -> int:
    """The generation of the index an ``overwrite`` replaces (0 when there is none, or it cannot be read): the
    new build continues the count, so a server watching ``out`` (``/info``, the generation metric) shows a
    rebuild as a new version, as it shows ``add`` and ``refit``."""
    if not is_index_dir(out):
        return 0
    try:
        return IndexDir(out).manifest().generation
    except IndexDirError:
        return 0


def input_dim(source: Corpus, encoder: Encoder | None) -> int:
    """The width of the raw vectors: the precomputed vectors' own, else the encoder's."""
    if source.precomputed:
        if source.vector_dim is not None:
            return source.vector_dim
        first = next(iter(source.batches(1024)))
        assert first.vectors is not None
        return int(first.vectors.shape[1])
    if encoder is None:
        raise ConfigError(
            "no encoder given and no `vectors_column`: nothing can turn the texts into vectors", "vectors_column"
        )
    return encoder.dim


def _open_stash(
    work: Path, source: Corpus, encoder: Encoder | None, d: int, poolings: list[str], options: BuildOptions
) -> tuple[VectorStash, int]:
    """A fresh stash in the work directory, or, with ``resume``, the one an interrupted build left there.

    Precision "auto" is settled before the stash records the encoder, and a resumed build takes the choice
    recorded (timing could choose otherwise the second time, and a stash must not mix fp32 and bf16 vectors)."""
    stash_dir = work / STASH
    resuming = options.resume and (stash_dir / STATE_NAME).is_file()
    if resuming:
        _check_no_links(work)
        stash = VectorStash.open(stash_dir)
    settle = getattr(encoder, "settle_precision", None)
    if settle is not None:
        settle(((stash.meta.get("encoder") or {}) if resuming else {}).get("precision_used"))
    meta = {
        "corpus_sha256": source.fingerprint(),
        "corpus": source.spec.settings(),
        "encoder": encoder.info().to_dict() if encoder else None,
        "window_rows": options.window_rows,
    }
    if resuming:
        found = _flat(stash.meta) | {"poolings": stash.poolings, "stash_dtype": stash.dtype}
        wanted = _flat(json.loads(json.dumps(meta))) | {"poolings": poolings, "stash_dtype": options.stash_dtype}
        # the windows are the stash's own (each is a part): a resume keeps them, whichever engine (Ray cuts
        # smaller ones than a local build) resumes
        same = ("encoder", "window_rows")
        changed = [key for key in wanted if key not in same and found.get(key) != wanted[key]]
        if _identity(found.get("encoder")) != _identity(wanted.get("encoder")):
            changed.append("encoder")
        if changed:
            settings = [key for key in changed if key != "corpus_sha256"]
            what = "; ".join(
                (["the corpus file has changed"] if "corpus_sha256" in changed else [])
                + ([f"{', '.join(settings)} changed"] if settings else [])
            )
            raise ConfigError(
                f"cannot resume the unfinished build in {work}: {what} since it started; "
                "run again without `resume` to start over",
                "resume",
            )
        _drop_unlisted(stash)
        stash.verify(full=True)
        log.info("resuming: %d rows (%d record batches) already encoded", len(stash), stash.source_batches)
        return stash, stash.source_batches
    if options.resume:
        log.warning("nothing to resume in %s; starting a fresh build", work)
    elif (stash_dir / STATE_NAME).is_file():
        log.warning("discarding the unfinished build in %s (rerun with `--resume` to continue one)", work)
    files.remove_tree(work)  # a link at its name is refused (``writing`` checked it already), never followed
    work.mkdir()
    return VectorStash.create(stash_dir, d, poolings, options.stash_dtype, meta), 0


def _check_no_links(work: Path) -> None:
    """A work directory holding a symbolic link (planted, or copied in) could make a resume delete or write
    files outside the index: refuse it rather than follow it."""
    for path in [work, *work.rglob("*")]:
        if path.is_symlink():
            raise IndexDirError(
                f"the unfinished build in {work} contains a symbolic link ({path.name}); remove {work} and "
                "build again without `resume`"
            )


def _identity(info: dict[str, Any] | None) -> Any:
    """What of an encoder record decides the vectors: not the precision "auto" settled on (a resumed build takes
    the recorded one) nor the CPU it was measured on (a build may be resumed on another machine)."""
    if info is None:
        return None
    return {k: v for k, v in info.items() if k not in ("precision_used", "precision_cpu")}


def _flat(meta: dict[str, Any]) -> dict[str, Any]:
    """The stash fingerprint with the corpus-reading settings (text_column, ...) as top-level keys."""
    return {k: v for k, v in meta.items() if k != "corpus"} | dict(meta.get("corpus") or {})


def _drop_unlisted(stash: VectorStash) -> None:
    """Remove what a killed build left half-written: entries in the stash that ``stash.json`` does not list."""
    listed = set(stash.files())
    for path in stash.root.iterdir():
        if path not in listed:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


# ----- pass 2 ----------------------------------------------------------------------------------------------
def write_version(
    work: Path,
    stash: VectorStash,
    moments: RunningMoments,
    spec: TransformSpec,
    index_spec: IndexSpec,
    timer: Timer,
    progress: Progress,
    engine: Engine | None = None,
) -> tuple[TransformRecord, IndexRecord]:
    """Fit, fill the index from the stash, and write everything but the manifest into ``work``."""
    assert spec.pooling is not None
    with timer.stage("fit"):
        transform = spec.fit(moments)
    with timer.stage("index"):
        faiss_index = fill_index(stash, transform, index_spec, spec.pooling, progress, engine=engine)
    with timer.stage("write"):
        save_transform(work, transform)
        save_moments(work, moments)
        save_faiss_index(work, faiss_index)
        save_docs(work, stash)
    return TransformRecord.of(transform, spec), index_record(faiss_index, index_spec, len(stash))


def index_record(
    faiss_index: Any, spec: IndexSpec, n: int, factory: str | None = None, calibration: Calibration | None = None
) -> IndexRecord:
    """The manifest's record of a FAISS index; ``factory``: the string it was built from, when that was not at
    ``n`` rows (``add`` grows an index built for fewer: its lists stay those it was trained with);
    ``calibration``: a default knob measured on queries (``retrieval calibrate``), which replaces the spec's."""
    search = default_search_params(faiss_index, spec)
    if calibration is not None:
        search[calibration.knob] = calibration.value
    return IndexRecord(
        spec=spec,
        factory=factory or spec.factory(n),
        ntotal=int(faiss_index.ntotal),
        search=search,
        faiss=describe(faiss_index),
        metric="hamming" if spec.binary else "inner_product",
        calibration=calibration,
    )


def fill_index(
    stash: VectorStash,
    transform: Whitening | RawTransform,
    spec: IndexSpec,
    pooling: str | None = None,
    progress: Progress = no_progress,
    engine: Engine | None = None,
) -> Any:
    """Pass 2: train on a transformed sample where the index needs it, then add the stash block by block
    (or let ``engine`` fill shards of a large IVF index in parallel and merge them)."""
    n = len(stash)
    index = create_index(spec, transform.dim_out, n)
    sample_rows = training_rows(index, spec, n)
    if sample_rows:
        sample = stash.sample(sample_rows, pooling=pooling)
        train(index, transform.transform(sample), sample, transform)
    filled = engine.fill(index, stash, transform, pooling) if engine else None
    if filled is not None:  # shards filled in parallel and merged
        index = filled
        progress("index", n, n)
    else:
        for block in stash.iter_blocks(BLOCK_ROWS, pooling=pooling):
            add_rows(index, transform, block)  # refuses non-finite vectors: never an index of NaN or inf
            progress("index", block.shape[0], n)
    set_search_params(index, **default_search_params(index, spec))
    return index
