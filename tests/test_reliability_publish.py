"""Reliability, publishing: readers racing a publish, writers racing each other, a publish cut short (a kill
between its renames, a full disk, a failed FAISS write): a version is whole or absent, never half."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, FakeEncoder, write_corpus
from killed_writer import start_writer, wait_for
from reliability import QRELS, QUERIES, case, leftovers, new_docs, ok, one_line, run, snapshot, table_file, texts

from retrieval import files, indexdir, update
from retrieval.build import BuildOptions, build_index
from retrieval.corpus import CorpusSpec
from retrieval.errors import IndexDirError
from retrieval.indexdir import IndexDir, load
from retrieval.search import Searcher, SearchParams
from retrieval.whitening import TransformSpec


@pytest.mark.parametrize("dim", [8, None])
@case(
    "concurrency",
    "a searcher loaded just before `index --overwrite` publishes, then re-scoring (by default, or asked for on "
    "a raw index, whose stash is mapped on first use)",
    "re-scores with its own version's stashed vectors, never the new version's; or refuses: load it again",
)
def test_a_searcher_rescores_its_own_version(tmp_path: Path, dim: int | None) -> None:
    out = tmp_path / "idx"
    build_index(CorpusSpec(write_corpus(tmp_path / "a.parquet", 300)), FakeEncoder(), out, TransformSpec(dim=dim))
    params = SearchParams(k=5, rescore=20)
    reference = Searcher.load(shutil.copytree(out, tmp_path / "copy"), encoder=FakeEncoder())
    expected = [[(h.id, h.score) for h in hits] for hits in reference.search_batch(texts(5), params)]
    searcher = Searcher.load(out, encoder=FakeEncoder(), verify="quick")  # loaded, not yet searched
    other = table_file(tmp_path / "b.parquet", id=[f"b{i}" for i in range(200)], text=texts(200, "other words"))
    build_index(CorpusSpec(other), FakeEncoder(), out, TransformSpec(dim=dim), options=BuildOptions(overwrite=True))
    if dim is None:  # raw: no re-scoring by default, so nothing was mapped at load
        assert searcher.manifest.rescoring.depth == 0
        with pytest.raises(IndexDirError, match="replaced since it was loaded"):
            searcher.search_batch(texts(5), params)
        return
    assert searcher.manifest.rescoring.depth > 0
    got = [[(h.id, h.score) for h in hits] for hits in searcher.search_batch(texts(5), params)]
    assert got == expected


@pytest.mark.parametrize("through", ["path", "symlink"])
@case(
    "concurrency",
    "a reader (by the path or a symbolic link to it) arriving between a publish's two renames",
    "waits for the publish and reads the index; one that saw the directory missing retries",
)
def test_a_reader_in_the_publish_gap(fake_index: Path, tmp_path: Path, through: str) -> None:
    path = fake_index
    if through == "symlink":
        path = tmp_path / "link"
        path.symlink_to(fake_index)
    old = files.work_dir(fake_index, "old")
    with files.writing(fake_index):  # a writer holds the lock, between rename(target, old) and rename(work, target)
        os.rename(fake_index, old)
        timer = threading.Timer(0.3, lambda: os.rename(old, fake_index))
        timer.start()
        start = time.monotonic()
        assert load(path, "quick").manifest.n == 300
        assert time.monotonic() - start >= 0.25
        timer.join()


def test_a_reader_that_saw_the_gap_retries(fake_index: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The directory missing when the read starts, back (publish done) before the failure is judged."""
    old = files.work_dir(fake_index, "old")
    real_load_once = indexdir._load_once
    calls = []

    def load_once(directory: IndexDir, verify: Any) -> Any:
        calls.append(directory)
        try:
            return real_load_once(directory, verify)
        finally:
            if len(calls) == 1:
                os.rename(old, fake_index)

    monkeypatch.setattr(indexdir, "_load_once", load_once)
    with files.writing(fake_index):
        os.rename(fake_index, old)
        assert indexdir.load(fake_index, "quick").manifest.n == 300
    assert len(calls) == 2


