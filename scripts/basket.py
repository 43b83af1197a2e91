"""The evaluation sets of the quality scripts, encoded once per model and cached under indexes/bench (never committed).

IR sets are a corpus stash (an index built with all three poolings stashed in one pass) plus encoded queries;
STS sets are pair files plus every sentence encoded once. ``IrTask.evaluate`` scores a transform (and
optionally re-scoring of its top candidates at full dimension) exactly, in memory: these corpora are small.

    dev (choose_defaults.py): SciFact train queries; STS-B dev (fit on STS-B train + dev sentences);
        STS12-16 (each fitted on its own sentences); the stdlib docstrings (one document per docstring) with
        pseudo-queries.
    test (bench_quality.py): SciFact test queries; STS-B test (fit on all STS-B sentences); STS12-16.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.build import BuildOptions, build_index
from retrieval.corpus import CorpusSpec
from retrieval.encode.spec import POOLINGS
from retrieval.encode.transformer import TransformerEncoder
from retrieval.evaluate import Pairs, Queries, moments_of, read_pairs, read_qrels, read_queries, sts_result, to_run
from retrieval.indexdir import IndexDir
from retrieval.metrics import Qrels, evaluate_run
from retrieval.moments import RunningMoments
from retrieval.pseudo import PseudoQueries, make_pseudo_queries
from retrieval.whitening import RawTransform, TransformSpec, Whitening

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
WORK = ROOT / "indexes" / "bench"
MODELS = ("all-MiniLM-L6-v2", "all-mpnet-base-v2")
STS_YEARS = ("sts12", "sts13", "sts14", "sts15", "sts16")
PSEUDO_QUERIES = 1000  # per pseudo-query task of the dev basket (stdlib docstrings): more queries, less noise
_encoders: dict[str, TransformerEncoder] = {}


def encoder(model: str) -> TransformerEncoder:
    if model not in _encoders:
        _encoders[model] = TransformerEncoder(model, "mean")
    return _encoders[model]


def encode_cached(model: str, name: str, texts: Sequence[str]) -> dict[str, np.ndarray]:
    """Raw vectors of ``texts`` for every pooling, encoded once (one pass) and cached by model and name."""
    path = WORK / f"{name}-{model.lower()}.npz"
    if path.is_file():
        with np.load(path, allow_pickle=False) as data:
            cached = data["texts"] if "texts" in data else data["sentences"]  # bench_quality's older STS cache
            if list(cached) == list(texts):
                return {p: data[p] for p in POOLINGS}
    print(f"encoding {len(texts):,} texts ({name}) with {model}...", file=sys.stderr)
    vectors = encoder(model).encode_poolings(list(texts), POOLINGS)
    WORK.mkdir(parents=True, exist_ok=True)
    np.savez(path, texts=np.array(list(texts)), **vectors)
    return vectors


# ----- IR ---------------------------------------------------------------------------------------------------
def corpus_index(corpus: str, model: str) -> Path:
    """The index directory of ``corpus`` ("scifact" or "stdlib") for ``model``, built (three poolings) if absent."""
    directory = WORK / f"{corpus}-{model.lower()}"
    if (directory / "manifest.json").is_file():
        return directory
    if corpus == "scifact":
        spec = CorpusSpec(DATA / "scifact" / "corpus.parquet", id_column="doc_id", title_column="title")
    else:
        spec = CorpusSpec(stdlib_docstrings(), title_column="title")
    print(f"encoding the {corpus} corpus with {model} (3 poolings, one pass)...", file=sys.stderr)
    options = BuildOptions(extra_poolings=("cls", "first-last-avg"), overwrite=True)
    build_index(spec, encoder(model), directory, TransformSpec.raw(), options=options)
    return directory


def stdlib_docstrings() -> Path:
    """This Python's standard-library docstrings, one document per docstring (its paragraphs joined; the demo
    corpus has one per paragraph, whose shared title would make a docstring's other paragraphs rival positives)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from retrieval.cli.demo_corpus import docstring_paragraphs

    path = WORK / "stdlib-docstrings.parquet"
    if not path.is_file():
        docs: dict[str, list[str]] = {}
        for _, title, paragraph in docstring_paragraphs():
            docs.setdefault(title, []).append(paragraph)
        WORK.mkdir(parents=True, exist_ok=True)
        titles = list(docs)
        pq.write_table(pa.table({"id": titles, "title": titles, "text": [" ".join(docs[t]) for t in titles]}), path)
    return path


