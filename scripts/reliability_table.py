"""Write docs/reliability.md: what the reliability tests try, how, and the table of their cases.

Each test in tests/test_reliability_*.py is registered with ``@case(area, what is tried, what happens)``
(tests/reliability.py); this script imports those modules and writes the page from that registry, so the page
cannot claim a case no test tries. tests/test_reliability_table.py fails when the page is out of date.

    python scripts/reliability_table.py           # rewrite docs/reliability.md
    python scripts/reliability_table.py --check   # exit 1 if docs/reliability.md is out of date
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
PAGE = ROOT / "docs" / "reliability.md"

INTRO = """\
# Reliability: what happens when things go wrong

Every row of the table below is a test: a fault or a bad input that a hostile user or a real deployment
throws, tried for real. Common to all of them:

- a user error is one line on stderr starting `error:` with a non-zero exit (1; 2 for usage errors; 130 for
  Ctrl-C; 143 for SIGTERM, whichever command it stops; `serve` exits 0 once it has shut down), never a
  traceback;
- an index directory is either complete and valid or absent;
- a failed, refused or interrupted writer leaves the previous index byte-for-byte as it was.

## How the cases are tried

- **Commands** run in process through the CLI itself; a test checks the exit status, that stderr is exactly
  one line naming what to fix, and compares the index directory's bytes before and after.
- **Kills and signals** hit real processes: a writer (`add`, `refit`, `remove`) paused at a named point (while
  it encodes, while it writes, between the two renames of a publish) is sent SIGKILL, SIGTERM or Ctrl-C, and
  so is the command line while it starts, parses its arguments, waits for input or tears down.
- **Read-only file systems, full disks and mount points** are real bind mounts and small tmpfs mounts where the
  tests run as root; elsewhere the failing system call is simulated.
- The tests are `tests/test_reliability_*.py` (input, options, index directory, publishing, signals, safety);
  `python -m pytest tests/test_reliability_*.py` runs them all. This page is generated from them:
  `python scripts/reliability_table.py` (a test fails when the two disagree).

## The cases

"""

OUTRO = """
## How the guarantees are kept

Writers (`index`, `add`, `refit`, `calibrate --apply`) take a lock on the real directory (symbolic links
resolved), verify what they read (`refit` every stash part's sha256, `add` the files it reads and the sizes of
the parts it links), and publish by renaming a finished directory into place; the manifest carries a checksum
of its own, so a hand-edited manifest is refused rather than trusted. Readers load one whole version: a load
that races a publish reads again. Paths named inside an index (manifest, `stash.json`) must stay inside it.
Nothing is pickled (`.npz` with `allow_pickle=False`, `.npy`, Arrow, FAISS's own format) and no model code is
run (`trust_remote_code` is never set).
"""


def table() -> str:
    """The cases every reliability test module registers, as a markdown table."""
    for path in (TESTS, ROOT):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    for module in sorted(TESTS.glob("test_reliability_*.py")):
        importlib.import_module(module.stem)  # registers its cases (once: pytest imports them by the same name)
    import reliability

    return reliability.table()


def page() -> str:
    return INTRO + table() + OUTRO


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is out of date; write nothing")
    args = parser.parse_args(argv)
    text = page()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run python scripts/reliability_table.py", file=sys.stderr)
            return 1
        return 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
