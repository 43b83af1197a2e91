"""Tests for retrieval.metrics: hand-worked retrieval and correlation examples, arithmetic in comments."""

from __future__ import annotations

import math

import numpy as np
import pytest

from retrieval.metrics import (
    EvalResult,
    average_precision_at_k,
    evaluate_run,
    knn_recall,
    mrr_at_k,
    ndcg_at_k,
    pearson,
    precision_at_k,
    rank_run,
    rankdata,
    recall_at_k,
    spearman,
    sts_scores,
)

# Every expected value below is worked by hand in float64; the only error is rounding in a few operations,
# so a relative tolerance of 1e-12 is ample and still catches any formula slip.
REL = 1e-12

LOG2_3 = math.log2(3)  # discount of rank 2
LOG2_5 = math.log2(5)  # discount of rank 4

# The running example: relevant = {d2 (grade 1), d4 (grade 2), d9 (grade 1, never retrieved)}, so R = 3.
RANKED = ["d1", "d2", "d3", "d4"]
RELS = {"d2": 1, "d4": 2, "d9": 1}


class TestRunningExample:
    def test_ndcg_at_3(self) -> None:
        # top 3 = d1(0), d2(1), d3(0): DCG = 1/log2(3)
        # ideal grades sorted [2, 1, 1]: IDCG = 2/log2(2) + 1/log2(3) + 1/log2(4) = 2 + 1/log2(3) + 0.5
        expected = (1 / LOG2_3) / (2.5 + 1 / LOG2_3)  # = 0.63093 / 3.13093 = 0.20152
        assert ndcg_at_k(RANKED, RELS, 3) == pytest.approx(expected, rel=REL)
        assert expected == pytest.approx(0.201516, abs=1e-6)

    def test_ndcg_at_10(self) -> None:
        # DCG = 1/log2(3) + 2/log2(5) = 0.63093 + 0.86135 = 1.49228
        # ideal has only three judged relevant grades, so IDCG@10 = IDCG@3 = 3.13093
        expected = (1 / LOG2_3 + 2 / LOG2_5) / (2.5 + 1 / LOG2_3)  # = 1.49228 / 3.13093 = 0.47663
        assert ndcg_at_k(RANKED, RELS, 10) == pytest.approx(expected, rel=REL)
        assert expected == pytest.approx(0.476626, abs=1e-6)

    def test_recall(self) -> None:
        assert recall_at_k(RANKED, RELS, 1) == 0.0  # d1 is not relevant
        assert recall_at_k(RANKED, RELS, 2) == pytest.approx(1 / 3, rel=REL)  # d2 of {d2, d4, d9}
        assert recall_at_k(RANKED, RELS, 10) == pytest.approx(2 / 3, rel=REL)  # d9 never retrieved

    def test_precision(self) -> None:
        assert precision_at_k(RANKED, RELS, 3) == pytest.approx(1 / 3, rel=REL)  # d2 in 3
        # trec_eval divides by k, not by the 4 documents retrieved: 2 / 10
        assert precision_at_k(RANKED, RELS, 10) == pytest.approx(0.2, rel=REL)

    def test_mrr(self) -> None:
        assert mrr_at_k(RANKED, RELS, 10) == pytest.approx(0.5, rel=REL)  # first relevant at rank 2
        assert mrr_at_k(RANKED, RELS, 1) == 0.0  # rank 2 is outside the top 1

    def test_average_precision(self) -> None:
        # hits at rank 2 (P@2 = 1/2) and rank 4 (P@4 = 2/4); divide by R = 3 (not min(k, R))
        assert average_precision_at_k(RANKED, RELS, 10) == pytest.approx((0.5 + 0.5) / 3, rel=REL)
        # cut at 3: only the rank-2 hit counts, still divided by R = 3
        assert average_precision_at_k(RANKED, RELS, 3) == pytest.approx(0.5 / 3, rel=REL)
        # cut at 2 with R = 3 > k: the divisor stays 3, as map_cut does
        assert average_precision_at_k(RANKED, RELS, 2) == pytest.approx(0.5 / 3, rel=REL)


