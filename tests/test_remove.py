"""Removing documents by id (``update.remove``, ``retrieval remove``): the rows leave the stash, the docs and the
FAISS index; the kernel stays; what is left equals the original with those rows taken out, bit for bit where
nothing is recomputed."""

from __future__ import annotations

import os
from pathlib import Path

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import FakeEncoder
from test_update import files_beside, more_docs, verify_loads
from typer.testing import CliRunner

from retrieval import update
from retrieval.build import BuildOptions, build_index
from retrieval.cli.app import app
from retrieval.corpus import CorpusSpec
from retrieval.docs import Docs
from retrieval.errors import ConfigError, CorpusError, IndexDirError
from retrieval.index import IndexSpec, load_index
from retrieval.indexdir import DOCS, INDEX, MOMENTS, TRANSFORM, IndexDir
from retrieval.info import describe_index
from retrieval.moments import RunningMoments
from retrieval.search import Searcher, SearchParams
from retrieval.whitening import TransformSpec

OPTIONS = BuildOptions(window_rows=64)  # parts of 64 rows: doc0-63, doc64-127, doc128-191, doc192-255, doc256-299
runner = CliRunner()
# Rows from three parts, one of them (doc128-191) whole: rewritten parts, a dropped part and untouched ones.
GONE = ["doc3", "doc70", "doc71", "doc299", *(f"doc{i}" for i in range(128, 192))]


def build(corpus: Path, out: Path, index: IndexSpec = IndexSpec()) -> None:
    build_index(CorpusSpec(corpus), FakeEncoder(), out, TransformSpec(dim=8), index=index, options=OPTIONS)


