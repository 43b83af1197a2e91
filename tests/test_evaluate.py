"""Dataset-level evaluation: reading queries, qrels and pairs (bad columns refused), FAISS output as a run,
evaluate_ir on a fake-encoder index with qrels whose metrics are worked out by hand, and STS aggregation."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import FakeEncoder

from retrieval.build import build_index
from retrieval.corpus import CorpusSpec
from retrieval.errors import CorpusError
from retrieval.evaluate import (
    Pairs,
    QueryFile,
    evaluate_ir,
    evaluate_sts,
    pair_cosines,
    read_pairs,
    read_qrels,
    read_queries,
    sts_result,
    to_run,
)
from retrieval.metrics import spearman
from retrieval.moments import RunningMoments
from retrieval.search import Searcher, SearchParams
from retrieval.whitening import RawTransform, TransformSpec, Whitening


def write(path: Path, **columns: list) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


# ----- reading ---------------------------------------------------------------------------------------------
def test_read_queries_keeps_order_and_stringifies_ids(tmp_path: Path) -> None:
    path = write(tmp_path / "q.parquet", query_id=[3, 1, 2], text=["c", "a", "b"])
    queries = read_queries(path)
    assert (queries.ids, queries.texts, len(queries)) == (["3", "1", "2"], ["c", "a", "b"], 3)
    other = write(tmp_path / "q2.parquet", _id=["x"], question=["why?"])
    assert read_queries(other, id_column="_id", text_column="question").texts == ["why?"]
    large = tmp_path / "q3.parquet"  # large_string text, as some writers store it
    pq.write_table(pa.table({"query_id": ["q"], "text": pa.array(["why?"], pa.large_string())}), large)
    assert read_queries(large).texts == ["why?"]


def test_read_qrels_keeps_grades_and_groups_by_query(tmp_path: Path) -> None:
    path = write(
        tmp_path / "qrels.parquet",
        query_id=["q1", "q1", "q2", "q3"],
        doc_id=["d1", "d2", "d1", "d9"],
        score=[2, 1, 0, 3],
    )
    assert read_qrels(path) == {"q1": {"d1": 2, "d2": 1}, "q2": {"d1": 0}, "q3": {"d9": 3}}
    numeric = write(tmp_path / "n.parquet", query_id=[1], doc_id=[7], score=[1])
    assert read_qrels(numeric) == {"1": {"7": 1}}


def test_a_query_without_an_id_is_refused_with_its_row(tmp_path: Path) -> None:
    path = write(tmp_path / "q.parquet", query_id=["q1", None, "q3"], text=["a", "b", "c"])
    with pytest.raises(CorpusError, match=r"^row 1 of .*q\.parquet has a null 'query_id': every query needs an id"):
        read_queries(path)


def test_a_pair_judged_twice_alike_is_kept_and_differently_refused(tmp_path: Path) -> None:
    """Which of two grades for one (query, doc) would count is a guess (BEIR keeps the last, others the first)."""
    alike = write(tmp_path / "a.parquet", query_id=["q1", "q1"], doc_id=["d1", "d1"], score=[2, 2])
    assert read_qrels(alike) == {"q1": {"d1": 2}}
    path = write(tmp_path / "r.parquet", query_id=["q1", "q2", "q1"], doc_id=["d1", "d1", "d1"], score=[2, 1, 0])
    with pytest.raises(CorpusError, match=r"^row 2 of .*r\.parquet grades doc 'd1' for query 'q1' 0, an earlier row 2"):
        read_qrels(path)


@pytest.mark.parametrize("grade", [math.nan, math.inf, -math.inf])
def test_a_non_finite_grade_is_refused_with_its_row(tmp_path: Path, grade: float) -> None:
    """Refused as a bad grade in one line, not a ValueError or OverflowError from int()."""
    path = write(tmp_path / "r.parquet", query_id=["q1", "q1"], doc_id=["d1", "d2"], score=[1.0, grade])
    with pytest.raises(CorpusError, match=r"^row 1 of .*r\.parquet has the grade .*: relevance grades must be whole"):
        read_qrels(path)


@pytest.mark.parametrize(
    ("reader", "columns", "missing"),
    [
        (read_queries, {"query_id": ["q"], "body": ["t"]}, "text"),
        (read_qrels, {"query_id": ["q"], "doc_id": ["d"]}, "score"),
        (read_qrels, {"qid": ["q"], "doc_id": ["d"], "score": [1]}, "query_id"),
        (read_pairs, {"sentence1": ["a"], "sentence2": ["b"], "label": [1.0]}, "score"),
    ],
)
def test_missing_columns_are_named(tmp_path: Path, reader, columns: dict, missing: str) -> None:
    path = write(tmp_path / "bad.parquet", **columns)
    with pytest.raises(CorpusError) as info:
        reader(path)
    message = str(info.value)
    assert f"no column {missing!r}" in message
    assert ", ".join(columns) in message  # the columns the file does have, so the user can map them


def test_missing_or_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="qrels file not found"):
        read_qrels(tmp_path / "absent.parquet")
    junk = tmp_path / "junk.parquet"
    junk.write_text("query_id,doc_id,score\n")
    with pytest.raises(CorpusError, match="not a readable parquet file"):
        read_queries(junk)


def test_read_pairs_with_and_without_subsets(tmp_path: Path) -> None:
    plain = read_pairs(write(tmp_path / "sts-b.parquet", sentence1=["a", "b"], sentence2=["b", "c"], score=[1, 4.5]))
    assert plain.name == "sts-b" and plain.subset == ["sts-b", "sts-b"]
    assert plain.gold.dtype == np.float64 and plain.gold.tolist() == [1.0, 4.5]
    assert plain.sentences() == ["a", "b", "c"]  # distinct, first-seen order: s1 column, then s2
    columns = {"sentence1": ["x", "y", "w", "v"], "sentence2": ["y", "z", "v", "u"], "score": [0, 5, 1, 2]}
    grouped = read_pairs(write(tmp_path / "sts12.parquet", **columns, subset=["A", "A", "B", "B"]))
    assert grouped.subset == ["A", "A", "B", "B"]


def test_text_columns_in_any_arrow_layout(tmp_path: Path) -> None:
    """pandas writes a categorical column as a dictionary of strings; arrow also has string_view. Both are text."""
    for layout in (lambda v: pa.array(v).dictionary_encode(), lambda v: pa.array(v, pa.string_view())):
        queries = tmp_path / "q.parquet"
        pq.write_table(pa.table({"query_id": [1, 2, 3], "text": layout(["c", "a", "c"])}), queries)
        assert read_queries(queries).texts == ["c", "a", "c"]
        columns = {
            c: layout(v) for c, v in [("sentence1", ["x", "y"]), ("sentence2", ["y", "z"]), ("subset", ["A", "A"])]
        }
        pairs = tmp_path / "pairs.parquet"
        pq.write_table(pa.table({**columns, "score": [0.0, 5.0]}), pairs)
        read = read_pairs(pairs)
        assert (read.sentence1, read.sentence2, read.subset) == (["x", "y"], ["y", "z"], ["A", "A"])


def test_ids_are_read_as_the_corpus_reads_them(tmp_path: Path) -> None:
    """Binary ids were turned into "b'q1'" (str of bytes), which matched no document id of the index (the corpus
    decodes them); float ids were taken as "1.0", which the corpus refuses as ambiguous."""
    queries, qrels = tmp_path / "q.parquet", tmp_path / "qrels.parquet"
    binary = pa.array([b"q1", b"q2"], pa.binary())
    pq.write_table(pa.table({"query_id": binary, "text": ["a", "b"]}), queries)
    assert read_queries(queries).ids == ["q1", "q2"]
    assert [q.ids for q in QueryFile(queries).chunks()] == [["q1", "q2"]]
    pq.write_table(pa.table({"query_id": binary, "doc_id": pa.array([b"d1", b"d2"]), "score": [1, 2]}), qrels)
    assert read_qrels(qrels) == {"q1": {"d1": 1}, "q2": {"d2": 2}}
    categorical = pa.array([b"q1", b"q2"], pa.binary()).dictionary_encode()  # as the corpus takes one
    pq.write_table(pa.table({"query_id": categorical, "text": ["a", "b"]}), queries)
    assert read_queries(queries).ids == ["q1", "q2"] and next(QueryFile(queries).chunks()).ids == ["q1", "q2"]
    pq.write_table(pa.table({"query_id": pa.array([7, 8], pa.int16()), "text": ["a", "b"]}), queries)
    assert read_queries(queries).ids == ["7", "8"] and next(QueryFile(queries).chunks()).ids == ["7", "8"]
    pq.write_table(pa.table({"query_id": [1.0, 2.0], "text": ["a", "b"]}), queries)
    for read in (read_queries, QueryFile):
        with pytest.raises(CorpusError, match="'query_id' of .* holds double: ids must be strings or integers"):
            read(queries)
    pq.write_table(pa.table({"query_id": ["q1"], "doc_id": [3.0], "score": [1]}), qrels)
    with pytest.raises(CorpusError, match="'doc_id' of .* holds double"):
        read_qrels(qrels)
    pq.write_table(pa.table({"query_id": ["q1", "q2"], "text": ["a", "\u200b\x00"]}), queries)
    for read in (read_queries, QueryFile):  # nothing the tokenizer keeps: as blank as "  "
        with pytest.raises(CorpusError, match="query q2 of .* has no text"):
            read(queries)
    pq.write_table(pa.table({"query_id": pa.array([b"\xff"]), "text": ["a"]}), queries)
    with pytest.raises(CorpusError, match="bytes that are not UTF-8: store ids as text"):
        read_queries(queries)


# ----- FAISS output as a run -------------------------------------------------------------------------------
def test_to_run_maps_rows_to_ids_and_drops_missing() -> None:
    scores = np.array([[0.9, 0.5, -np.inf], [0.7, 0.6, 0.1]], dtype=np.float32)
    rows = np.array([[2, 0, -1], [1, 2, 0]])
    run = to_run(["qa", "qb"], scores, rows, ["d0", "d1", "d2"])
    assert run == {
        "qa": {"d2": pytest.approx(0.9), "d0": pytest.approx(0.5)},
        "qb": {"d1": pytest.approx(0.7), "d2": pytest.approx(0.6), "d0": pytest.approx(0.1)},
    }


# ----- evaluate_ir against hand-worked numbers ---------------------------------------------------------------
DUP = "whitening vectors search"


@pytest.fixture(scope="module")
def searcher(tmp_path_factory: pytest.TempPathFactory) -> Searcher:
    """100 fake documents d00..d99 plus two with the same text (dupA, dupB): the fake encoder maps equal
    texts to equal vectors, so a query equal to a document's text finds that document first (cosine 1)."""
    root = tmp_path_factory.mktemp("eval")
    ids = [f"d{i:02d}" for i in range(100)] + ["dupA", "dupB"]
    texts = [f"document number {i} about topic {i % 7}" for i in range(100)] + [DUP, DUP]
    corpus = write(root / "corpus.parquet", id=ids, text=texts)
    build_index(CorpusSpec(corpus), FakeEncoder(), root / "idx", TransformSpec())
    return Searcher.load(root / "idx", encoder=FakeEncoder())


