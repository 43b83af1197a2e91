"""Evaluation metrics: ranked retrieval (nDCG, Recall, MRR, MAP, P at k, as BEIR/trec_eval) and STS Spearman.

Retrieval metrics follow trec_eval (the ``ndcg_cut``, ``recall``, ``map_cut`` and ``P`` measures that BEIR
reads through pytrec_eval), so numbers are comparable with published BEIR tables:

* a document is *relevant* when its judged grade is ``> 0``; grades ``<= 0`` and unjudged documents
  count as 0;
* nDCG gains are the grades themselves (linear, as trec_eval; not ``2**rel - 1``), discounted by
  ``log2(rank + 1)`` with ranks from 1; the ideal ranking is the judged grades sorted descending, cut
  at ``k``;
* Recall@k and MAP@k divide by the total number of relevant documents ``R`` (not ``min(k, R)``);
* P@k divides by ``k`` even when fewer than ``k`` documents were retrieved;
* MRR@k is the reciprocal rank of the first relevant document within the top ``k`` (BEIR's custom MRR).

Every per-query metric is 0 when the query has no relevant document.

Only numpy and the standard library are used: no scipy, no pytrec_eval.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "EvalResult",
    "Qrels",
    "Run",
    "average_precision_at_k",
    "evaluate_run",
    "knn_recall",
    "mrr_at_k",
    "ndcg_at_k",
    "pearson",
    "precision_at_k",
    "rank_run",
    "rankdata",
    "recall_at_k",
    "spearman",
    "sts_scores",
]

Qrels = dict[str, dict[str, int]]
"""query_id -> doc_id -> graded relevance (0 or less = not relevant)."""

Run = dict[str, dict[str, float]]
"""query_id -> doc_id -> retrieval score (higher = better)."""


# ------------------------------------------------------------------------------------------------------------
# Per-query retrieval metrics. ``ranked`` is the retrieved doc ids, best first, without duplicates.


def _check(ranked: Sequence[str], k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    if len(set(ranked)) != len(ranked):
        raise ValueError("ranked contains duplicate doc ids; each document may be retrieved once")


def _n_relevant(rels: Mapping[str, int]) -> int:
    return sum(1 for r in rels.values() if r > 0)


def _gain(rels: Mapping[str, int], doc_id: str) -> int:
    return max(rels.get(doc_id, 0), 0)


def ndcg_at_k(ranked: Sequence[str], rels: Mapping[str, int], k: int) -> float:
    """trec_eval ``ndcg_cut.k``: linear gains, 1/log2(rank + 1) discount, ideal = sorted judged grades to k.

    Returns 0.0 when no judged document is relevant.
    """
    _check(ranked, k)
    ideal_gains = sorted((r for r in rels.values() if r > 0), reverse=True)[:k]
    if not ideal_gains:
        return 0.0
    dcg = sum(_gain(rels, d) / math.log2(i + 2) for i, d in enumerate(ranked[:k]))
    idcg = sum(g / math.log2(i + 2) for i, g in enumerate(ideal_gains))
    return dcg / idcg


def recall_at_k(ranked: Sequence[str], rels: Mapping[str, int], k: int) -> float:
    """|relevant in top k| / |relevant|; 0.0 when there is no relevant document."""
    _check(ranked, k)
    n_rel = _n_relevant(rels)
    if n_rel == 0:
        return 0.0
    return sum(1 for d in ranked[:k] if rels.get(d, 0) > 0) / n_rel


def precision_at_k(ranked: Sequence[str], rels: Mapping[str, int], k: int) -> float:
    """trec_eval ``P.k``: |relevant in top k| / k (not / number retrieved); 0.0 with no relevant document."""
    _check(ranked, k)
    if _n_relevant(rels) == 0:
        return 0.0
    return sum(1 for d in ranked[:k] if rels.get(d, 0) > 0) / k


def mrr_at_k(ranked: Sequence[str], rels: Mapping[str, int], k: int) -> float:
    """1 / rank of the first relevant document within the top k (ranks from 1), else 0.0."""
    _check(ranked, k)
    for i, d in enumerate(ranked[:k]):
        if rels.get(d, 0) > 0:
            return 1.0 / (i + 1)
    return 0.0


def average_precision_at_k(ranked: Sequence[str], rels: Mapping[str, int], k: int) -> float:
    """trec_eval ``map_cut.k``: sum of P@i at each relevant hit i <= k, divided by the total relevant count R.

    The divisor is R, not ``min(k, R)``, so a perfect top-k scores below 1 when R > k. 0.0 when R = 0.
    """
    _check(ranked, k)
    n_rel = _n_relevant(rels)
    if n_rel == 0:
        return 0.0
    hits = 0
    total = 0.0
    for i, d in enumerate(ranked[:k]):
        if rels.get(d, 0) > 0:
            hits += 1
            total += hits / (i + 1)
    return total / n_rel


# ------------------------------------------------------------------------------------------------------------
# Whole-run evaluation.


@dataclass(frozen=True)
class EvalResult:
    """Metrics averaged over the evaluated queries, the per-query values behind them, and how many queries.

    ``metrics`` and each ``per_query[qid]`` map names such as ``"nDCG@10"``, ``"Recall@100"``, ``"MRR@10"``,
    ``"MAP@100"``, ``"P@10"`` to values in [0, 1]. When ``n_queries == 0`` every metric is NaN.
    """

    metrics: dict[str, float]
    per_query: dict[str, dict[str, float]]
    n_queries: int


def rank_run(scores: Mapping[str, float]) -> list[str]:
    """Doc ids by score descending, ties broken by doc id descending (string order), as trec_eval sorts.

    trec_eval (and so pytrec_eval and BEIR) ignores any rank given in the run file and breaks equal scores by
    ``strcmp`` on the docno, larger first. Python's ``str`` order equals UTF-8 byte order, so this matches it.
    """
    return [d for d, _ in sorted(scores.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)]


def evaluate_run(
    run: Run,
    qrels: Qrels,
    ndcg_ks: Sequence[int] = (10,),
    recall_ks: Sequence[int] = (10, 100),
    mrr_ks: Sequence[int] = (10,),
    map_ks: Sequence[int] = (100,),
    precision_ks: Sequence[int] = (),
) -> EvalResult:
    """Evaluate a run against qrels with pytrec_eval / BEIR semantics and average over queries.

    Which queries count (the choice BEIR makes through pytrec_eval, i.e. trec_eval *without* ``-c``):

    * it must be a key of both ``qrels`` and ``run``: queries in ``qrels`` but absent from ``run`` are
      **skipped**, not scored 0, so they do not lower the average (a key with an empty dict is present and
      scores 0); queries in ``run`` but not in ``qrels`` are ignored;
    * a query whose judgements hold no grade > 0 is evaluated and scores 0, as pytrec_eval (and so BEIR) and
      trec_eval count it (it was skipped: a mean over fewer queries than BEIR's); one with no judgement at all
      (an empty dict) is left out, as pytrec_eval leaves it out.

    Each query's documents are ranked by :func:`rank_run` (score descending, ties by doc id descending).
    Averages are plain means over the evaluated queries; ``n_queries`` says how many there were.
    Unlike BEIR's ``EvaluateRetrieval.evaluate`` nothing is removed from the run (e.g. doc id == query id);
    filter the run first if that is wanted.
    """
    families: list[tuple[str, Sequence[int], Callable[[Sequence[str], Mapping[str, int], int], float]]] = [
        ("nDCG", ndcg_ks, ndcg_at_k),
        ("Recall", recall_ks, recall_at_k),
        ("MRR", mrr_ks, mrr_at_k),
        ("MAP", map_ks, average_precision_at_k),
        ("P", precision_ks, precision_at_k),
    ]
    names = [(f"{prefix}@{k}", k, fn) for prefix, ks, fn in families for k in ks]
    for _, k, _ in names:
        _check((), k)  # reject a bad k even when no query gets evaluated
    per_query: dict[str, dict[str, float]] = {}
    for qid in sorted(qrels):
        rels = qrels[qid]
        if qid not in run or not rels:  # no judgement at all: pytrec_eval leaves it out too
            continue
        ranked = rank_run(run[qid])
        per_query[qid] = {name: fn(ranked, rels, k) for name, k, fn in names}
    n = len(per_query)
    if n == 0:
        metrics = {name: math.nan for name, _, _ in names}
    else:
        # math.fsum: the mean does not depend on query order beyond the last ulp.
        metrics = {name: math.fsum(q[name] for q in per_query.values()) / n for name, _, _ in names}
    return EvalResult(metrics=metrics, per_query=per_query, n_queries=n)


# ------------------------------------------------------------------------------------------------------------
# Correlations for STS.


def knn_recall(found: np.ndarray, truth: np.ndarray, k: int | None = None) -> float:
    """Recall@k of approximate neighbours: the share of each query's true top k (rows of ``truth``) that
    ``found`` holds in its first k, averaged over queries. Rows of -1 (fewer hits than asked) count as misses."""
    k = k or truth.shape[1]
    hits = sum(len(set(f[:k][f[:k] >= 0].tolist()) & set(t[:k].tolist())) for f, t in zip(found, truth, strict=True))
    return hits / (len(truth) * k)


def _as_1d(x: ArrayLike, name: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} contains NaN or infinite values")
    return a


def rankdata(x: ArrayLike) -> np.ndarray:
    """Ranks from 1 with ties given their average rank (``scipy.stats.rankdata(x, method='average')``).

    ``x`` must be one-dimensional and finite (ValueError otherwise). Returns float64.
    """
    a = _as_1d(x, "x")
    n = a.size
    if n == 0:
        return np.empty(0, dtype=np.float64)
    order = np.argsort(a, kind="stable")
    sorted_a = a[order]
    # Start index of each run of equal values in sorted order, and the run lengths.
    starts = np.flatnonzero(np.concatenate(([True], sorted_a[1:] != sorted_a[:-1])))
    lengths = np.diff(np.append(starts, n))
    # A run occupying 0-based positions s..s+len-1 has 1-based average rank s + (len + 1) / 2.
    avg = starts + (lengths + 1) / 2.0
    ranks = np.empty(n, dtype=np.float64)
    ranks[order] = np.repeat(avg, lengths)
    return ranks


def pearson(x: ArrayLike, y: ArrayLike) -> float:
    """Pearson correlation of two equal-length 1-D finite arrays, computed in float64.

    Returns NaN when fewer than 2 values are given or either input is constant (the correlation is undefined);
    raises ValueError for mismatched lengths, non-1-D or non-finite input.
    """
    a = _as_1d(x, "x")
    b = _as_1d(y, "y")
    if a.size != b.size:
        raise ValueError(f"x and y differ in length: {a.size} != {b.size}")
    if a.size < 2:
        return math.nan
    da = a - a.mean()
    db = b - b.mean()
    denom = math.sqrt(float(da @ da) * float(db @ db))
    if denom == 0.0:
        return math.nan
    r = float(da @ db) / denom
    return max(-1.0, min(1.0, r))


def spearman(x: ArrayLike, y: ArrayLike) -> float:
    """Spearman's rho: the Pearson correlation of average ranks (:func:`rankdata`), as scipy computes it.

    Same contract as :func:`pearson`: NaN for < 2 values or a constant input; ValueError if malformed.
    """
    a = _as_1d(x, "x")
    b = _as_1d(y, "y")
    if a.size != b.size:
        raise ValueError(f"x and y differ in length: {a.size} != {b.size}")
    return pearson(rankdata(a), rankdata(b))


def sts_scores(groups: Mapping[str, tuple[ArrayLike, ArrayLike]]) -> dict[str, float]:
    """STS summary from per-subset ``(predicted, gold)`` arrays (e.g. cosine similarity and human score).

    Returns, all as Spearman x 100:

    * one entry per subset under its own name;
    * ``"wmean"``: the mean of the per-subset values weighted by subset size (the usual "weighted average"
      of STS12-16 reporting);
    * ``"all"``: Spearman of all subsets concatenated (SentEval's "all" pooling).

    Subset names ``"wmean"`` and ``"all"`` are reserved (ValueError). A subset whose Spearman is undefined
    (fewer than 2 pairs or constant) gives NaN, which makes ``"wmean"`` NaN too. Raises ValueError if
    ``groups`` is empty or a subset's arrays differ in length.
    """
    if not groups:
        raise ValueError("sts_scores needs at least one subset")
    reserved = {"wmean", "all"} & set(groups)
    if reserved:
        raise ValueError(f"subset names {sorted(reserved)} are reserved for the summary values")
    out: dict[str, float] = {}
    preds: list[np.ndarray] = []
    golds: list[np.ndarray] = []
    sizes: list[int] = []
    for name, (pred, gold) in groups.items():
        p = _as_1d(pred, f"{name} predictions")
        g = _as_1d(gold, f"{name} gold scores")
        out[name] = 100.0 * spearman(p, g)
        preds.append(p)
        golds.append(g)
        sizes.append(p.size)
    total = sum(sizes)
    if total == 0:
        out["wmean"] = math.nan
    else:
        out["wmean"] = math.fsum(out[name] * n for name, n in zip(groups, sizes, strict=True)) / total
    out["all"] = 100.0 * spearman(np.concatenate(preds), np.concatenate(golds))
    return out
