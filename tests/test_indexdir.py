"""The index directory as one owner sees it: typed manifest round trips, what importing the core pulls in, the
cheap check a one-shot search does, a reader that always sees one whole version while writers publish, and
user files that survive a publish."""

from __future__ import annotations

import ast
import dataclasses
import errno
import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, FakeEncoder, write_corpus

from retrieval import files, indexdir, update
from retrieval.build import BuildOptions, build_index
from retrieval.corpus import CorpusSpec
from retrieval.errors import ConfigError, IndexDirError, PlantedLinkError
from retrieval.indexdir import INDEX, MANIFEST, IndexDir, checksum, load
from retrieval.manifest import Manifest
from retrieval.search import Searcher, SearchParams
from retrieval.whitening import TransformSpec, Whitening


@pytest.fixture
def index(tmp_path: Path) -> Path:
    corpus = write_corpus(tmp_path / "corpus.parquet", n=300)
    build_index(CorpusSpec(corpus), FakeEncoder(), tmp_path / "idx", TransformSpec(dim=8))
    return tmp_path / "idx"


def test_the_manifest_round_trips_through_json(index: Path) -> None:
    manifest = Manifest.load(index)
    assert Manifest.from_dict(json.loads(json.dumps(manifest.to_dict()))) == manifest
    on_disk = json.loads((index / MANIFEST).read_text())
    assert manifest.to_dict() == {k: v for k, v in on_disk.items() if k != "checksum"}
    assert on_disk["checksum"] == checksum(on_disk)


def _as_schema(index: Path, version: int) -> None:
    """Rewrite the index's manifest as schema ``version`` wrote it: the output dimension named ``k``; version 2
    had no codes, rotation, lexical part, fusion or kept columns either."""
    data = json.loads((index / MANIFEST).read_text())
    data.pop("checksum")
    data["transform"]["k"] = data["transform"].pop("dim")
    if version == 2:
        for key in ("codes", "rotation"):
            data["index"]["spec"].pop(key, None)
        for key in ("lexical", "fusion", "columns"):
            data.pop(key, None)
    data["schema_version"] = version
    data["checksum"] = checksum(data)
    files.write_atomic(index / MANIFEST, json.dumps(data).encode())


@pytest.mark.parametrize("version", [2, 3])
def test_an_older_manifest_s_k_reads_as_dim_and_its_next_version_is_the_current_schema(
    index: Path, tmp_path: Path, version: int
) -> None:
    """Schemas 2 and 3 named the output dimension ``k`` (the number of hits everywhere else); 4 names it ``dim``.
    An index written before still loads and searches, and the next writer writes it in the current schema."""
    expected = Searcher.load(index, encoder=FakeEncoder()).search("alpha", SearchParams(k=5))
    _as_schema(index, version)
    searcher = Searcher.load(index, encoder=FakeEncoder())
    assert searcher.manifest.schema_version == version and searcher.manifest.transform.dim == 8
    assert [hit.id for hit in searcher.search("alpha", SearchParams(k=5))] == [hit.id for hit in expected]
    more = write_corpus(tmp_path / "more.parquet", n=20, id=[f"new{i}" for i in range(20)])
    update.add(index, CorpusSpec(more), FakeEncoder())
    on_disk = json.loads((index / MANIFEST).read_text())
    assert on_disk["schema_version"] == indexdir.SCHEMA_VERSION == 5
    assert on_disk["transform"]["dim"] == 8 and "k" not in on_disk["transform"]