def test_ndcg_gains_are_linear_not_exponential() -> None:
    ranked = ["a", "b", "c"]
    rels = {"a": 1, "b": 3, "c": 2}
    # DCG  = 1/1 + 3/log2(3) + 2/2 = 2 + 3/log2(3)
    # IDCG = 3/1 + 2/log2(3) + 1/2 = 3.5 + 2/log2(3)
    expected = (2 + 3 / LOG2_3) / (3.5 + 2 / LOG2_3)  # = 3.8928 / 4.7619 = 0.81749
    assert ndcg_at_k(ranked, rels, 3) == pytest.approx(expected, rel=REL)
    # with 2^rel - 1 gains it would be (1 + 7/log2(3) + 3/2) / (7 + 3/log2(3) + 1/2) = 0.73458: make sure not
    exponential = (1 + 7 / LOG2_3 + 1.5) / (7.5 + 3 / LOG2_3)
    assert ndcg_at_k(ranked, rels, 3) != pytest.approx(exponential, rel=1e-3)
    # the ideal is cut at k: k = 1 puts b (3) against the ideal 3 -> a (1) gives 1/3
    assert ndcg_at_k(ranked, rels, 1) == pytest.approx(1 / 3, rel=REL)


def test_perfect_ranking_scores_one() -> None:
    ranked = ["b", "c", "a", "x"]
    rels = {"a": 1, "b": 3, "c": 2}
    for k in (1, 2, 3, 10):
        assert ndcg_at_k(ranked, rels, k) == pytest.approx(1.0, rel=REL)
        assert mrr_at_k(ranked, rels, k) == 1.0
    assert recall_at_k(ranked, rels, 3) == 1.0
    assert average_precision_at_k(ranked, rels, 3) == pytest.approx(1.0, rel=REL)
    # R = 3 > k = 2: map_cut divides by R, so a perfect top 2 scores (1 + 1) / 3
    assert average_precision_at_k(ranked, rels, 2) == pytest.approx(2 / 3, rel=REL)


@pytest.mark.parametrize("rels", [{}, {"d1": 0, "d2": 0}, {"d1": -1}])
def test_no_relevant_documents_gives_zero(rels: dict[str, int]) -> None:
    for fn in (ndcg_at_k, recall_at_k, precision_at_k, mrr_at_k, average_precision_at_k):
        assert fn(RANKED, rels, 10) == 0.0


def test_negative_and_zero_grades_are_not_relevant() -> None:
    ranked = ["a", "b", "c"]
    rels = {"a": -2, "b": 0, "c": 1}
    # only c (rank 3) counts; a negative grade adds no negative gain
    assert ndcg_at_k(ranked, rels, 3) == pytest.approx((1 / 2) / 1, rel=REL)  # 1/log2(4) over ideal 1/1
    assert mrr_at_k(ranked, rels, 3) == pytest.approx(1 / 3, rel=REL)
    assert recall_at_k(ranked, rels, 2) == 0.0


def test_empty_ranking() -> None:
    for fn in (ndcg_at_k, recall_at_k, precision_at_k, mrr_at_k, average_precision_at_k):
        assert fn([], RELS, 10) == 0.0


@pytest.mark.parametrize("k", [0, -1, 2.5, True])
def test_bad_k_is_rejected(k: object) -> None:
    with pytest.raises(ValueError, match="k must be"):
        ndcg_at_k(RANKED, RELS, k)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="k must be"):
        evaluate_run({}, {}, ndcg_ks=(k,))  # type: ignore[arg-type]


def test_duplicate_doc_ids_are_rejected() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        recall_at_k(["d2", "d2"], RELS, 10)


# ------------------------------------------------------------------------------------------------------------
# evaluate_run


def test_rank_run_breaks_ties_by_doc_id_descending() -> None:
    # b and a tie at 1.0: trec_eval puts the larger docno first -> b, a; then c (0.5), then z (-1.0)
    assert rank_run({"a": 1.0, "c": 0.5, "b": 1.0, "z": -1.0}) == ["b", "a", "c", "z"]
    # a three-way tie, string order (not numeric): "d9" > "d10" > "d1"
    assert rank_run({"d1": 0.0, "d10": 0.0, "d9": 0.0}) == ["d9", "d10", "d1"]


