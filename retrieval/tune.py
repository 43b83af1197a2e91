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

from retrieval.autorule import DEFAULT_RULE, AutoRule, Decision, decide
from retrieval.encode.spec import EncoderSpec, MultiPoolingEncoder
from retrieval.encode.transformer import from_info
from retrieval.errors import ConfigError
from retrieval.evaluate import Pairs, Queries, check_judged_in, moments_of, sts_result, to_run
from retrieval.indexdir import IndexDir
from retrieval.metrics import Qrels, evaluate_run
from retrieval.progress import Progress, no_progress
from retrieval.pseudo import KINDS, PseudoQueries, make_pseudo_queries
from retrieval.scan import TopK
from retrieval.stash import VectorStash
from retrieval.whitening import DEFAULT_GAMMA, TransformSpec

log = logging.getLogger(__name__)

DEFAULT_GAMMAS = (0.0, DEFAULT_GAMMA, 0.5, 0.75, 1.0)  # PCA, the default, stronger, full whitening
TIMING_QUERIES = 30  # single-query flat searches timed per candidate
AUTO_QUERIES = 300  # pseudo-queries of each kind of `tune --auto`: 900 queries and 600 documents encoded (only
# the sampled documents are encoded again). The rule's confidence bound widens with fewer: it keeps the current
# setting more often, never less safely (docs/benchmarks/tuning.md)
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
    rule: str = "best"  # how ``best`` was picked: "best" (``pick``), "one-SE" (``pick_one_se``), "safe" (``autorule``)
    decision: Decision | None = None  # `tune --auto`: kept or changed, how sure, on which kinds
    # `tune --auto`: kind -> candidate -> the metric per pseudo-query, what ``decision`` was made from; not saved
    kind_scores: dict[str, dict[TransformSpec, np.ndarray]] = field(default_factory=dict, repr=False)
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
            "decision": self.decision.to_dict() if self.decision else None,
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
    rule: AutoRule = DEFAULT_RULE,
    kinds: Sequence[str] = KINDS,
) -> TuneResult:
    """Tune without qrels: every kind of pseudo-query (``pseudo.KINDS``, ``n_queries`` of each) made from the
    index's own documents is a dev split, and the index's current setting (transform and re-scorer) is kept
    unless a candidate beats it on each kind by ``rule`` (``autorule``): pseudo-queries are a biased stand-in for
    real ones, each kind in its own way, so only a gain they all agree on is taken. ``result.decision`` says
    which, and how sure; ``result.best`` / ``result.scorer`` are what ``--apply`` writes.

    Only the sampled documents are encoded again (without their query), once for every pooling; ``test``, if
    given, is reported as usual and never used to choose. ``encoder``: one already loaded (it must match the
    index's); None loads the one the manifest names. A kind the corpus cannot make MIN_AUTO_QUERIES of is left
    out (logged); with none left, ConfigError."""
    check_metric(metric, IR_METRICS)
    sweep = _Sweep(directory, poolings, dims, gammas, encoder)
    manifest = IndexDir(directory).manifest()
    d = sweep.stash.dim
    current = manifest.transform.spec.resolve(d)
    current_scorer = manifest.rescoring.scorer.resolve(d)
    if current.pooling not in sweep.poolings:
        raise ConfigError(
            f"`auto` weighs every candidate against the index's current setting ({current.label}): "
            f"include its pooling {current.pooling} in `poolings`",
            "poolings",
        )
    grid = [c.resolve(d) for c in sweep.grid]
    grid += [s for s in dict.fromkeys((current, current_scorer)) if s not in grid and s.pooling in sweep.poolings]
    docs = IndexDir(directory).docs()
    per_kind: dict[str, TuneResult] = {}
    made: list[PseudoQueries] = []  # kept alive: the sweep caches query vectors by the Queries object's id
    for kind in kinds:
        pseudo = make_pseudo_queries(len(sweep.stash), docs.texts, docs.id, n_queries, seed, kind=kind)
        if len(pseudo) < MIN_AUTO_QUERIES:
            log.info("%s: only %d pseudo-queries of this kind: left out", kind, len(pseudo))
            continue
        made.append(pseudo)
        positives = None
        if pseudo.positives is not None:
            encoded = sweep.encoder.encode_poolings(
                pseudo.positives, sweep.poolings, on_batch=lambda n: progress("encode", n, len(made[-1]))
            )
            rows = np.asarray(pseudo.rows, dtype=np.int64)
            positives = {p: (rows, encoded[p]) for p in sweep.poolings}
        per_kind[kind] = tune_ir(
            sweep.stash,
            sweep.doc_ids,
            sweep.query_vectors,
            (pseudo.queries, pseudo.qrels),
            test if not per_kind else None,
            grid,
            metric,
            on_trial=lambda t: progress("tune", 1, len(grid) * len(kinds)),
            dev_positives=positives,
        )
    if not per_kind:
        raise ConfigError(
            f"no kind of pseudo-query ({', '.join(kinds)}) could be made {MIN_AUTO_QUERIES} times from the "
            f"{len(sweep.stash)} documents: tune with `queries` and `qrels` instead",
            "auto",
        )
    scores = {k: {t.candidate: _per_query(t) for t in r.trials} for k, r in per_kind.items()}
    decision = decide(scores, current, current_scorer, d, rule)
    trials = _merged_trials(per_kind, metric)
    by_spec = {t.candidate: t for t in trials}
    result = choose(trials, metric)
    result.best, result.scorer = by_spec[decision.transform.chosen], by_spec[decision.scorer.chosen]
    pooling = decision.transform.chosen.pooling
    result.raw = next((t for t in trials if not t.candidate.whiten and t.candidate.pooling == pooling), None)
    result.rule = "safe"
    result.decision, result.kind_scores = decision, scores
    result.corpus_rows_encoded = sum(len(p) for p in made if p.positives is not None)
    result.dev_source = f"{' + '.join(f'{len(p)} {p.split_by[0]}' for p in made)} pseudo-queries (seed {seed})"
    result.generation = sweep.generation
    return result


def _per_query(trial: Trial) -> np.ndarray:
    assert trial.dev_per_query is not None
    return trial.dev_per_query


def _merged_trials(per_kind: dict[str, TuneResult], metric: str) -> list[Trial]:
    """One trial per candidate: each dev metric averaged over the kinds (``metric`` of each kind kept as
    ``"<metric> <kind>"``), the test split's as measured with the first kind."""
    first = next(iter(per_kind.values())).trials
    merged = []
    for i, trial in enumerate(first):
        runs = [r.trials[i] for r in per_kind.values()]
        dev = {m: float(np.mean([t.dev[m] for t in runs])) for m in trial.dev}
        dev |= {f"{metric} {k}": r.trials[i].dev[metric] for k, r in per_kind.items()}
        merged.append(Trial(trial.candidate, dev, trial.test, trial.search_ms))
    return merged


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
