"""Growing and re-fitting an index directory: refit, add, drift, and the .npy / bad-vector inputs they take."""

from __future__ import annotations

import os
import tracemalloc
import warnings
from pathlib import Path

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer.main
from conftest import FakeEncoder
from typer.testing import CliRunner

from retrieval import files, update
from retrieval.build import BuildOptions, build_index
from retrieval.cli.app import app
from retrieval.corpus import CorpusSpec
from retrieval.docs import Docs
from retrieval.encode.spec import EncoderInfo
from retrieval.errors import ConfigError, CorpusError, IndexDirError
from retrieval.index import IndexSpec, load_index
from retrieval.indexdir import DOCS, INDEX, MANIFEST, MOMENTS, STASH, TRANSFORM, IndexDir
from retrieval.info import describe_index
from retrieval.manifest import Manifest
from retrieval.moments import RunningMoments
from retrieval.search import Searcher, SearchParams
from retrieval.stash import VectorStash
from retrieval.whitening import Drift, TransformSpec, Whitening, kernel_drift, load_transform

OPTIONS = BuildOptions(window_rows=64)  # several stash parts, the last one short
runner = CliRunner()


def build(corpus: Path, out: Path, encoder=None, transform=TransformSpec(dim=8), **kwargs):  # type: ignore[no-untyped-def]
    return build_index(CorpusSpec(corpus), encoder or FakeEncoder(), out, transform, options=OPTIONS, **kwargs)


def index_vectors(directory: Path) -> np.ndarray:
    index = load_index(directory / INDEX)
    return faiss.rev_swig_ptr(index.get_xb(), index.ntotal * index.d).reshape(index.ntotal, index.d).copy()


def ids_of(directory: Path) -> list[str]:
    return Docs(directory / DOCS).ids


def anisotropic(n: int, d: int = 16, seed: int = 1338, shift: float = 0.0) -> np.ndarray:
    """Large common mean, low intrinsic rank; ``shift`` rotates the signal towards other directions."""
    rng = np.random.default_rng(seed)
    basis = np.random.default_rng(7).normal(size=(4, d)) * np.array([3.0, 2.0, 1.0, 0.5])[:, None]
    if shift:
        basis = basis + shift * np.random.default_rng(8).normal(size=(4, d)) * 3
    mean = np.random.default_rng(9).normal(size=d) * 5 + 10
    return (mean + rng.normal(size=(n, 4)) @ basis + 0.05 * rng.normal(size=(n, d))).astype(np.float32)


def more_docs(path: Path, ids: list[str]) -> Path:
    pq.write_table(pa.table({"id": ids, "text": [f"a brand new passage {i} on whitening" for i in ids]}), path)
    return path


# ----- refit -------------------------------------------------------------------------------------------------
def test_refit_equals_a_clean_build_and_never_encodes(tmp_path, corpus, monkeypatch):
    monkeypatch.setattr("retrieval.update.from_info", lambda *a, **k: pytest.fail("refit loaded an encoder"))
    directory = tmp_path / "idx"
    build(corpus, directory)
    part = IndexDir(directory).stash().files()[1]
    inode = os.stat(part).st_ino
    target = TransformSpec(dim=6, gamma=1.0, epsilon=1e-5)

    manifest = update.refit(directory, target, IndexSpec("hnsw", m=16))
    clean = build(corpus, tmp_path / "clean", transform=target, index=IndexSpec("hnsw", m=16))

    a, b = load_transform(directory / TRANSFORM), load_transform(tmp_path / "clean" / TRANSFORM)
    assert isinstance(a, Whitening) and isinstance(b, Whitening)
    # Same float64 moments on both sides: the kernels agree to rounding.
    np.testing.assert_allclose(a.kernel, b.kernel, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(a.mean, b.mean, rtol=1e-12)
    assert manifest.transform.dim == 6 and manifest.index.kind == "hnsw" and manifest.n == clean.n
    assert manifest.generation == 2 and clean.generation == 1
    # HNSW stores its vectors flat underneath; float32 transform of identical inputs -> 1e-6.
    got = load_index(directory / INDEX).reconstruct_n(0, manifest.n)
    want = load_index(tmp_path / "clean" / INDEX).reconstruct_n(0, clean.n)
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert ids_of(directory) == ids_of(tmp_path / "clean")
    assert os.stat(directory / part.relative_to(directory)).st_ino == inode  # hard-linked, not copied
    assert not files_beside(directory)
    verify_loads(directory)


def files_beside(directory: Path) -> list[str]:
    """Work directories left beside an index (there should be none after a finished or failed update)."""
    return [p.name for p in directory.parent.iterdir() if p.name.startswith(f".{directory.name}.")]


def verify_loads(directory: Path) -> None:
    """The directory loads and every file matches its checksum."""
    searcher = Searcher.load(directory, encoder=FakeEncoder())
    IndexDir(directory).verify(searcher.manifest, "full")


def test_refit_to_another_pooling_streams_the_stash(tmp_path, monkeypatch):
    vectors = anisotropic(200)
    path = tmp_path / "v.npy"
    np.save(path, vectors)
    directory = tmp_path / "idx"
    build_index(CorpusSpec(path), None, directory, TransformSpec(dim=4), options=OPTIONS)
    # same pooling: the moments come from moments.npz, not from a pass over the stash
    monkeypatch.setattr(VectorStash, "moments", lambda *a: pytest.fail("refit streamed the stash"))
    update.refit(directory, TransformSpec(dim=4, pooling="vectors"), None)
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="not 'cls'"):
        update.refit(directory, TransformSpec(pooling="cls"))
    np.testing.assert_allclose(
        IndexDir(directory).stash().moments().covariance(), np.cov(vectors.T, bias=True), rtol=1e-6, atol=1e-9
    )


