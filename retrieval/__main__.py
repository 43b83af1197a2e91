"""``python -m retrieval`` and the ``retrieval`` script: the command line. Ctrl-C while it starts (importing the
CLI takes most of a second) ends as it does during a command: one line and exit 130, not a traceback."""

from __future__ import annotations

import signal
import sys


def main() -> None:
    try:
        from retrieval import runtime

        runtime.tune_process(serving=sys.argv[1:2] == ["serve"])  # before the CLI imports FAISS (and torch)
        from retrieval.cli.app import run

        run()
    except KeyboardInterrupt:  # while the CLI is imported or typer builds its commands: no command has run
        sys.stderr.write("error: interrupted\n")
        raise SystemExit(130) from None
    finally:
        # The command is over and has said how it went. What is left is the interpreter's teardown (up to ~1.5 s
        # of garbage collection after torch), where a Ctrl-C or SIGTERM killed the process: a command that had
        # published its index then exited as if it had failed. Ignored, not handled: Python resets the handlers
        # it installed before that collection, but leaves ignored signals ignored.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


if __name__ == "__main__":
    main()