def test_evaluate_run_tie_handling() -> None:
    run = {"q": {"a": 1.0, "b": 1.0, "c": 0.5}}
    qrels = {"q": {"a": 1}}
    # ranking b, a, c (tie broken by doc id descending): the relevant a is at rank 2
    result = evaluate_run(run, qrels, ndcg_ks=(1, 2), recall_ks=(1,), mrr_ks=(10,), map_ks=(10,))
    assert result.metrics["MRR@10"] == pytest.approx(0.5, rel=REL)
    assert result.metrics["Recall@1"] == 0.0
    assert result.metrics["nDCG@1"] == 0.0
    assert result.metrics["nDCG@2"] == pytest.approx(1 / LOG2_3, rel=REL)  # gain 1 at rank 2 over ideal 1
    assert result.metrics["MAP@10"] == pytest.approx(0.5, rel=REL)  # P@2 = 1/2, R = 1


def test_evaluate_run_averages_and_names() -> None:
    run = {
        "q1": {d: float(-i) for i, d in enumerate(RANKED)},  # d1 > d2 > d3 > d4 by score
        "q2": {"x": 2.0, "y": 1.0},
    }
    qrels = {"q1": RELS, "q2": {"x": 1}}
    result = evaluate_run(run, qrels, precision_ks=(10,))
    assert isinstance(result, EvalResult)
    assert set(result.metrics) == {"nDCG@10", "Recall@10", "Recall@100", "MRR@10", "MAP@100", "P@10"}
    assert result.n_queries == 2
    # q1 is the running example, q2 is perfect: nDCG@10 = (0.47663 + 1) / 2
    q1_ndcg = (1 / LOG2_3 + 2 / LOG2_5) / (2.5 + 1 / LOG2_3)
    assert result.per_query["q1"]["nDCG@10"] == pytest.approx(q1_ndcg, rel=REL)
    assert result.per_query["q2"]["nDCG@10"] == 1.0
    assert result.metrics["nDCG@10"] == pytest.approx((q1_ndcg + 1) / 2, rel=REL)
    assert result.metrics["Recall@10"] == pytest.approx((2 / 3 + 1) / 2, rel=REL)
    assert result.metrics["MRR@10"] == pytest.approx((0.5 + 1) / 2, rel=REL)
    assert result.metrics["MAP@100"] == pytest.approx((1 / 3 + 1) / 2, rel=REL)
    assert result.metrics["P@10"] == pytest.approx((0.2 + 0.1) / 2, rel=REL)


def test_evaluate_run_skips_queries_absent_from_run() -> None:
    # As pytrec_eval (so BEIR): q2 is judged but not in the run -> skipped, not scored 0 (trec_eval -c would).
    # q3 has judgements but none above 0 -> evaluated, every metric 0 (it was skipped: a mean over fewer
    # queries than BEIR's). q4 is in the run but not judged -> ignored. pytrec_eval 0.5.11 (ndcg_cut_10,
    # recip_rank, recall_10) gives q1 1.0 and q3 0.0 on exactly these inputs.
    qrels = {"q1": {"a": 1}, "q2": {"b": 1}, "q3": {"c": 0}}
    run = {"q1": {"a": 1.0, "z": 0.5}, "q3": {"c": 1.0}, "q4": {"a": 1.0}}
    result = evaluate_run(run, qrels)
    assert result.n_queries == 2
    assert set(result.per_query) == {"q1", "q3"} and set(result.per_query["q3"].values()) == {0.0}
    assert result.metrics["MRR@10"] == 0.5  # would be 1/3 if q2 counted as 0 (trec_eval -c)
    assert result.metrics["nDCG@10"] == result.metrics["Recall@10"] == 0.5
    # no judgement at all (an empty dict; the qrels reader never makes one): left out, as pytrec_eval does
    assert evaluate_run({**run, "q5": {"a": 1.0}}, {**qrels, "q5": {}}).n_queries == 2


def test_evaluate_run_empty_run_entry_scores_zero() -> None:
    # a query present in the run with no documents is evaluated, and scores 0
    result = evaluate_run({"q1": {}, "q2": {"b": 1.0}}, {"q1": {"a": 1}, "q2": {"b": 1}})
    assert result.n_queries == 2
    assert result.per_query["q1"]["nDCG@10"] == 0.0
    assert result.metrics["nDCG@10"] == pytest.approx(0.5, rel=REL)


