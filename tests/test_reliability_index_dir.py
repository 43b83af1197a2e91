"""Reliability, the index directory: hand-edited, damaged, read-only, write-protected, mounted, private,
symlinked or planted-with-links indexes, and writers refused before they read what is damaged."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import FakeEncoder, write_corpus
from reliability import case, leftovers, new_docs, ok, one_line, run, snapshot

from retrieval import files, update
from retrieval.build import BuildOptions, build_index
from retrieval.corpus import CorpusSpec
from retrieval.errors import ConfigError, IndexDirError
from retrieval.evaluate import Queries
from retrieval.indexdir import INDEX, MANIFEST, STASH, IndexDir
from retrieval.manifest import Manifest
from retrieval.search import Searcher
from retrieval.tune import tune_index
from retrieval.whitening import TransformSpec


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (lambda m: m["transform"].__setitem__("k", 4), "does not match its own checksum"),
        (lambda m: m["transform"]["spec"].__setitem__("gamma", 1.0), "does not match its own checksum"),
        (lambda m: m["encoder"].__setitem__("model", "some/other-model"), "does not match its own checksum"),
        (lambda m: m["transform"].__setitem__("d", 64), "does not match its own checksum"),
        (lambda m: m.__setitem__("schema_version", 1), "schema version 1; this retrieval reads versions 2 to 5"),
    ],
    ids=["k", "gamma", "model", "d", "schema"],
)
@case(
    "index dir",
    "manifest edited by hand (dim, d, gamma, model, schema version)",
    "one line: the manifest does not match its checksum (or its schema); rebuild",
)
def test_tampered_manifest(copy: Path, edit: Callable[[dict], None], fragment: str) -> None:
    data = json.loads((copy / MANIFEST).read_text())
    edit(data)
    (copy / MANIFEST).write_text(json.dumps(data, indent=2))
    one_line(run("search", "anything", "--index", copy), fragment)
    one_line(run("info", copy), fragment)


@pytest.mark.parametrize(
    ("name", "damage", "fragment"),
    [
        ("index.faiss", "zero", "checksum mismatch"),
        ("docs.arrow", "truncate", "checksum mismatch"),
        ("transform.npz", "delete", "is missing"),
        ("manifest.json", "delete", "not a complete index"),
        ("manifest.json", "truncate", "not valid JSON"),
    ],
)
@case(
    "index dir",
    "a file zeroed, truncated or deleted (index, docs, transform, manifest)",
    "one line naming the file; `info --verify` too",
)
def test_damaged_files(copy: Path, name: str, damage: str, fragment: str) -> None:
    path = copy / name
    if damage == "zero":
        path.write_bytes(bytes(path.stat().st_size))
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        path.unlink()
    one_line(run("search", "anything", "--index", copy), fragment)
    one_line(run("info", copy, "--verify"), fragment)


@case(
    "index dir",
    "extra files a user put inside an index",
    "searches ignore them; add, refit and --overwrite carry them over",
)
def test_extra_files_inside_an_index(copy: Path, tmp_path: Path) -> None:
    (copy / "NOTES.md").write_text("mine")
    (copy / "results").mkdir()
    (copy / "results" / "r.json").write_text("{}")
    ok(run("search", "document", "--index", copy))
    ok(run("refit", copy, "--dim", 4))
    ok(run("add", copy, new_docs(tmp_path / "more.parquet")))
    assert (copy / "NOTES.md").read_text() == "mine" and (copy / "results" / "r.json").read_text() == "{}"


@contextmanager
def read_only(directory: Path) -> Iterator[str]:
    """``directory`` read-only: a read-only bind mount where this machine allows mounts (as root, where write
    permissions are not enforced, a chmod would prove nothing), else write calls failing with EROFS."""
    if os.geteuid() == 0 and shutil.which("mount"):
        bind = subprocess.run(["mount", "--bind", str(directory), str(directory)], capture_output=True)
        if bind.returncode == 0:
            remount = subprocess.run(["mount", "-o", "remount,ro,bind", str(directory)], capture_output=True)
            try:
                if remount.returncode == 0:
                    yield "mount"
                    return
            finally:
                subprocess.run(["umount", str(directory)], capture_output=True)
    with pytest.MonkeyPatch.context() as mp:
        real_open = os.open

        def refuse(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            if str(path).startswith(str(directory)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                raise OSError(30, "Read-only file system", str(path))
            return real_open(path, flags, *args, **kwargs)

        mp.setattr(os, "open", refuse)
        yield "simulated"


@case("index dir", "the index on a read-only file system", "search works; add, refit and remove refuse in one line")
def test_read_only_index(copy: Path, tmp_path: Path) -> None:
    more = new_docs(tmp_path / "more.parquet")
    expected = ok(run("search", "document number 3", "--index", copy, "--json")).stdout
    with read_only(copy.parent):
        assert ok(run("search", "document number 3", "--index", copy, "--json")).stdout == expected
        one_line(run("add", copy, more), "cannot write", "writable directory")
        one_line(run("refit", copy, "--dim", 4), "cannot write", "writable directory")
        one_line(run("remove", copy, "doc3"), "cannot write", "writable directory")
    assert leftovers(copy) == []


@case(
    "index dir",
    "a write-protected index (`chmod -R a-w`)",
    "search works; add, refit and remove refuse in one line saying `chmod -R u+w` (they replaced it, then could not "
    "remove the old version, and every later writer failed)",
)
def test_write_protected_index(copy: Path, tmp_path: Path) -> None:
    expected = ok(run("search", "document number 3", "--index", copy, "--json")).stdout
    before = snapshot(copy)
    for path in [copy, *copy.rglob("*")]:
        path.chmod(path.stat().st_mode & ~0o222)
    try:
        assert ok(run("search", "document number 3", "--index", copy, "--json")).stdout == expected
        one_line(run("add", copy, new_docs(tmp_path / "more.parquet")), "is write-protected", "chmod -R u+w")
        one_line(run("refit", copy, "--dim", 4), "is write-protected")
        one_line(run("remove", copy, "doc3"), "is write-protected")
    finally:
        for path in [copy, *copy.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)
    assert snapshot(copy) == before and leftovers(copy) == []


@case(
    "index dir",
    "the index folder is itself a mount point (a container's volume)",
    "search works; writers refuse in one line before encoding, saying to mount the folder that holds it (a "
    "traceback, Device or resource busy, after the encoding)",
)
def test_index_that_is_a_mount_point(copy: Path, tmp_path: Path) -> None:
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("a bind mount needs root")
    if subprocess.run(["mount", "--bind", str(copy), str(copy)], capture_output=True).returncode != 0:
        pytest.skip("this machine allows no mounts")
    try:
        before = snapshot(copy)
        ok(run("search", "document", "--index", copy))
        one_line(run("add", copy, new_docs(tmp_path / "more.parquet")), "is a mount point", "mount the folder")
        one_line(run("refit", copy, "--dim", 4), "is a mount point")
        assert snapshot(copy) == before
    finally:
        subprocess.run(["umount", str(copy)], capture_output=True)
    assert leftovers(copy) == []


@case(
    "index dir",
    "a private index (folders 700, files 600) updated by a writer whose umask is 022",
    "the new version keeps 700/600 (it became 755/644: readable by all)",
)
def test_private_index_stays_private(copy: Path, tmp_path: Path) -> None:
    for path in [copy, *copy.rglob("*")]:
        path.chmod(0o700 if path.is_dir() else 0o600)
    umask = os.umask(0o022)
    try:
        ok(run("add", copy, new_docs(tmp_path / "more.parquet")))
        ok(run("refit", copy, "--dim", 4))
    finally:
        os.umask(umask)
    modes = {path.stat().st_mode & 0o777 for path in [copy, *copy.rglob("*")] if path.is_dir()}
    assert modes == {0o700}
    assert {path.stat().st_mode & 0o777 for path in copy.rglob("*") if path.is_file()} == {0o600}


@case(
    "index dir",
    "`remove` with ids the index does not hold",
    "one line naming the first of them; nothing removed (`--missing-ok` removes the others)",
)
def test_remove_unknown_ids(fake_index: Path) -> None:
    before = snapshot(fake_index)
    one_line(run("remove", fake_index, "doc3", "no-such-doc"), "1 of the 2 ids", "first: 'no-such-doc'", "--missing-ok")
    assert snapshot(fake_index) == before and leftovers(fake_index) == []


@case(
    "index dir",
    "the index reached through a symbolic link",
    "search works; add works again and again and the link keeps pointing at the index",
)
def test_symlinked_index(copy: Path, tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(copy)
    ok(run("search", "document", "--index", link))
    ok(run("add", link, new_docs(tmp_path / "a.parquet", prefix="a")))
    ok(run("add", link, new_docs(tmp_path / "b.parquet", prefix="b")))
    assert link.is_symlink() and Manifest.load(link).n == 160 == Manifest.load(copy).n


@case(
    "index dir",
    "a second writer through a symbolic link to the same index",
    "refused: the lock is on the real directory",
)
def test_lock_is_on_the_resolved_directory(copy: Path, tmp_path: Path) -> None:
    link = tmp_path / "alias"
    link.symlink_to(copy)
    with files.writing(files.resolved(copy)):
        one_line(run("refit", link, "--dim", 4), "another retrieval process is writing")


@case("index dir", "`add` with an encoder of another model", "refused: the index was built with another model")
def test_add_with_another_model(fake_index: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="built with model 'fake'.* query encoder uses 'other'"):
        update.add(fake_index, CorpusSpec(new_docs(tmp_path / "m.parquet")), FakeEncoder(name="other"))


@case(
    "index dir",
    "stash.json naming a part outside the index (../../secret.npy)",
    "refused before anything is read or linked",
)
def test_stash_paths_outside_the_index(fake_index: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.npy"
    np.save(secret, np.zeros((3, 16), dtype=np.float32))
    state_path = fake_index / STASH / "stash.json"
    state = json.loads(state_path.read_text())
    state["parts"][0]["vectors"]["mean"] = "../../secret.npy"
    state_path.write_text(json.dumps(state))
    with pytest.raises(IndexDirError, match="outside the stash"):
        IndexDir(fake_index).stash()
    with pytest.raises(IndexDirError):  # refit verifies stash.json against the manifest first
        update.refit(fake_index, TransformSpec(dim=4))
    assert not list(fake_index.rglob("secret.npy"))


@pytest.mark.parametrize("damage", ["garbage", "shuffled"])
@case(
    "index dir",
    "a stash part overwritten with garbage, or its rows shuffled, then refit / tune / calibrate / re-score (a "
    "one-shot search included)",
    "refused (checksum mismatch; a one-shot search checks sizes and sampled hashes of the parts it maps); the "
    "index is not rebuilt from garbage",
)
def test_garbage_in_the_stash(fake_index: Path, damage: str) -> None:
    stash = IndexDir(fake_index).stash()
    part = stash.root / stash.parts[0].vectors["mean"]
    if damage == "garbage":
        part.write_bytes(part.read_bytes()[:128] + os.urandom(part.stat().st_size - 128))  # same size, garbage
    else:  # a one-shot search re-scored these and answered other documents' ids with exit 0
        rows = np.load(part)
        np.save(part, rows[np.random.default_rng(1).permutation(len(rows))])
    before = snapshot(fake_index)
    with pytest.raises(IndexDirError, match="corrupt"):
        update.refit(fake_index, TransformSpec(dim=4))
    assert snapshot(fake_index) == before and leftovers(fake_index) == []
    dev = (Queries(["q"], ["document number 1"]), {"q": {"doc1": 1}})
    with pytest.raises(IndexDirError, match="corrupt"):
        tune_index(fake_index, dev, dims=[4], gammas=[0.5])
    with pytest.raises(IndexDirError, match="corrupt"):  # a searcher that re-scores loads with full checks
        Searcher.load(fake_index, encoder=FakeEncoder())
    with pytest.raises(IndexDirError, match="corrupt"):  # ... and a one-shot search with quick ones
        Searcher.load(fake_index, encoder=FakeEncoder(), verify="quick")
    with pytest.raises(ConfigError, match="no knob to calibrate"):  # refused before any file is read
        update.calibrate_index(fake_index, FakeEncoder().encode(["a query"]), 0.9)
    assert snapshot(fake_index) == before and leftovers(fake_index) == []


def flip_middle_byte(data: bytes) -> bytes:
    return data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + data[len(data) // 2 + 1 :]


@pytest.mark.parametrize(
    ("name", "damage", "message"),
    [
        (INDEX, flip_middle_byte, "checksum mismatch"),
        # a readable file still, saying something else: it would have been copied on as true
        (f"{STASH}/part-00000.parquet", lambda data: data.replace(b"document", b"DOCUMENT", 1), "is corrupt"),
    ],
)
@case(
    "index dir",
    "`add` on an index with a flipped byte in index.faiss, or a stashed (id, text) part altered at the same size",
    "refused (checksum mismatch) before anything is read from it; nothing republished with fresh checksums",
)
def test_add_on_a_damaged_index(
    fake_index: Path, tmp_path: Path, name: str, damage: Callable[[bytes], bytes], message: str
) -> None:
    path = fake_index / name
    damaged = damage(path.read_bytes())
    assert damaged != path.read_bytes() and len(damaged) == path.stat().st_size
    path.write_bytes(damaged)
    before = snapshot(fake_index)
    with pytest.raises(IndexDirError, match=message):
        update.add(fake_index, CorpusSpec(new_docs(tmp_path / "m.parquet")), FakeEncoder())
    assert snapshot(fake_index) == before


@case(
    "index dir",
    "`index` without --overwrite onto an index left renamed aside by a publish killed between its renames",
    "refused in one line (it exists); the old index put back, unchanged",
)
def test_build_after_an_interrupted_publish_needs_overwrite(fake_index: Path, tmp_path: Path) -> None:
    before = snapshot(fake_index)
    os.rename(fake_index, files.work_dir(fake_index, "old"))
    with pytest.raises(ConfigError, match="already exists"):
        build_index(CorpusSpec(write_corpus(tmp_path / "b.parquet", 50)), FakeEncoder(), fake_index)
    assert snapshot(fake_index) == before and leftovers(fake_index) == []


@case(
    "index dir",
    "a symbolic link planted inside an unfinished build, then --resume",
    "refused; nothing outside the index deleted or written",
)
def test_planted_symlink_in_a_work_dir(tmp_path: Path) -> None:
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    out = tmp_path / "idx"
    work = files.work_dir(out)
    (work / STASH).mkdir(parents=True)
    (work / STASH / "stash.json").write_text("{}")
    (work / STASH / "planted").symlink_to(outside)
    corpus = write_corpus(tmp_path / "c.parquet", n=50)
    with pytest.raises(IndexDirError, match="symbolic link"):
        build_index(CorpusSpec(corpus), FakeEncoder(), out, TransformSpec(dim=4), options=BuildOptions(resume=True))
    assert (outside / "keep.txt").read_text() == "mine"