# ----- what importing the core costs -------------------------------------------------------------------------
@pytest.mark.process
def test_the_core_imports_neither_the_service_nor_ray_nor_the_cli() -> None:
    """retrieval.search and retrieval.build are what the service and the Ray workers import: they must not drag
    in fastapi, ray, typer or rich (nor torch, which only an encoder loads)."""
    code = (
        "import sys, retrieval.search, retrieval.build, retrieval.info\n"
        "print(sorted(m for m in ('fastapi', 'ray', 'typer', 'rich', 'torch', 'uvicorn') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


@pytest.mark.process
def test_info_needs_no_faiss() -> None:
    code = "import sys, retrieval.info\nprint('faiss' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


def test_the_package_parses_as_python_3_10() -> None:
    """pyproject says >= 3.10: no 3.11-only syntax (mypy checks the 3.10 API, e.g. datetime.UTC, separately)."""
    for path in sorted((ROOT / "retrieval").glob("*.py")):
        ast.parse(path.read_text(), filename=str(path), feature_version=(3, 10))
    assert "datetime.UTC" not in "".join(p.read_text() for p in (ROOT / "retrieval").glob("*.py"))
    assert "dt.UTC" not in "".join(p.read_text() for p in (ROOT / "retrieval").glob("*.py"))


def _imports(module: str) -> set[str]:
    tree = ast.parse((ROOT / "retrieval" / f"{module}.py").read_text())
    return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


def test_the_index_directory_imports_nothing_above_it() -> None:
    """manifest.py owns the manifest's records (Calibration among them), read and written by indexdir; calibrate,
    which measures one, sits above both; the FAISS factory-string rules belong to index.py, and one check says what
    a text column is."""
    assert "retrieval.calibrate" not in _imports("indexdir") | _imports("manifest")
    assert "retrieval.manifest" in _imports("calibrate") and "retrieval.manifest" in _imports("indexdir")
    assert "re" not in {line.split()[1] for line in (ROOT / "retrieval/indexdir.py").read_text().splitlines()
                        if line.startswith("import ")}  # fmt: skip
    from retrieval.index import lossy_codes, trained_on_rows

    assert lossy_codes("IVF64,PQ8") and not lossy_codes("IVF64,PQ8,RFlat") and trained_on_rows("IVF64,Flat")
    texts = [p.read_text() for p in (ROOT / "retrieval").rglob("*.py")]
    assert not any("def _is_text" in text for text in texts)


# ----- the cheap check of a one-shot search ------------------------------------------------------------------
def test_quick_verification_samples_large_files_and_catches_truncation(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(files, "QUICK_FULL_BELOW", 1024)  # every file counts as large: hashed by sampling
    corpus = write_corpus(tmp_path / "corpus.parquet", n=300)
    build_index(CorpusSpec(corpus), FakeEncoder(), tmp_path / "idx", TransformSpec(dim=8))
    index, manifest = tmp_path / "idx", Manifest.load(tmp_path / "idx")
    path = index / INDEX
    assert manifest.files[INDEX]["quick_sha256"] != manifest.files[INDEX]["sha256"]  # a sample, not the file
    IndexDir(index).verify(manifest, "quick")
    data = path.read_bytes()
    path.write_bytes(data[:-1])  # truncated: the size differs
    with pytest.raises(IndexDirError, match="checksum mismatch"):
        IndexDir(index).verify(manifest, "quick")
    path.write_bytes(data[:-64] + bytes(64))  # the tail zeroed: the sample includes the last block
    with pytest.raises(IndexDirError, match="checksum mismatch"):
        IndexDir(index).verify(manifest, "quick")


def test_a_quick_load_hashes_no_large_file_whole(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(files, "QUICK_FULL_BELOW", 1024)
    corpus = write_corpus(tmp_path / "corpus.parquet", n=300)
    build_index(CorpusSpec(corpus), FakeEncoder(), tmp_path / "idx", TransformSpec(dim=8))
    hashed: list[str] = []
    real = files.sha256
    monkeypatch.setattr(files, "sha256", lambda path: hashed.append(Path(path).name) or real(path))
    Searcher.load(tmp_path / "idx", encoder=FakeEncoder(), verify="quick")
    # only stash parts smaller than their sample would be (16 KiB), which a re-scoring load hashes whole
    full_below = files.PART_SAMPLE_BLOCKS * files.PART_SAMPLE_BYTES
    small = {path.name for path in (tmp_path / "idx" / "vectors").glob("*.npy") if path.stat().st_size < full_below}
    # and files under the quick threshold, hashed whole by design (the lexical part's parameters)
    small |= {path.name for path in (tmp_path / "idx").rglob("*.json") if path.stat().st_size < 1024}
    assert set(hashed) <= small, hashed
    Searcher.load(tmp_path / "idx", encoder=FakeEncoder(), verify="full")
    assert set(hashed) >= {"index.faiss", "docs.arrow", "transform.npz"}


# ----- one whole version, whatever writers do ----------------------------------------------------------------
def test_readers_see_one_whole_version_while_writers_publish(index: Path, tmp_path: Path) -> None:
    """The bug: a reader loading while ``add``/``refit`` published could read the new manifest with the old FAISS
    index ("does not match its manifest") or find the directory gone. Loads race 12 publishes: none may fail."""
    errors: list[BaseException] = []
    loads = 0
    stop = threading.Event()

    def reader() -> None:
        nonlocal loads
        while not stop.is_set():
            try:
                searcher = Searcher.load(index, encoder=FakeEncoder(), verify="quick")
                assert searcher.index.ntotal == searcher.manifest.n == len(searcher.docs)
                loads += 1
            except BaseException as err:  # noqa: BLE001 - every failure counts
                errors.append(err)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        for i in range(6):
            more = write_corpus(tmp_path / f"more{i}.parquet", n=20)
            ids = [f"new{i}-{j}" for j in range(20)]
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pq.read_table(more).set_column(0, "id", pa.array(ids)), more)
            update.add(index, CorpusSpec(more), FakeEncoder())
            update.refit(index, TransformSpec(dim=8 - i % 2))
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert not errors, errors[:3]
    assert loads > 12
    assert Manifest.load(index).generation == 13


@pytest.mark.parametrize("dim", [5, 8])  # 8: the same spec, every shape agrees: only the identity shows it
def test_a_publish_between_reading_the_manifest_and_the_index_is_read_again(index: Path, monkeypatch, dim) -> None:
    """Deterministically, the race the loop above samples: a refit lands after the reader has read the manifest
    and before it reads the FAISS index. The reader must not mix the two versions."""
    real = IndexDir.faiss_index
    published = []

    def publish_first(self, mmap=False, manifest=None):  # type: ignore[no-untyped-def]
        if not published:
            published.append(update.refit(index, TransformSpec(dim=dim)))
        return real(self, mmap, manifest)

    monkeypatch.setattr(IndexDir, "faiss_index", publish_first)
    searcher = Searcher.load(index, encoder=FakeEncoder(), verify="quick")
    assert published and searcher.manifest.transform.dim == searcher.index.d == dim
    assert searcher.manifest.generation == 2 and searcher.loaded.identity == IndexDir(index).identity()


def test_a_load_that_fails_on_an_unchanged_directory_fails_at_once(index: Path) -> None:
    (index / INDEX).write_bytes(b"garbage")
    with pytest.raises(IndexDirError):
        load(index, "none")


# ----- user files are not the writers' to delete -------------------------------------------------------------
def test_files_a_user_put_inside_an_index_survive_add_refit_and_overwrite(index: Path, tmp_path: Path) -> None:
    (index / "NOTES.md").write_text("why this index exists")
    (index / "eval-results").mkdir()
    (index / "eval-results" / "run1.json").write_text("{}")
    update.refit(index, TransformSpec(dim=4))
    more = write_corpus(tmp_path / "more.parquet", n=5)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pq.read_table(more).set_column(0, "id", pa.array([f"x{i}" for i in range(5)])), more)
    update.add(index, CorpusSpec(more), FakeEncoder())
    build_index(CorpusSpec(more), FakeEncoder(), index, TransformSpec(dim=4), options=BuildOptions(overwrite=True))
    assert (index / "NOTES.md").read_text() == "why this index exists"
    assert (index / "eval-results" / "run1.json").read_text() == "{}"
    assert Searcher.load(index, encoder=FakeEncoder()).search("x", SearchParams(k=1))
    assert sorted(p.name for p in index.parent.iterdir() if p.name.startswith(".idx")) == []


def test_search_params_reject_floats_and_bools() -> None:
    with pytest.raises(Exception, match="`k` must be an integer"):
        SearchParams(k=2.5).check()  # type: ignore[arg-type]
    with pytest.raises(Exception, match="`k` must be an integer"):
        SearchParams(k=True).check()


def test_quick_sha256_samples_a_large_file_from_its_first_byte_to_its_last(tmp_path: Path, monkeypatch) -> None:
    """8 MiB, 64 blocks of 64 KiB: the first and last bytes are in the sample (a damaged head or tail is caught),
    and a byte between two blocks is not (it is a sample, not the whole file)."""
    monkeypatch.setattr(files, "QUICK_FULL_BELOW", 1024)
    path = tmp_path / "big.bin"
    data = np.random.default_rng(0).integers(0, 256, size=8 << 20, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    fingerprint = files.quick_sha256(path)
    assert fingerprint != files.sha256(path)
    step = ((8 << 20) - files.QUICK_BLOCK_BYTES) / (files.QUICK_BLOCKS - 1)  # ~130 KiB between block starts
    between = (files.QUICK_BLOCK_BYTES + int(step)) // 2  # after the first block ends, before the second starts
    for offset, caught in [(0, True), (len(data) - 1, True), (between, False)]:
        damaged = bytearray(data)
        damaged[offset] ^= 0xFF
        path.write_bytes(bytes(damaged))
        assert (files.quick_sha256(path) != fingerprint) is caught, offset


def test_a_stash_part_s_sampled_hash_and_what_a_quick_reader_checks(tmp_path: Path) -> None:
    """Parts record a sampled hash (4 x 4 KiB, first byte to last): a one-shot search that re-scores checks it
    for every part it maps. Shuffled rows change it; a byte between two blocks does not (a sample). Parts written
    before it was recorded are checked by size only, as before."""
    rows = np.random.default_rng(0).standard_normal((2000, 64)).astype(np.float32)  # 512 KB: sampled, not whole
    path = tmp_path / "part.npy"
    np.save(path, rows)
    fingerprint = files.part_fingerprint(path)
    assert fingerprint != files.sha256(path)
    np.save(path, rows[np.random.default_rng(1).permutation(len(rows))])
    assert files.part_fingerprint(path) != fingerprint
    np.save(path, rows)
    data = bytearray(path.read_bytes())
    data[files.PART_SAMPLE_BYTES + 100] ^= 0xFF  # after the first block, long before the second
    path.write_bytes(bytes(data))
    assert files.part_fingerprint(path) == fingerprint

    out = tmp_path / "idx"
    build_index(CorpusSpec(write_corpus(tmp_path / "c.parquet", n=300)), FakeEncoder(), out, TransformSpec(dim=8))
    stash = IndexDir(out).stash()
    part = stash.parts[0]
    record = part.checksums[part.vectors["mean"]]
    assert record["sampled_sha256"] == files.part_fingerprint(stash.root / part.vectors["mean"])
    name = part.vectors["mean"]
    vectors = np.load(stash.root / name)
    np.save(stash.root / name, vectors[::-1])  # rows reversed: same size
    with pytest.raises(IndexDirError, match="corrupt"):
        stash.verify(full=False, sampled="mean")
    stash.verify(full=False)  # sizes alone do not see it
    del record["sampled_sha256"]  # as a part written before the sampled hash was kept: sizes only, as before
    stash.verify(full=False, sampled="mean")
    with pytest.raises(IndexDirError, match="corrupt"):
        stash.verify(full=True)


@pytest.mark.parametrize(
    ("code", "raised", "message"),
    [
        (errno.ENOSPC, IndexDirError, "no space left on the device while writing /x/out.npz"),
        (errno.EDQUOT, IndexDirError, "no space left"),
        (errno.EROFS, IndexDirError, r"cannot write /x/out.npz \(boom\)"),
        (errno.EIO, OSError, "boom"),  # not a write refusal: the original error, traceback and all
    ],
)
def test_write_errors_turn_only_write_refusals_into_one_line(code: int, raised: type, message: str) -> None:
    with pytest.raises(raised, match=message) as caught:
        with files.write_errors(Path("/x")):
            raise OSError(code, "boom", "/x/out.npz")
    assert (caught.type is IndexDirError) == (raised is IndexDirError)


def test_inside_refuses_names_that_escape_through_a_symbolic_link(tmp_path: Path) -> None:
    root, outside = tmp_path / "stash", tmp_path / "elsewhere"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside)
    assert files.inside(root, "part-00000.mean.npy") and files.inside(root, "sub/part.npy")
    assert not files.inside(root, "link/secret.npy")  # no "..", not absolute: only resolving shows it
    assert not files.inside(root, "../elsewhere/secret.npy") and not files.inside(root, str(outside / "x"))
    assert not files.inside(root, "")


def test_publish_carries_only_foreign_entries_over_as_hard_links(tmp_path: Path) -> None:
    target, work = tmp_path / "idx", tmp_path / ".idx.building"
    target.mkdir()
    (target / "index.faiss").write_text("old index")
    (target / "rescore.npz").write_text("old scorer, dropped by the new version")
    (target / "NOTES.md").write_text("the user's")
    work.mkdir()
    (work / "index.faiss").write_text("new index")
    notes = (target / "NOTES.md").stat().st_ino
    files.publish(work, target, own={"index.faiss", "rescore.npz"})
    assert sorted(p.name for p in target.iterdir()) == ["NOTES.md", "index.faiss"]
    assert (target / "index.faiss").read_text() == "new index"
    assert (target / "NOTES.md").stat().st_ino == notes  # linked, not copied
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx"]  # neither the work nor the old one left


def test_replacing_discards_the_work_and_keeps_the_target_when_the_block_fails(tmp_path: Path) -> None:
    target = tmp_path / "idx"
    target.mkdir()
    (target / "index.faiss").write_text("old index")
    with pytest.raises(RuntimeError, match="encoder crashed"):
        with files.replacing(target, "adding") as work:
            (work / "index.faiss").write_text("half a new index")
            raise RuntimeError("encoder crashed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx"]
    assert (target / "index.faiss").read_text() == "old index"


def test_verify_refuses_a_manifest_that_lists_a_file_outside_the_index(index: Path, tmp_path: Path) -> None:
    """The manifest's checksum is not a signature: a rewritten one with a fresh checksum still cannot make a
    reader hash (or vouch for) a file outside the directory."""
    (tmp_path / "outside.bin").write_bytes(b"x")
    data = json.loads((index / MANIFEST).read_text())
    data["files"]["../outside.bin"] = {"bytes": 1, "sha256": files.sha256(tmp_path / "outside.bin")}
    data["checksum"] = checksum(data)
    (index / MANIFEST).write_text(json.dumps(data))
    directory = IndexDir(index)
    with pytest.raises(IndexDirError, match=r"does not list \.\./outside.bin as an index file"):
        directory.verify(directory.manifest(), "full")


@pytest.mark.parametrize("level", ["full", "quick"])
@pytest.mark.parametrize("name", ["docs.arrow", "vectors"])
def test_an_index_file_replaced_by_a_link_out_of_the_index_is_named_as_one(
    index: Path, tmp_path: Path, name: str, level: str
) -> None:
    """Refused, as before, but the message said the manifest "does not list docs.arrow", which it does."""
    moved = tmp_path / f"moved-{name}"
    (index / name).rename(moved)
    (index / name).symlink_to(moved)
    with pytest.raises(IndexDirError, match=f"^index file {index / name} is a symbolic link out of the index"):
        load(index, level)  # type: ignore[arg-type]


@pytest.mark.parametrize("level", ["Full", "ful", ""])
def test_an_unknown_verification_level_is_refused_not_skipped(index: Path, level: str) -> None:
    with pytest.raises(ConfigError, match="`verify` must be one of full, quick, none"):
        Searcher.load(index, encoder=FakeEncoder(), verify=level)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="`verify` must be one of"):
        IndexDir(index).verify(Manifest.load(index), level)  # type: ignore[arg-type]


