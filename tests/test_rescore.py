"""Re-scoring by default: recorded in the manifest; on when the index is reduced (k < d) and kept its stash; off
with ``rescore=0``; never without a stash; a full-rank scorer saved by refit (what ``tune --apply`` chooses),
used by search and kept by add; manifests written before the record get the same rule."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, FakeEncoder, write_corpus

from retrieval import indexdir, update
from retrieval.build import BuildOptions, build_index
from retrieval.corpus import CorpusSpec
from retrieval.errors import ConfigError, IndexDirError
from retrieval.index import IndexSpec
from retrieval.indexdir import MANIFEST, RESCORE, IndexDir, checksum, load
from retrieval.manifest import RESCORE_DEPTH, Manifest, RescoreRecord
from retrieval.moments import RunningMoments
from retrieval.search import Searcher, SearchParams
from retrieval.whitening import TransformSpec, Whitening, l2_normalize

RAW16 = TransformSpec(dim=16, gamma=None, whiten=False, pooling="mean")  # the raw scorer, as recorded


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("rescore") / "corpus.parquet")


def build(corpus: Path, out: Path, transform: TransformSpec, keep_vectors: bool = True) -> Manifest:
    return build_index(CorpusSpec(corpus), FakeEncoder(), out, transform, options=BuildOptions(keep_vectors))


@pytest.fixture(scope="module")
def reduced(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """16 -> 4 dims with the stash kept: re-scoring is on by default."""
    out = tmp_path_factory.mktemp("reduced") / "idx"
    build(corpus, out, TransformSpec(dim=4))
    return out


def queries(n: int = 8) -> np.ndarray:
    return FakeEncoder().encode([f"a question about topic {i}" for i in range(n)])


def test_the_manifest_records_the_default(corpus: Path, reduced: Path, tmp_path: Path) -> None:
    manifest = Manifest.load(reduced)
    assert manifest.rescore == RescoreRecord(RESCORE_DEPTH, RAW16)
    on_disk = json.loads((reduced / MANIFEST).read_text())["rescore"]
    assert on_disk == {"depth": RESCORE_DEPTH, "scorer": RAW16.to_dict()}
    assert not (reduced / RESCORE).exists()  # raw cosine needs no file
    # off where it cannot pay or cannot run: full dimension (raw or whitened), or no stash to read
    for name, spec, keep in (
        ("raw", TransformSpec(), True),
        ("full-rank", TransformSpec(whiten=True), True),
        ("no-stash", TransformSpec(dim=4), False),
    ):
        assert build(corpus, tmp_path / name, spec, keep).rescore == RescoreRecord(0, RAW16), name


def test_search_rescores_by_default_and_rescore_0_turns_it_off(reduced: Path) -> None:
    searcher = Searcher.load(reduced, encoder=FakeEncoder())
    raw = queries()
    assert searcher.rescore_depth(SearchParams()) == RESCORE_DEPTH
    default = searcher.search_raw(raw, SearchParams(k=5))
    explicit = searcher.search_raw(raw, SearchParams(k=5, rescore=RESCORE_DEPTH))
    off = searcher.search_raw(raw, SearchParams(k=5, rescore=0))
    np.testing.assert_array_equal(default[1], explicit[1])
    np.testing.assert_array_equal(default[0], explicit[0])
    plain = searcher.search_transformed(searcher.transform.transform(raw), 5)  # the reduced index alone
    np.testing.assert_array_equal(off[1], plain[1])
    assert not np.array_equal(default[1], off[1])  # the 4-dim order is not the 16-dim raw one
    # the default's hits: the reduced index's top RESCORE_DEPTH, ordered by raw cosine of the stashed vectors
    _, candidates = searcher.search_raw(raw, SearchParams(k=RESCORE_DEPTH, rescore=0))
    stash = IndexDir(reduced).stash()
    for q in range(len(raw)):
        cosines = l2_normalize(stash.read_rows(candidates[q])) @ l2_normalize(raw[q])
        assert default[1][q].tolist() == candidates[q][np.argsort(-cosines, kind="stable")[:5]].tolist()
    # asked for more hits than the default depth: every hit re-scored
    _, deep = searcher.search_raw(raw[:1], SearchParams(k=80))
    _, deep_off = searcher.search_raw(raw[:1], SearchParams(k=80, rescore=0))
    assert sorted(deep[0].tolist()) == sorted(deep_off[0].tolist()) and deep[0].tolist() != deep_off[0].tolist()


def test_no_stash_no_rescoring(corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    build(corpus, tmp_path / "idx", TransformSpec(dim=4), keep_vectors=False)
    searcher = Searcher.load(tmp_path / "idx", encoder=FakeEncoder())

    def no_stash() -> None:
        raise AssertionError("the stash was read")

    with monkeypatch.context() as patch:
        patch.setattr(searcher, "stash", no_stash)
        scores, rows = searcher.search_raw(queries(), SearchParams(k=5))  # the default: nothing to re-score
    assert rows.shape == (8, 5) and (rows >= 0).all()
    with pytest.raises(ConfigError, match="kept no raw-vector stash"):  # asked for explicitly: a clear error
        searcher.search_raw(queries(), SearchParams(k=5, rescore=10))


def test_a_manifest_without_the_record_gets_the_default_rule(reduced: Path, tmp_path: Path) -> None:
    old = Path(shutil.copytree(reduced, tmp_path / "old"))
    data = json.loads((old / MANIFEST).read_text())
    del data["rescore"]  # as written before re-scoring had a default (self-consistent: its own checksum redone)
    data["checksum"] = checksum(data)
    (old / MANIFEST).write_text(json.dumps(data))
    manifest = Manifest.load(old)
    assert manifest.rescore is None and manifest.rescoring == RescoreRecord(RESCORE_DEPTH, RAW16)
    assert Manifest.from_dict(manifest.to_dict()).rescore == RescoreRecord(RESCORE_DEPTH, RAW16)
    assert Searcher.load(old, encoder=FakeEncoder()).rescore_depth(SearchParams()) == RESCORE_DEPTH


def test_info_gives_the_true_reason_for_a_depth_of_0_recorded_on_a_reduced_index(
    corpus: Path, reduced: Path, tmp_path: Path
) -> None:
    """An older version recorded depth 0 for indexes it did not re-score by default (lossy FAISS codes): info
    said "the index keeps every dimension" of an index that does not."""
    from retrieval.info import describe_index

    old = Path(shutil.copytree(reduced, tmp_path / "old"))
    data = json.loads((old / MANIFEST).read_text())
    data["rescore"]["depth"] = 0
    data["checksum"] = checksum(data)
    (old / MANIFEST).write_text(json.dumps(data))
    line = describe_index(old)["summary"]["re-scoring"]
    assert line == "off by default, as this index records (`search --rescore N` re-scores)", line
    build(corpus, tmp_path / "full", TransformSpec(whiten=True))  # depth 0 by the rule: the reason stays
    assert "every dimension" in describe_index(tmp_path / "full")["summary"]["re-scoring"]


def test_a_full_rank_scorer_is_saved_used_and_kept(reduced: Path, tmp_path: Path) -> None:
    index = Path(shutil.copytree(reduced, tmp_path / "idx"))
    manifest = update.refit(index, TransformSpec(dim=4, gamma=0.5), scorer=TransformSpec(gamma=1.0, whiten=True))
    full = TransformSpec(dim=16, gamma=1.0, whiten=True, pooling="mean", center=True)
    assert manifest.rescore == RescoreRecord(RESCORE_DEPTH, full) and RESCORE in manifest.files
    searcher = Searcher.load(index, encoder=FakeEncoder())
    scorer = searcher.loaded.rescorer
    assert isinstance(scorer, Whitening) and (scorer.dim_in, scorer.dim_out, scorer.gamma) == (16, 16, 1.0)
    fresh = Whitening.fit(RunningMoments.load(index / "moments.npz"), dim=16, gamma=1.0)
    np.testing.assert_array_equal(scorer.kernel, fresh.kernel)  # saved bit for bit, not refitted at load
    raw = queries()
    _, candidates = searcher.search_raw(raw, SearchParams(k=RESCORE_DEPTH, rescore=0))
    scores, rows = searcher.search_raw(raw, SearchParams(k=5))
    stash = IndexDir(index).stash()
    for q in range(len(raw)):
        cosines = fresh.transform(stash.read_rows(candidates[q])) @ fresh.transform(raw[q])[0]
        best = np.argsort(-cosines, kind="stable")[:5]
        assert rows[q].tolist() == candidates[q][best].tolist()
        np.testing.assert_allclose(scores[q], cosines[best], atol=1e-5)  # float32 products in another order

    # add keeps the scorer (linked, as the kernel is); a refit without one keeps it; a full-dimension refit
    # turns re-scoring off
    before = (index / RESCORE).read_bytes()
    more = tmp_path / "more.parquet"
    pq.write_table(pa.table({"id": ["new1", "new2"], "text": ["one more document", "and another"]}), more)
    update.add(index, CorpusSpec(more), FakeEncoder())
    assert (index / RESCORE).read_bytes() == before and Manifest.load(index).rescore == manifest.rescore
    assert update.refit(index, TransformSpec(dim=6)).rescore == RescoreRecord(RESCORE_DEPTH, full)
    assert update.refit(index, TransformSpec.raw()).rescore == RescoreRecord(0, full)
    with pytest.raises(ConfigError, match="must keep all 16 dimensions"):
        update.refit(index, TransformSpec(dim=4), scorer=TransformSpec(dim=8, whiten=True))


def test_refit_back_to_raw_scoring_removes_the_file(reduced: Path, tmp_path: Path) -> None:
    index = Path(shutil.copytree(reduced, tmp_path / "idx"))
    update.refit(index, TransformSpec(dim=4), scorer=TransformSpec(whiten=True))
    assert (index / RESCORE).is_file()
    manifest = update.refit(index, TransformSpec(dim=4), scorer=TransformSpec.raw())
    assert manifest.rescore == RescoreRecord(RESCORE_DEPTH, RAW16) and not (index / RESCORE).exists()
    Searcher.load(index, encoder=FakeEncoder()).search_raw(queries(2), SearchParams(k=3))


def scored_copy(reduced: Path, tmp_path: Path) -> Path:
    """A copy of ``reduced`` re-scored by a full-rank whitening (what `tune --apply` may choose)."""
    index = Path(shutil.copytree(reduced, tmp_path / "idx"))
    update.refit(index, TransformSpec(dim=4), scorer=TransformSpec(gamma=1.0, whiten=True))
    return index


def test_a_replaced_scorer_file_is_refused_by_the_quick_check(reduced: Path, tmp_path: Path) -> None:
    index = scored_copy(reduced, tmp_path)
    other = Whitening.fit(RunningMoments.load(index / "moments.npz"), dim=16, gamma=0.5)  # valid, but not recorded
    other.save(index / RESCORE)
    with pytest.raises(IndexDirError, match=RESCORE):
        load(index, "quick")  # what every search does: the scorer is among the files it checks


def test_a_scorer_that_is_not_full_rank_is_refused(reduced: Path, tmp_path: Path) -> None:
    index = scored_copy(reduced, tmp_path)
    Whitening.fit(RunningMoments.load(index / "moments.npz"), dim=8, gamma=1.0).save(index / RESCORE)
    data = json.loads((index / MANIFEST).read_text())  # recorded as it is now: only the shape check can object
    data["files"][RESCORE] = indexdir._record(index / RESCORE)
    data["checksum"] = checksum(data)
    (index / MANIFEST).write_text(json.dumps(data))
    with pytest.raises(IndexDirError, match="not full-rank"):
        load(index, "full")


@pytest.mark.parametrize(
    ("factory", "depth"),
    [
        ("PCA8,HNSW16", RESCORE_DEPTH),
        ("IVF8,SQ8", RESCORE_DEPTH),
        ("IVF8,PQ4x4", RESCORE_DEPTH),
        ("PCA8,IVF8,PQ4x4,Refine(Flat)", RESCORE_DEPTH),  # the refine works in the PCA's 8 dimensions
        ("IVF8,RQ2x4", RESCORE_DEPTH),  # residual and additive quantisers are lossy too
        ("IVF8,LSQ2x4", RESCORE_DEPTH),
        ("IVF8,PQ4x4,Refine(PQ2x4)", RESCORE_DEPTH),  # a lossy refine
        ("IVF8,PQ4x4,Refine(Flat)", 0),  # exact scores at the end already
        ("IVF8,PQ4x4,RFlat", 0),  # FAISS's short form of it
        ("IVF8,SQfp16", 0),  # 16-bit codes: next to nothing lost
        ("HNSW16", 0),
        ("flat", 0),
    ],
)
def test_an_index_of_lossy_faiss_codes_rescores_by_default(tmp_path: Path, factory: str, depth: int) -> None:
    """A raw index whose FAISS codes drop information (a PCA inside the factory string, product or 8-bit
    codes) ranks by approximate scores the stash can correct, as a reduced index does: "PCA8,HNSW16" found 31% of
    the exact cosine top 10 (QA, 48-d vectors), 95% re-scoring 50 candidates."""
    rng = np.random.default_rng(3)
    vectors = (rng.standard_normal((600, 16)) * np.linspace(2, 0.5, 16)).astype(np.float32)
    np.save(tmp_path / "v.npy", vectors)
    manifest = build_index(
        CorpusSpec(tmp_path / "v.npy"), None, tmp_path / "idx", TransformSpec(), index=IndexSpec(factory)
    )
    assert manifest.transform.dim == manifest.transform.d == 16 and manifest.rescoring.depth == depth
    if factory == "PCA8,HNSW16":
        searcher = Searcher.load(tmp_path / "idx")
        exact = l2_normalize(vectors) @ l2_normalize(vectors[:50]).T
        truth = np.argsort(-exact, axis=0)[:10].T

        def recall(rescore: int | None) -> float:
            _, rows = searcher.search_raw(vectors[:50], SearchParams(k=10, rescore=rescore))
            return float(np.mean([len(set(r) & set(t)) / 10 for r, t in zip(rows, truth, strict=True)]))

        assert recall(None) > 0.95 > 0.8 > recall(0)
    refitted = update.refit(tmp_path / "idx", TransformSpec())  # a refit applies the same rule
    assert refitted.rescoring.depth == depth


def _fragmented(tmp_path: Path) -> Path:
    """An index whose stash is 60 parts of 5 rows (what many small adds, or a build of millions, comes to)."""
    out = tmp_path / "frag"
    spec = TransformSpec(dim=4)
    build_index(
        CorpusSpec(write_corpus(tmp_path / "c.parquet", n=300)),
        FakeEncoder(),
        out,
        spec,
        IndexSpec(),
        BuildOptions(window_rows=5),
    )
    return out


def test_rescoring_a_stash_of_more_parts_than_the_open_file_limit(tmp_path: Path) -> None:
    """Re-scoring keeps each part mapped, a descriptor each: past the soft limit (often 1,024) every search failed
    with "Too many open files". The soft limit is raised to the hard one, as Ray and most servers do."""
    import resource

    out = _fragmented(tmp_path)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert hard == resource.RLIM_INFINITY or hard > 200, "this test needs a hard limit above 200"
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 30, hard))
    try:
        searcher = Searcher.load(out, encoder=FakeEncoder())
        hits = searcher.search_vectors(queries(3), SearchParams(k=5, rescore=300))
        assert all(len(h) == 5 for h in hits)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 200
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.process
def test_a_hard_open_file_limit_below_the_stash_is_one_clear_error(tmp_path: Path) -> None:
    out = _fragmented(tmp_path)
    code = (
        "import resource, os, sys\n"
        "from conftest import FakeEncoder\n"
        "from retrieval.search import Searcher, SearchParams\n"
        "from retrieval.errors import IndexDirError\n"
        "limit = len(os.listdir('/proc/self/fd')) + 30\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))\n"
        "try:\n"
        f"    s = Searcher.load({str(out)!r}, encoder=FakeEncoder())\n"
        "    s.search_vectors(FakeEncoder().encode(['a question']), SearchParams(k=5, rescore=300))\n"
        "except IndexDirError as err:\n"
        "    print(err)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{Path(__file__).parent}"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Too many open files; the stash has 60 parts" in done.stdout and "`ulimit -n`" in done.stdout, done.stdout


# ----- re-scored rows read by pread ----------------------------------------------------------------------------
def _mapped(root: Path) -> list[str]:
    """The files under ``root`` this process has mapped."""
    inside = str(root.resolve())
    return [line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if inside in line]


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_rows_read_by_pread_are_the_mapped_rows_exactly(tmp_path: Path, dtype: str) -> None:
    from retrieval.stash import VectorStash

    rng = np.random.default_rng(5)
    stash = VectorStash.create(tmp_path / "s", 12, ["mean"], dtype)
    for size in (7, 40, 1, 33):  # parts of uneven sizes: rows cross them
        block = (rng.normal(size=(size, 12)) * rng.uniform(0.5, 4, size=(size, 1))).astype(np.float32)
        stash.append({"mean": block}, [str(i) for i in range(size)], [""] * size)
    opened, mapped = VectorStash.open(tmp_path / "s"), VectorStash.open(tmp_path / "s")
    for rows in (np.array([80, 0, 3, 3, 47, 46, 45, 6, 7, 8, 9, 79]), rng.integers(0, 81, 200), np.arange(81)):
        by_pread = opened.read_rows(rows, pread=True)
        assert not opened._maps
        np.testing.assert_array_equal(by_pread, mapped.read_rows(rows))  # the same bytes, decoded alike
    del mapped
    import gc

    gc.collect()
    assert not _mapped(tmp_path / "s")  # nothing mapped by pread
    assert opened.read_rows(np.zeros(0, dtype=np.int64), pread=True).shape == (0, 12)
    with pytest.raises(IndexError):
        opened.read_rows(np.array([81]), pread=True)
    # parts appended, then the short tail merged into one part, under the reader that has read them all before
    block = rng.normal(size=(5, 12)).astype(np.float32)
    opened.append({"mean": block}, [str(i) for i in range(5)], [""] * 5)
    assert np.abs(opened.read_rows(np.arange(81, 86), pread=True) - block).max() <= 2 / 255 * np.abs(block).sum(1).max()
    before = opened.read_rows(np.arange(86), pread=True)
    opened.merge_tail(40)  # the last three parts (1 + 33 + 5 rows) written again as one
    assert len(opened.parts) == 3
    merged = VectorStash.open(tmp_path / "s")
    np.testing.assert_array_equal(opened.read_rows(np.arange(86), pread=True), merged.read_rows(np.arange(86)))
    # int8 codes the merged rows again on their own ranges: within a step (2/255 of a row's length) of before
    step = 2 / 255 * np.linalg.norm(before, axis=1, keepdims=True) if dtype == "int8" else 1e-6
    assert (np.abs(opened.read_rows(np.arange(86), pread=True) - before) <= step + 1e-6).all()
    opened.close()


def test_a_part_cut_short_under_a_pread_reader_is_named(tmp_path: Path) -> None:
    from retrieval.errors import IndexDirError
    from retrieval.stash import VectorStash

    rng = np.random.default_rng(6)
    stash = VectorStash.create(tmp_path / "s", 12, ["mean"], "float32")
    for size in (10, 10, 10):
        stash.append(
            {"mean": rng.normal(size=(size, 12)).astype(np.float32)}, [str(i) for i in range(size)], [""] * size
        )
    opened = VectorStash.open(tmp_path / "s")
    assert opened.read_rows(np.array([3, 15, 29]), pread=True).shape == (3, 12)  # descriptors kept
    name = opened.parts[1].vectors["mean"]
    part = tmp_path / "s" / name
    part.write_bytes(part.read_bytes()[: -12 * 4 * 3])  # its last three rows gone
    assert opened.read_rows(np.array([3, 15, 29]), pread=True).shape == (3, 12)  # rows before the cut still read
    with pytest.raises(IndexDirError, match=f"stash part {name} is truncated; rebuild"):
        opened.read_rows(np.array([3, 19, 29]), pread=True)
    opened.close()


def test_a_searcher_rescoring_by_pread_answers_as_by_maps_and_maps_no_stash(reduced: Path) -> None:
    raw = queries(6)
    mapped = Searcher.load(reduced, encoder=FakeEncoder())
    by_pread = Searcher.load(reduced, encoder=FakeEncoder(), stash_reads="pread")
    for params in (SearchParams(k=5), SearchParams(k=3, rescore=200)):
        expected = mapped.search_raw(raw, params)
        found = by_pread.search_raw(raw, params)
        np.testing.assert_array_equal(found[1], expected[1])
        np.testing.assert_array_equal(found[0], expected[0])
    del mapped
    import gc

    gc.collect()
    by_pread.warm_up(prefault=True)  # makes the docs resident, never the stash it does not map
    assert not [name for name in _mapped(reduced) if "/stash/" in name]
    with pytest.raises(ConfigError, match="stash_reads"):
        Searcher.load(reduced, encoder=FakeEncoder(), stash_reads="mmap")
