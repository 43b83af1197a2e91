"""The indexing job with the fake encoder: what it writes, that queries see the same transform, and that a
failed or refused build never leaves a half index nor harms the previous one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import FakeEncoder, write_corpus

from retrieval import files, update
from retrieval.build import BuildOptions, build_index
from retrieval.corpus import CorpusSpec
from retrieval.docs import Docs
from retrieval.errors import ConfigError, CorpusError, IndexDirError, RetrievalError
from retrieval.index import IndexSpec, flat_vectors, load_index
from retrieval.indexdir import IndexDir
from retrieval.lexical import FILES as LEXICAL_FILES
from retrieval.manifest import SCHEMA_VERSION, Manifest, StashRecord
from retrieval.moments import RunningMoments
from retrieval.search import Searcher, SearchParams
from retrieval.stash import VectorStash
from retrieval.whitening import DEFAULT_GAMMA, TransformSpec, Whitening, l2_normalize, load_transform

N, D, K = 300, 16, 8

# The FAISS index holds float32 vectors made by the same float32 code the query side runs: identical up to
# BLAS summation order, far below 1e-6.
SAME_TRANSFORM_ATOL = 1e-6


def texts_of(path: Path) -> tuple[list[str], list[str]]:
    """(ids, texts) of a corpus parquet, or of an index's docs.arrow."""
    if path.suffix == ".arrow":
        docs = Docs(path)
        return docs.ids, docs.texts(range(len(docs)))
    table = pq.read_table(path)
    return table.column("id").to_pylist(), table.column("text").to_pylist()


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def siblings(out: Path) -> list[str]:
    """Everything next to ``out`` (work and old directories are hidden siblings)."""
    return sorted(p.name for p in out.parent.iterdir()) if out.parent.exists() else []


def build(corpus: Path, out: Path, encoder: FakeEncoder | None = None, **kwargs) -> Manifest:
    transform = kwargs.pop("transform", TransformSpec(dim=K))
    return build_index(CorpusSpec(corpus), encoder or FakeEncoder(), out, transform, **kwargs)


@pytest.fixture
def built(corpus: Path, tmp_path: Path) -> tuple[Path, FakeEncoder, Manifest]:
    encoder = FakeEncoder()
    out = tmp_path / "out" / "idx"
    manifest = build(corpus, out, encoder)
    return out, encoder, manifest


# ----- the index answers with the same transform -----------------------------------------------------------
def test_a_document_finds_itself_first(built: tuple[Path, FakeEncoder, Manifest], corpus: Path) -> None:
    out, encoder, _ = built
    searcher = Searcher.load(out, encoder=encoder)
    ids, texts = texts_of(corpus)
    for row in (0, 1, 77, 299):
        hits = searcher.search(texts[row], SearchParams(k=3))
        assert hits[0].id == ids[row] and hits[0].row == row and hits[0].text == texts[row]
        # a unit vector against itself: cosine 1 up to float32 rounding
        assert hits[0].score == pytest.approx(1.0, abs=1e-5)
        assert hits[1].score < hits[0].score


def test_index_time_and_query_time_transforms_agree(built: tuple[Path, FakeEncoder, Manifest], corpus: Path) -> None:
    out, encoder, _ = built
    searcher = Searcher.load(out, encoder=encoder)
    _, texts = texts_of(corpus)
    stored = flat_vectors(searcher.index)
    assert stored.shape == (N, K)
    rows = [0, 5, 150, 299]
    query = searcher.transform.transform(encoder.encode([texts[r] for r in rows]))
    np.testing.assert_allclose(query, stored[rows], atol=SAME_TRANSFORM_ATOL)
    # and what was stored is what a fresh fit of the saved moments gives (the saved file knows its k)
    transform = load_transform(out / "transform.npz")
    assert isinstance(transform, Whitening) and transform.kernel.shape == (D, K)
    assert not transform.center  # a reduced kernel: uncentred by default
    refit = Whitening.fit(RunningMoments.load(out / "moments.npz"), dim=K, gamma=transform.gamma, center=False)
    np.testing.assert_allclose(refit.transform(encoder.encode(texts[:4])), stored[:4], atol=1e-5)


def test_stored_vectors_are_unit_length(built: tuple[Path, FakeEncoder, Manifest]) -> None:
    stored = flat_vectors(load_index(built[0] / "index.faiss"))
    # float32 normalisation: |x| = 1 within a few ulps
    np.testing.assert_allclose(np.linalg.norm(stored, axis=1), 1.0, atol=1e-6)


def test_saved_moments_equal_the_one_shot_covariance(built: tuple[Path, FakeEncoder, Manifest], corpus: Path) -> None:
    out, _, _ = built
    _, texts = texts_of(corpus)
    x = FakeEncoder().encode(texts).astype(np.float64)
    moments = RunningMoments.load(out / "moments.npz")
    assert moments.n == N
    # float64 accumulation of float32 vectors (a large common mean included): rtol 1e-6 per the issue;
    # atol scaled to the largest entry for near-zero off-diagonals.
    np.testing.assert_allclose(moments.mean, x.mean(axis=0), rtol=1e-6)
    cov = np.cov(x.T, bias=True)
    np.testing.assert_allclose(moments.covariance(), cov, rtol=1e-6, atol=1e-9 * np.abs(cov).max())


