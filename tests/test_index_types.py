"""Approximate indexes (issue 4, section 1): flat, hnsw, ivf and index_factory strings built over the transformed
vectors; recall against exact search; search-time knobs (efSearch, nprobe) reaching FAISS; `info` showing the
type and its parameters; IVF defaults derived from N; IVF training on a transformed sample of the stash."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import FakeEncoder, write_corpus
from typer.testing import CliRunner

import retrieval.build
import retrieval.index
import retrieval.search
import retrieval.update
from retrieval.build import build_index
from retrieval.cli.app import app
from retrieval.corpus import CorpusSpec
from retrieval.errors import ConfigError
from retrieval.index import (
    MAX_KNOB,
    REFINE_K_FACTOR,
    FaissProduct,
    IndexSpec,
    _check_training_rows,
    _hnsw,
    _ivf,
    create_index,
    describe,
    flat_vectors,
    load_for_adding,
    load_index,
    search_parameters,
    set_search_params,
    train_size,
)
from retrieval.indexdir import INDEX, IndexDir
from retrieval.manifest import RESCORE_DEPTH
from retrieval.metrics import knn_recall
from retrieval.search import Searcher, SearchParams
from retrieval.whitening import TransformSpec

N = 2000
runner = CliRunner()

# kind -> (FAISS class after load, knob name, increasing knob values, a generous value)
KINDS = {
    "flat": ("IndexFlatIP", None, [], None),
    "hnsw": ("IndexHNSWFlat", "ef_search", [8, 16, 32, 64, 256], 256),
    "ivf": ("IndexIVFScalarQuantizer", "nprobe", [1, 2, 4, 8, 16, 51], 51),  # nlist 51 for N = 2000, fp16
    "HNSW16": ("IndexHNSWFlat", "ef_search", [8, 16, 32, 64, 256], 256),
    "IVF16,Flat": ("IndexIVFFlat", "nprobe", [1, 2, 4, 8, 16], 16),
    "IVF16,SQ8": ("IndexIVFScalarQuantizer", "nprobe", [1, 2, 4, 8, 16], 16),
    "IVF16,SQfp16": ("IndexIVFScalarQuantizer", "nprobe", [1, 2, 4, 8, 16], 16),  # half the bytes of floats
    "IVF16_HNSW32,Flat": ("IndexIVFFlat", "nprobe", [1, 2, 4, 8, 16], 16),  # lists found by an HNSW
    # "np": no polysemous training (seconds here, and unused by a refined search); PQ8x4 = 8 codes of 4 bits
    "IVF8,PQ8x4np,Refine(Flat)": ("IndexRefineFlat", "nprobe", [1, 2, 4, 8], 8),
    # a pre-transform (random rotation) wraps the index: the knobs must still reach the inner one
    "RR16,IVF16,Flat": ("IndexPreTransform", "nprobe", [1, 2, 4, 8, 16], 16),
    "RR16,HNSW16": ("IndexPreTransform", "ef_search", [8, 16, 32, 64, 256], 256),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Path], np.ndarray]]:
    """One 2000-row fake corpus, every kind built over it (16 -> 16 dims, the default gamma), and 100 queries.
    Same stash, same moments: every index holds exactly the same transformed vectors."""
    root = tmp_path_factory.mktemp("kinds")
    corpus = write_corpus(root / "corpus.parquet", n=N)
    built = {}
    for kind in KINDS:
        out = root / kind.replace(",", "_").replace("(", "_").replace(")", "")
        # ef_construction 40 instead of 200: a build in a fraction of the time, recall still ~1 at N = 2000
        build_index(CorpusSpec(corpus), FakeEncoder(), out, TransformSpec(), IndexSpec(kind, ef_construction=40))
        built[kind] = out
    queries = FakeEncoder().encode([f"what about topic {i}?" for i in range(100)])
    yield corpus, built, queries


def knob_value(searcher: Searcher, knob: str) -> int:
    return int(_hnsw(searcher.index).efSearch) if knob == "ef_search" else int(_ivf(searcher.index).nprobe)


@pytest.mark.parametrize("kind", list(KINDS))
def test_recall_and_search_knobs(setup, kind: str) -> None:
    _, built, queries = setup
    cls, knob, values, generous = KINDS[kind]
    exact = Searcher.load(built["flat"], encoder=FakeEncoder())
    _, truth = exact.search_raw(queries, SearchParams(k=10))
    searcher = Searcher.load(built[kind], encoder=FakeEncoder())
    assert type(searcher.index).__name__ == cls
    assert searcher.manifest.index.kind == kind
    assert searcher.transform.dim_out == exact.transform.dim_out == 16

    params = {knob: generous} if knob else {}
    _, rows = searcher.search_raw(queries, SearchParams(k=10, **params))
    assert knn_recall(rows, truth) >= 0.9, kind
    if knob is None:
        return
    # every knob value reaches FAISS for that call only (the shared index keeps its stored default), and more
    # search effort never loses recall on these queries
    stored = knob_value(searcher, knob)
    recalls = []
    for value in values:
        _, rows = searcher.search_raw(queries, SearchParams(k=10, **{knob: value}))
        assert knob_value(searcher, knob) == stored
        recalls.append(knn_recall(rows, truth))
    assert recalls == sorted(recalls), (kind, recalls)
    assert recalls[0] < 1.0 or "HNSW" in kind, "the smallest setting should cost some recall"
    assert recalls[-1] > recalls[0] or "HNSW" in kind, "the knob never reached FAISS"
    # a call without knobs searches with the index's defaults, whatever the previous call asked
    _, default_rows = searcher.search_raw(queries, SearchParams(k=10))
    _, explicit = searcher.search_raw(queries, SearchParams(k=10, **{knob: searcher.manifest.index.search[knob]}))
    assert np.array_equal(default_rows, explicit)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_searcher_maps_its_index_and_finds_what_the_index_read_whole_finds(setup, kind: str) -> None:
    """Searchers map the index file (IO_FLAG_MMAP_IFC: flat storage is not copied into memory); every kind must
    answer exactly as the same file read whole, and the flat fast path must scan the mapped vectors."""
    import faiss

    _, built, queries = setup
    searcher = Searcher.load(built[kind], encoder=FakeEncoder())
    read = load_index(built[kind] / INDEX)
    vectors = searcher.transform.transform(queries)
    knobs = searcher.manifest.index.search
    got = searcher.index.search(vectors, 10, params=search_parameters(searcher.index, **knobs))
    expected = read.search(vectors, 10, params=search_parameters(read, **knobs))
    np.testing.assert_array_equal(got[1], expected[1])
    np.testing.assert_array_equal(got[0], expected[0])
    top = faiss.downcast_index(searcher.index)
    storage = faiss.downcast_index(top.storage) if hasattr(top, "storage") else top
    if isinstance(storage, faiss.IndexFlatCodes):
        assert not storage.codes.is_owned  # a view of the mapped file, not a copy
    if kind == "flat":
        np.testing.assert_array_equal(flat_vectors(searcher.index), read.reconstruct_n(0, read.ntotal))
        _, rows = searcher.search_raw(queries, SearchParams(k=10))
        assert knn_recall(rows, expected[1]) == 1.0


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_index_read_for_adding_has_the_same_vectors_and_room_for_the_new_rows(
    setup, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``add`` reads the index with ``load_for_adding``: a flat index's vectors come from the file in chunks (7 rows
    here, so the last chunk is partial) into an array sized for the new rows too, which adding them never moves
    (moving it is the copy that made ``add`` peak at twice the index; growing chunk by chunk alone would
    leave room for ~1,600 rows, not 2,000); other kinds are read whole."""
    import faiss

    monkeypatch.setattr(retrieval.index, "ADD_CHUNK_BYTES", 7 * 16 * 4)
    _, built, queries = setup
    path = built[kind] / INDEX
    grown, read = load_for_adding(path, N), load_index(path)  # room for as many again
    assert grown.ntotal == read.ntotal == N
    vectors = np.tile(np.asarray(queries, dtype=np.float32), (N // len(queries), 1))
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    if kind != "flat":
        assert type(faiss.downcast_index(grown)) is type(faiss.downcast_index(read))
        return
    assert grown.metric_type == faiss.METRIC_INNER_PRODUCT and grown.codes.is_owned
    np.testing.assert_array_equal(grown.reconstruct_n(0, N), read.reconstruct_n(0, N))
    where = int(grown.codes.data())
    grown.add(vectors[: N // 2])
    grown.add(vectors[N // 2 :])
    assert int(grown.codes.data()) == where  # N rows fitted in the room made for them: no copy
    read.add(vectors)
    np.testing.assert_array_equal(grown.search(vectors[:100], 10)[1], read.search(vectors[:100], 10)[1])


def test_a_flat_file_laid_out_unexpectedly_is_read_whole(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The vectors are looked for at the end of the file (FAISS's layout) and their first and last rows checked;
    when they are not there (here: bytes after them), the index is read whole rather than wrongly."""
    import faiss

    x = np.random.default_rng(0).standard_normal((100, 8)).astype(np.float32)
    index = faiss.IndexFlatIP(8)
    index.add(x)
    path = tmp_path / "index.faiss"
    faiss.write_index(index, str(path))
    with open(path, "ab") as f:
        f.write(b"\0" * 32)
    grown = load_for_adding(path, 10)
    np.testing.assert_array_equal(grown.reconstruct_n(0, 100), x)
    assert "reading the index whole" in caplog.text


@pytest.mark.parametrize("kind", ["hnsw", "IVF16,Flat", "IVF8,PQ8x4np,Refine(Flat)"])
def test_concurrent_callers_with_different_knobs_do_not_race(setup, kind: str) -> None:
    """The bug: knobs were set on the shared FAISS index per call, so two threads with different knobs raced.
    Each thread's results must equal the same search done alone."""
    _, built, queries = setup
    knob = "ef_search" if "hnsw" in kind.lower() else "nprobe"
    low, high = (1, 512) if knob == "ef_search" else (1, 16)
    searcher = Searcher.load(built[kind], encoder=FakeEncoder())
    alone = {v: searcher.search_raw(queries, SearchParams(k=10, **{knob: v}))[1] for v in (low, high)}
    assert not np.array_equal(alone[low], alone[high])  # the two knobs really give different results

    def worker(value: int) -> bool:
        return all(
            np.array_equal(searcher.search_raw(queries, SearchParams(k=10, **{knob: value}))[1], alone[value])
            for _ in range(30)
        )

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(worker, [low, high, low, high]))


def test_default_knobs_and_what_info_shows(setup) -> None:
    _, built, _ = setup
    expected = {
        "hnsw": {"M": 32, "efConstruction": 40, "efSearch": 128},
        "HNSW16": {"M": 16, "efConstruction": 40, "efSearch": 128},
        "ivf": {"nlist": 51, "nprobe": 7},  # nlist = min(4 sqrt(2000), 2000 // 39) = 51; nprobe ~ sqrt(51)
        "IVF16,SQ8": {"nlist": 16, "nprobe": 4},
        "IVF8,PQ8x4np,Refine(Flat)": {"nlist": 8, "nprobe": 3, "k_factor": REFINE_K_FACTOR},
    }
    for kind, params in expected.items():
        result = runner.invoke(app, ["info", str(built[kind]), "--json"])
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        index = report["manifest"]["index"]
        assert index["spec"]["kind"] == kind and index["ntotal"] == N
        assert {k: index["faiss"][k] for k in params} == params, kind
        shown = report["summary"]["index"]
        assert shown.startswith(f"{kind} (")
        assert all(f"{k}={v}" in shown for k, v in params.items() if k != "k_factor"), shown
    flat = json.loads(runner.invoke(app, ["info", str(built["flat"]), "--json"]).stdout)["manifest"]["index"]
    assert set(flat["faiss"]) == {"class", "ntotal", "dim", "code_bytes"} and flat["search"] == {}  # no knobs to show


def test_knobs_are_clamped_and_ignored_where_they_do_not_apply(setup) -> None:
    _, built, queries = setup
    ivf = Searcher.load(built["IVF16,Flat"], encoder=FakeEncoder())
    # no HNSW here: ef_search is ignored; nprobe beyond the 16 lists probes them all
    _, clamped = ivf.search_raw(queries[:3], SearchParams(k=5, nprobe=1000, ef_search=7))
    _, every_list = ivf.search_raw(queries[:3], SearchParams(k=5, nprobe=16))
    assert np.array_equal(clamped, every_list)
    hnsw = Searcher.load(built["hnsw"], encoder=FakeEncoder())
    _, rows = hnsw.search_raw(queries[:3], SearchParams(k=5, nprobe=3))
    assert (rows >= 0).all()


@pytest.mark.parametrize("n", [1, 10, 38, 39, 100, 2000, 10_000, 100_000, 1_000_000])
def test_default_nlist_is_sane(n: int) -> None:
    nlist = IndexSpec("ivf").nlist_for(n)
    assert 1 <= nlist <= max(1, n // 39)  # at least ~39 training points per list, FAISS's own minimum
    if n >= 25_000:  # from here on 4 sqrt(N) <= N / 39
        assert nlist == int(4 * np.sqrt(n))
    assert IndexSpec("ivf", nlist=7).nlist_for(n) == 7
    assert IndexSpec("ivf").factory(n) == f"IVF{nlist},SQfp16"


def test_ivf_trains_on_a_transformed_sample_of_the_stash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    captured = []
    real_train = retrieval.build.train

    def spy(index, sample: np.ndarray, raw: np.ndarray | None = None, transform: Any = None) -> None:
        captured.append(np.array(sample))
        real_train(index, sample, raw, transform)

    monkeypatch.setattr(retrieval.build, "train", spy)
    corpus = write_corpus(tmp_path / "corpus.parquet", n=600)
    out = tmp_path / "idx"
    build_index(
        CorpusSpec(corpus), FakeEncoder(), out, TransformSpec(dim=12), IndexSpec("ivf", nlist=8, train_size=300)
    )
    (sample,) = captured
    assert sample.shape == (300, 12)  # the training-size knob, at the transform's width (not the encoder's 16)
    np.testing.assert_allclose(np.linalg.norm(sample, axis=1), 1.0, atol=1e-5)  # float32 unit rows
    searcher = Searcher.load(out, encoder=FakeEncoder())
    stash = IndexDir(out).stash()
    transformed = searcher.transform.transform(np.concatenate(list(stash.iter_blocks())))
    # each sample row is one transformed stash row (cosine 1 up to float32 round-off), 300 distinct rows
    best = (sample @ transformed.T).argmax(axis=1)
    np.testing.assert_allclose(sample, transformed[best], atol=1e-6)
    assert len(set(best.tolist())) == 300
    assert searcher.manifest.index.faiss["nlist"] == 8


def test_bad_index_types_are_refused(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus.parquet", n=100)
    out = tmp_path / "idx"
    with pytest.raises(ConfigError, match="'NotAnIndex12'.*valid index_factory string"):
        build_index(CorpusSpec(corpus), FakeEncoder(), out, TransformSpec(), IndexSpec("NotAnIndex12"))
    assert not out.exists()
    with pytest.raises(ConfigError, match="IVF with 64 lists needs at least that many training rows"):
        build_index(CorpusSpec(corpus), FakeEncoder(), out, TransformSpec(), IndexSpec("ivf", nlist=64, train_size=50))
    assert not out.exists()
    for kind, message in [
        ("PQ4", "a product quantizer of 8 bits needs at least 256 training rows"),  # was a FAISS RuntimeError
        ("IVF4,PQ4", "a product quantizer of 8 bits needs at least 256 training rows"),
        ("IDMap,Flat", "FAISS cannot add rows to index type 'IDMap,Flat'"),  # it wants ids of its own
    ]:
        with pytest.raises(ConfigError, match=message):
            build_index(CorpusSpec(corpus), FakeEncoder(), out, TransformSpec(), IndexSpec(kind))
        assert not out.exists() and not retrieval.build.files.work_dir(out).exists()


def test_build_knobs_reach_an_index_under_a_pre_transform(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus.parquet", n=300)
    out = tmp_path / "idx"
    build_index(CorpusSpec(corpus), FakeEncoder(), out, TransformSpec(), IndexSpec("RR16,HNSW8", ef_construction=77))
    record = IndexDir(out).manifest().index
    assert record.faiss["efConstruction"] == 77 and record.faiss["efSearch"] == record.search["ef_search"] == 128


def test_add_keeps_the_factory_string_the_index_was_built_with(tmp_path: Path) -> None:
    """An IVF index keeps the lists it was trained with when rows are added: the manifest must say so."""
    out = tmp_path / "idx"
    build_index(
        CorpusSpec(write_corpus(tmp_path / "a.parquet", n=500)), FakeEncoder(), out, TransformSpec(), IndexSpec("ivf")
    )
    built = IndexDir(out).manifest().index
    more = write_corpus(tmp_path / "b.parquet", n=1000, id=[f"new{i}" for i in range(1000)])
    retrieval.update.add(out, CorpusSpec(more), FakeEncoder())
    after = IndexDir(out).manifest().index
    assert after.factory == built.factory == f"IVF{after.faiss['nlist']},SQfp16" and after.ntotal == 1500


# ----- the CLI ---------------------------------------------------------------------------------------------
def test_cli_index_type_and_search_knobs(tiny_bert: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = retrieval.search.search_parameters

    def spy(index, ef_search=None, nprobe=None):  # type: ignore[no-untyped-def]
        calls.append((ef_search, nprobe))
        return real(index, ef_search=ef_search, nprobe=nprobe)

    monkeypatch.setattr(retrieval.search, "search_parameters", spy)
    corpus = write_corpus(tmp_path / "corpus.parquet", n=120)
    query = "document number 17 about topic 3"
    for kind, flag, value in (("hnsw", "--ef", 64), ("ivf", "--nprobe", 2)):
        out = tmp_path / kind
        built = runner.invoke(
            app, ["index", str(corpus), "--model", str(tiny_bert), "--index-type", kind, "--out", str(out)]
        )
        assert built.exit_code == 0, built.output
        info = json.loads(runner.invoke(app, ["info", str(out), "--json"]).stdout)
        assert info["manifest"]["index"]["spec"]["kind"] == kind
        calls.clear()
        dense = ["--mode", "dense"]  # hybrid's dense side asks for more candidates (here every row: a wider knob)
        found = runner.invoke(
            app, ["search", query, "--index", str(out), "--json", "-k", "3", flag, str(value), *dense]
        )
        assert found.exit_code == 0, found.output
        hits = [json.loads(line) for line in found.stdout.splitlines()]
        assert [h["rank"] for h in hits] == [1, 2, 3]
        assert hits[0]["id"] == "doc17"  # the query is that document's text: cosine 1
        # the asked knob, and the index's stored default for the other (which the index does not have)
        assert calls == [(64, None)] if kind == "hnsw" else calls == [(None, 2)]
    ivf_info = json.loads(runner.invoke(app, ["info", str(tmp_path / "ivf"), "--json"]).stdout)
    assert ivf_info["manifest"]["index"]["faiss"]["nlist"] == 3  # 120 // 39: few rows, few lists


# ----- the spec's bounds, training rows and stored knobs, without a build ------------------------------------
KNOBS = ("ef_construction", "ef_search", "nlist", "nprobe", "train_size")  # count-like: 1 to MAX_KNOB


def test_spec_knob_bounds_are_inclusive() -> None:
    IndexSpec("hnsw", m=2).check()
    IndexSpec("hnsw", m=512).check()
    IndexSpec("ivf", ef_construction=1, ef_search=1, nlist=1, nprobe=1, train_size=1).check()
    IndexSpec("ivf", nlist=MAX_KNOB, nprobe=MAX_KNOB, train_size=MAX_KNOB).check()
    refused = [IndexSpec("hnsw", m=1), IndexSpec("hnsw", m=513), IndexSpec(" ")]
    refused += [IndexSpec("ivf", **{name: value}) for name in KNOBS for value in (0, MAX_KNOB + 1)]
    params = []
    for spec in refused:
        with pytest.raises(ConfigError) as error:
            spec.check()
        params.append(error.value.param)
    assert params == ["m", "m", "index_type"] + [name for name in KNOBS for _ in range(2)]


def test_training_rows_follow_the_lists_and_never_pass_n() -> None:
    def rows(spec: IndexSpec, n: int) -> int:
        return train_size(create_index(spec, 8, n), spec, n)

    assert rows(IndexSpec("flat"), 1_000) == 0 and rows(IndexSpec("hnsw"), 1_000) == 0  # nothing to train
    assert rows(IndexSpec("ivf", nlist=16), 1_000_000) == 10_000  # at least 10k rows, however few the lists
    assert rows(IndexSpec("ivf", nlist=1_000), 1_000_000) == 50_000  # else 50 per list
    assert rows(IndexSpec("ivf", nlist=1_000), 20_000) == 20_000  # never more than there are
    assert rows(IndexSpec("ivf", nlist=16, train_size=5_000), 3_000) == 3_000  # the knob too
    assert rows(IndexSpec("ivf", nlist=16, train_size=500), 3_000) == 500
    ivf = create_index(IndexSpec("ivf", nlist=16), 8, 100)
    _check_training_rows(ivf, 16)  # one row per list: FAISS's own floor
    with pytest.raises(ConfigError, match=r"IVF with 16 lists needs at least that many training rows \(got 15\)"):
        _check_training_rows(ivf, 15)


def test_stored_knobs_are_clamped_and_only_flat_inner_product_is_sliced() -> None:
    import faiss

    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 8)).astype(np.float32)
    ivf = create_index(IndexSpec("ivf", nlist=16), 8, len(x))
    ivf.train(x)
    set_search_params(ivf, ef_search=9, nprobe=1_000)  # no HNSW: ef_search ignored; nprobe at most the lists
    assert describe(ivf)["nprobe"] == 16 and "efSearch" not in describe(ivf)
    ip = faiss.IndexFlatIP(8)
    ip.add(x)
    np.testing.assert_array_equal(flat_vectors(ip), x)
    l2 = faiss.IndexFlatL2(8)
    l2.add(x)
    assert flat_vectors(l2) is None  # its scores are distances: a sliced inner-product scan would misrank
    assert flat_vectors(faiss.IndexFlatIP(8)) is None  # empty


def test_faiss_product_equals_a_float64_product() -> None:
    """FAISS's BLAS multiplies as numpy's does, to float32 rounding: rows of unit scale, a 16 x 8 matrix, error
    within 1e-6 of the largest entry (a float32 product over 16 terms stays ~1e-7)."""
    rng = np.random.default_rng(3)
    matrix = rng.normal(size=(16, 8))
    product = FaissProduct(matrix)
    for n in (1, 7, 300):
        rows = rng.normal(size=(n, 16)).astype(np.float32)
        expected = rows.astype(np.float64) @ matrix.astype(np.float32).astype(np.float64)
        got = product(rows)
        assert got.dtype == np.float32 and got.shape == (n, 8)
        np.testing.assert_allclose(got, expected, atol=1e-6 * np.abs(expected).max())
    assert product(np.empty((0, 16), np.float32)).shape == (0, 8)
    np.testing.assert_allclose(product(rows[::2]), expected[::2], atol=1e-6 * np.abs(expected).max())  # strided
    with pytest.raises(ValueError, match="cannot multiply a 16 x 8"):
        product(np.ones((2, 8), np.float32))


@pytest.mark.parametrize("kind", ["flat", "hnsw", "ivf", "RR16,IVF16,Flat"])
def test_queries_searched_by_faiss_are_transformed_by_faiss_blas(setup, kind: str, tmp_path: Path) -> None:
    """HNSW/IVF query batches go through FAISS's product (numpy's thread pool spinning beside FAISS's OpenMP
    slowed them up to 1.6x, scripts/bench_batches.py); a flat scan keeps numpy's, and so does a single query.
    Either way, the same hits as numpy's transform gives, and scores equal to float32 rounding."""
    corpus, _, queries = setup
    spec = IndexSpec(kind, ef_construction=40)
    build_index(CorpusSpec(corpus), FakeEncoder(), tmp_path / "idx", TransformSpec(dim=8, gamma=0.5), spec)
    searcher = Searcher.load(tmp_path / "idx", encoder=FakeEncoder())
    assert (searcher._query_product is None) == (kind == "flat")
    called = []
    if searcher._query_product is not None:
        product = searcher._query_product

        def counting(rows: np.ndarray) -> np.ndarray:
            called.append(len(rows))
            return product(rows)

        searcher._query_product = counting  # type: ignore[assignment]
    scores, rows = searcher.search_raw(queries, SearchParams(k=10, rescore=0))  # the index's own scores
    assert called == ([] if kind == "flat" else [len(queries)])
    searcher.search_raw(queries[:1], SearchParams(k=10, rescore=0))
    assert called == ([] if kind == "flat" else [len(queries)])  # a single query keeps numpy's product
    vectors = searcher.transform.transform(queries)  # numpy's product
    expected = searcher.search_transformed(vectors, 10)
    assert knn_recall(rows, expected[1]) >= 0.99  # a tie broken by a last-bit difference may swap a pair
    np.testing.assert_allclose(scores, expected[0], atol=1e-5)
    if kind == "flat":
        return
    # a full-rank re-scoring kernel (what tune may record) multiplies its queries and candidates the same way
    retrieval.update.refit(
        tmp_path / "idx", TransformSpec(dim=8, gamma=0.5), scorer=TransformSpec(gamma=1.0, whiten=True)
    )
    searcher = Searcher.load(tmp_path / "idx", encoder=FakeEncoder())
    assert isinstance(searcher._rescore_product, FaissProduct)
    rescore_product, multiplied = searcher._rescore_product, []

    def counting_rescore(rows: np.ndarray) -> np.ndarray:
        multiplied.append(len(rows))
        return rescore_product(rows)

    searcher._rescore_product = counting_rescore  # type: ignore[assignment]
    scores, rows = searcher.search_raw(queries, SearchParams(k=10))
    assert multiplied == [len(queries), len(queries) * RESCORE_DEPTH]  # the queries, then their candidates
    searcher._rescore_product = None
    numpy_scores, numpy_rows = searcher.search_raw(queries, SearchParams(k=10))
    assert knn_recall(rows, numpy_rows) >= 0.99
    np.testing.assert_allclose(scores, numpy_scores, atol=1e-5)


@pytest.mark.parametrize("kind", list(KINDS))
def test_single_ivf_queries_go_to_a_twin_that_shares_the_lists(setup, kind: str) -> None:
    """An IVF-Flat index gets a twin searching one query over all its threads (parallel_mode 1), sharing the
    quantizer and lists; it answers a single query as the index itself does, and keeps the original alive.
    Batches and every other kind use the index as it is."""
    import gc

    import faiss

    _, built, queries = setup
    searcher = Searcher.load(built[kind], encoder=FakeEncoder())
    twin = searcher._one_query
    assert (twin is not None) == (kind in ("ivf", "IVF16,Flat", "IVF16,SQ8", "IVF16,SQfp16", "IVF16_HNSW32,Flat"))
    if twin is None:
        return
    assert twin.parallel_mode == 1 and faiss.downcast_index(searcher.index).parallel_mode == 0
    assert twin.invlists.this == faiss.extract_index_ivf(searcher.index).invlists.this  # shared, not copied
    used = []
    original = twin.search

    def counting(*args, **kwargs):
        used.append(len(args[0]))
        return original(*args, **kwargs)

    twin.search = counting
    vectors = searcher.transform.transform(queries)
    for nprobe in (1, 4, 16):
        params = search_parameters(searcher.index, nprobe=nprobe)
        expected_scores, expected_rows = searcher.index.search(vectors, 10, params=params)
        for q in range(0, len(queries), 10):
            scores, rows = searcher.search_transformed(vectors[q : q + 1], 10, nprobe=nprobe)
            np.testing.assert_array_equal(scores[0], expected_scores[q])
            assert knn_recall(rows, expected_rows[q : q + 1]) == 1.0
    searcher.search_transformed(vectors[:5], 10)  # a batch: the index itself
    assert used == [1] * 30

    lone = retrieval.index.one_query_twin(load_index(built[kind] / INDEX))  # its original dropped at once
    gc.collect()
    np.testing.assert_array_equal(lone.search(vectors[:1], 10)[1], searcher.search_transformed(vectors[:1], 10)[1])


def test_an_hnsw_coarse_quantizer_files_rows_with_the_specs_beam(setup) -> None:
    """FAISS's efSearch of 16 filed 1M real rows in wrong lists (recall@10 capped at 0.931): the quantizer's
    HNSW gets the spec's efConstruction and efSearch, saved with the index; every row sits in the list of its
    exactly nearest centroid, as with a flat quantizer."""
    import faiss

    _, built, _ = setup
    index = load_index(built["IVF16_HNSW32,Flat"] / INDEX)
    coarse = retrieval.index._coarse_hnsw(index)
    spec = IndexSpec("IVF16_HNSW32,Flat", ef_construction=40)
    assert (coarse.efConstruction, coarse.efSearch) == (spec.ef_construction, spec.ef_search)
    assert retrieval.index._coarse_hnsw(load_index(built["IVF16,Flat"] / INDEX)) is None
    ivf = faiss.extract_index_ivf(index)
    centroids = ivf.quantizer.reconstruct_n(0, ivf.nlist)
    lists = faiss.extract_index_ivf(index).invlists
    for number in range(ivf.nlist):
        rows = faiss.rev_swig_ptr(lists.get_codes(number), lists.list_size(number) * ivf.code_size)
        vectors = np.frombuffer(bytes(rows), dtype=np.float32).reshape(-1, ivf.d)
        assert (np.argmax(vectors @ centroids.T, axis=1) == number).all()


def test_a_default_nprobe_above_nlist_is_recorded_as_every_list(tmp_path: Path) -> None:
    """`refit --index-type ivf --nlist 8 --nprobe 100` recorded a default of 100 beside FAISS's 8 (info showed
    both); FAISS probes at most every list, so that is the default recorded."""
    from retrieval.index import IndexSpec
    from retrieval.whitening import TransformSpec

    corpus = write_corpus(tmp_path / "corpus.parquet", n=400)
    build_index(
        CorpusSpec(corpus), FakeEncoder(), tmp_path / "idx", TransformSpec(), IndexSpec("ivf", nlist=8, nprobe=100)
    )
    manifest = IndexDir(tmp_path / "idx").manifest()
    assert manifest.index.search == {"nprobe": 8} and manifest.index.faiss["nprobe"] == 8
