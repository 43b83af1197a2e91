"""Links and special files planted at the names this tool keeps beside and inside an index: refused in one line
naming them, never followed; a reader that moves nothing. Every link is planted in tmp_path and points into it."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import FakeEncoder, write_corpus
from typer.testing import CliRunner, Result

from retrieval import files, update
from retrieval.build import BuildOptions, build_index
from retrieval.cli import home
from retrieval.cli.app import app
from retrieval.corpus import CorpusSpec
from retrieval.errors import ConfigError, IndexDirError, PlantedLinkError
from retrieval.indexdir import load
from retrieval.manifest import Manifest
from retrieval.whitening import TransformSpec

runner = CliRunner()


@pytest.fixture
def index(tmp_path: Path) -> Path:
    corpus = write_corpus(tmp_path / "corpus.parquet", n=120)
    build_index(CorpusSpec(corpus), FakeEncoder(), tmp_path / "idx", TransformSpec(dim=8))
    return tmp_path / "idx"


def more_rows(tmp_path: Path, n: int = 5) -> CorpusSpec:
    return CorpusSpec(write_corpus(tmp_path / "more.parquet", n=n, id=[f"x{i}" for i in range(n)]))


def precious(tmp_path: Path) -> Path:
    """A folder outside the index, with one file, that no planted link may get written, moved or removed."""
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    (folder / "keep.txt").write_text("mine")
    return folder


def one_line(result: Result, *fragments: str) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 1, (result.exit_code, result.output, result.exception)
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, lines
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def siblings(path: Path) -> list[str]:
    return sorted(entry.name for entry in path.parent.iterdir())


# ----- the writers' lock ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("victim_exists", [True, False])
def test_a_link_at_the_lock_file_is_refused_not_followed(index: Path, tmp_path: Path, victim_exists: bool) -> None:
    """`ln -s /some/path .idx.lock; retrieval add idx new.parquet` created (or locked) /some/path."""
    victim = tmp_path / "victim.txt"
    if victim_exists:
        victim.write_text("mine")
    link = files.lock_path(index)
    link.symlink_to(victim)
    with pytest.raises(PlantedLinkError, match=f"^{link} is a symbolic link where retrieval keeps its writer's lock"):
        update.add(index, more_rows(tmp_path), FakeEncoder())
    assert victim.exists() == victim_exists and (not victim_exists or victim.read_text() == "mine")
    assert link.is_symlink() and Manifest.load(index).n == 120


def test_a_fifo_or_folder_at_the_lock_file_is_refused(index: Path, tmp_path: Path) -> None:
    lock = files.lock_path(index)
    os.mkfifo(lock)
    with pytest.raises(PlantedLinkError, match=f"^{lock} is not a file but retrieval keeps its writer's lock"):
        update.refit(index, TransformSpec(dim=4))
    lock.unlink()
    lock.mkdir()
    with pytest.raises(PlantedLinkError, match=f"^{lock} is not a file"):
        update.refit(index, TransformSpec(dim=4))
    assert Manifest.load(index).transform.dim == 8


def test_the_cli_refuses_a_planted_lock_in_one_line(index: Path, tmp_path: Path) -> None:
    files.lock_path(index).symlink_to(tmp_path / "victim")
    one_line(runner.invoke(app, ["refit", str(index), "--dim", "4"]), f"{files.lock_path(index)} is a symbolic link")
    assert not (tmp_path / "victim").exists()


# ----- the previous version's name, and readers ----------------------------------------------------------------
def test_a_reader_never_renames_a_planted_old_version_into_place(index: Path, tmp_path: Path) -> None:
    """With idx absent, `ln -s /elsewhere .idx.old; retrieval search q --index idx` renamed the link into place
    and served the outside folder as the index (later writes went there too)."""
    elsewhere = tmp_path / "elsewhere-index"
    index.rename(elsewhere)
    old = files.work_dir(index, "old")
    old.symlink_to(elsewhere)
    with pytest.raises(IndexDirError, match=f"no index directory at {index}"):
        load(index, "quick")
    assert (
        old.is_symlink()
        and not os.path.lexists(index)
        and siblings(index) == sorted(["corpus.parquet", "elsewhere-index", ".idx.old"])
    )


def test_a_reader_leaves_an_interrupted_publish_to_the_writers(index: Path) -> None:
    """A publish killed between its two renames: the reader says where the previous version is and creates,
    renames and deletes nothing (it used to take the writers' lock and rename it back)."""
    old = files.work_dir(index, "old")
    index.rename(old)
    before = siblings(index)
    with pytest.raises(IndexDirError, match="its previous version is at .*idx.old: .*next `retrieval add`"):
        load(index, "quick")
    assert siblings(index) == before
    with files.writing(index):  # a writer puts it back
        pass
    assert load(index, "quick").manifest.n == 120


def test_a_writer_refuses_a_link_at_the_old_version_name(index: Path, tmp_path: Path) -> None:
    elsewhere = precious(tmp_path)
    index.rename(tmp_path / "moved")
    old = files.work_dir(index, "old")
    old.symlink_to(elsewhere)
    with pytest.raises(PlantedLinkError, match=f"^{old} is a symbolic link where retrieval keeps its previous version"):
        update.add(index, more_rows(tmp_path), FakeEncoder())
    assert old.is_symlink() and not os.path.lexists(index) and os.listdir(elsewhere) == ["keep.txt"]


# ----- a build's work folder -----------------------------------------------------------------------------------
@pytest.mark.parametrize("resume", [False, True])
@pytest.mark.parametrize("dangling", [False, True])
def test_a_link_at_the_build_folder_is_refused_in_one_line(tmp_path: Path, resume: bool, dangling: bool) -> None:
    """A link (or a dangling one) at `.out.building`: `index --out out [--resume]` died with "Cannot call rmtree
    on a symbolic link" or FileExistsError, again and again until the link was removed by hand."""
    corpus = write_corpus(tmp_path / "c.parquet", n=60)
    vectors = tmp_path / "vectors.npy"
    np.save(vectors, np.random.default_rng(0).normal(size=(60, 8)).astype(np.float32))
    out = tmp_path / "out"
    link = files.work_dir(out)
    link.symlink_to(tmp_path / "nothing" if dangling else precious(tmp_path))
    args = ["index", str(vectors), "--out", str(out), "--dim", "4"]
    result = runner.invoke(app, args + (["--resume"] if resume else []))
    one_line(result, f"{link} is a symbolic link where retrieval keeps its work folder", "remove the link")
    assert link.is_symlink() and not out.exists() and not files.lock_path(out).exists()
    assert dangling or os.listdir(tmp_path / "elsewhere") == ["keep.txt"]
    with pytest.raises(PlantedLinkError, match=f"^{link} is a symbolic link"):
        build_index(CorpusSpec(corpus), FakeEncoder(), out, TransformSpec(dim=4), options=BuildOptions(resume=resume))


# ----- files written and copied inside an index --------------------------------------------------------------
def test_an_atomic_write_never_writes_through_a_link_at_its_temporary_name(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    target = tmp_path / "stash.json"
    link = tmp_path / f"stash.json.{os.getpid()}.tmp"
    link.symlink_to(victim)
    with pytest.raises(PlantedLinkError, match="stash.json.[0-9]+.tmp is a symbolic link"):
        files.write_atomic(target, b"new")
    assert victim.read_text() == "mine" and not target.exists() and link.is_symlink()


def test_a_fifo_a_user_left_in_the_index_does_not_hang_a_writer(index: Path, tmp_path: Path) -> None:
    """The user's entries are carried into each new version; flushing them opened a FIFO for reading, which
    blocks until a writer opens its other end: `add` hung for ever."""
    fifo = index / "pipe"
    os.mkfifo(fifo)
    done: list[int] = []
    writer = threading.Thread(target=lambda: done.append(update.add(index, more_rows(tmp_path), FakeEncoder()).n))
    writer.start()
    writer.join(timeout=60)
    if writer.is_alive():  # the old code: open the other end, so the stuck writer can finish
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        writer.join()
    assert done == [125] and not writer.is_alive()
    assert (index / "pipe").exists() and not (index / "pipe").is_file()


def test_a_copy_across_devices_keeps_a_link_a_link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where hard links fail (another device), a symbolic link among the files carried from the previous version
    was copied as the file it names: the contents of a file outside the index taken into it."""
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    (tmp_path / "a").symlink_to(victim)

    def cross_device(*args: object, **kwargs: object) -> None:
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cross_device)
    files.link_or_copy(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "b").is_symlink() and os.readlink(tmp_path / "b") == str(victim)


def test_the_default_index_pointer_is_never_written_through_a_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "indexes"
    root.mkdir()
    monkeypatch.setenv("RETRIEVAL_INDEX_ROOT", str(root))
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    (root / home.LAST_NAME).symlink_to(victim)
    home.remember(root / "idx")
    assert victim.read_text() == "mine" and (root / home.LAST_NAME).read_text() == "idx\n"
    assert not (root / home.LAST_NAME).is_symlink()


def test_a_dangling_link_at_the_output_is_refused(tmp_path: Path) -> None:
    """A link at OUT to an index builds that index (a link to an index is followed on purpose); a dangling one
    made the build create its target, wherever it pointed."""
    corpus = write_corpus(tmp_path / "c.parquet", n=60)
    out = tmp_path / "out"
    out.symlink_to(tmp_path / "far" / "away")
    with pytest.raises(ConfigError, match=f"^{out} is a symbolic link to .*far/away, which does not exist"):
        build_index(CorpusSpec(corpus), FakeEncoder(), out, TransformSpec(dim=4))
    assert out.is_symlink() and not (tmp_path / "far").exists()
