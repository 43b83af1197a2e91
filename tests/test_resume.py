"""Builds that survive SIGKILL: a real build process is killed at several points, then resumed.

Run as a script, this file is that build process (``python tests/test_resume.py CORPUS OUT ...``): build_index
with a FakeEncoder that sleeps per batch and logs how many rows it encoded, optionally pausing inside the
final write or inside publish so the test can kill it there.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import FakeEncoder, write_corpus
from typer.testing import CliRunner

from retrieval import docs, files
from retrieval.build import BuildOptions, build_index
from retrieval.cli.app import app
from retrieval.corpus import CorpusSpec
from retrieval.errors import ConfigError, IndexDirError, RetrievalError
from retrieval.index import load_index
from retrieval.indexdir import INDEX, STASH, IndexDir
from retrieval.progress import no_progress
from retrieval.search import Searcher
from retrieval.stash import VectorStash
from retrieval.whitening import TransformSpec

HERE = Path(__file__).resolve()
WINDOW = 50  # corpus rows per stash part
ROWS = 600  # 12 parts
SPEC = TransformSpec(dim=8, gamma=1.0)


# ----- the build process under test --------------------------------------------------------------------------
class LoggingEncoder(FakeEncoder):
    """FakeEncoder that sleeps per batch and appends each batch's row count to a log file."""

    def __init__(self, log: Path | None, sleep: float, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        self.log, self.sleep = log, sleep

    def encode(self, texts):  # type: ignore[no-untyped-def]
        time.sleep(self.sleep)
        if self.log is not None:
            with open(self.log, "a") as fh:
                fh.write(f"{len(texts)}\n")
        return super().encode(texts)


def _pause_at(point: str, marker: Path) -> None:
    """Stop the process forever at ``point`` (after touching ``marker``) so the test can kill it there."""

    def hold() -> None:
        marker.touch()
        time.sleep(600)

    if point == "write":  # inside the final write: transform, moments and index saved, docs not yet
        real_write_docs = docs.write_docs

        def write_docs(*args):  # type: ignore[no-untyped-def]
            hold()
            return real_write_docs(*args)

        docs.write_docs = write_docs  # type: ignore[assignment]
    elif point == "publish":  # between publish's two renames: the old index aside, the new one not in place
        real_rename = os.rename

        def rename(src, dst):  # type: ignore[no-untyped-def]
            if str(src).endswith(".building"):
                hold()
            real_rename(src, dst)

        files.os.rename = rename  # type: ignore[assignment]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("corpus", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--log", type=Path)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--pause", choices=["none", "write", "publish"], default="none")
    parser.add_argument("--model", default="fake")
    args = parser.parse_args(argv)
    _pause_at(args.pause, args.out.parent / f"paused-{args.pause}")
    if args.corpus.suffix == ".npy":
        encoder = None
        progress = lambda stage, n, total: time.sleep(args.sleep) if stage == "encode" else None  # noqa: E731
    else:
        encoder, progress = LoggingEncoder(args.log, args.sleep, name=args.model), no_progress
    options = BuildOptions(overwrite=args.overwrite, resume=args.resume, window_rows=WINDOW)
    try:
        build_index(CorpusSpec(args.corpus), encoder, args.out, SPEC, options=options, progress=progress)
    except RetrievalError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


# ----- helpers -----------------------------------------------------------------------------------------------
def start(corpus: Path, out: Path, log: Path, *flags: str, sleep: float = 0.05) -> subprocess.Popen:
    command = [sys.executable, str(HERE), str(corpus), str(out), "--log", str(log), "--sleep", str(sleep), *flags]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kill_when(process: subprocess.Popen, ready, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not ready():
        if process.poll() is not None:
            pytest.fail(f"the build ended (exit {process.returncode}) before the kill point: {process.stderr.read()}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail("the build never reached the kill point")
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL


def stashed_parts(out: Path) -> int:
    path = files.work_dir(out) / STASH / "stash.json"
    try:
        return len(VectorStash.open(path.parent).parts)
    except Exception:  # mid-rename or not yet written: not ready
        return 0


def encoded_rows(log: Path) -> int:
    return sum(int(line) for line in log.read_text().split()) if log.exists() else 0


def resume(corpus: Path, out: Path, log: Path, *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(HERE), str(corpus), str(out), "--log", str(log), "--resume", *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def assert_same_index(a: Path, b: Path) -> None:
    ta, tb = IndexDir(a).transform(), IndexDir(b).transform()
    # Same stash, same float64 moments (batched the same way): kernels agree to rounding.
    np.testing.assert_allclose(ta.kernel, tb.kernel, rtol=1e-9, atol=1e-12)  # type: ignore[union-attr]
    ia, ib = load_index(a / INDEX), load_index(b / INDEX)
    assert ia.ntotal == ib.ntotal == ROWS
    np.testing.assert_allclose(ia.reconstruct_n(0, ROWS), ib.reconstruct_n(0, ROWS), atol=1e-6)  # float32 search
    ids = [IndexDir(d).docs().ids for d in (a, b)]
    assert ids[0] == ids[1]
    IndexDir(a).verify(Searcher.load(a, encoder=FakeEncoder()).manifest, "full")


@pytest.fixture
def clean(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp("clean")
    corpus = write_corpus(folder / "corpus.parquet", ROWS)
    build_index(CorpusSpec(corpus), FakeEncoder(), folder / "idx", SPEC, options=BuildOptions(window_rows=WINDOW))
    return folder / "idx"


@pytest.fixture
def big_corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus.parquet", ROWS)


# ----- tests -------------------------------------------------------------------------------------------------
@pytest.mark.process
@pytest.mark.parametrize("after_parts", [1, 6])
def test_killed_build_resumes_without_re_encoding(tmp_path, big_corpus, clean, after_parts):
    out, log = tmp_path / "idx", tmp_path / "rows.log"
    kill_when(start(big_corpus, out, log), lambda: stashed_parts(out) >= after_parts)
    assert not out.exists()  # nothing published
    parts = stashed_parts(out)
    assert after_parts <= parts < ROWS // WINDOW
    log.unlink()
    stray = files.work_dir(out) / STASH / f"part-{parts:05d}.mean.npy.tmp"
    stray.write_bytes(b"half a part")  # what a kill inside VectorStash.append leaves

    done = resume(big_corpus, out, log)
    assert done.returncode == 0, done.stderr
    assert encoded_rows(log) == ROWS - parts * WINDOW  # only the rows not yet stashed
    assert_same_index(out, clean)
    assert not files.work_dir(out).exists() and not list((out / STASH).glob("*.tmp"))


@pytest.mark.process
@pytest.mark.parametrize("point", ["write", "publish"])
def test_kill_in_the_final_write_or_publish_keeps_the_previous_index(tmp_path, big_corpus, clean, point):
    out, log = tmp_path / "idx", tmp_path / "rows.log"
    previous = write_corpus(tmp_path / "previous.parquet", 120)
    build_index(CorpusSpec(previous), FakeEncoder(), out, SPEC)
    marker = tmp_path / f"paused-{point}"
    kill_when(start(big_corpus, out, log, "--overwrite", "--pause", point, sleep=0), marker.exists)
    assert encoded_rows(log) == ROWS

    # The previous index is intact and loads (after publish's first rename it is aside: a reader says so and
    # moves nothing; the next writer puts it back).
    if point == "publish":
        with pytest.raises(IndexDirError, match="its previous version is at"):
            Searcher.load(out, encoder=FakeEncoder())
        with files.writing(out):
            pass
    searcher = Searcher.load(out, encoder=FakeEncoder())
    assert searcher.manifest.n == 120
    IndexDir(out).verify(searcher.manifest, "full")
    log.unlink()
    done = resume(big_corpus, out, log, "--overwrite")
    assert done.returncode == 0, done.stderr
    assert encoded_rows(log) == 0  # every part was stashed before the kill
    assert_same_index(out, clean)


@pytest.mark.process
def test_kill_mid_way_keeps_the_previous_index(tmp_path, big_corpus, clean):
    out, log = tmp_path / "idx", tmp_path / "rows.log"
    build_index(CorpusSpec(write_corpus(tmp_path / "previous.parquet", 120)), FakeEncoder(), out, SPEC)
    before = (out / INDEX).read_bytes()
    kill_when(start(big_corpus, out, log, "--overwrite"), lambda: stashed_parts(out) >= 4)
    assert (out / INDEX).read_bytes() == before
    IndexDir(out).verify(Searcher.load(out, encoder=FakeEncoder()).manifest, "full")
    assert resume(big_corpus, out, log, "--overwrite").returncode == 0
    assert_same_index(out, clean)


@pytest.mark.process
def test_resume_with_a_changed_corpus_or_settings_is_refused(tmp_path, big_corpus):
    out, log = tmp_path / "idx", tmp_path / "rows.log"
    kill_when(start(big_corpus, out, log), lambda: stashed_parts(out) >= 2)
    parts = stashed_parts(out)

    other_model = resume(big_corpus, out, log, "--model", "another-model")
    assert other_model.returncode == 1
    assert "cannot resume" in other_model.stderr and "encoder changed" in other_model.stderr
    resumed = BuildOptions(resume=True, window_rows=WINDOW)
    with pytest.raises(ConfigError, match="text_column changed"):  # reading the corpus differently is a change
        build_index(CorpusSpec(big_corpus, text_column="id"), FakeEncoder(), out, SPEC, options=resumed)
    write_corpus(big_corpus, ROWS, text=[f"edited document {i}" for i in range(ROWS)])
    with pytest.raises(ConfigError, match="the corpus file has changed since it started"):
        build_index(CorpusSpec(big_corpus), FakeEncoder(), out, SPEC, options=resumed)
    assert stashed_parts(out) == parts  # a refusal leaves the unfinished build as it was


@pytest.mark.process
def test_cli_resume_of_a_killed_npy_build(tmp_path):
    vectors = np.random.default_rng(3).normal(size=(ROWS, 12)).astype(np.float32) + 4
    np.save(tmp_path / "v.npy", vectors)
    out = tmp_path / "idx"
    kill_when(start(tmp_path / "v.npy", out, tmp_path / "unused.log", sleep=0.1), lambda: stashed_parts(out) >= 2)

    np.save(tmp_path / "v.npy", vectors[::-1])  # same name and shape, other bytes
    done = resume(tmp_path / "v.npy", out, tmp_path / "unused.log")
    assert done.returncode == 1 and "corpus file has changed" in done.stderr

    # The CLI reads in windows of its own size (another engine's, Ray's, are smaller still); the unfinished
    # build used WINDOW, and the resume keeps them: it was refused ("window_rows changed") before
    np.save(tmp_path / "v.npy", vectors)
    cli = ["index", str(tmp_path / "v.npy"), "--out", str(out), "--resume", "--dim", "8", "--gamma", "1"]
    result = CliRunner().invoke(app, cli)
    assert result.exit_code == 0, result.output
    assert len(VectorStash.open(out / STASH).parts) == ROWS // WINDOW  # the windows it began with
    clean = tmp_path / "clean"
    build_index(CorpusSpec(tmp_path / "v.npy"), None, clean, SPEC, options=BuildOptions(window_rows=WINDOW))
    np.testing.assert_allclose(
        load_index(out / INDEX).reconstruct_n(0, ROWS),
        load_index(clean / INDEX).reconstruct_n(0, ROWS),
        atol=1e-6,
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def test_a_resumed_build_keeps_the_precision_auto_chose(tiny_bert: Path, tmp_path: Path, monkeypatch) -> None:
    """Precision "auto" is decided by timing, so a second run could decide otherwise: the stash records the
    choice before the first window, and a resumed build takes it, so one index never mixes fp32 and bf16
    vectors. Simulated bf16 CPU: the first run's timing picks bf16, the resumed run's would pick fp32."""
    from retrieval import timing
    from retrieval.encode import transformer as enc

    monkeypatch.setattr(enc, "cpu_supports_bf16", lambda: True)
    answers = {"precision": "bf16"}
    monkeypatch.setattr(timing, "_chosen", timing.Policy(answers=answers))
    corpus = write_corpus(tmp_path / "c.parquet", n=120)

    def build(out: Path, resume: bool = False, stop_after: int | None = None) -> None:
        model = enc.EncoderSpec(str(tiny_bert), precision="auto").load()
        if stop_after is not None:
            real, calls = model.encode_poolings, [0]

            def interrupted(*args, **kwargs):
                calls[0] += 1
                if calls[0] > stop_after:
                    raise KeyboardInterrupt
                return real(*args, **kwargs)

            monkeypatch.setattr(model, "encode_poolings", interrupted)
        build_index(
            CorpusSpec(corpus), model, out, TransformSpec(dim=8), options=BuildOptions(window_rows=20, resume=resume)
        )

    build(tmp_path / "bf16")  # bf16 all the way: the reference
    with pytest.raises(KeyboardInterrupt):
        build(tmp_path / "idx", stop_after=3)
    assert VectorStash.open(files.work_dir(tmp_path / "idx") / STASH).meta["encoder"]["precision_used"] == "bf16"
    answers["precision"] = "fp32"  # this run's timing would choose fp32
    monkeypatch.setattr(enc, "cpu_model", lambda: "another CPU")  # and it runs on another machine: still resumable
    build(tmp_path / "idx", resume=True)
    assert IndexDir(tmp_path / "idx").manifest().encoder.precision_used == "bf16"
    whole = np.concatenate(list(IndexDir(tmp_path / "bf16").stash().iter_blocks()))
    resumed = np.concatenate(list(IndexDir(tmp_path / "idx").stash().iter_blocks()))
    np.testing.assert_array_equal(resumed, whole)
