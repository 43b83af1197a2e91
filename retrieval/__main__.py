"""``python -m retrieval`` and the ``retrieval`` script: the command line. Ctrl-C while it starts (importing the
CLI takes most of a second) ends as it does during a command: one line and exit 130, not a traceback."""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from retrieval.cli import run
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        raise SystemExit(130) from None
    run()


if __name__ == "__main__":
    main()