def test_refit_to_a_stashed_pooling_fits_and_records_that_pooling(tmp_path, corpus, tiny_bert):
    """A build that stashed cls beside mean, refitted to cls: the kernel comes from the cls vectors (one float64
    pass over the stash), queries are pooled with cls, and the re-scoring scorer is recorded for cls too."""
    from retrieval.encode.transformer import TransformerEncoder

    encoder = TransformerEncoder(str(tiny_bert), max_length=48, precision="fp32")
    directory = tmp_path / "idx"
    build_index(
        CorpusSpec(corpus), encoder, directory, TransformSpec(dim=8), options=BuildOptions(extra_poolings=("cls",))
    )
    stash = IndexDir(directory).stash()
    cls = np.concatenate(list(stash.iter_parts("cls"))).astype(np.float64)
    mean = np.concatenate(list(stash.iter_parts("mean"))).astype(np.float64)
    assert np.abs(cls.mean(axis=0) - mean.mean(axis=0)).max() > 1e-2  # the two poolings differ

    # an explicit scorer without a pooling: it is fitted and recorded for the pooling of the refit
    manifest = update.refit(directory, TransformSpec(dim=8, pooling="cls"), None, scorer=TransformSpec(gamma=0.5))
    fitted = load_transform(directory / TRANSFORM)
    assert isinstance(fitted, Whitening)
    np.testing.assert_allclose(fitted.mean, cls.mean(axis=0), rtol=1e-9, atol=1e-9)  # float64 sums of float32 rows
    reference = TransformSpec(dim=8, pooling="cls").fit(RunningMoments.from_array(cls))  # one-shot float64
    np.testing.assert_allclose(np.abs(fitted.kernel), np.abs(reference.kernel), rtol=1e-6, atol=1e-9)
    assert manifest.transform.pooling == manifest.encoder.pooling == "cls"
    assert manifest.rescoring.scorer.pooling == "cls" and manifest.rescoring.scorer.gamma == 0.5
    assert Manifest.load(directory).encoder.pooling == "cls"


@pytest.mark.parametrize(
    ("index", "message"),
    [
        (IndexSpec("hnsw", m=1000), r"`m` \(HNSW neighbours per node\) must be between 2 and 512 \(got 1000\)"),
        (IndexSpec("ivf", nlist=1000), r"IVF with 1000 lists needs at least that many training rows \(got 300\)"),
    ],
)
def test_refit_refuses_an_index_it_cannot_build_before_any_work(tmp_path, corpus, monkeypatch, index, message):
    directory = tmp_path / "idx"
    build(corpus, directory)
    monkeypatch.setattr(update, "write_version", lambda *a, **k: pytest.fail("refit started building"))
    with pytest.raises(ConfigError, match=message):
        update.refit(directory, TransformSpec(dim=4), index)
    assert Manifest.load(directory).generation == 1 and not files_beside(directory)


def test_transform_spec_applies_the_given_changes_and_lets_defaults_fill_the_rest(tmp_path, corpus):
    whitened, raw = tmp_path / "whitened", tmp_path / "raw"
    build(corpus, whitened, transform=TransformSpec(dim=8, gamma=0.5, center=True))
    build(corpus, raw, transform=TransformSpec.raw())
    kept = update.transform_spec(whitened)
    assert (kept.dim, kept.gamma, kept.center, kept.whitens, kept.pooling) == (8, 0.5, True, True, "mean")
    # no whitening: no kernel, so no kept dim, gamma or centring either
    off = update.transform_spec(whitened, whiten=False)
    assert (off.dim, off.gamma, off.center, off.whiten) == (None, None, None, False)
    assert off.resolve(16).dim == 16
    # a new dim: gamma kept, centring and whitening back to the defaults for that dim
    narrower = update.transform_spec(whitened, dim=4)
    assert (narrower.dim, narrower.gamma, narrower.center, narrower.whiten) == (4, 0.5, None, None)
    # a raw index reduced by a dim: it had no gamma to keep, so the default one
    reduced = update.transform_spec(raw, dim=4)
    assert (reduced.dim, reduced.gamma, reduced.whiten) == (4, None, None)
    assert reduced.resolve(16).whiten is True
    assert update.transform_spec(raw, dim=4, gamma=0.25).gamma == 0.25


def test_refit_refuses_a_directory_without_stash(tmp_path, corpus):
    directory = tmp_path / "idx"
    build_index(
        CorpusSpec(corpus), FakeEncoder(), directory, TransformSpec(dim=8), options=BuildOptions(keep_vectors=False)
    )
    with pytest.raises(IndexDirError, match="kept no raw-vector stash"):
        update.refit(directory, TransformSpec(dim=4))
    result = runner.invoke(app, ["refit", str(directory), "--dim", "4"])
    assert result.exit_code == 1 and "kept no raw-vector stash" in result.output