def test_evaluate_run_with_no_overlap_is_nan() -> None:
    result = evaluate_run({"q9": {"a": 1.0}}, {"q1": {"a": 1}})
    assert result.n_queries == 0
    assert result.per_query == {}
    assert all(math.isnan(v) for v in result.metrics.values())


def test_eval_result_is_frozen() -> None:
    result = evaluate_run({"q": {"a": 1.0}}, {"q": {"a": 1}})
    with pytest.raises(AttributeError):
        result.n_queries = 5  # type: ignore[misc]


# ------------------------------------------------------------------------------------------------------------
# Correlations


def test_rankdata_with_ties() -> None:
    np.testing.assert_array_equal(rankdata([10, 20, 20, 30]), [1.0, 2.5, 2.5, 4.0])
    # unsorted input with a triple tie: 3s occupy ranks 2, 3, 4 -> 3.0 each
    np.testing.assert_array_equal(rankdata([3, 1, 3, 5, 3]), [3.0, 1.0, 3.0, 5.0, 3.0])
    np.testing.assert_array_equal(rankdata([7, 7, 7]), [2.0, 2.0, 2.0])
    np.testing.assert_array_equal(rankdata([0.5]), [1.0])
    assert rankdata([]).shape == (0,)


def test_rankdata_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="one-dimensional"):
        rankdata([[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="NaN"):
        rankdata([1.0, float("nan")])


def test_pearson_hand_example() -> None:
    # x = [1, 2, 3], y = [1, 2, 4]: dx = [-1, 0, 1], dy = [-4/3, -1/3, 5/3]
    # sum dx*dy = 4/3 + 5/3 = 3; sum dx^2 = 2; sum dy^2 = (16 + 1 + 25)/9 = 14/3
    # r = 3 / sqrt(2 * 14/3) = 3 / sqrt(28/3) = 0.98198
    assert pearson([1, 2, 3], [1, 2, 4]) == pytest.approx(3 / math.sqrt(28 / 3), rel=REL)


def test_spearman_monotone_and_reversed() -> None:
    x = np.linspace(-2.0, 3.0, 17)
    assert spearman(x, np.exp(3 * x)) == pytest.approx(1.0, rel=REL)  # nonlinear, strictly increasing
    assert spearman(x, x**3 - 10) == pytest.approx(1.0, rel=REL)
    assert spearman(x, -np.exp(x)) == pytest.approx(-1.0, rel=REL)  # strictly decreasing
    assert spearman(x, x[::-1]) == pytest.approx(-1.0, rel=REL)
    # Pearson is not 1 on the nonlinear transform, which is the point of ranking
    assert pearson(x, np.exp(3 * x)) < 0.9


def test_spearman_hand_example_with_ties() -> None:
    # ranks of x = [1, 2, 2, 3] -> [1, 2.5, 2.5, 4]; ranks of y = [1, 3, 2, 4] -> [1, 3, 2, 4]; both mean 2.5
    # dx = [-1.5, 0, 0, 1.5], dy = [-1.5, 0.5, -0.5, 1.5]
    # sum dx*dy = 2.25 + 2.25 = 4.5; sum dx^2 = 4.5; sum dy^2 = 2.25 + 0.25 + 0.25 + 2.25 = 5
    # rho = 4.5 / sqrt(4.5 * 5) = sqrt(0.9) = 0.948683
    assert spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(math.sqrt(0.9), rel=REL)


def test_spearman_undefined_cases_are_nan() -> None:
    assert math.isnan(spearman([1.0], [2.0]))
    assert math.isnan(spearman([], []))
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))  # constant input
    assert math.isnan(pearson([1, 2, 3], [5, 5, 5]))


