"""Growing and re-fitting an index directory from its stash: add, refit, drift.

``refit`` fits a new kernel from the stored moments (or from the stash, for another pooling) and rebuilds the
FAISS index from the stash: nothing is encoded again. ``add`` encodes only new rows, appends them to the stash
as new parts, merges their moments and adds them to the index with the EXISTING kernel. ``drift`` says how far
that kernel now is from a fresh fit on the updated moments, so users know when to ``refit``.

Both writers assemble the new directory in a hidden sibling (unchanged stash parts hard-linked, not copied) and
swap it into place with ``files.publish``: an interruption leaves the previous index intact.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from retrieval import files
from retrieval.build import (
    WINDOW_ROWS,
    Progress,
    Timer,
    TransformSpec,
    encode_batch,
    no_progress,
    write_artifacts,
    write_docs,
)
from retrieval.corpus import Corpus, CorpusSpec
from retrieval.encoder import Encoder, check_compatible, load_encoder
from retrieval.errors import ConfigError, CorpusError, IndexDirError
from retrieval.index import IndexSpec, describe, load_index, save_index
from retrieval.manifest import (
    DOCS_NAME,
    INDEX_NAME,
    MOMENTS_NAME,
    STASH_DIR,
    TRANSFORM_NAME,
    Manifest,
    stash_part_records,
)
from retrieval.moments import RunningMoments
from retrieval.stash import VectorStash
from retrieval.whitening import Whitening, load_transform

log = logging.getLogger(__name__)

# drift() advises a refit above these: 10% relative change of the whitened covariance, or a top-k subspace
# whose mean squared principal cosine fell below 0.9.
DRIFT_REFIT = 0.1
OVERLAP_REFIT = 0.9


# ----- what to fit, what to build --------------------------------------------------------------------------
def transform_spec(directory: Path, **changes: Any) -> TransformSpec:
    """The transform spec ``directory`` was fitted with, with ``changes`` applied (None values: keep).

    Turning whitening off drops a kept ``dim`` unless one is given (the raw transform keeps every dimension).
    """
    current = TransformSpec(**Manifest.load(directory).transform["spec"])
    given = {key: value for key, value in changes.items() if value is not None}
    if given.get("whiten") is False and "dim" not in given:
        given["dim"] = None
    return dataclasses.replace(current, **given)


def index_spec(directory: Path, **changes: Any) -> IndexSpec:
    """The FAISS index spec ``directory`` was built with, with ``changes`` applied (None values: keep)."""
    current = IndexSpec(**Manifest.load(directory).index["spec"])
    return dataclasses.replace(current, **{key: value for key, value in changes.items() if value is not None})


# ----- refit -----------------------------------------------------------------------------------------------
def refit(
    directory: Path,
    transform: TransformSpec,
    index: IndexSpec | None = None,
    progress: Progress = no_progress,
) -> Manifest:
    """Re-fit the kernel and rebuild the index of ``directory`` from its stash, without encoding anything.

    ``index=None`` keeps the current index kind and knobs. The moments come from ``moments.npz`` when the
    pooling is unchanged, else from one pass over the stash for the new pooling.
    """
    directory = Path(directory)
    with files.writing(directory):
        return _refit(directory, transform, index, progress)


def _refit(directory: Path, transform: TransformSpec, index: IndexSpec | None, progress: Progress) -> Manifest:
    manifest = Manifest.load(directory)
    stash = _stash(directory, "refit")
    transform.check(stash.dim)
    pooling = transform.pooling or manifest.transform["pooling"]
    if pooling not in stash.poolings:
        raise ConfigError(
            f"the stash of {directory} holds poolings {', '.join(stash.poolings)}, not {pooling!r}; "
            "build with --extra-pooling to keep more"
        )
    spec = dataclasses.replace(transform, pooling=pooling)
    index = index or IndexSpec(**manifest.index["spec"])
    timer = Timer()
    with files.replacing(directory, "refitting") as work:
        linked = _link_stash(stash, work / STASH_DIR)
        with timer.stage("moments"):
            if pooling == manifest.transform["pooling"]:
                moments = RunningMoments.load(directory / MOMENTS_NAME)
            else:
                moments = stash_moments(linked, pooling)
        new = write_artifacts(work, linked, moments, spec, index, timer, progress)
        new.encoder, new.corpus = manifest.encoder, manifest.corpus
        new.files = stash_part_records(manifest, list(new.files))
        if "pooling" in new.encoder:  # queries must be pooled as the documents the new kernel was fitted on
            new.encoder = new.encoder | {"pooling": pooling}
        with timer.stage("write"):
            new.timings = timer.seconds
            new.save(work)
    log.info("refitted %s: %d rows, %d -> %d dims", directory, new.n, new.transform["d"], new.transform["k"])
    return new


def stash_moments(stash: VectorStash, pooling: str | None = None) -> RunningMoments:
    """Moments of every stashed vector of one pooling, streamed block by block."""
    moments = RunningMoments(stash.dim)
    for block in stash.iter_blocks(pooling=pooling):
        moments.update(block)
    return moments


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
    only). Ids must be new; row-number ids (no id column, or a .npy) continue from the index's row count.
    The directory is replaced atomically: on any failure the previous index stays as it was.
    """
    directory = Path(directory)
    with files.writing(directory):
        return _add(directory, corpus, encoder, progress, window_rows)