# ----- add ---------------------------------------------------------------------------------------------------
def test_add_then_search_finds_the_new_docs(tmp_path, corpus):
    directory = tmp_path / "idx"
    encoder = FakeEncoder()
    build(corpus, directory, encoder)
    kernel_before = (directory / TRANSFORM).read_bytes()
    new_ids = [f"new{i}" for i in range(40)]
    encoder.rows = 0

    manifest = update.add(directory, CorpusSpec(more_docs(tmp_path / "more.parquet", new_ids)), encoder)

    assert encoder.rows == 40  # only the new rows were encoded
    assert manifest.stash is not None
    assert manifest.n == 340 and manifest.stash.rows == 340 and manifest.corpus.added[-1]["rows"] == 40
    assert ids_of(directory)[-40:] == new_ids and len(VectorStash.open(directory / STASH)) == 340
    assert (directory / TRANSFORM).read_bytes() == kernel_before  # the existing kernel
    searcher = Searcher.load(directory, encoder=FakeEncoder())
    IndexDir(directory).verify(searcher.manifest, "full")
    for i in (0, 17, 39):
        assert searcher.search(f"a brand new passage new{i} on whitening", SearchParams(k=1))[0].id == f"new{i}"
    # The index holds every stash row through the old kernel; the moments cover all rows (float64 -> 1e-9).
    stash = IndexDir(directory).stash()
    raw = np.concatenate(list(stash.iter_blocks()))
    np.testing.assert_allclose(index_vectors(directory), searcher.transform.transform(raw), atol=1e-6)
    moments = RunningMoments.load(directory / MOMENTS)
    np.testing.assert_allclose(moments.covariance(), np.cov(raw.T.astype(np.float64), bias=True), rtol=1e-9)
    assert not files_beside(directory)


def titled(path: Path, ids: list[str], vectors: np.ndarray | None = None) -> Path:
    """A BEIR-shaped corpus: ids in ``doc_id``, a ``title`` and a ``body``; with ``vectors``, also an ``emb``."""
    columns = {
        "doc_id": ids,
        "title": [f"Title {i}" for i in ids],
        "body": [f"the passage of document {i} on whitening" for i in ids],
    }
    if vectors is not None:
        columns["emb"] = [row.tolist() for row in vectors]
    pq.write_table(pa.table(columns), path)
    return path


def test_small_adds_do_not_pile_up_stash_parts(tmp_path, corpus):
    """Each add wrote a part, and a reader keeps every part open (re-scoring): 150 one-row adds were 155 parts,
    155 open files. The short parts at the end are merged; the build's full parts are linked, never copied."""
    directory = tmp_path / "idx"
    build(corpus, directory)  # 300 rows in windows of 64: four full parts and one of 44
    stash = IndexDir(directory).stash()
    full = [p for p in stash.parts if p.rows == 64]
    inodes = {name: os.stat(stash.root / name).st_ino for p in full for name in p.names}
    ids, texts = stash.ids(), [t for table in stash.iter_docs() for t in table["text"].to_pylist()]
    for i in range(12):
        update.add(directory, CorpusSpec(more_docs(tmp_path / f"m{i}.parquet", [f"new{i}"])), FakeEncoder())
        ids.append(f"new{i}")
        texts.append(f"a brand new passage new{i} on whitening")
    stash = IndexDir(directory).stash()
    assert [p.rows for p in stash.parts] == [64] * len(full) + [44 + 12]
    assert {name: os.stat(stash.root / name).st_ino for p in full for name in p.names} == inodes
    assert sorted(p.name for p in stash.root.iterdir()) == sorted(p.name for p in stash.files())  # none left over
    stash.verify(full=True)
    assert stash.ids() == ids
    np.testing.assert_array_equal(np.concatenate(list(stash.iter_blocks())), FakeEncoder().encode(texts))
    searcher = Searcher.load(directory, encoder=FakeEncoder())
    assert searcher.search(texts[-1], SearchParams(k=1))[0].id == "new11"
    big = more_docs(tmp_path / "big.parquet", [f"big{i}" for i in range(150)])
    update.add(directory, CorpusSpec(big), FakeEncoder(), window_rows=64)  # two windows of 64 and one of 22
    assert [p.rows for p in IndexDir(directory).stash().parts] == [64] * len(full) + [56, 64, 64, 22]


def test_an_add_after_a_remove_copies_no_more_than_a_part(tmp_path, corpus):
    """A remove rewrites the parts it touches shorter: the first merge took them all (a 1-row add rewrote nearly
    the whole stash, in memory). The merged part stays within the largest part's rows."""
    directory = tmp_path / "idx"
    build(corpus, directory)  # [64, 64, 64, 64, 44]
    update.remove(directory, ["doc70", "doc140", "doc200"])  # one from each of parts 1-3
    assert [p.rows for p in IndexDir(directory).stash().parts] == [64, 63, 63, 63, 44]
    update.add(directory, CorpusSpec(more_docs(tmp_path / "m.parquet", ["new0"])), FakeEncoder())
    stash = IndexDir(directory).stash()
    assert [p.rows for p in stash.parts] == [64, 63, 63, 63, 45]
    kept = [f"doc{i}" for i in range(300) if i not in (70, 140, 200)]
    assert stash.ids() == [*kept, "new0"]
    stash.verify(full=True)