def test_a_publish_keeps_created_and_stamps_updated(index: Path, monkeypatch) -> None:
    created = Manifest.load(index).created
    monkeypatch.setattr(indexdir, "now", lambda: "2099-01-01T00:00:00+00:00")
    manifest = update.refit(index, TransformSpec(dim=4))
    assert (manifest.created, manifest.updated) == (created, "2099-01-01T00:00:00+00:00")
    assert Manifest.load(index).created == created


def test_only_a_manifest_this_tool_wrote_makes_an_index_dir(index: Path, tmp_path: Path) -> None:
    assert indexdir.is_index_dir(index)
    data = json.loads((index / MANIFEST).read_text())
    other = tmp_path / "other"
    other.mkdir()
    (other / MANIFEST).write_text(json.dumps(data | {"versions": {"someone-else": "1.0"}}))
    assert not indexdir.is_index_dir(other)  # the right shape, but not ours: an overwrite must not take it


def _rerecord(index: Path, name: str) -> None:
    """Re-record ``name`` in the manifest, checksum and all: only the consistency checks can object now."""
    data = json.loads((index / MANIFEST).read_text())
    data["files"][name] = indexdir._record(index / name)
    data["checksum"] = checksum(data)
    (index / MANIFEST).write_text(json.dumps(data))


