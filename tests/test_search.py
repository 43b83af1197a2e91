"""Searching a built index: typed hits, k edge cases, refusing the wrong encoder or a damaged index,
re-scoring by raw cosine, and the single-query flat fast path against FAISS's own search."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import re
import shutil
from pathlib import Path

import faiss
import numpy as np
import pytest
from conftest import FakeEncoder, mapped_rss_kib, write_corpus

from retrieval import update
from retrieval.build import build_index
from retrieval.cli import home
from retrieval.corpus import CorpusSpec
from retrieval.errors import ConfigError, IndexDirError
from retrieval.index import IndexSpec, flat_vectors, load_index, search_parameters
from retrieval.indexdir import IndexDir
from retrieval.manifest import SCHEMA_VERSION
from retrieval.search import Hit, Searcher, SearchParams
from retrieval.whitening import TransformSpec, l2_normalize

# float32 inner products of unit vectors summed in different orders (BLAS vs FAISS kernels).
SCORE_ATOL = 1e-5


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One index over 300 fake documents, reduced to 4 of 16 dims (so re-scoring has something to fix).
    Module-scoped: tests that damage an index copy it first."""
    root = tmp_path_factory.mktemp("search")
    corpus = write_corpus(root / "corpus.parquet")
    build_index(CorpusSpec(corpus), FakeEncoder(), root / "idx", TransformSpec(dim=4))
    return root / "idx"


@pytest.fixture
def searcher(index_dir: Path) -> Searcher:
    return Searcher.load(index_dir, encoder=FakeEncoder())