def test_add_reads_new_rows_as_the_index_was_built(tmp_path):
    """Before: `retrieval add` read a new file of the same shape with the CLI's own defaults, not the build's:
    row-number ids (`300`), untitled texts from `text` (a missing column). Now what was not given is as built."""
    directory, encoder = tmp_path / "idx", FakeEncoder()
    first = titled(tmp_path / "a.parquet", [f"d{i}" for i in range(300)])
    spec = CorpusSpec(first, text_column="body", id_column="doc_id", title_column="title")
    build_index(spec, encoder, directory, TransformSpec(dim=8), options=OPTIONS)
    more = titled(tmp_path / "b.parquet", ["x1", "x2"])

    like = update.read_like_build(directory, more)
    assert (like.path, like.text_column, like.id_column, like.title_column) == (more, "body", "doc_id", "title")
    update.add(directory, like, encoder)
    docs = Docs(directory / DOCS)
    assert docs.ids[-2:] == ["x1", "x2"] and docs.texts([300]) == ["Title x1 the passage of document x1 on whitening"]
    # what is given wins; "" asks for none (row-number ids, no title)
    assert update.read_like_build(directory, more, text_column="title").text_column == "title"
    bare = update.read_like_build(directory, more, id_column="", title_column="")
    assert (bare.id_column, bare.title_column, bare.text_column) == (None, None, "body")
    with pytest.raises(TypeError, match="unexpected options"):
        update.read_like_build(directory, more, title="title")


def test_cli_add_takes_the_build_s_vectors_id_and_title_columns(tmp_path):
    """An index built from a vectors column (no texts kept): `add` of a file of the same shape needs no options
    (before, it looked for a `text` column to encode and refused)."""
    directory = tmp_path / "idx"
    built = titled(tmp_path / "a.parquet", [f"d{i}" for i in range(200)], anisotropic(200))
    options = ["--id-column", "doc_id", "--title-column", "title", "--text-column", "body", "--vectors-column", "emb"]
    result = runner.invoke(app, ["index", str(built), "--out", str(directory), "--dim", "4", *options])
    assert result.exit_code == 0, result.output
    more = titled(tmp_path / "b.parquet", ["x1", "x2", "x3"], anisotropic(3, seed=5))
    result = runner.invoke(app, ["add", str(directory), str(more)])
    assert result.exit_code == 0, result.output
    assert ids_of(directory)[-3:] == ["x1", "x2", "x3"]
    added = IndexDir(directory).manifest().corpus.added[-1]
    assert (added["id_column"], added["title_column"], added["vectors_column"]) == ("doc_id", "title", "emb")


@pytest.mark.parametrize("action", ["add", "refit"])
def test_add_links_old_parts_unread_and_refit_verifies_what_it_reads(tmp_path, corpus, monkeypatch, action):
    """Stash parts are written once, checksummed as they are written. add only links the old parts' vectors (it
    checks their sizes, not their bytes) but reads their (id, text) files again, so it verifies those; refit
    reads every part, so it verifies every part's sha256 first."""
    directory = tmp_path / "idx"
    build(corpus, directory)
    old_parts = {name for part in IndexDir(directory).stash().parts for name in part.checksums}
    assert len(old_parts) == 10  # 300 rows in windows of 64: 5 parts, a parquet and a .npy each
    hashed: list[str] = []
    real_sha256 = files.sha256
    monkeypatch.setattr("retrieval.stash.sha256", lambda path: hashed.append(path.name) or real_sha256(path))

    if action == "add":
        update.add(directory, CorpusSpec(more_docs(tmp_path / "more.parquet", ["n1", "n2"])), FakeEncoder())
        assert old_parts & set(hashed) == {name for name in old_parts if name.endswith(".parquet")}
    else:
        update.refit(directory, TransformSpec(dim=4))
        assert old_parts <= set(hashed)
    monkeypatch.undo()
    IndexDir(directory).verify(Manifest.load(directory), "full")  # every recorded checksum is still true


def test_a_searcher_keeps_its_mapped_version_while_add_and_refit_publish_new_ones(tmp_path, corpus):
    """A Searcher maps index.faiss; add and refit write new files and swap the directory, never rewriting a
    file in place, so an open searcher keeps answering from its version (and a writer never adds to a map)."""
    directory = tmp_path / "idx"
    build(corpus, directory)
    searcher = Searcher.load(directory, FakeEncoder())
    before = searcher.search_raw(FakeEncoder().encode(["a query about topic 3"]), SearchParams(k=5))
    update.add(directory, CorpusSpec(more_docs(tmp_path / "more.parquet", ["new1", "new2"])), FakeEncoder())
    update.refit(directory, TransformSpec(dim=4))
    again = searcher.search_raw(FakeEncoder().encode(["a query about topic 3"]), SearchParams(k=5))
    np.testing.assert_array_equal(again[1], before[1])
    np.testing.assert_array_equal(again[0], before[0])
    assert searcher.index.ntotal == 300 and Searcher.load(directory, FakeEncoder()).index.ntotal == 302