def test_manifest_describes_the_directory(built: tuple[Path, FakeEncoder, Manifest], corpus: Path) -> None:
    out, encoder, returned = built
    manifest = Manifest.load(out)
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk["schema_version"] == SCHEMA_VERSION == manifest.schema_version
    assert manifest.encoder == encoder.info()
    assert manifest == Manifest.from_dict(on_disk)  # the typed sections round-trip through JSON
    t = manifest.transform
    assert (t.kind, t.d, t.dim, t.pooling) == ("whitening", D, K, "mean")
    assert t.spec.gamma == DEFAULT_GAMMA and t.spec.epsilon == TransformSpec().epsilon
    assert t.n_fit == N and t.explained_variance is not None and 0.5 < t.explained_variance <= 1.0
    assert manifest.n == N == manifest.index.ntotal
    assert manifest.index.kind == "flat" and manifest.index.metric == "inner_product"
    assert manifest.generation == 1 and manifest.created == manifest.updated != ""
    c = manifest.corpus
    assert (c.rows, c.indexed, c.skipped) == (N, N, 0)
    assert c.sha256 == files.sha256(corpus) and c.path == str(corpus.resolve())
    assert set(manifest.timings) >= {"validate", "encode", "fit", "index", "write"}
    assert all(v >= 0 for v in manifest.timings.values())
    # the returned manifest also counts the time spent writing manifest.json itself
    assert manifest.timings.keys() == returned.timings.keys()
    assert {k: v for k, v in manifest.timings.items() if k != "write"} == {
        k: v for k, v in returned.timings.items() if k != "write"
    }
    assert {"numpy", "faiss", "pyarrow", "retrieval"} <= set(manifest.versions)
    stash = IndexDir(out).stash()
    assert manifest.stash == StashRecord("float32", ["mean"], N, sum(p.stat().st_size for p in stash.files()[1:]))
    # every top-level file is listed with its true size and sha256; the stash parts in stash.json
    own = {"transform.npz", "moments.npz", "index.faiss", "docs.arrow", "vectors/stash.json"}
    assert set(manifest.files) == own | {f"lexical/{name}" for name in LEXICAL_FILES}
    for name, record in manifest.files.items():
        digest = files.sha256(out / name)
        assert record == {"bytes": (out / name).stat().st_size, "sha256": digest, "quick_sha256": digest}
    present = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} - {"manifest.json"}
    in_stash = {f"vectors/{name}" for part in stash.parts for name in part.checksums}
    assert present == set(manifest.files) | in_stash
    for part in stash.parts:
        for name, record in part.checksums.items():
            path = out / "vectors" / name
            size, digest, sampled = path.stat().st_size, files.sha256(path), files.part_fingerprint(path)
            assert record == {"bytes": size, "sha256": digest, "sampled_sha256": sampled}
    IndexDir(out).verify(manifest, "full")
    # nothing is left beside the index
    assert siblings(out) == ["idx"]


def test_docs_table_maps_rows_to_ids_and_texts(built: tuple[Path, FakeEncoder, Manifest], corpus: Path) -> None:
    assert texts_of(built[0] / "docs.arrow") == texts_of(corpus)


def test_doc_ids_are_a_lazy_sequence_of_the_docs(built: tuple[Path, FakeEncoder, Manifest], corpus: Path) -> None:
    docs = Docs(built[0] / "docs.arrow")
    expected = pq.read_table(corpus).column("id").to_pylist()
    ids = docs.ids
    assert len(ids) == len(expected) and ids[0] == expected[0] and ids[-1] == expected[-1]
    assert ids[5:9] == expected[5:9] and ids[np.int64(7)] == expected[7]
    assert ids == expected and ids != expected[:-1] and ids != "not a sequence"
    assert expected[3] in ids and list(ids) == expected
    with pytest.raises(IndexError):
        ids[len(expected)]


def test_progress_reports_every_row(corpus: Path, tmp_path: Path) -> None:
    seen: dict[str, list[tuple[int, int]]] = {}
    build(corpus, tmp_path / "idx", progress=lambda s, n, total: seen.setdefault(s, []).append((n, total)))
    assert sum(n for n, _ in seen["encode"]) == N and {t for _, t in seen["encode"]} == {N}
    assert sum(n for n, _ in seen["index"]) == N


