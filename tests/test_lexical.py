"""The lexical part: streaming term counts merged exactly, the BM25 matrix against bm25s's own index, the saved
index searched and filtered, and an index's lexical part kept in sync by add, remove and refit."""

from __future__ import annotations

import json
from pathlib import Path

import bm25s
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import Stemmer
from conftest import FakeEncoder, write_corpus

from retrieval import files, update
from retrieval.build import BuildOptions, build_index
from retrieval.corpus import CorpusSpec
from retrieval.errors import ConfigError
from retrieval.indexdir import LEXICAL, IndexDir, checksum, load
from retrieval.lexical import (
    Analyzer,
    LexicalIndex,
    LexicalSpec,
    TermCounts,
    TermStats,
    bm25_matrix,
    save,
    take_rows,
    top_positive,
)
from retrieval.whitening import TransformSpec

WORDS = (
    "protein cell cells gene genes mutation mutations cancer tumour study studies running runs ran the of and a".split()
)


def texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    out = [" ".join(rng.choice(WORDS, size=rng.integers(1, 30))) for _ in range(n)]
    out[3] = "Gene-42 and BRCA1: the GENES!"  # case, punctuation, digits
    out[5] = "the and of"  # no term left: still counts in N and in the average length
    return out


def dense(data: np.ndarray, indices: np.ndarray, indptr: np.ndarray, docs: int) -> np.ndarray:
    """A CSC-by-term matrix as a dense (docs, terms) float64 array."""
    out = np.zeros((docs, len(indptr) - 1))
    for term in range(len(indptr) - 1):
        out[indices[indptr[term] : indptr[term + 1]], term] = data[indptr[term] : indptr[term + 1]]
    return out


def reference(corpus: list[str]) -> tuple[np.ndarray, dict[str, int]]:
    """bm25s's own index of the whole corpus at once: the one-shot reference."""
    retriever = bm25s.BM25()
    tokens = bm25s.tokenize(corpus, stopwords="en", stemmer=Stemmer.Stemmer("english"), show_progress=False)
    retriever.index(tokens, show_progress=False)
    s = retriever.scores
    return dense(s["data"], s["indices"], s["indptr"], len(corpus)), retriever.vocab_dict


@pytest.mark.parametrize("window", [1, 7, 61])
def test_windows_merged_give_bm25s_one_shot_index(window: int) -> None:
    corpus = texts(61)
    analyzer = Analyzer(LexicalSpec())
    stats = TermStats()
    for start in range(0, len(corpus), window):
        stats.add(TermCounts.of(corpus[start : start + window], analyzer))
    counts = stats.counts()
    assert counts.docs == len(corpus)
    ours = dense(*bm25_matrix(counts, LexicalSpec()), counts.docs)
    theirs, vocab = reference(corpus)
    assert sorted(counts.terms) == sorted(t for t in vocab if t)  # bm25s adds an empty token of its own
    # float32 scores on both sides (ours computed in float64, then rounded): 1e-6 relative
    np.testing.assert_allclose(ours, theirs[:, [vocab[t] for t in counts.terms]], rtol=1e-6, atol=1e-7)
    one_shot = TermCounts.of(corpus, analyzer)  # the counts themselves are integers: exactly equal
    order = np.argsort(one_shot.terms)
    assert [one_shot.terms[i] for i in order] == sorted(counts.terms)