def test_a_transform_fitted_with_another_gamma_than_recorded_is_refused(index: Path) -> None:
    transform = IndexDir(index).transform()
    assert isinstance(transform, Whitening)
    dataclasses.replace(transform, gamma=transform.gamma + 0.5).save(index / indexdir.TRANSFORM)
    _rerecord(index, indexdir.TRANSFORM)
    with pytest.raises(IndexDirError, match="does not match its manifest"):
        load(index, "full")


def test_a_stash_with_more_rows_than_the_index_is_refused(index: Path) -> None:
    stash = IndexDir(index).stash()
    stash.append({p: np.zeros((2, stash.dim), np.float32) for p in stash.poolings}, ["y1", "y2"], ["a", "b"])
    _rerecord(index, f"{indexdir.STASH}/stash.json")
    with pytest.raises(IndexDirError, match="vector stash does not match its manifest"):
        load(index, "quick")


# ----- deploying an index directory: permissions, mounts, copies -------------------------------------------------
def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mode & 0o7777 for p in [root, *root.rglob("*")]}


def more_rows(tmp_path: Path, n: int = 5) -> CorpusSpec:
    texts = [f"an added document {i} about whitening" for i in range(n)]
    return CorpusSpec(write_corpus(tmp_path / "more.parquet", n=n, id=[f"x{i}" for i in range(n)], text=texts))