# ----- variants ------------------------------------------------------------------------------------------
def test_no_keep_vectors_drops_the_stash(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "idx"
    manifest = build(corpus, out, options=BuildOptions(keep_vectors=False))
    assert not (out / "vectors").exists()
    assert manifest.stash is None
    assert not [name for name in manifest.files if name.startswith("vectors")]
    IndexDir(out).verify(Manifest.load(out))
    with pytest.raises(IndexDirError, match="kept no raw-vector stash"):
        IndexDir(out).stash()
    searcher = Searcher.load(out, encoder=FakeEncoder())
    with pytest.raises(ConfigError, match="kept no raw-vector stash, so it cannot re-score"):
        searcher.search_raw(FakeEncoder().encode(["x"]), SearchParams(k=3, rescore=10))


def test_no_whiten_indexes_the_raw_normalised_vectors(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "idx"
    manifest = build(corpus, out, transform=TransformSpec(whiten=False))
    assert (manifest.transform.kind, manifest.transform.d, manifest.transform.dim) == ("raw", D, D)
    _, texts = texts_of(corpus)
    stored = flat_vectors(load_index(out / "index.faiss"))
    # no centring, no kernel: only the float32 L2 normalisation
    np.testing.assert_allclose(stored, l2_normalize(FakeEncoder().encode(texts)), atol=1e-6)
    # raw vectors share a large common mean: their average cosine is high (0.86 here); whitened ones near 0
    assert (stored @ stored.T).mean() > 0.8
    build(corpus, tmp_path / "w", transform=TransformSpec(dim=K, center=True))
    whitened_index = load_index(tmp_path / "w" / "index.faiss")
    whitened = flat_vectors(whitened_index)
    assert abs((whitened @ whitened.T).mean()) < 0.1


def test_no_whiten_with_a_smaller_dim_is_refused(corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="the raw transform keeps all 16 dimensions"):
        build(corpus, tmp_path / "idx", transform=TransformSpec(dim=4, whiten=False))


def test_full_dim_is_the_default(corpus: Path, tmp_path: Path) -> None:
    manifest = build(corpus, tmp_path / "idx", transform=TransformSpec())
    assert manifest.transform.dim == D


@pytest.mark.parametrize("dim", [0, -1, D + 1])
def test_bad_dim_is_refused_before_anything_is_written(corpus: Path, tmp_path: Path, dim: int) -> None:
    encoder = FakeEncoder()
    out = tmp_path / "out" / "idx"
    message = rf"`dim` must be between 1 and the encoder's dimension {D}" if dim > 0 else "`dim` must be at least 1"
    with pytest.raises(ConfigError, match=rf"{message} \(got {dim}\)"):
        build(corpus, out, encoder, transform=TransformSpec(dim=dim))
    assert encoder.calls == 0
    assert not out.parent.exists()


@pytest.mark.parametrize(
    "spec",
    [
        TransformSpec(gamma=-0.5),
        TransformSpec(gamma=float("nan")),
        TransformSpec(gamma=float("inf")),
        TransformSpec(gamma=1e6),
        TransformSpec(epsilon=-1.0),
        TransformSpec(epsilon=float("nan")),
        TransformSpec(epsilon=float("inf")),
    ],
)
def test_bad_gamma_or_epsilon_is_refused(corpus: Path, tmp_path: Path, spec: TransformSpec) -> None:
    """NaN, inf and huge values used to build all-NaN or all-zero indexes; now refused before any work."""
    with pytest.raises(ConfigError, match="`gamma` must be between 0 and 2|`epsilon` must be between 0 and 1"):
        build(corpus, tmp_path / "idx", transform=spec)
    assert not (tmp_path / "idx").exists()


def test_bad_corpus_writes_nothing(tmp_path: Path) -> None:
    path = write_corpus(tmp_path / "c.parquet", n=5, id=["a", "b", "a", "c", "d"])
    out = tmp_path / "out" / "idx"
    with pytest.raises(CorpusError, match="duplicate id 'a'"):
        build(path, out)
    assert not out.parent.exists()


def test_skip_empty_indexes_only_the_usable_rows(tmp_path: Path) -> None:
    texts = [f"text number {i}" for i in range(40)]
    texts[3] = texts[30] = ""
    path = write_corpus(tmp_path / "c.parquet", n=40, text=texts)
    out = tmp_path / "idx"
    manifest = build_index(CorpusSpec(path, skip_empty=True), FakeEncoder(), out, TransformSpec(dim=4))
    assert manifest.n == 38 and (manifest.corpus.rows, manifest.corpus.indexed, manifest.corpus.skipped) == (40, 38, 2)
    ids, _ = texts_of(out / "docs.arrow")
    assert "doc3" not in ids and "doc30" not in ids and len(ids) == 38


def test_title_column_is_part_of_what_is_encoded(tmp_path: Path) -> None:
    path = write_corpus(tmp_path / "c.parquet", n=30, title=[f"Title {i}" for i in range(30)])
    out = tmp_path / "idx"
    encoder = FakeEncoder()
    build_index(CorpusSpec(path, title_column="title"), encoder, out, TransformSpec(dim=4))
    hits = Searcher.load(out, encoder=encoder).search("Title 4 document number 4 about topic 4", SearchParams(k=1))
    assert hits[0].id == "doc4" and hits[0].score == pytest.approx(1.0, abs=1e-5)


def test_hits_carry_the_title_apart_and_add_and_remove_keep_it(tmp_path: Path) -> None:
    """The title column is kept beside the text (which begins with it) for hits to show; rows added with titles
    get theirs, rows added without a title column get None, and parts rewritten by ``remove`` or merged after an
    ``add`` keep every row's title. An index built without one has no titles at all."""
    path = write_corpus(tmp_path / "c.parquet", n=30, title=[f"Title {i}" for i in range(30)])
    out = tmp_path / "idx"
    build_index(CorpusSpec(path, title_column="title"), FakeEncoder(), out, TransformSpec(dim=4))
    hit = Searcher.load(out, encoder=FakeEncoder()).search("Title 4 document number 4 about topic 4")[0]
    assert (hit.id, hit.title, hit.text) == ("doc4", "Title 4", "Title 4 document number 4 about topic 4")

    titled = write_corpus(tmp_path / "t.parquet", n=2, id=["t0", "t1"], title=["New 0", "New 1"])
    update.add(out, CorpusSpec(titled, title_column="title"), FakeEncoder())
    update.add(out, CorpusSpec(write_corpus(tmp_path / "u.parquet", n=2, id=["u0", "u1"])), FakeEncoder())
    update.remove(out, ["doc3", "t1"])
    docs = Docs(out / "docs.arrow")
    expected = [f"Title {i}" for i in range(30) if i != 3] + ["New 0", None, None]
    assert list(docs.ids)[-3:] == ["t0", "u0", "u1"] and docs.titles(range(len(docs))) == expected
    rows = [31, 0, 29, 30, 5]  # across the parts add and remove wrote: hits' one lookup a row agrees with each column's
    assert docs.records(rows) == list(zip([docs.id(r) for r in rows], docs.texts(rows), docs.titles(rows), strict=True))
    hit = Searcher.load(out, encoder=FakeEncoder()).search("New 0 document number 0 about topic 0")[0]
    assert (hit.id, hit.title) == ("t0", "New 0")

    build_index(CorpusSpec(path), FakeEncoder(), tmp_path / "plain", TransformSpec(dim=4))
    assert Docs(tmp_path / "plain" / "docs.arrow").titles([0, 1]) is None
    assert [title for *_, title in Docs(tmp_path / "plain" / "docs.arrow").records([0, 1])] == [None, None]
    assert Searcher.load(tmp_path / "plain", encoder=FakeEncoder()).search("document number 4")[0].title is None


def test_precomputed_vectors_column_needs_no_encoder(tmp_path: Path) -> None:
    x = FakeEncoder().encode([f"t{i}" for i in range(50)])
    path = tmp_path / "v.parquet"
    column = pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), D)
    pq.write_table(pa.table({"id": [f"v{i}" for i in range(50)], "emb": column}), path)
    out = tmp_path / "idx"
    manifest = build_index(CorpusSpec(path, vectors_column="emb"), None, out, TransformSpec(dim=4))
    assert manifest.encoder.kind == "vectors" and manifest.n == 50
    searcher = Searcher.load(out)
    assert searcher.encoder is None
    hits = searcher.search_vectors(x[7], SearchParams(k=2))[0]
    assert hits[0].id == "v7" and hits[0].score == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(ConfigError, match="precomputed vectors"):
        searcher.search("text", SearchParams(k=2))