def test_saved_index_searches_like_bm25s_and_obeys_a_mask(tmp_path: Path) -> None:
    corpus = texts(80, seed=1)
    stats = TermStats()
    stats.add(TermCounts.of(corpus, Analyzer(LexicalSpec())))
    save(tmp_path / "lex", stats.counts(), LexicalSpec())
    index = LexicalIndex(tmp_path / "lex", LexicalSpec())
    queries = ["mutations in cancer genes", "running study", "zebra", "the of and"]
    scores, rows = index.search(queries, k=5)
    retriever = bm25s.BM25()
    retriever.index(
        bm25s.tokenize(corpus, stopwords="en", stemmer=Stemmer.Stemmer("english"), show_progress=False),
        show_progress=False,
    )
    for q, query in enumerate(queries[:2]):
        tokens = bm25s.tokenize([query], stopwords="en", stemmer=Stemmer.Stemmer("english"), show_progress=False)
        want, want_scores = retriever.retrieve(tokens, k=5, show_progress=False)
        np.testing.assert_allclose(scores[q], want_scores[0], rtol=1e-5)
        assert set(rows[q]) == set(want[0])  # ties may come in another order
    # no term known, or only stop words: nothing found (not 5 arbitrary zero-score rows)
    assert (rows[2:] == -1).all() and np.isneginf(scores[2:]).all()
    mask = np.zeros(80, dtype=bool)
    mask[::3] = True
    masked_scores, masked_rows = index.search(queries[:1], k=80, mask=mask)
    found = masked_rows[0][masked_rows[0] >= 0]
    assert len(found) and all(mask[found])
    full_scores, full_rows = index.search(queries[:1], k=80)
    expected = [r for r in full_rows[0] if r >= 0 and mask[r]]
    assert sorted(found) == sorted(expected)


def test_top_positive_is_a_full_sort_of_the_positive_scores() -> None:
    """The k best positive scores, best first, ties lower row first: against a stable full sort, on scores that
    are mostly zero (as a query's BM25 scores are) and rich in ties at the k-th place."""
    rng = np.random.default_rng(3)
    for n, k, positive in [(1000, 10, 0.05), (1000, 50, 0.05), (200, 10, 0.02), (5000, 100, 0.5), (30, 10, 1.0)]:
        scores = np.zeros(n, dtype=np.float32)
        hit = rng.random(n) < positive
        scores[hit] = rng.integers(1, 6, hit.sum()).astype(np.float32) / 4  # five values: ties everywhere
        rows, values = top_positive(scores, k)
        order = np.lexsort((np.arange(n), -scores))  # score descending, then row ascending
        want = [r for r in order if scores[r] > 0][:k]
        assert rows.tolist() == want
        np.testing.assert_array_equal(values, scores[want])
        assert values.dtype == np.float32
    none, empty = top_positive(np.zeros(10, dtype=np.float32), 3)
    assert len(none) == len(empty) == 0


def test_take_rows_keeps_the_counts_of_the_rows_kept() -> None:
    counts = TermCounts.of(texts(20), Analyzer(LexicalSpec()))
    keep = np.array([0, 2, 3, 9, 19])
    kept = take_rows(counts, keep)
    again = TermCounts.of([texts(20)[i] for i in keep], Analyzer(LexicalSpec()))
    for row in range(len(keep)):
        mine = {kept.terms[t]: c for t, c in zip(*_doc(kept, row), strict=True)}
        theirs = {again.terms[t]: c for t, c in zip(*_doc(again, row), strict=True)}
        assert mine == theirs


def _doc(counts: TermCounts, row: int) -> tuple[list[int], list[int]]:
    span = slice(counts.indptr[row], counts.indptr[row + 1])
    return counts.term_ids[span].tolist(), counts.counts[span].tolist()


def test_spec_is_checked() -> None:
    with pytest.raises(ConfigError, match="stemmer"):
        LexicalSpec(stemmer="klingon").check()
    with pytest.raises(ConfigError, match="`b`"):
        LexicalSpec(b=1.5).check()


# ----- inside an index directory -----------------------------------------------------------------------------
def lexical_matrix(path: Path) -> tuple[np.ndarray, list[str]]:
    """The saved BM25 matrix as dense (docs, terms), columns sorted by term, dropping terms no row holds."""
    counts = IndexDir(path).term_counts()
    matrix = dense(*bm25_matrix(counts, LexicalSpec()), counts.docs)
    used = np.flatnonzero(np.bincount(counts.term_ids, minlength=len(counts.terms)))
    order = sorted(used, key=lambda t: counts.terms[t])
    return matrix[:, order], [counts.terms[t] for t in order]


def corpus_of(path: Path, rows: list[str], start: int = 0) -> Path:
    ids = [f"d{start + i}" for i in range(len(rows))]
    pq.write_table(pa.table({"id": ids, "text": rows}), path)
    return path