@pytest.mark.parametrize("fault", ["disk full", "read-only", "interrupted"])
@case(
    "faults",
    "`tune --results` and `eval ir --per-query` writing to a full disk or a read-only place, or interrupted "
    "while they write",
    "one line (or exit 130); the results whole or as they were: no half file, no stale plot beside new "
    "numbers, no empty folder made",
)
def test_results_are_whole_or_untouched(
    cli_index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    queries = table_file(tmp_path / "q.parquet", **QUERIES)
    qrels = table_file(tmp_path / "r.parquet", **QRELS)
    judged = ("--queries", queries, "--qrels", qrels)
    old = tmp_path / "old"
    old.mkdir()
    (old / "tune.json").write_text("earlier results")
    (old / "tune.png").write_bytes(b"earlier plot")
    (old / "pq.jsonl").write_text("earlier per-query lines")
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    error = {"disk full": OSError(28, "No space left on device"), "read-only": OSError(30, "Read-only file system")}
    fail = KeyboardInterrupt() if fault == "interrupted" else error[fault]
    real_fsync = os.fsync

    def failing(fd: int) -> None:  # the file's bytes are written (to its temporary name) when the fault comes
        raise fail

    monkeypatch.setattr(os, "fsync", failing)
    fragment = {"disk full": "no space left on the device while writing", "read-only": "cannot write"}
    code = 130 if fault == "interrupted" else 1
    for results in (old, tmp_path / "new" / "results"):
        result = run("tune", cli_index, *judged, "--dims", 4, "--gammas", 0, "--results", results)
        last = result.stderr.splitlines()[-1]  # after the sweep's own warnings (a 120-row corpus)
        assert result.exit_code == code and "Traceback" not in result.output, result.output
        assert last == "error: interrupted" if code == 130 else fragment[fault] in last and str(results) in last
    result = run("eval", "ir", cli_index, *judged, "--per-query", old / "pq.jsonl")
    assert result.exit_code == code and "Traceback" not in result.output
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before
    assert not (tmp_path / "new" / "results").exists()

    monkeypatch.setattr(os, "fsync", real_fsync)
    ok(run("tune", cli_index, *judged, "--dims", 4, "--gammas", 0, "--results", old))
    assert json.loads((old / "tune.json").read_text())["metric"] == "nDCG@10"
    assert (old / "tune.png").read_bytes()[:4] == b"\x89PNG" and sorted(p.name for p in old.iterdir()) == [
        "pq.jsonl", "tune.json", "tune.png"
    ]  # fmt: skip


@contextmanager
def small_disk(directory: Path, size: str) -> Iterator[str]:
    """A ``size`` tmpfs mounted at ``directory`` where mounts are allowed; else writes of more than ~1 MB under
    it fail with ENOSPC."""
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0 and shutil.which("mount"):
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], capture_output=True
        )
        if mounted.returncode == 0:
            try:
                yield "tmpfs"
            finally:
                subprocess.run(["umount", "-l", str(directory)], capture_output=True)
            return
    with pytest.MonkeyPatch.context() as mp:
        real = files.write_atomic

        def full(path: Path, data: bytes) -> None:
            if str(path).startswith(str(directory)) and len(data) > 200_000:
                raise OSError(28, "No space left on device", str(path))
            real(path, data)

        mp.setattr(files, "write_atomic", full)
        mp.setattr("retrieval.stash.write_atomic", full)
        yield "simulated"