def _add(
    directory: Path, corpus: CorpusSpec, encoder: Encoder | None, progress: Progress, window_rows: int
) -> Manifest:
    manifest = Manifest.load(directory)
    stash = _stash(directory, "add")
    source = Corpus(corpus)
    report = source.validate(min_rows=1)
    encoder = _encoder_for(manifest, source, encoder)
    width = _input_width(source, encoder)
    if width != stash.dim:
        raise CorpusError(f"{corpus.path} gives {width}-d vectors; the index at {directory} takes {stash.dim}-d")
    offset = len(stash) if source.id_column is None else 0
    _check_new_ids(directory, source, window_rows, offset)

    pooling = manifest.transform["pooling"]
    transform = load_transform(directory / TRANSFORM_NAME)
    timer = Timer()
    with files.replacing(directory, "adding") as work:
        grown = _link_stash(stash, work / STASH_DIR)
        files.link_or_copy(directory / TRANSFORM_NAME, work / TRANSFORM_NAME)  # never written: safe to share
        with timer.stage("load"):
            faiss_index = load_index(directory / INDEX_NAME)
        added = RunningMoments(stash.dim)

        def on_batch(n: int) -> None:
            progress("encode", n, report.usable)

        with timer.stage("encode"):
            for batch in source.batches(window_rows):
                ids = [str(int(i) + offset) for i in batch.ids] if offset else batch.ids
                vectors = encode_batch(batch, source, encoder, grown.poolings, stash.dim, on_batch)
                grown.append(vectors, ids, batch.texts)
                stored = np.asarray(vectors[pooling], dtype=grown.state["dtype"]).astype(np.float32, copy=False)
                added.update(stored)
                faiss_index.add(transform.transform(stored))
                if batch.vectors is not None:
                    progress("encode", len(batch), report.usable)
        with timer.stage("write"):
            moments = RunningMoments.load(directory / MOMENTS_NAME).merge(added)
            moments.save(work / MOMENTS_NAME)  # fresh files, never the linked ones: the old index stays intact
            save_index(faiss_index, work / INDEX_NAME)
            write_docs(grown, work / DOCS_NAME)
            new = _grown_manifest(manifest, grown, faiss_index, corpus, source, added.n)
            new.timings = timer.seconds
            new.save(work)
    log.info("added %d rows to %s (now %d)", added.n, directory, new.n)
    return new


def _encoder_for(manifest: Manifest, source: Corpus, encoder: Encoder | None) -> Encoder | None:
    built_from_vectors = manifest.encoder.get("kind") == "vectors"
    if source.precomputed != built_from_vectors:
        if built_from_vectors:
            raise ConfigError(
                "this index was built from precomputed vectors: add a .npy or a parquet with --vectors-column"
            )
        raise ConfigError(
            f"this index encodes text with {manifest.encoder.get('model')!r}: add texts, not precomputed vectors"
        )
    if source.precomputed:
        return None
    if encoder is None:
        return load_encoder(manifest.encoder)
    check_compatible(manifest.encoder, encoder.describe())
    return encoder


def _input_width(source: Corpus, encoder: Encoder | None) -> int:
    if encoder is not None:
        return encoder.dim
    if source.vector_dim is not None:
        return source.vector_dim
    first = next(iter(source.batches(1024)))
    assert first.vectors is not None
    return int(first.vectors.shape[1])


def _check_new_ids(directory: Path, source: Corpus, window_rows: int, offset: int) -> None:
    existing = set(pq.read_table(directory / DOCS_NAME, columns=["id"]).column("id").to_pylist())
    clashes: list[str] = []
    count = 0
    for batch in source.batches(window_rows):
        for i in batch.ids:
            i = str(int(i) + offset) if offset else i
            if i in existing:
                count += 1
                if len(clashes) < 5:
                    clashes.append(i)
    if count:
        raise CorpusError(
            f"{count} ids of {source.path} are already in the index (first: {', '.join(clashes)}); "
            "ids must be new: drop those rows, or rebuild the index from the merged corpus"
        )