@pytest.fixture
def damaged(index_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the index to break."""
    return Path(shutil.copytree(index_dir, tmp_path / "copy"))


def queries(n: int = 5) -> np.ndarray:
    return FakeEncoder().encode([f"a query about topic {i}" for i in range(n)])


# ----- hits ------------------------------------------------------------------------------------------------
def test_hits_are_typed_ranked_and_json_able(searcher: Searcher) -> None:
    hits = searcher.search("document number 12 about topic 5", SearchParams(k=5))
    assert [h.rank for h in hits] == [1, 2, 3, 4, 5]
    assert all(isinstance(h, Hit) for h in hits)
    first = hits[0]
    assert (first.id, first.row, first.text) == ("doc12", 12, "document number 12 about topic 5")
    assert isinstance(first.score, float) and first.score == pytest.approx(1.0, abs=SCORE_ATOL)
    scores = [h.score for h in hits]
    assert scores == sorted(scores, reverse=True)
    assert all(searcher.docs.ids[h.row] == h.id for h in hits)
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.score = 0.0  # type: ignore[misc]
    decoded = json.loads(json.dumps([dataclasses.asdict(h) for h in hits]))
    assert decoded[0] == {"rank": 1, "id": "doc12", "score": first.score, "text": first.text, "row": 12, "title": None}


def test_k_larger_than_n_returns_every_document(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.parquet", n=6)
    build_index(CorpusSpec(corpus), FakeEncoder(), tmp_path / "idx", TransformSpec(dim=3))
    searcher = Searcher.load(tmp_path / "idx", encoder=FakeEncoder())
    hits = searcher.search("anything", SearchParams(k=50))
    assert sorted(h.id for h in hits) == [f"doc{i}" for i in range(6)]
    assert [h.rank for h in hits] == list(range(1, 7))
    batch = searcher.search_batch(["one", "two"], SearchParams(k=50))  # the FAISS path (nq = 2) too
    assert [len(b) for b in batch] == [6, 6]


@pytest.mark.parametrize("spec", [IndexSpec("ivf", nlist=16, nprobe=1), IndexSpec("hnsw", m=4, ef_search=8)])
def test_an_approximate_index_holding_k_documents_returns_k(tmp_path: Path, spec: IndexSpec) -> None:
    """Probed lists holding fewer than k rows (nprobe 1 of 16 lists, more so once `remove` thinned them) or a
    narrow beam returned fewer hits than asked: 400 rows, k = 50 gave 30 of them on average. Those queries are
    searched again with the knob doubled until they fill; what they find is at least as good as the first try."""
    rng = np.random.default_rng(0)
    vectors = (rng.standard_normal((400, 16)) * np.linspace(3, 0.2, 16)).astype(np.float32)
    np.save(tmp_path / "a.npy", vectors)
    build_index(CorpusSpec(tmp_path / "a.npy"), None, tmp_path / "idx", TransformSpec(dim=8), index=spec)
    searcher = Searcher.load(tmp_path / "idx")
    for k in (10, 50, 399):
        scores, rows = searcher.search_raw(vectors[:40], SearchParams(k=k, rescore=0))
        assert (rows >= 0).all() and all(len(set(r)) == k for r in rows), k
        assert (np.diff(scores, axis=1) <= 0).all()
    exact = faiss.IndexFlatIP(8)
    exact.add(searcher.transform.transform(vectors))
    queries = searcher.transform.transform(vectors[:40])
    _, truth = exact.search(queries, 50)
    knobs = search_parameters(searcher.index, **searcher.manifest.index.search)
    _, first = searcher.index.search(queries, 50, params=knobs)
    _, rows = searcher.search_raw(vectors[:40], SearchParams(k=50, rescore=0))
    assert (first < 0).any(axis=1).mean() > 0.5  # the index's knobs alone fall short for most queries

    def recall(found: np.ndarray) -> float:
        return float(np.mean([len(set(r) & set(t)) / 50 for r, t in zip(found, truth, strict=True)]))

    assert recall(rows) >= recall(first)

    update.remove(tmp_path / "idx", [str(i) for i in range(400) if i % 10])  # 40 rows left in 16 lists
    searcher = Searcher.load(tmp_path / "idx")
    assert [len(hits) for hits in searcher.search_vectors(vectors[:40], SearchParams(k=39, rescore=0))] == [39] * 40


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SearchParams(k=0), "`k` must be an integer between 1 and 10,000 (got 0)"),
        (SearchParams(k=-3), "`k` must be an integer between 1 and 10,000 (got -3)"),
        (SearchParams(k=10**9), "`k` must be an integer between 1 and 10,000"),
        (SearchParams(rescore=-5), "`rescore` must be an integer between 0 and 10,000 (got -5)"),
        (SearchParams(ef_search=0), "`ef_search` must be an integer between 1"),
        (SearchParams(nprobe=-3), "`nprobe` must be an integer between 1"),
        # bool is an int subclass: True would otherwise be read as k=1 / ef_search=1
        (SearchParams(k=True), "`k` must be an integer between 1 and 10,000 (got True)"),
        (SearchParams(rescore=False), "`rescore` must be an integer between 0 and 10,000 (got False)"),
        (SearchParams(ef_search=True), "`ef_search` must be an integer between 1"),
        (SearchParams(nprobe=True), "`nprobe` must be an integer between 1"),
        (SearchParams(ef_search=2.5), "`ef_search` must be an integer between 1"),  # type: ignore[arg-type]
        (SearchParams(nprobe=1.5), "`nprobe` must be an integer between 1"),  # type: ignore[arg-type]
        (SearchParams(ef_search=(1 << 20) + 1), "`ef_search` must be an integer between 1"),
        (SearchParams(nprobe=(1 << 20) + 1), "`nprobe` must be an integer between 1"),
    ],
)
def test_bad_search_params_are_refused(searcher: Searcher, params: SearchParams, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        searcher.search("query", params)
    assert str(info.value).startswith(message) and info.value.param in message


def test_query_vectors_of_the_wrong_width_are_refused(searcher: Searcher) -> None:
    with pytest.raises(ConfigError, match="query vectors have 8 dims; this index takes 16"):
        searcher.search_vectors(np.zeros((1, 8), dtype=np.float32))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_query_vectors_with_nan_or_inf_are_refused(searcher: Searcher, bad: float) -> None:
    raw = queries(2)
    raw[1, 3] = bad  # one bad value in the second query of a batch
    with pytest.raises(ConfigError, match="query vectors contain NaN or inf"):
        searcher.search_vectors(raw)


@pytest.mark.parametrize(
    ("texts", "message"),
    [
        (["topic 3", "   \t\n"], "`query` is empty (only whitespace or invisible characters)"),
        (["topic 3", ""], "`query` is empty (only whitespace or invisible characters)"),
        (["topic 3", "\u200b\ufeff\x00"], "`query` is empty (only whitespace or invisible characters)"),
        (["topic 3", "bad \ud800 byte"], "`query` 1 holds a lone surrogate"),
        (["topic 3", 42], "`query` 1 is int, not text"),
    ],
)
def test_queries_that_are_not_searchable_text_are_refused_before_encoding(
    index_dir: Path, texts: list, message: str
) -> None:
    encoder = FakeEncoder()
    searcher = Searcher.load(index_dir, encoder=encoder)
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        searcher.search_batch(texts, SearchParams(k=3))
    assert info.value.param == "query" and encoder.calls == 0  # refused whole, before any encoding


def test_search_batch_equals_single_searches(searcher: Searcher) -> None:
    texts = ["document number 3 about topic 3", "topic 5", "whatever else"]
    batch = searcher.search_batch(texts, SearchParams(k=4))
    for text, hits in zip(texts, batch, strict=True):
        single = searcher.search(text, SearchParams(k=4))
        assert [h.id for h in hits] == [h.id for h in single]
        np.testing.assert_allclose([h.score for h in hits], [h.score for h in single], atol=SCORE_ATOL)


# ----- the wrong encoder -----------------------------------------------------------------------------------
def test_an_index_built_by_another_model_is_refused(index_dir: Path) -> None:
    with pytest.raises(ConfigError) as info:
        Searcher.load(index_dir, encoder=FakeEncoder(name="other-model"))
    message = str(info.value)
    assert "built with model 'fake'" in message and "'other-model'" in message
    assert "\n" not in message


def test_an_index_built_with_another_pooling_is_refused(index_dir: Path) -> None:
    with pytest.raises(ConfigError, match="built with pooling 'mean' but the query encoder uses 'cls'"):
        Searcher.load(index_dir, encoder=FakeEncoder(pooling="cls"))


def test_an_index_from_a_python_encoder_needs_one_to_search_text(index_dir: Path) -> None:
    searcher = Searcher.load(index_dir)  # only transformers encoders can be rebuilt from a manifest
    assert searcher.encoder is None
    with pytest.raises(ConfigError, match="no encoder for text queries; search it with query vectors"):
        searcher.search("text")
    assert searcher.search_vectors(FakeEncoder().encode(["document number 1 about topic 1"]))[0][0].id == "doc1"


# ----- damaged or missing indexes --------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["index.faiss", "transform.npz", "docs.arrow"])
def test_a_flipped_byte_is_a_checksum_error(damaged: Path, name: str) -> None:
    path = damaged / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(IndexDirError, match=rf"{name} is corrupt or truncated \(checksum mismatch\)"):
        Searcher.load(damaged, encoder=FakeEncoder())


@pytest.mark.parametrize("name", ["index.faiss", "transform.npz"])
def test_a_truncated_file_is_refused(damaged: Path, name: str) -> None:
    path = damaged / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(IndexDirError, match="checksum mismatch"):
        Searcher.load(damaged, encoder=FakeEncoder())
    # without the checksum check, the readers still refuse it with an IndexDirError, not a crash
    with pytest.raises(IndexDirError, match="corrupt|cannot read"):
        Searcher.load(damaged, encoder=FakeEncoder(), verify=False)


def test_a_missing_file_is_refused(damaged: Path) -> None:
    (damaged / "docs.arrow").unlink()
    with pytest.raises(IndexDirError, match="docs.arrow is missing"):
        Searcher.load(damaged, encoder=FakeEncoder())


def test_a_missing_manifest_is_refused(damaged: Path) -> None:
    (damaged / "manifest.json").unlink()
    with pytest.raises(IndexDirError, match="has no manifest.json: it is not a complete index"):
        Searcher.load(damaged, encoder=FakeEncoder())


def test_a_garbled_manifest_is_refused(damaged: Path) -> None:
    (damaged / "manifest.json").write_text('{"schema_version": 1, ')
    with pytest.raises(IndexDirError, match="not valid JSON"):
        Searcher.load(damaged, encoder=FakeEncoder())


def test_another_schema_version_is_refused(damaged: Path) -> None:
    data = json.loads((damaged / "manifest.json").read_text())
    data["schema_version"] = 1  # older: rebuilt by this version
    (damaged / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(
        IndexDirError, match="schema version 1; this retrieval reads versions 2 to 5: rebuild the index"
    ):
        Searcher.load(damaged, encoder=FakeEncoder())


def test_a_newer_schema_version_asks_for_a_newer_retrieval_not_a_rebuild(damaged: Path) -> None:
    """A manifest from a newer retrieval was met with "rebuild the index with this version": a downgrade of
    the index. It names both versions and asks for an upgrade."""
    import retrieval

    data = json.loads((damaged / "manifest.json").read_text())
    data["schema_version"] = SCHEMA_VERSION + 1
    data["versions"]["retrieval"] = "9.0.0"
    (damaged / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(IndexDirError) as raised:
        Searcher.load(damaged, encoder=FakeEncoder())
    message = str(raised.value)
    assert f"schema version {SCHEMA_VERSION + 1}, written by retrieval 9.0.0" in message
    assert f"this retrieval ({retrieval.__version__}) reads version {SCHEMA_VERSION}" in message
    assert message.endswith("upgrade retrieval to read it") and "rebuild" not in message


def test_an_index_that_does_not_match_its_manifest_is_refused(damaged: Path) -> None:
    other = faiss.IndexFlatIP(4)
    other.add(np.eye(4, dtype=np.float32))
    faiss.write_index(other, str(damaged / "index.faiss"))
    with pytest.raises(IndexDirError, match="does not match its manifest"):
        Searcher.load(damaged, encoder=FakeEncoder(), verify=False)


def test_a_missing_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(IndexDirError, match="no index directory at .*retrieval index CORPUS"):
        Searcher.load(tmp_path / "nothing-here")


def test_no_index_built_yet(isolated_home: Path) -> None:
    with pytest.raises(IndexDirError, match="no index has been built yet.*retrieval index CORPUS.parquet"):
        home.default_index()
    isolated_home.mkdir(parents=True)  # an empty root is no better
    with pytest.raises(IndexDirError, match="no index has been built yet"):
        home.default_index()
    isolated_home.rmdir()
    isolated_home.write_text("")  # it said "no index has been built yet (nothing recorded in <file>/.last-built)"
    with pytest.raises(
        IndexDirError, match=r"the index root .*indexes is a file: set RETRIEVAL_INDEX_ROOT to a folder"
    ):
        home.default_index()


def test_a_vectors_index_asked_for_text_says_what_it_takes(tmp_path: Path) -> None:
    """It named a Python call (`search_vectors()`) to a command-line user."""
    np.save(tmp_path / "v.npy", np.random.default_rng(0).standard_normal((20, 4)).astype(np.float32))
    build_index(CorpusSpec(tmp_path / "v.npy"), None, tmp_path / "idx", TransformSpec())
    with pytest.raises(ConfigError, match="no encoder for text queries; search it with query vectors") as info:
        Searcher.load(tmp_path / "idx").search("text")
    assert "search_vectors()" not in str(info.value)


def test_the_last_built_index_is_remembered(isolated_home: Path, index_dir: Path) -> None:
    home.remember(index_dir)
    assert home.default_index() == index_dir.resolve()
    assert home.default_out(Path("/data/scifact.parquet")) == isolated_home / "scifact"
    assert home.default_out(Path("/data/part-*.parquet")) == isolated_home / "data"


def test_a_corpus_named_dot_or_dot_dot_gets_its_folders_name(
    isolated_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "shelf" / "books").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "shelf" / "books")
    assert home.default_out(Path(".")) == isolated_home / "books"
    assert home.default_out(Path("..")) == isolated_home / "shelf"  # not indexes/.., the index root's parent


# ----- re-scoring and the flat fast path -------------------------------------------------------------------
def test_rescore_returns_the_exact_raw_cosine_top_k_among_the_candidates(searcher: Searcher, index_dir: Path) -> None:
    raw = queries(4)
    k, depth = 5, 50
    _, candidates = searcher.search_raw(raw, SearchParams(k=depth, rescore=0))
    scores, rows = searcher.search_raw(raw, SearchParams(k=k, rescore=depth))
    assert scores.shape == rows.shape == (4, k)
    stash = IndexDir(index_dir).stash()
    for q in range(4):
        cosines = l2_normalize(stash.read_rows(candidates[q])) @ l2_normalize(raw[q : q + 1])[0]
        best = np.argsort(-cosines, kind="stable")[:k]
        assert rows[q].tolist() == candidates[q][best].tolist()
        # float32 cosines, the same maths in the same order: agreement to float32 rounding
        np.testing.assert_allclose(scores[q], cosines[best], atol=SCORE_ATOL)
    # re-scoring changes the order: the 4-dim whitened ranking is not the 16-dim raw one
    assert not np.array_equal(rows, candidates[:, :k])


def test_rescore_keeps_missing_candidates_last(searcher: Searcher, index_dir: Path) -> None:
    """An ANN index can return fewer candidates than asked (-1 rows): re-scoring ranks the found ones by exact
    cosine, and the missing stay -1 with score -inf, after them, whatever their place among the candidates."""
    raw = queries(3)
    candidates = np.array([[5, -1, 2, 9, -1], [-1, -1, -1, -1, -1], [7, 3, 1, 0, 4]])
    scores, rows = searcher._rescore(raw, candidates, 4)
    stash = IndexDir(index_dir).stash()
    for q, expected_found in enumerate((3, 0, 4)):
        found = candidates[q][candidates[q] >= 0]
        cosines = l2_normalize(stash.read_rows(found)) @ l2_normalize(raw[q : q + 1])[0]
        best = np.argsort(-cosines, kind="stable")[:4]
        assert rows[q, :expected_found].tolist() == found[best].tolist()
        np.testing.assert_allclose(scores[q, :expected_found], cosines[best], atol=SCORE_ATOL)
        assert (rows[q, expected_found:] == -1).all() and np.isneginf(scores[q, expected_found:]).all()


def test_rescore_over_every_document_is_the_exact_raw_top_k(searcher: Searcher, index_dir: Path) -> None:
    raw = queries(2)
    scores, rows = searcher.search_raw(raw, SearchParams(k=3, rescore=10_000))
    everything = l2_normalize(np.concatenate(list(IndexDir(index_dir).stash().iter_blocks())))
    exact = l2_normalize(raw) @ everything.T
    for q in range(2):
        assert rows[q].tolist() == np.argsort(-exact[q], kind="stable")[:3].tolist()


def test_the_single_query_fast_path_agrees_with_faiss(searcher: Searcher) -> None:
    assert searcher._scan is not None  # the sliced scan is really taken for a few queries
    vectors = searcher.transform.transform(queries(20))
    for k in (1, 10, 300):
        for q in vectors:
            fast_scores, fast_rows = searcher.search_transformed(q[None, :], k)
            faiss_scores, faiss_rows = searcher.index.search(q[None, :], k)
            np.testing.assert_allclose(fast_scores, faiss_scores, atol=SCORE_ATOL)
            # the same ids barring ties: where ids differ, their scores must be equal within tolerance
            differ = fast_rows[0] != faiss_rows[0]
            np.testing.assert_allclose(fast_scores[0][differ], faiss_scores[0][differ], atol=SCORE_ATOL)
            assert differ.mean() < 0.05
        batch_scores, _ = searcher.search_transformed(vectors, k)  # nq >= 20 goes to FAISS's BLAS path
        assert batch_scores.shape == (20, k)


def test_flat_vectors_outlive_the_index_object(index_dir: Path) -> None:
    index = load_index(index_dir / "index.faiss")
    expected = index.reconstruct_n(0, index.ntotal)
    view = flat_vectors(index)
    del index
    gc.collect()
    # the view must keep the FAISS index alive, not point into freed memory
    np.testing.assert_array_equal(view, expected)
    assert not view.flags.writeable  # a searcher maps its index read-only: a write would be a crash, not an error
    assert flat_vectors(faiss.IndexHNSWFlat(4, 8, faiss.METRIC_INNER_PRODUCT)) is None


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="reads /proc/self/smaps")
def test_warm_up_makes_docs_and_stash_resident_within_its_budget(tmp_path: Path, monkeypatch) -> None:
    """A served index starts at the memory it keeps: warm-up reads every page of the docs and (when the index
    re-scores) the stash, which requests would otherwise bring in a few rows at a time (the serve benchmark's RSS
    grew 30% in its first minute that way); not when they would take more than a share of the free memory.
    (Files this small come in whole at a few touches, the kernel mapping large folios around each fault, so the
    test checks what warm-up read and that the maps are resident, not a cold contrast.)"""
    import retrieval.search

    corpus = write_corpus(tmp_path / "corpus.parquet", n=3000)
    build_index(CorpusSpec(corpus), FakeEncoder(), tmp_path / "idx", TransformSpec(dim=4))
    parts = [p.resolve() for p in IndexDir(tmp_path / "idx").stash().files() if p.suffix == ".npy"]
    docs = (tmp_path / "idx" / "docs.arrow").resolve()
    stash_bytes = sum(p.stat().st_size for p in parts)

    searcher = Searcher.load(tmp_path / "idx", encoder=FakeEncoder())
    assert searcher.manifest.rescoring.depth > 0
    touched = searcher.warm_up()
    assert touched >= 0.95 * (stash_bytes + docs.stat().st_size)  # npy headers and Arrow metadata aside
    assert sum(mapped_rss_kib(p) for p in parts) >= stash_bytes // 1024 - 8
    assert mapped_rss_kib(docs) >= searcher.docs.nbytes // 1024 - 8
    assert Searcher.load(tmp_path / "idx", encoder=FakeEncoder()).warm_up(prefault=False) == 0
    encoder = FakeEncoder()
    Searcher.load(tmp_path / "idx", encoder=encoder).warm_up(prefault=False)
    assert (encoder.calls, encoder.rows) == (1, 1)  # ... and runs one search, so no user pays the first one

    monkeypatch.setattr(retrieval.search, "available_memory", lambda: 1 << 20)  # 1 MiB free: over the share
    assert Searcher.load(tmp_path / "idx", encoder=FakeEncoder()).warm_up() == 0


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise")
def test_warm_up_of_a_pread_reader_asks_the_stash_into_the_page_cache_not_the_process(
    tmp_path: Path, monkeypatch
) -> None:
    """A stash read by pread stays out of the process (that is the point of pread), but its first reads went to
    the disk: warm-up asks the kernel to read every part into the page cache (POSIX_FADV_WILLNEED on the whole of
    each part's rows), and the process's resident memory does not grow by it; not over the memory share."""
    import retrieval.search

    corpus = write_corpus(tmp_path / "corpus.parquet", n=3000)
    build_index(CorpusSpec(corpus), FakeEncoder(), tmp_path / "idx", TransformSpec(dim=4))
    searcher = Searcher.load(tmp_path / "idx", encoder=FakeEncoder(), stash_reads="pread")
    stash = searcher.stash()
    pooling = searcher.manifest.transform.pooling
    parts = [stash.root / part.vectors[pooling] for part in stash.parts]
    advised: list[tuple[int, int, int, int]] = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda *args: (advised.append(args), real(*args))[1])
    searcher.warm_up()
    assert {advice for *_, advice in advised} == {os.POSIX_FADV_WILLNEED}
    assert len({fd for fd, *_ in advised}) == len(parts)  # each part once
    sizes = sorted(length for _, _, length, _ in advised)
    assert sizes == sorted(part.rows * stash.dim * 4 for part in stash.parts)  # every row, float32
    for (_, offset, length, _), path in zip(advised, parts, strict=True):
        assert offset + length == path.stat().st_size  # the rows run to the file's end, after the npy header
    if Path("/proc/self/smaps").is_file():
        assert sum(mapped_rss_kib(p.resolve()) for p in parts) == 0  # nothing of it in the process
    advised.clear()
    monkeypatch.setattr(retrieval.search, "available_memory", lambda: 1 << 10)  # over the share: left alone
    Searcher.load(tmp_path / "idx", encoder=FakeEncoder(), stash_reads="pread").warm_up()
    assert advised == []


def test_warm_up_leaves_the_stash_alone_when_the_index_does_not_rescore(tmp_path: Path) -> None:
    """An index at full dimension keeps its stash (for refit and add) but never re-scores from it: warm-up makes
    only its docs resident, not the stash that no request reads."""
    corpus = write_corpus(tmp_path / "corpus.parquet", n=3000)
    build_index(CorpusSpec(corpus), FakeEncoder(), tmp_path / "idx", TransformSpec())
    searcher = Searcher.load(tmp_path / "idx", encoder=FakeEncoder())
    assert searcher.manifest.rescoring.depth == 0 and searcher.manifest.stash is not None
    stash_bytes = sum(p.stat().st_size for p in searcher.stash().files() if p.suffix == ".npy")
    assert stash_bytes > 0.5 * searcher.docs.nbytes  # the stash would be visible in the count
    touched = searcher.warm_up()
    assert 0.95 * searcher.docs.nbytes <= touched <= searcher.docs.nbytes + 0.25 * stash_bytes  # Arrow padding


def test_the_default_index_of_a_copied_or_moved_project_is_its_own(tmp_path: Path, monkeypatch) -> None:
    """The pointer held an absolute path: a copy of a project searched the original's index, and a moved one
    was told to build one though its indexes/ held it. Inside the index root it is now relative to it."""
    monkeypatch.delenv("RETRIEVAL_INDEX_ROOT")
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    corpus = write_corpus(project / "c.parquet", n=50)
    build_index(CorpusSpec(corpus), FakeEncoder(), Path("indexes/c"), TransformSpec(dim=4))
    home.remember(Path("indexes/c"))
    assert (project / "indexes" / home.LAST_NAME).read_text() == "c\n"
    shutil.copytree(project, tmp_path / "copy")
    project.rename(tmp_path / "moved")
    for where in ("copy", "moved"):
        monkeypatch.chdir(tmp_path / where)
        assert home.default_index().resolve() == (tmp_path / where / "indexes" / "c").resolve()
        assert Searcher.load(home.default_index(), encoder=FakeEncoder()).manifest.n == 50
    outside = tmp_path / "elsewhere"  # an index outside the root is named as it was: absolute
    shutil.copytree(tmp_path / "moved" / "indexes" / "c", outside)
    home.remember(outside)
    assert home.default_index() == outside.resolve()


def test_a_default_index_whose_name_starts_with_a_space_is_found(tmp_path: Path, monkeypatch) -> None:
    """The pointer was read with strip(): harmless on an absolute path, but a relative one lost the space."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RETRIEVAL_INDEX_ROOT")
    build_index(
        CorpusSpec(write_corpus(tmp_path / "c.parquet", n=30)),
        FakeEncoder(),
        Path("indexes/ lead"),
        TransformSpec(dim=4),
    )
    home.remember(Path("indexes/ lead"))
    assert home.default_index() == Path("indexes/ lead") and home.default_index().is_dir()