def files_of(directory: Path) -> dict[Path, bytes]:
    return {p.relative_to(directory): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def stash_rows(directory: Path) -> np.ndarray:
    return np.concatenate(list(IndexDir(directory).stash().iter_blocks()))


def test_removed_rows_leave_the_stash_docs_and_index_and_the_kernel_stays(tmp_path, corpus):
    directory = tmp_path / "idx"
    build(corpus, directory)
    before, ids = stash_rows(directory), Docs(directory / DOCS).ids
    transform_bytes = (directory / TRANSFORM).read_bytes()
    untouched = IndexDir(directory).stash().parts[3]  # doc192-255: nothing removed there
    inode = os.stat(IndexDir(directory).stash().root / untouched.vectors["mean"]).st_ino
    keep = np.array([i not in GONE for i in ids])

    manifest = update.remove(directory, GONE)

    assert manifest is not None and manifest.n == 300 - len(GONE) == 232 and manifest.generation == 2
    assert manifest.corpus.removed[0]["rows"] == len(GONE)
    stash = IndexDir(directory).stash()
    np.testing.assert_array_equal(stash_rows(directory), before[keep])  # the very stored values, in order
    left = [i for i in ids if i not in GONE]
    assert Docs(directory / DOCS).ids == left == [i for part in stash.iter_ids() for i in part]
    assert [p.rows for p in stash.parts] == [63, 62, 64, 43]  # the emptied part is gone
    assert os.stat(stash.root / untouched.vectors["mean"]).st_ino == inode  # linked, not copied
    assert (directory / TRANSFORM).read_bytes() == transform_bytes
    transform = IndexDir(directory).transform()
    flat = load_index(directory / INDEX)
    stored = faiss.rev_swig_ptr(flat.get_xb(), flat.ntotal * flat.d).reshape(flat.ntotal, flat.d)
    np.testing.assert_allclose(stored, transform.transform(before[keep]), atol=1e-6)
    reference = RunningMoments.from_array(before[keep].astype(np.float64))  # float64 one-shot
    moments = RunningMoments.load(directory / MOMENTS)
    assert moments.n == 232
    np.testing.assert_allclose(moments.mean, reference.mean, rtol=1e-12)
    np.testing.assert_allclose(moments.m2, reference.m2, rtol=1e-10, atol=1e-9)
    assert "; 232 rows now, 300 at the fit" in describe_index(directory)["summary"]["kernel drift"]
    verify_loads(directory)

    searcher = Searcher.load(directory, encoder=FakeEncoder())
    hits = searcher.search_vectors(before[~keep], SearchParams(k=10))  # each removed document's own vector
    assert not {hit.id for row in hits for hit in row} & set(GONE)
    assert not files_beside(directory)


def lists(directory: Path) -> np.ndarray:
    index = load_index(directory / INDEX)
    quantizer = faiss.extract_index_ivf(index).quantizer
    return quantizer.reconstruct_n(0, quantizer.ntotal)


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
def test_an_approximate_index_keeps_its_lists_knobs_and_calibration(tmp_path, corpus, kind):
    directory = tmp_path / "idx"
    build(corpus, directory, IndexSpec(kind, nlist=8, nprobe=2, m=8, ef_search=24))
    before, ids = stash_rows(directory), Docs(directory / DOCS).ids
    update.calibrate_index(directory, before[::7], target=0.9)
    old = IndexDir(directory).manifest()
    centroids = lists(directory) if kind == "ivf" else None

    new = update.remove(directory, GONE)

    assert new is not None and new.index.search == old.index.search and new.index.calibration == old.index.calibration
    assert new.index.factory == old.index.factory and new.index.ntotal == 232
    if centroids is not None:  # the same lists: not trained again
        np.testing.assert_array_equal(lists(directory), centroids)
    kept = before[[i not in GONE for i in ids]]
    searcher = Searcher.load(directory, encoder=FakeEncoder())
    wide = SearchParams(k=1, rescore=0, ef_search=200, nprobe=8)  # exhaustive: each kept row finds itself
    found = [row[0].id for row in searcher.search_vectors(kept[::5], wide)]
    assert found == [i for i in ids if i not in GONE][::5]


def test_unknown_ids_are_refused_all_or_nothing_unless_missing_ok(tmp_path, corpus):
    directory = tmp_path / "idx"
    build(corpus, directory)
    before = files_of(directory)
    with pytest.raises(CorpusError, match=r"2 of the 3 ids are not in the index \(first: 'nope1', 'nope2'\); nothing"):
        update.remove(directory, ["doc5", "nope2", "nope1"])
    assert files_of(directory) == before and not files_beside(directory)

    assert update.remove(directory, ["nope1"], missing_ok=True) is None  # none there: nothing written
    assert files_of(directory) == before

    manifest = update.remove(directory, ["doc5", "nope1"], missing_ok=True)
    assert manifest is not None and manifest.n == 299 and "doc5" not in Docs(directory / DOCS).ids
    assert manifest.corpus.removed[0] | {"at": None, "ids_sha256": None} == {
        "rows": 1, "asked": 2, "at": None, "ids_sha256": None, "next_row_number": 300
    }  # fmt: skip


def test_removing_every_document_or_all_but_one_is_refused(tmp_path, corpus):
    """A build needs 2 rows; one row left made `info` fail (its drift fits a kernel to the rows left)."""
    directory = tmp_path / "idx"
    build(corpus, directory)
    with pytest.raises(CorpusError, match="would leave an empty index"):
        update.remove(directory, [f"doc{i}" for i in range(300)])
    with pytest.raises(CorpusError, match="removing 299 of 300 documents would leave a single document"):
        update.remove(directory, [f"doc{i}" for i in range(299)])
    assert IndexDir(directory).manifest().n == 300
    update.remove(directory, [f"doc{i}" for i in range(298)])
    assert "2 rows now, 300 at the fit" in describe_index(directory)["summary"]["kernel drift"]


def test_an_ivf_index_left_with_fewer_rows_than_lists_still_finds_every_row(tmp_path, corpus):
    """Asking for every document probes every list: it probed k lists, fewer than the 8 here once 5 rows remain."""
    directory = tmp_path / "idx"
    build(corpus, directory, IndexSpec("ivf", nlist=8, nprobe=1))
    before = stash_rows(directory)
    update.remove(directory, [f"doc{i}" for i in range(295)])
    searcher = Searcher.load(directory, encoder=FakeEncoder())
    for nprobe in (None, 1, 8):
        hits = searcher.search_vectors(before[:20], SearchParams(k=5, rescore=0, nprobe=nprobe))
        assert all(sorted(h.id for h in row) == [f"doc{i}" for i in range(295, 300)] for row in hits), nprobe


def test_info_and_remove_say_when_most_ivf_lists_are_empty(tmp_path, corpus):
    """The manifest records how rows fill the lists (counted here from the index itself); once most are empty,
    `remove` and `info` say so and name `refit`, which trains lists for the rows left."""
    directory = tmp_path / "idx"
    build(corpus, directory, IndexSpec("ivf", nlist=8))
    first = IndexDir(directory).manifest().index.faiss
    assert first["empty_lists"] == 0 and "most lists" not in describe_index(directory)["summary"]["lists"]

    def sizes() -> list[int]:
        index = load_index(directory / INDEX)  # held while its lists are read: extract_index_ivf does not own it
        ivf = faiss.extract_index_ivf(index)
        return [ivf.invlists.list_size(i) for i in range(ivf.nlist)]

    index = load_index(directory / INDEX)
    rows = IndexDir(directory).transform().transform(stash_rows(directory))
    rows_by_list = faiss.extract_index_ivf(index).quantizer.assign(rows, 1).ravel()
    crowded = int(np.argmax(sizes()))
    keep = {f"doc{i}" for i in np.flatnonzero(rows_by_list == crowded)}
    gone = [f"doc{i}" for i in range(300) if f"doc{i}" not in keep]
    result = runner.invoke(app, ["remove", str(directory), *gone])
    assert result.exit_code == 0, result.output
    after = sizes()
    recorded = IndexDir(directory).manifest().index.faiss
    assert (recorded["empty_lists"], recorded["largest_list"]) == (after.count(0), max(after)) == (7, len(keep))
    assert recorded["imbalance"] == pytest.approx(8.0, abs=1e-3)  # every row in one list of 8
    line = describe_index(directory)["summary"]["lists"]
    assert line.startswith(f"8, 7 empty, the largest {len(keep)} rows") and "`retrieval refit`" in line
    assert f"IVF lists: {line}" in result.stderr


def test_adding_after_a_part_was_emptied_never_overwrites_a_part(tmp_path, corpus):
    """Four parts left of five: a new part named by the count (part-00004) would overwrite doc256-299's."""
    directory = tmp_path / "idx"
    build(corpus, directory)
    update.remove(directory, [f"doc{i}" for i in range(128, 192)])
    manifest = update.add(directory, CorpusSpec(more_docs(tmp_path / "more.parquet", ["new1", "new2"])), FakeEncoder())
    assert manifest.n == 238
    ids = Docs(directory / DOCS).ids
    assert ids[-3:] == ["doc299", "new1", "new2"] and len(set(ids)) == 238
    verify_loads(directory)
    # part-00005 (the two new rows) was merged with part-00004 (doc256-299) into a part numbered past both
    parts = IndexDir(directory).stash().parts
    assert [(p.docs, p.rows) for p in parts][-1] == ("part-00006.parquet", 46)


def test_a_failure_midway_leaves_the_index_as_it_was(tmp_path, corpus, monkeypatch):
    directory = tmp_path / "idx"
    build(corpus, directory)
    before = files_of(directory)

    def disk_full(*args):  # type: ignore[no-untyped-def]
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("retrieval.docs.write_docs", disk_full)  # after the stash, moments and index are written
    with pytest.raises(IndexDirError, match="no space left on the device .* is unchanged"):
        update.remove(directory, GONE)
    assert files_of(directory) == before and not files_beside(directory)


def test_cli_remove_takes_ids_as_arguments_from_a_file_and_from_stdin(tmp_path, corpus):
    directory = tmp_path / "idx"
    build(corpus, directory)
    (tmp_path / "ids.txt").write_text("doc10\n\ndoc 11 is not an id\n  \ndoc12\n")
    result = runner.invoke(app, ["remove", str(directory), "doc1", "--ids-from", str(tmp_path / "ids.txt")])
    assert result.exit_code == 1 and "1 of the 4 ids are not in the index (first: 'doc 11 is" in result.output
    result = runner.invoke(
        app, ["remove", str(directory), "doc1", "--ids-from", str(tmp_path / "ids.txt"), "--missing-ok"]
    )
    assert result.exit_code == 0 and "removed 3 rows from" in result.output and "now 297" in result.output
    result = runner.invoke(app, ["remove", str(directory), "--ids-from", "-"], input="doc20\ndoc21\n")
    assert result.exit_code == 0 and "now 295" in result.output, result.output
    result = runner.invoke(app, ["remove", str(directory), "doc20", "--missing-ok"])
    assert result.exit_code == 0 and "none of the 1 ids is in" in result.output and "nothing changed" in result.output

    assert runner.invoke(app, ["remove", str(directory)]).output.startswith("error: no ids to remove")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    result = runner.invoke(app, ["remove", str(directory), "--ids-from", str(tmp_path / "latin1.txt")])
    assert result.exit_code == 1 and "is not UTF-8 text" in result.output and "Traceback" not in result.output
    assert IndexDir(directory).manifest().n == 295


def test_ids_from_a_file_lose_the_spaces_around_them_and_unknown_ids_are_quoted(tmp_path, corpus):
    """An editor's trailing space or a copied column's indent made every id unknown, and the message printed
    them unquoted: "first: doc3 , doc4" showed nothing wrong. Spaces and tabs around an id are dropped now (not
    inside it), and ids the index lacks are quoted."""
    directory = tmp_path / "idx"
    build(corpus, directory)
    (tmp_path / "ids.txt").write_text("doc3 \n\tdoc4\n  doc5\t \r\n")
    result = runner.invoke(app, ["remove", str(directory), "--ids-from", str(tmp_path / "ids.txt")])
    assert result.exit_code == 0 and "removed 3 rows" in result.output and "now 297" in result.output, result.output
    result = runner.invoke(app, ["remove", str(directory), "doc6", "doc 7 "])
    assert result.exit_code == 1 and "(first: 'doc 7 ')" in result.output, result.output


def test_the_empty_string_is_refused_as_an_id_in_one_line(tmp_path, corpus):
    directory = tmp_path / "idx"
    build(corpus, directory)
    before = files_of(directory)
    result = runner.invoke(app, ["remove", str(directory), ""])
    assert result.exit_code == 1 and result.output.startswith("error: an id to remove is the empty string ''")
    assert len(result.output.strip().splitlines()) == 1 and files_of(directory) == before
    with pytest.raises(ConfigError, match="the empty string"):
        update.remove(directory, ["doc1", ""], missing_ok=True)
    assert files_of(directory) == before


def test_ids_from_a_file_are_split_at_newlines_only(tmp_path):
    """U+2028, NEL (U+0085, what a cp1252 ellipsis becomes after mojibake) and form feeds are characters of an id,
    as they are when the ids come as arguments; str.splitlines cut the ids at them. A leading BOM is dropped."""
    ids = ["a\u2028b", "c\x85d", "e\x0cf", "g\x1ch", "plain"]
    pq.write_table(
        pa.table({"id": [*ids, "x1", "x2"], "text": [f"text {i}" for i in range(7)]}), tmp_path / "c.parquet"
    )
    directory = tmp_path / "idx"
    build_index(CorpusSpec(tmp_path / "c.parquet"), FakeEncoder(), directory, TransformSpec(dim=2), options=OPTIONS)
    (tmp_path / "ids.txt").write_bytes(("\ufeff" + "\r\n".join(ids[:4]) + "\n").encode())
    result = runner.invoke(app, ["remove", str(directory), "--ids-from", str(tmp_path / "ids.txt")])
    assert result.exit_code == 0 and "removed 4 rows" in result.output, result.output
    assert Docs(directory / DOCS).ids == ["plain", "x1", "x2"]


def test_a_removed_row_number_id_never_names_an_added_document(tmp_path):
    """Row-number ids of added rows start past every row number the index held, removed ones included: removing
    the last rows and adding again gave the new rows the removed rows' ids (``next_row_number`` counted the rows
    and ids left), so a client holding an old hit's id found another document under it."""
    from test_update import anisotropic

    np.save(tmp_path / "a.npy", anisotropic(40))
    np.save(tmp_path / "b.npy", anisotropic(3, seed=5))
    directory = tmp_path / "idx"
    build_index(CorpusSpec(tmp_path / "a.npy"), None, directory, TransformSpec(dim=4), options=OPTIONS)
    update.remove(directory, ["39", "38", "12"])
    assert update.add(directory, CorpusSpec(tmp_path / "b.npy")).n == 40
    assert Docs(directory / DOCS).ids[-3:] == ["40", "41", "42"]

    update.remove(directory, ["42", "41"])  # the mark stays past the highest row number ever held
    update.refit(directory, TransformSpec(dim=3))  # and survives a refit, which keeps the corpus record
    result = runner.invoke(app, ["add", str(directory), str(tmp_path / "b.npy")])
    assert result.exit_code == 0, result.output
    assert Docs(directory / DOCS).ids[-4:] == ["40", "43", "44", "45"]


def _without_new_records(directory: Path, *corpus_keys: str, removal_key: str | None = None) -> None:
    """The manifest as an older retrieval wrote it: without ``corpus_keys`` in the corpus record and without
    ``removal_key`` in its removals (checksum recomputed, as that version had one)."""
    import json

    from retrieval.indexdir import MANIFEST, checksum

    data = json.loads((directory / MANIFEST).read_text())
    for key in corpus_keys:
        data["corpus"].pop(key)
    for removal in data["corpus"]["removed"]:
        removal.pop(removal_key, None)
    data["checksum"] = checksum(data)
    (directory / MANIFEST).write_text(json.dumps(data))


def test_removals_recorded_by_an_older_version_never_give_their_ids_to_added_rows(tmp_path):
    """Removals written before they kept where row numbers stood: ``add`` gave the removed ids to new rows. It now
    starts past every row number the index can have given (source rows plus added rows): a gap, never a reuse."""
    from test_update import anisotropic

    np.save(tmp_path / "a.npy", anisotropic(40))
    np.save(tmp_path / "b.npy", anisotropic(3, seed=5))
    directory = tmp_path / "idx"
    build_index(CorpusSpec(tmp_path / "a.npy"), None, directory, TransformSpec(dim=4), options=OPTIONS)
    update.add(directory, CorpusSpec(tmp_path / "b.npy"))  # ids 40-42
    update.remove(directory, ["42", "41", "40", "39"])
    _without_new_records(directory, removal_key="next_row_number")
    update.add(directory, CorpusSpec(tmp_path / "b.npy"))
    assert Docs(directory / DOCS).ids[-4:] == ["38", "43", "44", "45"]


def test_an_older_manifest_refitted_after_its_changes_gets_no_refit_advice(tmp_path):
    """Manifests written before ``trained_after`` existed: the lists of an index refitted after its adds and
    removes were taken as trained before them, and calibrate advised a refit the index had had. A build and a
    refit fit the kernel on every row the index holds; an add or remove changes the row count, not the fit's.
    Where that cannot tell (as many rows removed as added: the build's count again), the lists count as older."""
    from test_update import anisotropic

    from retrieval.manifest import Manifest

    np.save(tmp_path / "a.npy", anisotropic(300))
    np.save(tmp_path / "b.npy", anisotropic(40, seed=5))
    ivf = IndexSpec(kind="ivf", nlist=8)
    for name, removed, refitted in [("unbalanced", 2, True), ("balanced", 40, False)]:
        directory = tmp_path / name
        spec = CorpusSpec(tmp_path / "a.npy")
        build_index(spec, None, directory, TransformSpec(dim=4), index=ivf, options=OPTIONS)
        update.add(directory, CorpusSpec(tmp_path / "b.npy"))
        update.remove(directory, [str(i) for i in range(removed)])
        _without_new_records(directory, "trained_after")
        assert Manifest.load(directory).corpus.changed_since_training, name  # changed since the build
        update.refit(directory, TransformSpec(dim=4))
        _without_new_records(directory, "trained_after")
        assert Manifest.load(directory).corpus.changed_since_training is not refitted, name
    update.add(tmp_path / "unbalanced", CorpusSpec(tmp_path / "b.npy"))
    _without_new_records(tmp_path / "unbalanced", "trained_after")
    assert Manifest.load(tmp_path / "unbalanced").corpus.changed_since_training  # an add after the refit


def test_a_manifest_without_a_checksum_is_named_as_an_older_version_not_as_corrupt(tmp_path):
    import json

    from test_update import anisotropic

    from retrieval.indexdir import MANIFEST

    np.save(tmp_path / "a.npy", anisotropic(40))
    directory = tmp_path / "idx"
    build_index(CorpusSpec(tmp_path / "a.npy"), None, directory, TransformSpec(dim=4), options=OPTIONS)
    data = json.loads((directory / MANIFEST).read_text())
    del data["checksum"]
    (directory / MANIFEST).write_text(json.dumps(data))
    result = runner.invoke(app, ["info", str(directory)])
    assert result.exit_code == 1
    assert "was written by an older retrieval, before manifests carried a checksum: rebuild" in result.output
    assert "corrupt" not in result.output