def _grown_manifest(
    old: Manifest, stash: VectorStash, faiss_index: Any, spec: CorpusSpec, source: Corpus, rows: int
) -> Manifest:
    corpus = dict(old.corpus)
    corpus["added"] = [
        *corpus.get("added", []),
        {
            "path": str(Path(spec.path).resolve()),
            "rows": rows,
            "sha256": source.fingerprint(),
            "at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            **spec.settings(),
        },
    ]
    index = old.index | {"ntotal": int(faiss_index.ntotal), "faiss": describe(faiss_index)}
    stash_files = [str(p.relative_to(stash.root.parent)) for p in stash.files()]
    names = [TRANSFORM_NAME, MOMENTS_NAME, INDEX_NAME, DOCS_NAME, *stash_files]
    return dataclasses.replace(
        old,
        corpus=corpus,
        index=index,
        stash=(old.stash or {}) | {"rows": len(stash)},
        files=stash_part_records(old, names),
    )


# ----- drift -----------------------------------------------------------------------------------------------
def drift(directory: Path) -> dict[str, Any]:
    """How far the stored kernel is from a fresh fit on the current moments (after ``add``).

    ``covariance_drift``: ||W^T S W - D||_F / ||D||_F, where S is the current second moment about the kernel's
    mean (covariance plus the mean shift), W the stored kernel and D = W^T Sigma_fit W its value at fit time
    (diagonal; ~identity for gamma = 1). ``subspace_overlap``: mean squared cosine of the principal angles
    between the stored top-k eigenvectors and those of a fresh fit (1 = same subspace; always 1 when k = d).
    ``mean_shift``: how far the mean moved, in whitened units relative to the spread at fit time.
    """
    directory = Path(directory)
    manifest = Manifest.load(directory)
    transform = load_transform(directory / TRANSFORM_NAME)
    moments = RunningMoments.load(directory / MOMENTS_NAME)
    if not isinstance(transform, Whitening):
        return {"kind": "raw", "rows_now": moments.n, "rows_added": manifest.n - moments.n}
    k = transform.dim_out
    w = transform.kernel
    lam = transform.eigenvalues
    scale = lam[0] if lam[0] > 0 else 1.0
    at_fit = lam[:k] * (lam[:k] + transform.epsilon * scale) ** (-transform.gamma)  # diag of W^T Sigma_fit W
    shift = moments.mean - transform.mean
    second = moments.covariance() + np.outer(shift, shift)
    now = w.T @ second @ w
    covariance_drift = float(np.linalg.norm(now - np.diag(at_fit))) / max(float(np.linalg.norm(at_fit)), 1e-300)
    fresh = Whitening.fit(moments, dim=k, gamma=transform.gamma, epsilon=transform.epsilon)
    old_basis = w / np.linalg.norm(w, axis=0)
    new_basis = fresh.kernel / np.linalg.norm(fresh.kernel, axis=0)
    cosines = np.clip(np.linalg.svd(old_basis.T @ new_basis, compute_uv=False), 0.0, 1.0)
    mean_shift = float(np.linalg.norm(shift @ w) / max(np.sqrt(at_fit.sum()), 1e-300))
    overlap = float(np.mean(cosines**2))
    report: dict[str, Any] = {
        "kind": "whitening",
        "rows_at_fit": transform.n,
        "rows_now": moments.n,
        "rows_added": moments.n - transform.n,
        "covariance_drift": covariance_drift,
        "mean_shift": mean_shift,
        "subspace_overlap": overlap,
        "max_principal_angle_deg": float(np.degrees(np.arccos(cosines.min()))),
    }
    report["refit_advised"] = covariance_drift > DRIFT_REFIT or overlap < OVERLAP_REFIT
    return report


def describe_drift(report: dict[str, Any]) -> str:
    """One line for ``retrieval info``."""
    if report["kind"] != "whitening":
        return "no kernel (raw transform)"
    line = (
        f"{report['covariance_drift']:.3f} (whitened covariance, relative), subspace overlap "
        f"{report['subspace_overlap']:.3f}, {report['rows_added']:,} rows added since the fit"
    )
    return line + ("; consider `retrieval refit`" if report["refit_advised"] else "")


# ----- shared ----------------------------------------------------------------------------------------------
def _stash(directory: Path, action: str) -> VectorStash:
    path = directory / STASH_DIR
    if not (path / "stash.json").is_file():
        raise IndexDirError(
            f"{directory} kept no raw-vector stash, so it cannot {action} without re-encoding; "
            "rebuild it with --keep-vectors (the default)"
        )
    return VectorStash.open(path)


def _link_stash(stash: VectorStash, root: Path) -> VectorStash:
    """The stash's parts hard-linked under ``root`` (no copy); ``stash.json`` copied, as ``append`` rewrites it."""
    for path in stash.files():
        if path.name == "stash.json":
            root.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, root / path.name)
        else:
            files.link_or_copy(path, root / path.name)
    return VectorStash.open(root)