def test_add_with_duplicate_ids_is_refused_and_writes_nothing(tmp_path, corpus):
    directory = tmp_path / "idx"
    build(corpus, directory)
    before = {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}
    encoder = FakeEncoder()
    more = more_docs(tmp_path / "more.parquet", ["new1", "doc5", "new2", "doc7"])
    with pytest.raises(CorpusError, match=r"2 ids .* already in the index \(first: doc5, doc7\)"):
        update.add(directory, CorpusSpec(more), encoder)
    assert encoder.rows == 0
    assert {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()} == before
    assert not files_beside(directory)


def test_add_finds_clashes_among_equal_hashes(tmp_path, corpus, monkeypatch):
    """add keeps 8-byte hashes of the new ids, not the index's ids: every hash equal forces the exact check."""
    monkeypatch.setattr(update, "id_hashes", lambda ids: np.zeros(len(ids), dtype=np.int64))
    directory = tmp_path / "idx"
    build(corpus, directory)
    with pytest.raises(CorpusError, match=r"1 ids .* already in the index \(first: doc9\)"):
        update.add(directory, CorpusSpec(more_docs(tmp_path / "clash.parquet", ["new1", "doc9"])), FakeEncoder())
    update.add(directory, CorpusSpec(more_docs(tmp_path / "fresh.parquet", ["new1", "new2"])), FakeEncoder())
    assert ids_of(directory)[-2:] == ["new1", "new2"]


def test_the_clash_check_does_not_hold_the_index_ids(tmp_path):
    """Peak Python allocations of add's id check against 6,000 and 60,000 stashed ids: one stash part's ids at a
    time, so the peak does not grow with the index (a set of its ids would grow by ~110 bytes per id)."""
    from retrieval.corpus import Corpus

    new = Corpus(CorpusSpec(more_docs(tmp_path / "new.parquet", [f"new-{i}" for i in range(100)])))
    peaks = []
    for n in (6_000, 60_000):
        stash = VectorStash.create(tmp_path / f"stash{n}", 2, ["mean"])
        for start in range(0, n, 2_000):
            ids = [f"document-{i:012d}" for i in range(start, start + 2_000)]
            stash.append({"mean": np.zeros((2_000, 2), np.float32)}, ids, [""] * 2_000)
        tracemalloc.start()
        update._check_new_ids(stash, new, 64)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert peaks[1] < 1.5 * peaks[0], peaks


def test_add_refuses_mismatched_width_and_kind(tmp_path, corpus):
    vec_dir = tmp_path / "vec"
    np.save(tmp_path / "v.npy", anisotropic(100))
    build_index(CorpusSpec(tmp_path / "v.npy"), None, vec_dir, TransformSpec(dim=4), options=OPTIONS)
    np.save(tmp_path / "narrow.npy", anisotropic(10, d=8))
    with pytest.raises(CorpusError, match="8-d vectors; the index .* takes 16-d"):
        update.add(vec_dir, CorpusSpec(tmp_path / "narrow.npy"))
    result = runner.invoke(app, ["add", str(vec_dir), str(tmp_path / "narrow.npy")])
    assert result.exit_code == 1 and "takes 16-d" in result.output
    with pytest.raises(ConfigError, match="built from precomputed vectors"):
        update.add(vec_dir, CorpusSpec(more_docs(tmp_path / "more.parquet", ["x"])))
    text_dir = tmp_path / "text"
    build(corpus, text_dir)
    with pytest.raises(ConfigError, match="add texts, not precomputed vectors"):
        update.add(text_dir, CorpusSpec(tmp_path / "v.npy"))
    with pytest.raises(ConfigError, match="pooling"):
        update.add(text_dir, CorpusSpec(tmp_path / "more.parquet"), FakeEncoder(pooling="cls"))


def test_cli_add_npy_continues_row_ids_and_refit(tmp_path):
    np.save(tmp_path / "v.npy", anisotropic(200))
    np.save(tmp_path / "more.npy", anisotropic(30, seed=5))
    directory = tmp_path / "idx"
    result = runner.invoke(app, ["index", str(tmp_path / "v.npy"), "--out", str(directory), "--dim", "4"])
    assert result.exit_code == 0, result.output
    assert "16 -> 4 dims (gamma 0.3, uncentred," in result.output  # reduced: uncentred by default
    centred = runner.invoke(
        app, ["index", str(tmp_path / "v.npy"), "--out", str(tmp_path / "c"), "--dim", "4", "--center"]
    )
    assert centred.exit_code == 0 and "16 -> 4 dims (gamma 0.3, explained" in centred.output, centred.output
    assert Searcher.load(tmp_path / "c").transform.center  # type: ignore[union-attr]
    shown = runner.invoke(app, ["info", str(directory)])
    assert shown.exit_code == 0 and "second moment" in shown.output, shown.output
    assert "second moment" not in runner.invoke(app, ["info", str(tmp_path / "c")]).output
    result = runner.invoke(app, ["add", str(directory), str(tmp_path / "more.npy")])
    assert result.exit_code == 0, result.output
    assert "added 30 rows" in result.output
    assert ids_of(directory)[-30:] == [str(i) for i in range(200, 230)]
    searcher = Searcher.load(directory)
    assert [h[0].id for h in searcher.search_vectors(np.load(tmp_path / "more.npy")[[0, 29]], SearchParams(k=1))] == [
        "200",
        "229",
    ]

    result = runner.invoke(app, ["refit", str(directory), "--gamma", "1", "--index-type", "hnsw", "--m", "8"])
    assert result.exit_code == 0, result.output
    manifest = Searcher.load(directory).manifest
    assert manifest.transform.dim == 4 and manifest.transform.spec.gamma == 1.0  # --dim kept, --gamma changed
    assert manifest.transform.spec.center is False  # ... and the centring kept
    assert manifest.index.factory == "HNSW8" and manifest.n == 230
    assert manifest.corpus.added[0]["rows"] == 30  # history survives a refit
    result = runner.invoke(app, ["refit", str(directory), "--center"])
    assert result.exit_code == 0, result.output
    assert "gamma 1.0, explained" in result.output  # centred: no "uncentred" in the summary line
    transform = load_transform(directory / "transform.npz")
    assert isinstance(transform, Whitening) and transform.center and transform.gamma == 1.0
    result = runner.invoke(app, ["refit", str(directory), "--no-center"])
    assert result.exit_code == 0, result.output
    assert "gamma 1.0, uncentred" in result.output
    result = runner.invoke(app, ["refit", str(directory), "--dim", "16"])  # full rank: its own default, centred
    assert result.exit_code == 0, result.output
    assert Searcher.load(directory).manifest.transform.spec.center is True
    result = runner.invoke(app, ["refit", str(directory), "--no-whiten"])
    assert result.exit_code == 0, result.output
    assert Searcher.load(directory).manifest.transform.kind == "raw"
    result = runner.invoke(app, ["refit", str(directory), "--no-center"])
    assert result.exit_code != 0 and "no kernel to centre" in result.output