@dataclass
class IrTask:
    """Queries with qrels over a corpus of raw vectors (every pooling); the transform is fitted on ``moments`` (the
    corpus as indexed), and pseudo-queries' positives are already swapped into ``docs``."""

    name: str
    model: str
    doc_ids: list[str]
    docs: dict[str, np.ndarray]
    moments: dict[str, RunningMoments]
    queries: Queries
    qrels: Qrels
    query_vectors: dict[str, np.ndarray]

    @property
    def dim(self) -> int:
        return self.docs["mean"].shape[1]

    def fit(self, spec: TransformSpec) -> Whitening | RawTransform:
        return spec.fit(self.moments[spec.pooling or "mean"])

    def ranking(self, spec: TransformSpec, depth: int = 100) -> np.ndarray:
        """Each query's top ``depth`` rows under ``spec`` (exact search), best first."""
        pooling = spec.pooling or "mean"
        transform = self.fit(spec)
        scores = transform.transform(self.query_vectors[pooling]) @ transform.transform(self.docs[pooling]).T
        depth = min(depth, scores.shape[1])
        top = np.argpartition(-scores, depth - 1, axis=1)[:, :depth]
        order = np.take_along_axis(scores, top, axis=1).argsort(axis=1, kind="stable")[:, ::-1]
        return np.take_along_axis(top, order, axis=1)

    def result(self, rows: np.ndarray) -> Any:
        """The ``EvalResult`` of ranked rows (best first)."""
        ranked = np.arange(rows.shape[1], 0, -1, dtype=np.float32)[None, :].repeat(len(rows), axis=0)
        return evaluate_run(to_run(self.queries.ids, ranked, rows, self.doc_ids), self.qrels)

    def evaluate(
        self, spec: TransformSpec, depths: Sequence[int] = (0,), scorer: TransformSpec | None = None
    ) -> dict[int, dict[str, float]]:
        """Metrics of ``spec`` (exact search), and of re-scoring its top ``depth`` at full dimension by ``scorer``
        (raw cosine by default), for each depth (0: no re-scoring)."""
        pooling = spec.pooling or "mean"
        top = self.ranking(spec, max(100, *depths))
        out = {}
        full = None
        for depth in depths:
            rows = top[:, :100].copy()
            if depth:
                if full is None:
                    scorer_t = self.fit(scorer or TransformSpec.raw(pooling))
                    full = (scorer_t.transform(self.docs[pooling]), scorer_t.transform(self.query_vectors[pooling]))
                for i in range(len(rows)):
                    candidates = top[i, :depth]
                    reranked = candidates[np.argsort(-(full[0][candidates] @ full[1][i]), kind="stable")]
                    rows[i, : min(depth, 100)] = reranked[:100]
            out[depth] = self.result(rows).metrics
        return out

    def per_query(self, spec: TransformSpec, metric: str = "nDCG@10") -> np.ndarray:
        result = self.result(self.ranking(spec))
        return np.array([result.per_query[q][metric] for q in self.queries.ids])

    def subset(self, rows: np.ndarray) -> IrTask:
        """The same task with only the queries at ``rows``."""
        ids = [self.queries.ids[i] for i in rows]
        return IrTask(
            self.name,
            self.model,
            self.doc_ids,
            self.docs,
            self.moments,
            Queries(ids, [self.queries.texts[i] for i in rows]),
            {q: self.qrels[q] for q in ids if q in self.qrels},
            {p: v[rows] for p, v in self.query_vectors.items()},
        )


def stash_corpus(directory: Path) -> tuple[list[str], dict[str, np.ndarray], dict[str, RunningMoments]]:
    stash = IndexDir(directory).stash()
    docs = {p: np.concatenate(list(stash.iter_blocks(pooling=p))) for p in stash.poolings}
    return stash.ids(), docs, {p: stash.moments(p) for p in stash.poolings}


def scifact_task(model: str, split: str) -> IrTask:
    """SciFact queries of ``split`` ("train" is the dev split, "test" the test split) over its 5,183 abstracts."""
    ids, docs, moments = stash_corpus(corpus_index("scifact", model))
    queries = read_queries(DATA / "scifact" / f"queries-{split}.parquet")
    qrels = read_qrels(DATA / "scifact" / f"qrels-{split}.parquet")
    vectors = encode_cached(model, f"scifact-queries-{split}", queries.texts)
    return IrTask(f"SciFact {split}", model, ids, docs, moments, queries, qrels, vectors)


