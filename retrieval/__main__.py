"""``python -m retrieval``: the same command line as the ``retrieval`` script."""

from retrieval.cli import run

run()