def test_a_new_version_keeps_the_permissions_of_the_one_it_replaces(index: Path, tmp_path: Path) -> None:
    """Every publish took the writer's umask: a private index (700 folders, 600 files) became readable by all
    after one `add`. Now folders keep the old directory's mode and new files its read/write bits."""
    import os

    for path in [index, *index.rglob("*")]:
        path.chmod(0o700 if path.is_dir() else 0o600)
    before = os.umask(0o022)
    try:
        update.add(index, more_rows(tmp_path), FakeEncoder())
        assert set(_modes(index).items()) == {
            (name, 0o700 if (index / name).is_dir() else 0o600) for name in _modes(index)
        }
        index.chmod(0o2750)  # a group's index: setgid folder, group may read
        kept = {p.stat().st_ino for p in index.rglob("*") if p.is_file()}  # stash parts are linked, not rewritten
        update.refit(index, TransformSpec(dim=4))
        folders = {mode for name, mode in _modes(index).items() if (index / name).is_dir()}
        written = {p.stat().st_mode & 0o7777 for p in index.rglob("*") if p.is_file() and p.stat().st_ino not in kept}
        linked = {p.stat().st_mode & 0o7777 for p in index.rglob("*") if p.is_file() and p.stat().st_ino in kept}
        assert folders == {0o2750} and written == {0o640} and linked == {0o600}
    finally:
        os.umask(before)


