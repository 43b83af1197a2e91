"""The writer process the reliability tests kill: `add`, `refit` or `remove` of an index, paused at a named point.

Run as ``python tests/killed_writer.py add|refit|remove INDEX [CORPUS] --pause encode|write|publish --marker FILE``:
it touches the marker file once it reaches the pause, then sleeps there until a test signals it. ``start_writer``
starts it, ``wait_for`` waits for the marker.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import ROOT, FakeEncoder
from reliability import new_docs

from retrieval import files, update
from retrieval.cli.shell import sigterm_exits
from retrieval.corpus import CorpusSpec
from retrieval.errors import Terminated
from retrieval.whitening import TransformSpec

HERE = Path(__file__).resolve()
REMOVED = [f"doc{i}" for i in range(3, 40)]  # what the fault tests' `remove` takes out


def writer(argv: list[str]) -> int:
    """The process: ``add|refit|remove INDEX [CORPUS] --pause POINT --marker FILE``; its exit status."""
    parser = argparse.ArgumentParser()
    parser.add_argument("action", choices=["add", "refit", "remove"])
    parser.add_argument("index", type=Path)
    parser.add_argument("corpus", type=Path, nargs="?")
    parser.add_argument("--pause", choices=["encode", "write", "publish"], required=True)
    parser.add_argument("--marker", type=Path, required=True)
    args = parser.parse_args(argv)
    # Ctrl-C as a terminal delivers it: a test suite started in the background (`make test &`) hands its children
    # SIGINT ignored, and Python then installs no handler, so the SIGINT tests would wait out their timeouts.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def hold() -> None:
        args.marker.touch()
        time.sleep(600)

    if args.pause == "encode":
        real_encode = FakeEncoder.encode
        FakeEncoder.encode = lambda self, t: (hold() if self.calls else None) or real_encode(self, t)  # type: ignore[method-assign]
    elif args.pause == "write":
        from retrieval import docs

        real_write = docs.write_docs
        docs.write_docs = lambda *a: hold() or real_write(*a)  # type: ignore[assignment]
    else:
        real_rename = os.rename
        files.os.rename = lambda src, dst: (
            (hold() if str(src).endswith((".adding", ".refitting", ".removing")) else None) or real_rename(src, dst)
        )  # type: ignore[assignment]
    try:
        with sigterm_exits():  # as the CLI's writers run
            if args.action == "add":
                update.add(args.index, CorpusSpec(args.corpus), FakeEncoder(), window_rows=5)
            elif args.action == "remove":
                update.remove(args.index, REMOVED)
            else:
                update.refit(args.index, TransformSpec(dim=4))
    except KeyboardInterrupt as stop:  # as the CLI exits: 143 for SIGTERM, 130 for Ctrl-C
        return 143 if isinstance(stop, Terminated) else 130
    return 0


def start_writer(tmp_path: Path, action: str, index: Path, pause: str) -> tuple[subprocess.Popen, Path]:
    marker = tmp_path / f"paused-{action}-{pause}"
    marker.unlink(missing_ok=True)
    corpus = [str(new_docs(tmp_path / "w.parquet", 30))] if action == "add" else []
    command = [
        sys.executable,
        str(HERE),
        action,
        str(index),
        *corpus,
        "--pause",
        pause,
        "--marker",
        str(marker),
    ]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{HERE.parent}"}
    return subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env), marker


def wait_for(marker: Path, process: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not marker.exists():
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        assert time.monotonic() < deadline, "the writer never reached its pause"
        time.sleep(0.02)


if __name__ == "__main__":
    sys.exit(writer(sys.argv[1:]))
