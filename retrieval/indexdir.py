"""An index directory: the only module that knows its file names; one reader, one writer.

    manifest.json   the Manifest (``manifest``): schema version, typed sections, timings, versions, checksums of
                    the files below
    transform.npz   the fitted Whitening or RawTransform
    moments.npz     RunningMoments of the pooling the transform was fitted on
    index.faiss     the FAISS index of the transformed vectors
    docs.arrow      row -> (id, text), memory-mapped
    columns.arrow   the metadata columns kept for filters (``--columns``), row by row, when asked for
    vectors/        the stash of raw vectors (absent when built without it); its parts carry their own checksums
    rescore.npz     the full-rank transform that re-scores candidates, when tune found one better than raw cosine
    lexical/        the BM25 index and the per-document term counts it is derived from (``lexical``), when built

Writers (build, add, refit) assemble a new version in a hidden sibling and publish it whole (``files``); a
reader loads one whole version (``load``): if a publish replaced the directory while it read, it reads again.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from retrieval import files
from retrieval.docs import Docs, read_columns
from retrieval.errors import ConfigError, IndexDirError
from retrieval.lexical import FILES as LEXICAL_FILES
from retrieval.lexical import LexicalIndex, LexicalSpec, TermCounts
from retrieval.manifest import READ_SCHEMAS, SCHEMA_VERSION, LexicalRecord, Manifest, library_versions, now
from retrieval.moments import RunningMoments
from retrieval.stash import STATE_NAME, VectorStash
from retrieval.whitening import RawTransform, Whitening, load_transform

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
TRANSFORM = "transform.npz"
MOMENTS = "moments.npz"
INDEX = "index.faiss"
DOCS = "docs.arrow"
STASH = "vectors"
RESCORE = "rescore.npz"
LEXICAL = "lexical"
COLUMNS = "columns.arrow"
OWN_NAMES = frozenset(
    {MANIFEST, TRANSFORM, MOMENTS, INDEX, DOCS, STASH, RESCORE, LEXICAL, COLUMNS}
)  # what a publish replaces
# its own files at the top (the stash and the lexical part are folders)
FILE_NAMES = (MANIFEST, TRANSFORM, MOMENTS, INDEX, DOCS, RESCORE, COLUMNS)
Identity = tuple[int, ...]  # ``IndexDir.identity``: which version a path names
LOAD_RETRY_SECONDS = 10.0  # how long a reader keeps retrying a load that raced a publish

Verify = Literal["full", "quick", "none"]
VERIFY_LEVELS = ("full", "quick", "none")


def check_verify(level: str) -> None:
    """Refuse a verification level that is not one of ``VERIFY_LEVELS`` (a typo must not skip the checks)."""
    if level not in VERIFY_LEVELS:
        raise ConfigError(f"`verify` must be one of {', '.join(VERIFY_LEVELS)} (got {level!r})", "verify")


# ----- reading ---------------------------------------------------------------------------------------------
class IndexDir:
    """Typed readers of the files of one index directory (no caching: each call reads)."""

    def __init__(self, path: Path | str):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"IndexDir({str(self.path)!r})"

    def manifest(self) -> Manifest:
        path = self.path / MANIFEST
        if not self.path.is_dir():
            aside = files.renamed_aside(files.resolved(self.path))
            if aside is not None:  # a reader never moves it back: that is the next writer's job, under the lock
                raise IndexDirError(
                    f"no index directory at {self.path}, but its previous version is at {aside}: an update was "
                    f"stopped while it published; the next `retrieval add`, `retrieval remove` or `retrieval refit` "
                    f"of {self.path} puts it back, or move it back yourself (`mv {aside} {self.path}`)"
                )
            raise IndexDirError(f"no index directory at {self.path}; build one with `retrieval index CORPUS`")
        if not path.is_file():
            raise IndexDirError(f"{self.path} has no {MANIFEST}: it is not a complete index; rebuild it")
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise IndexDirError(f"{path} is not valid JSON ({err}); the index is corrupt, rebuild it") from err
        version = data.get("schema_version") if isinstance(data, dict) else None
        if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
            import retrieval

            versions = data.get("versions")
            writer = versions.get("retrieval") if isinstance(versions, dict) else None
            by = f", written by retrieval {writer}" if isinstance(writer, str) else ""
            raise IndexDirError(
                f"{self.path} has index schema version {version}{by}; this retrieval ({retrieval.__version__}) "
                f"reads version {SCHEMA_VERSION}: upgrade retrieval to read it"
            )
        if version not in READ_SCHEMAS:
            raise IndexDirError(
                f"{self.path} has index schema version {version}; this retrieval reads versions "
                f"{READ_SCHEMAS[0]} to {SCHEMA_VERSION}: rebuild the index with this version"
            )
        if "checksum" not in data:
            raise IndexDirError(
                f"{self.path} was written by an older retrieval, before manifests carried a checksum: rebuild the "
                "index with this version"
            )
        if data.get("checksum") != checksum(data):
            raise IndexDirError(
                f"{path} does not match its own checksum: it was edited or is corrupt; rebuild the index "
                "(settings are changed with `retrieval refit`, never by editing the manifest)"
            )
        try:
            return Manifest.from_dict(data)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise IndexDirError(
                f"{path} lacks required fields or holds wrong types ({err}); rebuild the index"
            ) from err

    def transform(self) -> Whitening | RawTransform:
        return load_transform(self.path / TRANSFORM)

    def moments(self) -> RunningMoments:
        return RunningMoments.load(self.path / MOMENTS)

    def rescorer(self, manifest: Manifest) -> Whitening | RawTransform:
        """The full-dimension scorer of re-scoring: the saved full-rank transform, or raw cosine."""
        if manifest.has_rescorer:
            return load_transform(self.path / RESCORE)
        return RawTransform(manifest.transform.d)

    def faiss_index(self, mmap: bool = False, manifest: Manifest | None = None) -> Any:
        """The FAISS index; ``mmap``: read-only, its flat storage mapped from the file (``index.load_index``).
        Binary codes get the asymmetric re-rank depth ``manifest`` (None: this directory's) records."""
        from retrieval.codes import BinaryIndex
        from retrieval.index import load_index  # FAISS only where the index itself is read

        index = load_index(self.path / INDEX, mmap)
        if isinstance(index, BinaryIndex):
            index.rerank = (manifest or self.manifest()).index.spec.rerank_used
        return index

    def faiss_index_for_adding(self, rows: int) -> Any:
        """The FAISS index, in memory, with room for ``rows`` more where its kind allows (``index.load_for_adding``)."""
        from retrieval.index import load_for_adding

        return load_for_adding(self.path / INDEX, rows)

    def docs(self) -> Docs:
        return Docs(self.path / DOCS)

    def lexical(self, manifest: Manifest) -> LexicalIndex | None:
        """The BM25 index, memory-mapped, or None when the index has no lexical part."""
        if manifest.lexical is None:
            return None
        return LexicalIndex(self.path / LEXICAL, manifest.lexical.spec)

    def columns(self, manifest: Manifest) -> Any:
        """The kept metadata columns (a memory-mapped ``pyarrow.Table``), or None when none were kept."""
        return read_columns(self.path / COLUMNS) if manifest.columns else None

    def term_counts(self) -> TermCounts:
        """The per-document term counts the BM25 index was derived from (``add``, ``remove`` re-derive it)."""
        from retrieval.lexical import load_counts

        return load_counts(self.path / LEXICAL)

    def has_stash(self) -> bool:
        return (self.path / STASH / STATE_NAME).is_file()

    def stash(self, purpose: str = "re-fit, tune or re-score") -> VectorStash:
        if not self.has_stash():
            raise IndexDirError(
                f"{self.path} kept no raw-vector stash, so it cannot {purpose} without re-encoding; "
                "rebuild it keeping its vectors (the default)"
            )
        return VectorStash.open(self.path / STASH)

    def verify(self, manifest: Manifest, level: Verify = "full", names: list[str] | None = None) -> None:
        """Check the listed files (all by default): size always, then sha256 ("full") or a sampled hash
        ("quick"); "full" also checks every stash part against the checksums in ``stash.json``."""
        check_verify(level)
        if level == "none":
            return
        for name in names if names is not None else list(manifest.files):
            expected = manifest.files.get(name)
            path = self.path / name
            if expected is None or not files.inside(self.path, name):
                self._refuse_link_out(name)
                raise IndexDirError(f"{self.path}/{MANIFEST} does not list {name} as an index file; rebuild the index")
            if not path.is_file():
                raise IndexDirError(f"index file {path} is missing; rebuild the index")
            digest = files.sha256 if level == "full" else files.quick_sha256
            key = "sha256" if level == "full" else "quick_sha256"
            if path.stat().st_size != expected["bytes"] or digest(path) != expected[key]:
                raise IndexDirError(f"index file {path} is corrupt or truncated (checksum mismatch); rebuild the index")
        if level == "full" and names is None and self.has_stash():
            self.stash().verify(full=True)

    def _refuse_link_out(self, name: str) -> None:
        """Refuse an index file (or the folder holding it) that is a symbolic link out of the index, saying so:
        the manifest lists it, and the message that it did not sent users looking in the wrong place."""
        parts = Path(name).parts
        for depth in range(1, len(parts) + 1):
            path = self.path.joinpath(*parts[:depth])
            if path.is_symlink():
                raise IndexDirError(
                    f"index file {path} is a symbolic link out of the index (to {os.path.realpath(path)}), and an "
                    "index reads only its own files: put the file itself there, or rebuild the index"
                )

    def identity(self) -> Identity | None:
        """Which version of the directory the path names now, or None if absent: the directory's inode and change
        time (writers publish a new directory by renaming it into place), and the inode, size and modification time
        of each of its own files (a file edited or replaced in place changes those, not the directory's; not their
        change time, which a publish's hard links of unchanged files move when the old version is deleted)."""
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return None
        parts = [stat.st_ino, stat.st_ctime_ns]
        for name in FILE_NAMES:
            try:
                own = os.stat(self.path / name)
            except (FileNotFoundError, NotADirectoryError):
                parts += [0, 0, 0]
                continue
            parts += [own.st_ino, own.st_size, own.st_mtime_ns]
        return tuple(parts)


@dataclass
class Loaded:
    """One whole version of an index directory, read: what a Searcher serves. The FAISS index is read-only, its
    flat storage memory-mapped like the docs (a publish replaces files, never rewrites them, so maps stay valid)."""

    directory: IndexDir
    manifest: Manifest
    transform: Whitening | RawTransform
    index: Any
    docs: Docs
    rescorer: Whitening | RawTransform | None = None  # scores re-ranked candidates at full dimension
    stash: VectorStash | None = None  # raw vectors, mapped at load when this version re-scores by default
    identity: Identity | None = None  # the directory's identity when this version was read
    verify: Verify = "full"  # how it was checked when read (a stash mapped later is checked alike)
    lexical: LexicalIndex | None = None  # the BM25 index, when built with one
    columns: Any = None  # the kept metadata columns (pyarrow.Table), when built with some

    def open_stash(self) -> VectorStash:
        """The stash of this very version: the one mapped at load, else opened now, and only if the directory is
        still this version (a publish since would hand over the next version's vectors: refused)."""
        if self.stash is not None:
            return self.stash
        replaced = IndexDirError(f"{self.directory.path} was replaced since it was loaded; load it again to re-score")
        if self.directory.identity() != self.identity:
            raise replaced
        stash = _map_stash(self.directory, self.manifest, self.verify)
        if self.directory.identity() != self.identity:  # replaced while it was being mapped
            raise replaced
        self.stash = stash
        return stash

    def moments(self) -> RunningMoments | None:
        """The moments of this very version (what ``info`` measures drift against), or None if the directory
        has been replaced since it was loaded (the next version's moments would describe other data)."""
        if self.identity is None or self.directory.identity() != self.identity:
            return None
        moments = self.directory.moments()
        return moments if self.directory.identity() == self.identity else None


def load(path: Path | str, verify: Verify = "full") -> Loaded:
    """Read one whole version of the index at ``path``: never the manifest of one and the index of another.

    A load that fails while a publish is replacing the directory (seen as a change of the directory's identity,
    or a directory missing while a writer holds it) is retried for up to LOAD_RETRY_SECONDS; a failure on an
    unchanged directory is a real one and raised at once."""
    check_verify(verify)
    directory = IndexDir(path)
    real = files.resolved(directory.path)  # a writer's lock and renamed-aside copy sit beside the real directory
    deadline = time.monotonic() + LOAD_RETRY_SECONDS
    while True:
        before = directory.identity()
        try:
            loaded = _load_once(directory, verify)
            if directory.identity() == before:
                loaded.identity = before
                return loaded
            log.info("%s was replaced while it was read: reading the new version", directory.path)
        except (IndexDirError, OSError) as err:
            if not _raced(directory, real, before) or time.monotonic() > deadline:
                if isinstance(err, IndexDirError):
                    raise
                raise IndexDirError(f"cannot read the index at {directory.path}: {err}; rebuild it") from err
            log.info("%s changed under a load: reading it again", directory.path)
        time.sleep(0.01)


def _raced(directory: IndexDir, real: Path, before: Identity | None) -> bool:
    """A publish in the way: the directory is missing while a writer holds it, or it is another one than at the
    start of the read (replaced, or there again after the moment between a publish's two renames)."""
    now = directory.identity()
    publishing = now is None and os.path.lexists(files.lock_path(real))
    return publishing or (now is not None and now != before)


def _load_once(directory: IndexDir, verify: Verify) -> Loaded:
    manifest = directory.manifest()
    quick = [TRANSFORM, INDEX, DOCS] + ([RESCORE] if manifest.has_rescorer else [])
    quick += [f"{STASH}/{STATE_NAME}"] if manifest.stash is not None else []
    quick += lexical_names() if manifest.lexical is not None else []
    quick += [COLUMNS] if manifest.columns else []
    directory.verify(manifest, verify, quick if verify != "full" else None)
    transform = directory.transform()
    index = directory.faiss_index(
        mmap=True, manifest=manifest
    )  # a reader's: never added to, mapped (a 1.5 GB flat index loads at once)
    docs = directory.docs()
    t = manifest.transform
    agree = (
        index.ntotal == manifest.n == len(docs)
        and index.d == transform.dim_out == t.dim
        and transform.dim_in == t.d
        and manifest.encoder.dim in (0, t.d)
        and (
            not isinstance(transform, Whitening)
            or (transform.gamma, transform.epsilon) == (t.spec.gamma, t.spec.epsilon)
        )
    )
    if not agree:
        raise IndexDirError(f"{directory.path}: the FAISS index does not match its manifest; rebuild the index")
    rescorer = directory.rescorer(manifest)
    if rescorer.dim_in != transform.dim_in or rescorer.dim_out != transform.dim_in:
        raise IndexDirError(f"{directory.path}: the re-scoring transform is not full-rank; rebuild the index")
    # Mapped now, inside the identity check, when searches re-score by default; otherwise on first use, by
    # ``Loaded.open_stash`` (a one-shot search of a raw index never pays for mapping every part).
    rescores = manifest.stash is not None and manifest.rescoring.depth > 0
    stash = _map_stash(directory, manifest, verify) if rescores else None
    lexical = directory.lexical(manifest)
    if lexical is not None and lexical.n != manifest.n:
        raise IndexDirError(f"{directory.path}: the lexical index does not match its manifest; rebuild the index")
    columns = directory.columns(manifest)
    if columns is not None and (columns.num_rows != manifest.n or columns.column_names != list(manifest.columns)):
        raise IndexDirError(f"{directory.path}: the metadata columns do not match the manifest; rebuild the index")
    return Loaded(
        directory, manifest, transform, index, docs, rescorer, stash, verify=verify, lexical=lexical, columns=columns
    )


def _map_stash(directory: IndexDir, manifest: Manifest, verify: Verify = "full") -> VectorStash:
    """The stash with the fitted pooling's parts memory-mapped (kept: re-scoring reads rows at random). A "quick"
    reader checks those parts' sizes and sampled hashes first ("full" checked every byte at load)."""
    stash = directory.stash("re-score")
    if len(stash) != manifest.n or stash.dim != manifest.transform.d:
        raise IndexDirError(f"{directory.path}: the vector stash does not match its manifest; rebuild the index")
    if verify == "quick":
        stash.verify(full=False, sampled=manifest.transform.pooling)
    for _ in stash.iter_parts(manifest.transform.pooling):
        pass
    return stash


# ----- writing ---------------------------------------------------------------------------------------------
def save_transform(work: Path, transform: Whitening | RawTransform) -> None:
    transform.save(work / TRANSFORM)


def save_moments(work: Path, moments: RunningMoments) -> None:
    moments.save(work / MOMENTS)


def save_rescorer(work: Path, transform: Whitening) -> None:
    transform.save(work / RESCORE)


def save_faiss_index(work: Path, index: Any) -> None:
    from retrieval.index import save_index

    save_index(index, work / INDEX)


def save_docs(work: Path, stash: VectorStash) -> None:
    from retrieval.docs import write_docs

    write_docs(stash.iter_docs(), work / DOCS, stash.has_titles())


def lexical_names() -> list[str]:
    """The lexical part's files, as the manifest lists them."""
    return [f"{LEXICAL}/{name}" for name in LEXICAL_FILES]


def save_lexical(work: Path, counts: TermCounts, spec: LexicalSpec) -> LexicalRecord:
    """Derive the BM25 index from ``counts`` and write it with them; the manifest's record of it."""
    from retrieval.lexical import save, size_of

    save(work / LEXICAL, counts, spec)
    return LexicalRecord(
        spec, len(counts.terms), len(counts.term_ids), size_of(work / LEXICAL), importlib.metadata.version("bm25s")
    )


def link_lexical(work: Path, old: IndexDir) -> None:
    """Share the previous version's lexical part (its rows are unchanged: ``refit``, ``calibrate``)."""
    for name in lexical_names():
        link_from(work, old, name)


def column_types(schema: Any) -> dict[str, str]:
    """The manifest's record of kept metadata columns: name -> Arrow type, in file order."""
    return {f.name: str(f.type) for f in schema}


def link_from(work: Path, old: IndexDir, name: str) -> None:
    """Share an unchanged file of the previous version (hard link: never written again, so never at risk)."""
    files.link_or_copy(old.path / name, work / name)


def write_manifest(work: Path, manifest: Manifest) -> Manifest:
    """The one writer of ``manifest.json``: checks that every file of a complete index is in ``work``, records
    their sizes and checksums, stamps versions and times, and writes the manifest last (atomically)."""
    rescore = manifest.rescoring
    assert manifest.stash is not None or rescore.depth == 0, "re-scoring needs the stash"
    names = [TRANSFORM, MOMENTS, INDEX, DOCS] + ([f"{STASH}/{STATE_NAME}"] if manifest.stash else [])
    names += [RESCORE] if rescore.scorer.whiten else []
    names += lexical_names() if manifest.lexical is not None else []
    names += [COLUMNS] if manifest.columns else []
    missing = [name for name in names if not (work / name).is_file()]
    if missing:
        raise AssertionError(f"incomplete index in {work}: {missing} missing")
    records = {name: _record(work / name) for name in names}
    stamp = now()
    manifest = replace(
        manifest,
        rescore=rescore,
        files=records,
        versions=library_versions(),
        created=manifest.created or stamp,
        updated=stamp,
        schema_version=SCHEMA_VERSION,
    )
    data = manifest.to_dict()
    data["checksum"] = checksum(data)
    files.write_atomic(work / MANIFEST, (json.dumps(data, indent=2) + "\n").encode())
    return manifest


def checksum(data: dict[str, Any]) -> str:
    """sha256 of the manifest's content (its own "checksum" field left out), in a canonical JSON form."""
    content = {key: value for key, value in data.items() if key != "checksum"}
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _record(path: Path) -> dict[str, Any]:
    full = files.sha256(path)
    size = path.stat().st_size
    return {
        "bytes": size,
        "sha256": full,
        "quick_sha256": full if size < files.QUICK_FULL_BELOW else files.quick_sha256(path),
    }


def is_index_dir(path: Path) -> bool:
    """True only for a real directory whose manifest says this tool built it (what a publish may replace)."""
    manifest = Path(path) / MANIFEST
    if Path(path).is_symlink() or not Path(path).is_dir() or not manifest.is_file():
        return False
    try:
        data = json.loads(manifest.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return (
        isinstance(data, dict)
        and isinstance(data.get("schema_version"), int)
        and all(isinstance(data.get(key), dict) for key in ("encoder", "transform", "index", "corpus"))
        and "retrieval" in (data.get("versions") or {})
    )