def test_correlation_length_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        spearman([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="differ in length"):
        pearson([1, 2, 3], [1, 2])


def test_sts_scores_wmean_differs_from_all() -> None:
    groups = {
        "A": (np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0, 3.0])),  # rho = +1 -> 100
        "B": (np.array([1.0, 2.0, 3.0, 4.0]), np.array([4.0, 3.0, 2.0, 1.0])),  # rho = -1 -> -100
    }
    out = sts_scores(groups)
    assert set(out) == {"A", "B", "wmean", "all"}
    assert out["A"] == pytest.approx(100.0, rel=REL)
    assert out["B"] == pytest.approx(-100.0, rel=REL)
    # wmean = (3 * 100 + 4 * (-100)) / 7 = -100/7 = -14.2857
    assert out["wmean"] == pytest.approx(-100 / 7, rel=REL)
    # all: pred = [1, 2, 3, 1, 2, 3, 4] -> ranks [1.5, 3.5, 5.5, 1.5, 3.5, 5.5, 7]
    #      gold = [1, 2, 3, 4, 3, 2, 1] -> ranks [1.5, 3.5, 5.5, 7, 5.5, 3.5, 1.5]; both mean 4
    # dp = [-2.5, -0.5, 1.5, -2.5, -0.5, 1.5, 3], dg = [-2.5, -0.5, 1.5, 3, 1.5, -0.5, -2.5]
    # sum dp*dg = 6.25 + 0.25 + 2.25 - 7.5 - 0.75 - 0.75 - 7.5 = -7.75
    # sum dp^2 = sum dg^2 = 6.25 + 0.25 + 2.25 + 6.25 + 0.25 + 2.25 + 9 = 26.5
    # rho = -7.75 / 26.5 = -0.292453 -> -29.2453
    assert out["all"] == pytest.approx(-775 / 26.5, rel=REL)
    assert out["all"] != pytest.approx(out["wmean"], rel=1e-3)


def test_sts_scores_rejects_bad_groups() -> None:
    with pytest.raises(ValueError, match="at least one"):
        sts_scores({})
    with pytest.raises(ValueError, match="reserved"):
        sts_scores({"all": (np.ones(3), np.ones(3))})
    with pytest.raises(ValueError, match="differ in length"):
        sts_scores({"A": (np.arange(3.0), np.arange(4.0))})


# ------------------------------------------------------------------------------------------------------------
# Cross-check against scipy (a [dev] dependency only; the library never imports it; the hand-worked tests above
# stand alone).


def test_matches_scipy_on_random_data_with_ties() -> None:
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(1338)
    for n in (2, 3, 10, 257):
        # integers from a small range force many ties
        x = rng.integers(0, 5, size=n).astype(float)
        y = x + rng.integers(-2, 3, size=n)
        np.testing.assert_array_equal(rankdata(x), stats.rankdata(x, method="average"))
        if np.ptp(x) == 0 or np.ptp(y) == 0:
            continue
        # both compute in float64 but in different orders of operations: agree to ~1e-12
        assert spearman(x, y) == pytest.approx(stats.spearmanr(x, y).statistic, rel=1e-10, abs=1e-12)
        assert pearson(x, y) == pytest.approx(stats.pearsonr(x, y).statistic, rel=1e-10, abs=1e-12)


def test_pearson_of_an_exact_linear_relation_stays_within_one() -> None:
    # y = a x + b exactly (up to rounding in y): the unclipped ratio rounds to 1.0000000000000002 here
    x = [0.1257302210933933, -0.1321048632913019, 0.6404226504432821, 0.10490011715303971, -0.535669373161111]
    y = [2.2150642890811607, -0.14058929112833396, 6.917438548186283, 2.0247546225734845, -3.827667738147997]
    assert pearson(x, y) == 1.0
    assert pearson(x, [-v for v in y]) == -1.0


def test_knn_recall_counts_minus_one_as_a_miss_and_cuts_at_the_truths_width() -> None:
    # -1 pads a row that found fewer hits than asked: never a hit, even where the truth is padded too
    assert knn_recall(np.array([[4, -1]]), np.array([[4, -1]])) == 0.5
    # default k is the truth's width (2), not the found rows' (4): both true neighbours found -> 1.0, not 2 / 4
    assert knn_recall(np.array([[0, 1, 2, 3]]), np.array([[1, 0]])) == 1.0
    # two queries, k = 2: hits 1 of 2 and 2 of 2 -> 3 / 4
    assert knn_recall(np.array([[5, 9], [7, 8]]), np.array([[5, 6], [8, 7]])) == 0.75
    # an explicit k cuts both: the truth's first 2 (1, 0), found in the first 2 rows (1, 9) -> 1 / 2, not 2 / 3
    assert knn_recall(np.array([[1, 9, 0]]), np.array([[1, 0, 2]]), k=2) == 0.5