@pytest.mark.parametrize("columns", ["text and title", "title only"])
def test_a_vectors_corpus_keeps_its_texts_for_the_hits(tmp_path: Path, columns: str) -> None:
    """The vectors are given, so nothing is encoded, but the texts (title first, as for an encoded corpus) are
    what the hits show; a null text is stored empty (the row's vector decides whether it is used)."""
    x = FakeEncoder().encode([f"t{i}" for i in range(50)])
    table = {"id": [f"v{i}" for i in range(50)], "emb": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), D)}
    table["title"] = [f"Title {i}" for i in range(50)]
    if columns == "text and title":
        table["text"] = [None if i == 3 else f"body {i}" for i in range(50)]
    pq.write_table(pa.table(table), tmp_path / "v.parquet")
    build_index(CorpusSpec(tmp_path / "v.parquet", vectors_column="emb", title_column="title"), None, tmp_path / "i")
    searcher = Searcher.load(tmp_path / "i")
    hit = searcher.search_vectors(x[7], SearchParams(k=1))[0][0]
    assert (hit.id, hit.text) == ("v7", "Title 7 body 7" if columns == "text and title" else "Title 7")
    assert searcher.search_vectors(x[3], SearchParams(k=1))[0][0].text == (
        "" if columns == "text and title" else "Title 3"
    )


