"""An index directory: the only module that knows its file names; the typed manifest; one reader, one writer.

    manifest.json   the Manifest: schema version, typed sections, timings, versions, checksums of the files below
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

import datetime as dt
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from retrieval import files
from retrieval.docs import Docs, read_columns
from retrieval.encode.spec import EncoderInfo
from retrieval.errors import ConfigError, IndexDirError
from retrieval.fusion import FusionSpec
from retrieval.index import IndexSpec, lossy_codes
from retrieval.lexical import FILES as LEXICAL_FILES
from retrieval.lexical import LexicalIndex, LexicalSpec, TermCounts
from retrieval.moments import RunningMoments
from retrieval.stash import STATE_NAME, VectorStash
from retrieval.whitening import RawTransform, TransformSpec, Whitening, load_transform

log = logging.getLogger(__name__)

# 3: the index spec records `codes` and `rotation`, the index record its metric; a lexical part and fusion
# settings (an older retrieval's `add` would leave the lexical part behind). A version-2 manifest reads as a
# dense-only index of the kind's default codes.
# 4: the transform record names the output dimension `dim` (2 and 3 called it `k`, the number of hits everywhere
# else); an older manifest's `k` reads as `dim`, and its next version is written in schema 4.
SCHEMA_VERSION = 4
READ_SCHEMAS = (2, 3, SCHEMA_VERSION)
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
# Candidates re-scored at full dimension by default when an index is reduced (k < d) and kept its stash: the
# smallest depth that kept every IR dev task of both models at >= 99.9% of raw nDCG@10 at d/3 (worst 99.93%; 30
# gave 99.77%) for +0.8 ms p50 at 1M rows (docs/defaults.md; scripts/choose_defaults.py).
RESCORE_DEPTH = 50
# Deeper for coarser codes: the smallest depth whose re-scored top 10 finds as much of exact raw search's top 10
# as 32-bit floats of the same dimensions do (within 0.005 of recall@10, the IR dev basket, MiniLM; scalar codes
# at d/3 to d, binary at d). Binary at 384 dims, re-scored from the int8 stash: 100.2% of raw nDCG@10 on SciFact
# test, 100.1% on the dev basket (docs/benchmarks/codes.md; scripts/bench_codes.py).
RESCORE_DEPTHS = {"sq8": 20, "sq4": 50, "binary": 400}
LOAD_RETRY_SECONDS = 10.0  # how long a reader keeps retrying a load that raced a publish

Verify = Literal["full", "quick", "none"]
VERIFY_LEVELS = ("full", "quick", "none")


def check_verify(level: str) -> None:
    """Refuse a verification level that is not one of ``VERIFY_LEVELS`` (a typo must not skip the checks)."""
    if level not in VERIFY_LEVELS:
        raise ConfigError(f"`verify` must be one of {', '.join(VERIFY_LEVELS)} (got {level!r})", "verify")


# ----- the manifest's sections -------------------------------------------------------------------------------
@dataclass(frozen=True)
class TransformRecord:
    """The fitted transform: its spec (pooling filled in), input dimension ``d`` -> output ``dim``, and what the
    fit saw."""

    spec: TransformSpec
    d: int
    dim: int
    n_fit: int | None = None
    explained_variance: float | None = None

    @property
    def kind(self) -> str:
        return "whitening" if self.spec.whiten else "raw"

    @property
    def pooling(self) -> str:
        assert self.spec.pooling is not None
        return self.spec.pooling

    @classmethod
    def of(cls, transform: Whitening | RawTransform, spec: TransformSpec) -> TransformRecord:
        spec = spec.resolve(transform.dim_in)  # what was fitted, every default filled in
        if isinstance(transform, Whitening):
            return cls(spec, transform.dim_in, transform.dim_out, transform.n, float(transform.explained_variance))
        return cls(spec, transform.dim_in, transform.dim_out)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **asdict(self), "spec": self.spec.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransformRecord:
        return cls(
            TransformSpec.from_dict(data["spec"]),
            data["d"],
            data["dim"] if "dim" in data else data["k"],  # schemas 2 and 3 called it k
            data.get("n_fit"),
            data.get("explained_variance"),
        )


@dataclass(frozen=True)
class Calibration:
    """What ``calibrate`` measured: ``knob`` (ef_search or nprobe) at ``value`` gave ``recall`` (recall@10 of
    ``queries`` queries from ``source`` against their exact neighbours); ``reached``: recall >= ``target``.
    ``curve``: every (value, recall) measured on the way. ``rescore``: the searches re-scored their top this many
    candidates, as served (0: recall in the index's own space). ``rows``: the index's size when measured (0 in
    records written before it was kept); ``add`` keeps the calibration, and ``info`` says how much it has grown."""

    knob: str
    value: int
    recall: float
    target: float
    queries: int
    source: str
    reached: bool
    curve: list[tuple[int, float]]
    rescore: int = 0
    rows: int = 0
    mode: str = "dense"  # the search mode measured: dense, or hybrid (the fused top 10)

    @property
    def measured_as(self) -> str:
        if self.mode == "hybrid":
            rescored = f", re-scoring the top {self.rescore}" if self.rescore else ""
            return f"as served in hybrid mode (dense candidates fused with BM25's{rescored})"
        return f"as served (re-scoring the top {self.rescore})" if self.rescore else "in the index's own space"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"curve": [list(point) for point in self.curve]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        curve = [(int(value), float(recall)) for value, recall in data["curve"]]
        return cls(
            data["knob"], int(data["value"]), float(data["recall"]), float(data["target"]), int(data["queries"]),
            str(data["source"]), bool(data["reached"]), curve, int(data.get("rescore", 0)),
            int(data.get("rows", 0)), str(data.get("mode", "dense")),
        )  # fmt: skip


@dataclass(frozen=True)
class IndexRecord:
    """The FAISS index: the spec it was built from, the factory string, its size, default knobs, a description."""

    spec: IndexSpec
    factory: str
    ntotal: int
    search: dict[str, int] = field(default_factory=dict)  # default ef_search / nprobe
    faiss: dict[str, Any] = field(default_factory=dict)  # index.describe()
    metric: str = "inner_product"
    calibration: Calibration | None = None  # the default knob as `retrieval calibrate` measured it, if it did

    @property
    def kind(self) -> str:
        return self.spec.kind

    def to_dict(self) -> dict[str, Any]:
        calibration = self.calibration.to_dict() if self.calibration else None
        return asdict(self) | {"spec": self.spec.to_dict(), "calibration": calibration}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> IndexRecord:
        calibration = data.get("calibration")
        return cls(
            IndexSpec.from_dict(data["spec"]),
            data["factory"],
            int(data["ntotal"]),
            dict(data.get("search", {})),
            dict(data.get("faiss", {})),
            data.get("metric", "inner_product"),
            Calibration.from_dict(calibration) if calibration else None,
        )


@dataclass(frozen=True)
class StashRecord:
    dtype: str
    poolings: list[str]
    rows: int
    bytes: int = 0  # all part files together

    @classmethod
    def of(cls, stash: VectorStash) -> StashRecord:
        size = sum(record["bytes"] for part in stash.parts for record in part.checksums.values())
        return cls(stash.dtype, stash.poolings, len(stash), size)


@dataclass(frozen=True)
class RescoreRecord:
    """Re-scoring by default (``SearchParams.rescore=None``): the top ``depth`` candidates of the reduced index are
    re-ranked at full dimension by ``scorer``, the raw cosine of the stashed vectors (``whiten=False``) or a
    full-rank transform saved as ``rescore.npz`` (when ``tune`` found it better than raw). ``depth`` 0: off."""

    depth: int
    scorer: TransformSpec

    @classmethod
    def default(
        cls, transform: TransformRecord, stash: StashRecord | None, factory: str = "", code: str | None = None
    ) -> RescoreRecord:
        """By raw cosine when the index kept its stash and loses information: ``RESCORE_DEPTH`` when reduced by
        its transform (dim < d) or by its FAISS ``factory`` (``lossy_codes``), deeper for coarse codes
        (``code``, ``RESCORE_DEPTHS``); else off."""
        lossy = RESCORE_DEPTHS.get(code or "", RESCORE_DEPTH if lossy_codes(factory) else 0)  # measured per code
        depth = max(RESCORE_DEPTH if transform.dim < transform.d else 0, lossy)
        depth = depth if stash is not None else 0
        return cls(depth, TransformSpec.raw(transform.pooling).resolve(transform.d))

    def to_dict(self) -> dict[str, Any]:
        return {"depth": self.depth, "scorer": self.scorer.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RescoreRecord:
        return cls(int(data["depth"]), TransformSpec.from_dict(data["scorer"]))


@dataclass(frozen=True)
class LexicalRecord:
    """The BM25 part: how texts became terms and scores (``LexicalSpec``), its size, and the bm25s that built it."""

    spec: LexicalSpec
    terms: int
    postings: int
    bytes: int = 0
    library: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"spec": self.spec.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LexicalRecord:
        return cls(
            LexicalSpec.from_dict(data["spec"]),
            int(data["terms"]),
            int(data["postings"]),
            int(data.get("bytes", 0)),
            str(data.get("library", "")),
        )


@dataclass(frozen=True)
class CorpusRecord:
    """Where the rows came from: the first corpus, one entry per ``add`` and one per ``remove``."""

    path: str
    rows: int
    indexed: int
    skipped: int
    sha256: str
    settings: dict[str, Any] = field(default_factory=dict)  # text_column, id_column, ...
    added: list[dict[str, Any]] = field(default_factory=list)
    removed: list[dict[str, Any]] = field(default_factory=list)
    # How many adds and removes the index's lists and codes were trained after (a refit trains them again)
    trained_after: int = 0

    @property
    def changed_since_training(self) -> bool:
        """Whether rows were added or removed since the FAISS index was last trained (built or refitted)."""
        return len(self.added) + len(self.removed) > self.trained_after


def _corpus_record(data: dict[str, Any]) -> CorpusRecord:
    """The manifest's corpus record. One written before it kept ``trained_after`` is inferred from the kernel: a
    build and a refit fit the kernel and train the lists on the same rows, all of them, and an add or remove
    changes the row count but not the fit's. A fit on as many rows as the index holds, a count other than the
    build's, was a refit after the changes (advising another would be wrong). Anything else is taken as lists
    older than the changes: an add and a remove of as many rows leave the build's count, refitted or not."""
    corpus = dict(data["corpus"])
    if "trained_after" not in corpus:
        fitted, now = data["transform"].get("n_fit"), data["index"].get("ntotal")
        fitted_now = fitted == now != corpus.get("indexed")
        corpus["trained_after"] = len(corpus.get("added", [])) + len(corpus.get("removed", [])) if fitted_now else 0
    return CorpusRecord(**corpus)


@dataclass(frozen=True)
class Manifest:
    """Self-description of an index directory (``manifest.json``)."""

    encoder: EncoderInfo
    transform: TransformRecord
    index: IndexRecord
    corpus: CorpusRecord
    stash: StashRecord | None = None
    rescore: RescoreRecord | None = None  # None until written: ``write_manifest`` records the default
    timings: dict[str, float] = field(default_factory=dict)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> bytes, sha256, quick_sha256
    versions: dict[str, str] = field(default_factory=dict)
    created: str = ""  # when the index was first built
    updated: str = ""  # when this version was published
    generation: int = 1  # 1 for a first build, +1 for each add, refit or rebuild (--overwrite) at the same path
    lexical: LexicalRecord | None = None  # the BM25 part, when the index has one
    fusion: FusionSpec | None = None  # how hybrid searches combine the two rankings (None: ``FusionSpec()``)
    columns: dict[str, str] = field(default_factory=dict)  # metadata columns kept for filters: name -> type
    schema_version: int = SCHEMA_VERSION

    @property
    def n(self) -> int:
        return self.index.ntotal

    @property
    def rescoring(self) -> RescoreRecord:
        """How this index re-scores by default (the recorded choice, else the default rule)."""
        return self.rescore or RescoreRecord.default(
            self.transform, self.stash, self.index.factory, self.index.spec.code
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "generation": self.generation,
            "created": self.created,
            "updated": self.updated,
            "encoder": self.encoder.to_dict(),
            "transform": self.transform.to_dict(),
            "index": self.index.to_dict(),
            "corpus": asdict(self.corpus),
            "stash": asdict(self.stash) if self.stash else None,
            "rescore": self.rescoring.to_dict(),
            "lexical": self.lexical.to_dict() if self.lexical else None,
            "fusion": self.fusing.to_dict() if self.lexical else None,
            "columns": self.columns,
            "timings": self.timings,
            "versions": self.versions,
            "files": self.files,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        stash = data.get("stash")
        rescore = data.get("rescore")  # absent from manifests written before re-scoring had a default
        return cls(
            encoder=EncoderInfo.from_dict(data["encoder"]),
            transform=TransformRecord.from_dict(data["transform"]),
            index=IndexRecord.from_dict(data["index"]),
            corpus=_corpus_record(data),
            stash=StashRecord(**stash) if stash else None,
            rescore=RescoreRecord.from_dict(rescore) if rescore else None,
            timings=dict(data.get("timings", {})),
            files=dict(data.get("files", {})),
            versions=dict(data.get("versions", {})),
            created=str(data.get("created", "")),
            updated=str(data.get("updated", "")),
            generation=int(data.get("generation", 1)),
            lexical=LexicalRecord.from_dict(data["lexical"]) if data.get("lexical") else None,
            fusion=FusionSpec.from_dict(data["fusion"]) if data.get("fusion") else None,
            columns=dict(data.get("columns") or {}),
            schema_version=int(data["schema_version"]),
        )

    @classmethod
    def load(cls, directory: Path | str) -> Manifest:
        """The manifest of the index at ``directory`` (``IndexDir(directory).manifest()``)."""
        return IndexDir(directory).manifest()

    def next_version(self, **changes: Any) -> Manifest:
        """This manifest for the next published version (``add``/``refit``): generation + 1, files re-recorded."""
        return replace(self, generation=self.generation + 1, files={}, **changes)

    @property
    def fusing(self) -> FusionSpec:
        """How hybrid searches fuse (the recorded choice, else the defaults)."""
        return self.fusion or FusionSpec()

    @property
    def has_rescorer(self) -> bool:
        """Whether re-scoring uses a full-rank transform file (``rescore.npz``) rather than raw cosine."""
        return bool(self.rescoring.scorer.whiten)


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def library_versions() -> dict[str, str]:
    """Versions of what made the index, from installed metadata (importing torch to ask costs seconds)."""
    import retrieval

    versions = {"retrieval": retrieval.__version__, "python": platform.python_version()}
    for name in ("numpy", "faiss-cpu", "pyarrow", "torch", "transformers", "bm25s", "PyStemmer"):
        try:
            versions[name.removesuffix("-cpu")] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


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

    def faiss_index(self, mmap: bool = False) -> Any:
        """The FAISS index; ``mmap``: read-only, its flat storage mapped from the file (``index.load_index``)."""
        from retrieval.index import load_index  # FAISS only where the index itself is read

        return load_index(self.path / INDEX, mmap)

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
    index = directory.faiss_index(mmap=True)  # a reader's: never added to, mapped (a 1.5 GB flat index loads at once)
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