def test_a_write_protected_index_is_refused_before_any_work(index: Path, tmp_path: Path) -> None:
    """`chmod -R a-w` said: do not change this. A writer replaced it anyway, then could not remove the old
    version (`.idx.old`), and every later writer failed on it, blaming stash.json."""
    snapshot = {p: p.read_bytes() for p in index.rglob("*") if p.is_file()}
    for path in [index, *index.rglob("*")]:
        path.chmod(path.stat().st_mode & ~0o222)
    try:
        with pytest.raises(IndexDirError, match=r"idx is write-protected; make it writable \(`chmod -R u\+w"):
            update.add(index, more_rows(tmp_path), FakeEncoder())
        with pytest.raises(IndexDirError, match="write-protected"):
            build_index(
                CorpusSpec(tmp_path / "corpus.parquet"),
                FakeEncoder(),
                index,
                TransformSpec(dim=4),
                options=BuildOptions(overwrite=True),
            )
        assert {p: p.read_bytes() for p in index.rglob("*") if p.is_file()} == snapshot
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".idx")) == []
    finally:
        for path in [index, *index.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)


@pytest.mark.process
def test_a_write_protected_old_version_left_behind_is_removed_by_the_next_writer(index: Path, tmp_path: Path) -> None:
    """Such a leftover could not be emptied, and every later writer failed on it. As root, permissions are not
    enforced: the writer then runs without capabilities (``setpriv``), as an ordinary owner does."""
    import os
    import shutil

    old = files.work_dir(index, "old")
    shutil.copytree(index, old)
    for path in [old, *old.rglob("*")]:
        path.chmod(path.stat().st_mode & ~0o222)
    more = more_rows(tmp_path)
    if os.geteuid() != 0:
        update.add(index, more, FakeEncoder())
    else:
        if not shutil.which("setpriv"):
            pytest.skip("root without setpriv: write permissions cannot be enforced")
        code = (
            "import sys; sys.path.insert(0, sys.argv[3]); from pathlib import Path; from conftest import FakeEncoder\n"
            "from retrieval import update; from retrieval.corpus import CorpusSpec\n"
            "update.add(Path(sys.argv[1]), CorpusSpec(Path(sys.argv[2])), FakeEncoder())"
        )
        drop = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--"]
        args = [sys.executable, "-c", code, str(index), str(more.path), str(ROOT / "tests")]
        done = subprocess.run(
            [*drop, *args], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
        )
        assert done.returncode == 0, done.stderr
    assert not old.exists() and Searcher.load(index, encoder=FakeEncoder()).manifest.n == 305


