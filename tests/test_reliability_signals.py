"""Reliability, signals: SIGKILL, SIGTERM and Ctrl-C of writers, builds and readers at every stage (real
processes, paused at a named point), and of the command line while it starts or tears down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import typer.core
from conftest import ROOT, FakeEncoder, write_corpus
from killed_writer import REMOVED, start_writer, wait_for
from reliability import case, leftovers, new_docs, run, runner, snapshot, texts

from retrieval import build as build_module
from retrieval import files, update
from retrieval.cli.app import app
from retrieval.corpus import CorpusSpec
from retrieval.encode.models import model_dim
from retrieval.encode.spec import DEFAULT_MODEL
from retrieval.errors import IndexDirError
from retrieval.indexdir import STASH, IndexDir
from retrieval.manifest import Manifest
from retrieval.search import Searcher, SearchParams
from retrieval.whitening import TransformSpec


@pytest.mark.slow
@case(
    "faults",
    "Ctrl-C of `demo` while it builds, then `demo` again",
    "one line saying to rerun `retrieval demo` (it named `--resume`, which demo has not); the rerun continues from "
    "the parts encoded",
)
def test_an_interrupted_demo_continues_when_run_again(isolated_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if model_dim(DEFAULT_MODEL) is None:
        pytest.skip(f"{DEFAULT_MODEL} is not installed here (make install)")
    paragraphs = [
        (f"mod.f{i}", f"mod.f{i}", f"paragraph {i} of a small demo corpus about topic {i % 9}") for i in range(60)
    ]
    monkeypatch.setattr("retrieval.cli.demo_corpus.docstring_paragraphs", lambda: iter(paragraphs))
    fill = build_module.fill_index

    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(build_module, "fill_index", interrupted)  # the stash is encoded: the parts are kept
    result = run("demo", "--dim", 8)
    assert (result.exit_code, result.stderr.splitlines()[-1]) == (
        130,
        "error: interrupted: rerun `retrieval demo` to continue",
    )
    monkeypatch.setattr(build_module, "fill_index", fill)
    again = run("-v", "demo", "--dim", 8)
    assert again.exit_code == 0, again.output
    assert "resuming: 60 rows" in again.stderr and Manifest.load(isolated_home / "stdlib-docs").n == 60


def results(index: Path) -> list[list[str]]:
    searcher = Searcher.load(index, encoder=FakeEncoder())
    return [[h.id for h in hits] for hits in searcher.search_batch(texts(5), SearchParams(k=5))]


@pytest.mark.process
@pytest.mark.parametrize(
    ("action", "pause"),
    [
        ("add", "encode"),
        ("add", "write"),
        ("add", "publish"),
        ("refit", "write"),
        ("refit", "publish"),
        ("remove", "write"),
        ("remove", "publish"),
    ],
)
@case(
    "faults",
    "SIGKILL of `add`, `refit` or `remove` while encoding, writing, or between publish's two renames",
    "the old index searches with identical results (left aside by the publish: the next writer puts it back, a "
    "search says where it is); the next writer clears the stale work; a rerun works",
)
def test_sigkill_of_a_writer(fake_index: Path, tmp_path: Path, action: str, pause: str) -> None:
    before, expected = snapshot(fake_index), results(fake_index)
    process, marker = start_writer(tmp_path, action, fake_index, pause)
    wait_for(marker, process)
    process.send_signal(signal.SIGKILL)
    process.wait()
    if pause == "publish":  # left aside: a reader says where and moves nothing; a writer's first step restores it
        with pytest.raises(IndexDirError, match="its previous version is at"):
            results(fake_index)
        files.restore(fake_index)
    assert results(fake_index) == expected
    assert snapshot(fake_index) == before
    if action == "add":
        update.add(fake_index, CorpusSpec(new_docs(tmp_path / "again.parquet", 30)), FakeEncoder())
    elif action == "remove":
        assert update.remove(fake_index, REMOVED) is not None and IndexDir(fake_index).manifest().n == 263
    else:
        update.refit(fake_index, TransformSpec(dim=4))
    assert leftovers(fake_index) == []


@pytest.mark.process
@pytest.mark.parametrize("action", ["add", "refit", "remove"])
@case(
    "faults",
    "Ctrl-C (SIGINT) of `add`, `refit` or `remove`",
    "exit 130; the old index unchanged; no work directory or lock left",
)
def test_sigint_of_a_writer(fake_index: Path, tmp_path: Path, action: str) -> None:
    before = snapshot(fake_index)
    process, marker = start_writer(tmp_path, action, fake_index, "write")
    wait_for(marker, process)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=30) == 130
    assert snapshot(fake_index) == before and leftovers(fake_index) == []


@pytest.mark.process
@pytest.mark.parametrize(
    ("action", "pause"), [("add", "write"), ("add", "publish"), ("refit", "publish"), ("remove", "publish")]
)
@case(
    "faults",
    "SIGTERM (kill, timeout, docker stop) of `add`, `refit` or `remove`, also between publish's two renames",
    "exit 143; the old index unchanged; no work directory or lock left",
)
def test_sigterm_of_a_writer(fake_index: Path, tmp_path: Path, action: str, pause: str) -> None:
    before = snapshot(fake_index)
    process, marker = start_writer(tmp_path, action, fake_index, pause)
    wait_for(marker, process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 143
    with files.writing(fake_index):  # what any writer does first: puts back a version renamed aside
        pass
    assert snapshot(fake_index) == before and leftovers(fake_index) == []


@pytest.mark.process
@case(
    "faults", "SIGTERM of `retrieval add` while it encodes", "exit 143; the old index unchanged; nothing left beside it"
)
def test_sigterm_of_the_add_command(copy: Path, tmp_path: Path) -> None:
    before = snapshot(copy)
    corpus = new_docs(tmp_path / "many.parquet", 3000)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-m", "retrieval", "add", str(copy), str(corpus)], stderr=subprocess.PIPE, text=True, env=env
    )
    deadline = time.monotonic() + 120
    while not (files.work_dir(copy, "adding") / STASH).exists():
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read() if process.stderr else ""
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr
    assert "Traceback" not in stderr
    assert snapshot(copy) == before and leftovers(copy) == []


@pytest.mark.process
@pytest.mark.parametrize(
    ("stop", "status", "word"), [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
)
@case(
    "faults",
    "Ctrl-C or SIGTERM of `retrieval index`",
    "exit 130 / 143 and one line saying the encoded parts are kept and --resume continues; a resumed build completes",
)
def test_sigint_of_a_build(tiny_bert: Path, tmp_path: Path, stop: int, status: int, word: str) -> None:
    corpus = write_corpus(tmp_path / "c.parquet", n=3000)
    out = tmp_path / "idx"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RETRIEVAL_INDEX_ROOT": str(tmp_path / "root")}
    command = [sys.executable, "-m", "retrieval", "index", str(corpus), "--model", str(tiny_bert), "--out", str(out)]
    # SIGINT as a terminal delivers it: started in the background (`make test &`), the suite hands its children
    # SIGINT ignored, Python then installs no handler, and the build ran to the end (exit 0) under the signal.
    process = subprocess.Popen(
        command,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while not (files.work_dir(out) / STASH / "part-00000.parquet").exists():
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read() if process.stderr else ""
        time.sleep(0.02)
    process.send_signal(stop)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == status, stderr
    lines = [line for line in stderr.splitlines() if line.strip() and word in line]
    assert lines and "--resume" in lines[-1] and "Traceback" not in stderr
    done = subprocess.run([*command, "--resume"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert Manifest.load(out).n == 3000 and leftovers(out) == []


@pytest.mark.process
@case("faults", "Ctrl-C while the command line starts (importing its modules)", "exit 130 and one line, no traceback")
def test_sigint_while_the_cli_starts(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RETRIEVAL_INDEX_ROOT": str(tmp_path / "root")}
    process = subprocess.Popen(
        [sys.executable, "-m", "retrieval", "info", str(tmp_path / "none")],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal delivers it (above)
    )
    maps, deadline = Path(f"/proc/{process.pid}/maps"), time.monotonic() + 60
    while "_multiarray_umath" not in maps.read_text():  # numpy loaded: the CLI's imports are under way
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read() if process.stderr else ""
        time.sleep(0.002)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert (process.returncode, stderr) == (130, "error: interrupted\n")


@case("faults", "Ctrl-C while typer parses a command's arguments", "exit 130 and one line (it exited 130 silently)")
def test_sigint_while_arguments_are_parsed(fake_index: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(typer.core.TyperCommand, "parse_args", interrupted)
    result = runner.invoke(app, ["info", str(fake_index)])
    assert (result.exit_code, result.stderr) == (130, "error: interrupted\n")


def signalled_when(process: subprocess.Popen, ready: Callable[[], bool], stop: int) -> tuple[int, str]:
    """Send ``stop`` once ``ready()``; the exit status and stderr."""
    deadline = time.monotonic() + 120
    while not ready():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.005)
    process.send_signal(stop)
    _, stderr = process.communicate(timeout=60)
    return process.returncode, stderr


@pytest.mark.process
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
@case(
    "faults",
    "Ctrl-C or SIGTERM after a command has finished, while the interpreter tears down (~1.5 s after torch)",
    "ignored: the command's own exit status (a published `add` had exited 130 / 143, as if it had failed)",
)
def test_a_signal_after_the_command_keeps_its_exit_status(fake_index: Path, tmp_path: Path, stop: int) -> None:
    marker = tmp_path / "tearing-down"
    # a slow teardown: an exit handler registered before the CLI's, so it runs after everything the CLI does
    probe = (
        "import atexit, pathlib, runpy, sys, time\n"
        "atexit.register(lambda marker=sys.argv[1]: (pathlib.Path(marker).touch(), time.sleep(2)))\n"
        "sys.argv = ['retrieval', 'info', sys.argv[2], '--json']\n"
        "runpy.run_module('retrieval', run_name='__main__')\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", probe, str(marker), str(fake_index)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal delivers it (above)
    )
    code, stderr = signalled_when(process, marker.exists, stop)
    assert (code, stderr) == (0, "")


@pytest.mark.process
@pytest.mark.parametrize(
    ("stop", "status", "word"), [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
)
@case(
    "faults",
    "Ctrl-C or SIGTERM of a command that only reads (`search --queries -` waiting for its queries)",
    "exit 130 / 143 and one line, as for a writer (SIGTERM had killed it silently: status -15)",
)
def test_sigterm_of_a_reading_command(fake_index: Path, stop: int, status: int, word: str) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "retrieval", "search", "--queries", "-", "--index", str(fake_index)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    syscall = Path(f"/proc/{process.pid}/syscall")
    code, stderr = signalled_when(process, lambda: syscall.read_text().startswith("0 0x0 "), stop)  # read(0, ...)
    assert (code, stderr) == (status, f"error: {word}\n")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the swallowed exception, reported
def test_a_sigterm_python_swallowed_still_ends_the_command() -> None:
    """SIGTERM's exception raised inside a weakref callback (the import system's module-lock callbacks are one)
    is printed as "Exception ignored" and dropped: a build signalled there ran on to exit 0. The command still
    ends as terminated, once the work returns."""
    import weakref

    from retrieval.cli.shell import sigterm_exits
    from retrieval.errors import Terminated

    class Thing:
        pass

    def callback(_: object) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the handler runs here, between bytecodes: its exception is ignored
            pass

    finished, before = [], signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated), sigterm_exits():
        thing = Thing()
        kept = weakref.ref(thing, callback)
        del thing  # the callback runs, and swallows the handler's Terminated
        finished.append(kept() is None)
    assert finished == [True]  # the work ran on past the signal; the end of the block raised it
    assert signal.getsignal(signal.SIGTERM) == before  # the handler it replaced, back
    with sigterm_exits():  # caught on purpose (a graceful shutdown): the command's own outcome stands
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except Terminated:
            pass
