"""Choosing the transform: sweep pooling x k x gamma (the raw baseline included) over stashed vectors, never
re-encoding the corpus; pick the best on a dev split, report it on test.

IR: each candidate re-transforms the index's stash block by block and searches it exactly (the blocked top-k
of ``scan.TopK``: memory is one block, whatever N), so the numbers are those a flat index with that transform
would give. STS: the sentences are encoded once per pooling and every candidate re-transforms those vectors.
A candidate is a ``TransformSpec``: ``TransformSpec.raw(pooling)`` is "keep raw", and it can win.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.encode.spec import EncoderSpec, MultiPoolingEncoder
from retrieval.encode.transformer import from_info
from retrieval.errors import ConfigError
from retrieval.evaluate import Pairs, Queries, check_judged_in, moments_of, sts_result, to_run
from retrieval.indexdir import IndexDir
from retrieval.metrics import Qrels, evaluate_run
from retrieval.progress import Progress, no_progress
from retrieval.pseudo import make_pseudo_queries
from retrieval.scan import TopK
from retrieval.stash import VectorStash
from retrieval.whitening import DEFAULT_GAMMA, TransformSpec

log = logging.getLogger(__name__)

DEFAULT_GAMMAS = (0.0, DEFAULT_GAMMA, 0.5, 0.75, 1.0)  # PCA, the default, stronger, full whitening
TIMING_QUERIES = 30  # single-query flat searches timed per candidate
AUTO_QUERIES = 1000  # pseudo-queries of `tune --auto` (its sampled documents are the only ones encoded again).
# SciFact, MiniLM, 40 random draws: the choice on 1000 was within 0.5% of the train-qrels choice on train in 100%
# of draws, on 300 in 82% (on test: 95% and 45%; README, "Label-free tuning"). The choice is ``pick_one_se``'s:
# checked on dev data only (SciFact train qrels, STS-B dev, STS12-16; bench_quality.py --one-se-dev)
MIN_AUTO_QUERIES = 20


IR_METRICS = tuple(evaluate_run({}, {}).metrics)  # what tuning on qrels can choose by
STS_METRICS = ("all", "wmean")  # or a subset of the dev pairs


def check_metric(metric: str, names: Sequence[str]) -> None:
    """Refuse a metric the sweep will not produce, before anything is encoded."""
    if metric not in names:
        raise ConfigError(f"unknown `metric` {metric!r}; choose one of {', '.join(names)}", "metric")


def default_dims(d: int) -> list[int]:
    return [k for k in (d, 512, 384, 256, 128, 64) if k <= d]


def candidates(poolings: Sequence[str], dims: Sequence[int], gammas: Sequence[float], d: int) -> list[TransformSpec]:
    """The raw baseline of each pooling, then the grid of whitenings."""
    for k in dims:
        TransformSpec(dim=k).check(d)
    for gamma in gammas:
        TransformSpec(gamma=gamma).check(d)
    grid = [TransformSpec(dim=d, whiten=False, pooling=p) for p in poolings]
    grid += [
        TransformSpec(dim=k, gamma=g, whiten=True, pooling=p)
        for p, k, g in itertools.product(poolings, sorted(set(dims), reverse=True), gammas)
    ]
    return grid


@dataclass
class Trial:
    candidate: TransformSpec
    dev: dict[str, float]
    test: dict[str, float] = field(default_factory=dict)
    search_ms: float | None = None
    # the tuning metric per dev query (every candidate's in the same query order), for ``pick_one_se``; not saved
    dev_per_query: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def dim(self) -> int:
        assert self.candidate.dim is not None
        return self.candidate.dim

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.candidate.to_dict(),
            "label": self.candidate.label,
            "dev": self.dev,
            "test": self.test,
            "search_ms": self.search_ms,
        }


@dataclass
class TuneResult:
    metric: str
    trials: list[Trial]
    best: Trial
    raw: Trial | None  # the raw baseline of the chosen pooling
    corpus_rows_encoded: int = 0
    dev_source: str = "dev split"  # what the choice was made on: a labelled dev split, or pseudo-queries
    scorer: Trial | None = None  # the best full-dimension candidate of the chosen pooling: re-scoring's scorer
    rule: str = "best"  # how ``best`` was picked from the dev scores: "best" (``pick``) or "one-SE" (``pick_one_se``)
    # The version of the index swept (its manifest's generation), None for pairs: applying the choice to a version
    # published since (``update.refit``'s ``generation``) is refused, as it would undo that version's change.
    generation: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "best": self.best.to_dict(),
            "raw": self.raw.to_dict() if self.raw else None,
            "corpus_rows_encoded": self.corpus_rows_encoded,
            "dev_source": self.dev_source,
            "scorer": self.scorer.to_dict() if self.scorer else None,
            "rule": self.rule,
            "generation": self.generation,
            "trials": [t.to_dict() for t in self.trials],
        }


def pick(trials: Sequence[Trial], metric: str) -> Trial:
    """Best dev score; ties go to the smaller dimension, then to raw, then to the smaller gamma (cheaper, gentler)."""
    return max(
        trials,
        key=lambda t: (round(t.dev[metric], 6), -t.dim, not t.candidate.whiten, -(t.candidate.gamma or 0.0)),
    )


def pick_one_se(trials: Sequence[Trial], metric: str) -> Trial:
    """The one-standard-error rule (Breiman et al. 1984), for a noisy dev split such as pseudo-queries: of the
    best's (``pick``) pooling, the gentlest candidate (raw, then more dimensions, then a smaller gamma) whose
    paired mean loss to the best, query by query (``dev_per_query``), is within one standard error of that loss.
    The best itself always qualifies; without per-query scores this is ``pick``."""
    best = pick(trials, metric)
    if best.dev_per_query is None or len(best.dev_per_query) < 2:
        return best
    n = len(best.dev_per_query)
    eligible = [best]
    for t in trials:
        if t.candidate.pooling != best.candidate.pooling or t.dev_per_query is None or t is best:
            continue
        if len(t.dev_per_query) != n:
            raise ValueError(f"{t.candidate.label}: {len(t.dev_per_query)} per-query scores, the best has {n}")
        loss = best.dev_per_query - t.dev_per_query
        if loss.mean() <= loss.std(ddof=1) / np.sqrt(n) + 1e-12:
            eligible.append(t)
    return min(eligible, key=lambda t: (t.candidate.whiten, -t.dim, t.candidate.gamma or 0.0))


def choose(trials: list[Trial], metric: str, rule: Callable[[Sequence[Trial], str], Trial] = pick) -> TuneResult:
    """The choice among scored trials: ``rule``'s (``pick``: the best; ``pick_one_se`` for a noisy dev split), the
    raw baseline of its pooling, and the best full-dimension candidate of that pooling (re-scoring's scorer)."""
    best = rule(trials, metric)
    pooling = best.candidate.pooling
    raw = next((t for t in trials if not t.candidate.whiten and t.candidate.pooling == pooling), None)
    full = [t for t in trials if raw is not None and t.candidate.pooling == pooling and t.dim == raw.dim]
    names: dict[Callable[[Sequence[Trial], str], Trial], str] = {pick: "best", pick_one_se: "one-SE"}
    name = names.get(rule, getattr(rule, "__name__", "custom"))
    return TuneResult(metric, trials, best, raw, scorer=pick(full, metric) if full else None, rule=name)


# ----- IR ---------------------------------------------------------------------------------------------------
def tune_index(
    directory: Path,
    dev: tuple[Queries, Qrels],
    test: tuple[Queries, Qrels] | None = None,
    poolings: Sequence[str] | None = None,
    dims: Sequence[int] | None = None,
    gammas: Sequence[float] = DEFAULT_GAMMAS,
    metric: str = "nDCG@10",
    progress: Progress = no_progress,
) -> TuneResult:
    """Sweep the stash of the index at ``directory``: the queries are encoded by the index's own encoder (every
    pooling in one pass), the corpus comes from the stash, which is verified first."""
    check_metric(metric, IR_METRICS)
    docs = IndexDir(directory).docs()
    for split in (dev, test) if test is not None else (dev,):
        check_judged_in(docs, split, directory)
    sweep = _Sweep(directory, poolings, dims, gammas)
    result = tune_ir(
        sweep.stash,
        sweep.doc_ids,
        sweep.query_vectors,
        dev,
        test,
        sweep.grid,
        metric,
        on_trial=lambda t: progress("tune", 1, len(sweep.grid)),
    )
    result.generation = sweep.generation
    return result


def tune_auto(
    directory: Path,
    n_queries: int = AUTO_QUERIES,
    seed: int = 0,
    test: tuple[Queries, Qrels] | None = None,
    poolings: Sequence[str] | None = None,
    dims: Sequence[int] | None = None,
    gammas: Sequence[float] = DEFAULT_GAMMAS,
    metric: str = "nDCG@10",
    progress: Progress = no_progress,
    encoder: MultiPoolingEncoder | None = None,
) -> TuneResult:
    """Tune without qrels: pseudo-queries made from the index's own documents (``pseudo``) are the dev split, and
    the choice is the one-standard-error rule's (``pick_one_se``): pseudo-queries are a noisy stand-in for real
    ones, so a gentler candidate that is not measurably worse on them is preferred to the nominal best.

    Only the sampled documents are encoded again (without their query sentence), once for every pooling;
    ``test``, if given, is reported as usual and never used to choose. ``encoder``: one already loaded (it must
    match the index's); None loads the one the manifest names."""
    check_metric(metric, IR_METRICS)
    sweep = _Sweep(directory, poolings, dims, gammas, encoder)
    docs = IndexDir(directory).docs()
    pseudo = make_pseudo_queries(len(sweep.stash), docs.texts, docs.id, n_queries, seed)
    if len(pseudo) < MIN_AUTO_QUERIES:
        raise ConfigError(
            f"only {len(pseudo)} documents of {len(sweep.stash)} are long enough to make a pseudo-query "
            f"(at least {MIN_AUTO_QUERIES} needed): tune with `queries` and `qrels` instead",
            "auto",
        )
    encoded = sweep.encoder.encode_poolings(
        pseudo.positives, sweep.poolings, on_batch=lambda n: progress("encode", n, len(pseudo))
    )
    rows = np.asarray(pseudo.rows, dtype=np.int64)
    result = tune_ir(
        sweep.stash,
        sweep.doc_ids,
        sweep.query_vectors,
        (pseudo.queries, pseudo.qrels),
        test,
        sweep.grid,
        metric,
        on_trial=lambda t: progress("tune", 1, len(sweep.grid)),
        dev_positives={p: (rows, encoded[p]) for p in sweep.poolings},
        rule=pick_one_se,
    )
    result.corpus_rows_encoded = len(pseudo)
    result.dev_source = f"{len(pseudo)} pseudo-queries (seed {seed})"
    result.generation = sweep.generation
    return result


class _Sweep:
    """What every IR sweep of an index directory needs: its verified stash, the candidate grid, and its encoder
    with each query split encoded once, for every pooling in one pass."""

    def __init__(
        self,
        directory: Path,
        poolings: Sequence[str] | None,
        dims: Sequence[int] | None,
        gammas: Sequence[float],
        encoder: MultiPoolingEncoder | None = None,
    ):
        index_dir = IndexDir(directory)
        manifest = index_dir.manifest()
        self.generation = manifest.generation
        if not manifest.encoder.encodes_text:
            raise ConfigError("IR tuning needs a text encoder to encode the queries: this index was built from vectors")
        self.stash = index_dir.stash("tune")
        self.stash.verify(full=True)
        self.poolings = list(poolings or self.stash.poolings)
        for pooling in self.poolings:
            self.stash.check_pooling(pooling)
        self.grid = candidates(self.poolings, list(dims or default_dims(self.stash.dim)), gammas, self.stash.dim)
        if encoder is not None:  # the same model and max length (it pools every way asked, whatever its own pooling)
            info = encoder.info()
            manifest.encoder.with_pooling(info.pooling or "").check_query(replace(info, pooling=info.pooling or ""))
        self.encoder: MultiPoolingEncoder = encoder or from_info(manifest.encoder.with_pooling(self.poolings[0]))
        self._encoded: dict[int, dict[str, np.ndarray]] = {}
        self.doc_ids = index_dir.docs().ids  # the stash's rows, looked up per hit: never every id in memory

    def query_vectors(self, pooling: str, queries: Queries) -> np.ndarray:
        if id(queries) not in self._encoded:  # each split once, for all poolings
            self._encoded[id(queries)] = self.encoder.encode_poolings(queries.texts, self.poolings)
        return self._encoded[id(queries)][pooling]


def tune_ir(
    stash: VectorStash,
    doc_ids: Sequence[str],
    query_vectors: Callable[[str, Queries], np.ndarray],
    dev: tuple[Queries, Qrels],
    test: tuple[Queries, Qrels] | None,
    grid: Sequence[TransformSpec],
    metric: str = "nDCG@10",
    depth: int = 100,
    on_trial: Callable[[Trial], None] | None = None,
    dev_positives: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
    rule: Callable[[Sequence[Trial], str], Trial] = pick,
) -> TuneResult:
    """Evaluate every candidate on dev (and test), choose on dev only. ``query_vectors(pooling, queries)``
    returns raw query vectors: queries are encoded, the corpus never is (it comes from the stash).

    ``dev_positives[pooling] = (rows, raw vectors)``: for the dev queries only, these stash rows are replaced by
    these vectors (pseudo-queries' positives, re-encoded without the query); test sees the stash as it is.
    ``rule`` picks from the dev scores (``pick_one_se`` also reads each trial's per-query dev ``metric``)."""
    check_metric(metric, IR_METRICS)
    splits = {"dev": dev} | ({"test": test} if test is not None else {})
    for name, split in splits.items():
        if not len(split[0]):
            raise ConfigError(f"the {name} split has no queries", "queries")
    moments = {p: stash.moments(p) for p in dict.fromkeys(str(c.pooling) for c in grid)}
    raw_queries = {(p, name): query_vectors(p, split[0]) for p in moments for name, split in splits.items()}
    depth = min(depth, len(stash))
    trials = []
    for cand in grid:
        assert cand.pooling is not None
        transform = cand.fit(moments[cand.pooling])
        queries = {name: transform.transform(raw_queries[(cand.pooling, name)]) for name in splits}
        tops = {name: TopK(len(q), depth) for name, q in queries.items()}
        swap_rows, swap = None, None
        if dev_positives is not None:
            swap_rows = np.asarray(dev_positives[cand.pooling][0], dtype=np.int64)
            swap = transform.transform(dev_positives[cand.pooling][1])
        start, search_ms = 0, None
        for block in stash.iter_blocks(pooling=cand.pooling):
            docs = transform.transform(block)
            for name, q in queries.items():
                if name == "dev" and swap_rows is not None and swap is not None:
                    inside = (swap_rows >= start) & (swap_rows < start + len(docs))
                    if inside.any():
                        dev_docs = docs.copy()
                        dev_docs[swap_rows[inside] - start] = swap[inside]
                        tops[name].push(q @ dev_docs.T, start)
                        continue
                tops[name].push(q @ docs.T, start)
            if search_ms is None:
                search_ms = _single_query_ms(docs, queries["dev"]) * len(stash) / len(docs)
            start += len(docs)
        results = {
            name: evaluate_run(to_run(split[0].ids, *tops[name].result(), doc_ids), split[1])
            for name, split in splits.items()
        }
        if results["dev"].n_queries == 0:
            raise ConfigError("no dev query has a relevant judgement: check that the queries and qrels belong together")
        per_query = np.array([q[metric] for q in results["dev"].per_query.values()], dtype=np.float64)
        trial = Trial(
            cand,
            dev=results["dev"].metrics,
            test=results["test"].metrics if "test" in results else {},
            search_ms=search_ms,
            dev_per_query=per_query,
        )
        trials.append(trial)
        if on_trial:
            on_trial(trial)
    return choose(trials, metric, rule)


def _single_query_ms(docs: np.ndarray, queries: np.ndarray) -> float:
    """Median milliseconds of one exact top-10 search over ``docs`` (FAISS flat, one query at a time)."""
    import faiss

    times = []
    for i in range(TIMING_QUERIES + 3):
        query = np.ascontiguousarray(queries[i % len(queries)][None, :], dtype=np.float32)
        start = time.perf_counter()
        faiss.knn(query, docs, 10, faiss.METRIC_INNER_PRODUCT)
        times.append(time.perf_counter() - start)
    return float(np.median(times[3:]) * 1000)


# ----- STS --------------------------------------------------------------------------------------------------
def tune_pairs(
    dev: Pairs,
    test: Pairs | None = None,
    fit_sets: Sequence[Pairs] = (),
    encoder: EncoderSpec = EncoderSpec(),
    poolings: Sequence[str] = ("mean",),
    dims: Sequence[int] | None = None,
    gammas: Sequence[float] = DEFAULT_GAMMAS,
    metric: str = "all",
    progress: Progress = no_progress,
) -> TuneResult:
    """Encode every sentence of the pair files once per pooling (one pass), fit on all of them ("target", no
    labels), sweep the grid, choose on ``dev``."""
    check_metric(metric, (*STS_METRICS, *dict.fromkeys(dev.subset)))
    sets = [dev, *([test] if test else []), *fit_sets]
    sentences = list(dict.fromkeys(s for p in sets for s in p.sentences()))
    model = EncoderSpec(encoder.model, poolings[0], encoder.max_length, encoder.batch_size, encoder.precision).load()
    if len(poolings) > 1 and not isinstance(model, MultiPoolingEncoder):
        raise ConfigError("this encoder cannot pool several ways in one pass", "pooling")
    raw = model.encode_poolings(sentences, poolings, on_batch=lambda n: progress("encode", n, len(sentences)))
    vectors = {p: dict(zip(sentences, raw[p], strict=True)) for p in poolings}
    grid = candidates(poolings, list(dims or default_dims(model.dim)), gammas, model.dim)
    return tune_sts(vectors, sentences, dev, test, grid, metric, on_trial=lambda t: progress("tune", 1, len(grid)))


def tune_sts(
    vectors: dict[str, dict[str, np.ndarray]],
    fit_sentences: Sequence[str],
    dev: Pairs,
    test: Pairs | None,
    grid: Sequence[TransformSpec],
    metric: str = "all",
    on_trial: Callable[[Trial], None] | None = None,
) -> TuneResult:
    """``vectors[pooling][sentence]`` -> raw vector. The transform is fitted on ``fit_sentences`` (no labels)."""
    check_metric(metric, (*STS_METRICS, *dict.fromkeys(dev.subset)))
    moments = {p: moments_of(v, fit_sentences) for p, v in vectors.items()}
    trials = []
    for cand in grid:
        assert cand.pooling is not None
        transform = cand.fit(moments[cand.pooling])
        trial = Trial(cand, dev=sts_result(vectors[cand.pooling], dev, transform))
        if test is not None:
            trial.test = sts_result(vectors[cand.pooling], test, transform)
        trials.append(trial)
        if on_trial:
            on_trial(trial)
    return choose(trials, metric)


def check_request(
    *,
    index: bool,
    pairs: bool,
    queries: bool = False,
    qrels: bool = False,
    test_pairs: bool = False,
    auto: bool = False,
    apply: bool = False,
    auto_queries: int = AUTO_QUERIES,
    seed: int = 0,
) -> None:
    """Refuse a tuning request whose parts do not go together, before anything is read or encoded (each flag says
    whether that input is given): an index (IR, on ``queries`` + ``qrels`` or on pseudo-queries with ``auto``) or
    ``pairs`` (STS), not both; ``apply`` needs the index; test pairs go with dev pairs. The index's splits are
    checked by ``check_ir_splits``."""
    if index == pairs:
        raise ConfigError("give an INDEX_DIR with `queries`/`qrels` or `auto` (IR), or `pairs` (STS)")
    if apply and not index:  # before any encoding, not after the whole sweep
        raise ConfigError("`apply` re-fits an index: it needs INDEX_DIR", "apply")
    if auto and (not index or queries or qrels):
        raise ConfigError("`auto` tunes an INDEX_DIR on pseudo-queries: give it without `queries` and `qrels`", "auto")
    if not MIN_AUTO_QUERIES <= auto_queries <= 100_000:
        raise ConfigError(
            f"`auto_queries` must be between {MIN_AUTO_QUERIES} and 100,000 (got {auto_queries})", "auto_queries"
        )
    if seed < 0:
        raise ConfigError(f"`seed` must be 0 or more (got {seed})", "seed")
    if test_pairs and not pairs:
        raise ConfigError("`test_pairs` goes with `pairs` (STS); for an index, give `test_queries`/`test_qrels`")


def check_ir_splits(queries: bool, qrels: bool, test_queries: bool, test_qrels: bool, auto: bool) -> None:
    """Refuse an index's tuning without its dev split (``queries`` + ``qrels``, or ``auto``) or with half a test
    split (each flag says whether that file is given)."""
    if not auto and not (queries and qrels):
        raise ConfigError("IR tuning needs `queries` and `qrels` (the dev split), or `auto`", "queries")
    if test_queries != test_qrels:
        raise ConfigError("`test_queries` and `test_qrels` go together: give both or neither", "test_qrels")