@pytest.mark.parametrize("command", ["add", "refit", "remove"])
def test_cli_commands_have_help_on_every_option(command):
    cmd = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    assert cmd.help
    for param in cmd.params:
        assert getattr(param, "help", None), f"{command} {param.name} has no help"
    assert runner.invoke(app, [command, "--help"]).exit_code == 0


# ----- drift -------------------------------------------------------------------------------------------------
def test_drift_is_zero_after_a_build_and_grows_with_shifted_rows(tmp_path):
    np.save(tmp_path / "v.npy", anisotropic(400))
    directory = tmp_path / "idx"
    build_index(CorpusSpec(tmp_path / "v.npy"), None, directory, TransformSpec(dim=4, gamma=1.0), options=OPTIONS)
    fresh = drift(directory)
    # Stored kernel vs the same moments: only eigh round-off.
    assert fresh.covariance_drift < 1e-9 and fresh.subspace_overlap > 1 - 1e-9 and fresh.rows_added == 0
    assert not fresh.refit_advised

    np.save(tmp_path / "same.npy", anisotropic(100, seed=3))  # same distribution: little drift
    update.add(directory, CorpusSpec(tmp_path / "same.npy"))
    same = drift(directory)
    np.save(tmp_path / "shifted.npy", anisotropic(400, seed=4, shift=1.0))
    update.add(directory, CorpusSpec(tmp_path / "shifted.npy"))
    shifted = drift(directory)
    assert same.rows_added == 100 and shifted.rows_added == 500
    assert same.covariance_drift < 0.1 < shifted.covariance_drift
    assert shifted.subspace_overlap < same.subspace_overlap <= 1
    assert shifted.refit_advised
    assert "kernel drift" in describe_index(directory)["summary"]
    assert "consider `retrieval refit`" in describe_index(directory)["summary"]["kernel drift"]
    assert describe_index(directory)["drift"] == shifted.to_dict()

    update.refit(directory, TransformSpec(dim=4, gamma=1.0))
    assert drift(directory).covariance_drift < 1e-9
    assert drift(directory).rows_added == 0


def test_drift_that_cannot_be_measured_is_said_so_and_info_still_works(tmp_path):
    """Two indexes whose drift is undefined: one fitted on identical rows (every ratio divided by a zero spread:
    1e306 was shown), one with epsilon 0 that a remove left rank-deficient (info failed with a refit's error).
    Each still searches; info shows why drift is not measured, and no drift numbers."""
    same = np.tile(anisotropic(1), (50, 1))
    np.save(tmp_path / "same.npy", same)
    np.save(tmp_path / "other.npy", anisotropic(50, seed=2))
    flat = tmp_path / "flat"
    build_index(CorpusSpec(tmp_path / "same.npy"), None, flat, TransformSpec(gamma=1.0, center=True), options=OPTIONS)
    update.add(flat, CorpusSpec(tmp_path / "other.npy"))
    np.save(tmp_path / "full.npy", anisotropic(100, seed=9))
    thin = tmp_path / "thin"
    spec = TransformSpec(gamma=1.0, epsilon=0.0, center=True)
    build_index(CorpusSpec(tmp_path / "full.npy"), None, thin, spec, options=OPTIONS)
    update.remove(thin, [str(i) for i in range(2, 100)])  # 2 rows left of 16 dims
    for directory, reason in [
        (flat, "the kernel was fitted on identical rows"),
        (thin, "a refit of the current rows with the kernel's settings would be refused: the covariance is singular"),
    ]:
        report = describe_index(directory)
        assert report["summary"]["kernel drift"].startswith(f"not measured: {reason}") and report["drift"] == {}
        result = runner.invoke(app, ["info", str(directory)])
        assert result.exit_code == 0 and "not measured" in result.output, result.output
        assert Searcher.load(directory).search_vectors(anisotropic(1, seed=2), SearchParams(k=2))[0]