def doc_text(i: int) -> str:
    return f"document number {i} about topic {i % 7}"


QUERIES = {
    "q1": doc_text(3),
    "q2": doc_text(7),
    "q3": DUP,
    "q4": doc_text(9),
    "q5": doc_text(11),
    "q6": doc_text(13),
    "q7": doc_text(15),  # in no qrels: ignored
}
QRELS = {
    "q1": {"d03": 2},  # its own document at rank 1: every metric 1
    "q2": {"d07": 1, "absent": 1},  # rank 1 + a document the index lacks
    "q3": {"dupA": 1},  # dupA and dupB tie at cosine 1; ties go to the larger id, so dupA is rank 2
    "q4": {"d09": 0, "absent": 1},  # its own document judged not relevant; the relevant one is never found
    "q5": {"d11": 0},  # nothing relevant: evaluated, every metric 0 (as pytrec_eval and so BEIR count it)
    "q6": {"d13": 1, "absent": 3},  # graded: the grade-3 document is missing
}
# Only judged documents matter, and each one's rank is known (1, 2, or never retrieved):
#   q1: nDCG 1;                        R@10 1;   MRR 1
#   q2: 1 / (1 + 1/log2 3) = 0.613147; R@10 1/2; MRR 1
#   q3: (1/log2 3) / 1     = 0.630930; R@10 1;   MRR 1/2
#   q4: 0;                             R@10 0;   MRR 0
#   q5: 0;                             R@10 0;   MRR 0      (no grade above 0)
#   q6: 1 / (3 + 1/log2 3) = 0.275406; R@10 1/2; MRR 1      (linear gains, ideal = [3, 1])
# q7 is not evaluated: 6 queries.
EXPECTED = {
    "nDCG@10": (1 + 1 / (1 + 1 / math.log2(3)) + 1 / math.log2(3) + 0 + 0 + 1 / (3 + 1 / math.log2(3))) / 6,
    "Recall@10": (1 + 0.5 + 1 + 0 + 0 + 0.5) / 6,  # 0.5
    "Recall@100": 0.5,  # nothing judged sits between ranks 11 and 100
    "MRR@10": (1 + 1 + 0.5 + 0 + 0 + 1) / 6,  # 0.583333
}