def pseudo_ir(
    name: str,
    model: str,
    doc_ids: list[str],
    docs: dict[str, np.ndarray],
    moments: dict[str, RunningMoments],
    texts: Any,
    n: int,
    seed: int,
    cache: str,
) -> IrTask:
    """Pseudo-queries over a corpus (what ``tune --auto`` makes): the sampled documents, without their query, are
    encoded again and swapped in; the fit stays on the corpus as it is."""
    pseudo: PseudoQueries = make_pseudo_queries(len(doc_ids), texts, doc_ids.__getitem__, n, seed)
    queries = encode_cached(model, f"{cache}-pseudo{n}-s{seed}-queries", pseudo.queries.texts)
    positives = encode_cached(model, f"{cache}-pseudo{n}-s{seed}-positives", pseudo.positives)
    rows = np.asarray(pseudo.rows)
    swapped = {}
    for p, x in docs.items():
        swapped[p] = x.copy()
        swapped[p][rows] = positives[p]
    return IrTask(name, model, doc_ids, swapped, moments, pseudo.queries, pseudo.qrels, queries)


def pseudo_task(corpus: str, model: str, n: int = PSEUDO_QUERIES, seed: int = 0) -> IrTask:
    """Pseudo-queries over an indexed corpus ("scifact", "stdlib")."""
    directory = corpus_index(corpus, model)
    ids, docs, moments = stash_corpus(directory)
    texts = IndexDir(directory).docs().texts
    return pseudo_ir(f"{corpus} pseudo-queries", model, ids, docs, moments, texts, n, seed, corpus)


# ----- STS --------------------------------------------------------------------------------------------------
@dataclass
class StsTask:
    """Pairs scored by cosine after a transform fitted, without labels, on ``fit_sentences``."""

    name: str
    model: str
    pairs: Pairs
    fit_sentences: list[str]
    vectors: dict[str, dict[str, np.ndarray]]  # pooling -> sentence -> raw vector

    @property
    def dim(self) -> int:
        return next(iter(self.vectors["mean"].values())).shape[0]

    @cached_property
    def moments(self) -> dict[str, RunningMoments]:
        return {p: moments_of(v, self.fit_sentences) for p, v in self.vectors.items()}

    def evaluate(self, spec: TransformSpec) -> dict[str, float]:
        pooling = spec.pooling or "mean"
        return sts_result(self.vectors[pooling], self.pairs, spec.fit(self.moments[pooling]))


def sts_vectors(model: str) -> dict[str, dict[str, np.ndarray]]:
    """Every sentence of every shared STS file, encoded once per model (all poolings)."""
    sets = [read_pairs(DATA / "sts" / f"stsb-{s}.parquet") for s in ("train", "dev", "test")]
    sets += [read_pairs(DATA / "sts" / f"{y}.parquet") for y in STS_YEARS]
    sentences = list(dict.fromkeys(s for p in sets for s in p.sentences()))
    raw = encode_cached(model, "sts", sentences)
    return {p: dict(zip(sentences, raw[p], strict=True)) for p in POOLINGS}


def sts_tasks(model: str, stsb_split: str) -> list[StsTask]:
    """STS-B ``stsb_split`` ("dev": fitted on train + dev sentences, never test; "test": on all three), then
    STS12-16, each fitted on its own sentences (they have no dev split: the protocol's "target" fit)."""
    vectors = sts_vectors(model)
    stsb = {s: read_pairs(DATA / "sts" / f"stsb-{s}.parquet") for s in ("train", "dev", "test")}
    fit_splits = ("train", "dev") if stsb_split == "dev" else ("train", "dev", "test")
    fit = list(dict.fromkeys(s for split in fit_splits for s in stsb[split].sentences()))
    tasks = [StsTask(f"STS-B {stsb_split}", model, stsb[stsb_split], fit, vectors)]
    for year in STS_YEARS:
        pairs = read_pairs(DATA / "sts" / f"{year}.parquet")
        tasks.append(StsTask(year.upper(), model, pairs, pairs.sentences(), vectors))
    return tasks


def sts_pseudo_task(task: StsTask, n: int = PSEUDO_QUERIES, seed: int = 0) -> IrTask:
    """Pseudo-queries over an STS task's sentences (its fit sentences are the corpus): no gold scores used."""
    sentences = task.fit_sentences
    docs = {p: np.stack([v[s] for s in sentences]) for p, v in task.vectors.items()}
    ids = [str(i) for i in range(len(sentences))]
    texts = lambda rows: [sentences[r] for r in rows]  # noqa: E731
    name = task.name.lower().replace(" ", "-")
    return pseudo_ir(f"{task.name} pseudo-queries", task.model, ids, docs, task.moments, texts, n, seed, name)


def spec_label(spec: TransformSpec, d: int) -> str:
    if not spec.whiten:
        return "raw"
    uncentred = " uncentred" if spec.center is False else ""
    return f"k={spec.dim}{' (d)' if spec.dim == d else ''} gamma={spec.gamma:g}{uncentred}"


def jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    return x