@case(
    "faults",
    "the disk fills up during a build over an existing index",
    "one line (no space left); the old index intact; no work directory left",
)
def test_disk_full_during_a_build(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    with small_disk(disk, "1m"):
        out = disk / "idx"
        build_index(
            CorpusSpec(write_corpus(tmp_path / "small.parquet", n=40)), FakeEncoder(), out, TransformSpec(dim=4)
        )
        before = snapshot(out)
        big = write_corpus(tmp_path / "big.parquet", n=20_000)
        with pytest.raises(IndexDirError, match="no space left on the device"):
            build_index(CorpusSpec(big), FakeEncoder(), out, TransformSpec(dim=4), options=BuildOptions(overwrite=True))
        assert snapshot(out) == before and leftovers(out) == []
        assert Searcher.load(out, encoder=FakeEncoder()).manifest.n == 40


@pytest.mark.parametrize("first", ["add", "refit", "remove", "info --verify"])
@case(
    "faults",
    "a publish killed between its two renames (the index moved aside), then `add`, `refit`, `remove` or "
    "`info --verify` before any search",
    "a writer puts the previous version back and works; `info` (a reader: it never moves anything) says where the "
    "previous version is and how to put it back",
)
def test_an_index_left_aside_is_restored_by_whichever_writer_comes_first(
    fake_index: Path, tmp_path: Path, first: str
) -> None:
    before = snapshot(fake_index)
    os.rename(fake_index, files.work_dir(fake_index, "old"))  # the state a kill after publish's first rename leaves
    argv = {
        "add": ["add", fake_index, new_docs(tmp_path / "more.parquet")],
        "refit": ["refit", fake_index, "--dim", 4],
        "remove": ["remove", fake_index, "doc3"],
        "info --verify": ["info", fake_index, "--verify"],
    }[first]
    result = run(*argv) if first == "info --verify" else None
    if result is None:  # the writers load the fake encoder's index through the library, as the CLI would
        if first == "add":
            update.add(fake_index, update.read_like_build(fake_index, argv[2]), FakeEncoder())
        elif first == "refit":
            update.refit(fake_index, update.transform_spec(fake_index, dim=4))
        else:
            update.remove(fake_index, ["doc3"])
    else:
        one_line(result, "its previous version is at", "the next `retrieval add`, `retrieval remove` or")
        assert not fake_index.exists()
        update.current(fake_index)
        assert snapshot(fake_index) == before
    assert leftovers(fake_index) == []


@case(
    "faults",
    "a refit whose kept settings were read before another writer published",
    "refused in one line (its unset options would undo the other writer's change); run again",
)
def test_a_refit_based_on_an_older_version_is_refused(fake_index: Path, tmp_path: Path) -> None:
    generation = IndexDir(fake_index).manifest().generation
    spec = update.transform_spec(fake_index, gamma=1.0)  # read as `retrieval refit --gamma 1` reads it ...
    update.refit(fake_index, update.transform_spec(fake_index, dim=6))  # ... when another refit publishes first
    with pytest.raises(IndexDirError, match=r"changed since this refit read it \(version 1 -> 2, .*\): run it again"):
        update.refit(fake_index, spec, generation=generation)
    assert IndexDir(fake_index).manifest().transform.dim == 6  # the other writer's change stands


@case(
    "faults",
    "a killed update's work directory (`.IDX.refitting`) when a writer of another kind runs next",
    "removed by the next writer of any kind; a build's `.IDX.building` is kept for `--resume`",
)
def test_a_killed_update_s_work_is_cleared_by_any_next_writer(fake_index: Path, tmp_path: Path) -> None:
    for purpose in (*files.UPDATE_PURPOSES, "building"):
        (files.work_dir(fake_index, purpose) / "index.faiss").parent.mkdir()
        (files.work_dir(fake_index, purpose) / "index.faiss").write_bytes(b"a killed writer's")
    update.add(fake_index, CorpusSpec(new_docs(tmp_path / "m.parquet")), FakeEncoder())
    assert leftovers(fake_index) == [files.work_dir(fake_index).name]  # .fidx.building only


@pytest.mark.parametrize(
    ("said", "message"),
    [
        ("write error in x: 0 != 4096 (No space left on device)", "no space left on the device"),
        ("something FAISS could not do", r"FAISS could not write .*index.faiss \(.*: something FAISS could not do\)"),
    ],
)
@case(
    "faults",
    "FAISS fails to write `index.faiss` (a full disk) in `add` or a build",
    "one line (no space left, or FAISS's own reason); the old index intact; no work directory left",
)
def test_a_failed_faiss_write_is_one_line(fake_index: Path, tmp_path: Path, said: str, message: str) -> None:
    import faiss

    before = snapshot(fake_index)

    def refuse(*args: Any) -> None:
        raise RuntimeError(f"Error in void faiss::write_index: {said}")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(faiss, "write_index", refuse)
        with pytest.raises(IndexDirError, match=message):
            update.add(fake_index, CorpusSpec(new_docs(tmp_path / "m.parquet")), FakeEncoder())
        corpus = write_corpus(tmp_path / "c.parquet", n=50)
        with pytest.raises(IndexDirError, match=message):
            build_index(
                CorpusSpec(corpus),
                FakeEncoder(),
                fake_index,
                TransformSpec(dim=4),
                options=BuildOptions(overwrite=True),
            )
    assert snapshot(fake_index) == before and leftovers(fake_index) == []


@pytest.mark.process
@case(
    "faults",
    "two writers at once (`add` while `refit` runs)",
    "the second is refused at once in one line; the first completes",
)
def test_two_writers(fake_index: Path, tmp_path: Path) -> None:
    process, marker = start_writer(tmp_path, "refit", fake_index, "write")
    try:
        wait_for(marker, process)
        with pytest.raises(IndexDirError, match="another retrieval process is writing"):
            update.add(fake_index, CorpusSpec(new_docs(tmp_path / "m.parquet")), FakeEncoder())
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)
    update.add(fake_index, CorpusSpec(new_docs(tmp_path / "m.parquet")), FakeEncoder())  # free again afterwards


@pytest.mark.process
@case("faults", "`retrieval search` processes in a loop while `add` publishes three times", "zero failed searches")
def test_searches_while_add_publishes(copy: Path, tmp_path: Path, tiny_bert: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RETRIEVAL_INDEX_ROOT": str(tmp_path / "root")}
    loop = (
        "import sys, time\nfrom retrieval.search import Searcher, SearchParams\nfails = runs = 0\n"
        "end = time.monotonic() + float(sys.argv[2])\nwhile time.monotonic() < end:\n"
        "    try:\n        Searcher.load(sys.argv[1], verify='quick').search('document', SearchParams(k=3))\n"
        "        runs += 1\n"
        "    except Exception as err:\n        fails += 1; print(repr(err), file=sys.stderr)\nprint(runs, fails)"
    )
    searcher = subprocess.Popen(
        [sys.executable, "-c", loop, str(copy), "25"], stdout=subprocess.PIPE, text=True, env=env
    )
    for i in range(3):
        update.add(copy, CorpusSpec(new_docs(tmp_path / f"n{i}.parquet", prefix=f"n{i}-")))
    out, _ = searcher.communicate(timeout=120)
    runs, fails = map(int, out.split())
    assert fails == 0 and runs > 3