def drift(directory: Path) -> Drift:
    transform = IndexDir(directory).transform()
    assert isinstance(transform, Whitening)
    return kernel_drift(transform, IndexDir(directory).moments())


# ----- .npy and bad vectors ---------------------------------------------------------------------------------
def test_npy_input_builds_like_a_vectors_column(tmp_path):
    vectors = anisotropic(150)
    np.save(tmp_path / "v.npy", vectors)
    pq.write_table(pa.table({"emb": pa.array(list(vectors), pa.list_(pa.float32(), 16))}), tmp_path / "v.parquet")
    a = build_index(CorpusSpec(tmp_path / "v.npy"), None, tmp_path / "a", TransformSpec(dim=6), options=OPTIONS)
    spec = CorpusSpec(tmp_path / "v.parquet", vectors_column="emb")
    build_index(spec, None, tmp_path / "b", TransformSpec(dim=6), options=OPTIONS)
    assert a.n == 150 and a.encoder == EncoderInfo(kind="vectors", dim=16)
    assert ids_of(tmp_path / "a") == [str(i) for i in range(150)] == ids_of(tmp_path / "b")
    np.testing.assert_allclose(index_vectors(tmp_path / "a"), index_vectors(tmp_path / "b"), atol=1e-6)


def test_float64_values_beyond_float32_are_refused_by_row_not_as_inf(tmp_path):
    """1e39 is finite in float64 and inf in float32: the cast warned (numpy RuntimeWarning) and the build then
    said the input held NaN or inf. One line naming the row (the .npy) or the column, and nothing written."""
    vectors = anisotropic(50).astype(np.float64)
    vectors[7, 3] = -2e39
    np.save(tmp_path / "v.npy", vectors)
    pq.write_table(pa.table({"emb": list(vectors)}), tmp_path / "v.parquet")
    for corpus, where in [(["v.npy"], "row 7 of"), (["v.parquet", "--vectors-column", "emb"], "column 'emb'")]:
        args = ["index", str(tmp_path / corpus[0]), *corpus[1:], "--out", str(tmp_path / "idx")]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a numpy overflow warning would fail the command
            result = runner.invoke(app, args)
        assert result.exit_code == 1, result.output
        assert f"{where}" in result.output and "holds -2e+39, beyond float32's range" in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1
        assert not (tmp_path / "idx").exists()


