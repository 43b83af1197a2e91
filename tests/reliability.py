"""The reliability tests' registry and helpers: each test is one row of docs/reliability.md, and these are its tools.

``@case(area, what is tried, what happens)`` registers a test as a row of the table in docs/reliability.md, which
``python scripts/reliability_table.py`` writes from this registry (a test keeps the two equal). The helpers run
the CLI in process, check the one-line error contract, and snapshot an index directory; the fixtures (loaded by
tests/conftest.py as a plugin) give a tiny-BERT index built through the CLI and a fake-encoder one.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import FakeEncoder, write_corpus
from typer.testing import CliRunner, Result

from retrieval.build import build_index
from retrieval.cli.app import app
from retrieval.corpus import CorpusSpec
from retrieval.whitening import TransformSpec

AREAS = ("input", "options", "index dir", "concurrency", "faults", "safety")  # the table's order


@dataclass(frozen=True)
class Case:
    """One row: where the test is (file, line: its order within an area), and what it tries and sees."""

    area: str
    tried: str
    happens: str
    file: str
    line: int


CASES: dict[tuple[str, str], Case] = {}  # by (file, test name): a module imported twice registers once
runner = CliRunner()


def case(area: str, tried: str, happens: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a test as one row of docs/reliability.md's table."""
    if area not in AREAS:
        raise ValueError(f"unknown area {area!r}: one of {AREAS}")

    def register(test: Callable[..., Any]) -> Callable[..., Any]:
        code = test.__code__
        file = Path(code.co_filename).name
        CASES[(file, test.__name__)] = Case(area, tried, happens, file, code.co_firstlineno)
        return test

    return register


def table() -> str:
    """The registered cases as a markdown table, by area, then file and line."""
    rows = ["| area | what is tried | what happens |", "|---|---|---|"]
    ordered = sorted(CASES.values(), key=lambda c: (AREAS.index(c.area), c.file, c.line))
    rows += [f"| {c.area} | {c.tried} | {c.happens} |" for c in ordered]
    return "\n".join(rows) + "\n"


def run(*args: str | Path | int) -> Result:
    return runner.invoke(app, [str(a) for a in args])


def one_line(result: Result, *fragments: str, code: int = 1) -> str:
    """The command failed with ``code``, exactly one line on stderr (starting "error: "), no traceback."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def ok(result: Result) -> Result:
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def leftovers(directory: Path) -> list[str]:
    """Hidden work or lock entries beside an index (none after a finished, failed or interrupted write)."""
    return sorted(p.name for p in directory.parent.iterdir() if p.name.startswith(f".{directory.name}."))


def table_file(path: Path, **columns: Any) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def texts(n: int, prefix: str = "document number") -> list[str]:
    return [f"{prefix} {i} about topic {i % 7}" for i in range(n)]


def new_docs(path: Path, n: int = 20, prefix: str = "new") -> Path:
    return table_file(path, id=[f"{prefix}{i}" for i in range(n)], text=texts(n, "a brand new passage"))


def build_from(tiny_bert: Path, corpus: Path, out: Path, *options: str | int) -> Result:
    return run("index", corpus, "--model", tiny_bert, "--dim", 4, "--out", out, *options)


# queries, judgements and STS pairs that pass every check: a test spoils one column
QUERIES = {"query_id": ["q1", "q2"], "text": ["document number 1", "document number 2"]}
QRELS = {"query_id": ["q1", "q2"], "doc_id": ["doc1", "doc2"], "score": [1, 2]}
PAIRS = {"sentence1": ["a cat", "a dog", "the sun"], "sentence2": ["a kitten", "a puppy", "rain"], "score": [5, 4, 0]}


@pytest.fixture(scope="session")
def cli_index(tiny_bert: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One index built through the CLI with the tiny BERT, shared read-only (tests that change it copy it)."""
    root = tmp_path_factory.mktemp("reliability")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RETRIEVAL_INDEX_ROOT", str(root / "indexes"))
        corpus = write_corpus(root / "corpus.parquet", n=120)
        ok(run("index", corpus, "--model", tiny_bert, "--dim", 8, "--out", root / "idx"))
    return root / "idx"


@pytest.fixture
def copy(cli_index: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(cli_index, tmp_path / "idx"))


@pytest.fixture
def fake_index(tmp_path: Path) -> Path:
    corpus = write_corpus(tmp_path / "corpus.parquet", n=300)
    build_index(CorpusSpec(corpus), FakeEncoder(), tmp_path / "fidx", TransformSpec(dim=8))
    return tmp_path / "fidx"