# ----- streaming windows -----------------------------------------------------------------------------------
def test_windows_that_do_not_divide_n_give_the_same_index(corpus: Path, tmp_path: Path) -> None:
    small = build(corpus, tmp_path / "w7", options=BuildOptions(window_rows=7))
    whole = build(corpus, tmp_path / "wN", options=BuildOptions(window_rows=N))
    assert len(IndexDir(tmp_path / "w7").stash().parts) == -(-N // 7) == 43
    assert len(IndexDir(tmp_path / "wN").stash().parts) == 1
    assert small.n == whole.n == N
    assert texts_of(tmp_path / "w7" / "docs.arrow") == texts_of(tmp_path / "wN" / "docs.arrow")
    a = RunningMoments.load(tmp_path / "w7" / "moments.npz")
    b = RunningMoments.load(tmp_path / "wN" / "moments.npz")
    # the same float64 sums in another grouping: agreement to ~1e-12 relative
    np.testing.assert_allclose(a.covariance(), b.covariance(), rtol=1e-9, atol=1e-12 * np.abs(b.covariance()).max())
    va = flat_vectors(load_index(tmp_path / "w7" / "index.faiss"))
    vb = flat_vectors(load_index(tmp_path / "wN" / "index.faiss"))
    # kernels equal to ~1e-9; the float32 transform then adds a few ulps: 1e-5 on unit vectors
    np.testing.assert_allclose(va, vb, atol=1e-5)


# ----- existing, overwritten and failed builds -------------------------------------------------------------
def test_existing_index_is_not_replaced_without_overwrite(
    built: tuple[Path, FakeEncoder, Manifest], corpus: Path
) -> None:
    out = built[0]
    before = snapshot(out)
    encoder = FakeEncoder()
    with pytest.raises(ConfigError, match="already exists; pass `overwrite`"):
        build(corpus, out, encoder)
    assert encoder.calls == 0
    assert snapshot(out) == before


@pytest.mark.parametrize("kind", ["user folder", "user file", "foreign manifest"])
def test_overwrite_never_replaces_what_is_not_an_index(kind: str, corpus: Path, tmp_path: Path) -> None:
    """The data-loss bug: --overwrite on a user's folder deleted its files. Now: refused, nothing touched."""
    out = tmp_path / "mine"
    if kind == "user file":
        out.write_text("my thesis")
    else:
        out.mkdir()
        if kind == "user folder":
            (out / "thesis.tex").write_text("years of work")
            (out / "data").mkdir()
            (out / "data" / "results.csv").write_text("1,2,3")
        if kind == "foreign manifest":  # some other tool's manifest.json
            (out / "manifest.json").write_text('{"name": "my-web-app", "version": "1.0"}')
    before = snapshot(out) if out.is_dir() else out.read_bytes()
    encoder = FakeEncoder()
    with pytest.raises(ConfigError, match="only replaces an index built by retrieval"):
        build(corpus, out, encoder, options=BuildOptions(overwrite=True))
    assert encoder.calls == 0
    assert (snapshot(out) if out.is_dir() else out.read_bytes()) == before
    assert siblings(out) == sorted(["corpus.parquet", "mine"])


def test_an_empty_folder_is_built_into(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "empty"
    out.mkdir()
    assert build(corpus, out).n == N
    IndexDir(out).verify(Manifest.load(out))


def test_overwrite_replaces_the_index(built: tuple[Path, FakeEncoder, Manifest], tmp_path: Path) -> None:
    out = built[0]
    other = write_corpus(tmp_path / "other.parquet", n=50)
    update.refit(out, TransformSpec(dim=4))  # generation 2
    manifest = build(other, out, options=BuildOptions(overwrite=True))
    assert manifest.n == 50 == Manifest.load(out).n
    assert manifest.generation == 3  # a rebuild is a new version of the path, as an add or refit is
    assert Manifest.load(out).corpus.sha256 == files.sha256(other)
    IndexDir(out).verify(Manifest.load(out))
    assert siblings(out) == ["idx"]


class FailingEncoder(FakeEncoder):
    """Fails on the n-th call: with a RetrievalError, NaN vectors, or a crash that is not ours."""

    def __init__(self, fail_on: int, how: str):
        super().__init__()
        self.fail_on, self.how = fail_on, how

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        out = super().encode(texts)
        if self.calls >= self.fail_on:
            if self.how == "error":
                raise CorpusError("the encoder gave up")
            if self.how == "crash":
                raise RuntimeError("out of memory")
            out[len(out) // 2] = np.nan
        return out


@pytest.mark.parametrize(
    ("how", "error", "message"),
    [("error", CorpusError, "the encoder gave up"), ("nan", CorpusError, "NaN or inf \\(first ids: doc")],
)
def test_failed_build_leaves_the_previous_index_intact(
    built: tuple[Path, FakeEncoder, Manifest], corpus: Path, how: str, error: type[Exception], message: str
) -> None:
    out = built[0]
    before = snapshot(out)
    with pytest.raises(error, match=message):
        build(corpus, out, FailingEncoder(3, how), options=BuildOptions(overwrite=True, window_rows=50))
    assert snapshot(out) == before
    assert siblings(out) == ["idx"]  # no work directory behind
    Searcher.load(out, encoder=FakeEncoder())


def test_failed_first_build_leaves_nothing(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "out" / "idx"
    with pytest.raises(RetrievalError):
        build(corpus, out, FailingEncoder(2, "error"), options=BuildOptions(window_rows=50))
    assert not out.exists() and siblings(out) == []


def test_crash_keeps_the_previous_index_and_the_work_for_resume(
    built: tuple[Path, FakeEncoder, Manifest], corpus: Path
) -> None:
    out = built[0]
    before = snapshot(out)
    with pytest.raises(RuntimeError, match="out of memory"):
        build(corpus, out, FailingEncoder(3, "crash"), options=BuildOptions(overwrite=True, window_rows=50))
    assert snapshot(out) == before
    # an unexpected crash is what --resume is for: the two finished windows stay in the work directory
    work = files.work_dir(out)
    assert VectorStash.open(work / "vectors").source_batches == 2
    resumed = build(corpus, out, FakeEncoder(), options=BuildOptions(overwrite=True, window_rows=50, resume=True))
    assert resumed.n == N and siblings(out) == ["idx"]


def test_interrupted_publish_is_recovered_by_the_next_writer(built: tuple[Path, FakeEncoder, Manifest]) -> None:
    """A reader moves nothing: it says where the previous version is; the next writer puts it back."""
    out = built[0]
    before = snapshot(out)
    old = files.work_dir(out, "old")
    out.rename(old)  # killed between the two renames of publish()
    with pytest.raises(IndexDirError, match=r"previous version is at .*\.idx\.old: .*next `retrieval add`"):
        Searcher.load(out, encoder=FakeEncoder())
    assert not out.exists() and old.is_dir()
    with files.writing(out):
        pass
    searcher = Searcher.load(out, encoder=FakeEncoder())
    assert searcher.manifest.n == N and snapshot(out) == before


def test_publish_flushes_every_file_and_the_renames_to_disk(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Power-cut safety: each file of the new version is fsynced while still in the work directory (before it
    is renamed into place), then the parent directory (the renames)."""
    synced: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(
        files.os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd)
    )
    out = tmp_path / "idx"
    build(corpus, out)
    work = str(files.work_dir(out))
    published = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    flushed_in_work = {os.path.relpath(p, work) for p in synced if p.startswith(work + os.sep)}
    assert published <= flushed_in_work
    assert synced[-1] == str(tmp_path)  # last: the directory holding the renamed entries


def hold_lock(target: Path) -> subprocess.Popen:
    """Another process holding the writer's lock of ``target`` until its stdin closes."""
    code = "import sys; from pathlib import Path; from retrieval import files\n"
    code += "with files.writing(Path(sys.argv[1])):\n    print('held', flush=True); sys.stdin.read()"
    proc = subprocess.Popen([sys.executable, "-c", code, str(target)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"held"
    return proc


@pytest.mark.process
def test_one_writer_at_a_time(built: tuple[Path, FakeEncoder, Manifest], corpus: Path) -> None:
    out = built[0]
    before = snapshot(out)
    more = write_corpus(out.parent.parent / "more.parquet", 5)
    pq.write_table(pq.read_table(more).set_column(0, "id", pa.array([f"new{i}" for i in range(5)])), more)
    holder = hold_lock(out)
    try:
        for write in (
            lambda: build(corpus, out, FakeEncoder(), options=BuildOptions(overwrite=True)),
            lambda: update.refit(out, TransformSpec(dim=4)),
            lambda: update.add(out, CorpusSpec(more), FakeEncoder()),
        ):
            with pytest.raises(IndexDirError, match="another retrieval process is writing .*idx; wait for it"):
                write()
            assert snapshot(out) == before and siblings(out) == [".idx.lock", "idx"]
    finally:
        holder.communicate(b"")
    assert holder.returncode == 0
    assert siblings(out) == ["idx"]  # the lock file went with its holder
    assert update.refit(out, TransformSpec(dim=4)).transform.dim == 4  # and the next writer gets in
    assert siblings(out) == ["idx"]


# ----- the stash -------------------------------------------------------------------------------------------
@pytest.fixture
def stash(tmp_path: Path) -> tuple[VectorStash, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(23, 5)).astype(np.float32)
    stash = VectorStash.create(tmp_path / "stash", 5, ["mean", "cls"], meta={"k": 1})
    for start, stop in ((0, 10), (10, 17), (17, 23)):  # parts of 10, 7 and 6 rows
        ids = [f"r{i}" for i in range(start, stop)]
        stash.append({"mean": x[start:stop], "cls": -x[start:stop]}, ids, [f"text {i}" for i in range(start, stop)])
    return stash, x


def test_stash_parts_and_reopen(stash: tuple[VectorStash, np.ndarray]) -> None:
    s, x = stash
    again = VectorStash.open(s.root)
    assert len(again) == 23 and [p.rows for p in again.parts] == [10, 7, 6]
    assert again.poolings == ["mean", "cls"] and again.meta == {"k": 1} and again.dim == 5
    assert again.source_batches == 3
    assert all(p.is_file() for p in again.files()) and len(again.files()) == 1 + 3 * 3
    ids = [i for t in again.iter_docs() for i in t.column("id").to_pylist()]
    assert ids == [f"r{i}" for i in range(23)]


@pytest.mark.parametrize("block_rows", [1, 4, 7, 100])
def test_stash_iter_blocks_returns_every_row_in_order(stash: tuple[VectorStash, np.ndarray], block_rows: int) -> None:
    s, x = stash
    blocks = list(s.iter_blocks(block_rows))
    assert all(b.shape[0] <= block_rows and b.dtype == np.float32 for b in blocks)
    np.testing.assert_array_equal(np.concatenate(blocks), x)
    np.testing.assert_array_equal(np.concatenate(list(s.iter_blocks(block_rows, pooling="cls"))), -x)


def test_stash_read_rows_in_any_order(stash: tuple[VectorStash, np.ndarray]) -> None:
    s, x = stash
    rows = np.array([22, 0, 9, 10, 16, 17, 3, 9])  # across part boundaries, unsorted, repeated
    np.testing.assert_array_equal(s.read_rows(rows), x[rows])
    np.testing.assert_array_equal(s.read_rows(rows, pooling="cls"), -x[rows])
    assert s.read_rows(np.array([], dtype=np.int64)).shape == (0, 5)


def test_stash_sample(stash: tuple[VectorStash, np.ndarray]) -> None:
    s, x = stash
    sample = s.sample(8, seed=3)
    assert sample.shape == (8, 5)
    # every sampled row is a distinct row of x
    matches = [np.flatnonzero((x == row).all(axis=1)) for row in sample]
    assert all(len(m) == 1 for m in matches) and len({int(m[0]) for m in matches}) == 8
    np.testing.assert_array_equal(s.sample(8, seed=3), sample)  # seeded
    np.testing.assert_array_equal(s.sample(100), x)  # more than there are: all rows, in order


def test_stash_streaming_passes_keep_no_part_mapped(stash: tuple[VectorStash, np.ndarray]) -> None:
    """A kept memory map's pages stay in the process's resident set: a pass over the whole stash (moments, index
    filling, a training sample) must not keep them, or a process's RSS ends up holding the stash. Re-scoring's
    random reads do keep their maps (opened once per part)."""
    s, x = stash
    blocks = list(s.iter_blocks(4))
    assert all(not isinstance(b, np.memmap) and b.base is None for b in blocks)  # copies, not views of a map
    s.moments()
    s.sample(8)
    assert s._maps == {}
    np.testing.assert_array_equal(s.read_rows(np.array([3, 12]), keep=False), x[[3, 12]])
    assert s._maps == {}
    s.read_rows(np.array([3, 12]))
    assert sorted(s._maps) == [("mean", 0), ("mean", 1)]
    np.testing.assert_array_equal(np.concatenate(list(s.iter_blocks(4))), x)  # a kept map is read, not re-opened


def test_stash_ids_stream_part_by_part(stash: tuple[VectorStash, np.ndarray]) -> None:
    s, _ = stash
    assert [len(ids) for ids in s.iter_ids()] == [10, 7, 6]
    assert s.ids() == [f"r{i}" for i in range(23)]


def test_stash_float16(tmp_path: Path) -> None:
    x = np.random.default_rng(1).normal(size=(9, 4)).astype(np.float32)
    s = VectorStash.create(tmp_path / "s", 4, ["mean"], dtype="float16")
    s.append({"mean": x}, [str(i) for i in range(9)], [""] * 9)
    got = np.concatenate(list(VectorStash.open(tmp_path / "s").iter_blocks()))
    assert got.dtype == np.float32
    # float16 keeps 11 significant bits: relative error <= 2**-11
    np.testing.assert_allclose(got, x, rtol=2**-11, atol=1e-4)


def test_a_size_only_stash_check_catches_a_truncated_part(stash: tuple[VectorStash, np.ndarray]) -> None:
    """``verify(full=False)`` (what add does before linking the vectors) hashes nothing but checks every size."""
    s, _ = stash
    part = s.root / s.parts[1].vectors["cls"]
    part.write_bytes(part.read_bytes()[:-4])
    with pytest.raises(IndexDirError, match="checksum mismatch"):
        s.verify(full=False)


def test_a_stash_of_another_format_is_refused(stash: tuple[VectorStash, np.ndarray]) -> None:
    s, _ = stash
    state = json.loads((s.root / "stash.json").read_text())
    (s.root / "stash.json").write_text(json.dumps(state | {"format": 1}))
    with pytest.raises(IndexDirError, match="has format 1; this version reads format 2 or 3"):
        VectorStash.open(s.root)


def test_a_part_of_the_wrong_shape_or_poolings_is_refused(stash: tuple[VectorStash, np.ndarray]) -> None:
    s, x = stash
    np.save(s.root / s.parts[0].vectors["mean"], x[:9])  # a readable .npy, one row short of its part's 10
    with pytest.raises(IndexDirError, match=r"has shape \(9, 5\)"):
        list(VectorStash.open(s.root).iter_parts("mean"))
    with pytest.raises(ValueError, match="holds poolings"):
        s.register([s.parts[1].__class__(1, {"mean": "p.mean.npy"}, "p.parquet")])  # no "cls"
    assert len(VectorStash.open(s.root)) == 23  # nothing registered
    with pytest.raises(ValueError, match="vectors \\(2, 5\\) for 3 rows"):
        s.append({"mean": x[:3], "cls": x[:2]}, ["a", "b", "c"], ["a", "b", "c"])


def test_stash_errors(stash: tuple[VectorStash, np.ndarray], tmp_path: Path) -> None:
    s, _ = stash
    with pytest.raises(ConfigError, match="not 'first-last-avg'"):
        list(s.iter_parts("first-last-avg"))
    with pytest.raises(ConfigError, match="unknown `stash_dtype`"):
        VectorStash.create(tmp_path / "x", 4, ["mean"], dtype="int4")
    with pytest.raises(IndexDirError, match="no vector stash"):
        VectorStash.open(tmp_path / "missing")


@pytest.mark.parametrize("name", ["moments.npz", "transform.npz"])
def test_truncated_npz_files_are_index_errors(built: tuple[Path, FakeEncoder, Manifest], name: str) -> None:
    path = built[0] / name
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(IndexDirError, match="cannot read"):
        RunningMoments.load(path) if name == "moments.npz" else load_transform(path)


# ----- found by mutation testing -------------------------------------------------------------------------
def test_window_rows_below_one_is_refused_before_anything_is_written(corpus: Path, tmp_path: Path) -> None:
    encoder = FakeEncoder()
    with pytest.raises(ConfigError, match=r"`window_rows` must be at least 1 \(got 0\)"):
        build(corpus, tmp_path / "idx", encoder, options=BuildOptions(window_rows=0))
    assert encoder.calls == 0 and list(tmp_path.iterdir()) == [corpus]


def test_an_ivf_is_checked_against_the_usable_rows_before_encoding(tmp_path: Path) -> None:
    """40 rows, 30 of them empty: 10 usable rows cannot train 20 lists; said before any row is encoded."""
    texts = [f"text number {i}" if i % 4 == 0 else "" for i in range(40)]
    path = write_corpus(tmp_path / "c.parquet", n=40, text=texts)
    encoder = FakeEncoder()
    with pytest.raises(ConfigError, match=r"IVF with 20 lists needs at least that many training rows \(got 10\)"):
        build_index(
            CorpusSpec(path, skip_empty=True),
            encoder,
            tmp_path / "idx",
            TransformSpec(dim=4),
            IndexSpec("ivf", nlist=20),
        )
    assert encoder.calls == 0


def test_a_pooling_the_build_does_not_stash_is_refused_before_encoding(corpus: Path, tmp_path: Path) -> None:
    encoder = FakeEncoder()  # mean pooling only
    with pytest.raises(ConfigError, match=r"cannot fit on pooling 'cls': this build stashes mean"):
        build_index(CorpusSpec(corpus), encoder, tmp_path / "idx", TransformSpec(dim=4, pooling="cls"))
    assert encoder.calls == 0 and not (tmp_path / "idx").exists()


def test_resume_refuses_a_work_directory_holding_a_symbolic_link(
    built: tuple[Path, FakeEncoder, Manifest], corpus: Path, tmp_path: Path
) -> None:
    out = built[0]
    with pytest.raises(RuntimeError, match="out of memory"):
        build(corpus, out, FailingEncoder(3, "crash"), options=BuildOptions(overwrite=True, window_rows=50))
    outside = tmp_path / "outside.txt"
    outside.write_text("not the index's")
    (files.work_dir(out) / "vectors" / "planted").symlink_to(outside)
    with pytest.raises(IndexDirError, match=r"contains a symbolic link \(planted\)"):
        build(corpus, out, FakeEncoder(), options=BuildOptions(overwrite=True, window_rows=50, resume=True))
    assert outside.read_text() == "not the index's"


def test_a_build_without_resume_starts_over_from_an_interrupted_one(
    built: tuple[Path, FakeEncoder, Manifest], corpus: Path
) -> None:
    out = built[0]
    with pytest.raises(RuntimeError, match="out of memory"):
        build(corpus, out, FailingEncoder(3, "crash"), options=BuildOptions(overwrite=True, window_rows=50))
    encoder = FakeEncoder()
    manifest = build(corpus, out, encoder, options=BuildOptions(overwrite=True, window_rows=50))
    assert encoder.rows == N and manifest.n == N  # every row encoded again, none taken from the work left


def test_replacing_an_index_whose_manifest_cannot_be_read_starts_the_count_at_one(
    built: tuple[Path, FakeEncoder, Manifest], corpus: Path
) -> None:
    """An index this tool built (a manifest of a newer schema, say) whose manifest this version cannot read."""
    out = built[0]
    data = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps(data | {"schema_version": SCHEMA_VERSION + 1}))
    with pytest.raises(IndexDirError):
        IndexDir(out).manifest()
    manifest = build(corpus, out, options=BuildOptions(overwrite=True))
    assert manifest.generation == 1 and IndexDir(out).manifest().generation == 1


def test_windows_are_sized_for_the_corpus_and_the_engine() -> None:
    """Distributed: a power of two near rows / 2048 in [512, 65536]; local: 2,048 until that grows past it, so a
    100M-row build stays at a few thousand stash parts either way (each part's registration rewrites stash.json)."""
    from retrieval.build import WINDOW_ROWS, window_rows

    assert window_rows(5183) == 512 and window_rows(5183, distributed=False) == WINDOW_ROWS == 2048
    assert window_rows(10_000_000, distributed=False) == window_rows(10_000_000) == 8192
    assert window_rows(10**9, distributed=False) == 65536