def test_an_index_that_is_a_mount_point_is_refused_before_encoding(index: Path, tmp_path: Path, monkeypatch) -> None:
    """A container volume mounted at the index itself: the final rename failed with EBUSY, a traceback after
    the whole encoding. Now one line first (a real mount needs root: os.path.ismount is what decides)."""
    import os

    encoded: list[int] = []

    class Counting(FakeEncoder):
        def encode(self, texts, *args, **kwargs):  # type: ignore[no-untyped-def]
            encoded.append(len(texts))
            return super().encode(texts, *args, **kwargs)

    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda path: Path(path) == index or real(path))
    with pytest.raises(IndexDirError, match="idx is a mount point.*mount the folder that holds it instead"):
        update.add(index, more_rows(tmp_path), Counting())
    with pytest.raises(IndexDirError, match="is a mount point"):
        build_index(
            CorpusSpec(tmp_path / "corpus.parquet"),
            Counting(),
            index,
            TransformSpec(dim=4),
            options=BuildOptions(overwrite=True),
        )
    assert encoded == [] and Searcher.load(index, encoder=FakeEncoder()).manifest.n == 300


def test_a_shared_group_index_is_replaced_without_chmod(index: Path, tmp_path: Path, monkeypatch) -> None:
    """Removing the old version chmod-ed every folder first, which only their owner may: a group member's
    second update of a shared (2775) index failed after the encoding. A writable tree needs no chmod."""
    import os

    chmod, old = os.chmod, str(files.work_dir(index, "old"))

    def owned_only(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if str(path).startswith(old):  # the old version's folders: another member's
            raise PermissionError(1, "Operation not permitted", str(path))
        return chmod(path, *args, **kwargs)

    monkeypatch.setattr(os, "chmod", owned_only)  # as for a group member who owns none of the old folders
    update.add(index, more_rows(tmp_path), FakeEncoder())
    assert not files.work_dir(index, "old").exists() and Searcher.load(index, encoder=FakeEncoder()).manifest.n == 305


@pytest.mark.parametrize("name", ["old", "adding"])
def test_a_link_at_a_work_name_is_refused_not_followed(index: Path, tmp_path: Path, name: str) -> None:
    """A symbolic link at `.idx.old` made the writer chmod the whole tree it pointed to (and then fail); a
    link at one of the tool's own names is refused in one line naming it, the link and its target untouched."""
    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    for path in (victim / "sub", victim):
        path.chmod(0o555)
    link = files.work_dir(index, name)
    link.symlink_to(victim)
    try:
        with pytest.raises(PlantedLinkError, match=f"^{link} is a symbolic link where retrieval keeps its"):
            update.add(index, more_rows(tmp_path), FakeEncoder())
        assert link.is_symlink() and Manifest.load(index).n == 300
        assert {(victim / "sub").stat().st_mode & 0o777, victim.stat().st_mode & 0o777} == {0o555}
    finally:
        for path in (victim, victim / "sub"):
            path.chmod(0o755)


def test_links_a_user_put_in_an_index_are_carried_over_not_chmod_ed(index: Path, tmp_path: Path) -> None:
    """keep_permissions must not follow a user's symbolic links: it would chmod a file outside the index (or
    fail on a link to nothing)."""
    outside = tmp_path / "outside.txt"
    outside.write_text("mine")
    outside.chmod(0o644)
    (index / "notes").symlink_to(outside)
    (index / "gone").symlink_to(tmp_path / "nothing-here")
    index.chmod(0o700)
    update.add(index, more_rows(tmp_path), FakeEncoder())
    assert outside.stat().st_mode & 0o777 == 0o644 and (index / "notes").is_symlink() and (index / "gone").is_symlink()


def test_a_first_publish_warns_of_nothing_and_a_failed_clean_up_only_warns(tmp_path: Path, caplog, monkeypatch) -> None:
    """Publishing where nothing was before has no old version to remove: no warning. When the old version cannot be
    removed, the new one is in place: the writer warns, it does not fail."""
    import logging

    work, target = tmp_path / "work", tmp_path / "idx"
    work.mkdir()
    (work / "a").write_text("new")
    with caplog.at_level(logging.WARNING, logger="retrieval.files"):
        files.publish(work, target)
    assert caplog.records == [] and (target / "a").read_text() == "new"
    work.mkdir()
    (work / "a").write_text("newer")
    real = files.remove_tree

    def refused(path: Path) -> None:
        if path.exists():
            raise PermissionError(13, "Permission denied", str(path))
        real(path)

    monkeypatch.setattr(files, "remove_tree", refused)
    with caplog.at_level(logging.WARNING, logger="retrieval.files"):
        files.publish(work, target)
    assert (target / "a").read_text() == "newer" and "could not be removed" in caplog.text


def test_remove_tree_opens_up_only_what_it_may_and_removes_the_rest(tmp_path: Path, monkeypatch) -> None:
    """A leftover whose top folder is another member's (chmod refused) holding a write-protected folder of
    one's own: the refused chmod is skipped, the rest opened up, and the tree removed."""
    import os
    import shutil

    tree = tmp_path / ".idx.old"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "f").write_text("x")
    calls = {"rmtree": 0}
    real_rmtree, real_chmod = shutil.rmtree, os.chmod

    def rmtree(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls["rmtree"] += 1
        if calls["rmtree"] == 1:  # as for a user whom the write-protected sub refuses
            raise PermissionError(13, "Permission denied", str(path))
        return real_rmtree(path, *args, **kwargs)

    def chmod(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if Path(path) == tree:
            raise PermissionError(1, "Operation not permitted", str(path))
        return real_chmod(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    monkeypatch.setattr(os, "chmod", chmod)
    files.remove_tree(tree)
    assert not tree.exists() and calls["rmtree"] == 2


def test_an_index_this_user_cannot_write_is_refused(index: Path, monkeypatch) -> None:
    """Another user's 755 index: the mode has write bits, but not for this user (as root, os.access says yes
    to everything: simulated)."""
    import os

    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path) == index else real(path, mode))
    with pytest.raises(IndexDirError, match="write-protected"):
        files.check_replaceable(index)


def test_a_volume_mounted_from_elsewhere_is_a_mount_point(tmp_path: Path) -> None:
    """A container volume: another folder bind-mounted at the index's path (mountinfo's fifth field, not its
    fourth, the mount's source), in a folder whose name has a space (mountinfo writes it as \\040)."""
    import os
    import shutil

    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("a bind mount needs root")
    source, point = tmp_path / "volume source", tmp_path / "with space" / "idx"
    source.mkdir()
    point.mkdir(parents=True)
    if subprocess.run(["mount", "--bind", str(source), str(point)], capture_output=True).returncode != 0:
        pytest.skip("this machine allows no mounts")
    try:
        assert files.is_mount_point(files.resolved(point)) and not files.is_mount_point(point.parent)
    finally:
        subprocess.run(["umount", str(point)], capture_output=True)


def test_a_new_version_keeps_the_index_s_group_where_this_user_may_set_it(
    index: Path, tmp_path: Path, monkeypatch
) -> None:
    """An index of another group than its writer's: new files take the index's group; a writer who may not set it
    (not a member) still publishes, with the mode kept."""
    import os

    if os.geteuid() != 0:
        pytest.skip("giving an index another group needs root")
    for path in [index, *index.rglob("*")]:
        os.chown(path, -1, 100)
    update.add(index, more_rows(tmp_path), FakeEncoder())
    assert {path.stat().st_gid for path in [index, *index.rglob("*")]} == {100}

    def refused(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise PermissionError(1, "Operation not permitted")

    index.chmod(0o750)
    monkeypatch.setattr(os, "chown", refused)
    texts = [f"a later document {i}" for i in range(5)]
    later = write_corpus(tmp_path / "later.parquet", n=5, id=[f"y{i}" for i in range(5)], text=texts)
    update.add(index, CorpusSpec(later), FakeEncoder())
    assert index.stat().st_mode & 0o7777 == 0o750 and Searcher.load(index, encoder=FakeEncoder()).manifest.n == 310