def queries_and_qrels(tmp_path: Path) -> tuple:
    q = write(tmp_path / "queries.parquet", query_id=list(QUERIES), text=list(QUERIES.values()))
    rows = [(qid, doc, grade) for qid, docs in QRELS.items() for doc, grade in docs.items()]
    r = write(
        tmp_path / "qrels.parquet",
        query_id=[x[0] for x in rows],
        doc_id=[x[1] for x in rows],
        score=[x[2] for x in rows],
    )
    return read_queries(q), read_qrels(r)


def test_evaluate_ir_matches_hand_worked_metrics(searcher: Searcher, tmp_path: Path) -> None:
    queries, qrels = queries_and_qrels(tmp_path)
    # The premise of the hand computation: the duplicates tie exactly, above every other document.
    scores, rows = searcher.search_raw(searcher.encode([DUP, doc_text(3)]), SearchParams(k=3))
    assert scores[0, 0] == scores[0, 1] and scores[0, 2] < scores[0, 0]
    assert {searcher.docs.ids[r] for r in rows[0, :2]} == {"dupA", "dupB"}
    assert searcher.docs.ids[rows[1, 0]] == "d03"

    result = evaluate_ir(searcher, queries, qrels)
    assert result.n_queries == 6
    assert sorted(result.per_query) == ["q1", "q2", "q3", "q4", "q5", "q6"]
    assert EXPECTED["nDCG@10"] == pytest.approx(0.419915, abs=1e-6)  # the arithmetic in the comment above
    for name, value in EXPECTED.items():
        # exact ranks and a float64 mean of exact per-query values: only summation round-off remains
        assert result.metrics[name] == pytest.approx(value, rel=1e-12), name
    assert result.per_query["q3"] == pytest.approx(
        {"nDCG@10": 1 / math.log2(3), "Recall@10": 1.0, "Recall@100": 1.0, "MRR@10": 0.5, "MAP@100": 0.5}
    )
    assert result.per_query["q6"]["MAP@100"] == pytest.approx(0.5)  # P@1 = 1 at the one hit, over R = 2


