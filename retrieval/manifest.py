"""The manifest of an index directory: its schema version and typed sections, what made the index, and the
defaults an index records (re-scoring depths). ``indexdir`` reads and writes it; this module knows no file.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import platform
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from retrieval.encode.spec import EncoderInfo
from retrieval.fusion import FusionSpec
from retrieval.index import IndexSpec, lossy_codes
from retrieval.lexical import LexicalSpec
from retrieval.stash import VectorStash
from retrieval.whitening import RawTransform, TransformSpec, Whitening

# 3: the index spec records `codes` and `rotation`, the index record its metric; a lexical part and fusion
# settings (an older retrieval's `add` would leave the lexical part behind). A version-2 manifest reads as a
# dense-only index of the kind's default codes.
# 4: the transform record names the output dimension `dim` (2 and 3 called it `k`, the number of hits everywhere
# else); an older manifest's `k` reads as `dim`, and its next version is written in schema 4.
# 5: the index spec records `rerank`, the Hamming candidates a binary index re-ranks asymmetrically by default;
# an older binary index (thresholds at zero, searched by Hamming distance) reads as `rerank` 0 and is served as
# it was measured; a `refit --rerank N` turns it on.
SCHEMA_VERSION = 5
READ_SCHEMAS = (2, 3, 4, SCHEMA_VERSION)
# Candidates re-scored at full dimension by default when an index is reduced (k < d) and kept its stash: the
# smallest depth that kept every IR dev task of both models at >= 99.9% of raw nDCG@10 at d/3 (worst 99.93%; 30
# gave 99.77%) for +0.8 ms p50 at 1M rows (docs/defaults.md; scripts/choose_defaults.py).
RESCORE_DEPTH = 50
# Deeper for coarser codes: the smallest depth whose re-scored top 10 finds as much of exact raw search's top 10
# as 32-bit floats of the same dimensions do (within 0.005 of recall@10, the IR dev basket, MiniLM; scalar codes
# at d/3 to d, binary at d). Binary at 384 dims, re-scored from the int8 stash: 100.2% of raw nDCG@10 on SciFact
# test, 100.1% on the dev basket (docs/benchmarks/codes.md; scripts/bench_codes.py).
# Binary codes whose Hamming candidates are re-ranked asymmetrically first (``binary-asym``, the default rerank
# of 400): 100 met the same rule (recall@10 0.998 of raw search's top 10 on NPL, 0.979-0.993 elsewhere), and kept
# 99.98-101.2% of raw nDCG@10 on SciFact and every dev set; at 1M rows it re-scores a quarter of the rows.
# With the raw decoder (``binary-decoded``: whitened codes whose re-rank blends in the estimated raw cosine), 50
# met the same rule (recall@10 of raw search's top 10 0.982-0.996 on the dev basket at 384 bits, where the
# whitened cosine alone needed 200 in the same run) and kept 99.6-100.8% of raw nDCG@10 on SciFact and every dev
# set, from the int8 stash, at 384 and at 368 bits (docs/benchmarks/codes.md; scripts/bench_codes.py).
RESCORE_DEPTHS = {"sq8": 20, "sq4": 50, "binary": 400, "binary-asym": 100, "binary-decoded": 50}


def depth_key(index: IndexRecord) -> str | None:
    """The key of ``RESCORE_DEPTHS`` an index's default re-scoring depth is measured under: its code, or for binary
    codes re-ranked, whether the re-rank has the raw decoder (the scalars its FAISS record counts)."""
    spec = index.spec
    if spec.binary and spec.rerank_used:
        return "binary-decoded" if index.faiss.get("scalar_bytes") else "binary-asym"
    return spec.code


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
    def from_dict(cls, data: dict[str, Any], schema: int = SCHEMA_VERSION) -> IndexRecord:
        calibration = data.get("calibration")
        spec = IndexSpec.from_dict(data["spec"])
        if schema < 5 and spec.binary and spec.rerank is None:  # built before the asymmetric re-rank existed
            spec = replace(spec, rerank=0)
        return cls(
            spec,
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
            self.transform, self.stash, self.index.factory, depth_key(self.index)
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
            index=IndexRecord.from_dict(data["index"], int(data["schema_version"])),
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
        """The manifest of the index at ``directory``: ``IndexDir(directory).manifest()``, which owns the files
        (the directory's checks, the schema versions it reads, the checksum)."""
        from retrieval.indexdir import IndexDir  # the reader of the directory sits above the record it reads

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