@pytest.mark.parametrize(
    ("array", "message"),
    [
        (np.zeros(10, dtype=np.float32), r"shape \(10,\); expected 2-D"),
        (np.zeros((2, 3, 4), dtype=np.float32), "expected 2-D"),
        (np.array([["a", "b"]]), "expected a float array"),
        (np.zeros((50, 0), dtype=np.float32), r"vectors of width 0 \(shape \(50, 0\)\)"),
    ],
)
def test_npy_that_is_not_a_matrix_of_numbers_is_refused(tmp_path, array, message):
    np.save(tmp_path / "bad.npy", array)
    with pytest.raises(CorpusError, match=message):
        build_index(CorpusSpec(tmp_path / "bad.npy"), None, tmp_path / "idx")
    result = runner.invoke(app, ["index", str(tmp_path / "bad.npy"), "--out", str(tmp_path / "idx")])
    assert result.exit_code == 1 and ("expected" in result.output or "width 0" in result.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.npy"]  # nothing written, not even a work dir


@pytest.mark.parametrize("content", [b"not numpy at all", b""])
def test_unreadable_npy_is_refused(tmp_path, content):
    """An empty file raised numpy's EOFError, which click turned into a bare "aborted"."""
    (tmp_path / "bad.npy").write_bytes(content)
    with pytest.raises(CorpusError, match="not a readable .npy"):
        build_index(CorpusSpec(tmp_path / "bad.npy"), None, tmp_path / "idx")
    result = runner.invoke(app, ["index", str(tmp_path / "bad.npy"), "--out", str(tmp_path / "idx")])
    assert result.exit_code == 1 and "bad.npy is not a readable .npy array" in result.output, result.output


@pytest.mark.parametrize("name", [MOMENTS, TRANSFORM])
def test_an_emptied_index_file_is_named_not_aborted(tmp_path, corpus, name):
    directory = tmp_path / "idx"
    build(corpus, directory)
    (directory / name).write_bytes(b"")
    result = runner.invoke(app, ["info", str(directory)])
    assert result.exit_code == 1 and f"{name}: No data left in file; rebuild the index" in result.output, result.output


def test_nan_and_inf_vectors_are_counted_and_named(tmp_path):
    vectors = anisotropic(300)
    vectors[[5, 130, 299], 2] = [np.nan, np.inf, -np.inf]
    np.save(tmp_path / "v.npy", vectors)
    with pytest.raises(CorpusError, match=r"3 of 300 vectors contain NaN or inf \(first ids: 5, 130, 299\)"):
        build_index(CorpusSpec(tmp_path / "v.npy"), None, tmp_path / "idx", options=OPTIONS)
    assert not (tmp_path / "idx").exists() and not files_beside(tmp_path / "idx")
    ids = [f"d{i}" for i in range(300)]
    table = pa.table({"id": ids, "emb": pa.array(list(vectors), pa.list_(pa.float32(), 16))})
    pq.write_table(table, tmp_path / "v.parquet", row_group_size=64)
    with pytest.raises(CorpusError, match=r"3 of 300 vectors contain NaN or inf \(first ids: d5, d130, d299\)"):
        build_index(CorpusSpec(tmp_path / "v.parquet", vectors_column="emb"), None, tmp_path / "idx")
    # ... and the same on add, before the index is touched
    np.save(tmp_path / "good.npy", anisotropic(100))
    build_index(CorpusSpec(tmp_path / "good.npy"), None, tmp_path / "idx", TransformSpec(dim=4), options=OPTIONS)
    before = (tmp_path / "idx" / MANIFEST).read_bytes()
    with pytest.raises(CorpusError, match="3 of 300 vectors contain NaN or inf"):
        update.add(tmp_path / "idx", CorpusSpec(tmp_path / "v.npy"))
    assert (tmp_path / "idx" / MANIFEST).read_bytes() == before


def test_width_mismatch_inside_a_vectors_column_is_refused(tmp_path):
    column = [[1.0, 2.0, 3.0]] * 70 + [[1.0, 2.0]] * 5
    pq.write_table(pa.table({"emb": column}), tmp_path / "v.parquet", row_group_size=64)
    with pytest.raises(CorpusError, match="different lengths|same width"):
        build_index(CorpusSpec(tmp_path / "v.parquet", vectors_column="emb"), None, tmp_path / "idx", options=OPTIONS)


def test_a_failure_midway_through_add_leaves_the_index_as_it_was(tmp_path, corpus, monkeypatch):
    directory = tmp_path / "idx"
    build(corpus, directory)
    before = {p.relative_to(directory): p.read_bytes() for p in directory.rglob("*") if p.is_file()}

    def disk_full(*args):  # type: ignore[no-untyped-def]
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("retrieval.docs.write_docs", disk_full)  # after new parts, moments and index are written
    with pytest.raises(IndexDirError, match="no space left on the device .* is unchanged"):
        update.add(directory, CorpusSpec(more_docs(tmp_path / "more.parquet", ["new1", "new2"])), FakeEncoder())
    assert {p.relative_to(directory): p.read_bytes() for p in directory.rglob("*") if p.is_file()} == before
    assert not files_beside(directory)


def test_each_add_is_a_new_generation_and_joins_the_history(tmp_path, corpus):
    directory = tmp_path / "idx"
    assert build(corpus, directory).generation == 1
    first = update.add(directory, CorpusSpec(more_docs(tmp_path / "a.parquet", ["a1", "a2", "a3"])), FakeEncoder())
    second = update.add(directory, CorpusSpec(more_docs(tmp_path / "b.parquet", ["b1", "b2"])), FakeEncoder())
    assert (first.generation, second.generation) == (2, 3)
    assert [(Path(a["path"]).name, a["rows"]) for a in second.corpus.added] == [("a.parquet", 3), ("b.parquet", 2)]
    assert second.n == 305 and ids_of(directory)[-5:] == ["a1", "a2", "a3", "b1", "b2"]
    assert update.refit(directory, TransformSpec(dim=4)).corpus.added == second.corpus.added


def test_row_number_ids_continue_past_the_highest_ascii_number(tmp_path):
    stash = VectorStash.create(tmp_path / "stash", 2, ["mean"])
    stash.append({"mean": np.zeros((3, 2), np.float32)}, ["0", "1", "7"], [""] * 3)
    assert update.next_row_number(stash) == 8  # past the highest id, not the row count
    stash.append({"mean": np.zeros((2, 2), np.float32)}, ["x12", "\u0669\u0669"], [""] * 2)  # not ASCII row numbers
    assert update.next_row_number(stash) == 8
    other = VectorStash.create(tmp_path / "other", 2, ["mean"])
    other.append({"mean": np.zeros((3, 2), np.float32)}, ["a", "b", "1"], [""] * 3)
    assert update.next_row_number(other) == 3  # past the row count when no id is higher


def test_adding_row_number_ids_reads_the_index_ids_once(tmp_path, monkeypatch):
    """Row-number ids start past every row number the index holds, so they need no clash pass over its ids."""
    np.save(tmp_path / "a.npy", anisotropic(150))
    np.save(tmp_path / "b.npy", anisotropic(20, seed=5))
    directory = tmp_path / "idx"
    build_index(CorpusSpec(tmp_path / "a.npy"), None, directory, TransformSpec(dim=4), options=OPTIONS)
    passes = []
    iter_ids = VectorStash.iter_ids
    monkeypatch.setattr(VectorStash, "iter_ids", lambda self: passes.append(1) or iter_ids(self))
    manifest = update.add(directory, CorpusSpec(tmp_path / "b.npy"), None)
    assert len(passes) == 1 and manifest.n == 170
    assert ids_of(directory)[148:] == [str(i) for i in range(148, 170)]


def test_add_refuses_a_corpus_without_a_usable_row_and_writes_nothing(tmp_path, corpus):
    directory = tmp_path / "idx"
    build(corpus, directory)
    before = {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"id": ["new1", "new2"], "text": ["", None]}), empty)
    with pytest.raises(CorpusError, match=r"0 usable row\(s\) \(2 skipped .*at least 1 are needed to add"):
        update.add(directory, CorpusSpec(empty, skip_empty=True), FakeEncoder())
    assert {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()} == before