def test_evaluate_ir_reuses_given_query_vectors(searcher: Searcher, tmp_path: Path) -> None:
    queries, qrels = queries_and_qrels(tmp_path)
    raw = searcher.encode(queries.texts)
    encoder = searcher.encoder
    assert isinstance(encoder, FakeEncoder)
    before = encoder.rows
    result = evaluate_ir(searcher, queries, qrels, raw_queries=raw)
    assert encoder.rows == before  # nothing encoded again
    assert result.metrics["MRR@10"] == pytest.approx(EXPECTED["MRR@10"], rel=1e-12)
    shallow = evaluate_ir(searcher, queries, qrels, SearchParams(k=1), raw_queries=raw)
    # depth 1: every query keeps only its own document, so the queries judged on rank 1 alone score as before
    for qid in ("q1", "q2", "q4", "q6"):
        assert shallow.per_query[qid] == result.per_query[qid], qid
    # q3: FAISS picks one of the two exactly tied duplicates for the single slot; either way it is at rank 1
    assert shallow.per_query["q3"]["MRR@10"] in (0.0, 1.0)


# ----- STS ---------------------------------------------------------------------------------------------------
def angle_vectors(cosines: list[float]) -> dict[str, np.ndarray]:
    """An anchor (1, 0) and, for each cosine c, a unit vector at angle arccos(c) from it."""
    vectors = {"anchor": np.array([1.0, 0.0], dtype=np.float32)}
    for c in cosines:
        vectors[f"s{c}"] = np.array([c, math.sqrt(1 - c * c)], dtype=np.float32)
    return vectors