def test_index_keeps_its_lexical_part_in_sync(tmp_path: Path) -> None:
    corpus = texts(90, seed=2)
    spec = TransformSpec(dim=8)
    build_index(CorpusSpec(corpus_of(tmp_path / "a.parquet", corpus[:60])), FakeEncoder(), tmp_path / "idx", spec)
    manifest = IndexDir(tmp_path / "idx").manifest()
    assert manifest.lexical is not None and manifest.lexical.spec == LexicalSpec()
    assert manifest.lexical.terms > 0 and manifest.lexical.bytes > 0
    assert any(name.startswith(f"{LEXICAL}/") for name in manifest.files)

    update.add(tmp_path / "idx", CorpusSpec(corpus_of(tmp_path / "b.parquet", corpus[60:], 60)), FakeEncoder())
    build_index(CorpusSpec(corpus_of(tmp_path / "all.parquet", corpus)), FakeEncoder(), tmp_path / "fresh", spec)
    grown, terms = lexical_matrix(tmp_path / "idx")
    fresh, fresh_terms = lexical_matrix(tmp_path / "fresh")
    assert terms == fresh_terms
    np.testing.assert_allclose(grown, fresh, rtol=1e-6)  # the same float32 matrix, derived from the same counts

    drop = [f"d{i}" for i in range(0, 90, 4)]
    update.remove(tmp_path / "idx", drop)
    kept = [t for i, t in enumerate(corpus) if i % 4]
    build_index(CorpusSpec(corpus_of(tmp_path / "kept.parquet", kept)), FakeEncoder(), tmp_path / "fresh2", spec)
    shrunk, terms = lexical_matrix(tmp_path / "idx")
    fresh, fresh_terms = lexical_matrix(tmp_path / "fresh2")
    assert terms == fresh_terms
    np.testing.assert_allclose(shrunk, fresh, rtol=1e-6)

    before = {n: r["sha256"] for n, r in IndexDir(tmp_path / "idx").manifest().files.items() if n.startswith(LEXICAL)}
    update.refit(tmp_path / "idx", TransformSpec(dim=6))
    after = IndexDir(tmp_path / "idx").manifest()
    assert {n: r["sha256"] for n, r in after.files.items() if n.startswith(LEXICAL)} == before
    assert load(tmp_path / "idx").lexical is not None


def test_no_lexical_builds_a_dense_only_index(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.parquet", n=50)
    options = BuildOptions(lexical=None)
    manifest = build_index(CorpusSpec(corpus), FakeEncoder(), tmp_path / "idx", TransformSpec(dim=8), options=options)
    assert manifest.lexical is None and not (tmp_path / "idx" / LEXICAL).exists()
    assert load(tmp_path / "idx").lexical is None


def test_a_schema_2_index_without_a_lexical_part_still_loads(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.parquet", n=50)
    options = BuildOptions(lexical=None)
    build_index(CorpusSpec(corpus), FakeEncoder(), tmp_path / "idx", TransformSpec(dim=8), options=options)
    path = tmp_path / "idx" / "manifest.json"
    data = json.loads(path.read_text())
    data["schema_version"] = 2
    data["transform"]["k"] = data["transform"].pop("dim")  # as version 2 named it
    for key in ("lexical", "fusion", "columns"):
        data.pop(key, None)
    data.pop("checksum")
    data["checksum"] = checksum(data)
    files.write_atomic(path, json.dumps(data).encode())
    loaded = load(tmp_path / "idx")
    assert loaded.manifest.schema_version == 2 and loaded.lexical is None


def test_info_shows_the_lexical_part_and_the_kept_columns(tmp_path: Path) -> None:
    from retrieval.info import describe_index

    corpus = write_corpus(tmp_path / "c.parquet", n=50, year=list(range(50)))
    build_index(CorpusSpec(corpus, columns=("year",)), FakeEncoder(), tmp_path / "idx", TransformSpec(dim=8))
    summary = describe_index(tmp_path / "idx")["summary"]
    assert summary["lexical"].startswith("BM25 k1 1.5 b 0.75") and "convex, dense weight 0.4" in summary["lexical"]
    assert summary["columns"] == "year (int64)" and "lexical " in summary["size on disk"]
    options = BuildOptions(lexical=None)
    build_index(CorpusSpec(corpus), FakeEncoder(), tmp_path / "dense", TransformSpec(dim=8), options=options)
    assert describe_index(tmp_path / "dense")["summary"]["lexical"] == "none (dense search only)"
