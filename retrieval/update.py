"""Changing an index directory from its stash: add, remove and refit; and calibrate, which sets the default
search knob to the value measured on queries.

``refit`` fits a new kernel from the stored moments (or from the stash, for another pooling) and rebuilds the
FAISS index from the stash: nothing is encoded again. ``add`` encodes only new rows, appends them to the stash
as new parts, merges their moments and adds them to the index with the EXISTING kernel (``info`` reports how
far that kernel has drifted from a fresh fit, so users know when to ``refit``).

``remove`` drops rows by id from the stash, the docs and the index, with the existing kernel. Every writer
verifies what it reads, assemble the new version in a hidden sibling (unchanged stash parts
hard-linked, not copied) and swap it into place with ``files.publish``: an interruption leaves the previous
index intact.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import shutil
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from retrieval import files
from retrieval.build import WINDOW_ROWS, index_record, input_dim, write_version
from retrieval.calibrate import Served, calibrate, check_target, fused, query_sample
from retrieval.corpus import Corpus, CorpusSpec, id_hashes
from retrieval.docs import ColumnsWriter
from retrieval.encode.spec import Encoder
from retrieval.encode.transformer import from_info
from retrieval.errors import BusyError, ConfigError, CorpusError
from retrieval.fusion import FusionSpec, check_mode
from retrieval.index import KINDS, IndexSpec, add_rows, check_buildable, set_search_params
from retrieval.indexdir import (
    COLUMNS,
    DOCS,
    INDEX,
    MOMENTS,
    OWN_NAMES,
    RESCORE,
    STASH,
    TRANSFORM,
    IndexDir,
    link_from,
    link_lexical,
    save_docs,
    save_faiss_index,
    save_lexical,
    save_moments,
    save_rescorer,
    write_manifest,
)
from retrieval.ingest import Ingest
from retrieval.lexical import Analyzer, TermStats, take_rows
from retrieval.manifest import Calibration, CorpusRecord, Manifest, RescoreRecord, StashRecord, depth_key, now
from retrieval.moments import RunningMoments
from retrieval.progress import Progress, Timer, no_progress
from retrieval.stash import STATE_NAME, VectorStash, titles_of
from retrieval.whitening import TransformSpec, Whitening

log = logging.getLogger(__name__)


# ----- what to fit, what to build --------------------------------------------------------------------------
def current(directory: Path) -> Manifest:
    """The manifest of the version a writer (``add``, ``remove``, ``refit``) starts from, read before it takes
    the lock (the settings it keeps): a version an interrupted publish left aside is put back first (a reader
    would only say where it is)."""
    files.restore(directory)
    return IndexDir(files.resolved(directory)).manifest()


def transform_spec(directory: Path, **changes: Any) -> TransformSpec:
    """The transform spec ``directory`` was fitted with, with ``changes`` applied (None values: keep).

    Turning whitening off drops a kept ``dim`` and ``gamma`` unless given (the raw transform keeps every
    dimension and has no kernel; a ``gamma`` given with it is refused by ``TransformSpec.check``).
    """
    record = current(directory).transform
    fitted = record.spec
    given = {key: value for key, value in changes.items() if value is not None}
    if given.get("whiten") is False and "dim" not in given:
        given["dim"] = None
    if given.get("whiten") is False and "gamma" not in given:
        given["gamma"] = None  # nor a gamma
    if "center" not in given and ("dim" in given or given.get("whiten") is False):
        given["center"] = None  # a new `dim` without a word on centring: the default for that dim (raw: none)
    if "whiten" not in given and ("dim" in given or "gamma" in given):
        given["whiten"] = None  # a new `dim` or `gamma` without a word on whitening: the defaults decide
    # (a raw index records no gamma: TransformRecord.of resolves it away, so a raw index gets the default one)
    spec = dataclasses.replace(fitted, **given)
    if "epsilon" in given and not spec.resolve(record.d).whiten:
        raise ConfigError("the raw transform has no eigenvalues to regularise; drop `epsilon`, or whiten", "epsilon")
    return spec


def index_spec(directory: Path, **changes: Any) -> IndexSpec:
    """The FAISS index spec ``directory`` was built with, with ``changes`` applied (None values: keep). A knob
    given for a kind that does not read it is refused (``IndexSpec.check_given``)."""
    kept = current(directory).index.spec
    given = {key: value for key, value in changes.items() if value is not None}
    if "kind" in given and given["kind"] not in KINDS and "codes" not in given:
        given["codes"] = None  # a factory string names its own codes: the kept ones do not carry over
    if given.get("codes", "binary") != "binary" and "rotation" not in given:
        given["rotation"] = None  # a binary index's rotation does not carry over to other codes
    if given.get("codes", "binary") != "binary" and "rerank" not in given:
        given["rerank"] = None  # nor its re-rank depth
    spec = dataclasses.replace(kept, **given)
    spec.check_given({key: value for key, value in changes.items() if key != "kind"})
    return spec


# ----- refit -----------------------------------------------------------------------------------------------
def refit(
    directory: Path,
    transform: TransformSpec,
    index: IndexSpec | None = None,
    progress: Progress = no_progress,
    scorer: TransformSpec | None = None,
    generation: int | None = None,
) -> Manifest:
    """Re-fit the kernel and rebuild the index of ``directory`` from its stash, without encoding anything.

    ``index=None`` keeps the current index kind and knobs. The moments come from ``moments.npz`` when the
    pooling is unchanged, else from one pass over the stash for the new pooling. ``scorer``: the full-dimension
    scorer of re-scoring (raw, or a full-rank whitening fitted here; ``tune`` chooses it); None keeps the
    current one while the pooling is unchanged, else raw cosine. ``generation``: the version the specs were
    read from (``transform_spec``, ``index_spec``); if another writer has published since, the refit is refused,
    since the settings it keeps would undo that writer's.
    """
    directory = files.resolved(directory)
    if index is not None:
        index.check()
    with files.write_errors(directory), files.writing(directory):
        old = IndexDir(directory)
        if generation is not None and (now_serving := old.manifest().generation) != generation:
            raise BusyError(
                f"{directory} changed since this refit read it (version {generation} -> {now_serving}, published "
                "by another writer meanwhile): run it again, to re-fit the new version"
            )
        return _refit(old, transform, index, progress, scorer)


def _refit(
    old: IndexDir, transform: TransformSpec, index: IndexSpec | None, progress: Progress, scorer: TransformSpec | None
) -> Manifest:
    manifest = old.manifest()
    old.verify(manifest, "full")
    stash = old.stash("refit")
    transform.check(stash.dim)
    pooling = transform.pooling or manifest.transform.pooling
    stash.check_pooling(pooling)
    spec = dataclasses.replace(transform, pooling=pooling)
    if scorer is None:
        kept = manifest.rescoring.scorer
        scorer = kept if kept.pooling == pooling else TransformSpec.raw(pooling)
    scorer = dataclasses.replace(scorer, pooling=pooling).resolve(stash.dim)
    if scorer.dim != stash.dim:
        raise ConfigError(f"the re-scoring transform must keep all {stash.dim} dimensions (got {scorer.dim})", "dim")
    index = index or manifest.index.spec
    check_buildable(index, transform.dim or stash.dim, len(stash))
    timer = Timer()
    with files.replacing(old.path, "refitting", OWN_NAMES) as work:
        linked = link_stash(stash, work / STASH)
        if manifest.lexical is not None:  # the rows and texts are unchanged: so is the BM25 index
            link_lexical(work, old)
        if manifest.columns:
            link_from(work, old, COLUMNS)
        with timer.stage("moments"):
            moments = old.moments() if pooling == manifest.transform.pooling else linked.moments(pooling)
        transform_record, index_record_ = write_version(work, linked, moments, spec, index, timer, progress)
        fitted = scorer.fit(moments)
        if isinstance(fitted, Whitening):
            save_rescorer(work, fitted)
        default = RescoreRecord.default(
            transform_record, manifest.stash, index_record_.factory, depth_key(index_record_)
        )
        rescore = RescoreRecord(default.depth, scorer)
        changes = len(manifest.corpus.added) + len(manifest.corpus.removed)
        new = manifest.next_version(
            encoder=manifest.encoder.with_pooling(pooling),  # queries are pooled as the documents the kernel saw
            corpus=dataclasses.replace(manifest.corpus, trained_after=changes),  # lists and codes trained again
            transform=transform_record,
            index=index_record_,
            rescore=rescore,
            timings=timer.seconds,
        )
        new = write_manifest(work, new)
    log.info("refitted %s: %d rows, %d -> %d dims", old.path, new.n, new.transform.d, new.transform.dim)
    return new


# ----- add -------------------------------------------------------------------------------------------------
def add(
    directory: Path,
    corpus: CorpusSpec,
    encoder: Encoder | None = None,
    progress: Progress = no_progress,
    window_rows: int = WINDOW_ROWS,
) -> Manifest:
    """Encode the rows of ``corpus`` and add them to the index at ``directory`` with its existing kernel.

    ``encoder=None`` loads the one the manifest names (indexes of precomputed vectors take precomputed vectors
    only). Ids must be new; row-number ids (no id column, or a .npy) continue past the index's (``next_row_number``);
    a folder's files without ids keep their "file:row" ids.
    The directory is replaced atomically: on any failure the previous index stays as it was.
    """
    directory = files.resolved(directory)
    with files.write_errors(directory), files.writing(directory):
        return _add(IndexDir(directory), corpus, encoder, progress, window_rows)


def read_like_build(directory: Path, path: Path, **given: Any) -> CorpusSpec:
    """How ``add`` reads ``path``: each option in ``given`` that is not None (``text_column``, ``id_column``,
    ``title_column``, ``vectors_column``, ``skip_empty``) as given, the others as the index at ``directory`` was
    built, so rows added later get ids, titles and texts as the first rows did (an index built with
    ``--id-column doc_id --title-column title`` otherwise took row numbers and untitled texts from a new file
    of the same shape). An empty string asks for no id, title or vectors column."""
    built = current(directory).corpus.settings
    fields = {field.name for field in dataclasses.fields(CorpusSpec)} - {"path"}
    unknown = set(given) - fields
    if unknown:
        raise TypeError(f"read_like_build() got unexpected options {sorted(unknown)}")
    settings = {name: value for name, value in built.items() if name in fields}  # older manifests may lack some
    settings |= {name: value for name, value in given.items() if value is not None}
    for name in ("id_column", "title_column", "vectors_column"):
        settings[name] = settings.get(name) or None  # "" asks for none: row-number ids, no title, texts encoded
    settings["columns"] = tuple(settings.get("columns") or ())  # added rows keep the metadata the index keeps
    return CorpusSpec(Path(path), **settings)


def _add(old: IndexDir, corpus: CorpusSpec, encoder: Encoder | None, progress: Progress, window_rows: int) -> Manifest:
    manifest = old.manifest()
    old.verify(manifest, "full", list(manifest.files))  # what add reads: the index, moments, transform, docs
    stash = old.stash("add")
    stash.verify(full=False, docs=True)  # vectors are only linked: sizes; ids and texts are read again: sha256
    if list(corpus.columns) != list(manifest.columns):
        kept = ", ".join(manifest.columns) or "none"
        raise ConfigError(f"this index keeps the metadata columns: {kept}; add rows with the same `columns`", "columns")
    source = Corpus(corpus)
    report = source.validate(min_rows=1)
    encoder = _encoder_for(manifest, source, encoder)
    width = input_dim(source, encoder)
    if width != stash.dim:
        raise CorpusError(f"{corpus.path} gives {width}-d vectors; the index at {old.path} takes {stash.dim}-d")
    offset = 0
    if source.id_column is None and not source.named_files:
        # Row-number ids start past every ASCII row number the index holds or removed, so none can clash or come
        # back: no second pass.
        offset = next_row_number(stash, manifest.corpus)
    else:
        _check_new_ids(stash, source, window_rows)

    transform = old.transform()
    timer = Timer()
    with files.replacing(old.path, "adding", OWN_NAMES) as work:
        grown = link_stash(stash, work / STASH)
        link_from(work, old, TRANSFORM)  # never written: safe to share
        if manifest.has_rescorer:
            link_from(work, old, RESCORE)
        with timer.stage("load"):
            faiss_index = old.faiss_index_for_adding(report.usable)  # the vectors once, not twice
        lexical = manifest.lexical
        analyzer = Analyzer(lexical.spec) if lexical is not None else None
        ingest = Ingest(grown, encoder, manifest.transform.pooling, report.usable, progress, analyzer=analyzer)
        if lexical is not None:  # new rows' counts continue the index's: the BM25 index is derived again
            ingest.terms = TermStats.of(old.term_counts())
        if manifest.columns:  # the index's rows first, then the new ones, cast to the index's types
            kept = old.columns(manifest)
            ingest.columns = ColumnsWriter(work / COLUMNS, kept.schema)
            ingest.columns.write(kept)
        with timer.stage("encode"):
            for batch in source.batches(window_rows):
                ids = [str(int(i) + offset) for i in batch.ids] if offset else batch.ids
                add_rows(faiss_index, transform, ingest(batch, ids))
            grown.merge_tail(window_rows)  # small adds do not pile up parts (each an open file in a reader)
            if ingest.columns is not None:
                ingest.columns.close()
        with timer.stage("write"):
            save_moments(work, old.moments().merge(ingest.moments))  # fresh files: the old index stays intact
            added = {"path": str(Path(corpus.path).resolve()), "rows": ingest.moments.n}
            added |= {"sha256": source.fingerprint(), "at": now(), **corpus.settings()}
            record = dataclasses.replace(manifest.corpus, added=[*manifest.corpus.added, added])
            if lexical is not None and ingest.terms is not None:
                manifest = dataclasses.replace(
                    manifest, lexical=save_lexical(work, ingest.terms.counts(), lexical.spec)
                )
            new = _write_rows_changed(work, manifest, faiss_index, grown, record, timer)
    log.info("added %d rows to %s (now %d)", ingest.moments.n, old.path, new.n)
    return new


# ----- remove ----------------------------------------------------------------------------------------------
def remove(
    directory: Path, ids: Iterable[str], missing_ok: bool = False, progress: Progress = no_progress
) -> Manifest | None:
    """Remove the documents with these ``ids`` from the index at ``directory``, nothing encoded.

    The stash loses their rows (parts without any are hard-linked, the others rewritten), the FAISS index is
    refilled from the rows kept, with the EXISTING kernel (as ``add``: ``info`` reports drift, ``refit`` re-fits);
    a trained index (IVF, PQ) keeps its lists, any index its knobs and calibrated default, and the moments are
    counted again from the rows kept. Ids the index does not hold are refused, all or nothing, unless
    ``missing_ok``; then None when it holds none of them, and nothing is written. The directory is replaced
    atomically: on any failure the previous index stays as it was.
    """
    wanted = set(map(str, ids))
    if not wanted:
        raise ConfigError("no ids to remove; give the ids of the documents to remove", "ids")
    if "" in wanted:  # a shell's '' or an unset variable, far likelier than a document meant by an empty id
        raise ConfigError("an id to remove is the empty string ''; give the ids of the documents to remove", "ids")
    directory = files.resolved(directory)
    with files.write_errors(directory), files.writing(directory):
        return _remove(IndexDir(directory), wanted, missing_ok, progress)


def _remove(old: IndexDir, wanted: set[str], missing_ok: bool, progress: Progress) -> Manifest | None:
    manifest = old.manifest()
    old.verify(manifest, "full", list(manifest.files))
    stash = old.stash("remove documents")
    stash.verify(full=True)  # every kept row goes into the new index and stash: a corrupt part must not
    dropped: list[np.ndarray] = []  # per part, the rows to drop (one part's ids in memory at a time)
    found: set[str] = set()
    next_number = max(len(stash), _past_removed(manifest.corpus))
    for ids in stash.iter_ids():
        rows = [row for row, i in enumerate(ids) if i in wanted]
        found.update(ids[row] for row in rows)
        dropped.append(np.array(rows, dtype=np.int64))
        next_number = max(next_number, _past_row_numbers(ids))
    count = len(found)  # ids are unique in an index
    if count < len(wanted) and not missing_ok:
        absent = sorted(wanted - found)
        raise CorpusError(
            f"{len(absent):,} of the {len(wanted):,} ids are not in the index "
            f"(first: {', '.join(map(repr, absent[:5]))}); "
            "nothing was removed: check the ids, or pass `missing_ok` to remove the others"
        )
    if count == 0:
        return None
    if len(stash) - count < 2:  # as a build needs: a kernel's drift is measured by fitting one to the rows left
        left = "an empty index" if count == len(stash) else "a single document"
        raise CorpusError(f"removing {count:,} of {len(stash):,} documents would leave {left}; build a new one instead")

    transform, pooling = old.transform(), manifest.transform.pooling
    timer = Timer()
    with files.replacing(old.path, "removing", OWN_NAMES) as work:
        with timer.stage("stash"):
            kept = _stash_without(stash, dropped, work / STASH, f"g{manifest.generation + 1}")
        link_from(work, old, TRANSFORM)
        if manifest.has_rescorer:
            link_from(work, old, RESCORE)
        with timer.stage("load"):
            faiss_index = old.faiss_index()
            faiss_index.reset()  # its rows go; a trained index keeps its lists, HNSW its knobs
        moments = RunningMoments(stash.dim)
        with timer.stage("index"):
            for block in kept.iter_blocks(pooling=pooling):
                moments.update(block)
                add_rows(faiss_index, transform, block)
                progress("index", len(block), len(kept))
        with timer.stage("write"):
            save_moments(work, moments)
            digest = hashlib.sha256("\n".join(sorted(wanted)).encode()).hexdigest()
            # Where added row-number ids start stays past the removed ones: an id names one document, ever.
            removed = {"rows": count, "asked": len(wanted), "ids_sha256": digest}
            removed |= {"next_row_number": next_number, "at": now()}
            record = dataclasses.replace(manifest.corpus, removed=[*manifest.corpus.removed, removed])
            keep = kept_rows(stash, dropped)
            if manifest.columns:
                writer = ColumnsWriter(work / COLUMNS)
                writer.write(old.columns(manifest).take(keep))
                writer.close()
            if manifest.lexical is not None:  # the kept rows' counts, the BM25 index derived again
                counts = take_rows(old.term_counts(), keep)
                manifest = dataclasses.replace(manifest, lexical=save_lexical(work, counts, manifest.lexical.spec))
            new = _write_rows_changed(work, manifest, faiss_index, kept, record, timer)
    log.info("removed %d rows from %s (now %d)", count, old.path, new.n)
    return new


def _write_rows_changed(
    work: Path, manifest: Manifest, faiss_index: Any, stash: VectorStash, corpus: CorpusRecord, timer: Timer
) -> Manifest:
    """The index, docs and manifest of a version whose rows changed (``add``, ``remove``) under the same kernel
    and index kind. A knob measured on queries (``calibrate``) stays: the same lists or graph settings."""
    save_faiss_index(work, faiss_index)
    save_docs(work, stash)
    record = index_record(
        faiss_index, manifest.index.spec, len(stash), manifest.index.factory, manifest.index.calibration
    )
    new = manifest.next_version(corpus=corpus, index=record, stash=StashRecord.of(stash), timings=timer.seconds)
    return write_manifest(work, new)


def kept_rows(stash: VectorStash, dropped: list[np.ndarray]) -> np.ndarray:
    """The rows of ``stash`` not in ``dropped`` (per part, rows within it), ascending."""
    keep = np.ones(len(stash), dtype=bool)
    start = 0
    for part, rows in zip(stash.parts, dropped, strict=True):
        keep[start + rows] = False
        start += part.rows
    return np.flatnonzero(keep)


def _stash_without(stash: VectorStash, dropped: list[np.ndarray], root: Path, tag: str) -> VectorStash:
    """A new stash at ``root`` without the rows ``dropped[i]`` of each part ``i``: untouched parts hard-linked,
    the others rewritten under a new name (``part-00003`` -> ``part-00003-g4``), emptied parts left out."""
    kept = VectorStash.create(root, stash.dim, stash.poolings, stash.dtype, stash.meta)
    parts = []
    start = 0
    for part, rows, docs in zip(stash.parts, dropped, stash.iter_docs(), strict=True):
        if len(rows) == 0:
            for name in part.names:
                files.link_or_copy(stash.root / name, root / name)
            parts.append(part)
        elif len(rows) < part.rows:
            keep = np.setdiff1d(np.arange(part.rows), rows)
            vectors = {pooling: stash.read_rows(start + keep, pooling, keep=False) for pooling in stash.poolings}
            docs = docs.take(keep)
            stem = re.sub(r"-g\d+$", "", part.docs.removesuffix(".parquet")) + f"-{tag}"
            ids, texts = docs["id"].to_pylist(), docs["text"].to_pylist()
            parts.append(kept.write_part(stem, vectors, ids, texts, part.source_batches, titles=titles_of(docs)))
        start += part.rows
    kept.register(parts)
    return kept


# ----- calibrate -------------------------------------------------------------------------------------------
def calibrate_index(
    directory: Path,
    raw_queries: np.ndarray,
    target: float = 0.95,
    source: str = "",
    apply: bool = False,
    rescore: int | None = None,
    mode: str | None = None,
    texts: Sequence[str] | None = None,
) -> tuple[Calibration, Manifest]:
    """Measure the smallest efSearch / nprobe of the index at ``directory`` whose recall@10 on ``raw_queries``
    (encoder vectors, up to ``MAX_QUERIES`` of them, a seeded sample beyond) reaches ``target``
    (``retrieval.calibrate``), for searches that re-score their top ``rescore`` candidates (None: the index's
    default depth, as searches do; 0: the index alone), in ``mode`` (dense or hybrid; None: the mode a search
    of these queries takes, hybrid where the index has a lexical part and ``texts``, the queries' texts, are
    given). ``apply``: publish a new version whose default is that value (the FAISS file stores it too); the
    previous version stays intact on any failure. Returns the measurement and the manifest now in place."""
    check_target(target)
    mode = check_calibration(directory, rescore, mode, texts is not None)[1]
    if texts is not None and len(texts) != len(raw_queries):
        raise ConfigError(f"{len(texts)} query texts for {len(raw_queries)} query vectors", "queries")
    directory = files.resolved(directory)
    args = (raw_queries, target, source, rescore, mode, texts)
    if not apply:
        old = IndexDir(directory)
        manifest = _verified(old)
        index = old.faiss_index(mmap=True)
        return _measure(old, manifest, index, *args), manifest
    with files.write_errors(directory), files.writing(directory):
        old = IndexDir(directory)
        manifest = _verified(old)
        index = old.faiss_index()  # read once: measured, then saved with the new default
        calibration = _measure(old, manifest, index, *args)
        return calibration, _publish_calibration(old, manifest, index, calibration)


def check_calibration(
    directory: Path, rescore: int | None = None, mode: str | None = None, texts: bool = False
) -> tuple[Manifest, str]:
    """What ``calibrate_index`` refuses that its arguments and the manifest alone tell, so a caller can ask
    before it loads an encoder and encodes the queries (20-30 s for a real model): a negative ``rescore``, an
    index with no knob (flat: exact), a mode with no knob (lexical) or that the index or the queries cannot
    serve (hybrid without a lexical part, or without the queries' ``texts``). Returns the manifest read and the
    mode measured (``mode``, else hybrid where the index has a lexical part and the queries are texts)."""
    if rescore is not None and rescore < 0:
        raise ConfigError(f"`rescore` must be 0 or more (got {rescore})", "rescore")
    manifest = IndexDir(files.resolved(directory)).manifest()
    factory = manifest.index.factory.upper()
    if "HNSW" not in factory and "IVF" not in factory:  # what ``calibrate.knob_of`` finds in the FAISS index
        raise ConfigError("a flat index searches exactly: it has no knob to calibrate (use --index-type hnsw or ivf)")
    if mode is None:
        return manifest, "hybrid" if manifest.lexical is not None and texts else "dense"
    check_mode(mode)
    if mode == "lexical":
        raise ConfigError("a lexical search reads no ef-search or nprobe: calibrate `mode` dense or hybrid", "mode")
    if mode == "hybrid" and manifest.lexical is None:
        raise ConfigError(
            f"{directory} has no lexical index: calibrate `mode` dense, or rebuild it with `lexical`", "mode"
        )
    if mode == "hybrid" and not texts:
        raise ConfigError("a hybrid calibration needs the queries' texts: give them as parquet, not .npy", "mode")
    return manifest, mode


def _verified(old: IndexDir) -> Manifest:
    manifest = old.manifest()
    old.verify(manifest, "full", [INDEX, TRANSFORM])
    return manifest


def _measure(
    old: IndexDir,
    manifest: Manifest,
    index: Any,
    raw_queries: np.ndarray,
    target: float,
    source: str,
    rescore: int | None = None,
    mode: str = "dense",
    texts: Sequence[str] | None = None,
) -> Calibration:
    stash = old.stash("calibrate")
    stash.verify(full=False, sampled=manifest.transform.pooling)  # sizes and sampled hashes: it reads every row
    raw = np.asarray(raw_queries, dtype=np.float32)
    if raw.ndim != 2 or raw.shape[1] != stash.dim:
        raise ConfigError(f"the queries are vectors of shape {raw.shape}; this index takes {stash.dim}-d rows")
    broken = int((~np.isfinite(raw).all(axis=1)).sum())  # NaN queries found nothing and "reached" recall 1.0
    if broken:
        raise ConfigError(f"{broken:,} of {len(raw):,} query vectors contain NaN or inf: drop or fix them", "queries")
    sample = query_sample(len(raw))
    raw = raw[sample]
    transform = old.transform()
    depth = manifest.rescoring.depth if rescore is None else rescore
    served = served_as(old, manifest, stash, raw, depth)
    if mode == "hybrid":
        assert texts is not None
        served = hybrid_served(old, manifest, stash, raw, [texts[i] for i in sample], served)
    pooling = manifest.transform.pooling
    calibration = calibrate(index, stash, transform, transform.transform(raw), target, source, pooling, served, raw)
    return dataclasses.replace(calibration, mode=mode, rescore=depth)


def hybrid_served(
    old: IndexDir, manifest: Manifest, stash: VectorStash, raw: np.ndarray, texts: list[str], dense: Served | None
) -> Served:
    """Hybrid searches for ``raw`` (and their ``texts``) as ``Searcher`` serves them: the dense side's candidates
    (re-scored by ``dense`` where the index re-scores, else scored in the index's space), fused with BM25's."""
    from retrieval.search import rescore  # FAISS: imported where an index is searched

    lexical, fusion = old.lexical(manifest), manifest.fusing
    assert lexical is not None
    transform, pooling = old.transform(), manifest.transform.pooling

    def own_scores(rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return rescore(stash, transform, raw, rows, k, pooling)

    depth = max(fusion.depth, dense.depth if dense else 0)
    return fused(dense.rerank if dense else own_scores, lexical.search(texts, fusion.depth), fusion, depth)


def served_as(old: IndexDir, manifest: Manifest, stash: VectorStash, raw: np.ndarray, depth: int) -> Served | None:
    """Searches for ``raw`` (encoder vectors) re-scoring their top ``depth`` candidates as the index's searches
    do (``search.rescore`` with its full-dimension scorer); None for depth 0, the index alone."""
    if depth <= 0:
        return None
    from retrieval.search import rescore  # FAISS: imported where an index is searched

    scorer, pooling = old.rescorer(manifest), manifest.transform.pooling
    return Served(depth, lambda rows, k: rescore(stash, scorer, raw, rows, k, pooling))


def _publish_calibration(old: IndexDir, manifest: Manifest, index: Any, calibration: Calibration) -> Manifest:
    set_search_params(index, **{calibration.knob: calibration.value})
    with files.replacing(old.path, "calibrating", OWN_NAMES) as work:
        link_stash(old.stash("calibrate"), work / STASH)
        for name in (TRANSFORM, MOMENTS, DOCS) + ((RESCORE,) if manifest.has_rescorer else ()):
            link_from(work, old, name)
        if manifest.lexical is not None:
            link_lexical(work, old)
        if manifest.columns:
            link_from(work, old, COLUMNS)
        save_faiss_index(work, index)
        record = index_record(index, manifest.index.spec, manifest.n, manifest.index.factory, calibration)
        new = write_manifest(work, manifest.next_version(index=record))
    log.info("%s: default %s %d (recall@10 %.3f)", old.path, calibration.knob, calibration.value, calibration.recall)
    return new


# ----- fusion ----------------------------------------------------------------------------------------------
def set_fusion(directory: Path, fusion: FusionSpec) -> Manifest:
    """Publish a new version of the index at ``directory`` whose hybrid searches fuse by ``fusion`` (``tune
    --mode hybrid --apply``); every file is shared with the previous version, only the manifest changes."""
    fusion.check()
    directory = files.resolved(directory)
    with files.write_errors(directory), files.writing(directory):
        old = IndexDir(directory)
        manifest = old.manifest()
        if manifest.lexical is None:
            raise ConfigError(f"{directory} has no lexical index to fuse with; rebuild it with `lexical`", "mode")
        old.verify(manifest, "quick")
        with files.replacing(old.path, "fusing", OWN_NAMES) as work:
            if manifest.stash is not None:
                link_stash(old.stash("set the fusion"), work / STASH)
            for name in manifest.files:
                if not name.startswith(f"{STASH}/"):
                    link_from(work, old, name)
            new = write_manifest(work, manifest.next_version(fusion=fusion))
    log.info("%s: hybrid searches fuse by %s, dense weight %.2f", directory, fusion.method, fusion.weight)
    return new


def _encoder_for(manifest: Manifest, source: Corpus, encoder: Encoder | None) -> Encoder | None:
    built_from_vectors = not manifest.encoder.encodes_text
    if source.precomputed != built_from_vectors:
        if built_from_vectors:
            raise ConfigError(
                "this index was built from precomputed vectors: add a .npy or a parquet with `vectors_column`",
                "vectors_column",
            )
        raise ConfigError(
            f"this index encodes text with {manifest.encoder.model!r}: add texts, not precomputed vectors",
            "vectors_column",
        )
    if source.precomputed:
        return None
    if encoder is None:
        return from_info(manifest.encoder)
    manifest.encoder.check_query(encoder.info())
    return encoder


def next_row_number(stash: VectorStash, corpus: CorpusRecord | None = None) -> int:
    """Where row-number ids of added rows start: past the index's rows, past every id that is a row number (a
    build that skipped empty rows numbered its ids by source row, so they can run past the row count) and past
    every row number ``remove`` took out of the index (``corpus``'s record of removals)."""
    top = max(len(stash), _past_removed(corpus))
    for ids in stash.iter_ids():
        top = max(top, _past_row_numbers(ids))
    return top


def _past_row_numbers(ids: Sequence[str]) -> int:
    """One past the highest id of ``ids`` that is an ASCII row number (0 when none is)."""
    return max((int(i) for i in ids if i.isdecimal() and i.isascii()), default=-1) + 1


def _past_removed(corpus: CorpusRecord | None) -> int:
    """Where row numbers stood at each removal. A removal written before removals recorded it has no mark: then
    past every row number the index can ever have given (the build's source rows plus every add's rows), a
    bound that may leave a gap in the numbering but never gives a removed id to a new row."""
    if corpus is None:
        return 0
    ever = corpus.rows + sum(int(added.get("rows", 0)) for added in corpus.added)
    return max((int(r.get("next_row_number", ever)) for r in corpus.removed), default=0)


def _check_new_ids(stash: VectorStash, source: Corpus, window_rows: int) -> None:
    """Refuse ids the index already holds. Memory: 8 bytes per new id (``id_hashes``) and one stash part's ids at a
    time; the index's ids are never all held (a set of 1M id strings is ~100 MB)."""

    def new_ids() -> Iterator[list[str]]:
        for batch in source.batches(window_rows):
            yield batch.ids

    new = np.unique(np.concatenate([id_hashes(ids) for ids in new_ids()]))
    existing: set[str] = set()  # the index's ids whose hash is also a new id's: clashes, or equal hashes
    for ids in stash.iter_ids():
        existing.update(ids[j] for j in np.flatnonzero(np.isin(id_hashes(ids), new)))
    clashes: list[str] = []
    count = 0
    if existing:
        for ids in new_ids():
            for i in ids:
                if i in existing:
                    count += 1
                    if len(clashes) < 5:
                        clashes.append(i)
    if count:
        raise CorpusError(
            f"{count} ids of {source.path} are already in the index (first: {', '.join(clashes)}); "
            "ids must be new: drop those rows, or rebuild the index from the merged corpus"
        )


def link_stash(stash: VectorStash, root: Path) -> VectorStash:
    """The stash's parts hard-linked under ``root`` (no copy); ``stash.json`` copied, as ``register`` rewrites it."""
    for path in stash.files():
        if path.name == STATE_NAME:
            root.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, root / path.name)
        else:
            files.link_or_copy(path, root / path.name)
    return VectorStash.open(root)