def test_sts_result_wmean_vs_all(tmp_path: Path) -> None:
    cos_a, gold_a = [0.9, 0.7, 0.5, 0.1], [5, 4, 3, 1]  # same order: Spearman 100
    cos_b, gold_b = [0.8, 0.6, 0.3], [1, 2, 0]  # ranks [3,2,1] vs [2,3,1]: Spearman 50
    path = write(
        tmp_path / "sts12.parquet",
        sentence1=["anchor"] * 7,
        sentence2=[f"s{c}" for c in cos_a + cos_b],
        score=[float(g) for g in gold_a + gold_b],
        subset=["A"] * 4 + ["B"] * 3,
    )
    pairs = read_pairs(path)
    vectors = angle_vectors(cos_a + cos_b)
    result = sts_result(vectors, pairs, RawTransform(2))
    # wmean = (4 * 100 + 3 * 50) / 7.
    # all: cosine ranks [7,5,3,1,6,4,2], gold ranks [7,6,5,2.5,2.5,4,1] (two golds of 1 tie);
    # deviations from 4: [3,1,-1,-3,2,0,-2] and [3,2,1,-1.5,-1.5,0,-3] -> 17.5 / sqrt(28 * 27.5).
    hand = {"A": 100.0, "B": 50.0, "wmean": 550 / 7, "all": 100 * 17.5 / math.sqrt(28 * 27.5)}
    assert result == pytest.approx(hand, abs=1e-9)  # ranks are exact; float64 Pearson of small integers
    cosines = np.array(cos_a + cos_b)
    assert result["all"] == pytest.approx(100 * spearman(cosines, gold_a + gold_b), abs=1e-9)
    assert result["B"] == pytest.approx(100 * spearman(cos_b, gold_b), abs=1e-9)


def test_pair_cosines_match_numpy() -> None:
    encoder = FakeEncoder()
    sentences = [f"sentence {i}" for i in range(120)]
    raw = encoder.encode(sentences)
    vectors = dict(zip(sentences, raw, strict=True))
    moments = RunningMoments(encoder.dim)
    moments.update(raw)
    transform = Whitening.fit(moments, dim=10, gamma=0.5)
    rng = np.random.default_rng(7)
    s1 = [sentences[i] for i in rng.integers(0, 120, size=40)]
    s2 = [sentences[i] for i in rng.integers(0, 120, size=40)]
    pairs = Pairs("p", s1, s2, np.zeros(40), ["p"] * 40)

    def reference(names: list[str]) -> np.ndarray:
        x = np.stack([vectors[s] for s in names]).astype(np.float64)
        y = (x - transform.mean) @ transform.kernel
        return y / np.linalg.norm(y, axis=1, keepdims=True)

    expected = np.einsum("ij,ij->i", reference(s1), reference(s2))
    got = pair_cosines(vectors, pairs, transform)
    assert got.dtype == np.float64 and got.shape == (40,)
    # the library transforms in float32 (unit vectors, 10 dims): a few float32 ulps of 1
    np.testing.assert_allclose(got, expected, atol=1e-6)
    raw_cos = pair_cosines(vectors, pairs, RawTransform(encoder.dim))
    a = np.stack([vectors[s] for s in s1]).astype(np.float64)
    b = np.stack([vectors[s] for s in s2]).astype(np.float64)
    np.testing.assert_allclose(
        raw_cos, (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1), atol=1e-6
    )


def test_evaluate_sts_fits_on_every_sentence_and_scores_raw_and_transformed() -> None:
    """A target fit sees the sentences of the fit sets too; "raw" is the untransformed cosine, "transformed" the
    fitted whitening's: both as ``sts_result`` gives them on a transform fitted by hand from the same vectors."""
    gold = np.arange(30, dtype=np.float64)
    scored = Pairs("a", [f"a{i}" for i in range(30)], [f"b{i}" for i in range(30)], gold, ["a"] * 30)
    extra = Pairs("x", [f"x{i}" for i in range(30)], [f"y{i}" for i in range(30)], gold, ["x"] * 30)
    report = evaluate_sts([scored], FakeEncoder(), TransformSpec(dim=4), fit_sets=[extra])
    sentences = scored.sentences() + extra.sentences()
    vectors = dict(zip(sentences, FakeEncoder().encode(sentences), strict=True))
    moments = RunningMoments(16)
    moments.update(np.stack([vectors[s] for s in sentences]))
    fitted = TransformSpec(dim=4).fit(moments)
    assert report.fit == "target (120 sentences of a, x)"
    [result] = report.results
    assert result["transformed"] == pytest.approx(sts_result(vectors, scored, fitted), abs=1e-9)
    assert result["raw"] == pytest.approx(sts_result(vectors, scored, RawTransform(16)), abs=1e-9)
    assert result["raw"]["a"] != pytest.approx(result["transformed"]["a"], abs=1e-3)
