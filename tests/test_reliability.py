"""The reliability campaign: every fault and bad input a hostile user or a real deployment throws, one test each.

Each test is registered with ``@case(area, what is tried, what happens)``; docs/reliability.md's table is
generated from that registry (``python tests/test_reliability.py --table``) and a test keeps the two equal.

Run as a script with ``writer ...``, this file is also the writer process that the fault tests kill: ``add`` or
``refit`` of an index with a slow fake encoder, optionally paused at a named point.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer.core
from conftest import ROOT, FakeEncoder, write_corpus
from typer.testing import CliRunner, Result

from retrieval import build as build_module
from retrieval import files, indexdir, update
from retrieval.build import BuildOptions, build_index
from retrieval.cli.app import app
from retrieval.cli.shell import sigterm_exits
from retrieval.corpus import CorpusSpec
from retrieval.encode.models import model_dim
from retrieval.encode.spec import DEFAULT_MODEL
from retrieval.errors import ConfigError, IndexDirError, Terminated
from retrieval.evaluate import Queries
from retrieval.index import IndexSpec
from retrieval.indexdir import INDEX, MANIFEST, STASH, IndexDir, Manifest, load
from retrieval.search import Searcher, SearchParams
from retrieval.tune import tune_index
from retrieval.whitening import TransformSpec

HERE = Path(__file__).resolve()
CASES: list[tuple[str, str, str]] = []
runner = CliRunner()


def case(area: str, tried: str, happens: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a test as one row of docs/reliability.md's table."""

    def register(test: Callable[..., Any]) -> Callable[..., Any]:
        CASES.append((area, tried, happens))
        return test

    return register


def table() -> str:
    rows = ["| area | what is tried | what happens |", "|---|---|---|"]
    rows += [f"| {area} | {tried} | {happens} |" for area, tried, happens in CASES]
    return "\n".join(rows) + "\n"


# ----- helpers -----------------------------------------------------------------------------------------------
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


@pytest.fixture(scope="module")
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


def new_docs(path: Path, n: int = 20, prefix: str = "new") -> Path:
    return table_file(path, id=[f"{prefix}{i}" for i in range(n)], text=texts(n, "a brand new passage"))


def build_from(tiny_bert: Path, corpus: Path, out: Path, *options: str | int) -> Result:
    return run("index", corpus, "--model", tiny_bert, "--dim", 4, "--out", out, *options)


# ----- inputs ------------------------------------------------------------------------------------------------
@case("input", "zero-byte parquet", "one line (not a readable parquet file); nothing written")
def test_zero_byte_parquet(tiny_bert: Path, tmp_path: Path) -> None:
    (tmp_path / "c.parquet").write_bytes(b"")
    one_line(build_from(tiny_bert, tmp_path / "c.parquet", tmp_path / "out"), "not a readable parquet file")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path / "out") == []


@case("input", "truncated parquet (footer cut)", "one line (not a readable parquet file); nothing written")
def test_truncated_parquet(tiny_bert: Path, tmp_path: Path) -> None:
    good = write_corpus(tmp_path / "good.parquet", n=200)
    (tmp_path / "c.parquet").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    one_line(build_from(tiny_bert, tmp_path / "c.parquet", tmp_path / "out"), "not a readable parquet file")
    assert not (tmp_path / "out").exists()


@case(
    "input", "parquet corrupted in the middle (a data page zeroed)", "one line naming the file and row; nothing written"
)
def test_parquet_corrupt_in_the_middle(tiny_bert: Path, tmp_path: Path) -> None:
    rows = [" ".join(f"word{(i * 7 + j) % 997}" for j in range(40)) for i in range(3000)]
    path = table_file(tmp_path / "c.parquet", id=[f"d{i}" for i in range(3000)], text=rows)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4000] = bytes(4000)
    path.write_bytes(bytes(data))
    one_line(build_from(tiny_bert, path, tmp_path / "out"), "c.parquet cannot be read from row", "corrupt")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path / "out") == []


@pytest.mark.parametrize(
    ("column", "shown"),
    [
        (pa.array([["x", "y"], ["z"], ["w"]]), "list<"),
        (pa.array([{"a": 1}, {"a": 2}, {"a": 3}]), "struct<"),
        (pa.array([1, 2, 3]), "int64"),
    ],
    ids=["list", "struct", "int"],
)
@case("input", "text column of list, struct or integer type", "one line naming the column and its type")
def test_text_column_of_the_wrong_type(tiny_bert: Path, tmp_path: Path, column: pa.Array, shown: str) -> None:
    path = table_file(tmp_path / "c.parquet", id=["a", "b", "c"], text=column)
    one_line(build_from(tiny_bert, path, tmp_path / "out"), "column 'text'", shown, "not text")


@case("input", "binary text column with invalid UTF-8", "one line naming the column and the row")
def test_binary_text_with_invalid_utf8(tiny_bert: Path, tmp_path: Path) -> None:
    column = pa.array([b"fine text", b"\xff\xfe not utf-8", b"more"], pa.binary())
    path = table_file(tmp_path / "c.parquet", id=["a", "b", "c"], text=column)
    one_line(build_from(tiny_bert, path, tmp_path / "out"), "column 'text'", "not UTF-8 text (row 1)")


@case("input", "binary (valid UTF-8), dictionary-encoded and large_string text columns", "built like plain strings")
def test_text_column_encodings_that_work(tmp_path: Path) -> None:
    words = texts(30)
    columns = {
        "binary": pa.array([w.encode() for w in words], pa.binary()),
        "dictionary": pa.array(words).dictionary_encode(),
        "large_string": pa.array(words, pa.large_string()),
    }
    for name, column in columns.items():
        path = table_file(tmp_path / f"{name}.parquet", id=[f"d{i}" for i in range(30)], text=column)
        build_index(CorpusSpec(path), FakeEncoder(), tmp_path / name, TransformSpec(dim=4))
        docs = IndexDir(tmp_path / name).docs()
        assert docs.texts(range(30)) == words, name


@case("input", "null ids", "one line: every row needs an id")
def test_null_ids(tiny_bert: Path, tmp_path: Path) -> None:
    path = table_file(tmp_path / "c.parquet", id=["a", None, "c"], text=texts(3))
    one_line(build_from(tiny_bert, path, tmp_path / "out"), "null ids")


@case("input", "integer ids; float ids", "integers become their decimal strings; floats are refused in one line")
def test_integer_and_float_ids(tiny_bert: Path, tmp_path: Path) -> None:
    path = table_file(tmp_path / "i.parquet", id=pa.array([10, 20, 30, 40], pa.int64()), text=texts(4))
    build_index(CorpusSpec(path), FakeEncoder(), tmp_path / "ints", TransformSpec(dim=2))
    assert IndexDir(tmp_path / "ints").docs().ids == ["10", "20", "30", "40"]
    path = table_file(tmp_path / "f.parquet", id=[1.0, 2.0, 3.5], text=texts(3))
    one_line(build_from(tiny_bert, path, tmp_path / "out"), "column 'id'", "double", "not strings or integers")


@case("input", "a 1 MB text in one row", "encoded truncated to the model's max length; the full text is kept")
def test_a_megabyte_text(tiny_bert: Path, tmp_path: Path) -> None:
    big = "whitening vectors search " * 42_000  # ~1 MB
    path = table_file(tmp_path / "c.parquet", id=["big", *[f"d{i}" for i in range(20)]], text=[big, *texts(20)])
    ok(build_from(tiny_bert, path, tmp_path / "out"))
    searcher = Searcher.load(tmp_path / "out")
    assert searcher.docs.texts([0]) == [big]
    assert searcher.search("whitening vectors search", SearchParams(k=21))


@case(
    "input",
    "NUL, control characters and emoji in texts and ids",
    "stored intact; JSON output exact; tables escape them",
)
def test_control_characters_and_emoji(tiny_bert: Path, tmp_path: Path) -> None:
    weird = ["nul\x00inside", "bell\x07and \x1b[31mred\x1b[0m", "emoji 😀 document", "tab\tand\nnewline"]
    ids = ["id\x00nul", "id\x1b[2J", "id😀", "id\n2"]
    path = table_file(tmp_path / "c.parquet", id=ids + [f"d{i}" for i in range(20)], text=weird + texts(20))
    ok(build_from(tiny_bert, path, tmp_path / "out"))
    found = ok(run("search", "emoji 😀 document", "--index", tmp_path / "out", "--json", "-k", 24)).stdout
    hits = [json.loads(line) for line in found.splitlines()]
    assert {h["id"]: h["text"] for h in hits if h["id"] in ids} == dict(zip(ids, weird, strict=True))
    shown = ok(run("search", "emoji", "--index", tmp_path / "out", "-k", 24)).stdout
    assert "\x1b" not in shown and "\x07" not in shown and "\x00" not in shown
    assert "\\x1b[31mred" in shown and "😀" in shown


@case(
    "input",
    "hits in Chinese printed where the output is not UTF-8 (`PYTHONIOENCODING=ascii`, a latin-1 locale)",
    "characters it cannot show escaped (`\\u4e2d`), not a crash",
)
def test_output_that_is_not_utf8(tiny_bert: Path, tmp_path: Path) -> None:
    path = table_file(tmp_path / "c.parquet", id=["中", *[f"d{i}" for i in range(20)]], text=["中文 text", *texts(20)])
    ok(build_from(tiny_bert, path, tmp_path / "out"))
    for encoding in ("ascii", "latin-1"):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONIOENCODING": encoding}
        command = [sys.executable, "-m", "retrieval", "search", "中文 text", "--index", str(tmp_path / "out")]
        for extra in ([], ["--json"], ["--index", str(tmp_path / "absent中")]):
            done = subprocess.run(command + extra, capture_output=True, env=env, timeout=120)
            assert b"Traceback" not in done.stderr, done.stderr.decode(encoding)
            shown = (done.stdout + done.stderr).decode(encoding)
            assert "\\u4e2d" in shown and done.returncode == (1 if "absent" in " ".join(extra) else 0), shown


@case(
    "input",
    "a corpus, a file in its folder, or an output whose name is not UTF-8",
    "one line showing the name (its bytes as `\\xNN`); nothing written",
)
def test_names_that_are_not_utf8(tiny_bert: Path, tmp_path: Path) -> None:
    """pyarrow (the corpus) and FAISS (the output) took them as text: tracebacks, and FAISS's partial output left."""
    good = write_corpus(tmp_path / "good.parquet", n=30)
    odd = tmp_path / os.fsdecode(b"c\xff.parquet")
    shutil.copy(good, odd)
    (tmp_path / "folder").mkdir()
    shutil.copy(good, tmp_path / "folder" / os.fsdecode(b"part\xfe.parquet"))
    for corpus, out, shown in (
        (odd, tmp_path / "out", "c\\xff.parquet"),
        (tmp_path / "folder", tmp_path / "out", "part\\xfe.parquet"),
        (good, tmp_path / os.fsdecode(b"out\xfd"), "out\\xfd"),
    ):
        one_line(build_from(tiny_bert, corpus, out), shown, "is not UTF-8: rename")
        assert not out.exists() and leftovers(out) == []
    one_line(run("search", "a query", "--index", tmp_path / os.fsdecode(b"idx\xfc")), "idx\\xfc", "is not UTF-8")


@case("input", "a 100,000-character id", "stored and returned intact")
def test_a_very_long_id(tmp_path: Path) -> None:
    long_id = "x" * 100_000
    path = table_file(tmp_path / "c.parquet", id=[long_id, *[f"d{i}" for i in range(20)]], text=texts(21))
    build_index(CorpusSpec(path), FakeEncoder(), tmp_path / "out", TransformSpec(dim=4))
    searcher = Searcher.load(tmp_path / "out", encoder=FakeEncoder())
    assert searcher.search(texts(21)[0], SearchParams(k=1))[0].id == long_id


@case(
    "input",
    "texts of whitespace, or of characters the tokenizer drops (NUL, zero-width space, BOM, joiner)",
    "counted as empty: one line naming them, or left out with --skip-empty",
)
def test_whitespace_only_texts(tiny_bert: Path, tmp_path: Path) -> None:
    """The invisible ones encode exactly as "" does: they were indexed, and all matched each other at 1.0."""
    rows = texts(10)
    rows[3], rows[5], rows[7], rows[8] = "   ", "\x00", "\t\n", "\ufeff\u200b \u200d"
    path = table_file(tmp_path / "c.parquet", id=[f"d{i}" for i in range(10)], text=rows)
    one_line(build_from(tiny_bert, path, tmp_path / "out"), "4 of 10 rows have null or empty text", "d3, d5, d7, d8")
    ok(build_from(tiny_bert, path, tmp_path / "out", "--skip-empty"))
    assert IndexDir(tmp_path / "out").manifest().n == 6


@case(
    "input",
    "the text column named like the internal id column (--text-column id)",
    "texts and ids from the columns named",
)
def test_text_column_named_id(tmp_path: Path) -> None:
    path = table_file(tmp_path / "c.parquet", id=texts(12), doc=[f"k{i}" for i in range(12)])
    build_index(
        CorpusSpec(path, text_column="id", id_column="doc"), FakeEncoder(), tmp_path / "o", TransformSpec(dim=3)
    )
    docs = IndexDir(tmp_path / "o").docs()
    assert docs.ids == [f"k{i}" for i in range(12)] and docs.texts([5]) == [texts(12)[5]]


@case("input", "a vectors column of strings, or of empty lists", "one line naming the column")
def test_bad_vectors_columns(tmp_path: Path) -> None:
    path = table_file(tmp_path / "s.parquet", emb=["1,2,3", "4,5,6"])
    one_line(
        run("index", path, "--vectors-column", "emb", "--out", tmp_path / "o"), "column 'emb'", "not a list of numbers"
    )
    path = table_file(tmp_path / "e.parquet", emb=pa.array([[], []], pa.list_(pa.float32())))
    one_line(run("index", path, "--vectors-column", "emb", "--out", tmp_path / "o"), "empty vectors")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("bad", ["zero-byte", "no text column", "binary not UTF-8"])
@case(
    "input",
    "a folder or glob of parquet files with one bad file among good ones",
    "one line naming the bad file; nothing written",
)
def test_one_bad_file_in_a_folder(tiny_bert: Path, tmp_path: Path, bad: str) -> None:
    folder = tmp_path / "parts"
    folder.mkdir()
    for i in range(3):
        table_file(folder / f"part-{i}.parquet", id=[f"p{i}-{j}" for j in range(30)], text=texts(30))
    broken = folder / "part-1.parquet"
    if bad == "zero-byte":
        broken.write_bytes(b"")
    elif bad == "no text column":
        table_file(broken, id=["a", "b"], body=["x", "y"])
    else:
        table_file(broken, id=["a", "b"], text=pa.array([b"ok", b"\xff bad"], pa.binary()))
    for corpus in (folder, f"{folder}/part-*.parquet"):
        one_line(build_from(tiny_bert, corpus, tmp_path / "out"), "part-1.parquet")
        assert not (tmp_path / "out").exists() and leftovers(tmp_path / "out") == []


# ----- options -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        (["--dim", "0"], "--dim must be at least 1"),
        (["--dim", "-3"], "--dim must be at least 1"),
        (["--dim", "100000"], "--dim must be between 1 and the encoder's dimension 32"),
        (["--gamma", "nan"], "--gamma must be between 0 and 2"),
        (["--gamma", "inf"], "--gamma must be between 0 and 2"),
        (["--gamma", "-1"], "--gamma must be between 0 and 2"),
        (["--gamma", "1e6"], "--gamma must be between 0 and 2"),
        (["--epsilon", "nan"], "--epsilon must be between 0 and 1"),
        (["--epsilon", "inf"], "--epsilon must be between 0 and 1"),
        (["--epsilon", "-1"], "--epsilon must be between 0 and 1"),
        (["--batch-size", "0"], "--batch-size must be at least 1"),
        (["--max-length", "0"], "--max-length must be at least 1"),
        (
            ["--max-length", "100000"],
            "--max-length must be between 3 (the special tokens and one more) and the model's 64 positions",
        ),
        (["--m", "0"], "--m (HNSW neighbours per node) must be between 2 and 512"),
        (["--nlist", "0"], "--nlist must be between 1"),
        (["--nprobe", "-3"], "--nprobe must be between 1"),
        (["--ef-construction", "0"], "--ef-construction must be between 1"),
        (["--ef-search", "0"], "--ef-search must be between 1"),
        (["--train-size", "0"], "--train-size must be between 1"),
        (["--pooling", "max"], "unknown --pooling 'max'"),
        (["--precision", "fp8"], "unknown --precision 'fp8'"),
        (["--stash-dtype", "int8"], "unknown --stash-dtype 'int8'"),
        (["--index-type", "NotAnIndex"], "FAISS cannot build index type 'NotAnIndex'"),
        (["--index-type", "IVF4096,Flat"], "IVF with 4096 lists needs at least that many training rows"),
        (["--index-type", "PQ7x8"], "FAISS cannot build index type 'PQ7x8'"),
        (["--extra-pooling", "max"], "unknown --extra-pooling 'max'"),
        (["--no-whiten", "--gamma", "0.5"], "the raw transform has no eigenvalues to raise; drop --gamma"),
        (["--center"], "the raw transform has no kernel to centre"),
    ],
)
@case(
    "options",
    "every numeric option of `index` at 0, negative, NaN, inf, huge; unknown pooling, extra pooling, precision, "
    "dtype, index type, factory strings, IVF too large for N; a gamma or centring for the raw transform",
    "one line naming the flag; nothing written; never a FAISS abort",
)
def test_bad_index_options(tiny_bert: Path, tmp_path: Path, options: list[str], fragment: str) -> None:
    corpus = write_corpus(tmp_path / "c.parquet", n=200)
    result = run("index", corpus, "--model", tiny_bert, "--out", tmp_path / "out", *options)
    one_line(result, fragment)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path / "out") == []


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        (["-k", "0"], "-k must be an integer between 1 and 10,000"),
        (["-k", "99999999"], "-k must be an integer between 1 and 10,000"),
        (["--rescore", "-5"], "--rescore must be an integer between 0 and 10,000"),
        (["--ef", "0"], "--ef-search must be an integer between 1"),
        (["--nprobe", "-3"], "--nprobe must be an integer between 1"),
    ],
)
@case("options", "`search` with -k 0 or huge, --rescore -5, --ef 0, --nprobe -3", "one line naming the flag")
def test_bad_search_options(cli_index: Path, options: list[str], fragment: str) -> None:
    one_line(run("search", "anything", "--index", cli_index, *options), fragment)


@case(
    "options",
    "-k larger than N, on a flat, HNSW or IVF index",
    "all N documents, ranked (an approximate index searches exhaustively for it)",
)
def test_k_larger_than_n(cli_index: Path, tmp_path: Path) -> None:
    hits = ok(run("search", "document", "--index", cli_index, "--json", "-k", 5000)).stdout.splitlines()
    assert [json.loads(h)["rank"] for h in hits] == list(range(1, 121))
    # HNSW with a beam of 8, IVF probing 1 list: before, they returned only the documents they reached
    corpus = write_corpus(tmp_path / "corpus.parquet", n=450)
    for spec in (IndexSpec("hnsw", ef_search=8), IndexSpec("ivf", nlist=11, nprobe=1)):
        out = tmp_path / spec.kind
        build_index(CorpusSpec(corpus), FakeEncoder(), out, TransformSpec(dim=8), spec)
        searcher = Searcher.load(out, encoder=FakeEncoder())
        queries = FakeEncoder().encode(["document number 3", "whitening"])
        scores, rows = searcher.search_raw(queries, SearchParams(k=5000, rescore=0))
        for query_scores, query_rows in zip(scores, rows, strict=True):
            assert sorted(query_rows.tolist()) == list(range(450)), spec.kind
            assert np.all(np.diff(query_scores) <= 1e-6), spec.kind  # ranked
        _, fewer = searcher.search_raw(queries, SearchParams(k=449, rescore=0))
        assert fewer.shape == (2, 449)  # below N: the index's own knob, as configured


@pytest.mark.parametrize("query", ["", "   ", "\t\n", "\u200b", "\x00\ufeff"])
@case("options", "empty, whitespace-only or invisible query (zero-width space, NUL)", "one line: the query is empty")
def test_empty_query(cli_index: Path, query: str) -> None:
    one_line(run("search", query, "--index", cli_index), "the query is empty")


@case("options", "a 100,000-character query", "hits (the query is truncated to the model's max length)")
def test_a_huge_query(cli_index: Path) -> None:
    hits = ok(run("search", "whitening " * 10_000, "--index", cli_index, "--json", "-k", 3)).stdout.splitlines()
    assert len(hits) == 3


@case(
    "options",
    "`eval ir --depth 0` or below 100, `--per-query` a folder or in a missing one, `tune --dims abc`, `--results` "
    "under a file, `--seed -1`, `--auto-queries 19`, `--test-pairs` for an index, `eval sts --index` with --dim",
    "one line naming the option, before any work (a bad output path failed after the sweep, and skipped --apply)",
)
def test_bad_eval_and_tune_options(cli_index: Path, tmp_path: Path) -> None:
    queries = table_file(tmp_path / "q.parquet", query_id=["q"], text=["document"])
    qrels = table_file(tmp_path / "r.parquet", query_id=["q"], doc_id=["doc1"], score=[1])
    judged = ("--queries", queries, "--qrels", qrels)
    one_line(run("eval", "ir", cli_index, *judged, "--depth", 0), "--depth must be at least 100")
    one_line(run("eval", "ir", cli_index, *judged, "--depth", 5), "--depth must be at least 100")  # labels @100
    one_line(run("eval", "ir", cli_index, *judged, "--per-query", tmp_path), "is a folder: name a file")
    one_line(run("eval", "ir", cli_index, *judged, "--per-query", tmp_path / "no" / "x.jsonl"), "does not exist")
    one_line(run("tune", cli_index, *judged, "--dims", "abc"), "--dims")
    (tmp_path / "afile").write_text("")
    for results in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        one_line(run("tune", cli_index, *judged, "--dims", 4, "--results", results, "--apply"), "is a file")
    one_line(run("tune", cli_index, "--auto", "--seed", -1), "--seed must be 0 or more")
    one_line(run("tune", cli_index, "--auto", "--auto-queries", 19), "--auto-queries must be between 20")
    one_line(run("tune", cli_index, *judged, "--test-pairs", qrels), "--test-pairs goes with --pairs")
    pairs = table_file(tmp_path / "p.parquet", **PAIRS)
    one_line(run("eval", "sts", pairs, "--index", cli_index, "--dim", 4), "--dim does not apply with --index")


QUERIES = {"query_id": ["q1", "q2"], "text": ["document number 1", "document number 2"]}
QRELS = {"query_id": ["q1", "q2"], "doc_id": ["doc1", "doc2"], "score": [1, 2]}


@pytest.mark.parametrize(
    ("queries", "qrels", "fragment"),
    [
        ({"text": ["document", None]}, {}, "query q2 of"),
        ({"text": ["document", "  "]}, {}, "has no text (null or blank)"),
        ({"query_id": ["q1", "q1"]}, {}, "query id 'q1' appears more than once"),
        ({"query_id": [], "text": []}, {"query_id": [], "doc_id": [], "score": []}, "holds no queries"),
        ({"text": [1, 2]}, {}, "holds int64, not text"),
        ({}, {"score": [1, None]}, "has a null query id, doc id or grade"),
        ({}, {"score": [0.5, 1.0]}, "has the grade 0.5: relevance grades must be whole numbers"),
        ({}, {"score": ["1", "2"]}, "holds string: relevance grades must be integers"),
        ({}, {"query_id": ["1.0", "2.0"]}, "no query of"),
        ({}, {"score": [0, 0]}, "grades no document of these queries above 0"),
        # ids read from another column than the qrels use: every metric 0, and tune --apply chose on that
        ({}, {"doc_id": ["D1", "D2"]}, "none of the 2 documents judged relevant is in the index"),
        ({}, {"query_id": ["q1", "q1"], "doc_id": ["d1", "d1"]}, "keep one judgement per (query, doc) pair"),
    ],
)
@case(
    "input",
    "`eval ir` / `tune` queries and qrels: null, blank or non-text queries, duplicate query ids, no queries, null, "
    "fractional or text grades, one (query, doc) pair graded twice differently, qrels whose ids match no query, "
    "qrels that grade nothing above 0, qrels none of whose relevant documents is in the index",
    "one line naming the file, the row or id, and the fix; never a NaN table",
)
def test_bad_queries_and_qrels(cli_index: Path, tmp_path: Path, queries: dict, qrels: dict, fragment: str) -> None:
    q = table_file(tmp_path / "q.parquet", **(QUERIES | queries))
    r = table_file(tmp_path / "r.parquet", **(QRELS | qrels))
    one_line(run("eval", "ir", cli_index, "--queries", q, "--qrels", r, "--json"), fragment)
    one_line(run("tune", cli_index, "--queries", q, "--qrels", r, "--dims", 8), fragment)


PAIRS = {"sentence1": ["a cat", "a dog", "the sun"], "sentence2": ["a kitten", "a puppy", "rain"], "score": [5, 4, 0]}


@pytest.mark.parametrize(
    ("pairs", "fragment"),
    [
        ({"sentence1": ["a cat", None, "x"]}, "column 'sentence1' of"),
        ({"score": [5.0, None, 1.0]}, "every pair needs a gold score"),
        ({"score": ["5", "4", "0"]}, "gold scores must be numbers"),
        ({k: v[:1] for k, v in PAIRS.items()}, "holds 1 pairs: a rank correlation needs at least two"),
        ({"subset": ["all", "all", "b"]}, "names a subset 'all', which is reserved"),
        ({"score": [3, 3, 3]}, "the same gold score (3) for every pair"),  # was a NaN row, and NaN in --json
        ({"subset": ["a", "a", "b"]}, "subset 'b' of"),  # one pair: its Spearman, and the weighted mean, NaN
    ],
)
@case(
    "input",
    "`eval sts` pair files: a null sentence, null or text scores, one pair, a subset named `all`",
    "one line naming the file and what to fix",
)
def test_bad_pairs(tiny_bert: Path, tmp_path: Path, pairs: dict, fragment: str) -> None:
    path = table_file(tmp_path / "p.parquet", **(PAIRS | pairs))
    one_line(run("eval", "sts", path, "--model", tiny_bert), fragment)
    (tmp_path / "not.parquet").write_text("sentence1,sentence2,score")  # not parquet at all
    one_line(run("eval", "sts", tmp_path / "not.parquet", "--model", tiny_bert), "is not a readable parquet file")


@case(
    "options",
    "`eval sts --dim` past the encoder's dimension; `tune --metric nDCG@5`",
    "one line before anything is encoded (not raw scores reported as transformed, not a KeyError mid-sweep)",
)
def test_dim_and_metric_out_of_range(cli_index: Path, tiny_bert: Path, tmp_path: Path) -> None:
    pairs = table_file(tmp_path / "p.parquet", **PAIRS)
    one_line(run("eval", "sts", pairs, "--model", tiny_bert, "--dim", 64), "--dim must be between 1 and")
    q, r = table_file(tmp_path / "q.parquet", **QUERIES), table_file(tmp_path / "r.parquet", **QRELS)
    one_line(run("tune", cli_index, "--queries", q, "--qrels", r, "--metric", "nDCG@5"), "unknown --metric 'nDCG@5'")
    one_line(run("tune", "--pairs", pairs, "--model", tiny_bert, "--metric", "x"), "unknown --metric 'x'")


@case("options", "`demo --dim 0`, `demo --dim 1000` (past MiniLM's 384)", "refused before the demo corpus is written")
def test_demo_refuses_before_writing(isolated_home: Path) -> None:
    one_line(run("demo", "--dim", 0), "--dim must be at least 1")
    assert not isolated_home.exists() or not list(isolated_home.iterdir())
    if model_dim(DEFAULT_MODEL) is None:
        pytest.skip(f"{DEFAULT_MODEL} is not installed here (make install)")
    one_line(run("demo", "--dim", 1000), "--dim must be between 1 and the encoder's dimension 384")
    assert not isolated_home.exists() or not list(isolated_home.iterdir())


@case(
    "faults",
    "Ctrl-C of `demo` while it builds, then `demo` again",
    "one line saying to rerun `retrieval demo` (it named `--resume`, which demo has not); the rerun continues from "
    "the parts encoded",
)
def test_an_interrupted_demo_continues_when_run_again(isolated_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if model_dim(DEFAULT_MODEL) is None:
        pytest.skip(f"{DEFAULT_MODEL} is not installed here (make install)")
    paragraphs = [
        (f"mod.f{i}", f"mod.f{i}", f"paragraph {i} of a small demo corpus about topic {i % 9}") for i in range(60)
    ]
    monkeypatch.setattr("retrieval.cli.demo_corpus.docstring_paragraphs", lambda: iter(paragraphs))
    fill = build_module.fill_index

    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(build_module, "fill_index", interrupted)  # the stash is encoded: the parts are kept
    result = run("demo", "--dim", 8)
    assert (result.exit_code, result.stderr.splitlines()[-1]) == (
        130,
        "error: interrupted: rerun `retrieval demo` to continue",
    )
    monkeypatch.setattr(build_module, "fill_index", fill)
    again = run("-v", "demo", "--dim", 8)
    assert again.exit_code == 0, again.output
    assert "resuming: 60 rows" in again.stderr and Manifest.load(isolated_home / "stdlib-docs").n == 60


@case(
    "input",
    "precomputed vectors beyond float16's range (1e5) into a 16-bit stash (`--stash-dtype float16`), by `index` "
    "and by `add`",
    "one line naming the first id and the value, and float32 as the fix (it said NaN or inf, which the input had "
    "not, after numpy's overflow warnings); nothing written",
)
def test_vectors_beyond_float16_into_a_16_bit_stash(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    fine = rng.standard_normal((40, 8)).astype(np.float32)
    big = fine[:3].copy()
    big[1, 4] = 1e5
    table_file(tmp_path / "big.parquet", id=["b0", "b1", "b2"], v=list(big))
    root = tmp_path / "root"
    result = run(
        "index", tmp_path / "big.parquet", "--vectors-column", "v", "--stash-dtype", "float16", "--out", root / "x"
    )
    one_line(
        result,
        "1 row holds values beyond the float16 stash's range (+-65,504; first: id 'b1', 100000)",
        "`index --stash-dtype float32`",
    )
    assert not root.exists() or list(root.iterdir()) == []
    table_file(tmp_path / "fine.parquet", id=[f"f{i}" for i in range(40)], v=list(fine))
    ok(
        run(
            "index",
            tmp_path / "fine.parquet",
            "--vectors-column",
            "v",
            "--stash-dtype",
            "float16",
            "--out",
            root / "idx",
        )
    )
    before = snapshot(root / "idx")
    one_line(run("add", root / "idx", tmp_path / "big.parquet"), "first: id 'b1', 100000", "build the index with")
    assert snapshot(root / "idx") == before and leftovers(root / "idx") == []


@case(
    "input",
    "vectors whose differences float16 cannot hold into a 16-bit stash: a spread of 1e-2 about 1e4, or values of "
    "1e-8 (below float16's smallest step)",
    "one line naming float32 as the fix (they were stored identical or zero and the index held only zero "
    "vectors); nothing written; vectors at embeddings' scale are stored",
)
def test_vectors_float16_would_blur_into_a_16_bit_stash(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for name, vectors in [
        ("offset", 1e4 + 1e-2 * rng.normal(size=(300, 32))),
        ("tiny", 1e-8 * rng.normal(size=(300, 32))),
    ]:
        np.save(tmp_path / f"{name}.npy", vectors.astype(np.float32))
        result = run("index", tmp_path / f"{name}.npy", "--stash-dtype", "float16", "--out", tmp_path / name)
        one_line(result, "a float16 stash would round these vectors' differences away", "`index --stash-dtype float32`")
        assert not (tmp_path / name).exists()
    np.save(tmp_path / "embeddings.npy", (0.05 * rng.normal(size=(300, 32)) + 0.01).astype(np.float32))
    ok(run("index", tmp_path / "embeddings.npy", "--stash-dtype", "float16", "--out", tmp_path / "fine"))
    # a few near-duplicates (one text encoded twice) have almost no spread of their own: not judged on it
    twins = np.load(tmp_path / "embeddings.npy")[[0, 0, 0]] + 1e-6 * rng.normal(size=(3, 32)).astype(np.float32)
    np.save(tmp_path / "twins.npy", twins)
    ok(run("add", tmp_path / "fine", tmp_path / "twins.npy"))


@case("options", "`refit --gamma nan` on a good index", "one line; the index is unchanged")
def test_refit_with_nan_gamma(copy: Path) -> None:
    before = snapshot(copy)
    one_line(run("refit", copy, "--gamma", "nan"), "--gamma must be between 0 and 2")
    assert snapshot(copy) == before and leftovers(copy) == []


@case(
    "options",
    "`refit --nprobe` on a flat index, `refit --epsilon` or `--no-center` on a raw one, `index --index-type hnsw "
    "--nlist 8` (or `IVF2,Flat --nlist 5`, or flat `--m 8`)",
    "one line naming the option that would do nothing; the index is unchanged (they were accepted and ignored)",
)
def test_options_that_would_do_nothing(copy: Path, tmp_path: Path) -> None:
    before = snapshot(copy)
    one_line(run("refit", copy, "--nprobe", 4), "--nprobe does nothing for a flat index")
    one_line(run("refit", copy, "--m", 16), "--m does nothing for a flat index")
    assert snapshot(copy) == before
    ok(run("refit", copy, "--no-whiten"))
    raw = snapshot(copy)
    one_line(run("refit", copy, "--epsilon", "1e-3"), "no eigenvalues to regularise; drop --epsilon")
    one_line(run("refit", copy, "--no-center"), "drop --center/--no-center")
    assert snapshot(copy) == raw and leftovers(copy) == []
    corpus = write_corpus(tmp_path / "c.parquet", n=50)
    out = tmp_path / "hnsw"
    one_line(run("index", corpus, "--index-type", "hnsw", "--nlist", 8, "--out", out), "--nlist does nothing")
    one_line(run("index", corpus, "--index-type", "IVF2,Flat", "--nlist", 5, "--out", out), "--nlist does nothing")
    one_line(run("index", corpus, "--m", 8, "--out", out), "--m does nothing for a flat index")
    one_line(run("index", corpus, "--index-type", "NSG32", "--out", out), "NSG graphs cannot take rows in batches")
    assert not out.exists()


# ----- index directories -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (lambda m: m["transform"].__setitem__("k", 4), "does not match its own checksum"),
        (lambda m: m["transform"]["spec"].__setitem__("gamma", 1.0), "does not match its own checksum"),
        (lambda m: m["encoder"].__setitem__("model", "some/other-model"), "does not match its own checksum"),
        (lambda m: m["transform"].__setitem__("d", 64), "does not match its own checksum"),
        (lambda m: m.__setitem__("schema_version", 1), "schema version 1; this retrieval reads version 2"),
    ],
    ids=["k", "gamma", "model", "d", "schema"],
)
@case(
    "index dir",
    "manifest edited by hand (k, d, gamma, model, schema version)",
    "one line: the manifest does not match its checksum (or its schema); rebuild",
)
def test_tampered_manifest(copy: Path, edit: Callable[[dict], None], fragment: str) -> None:
    data = json.loads((copy / MANIFEST).read_text())
    edit(data)
    (copy / MANIFEST).write_text(json.dumps(data, indent=2))
    one_line(run("search", "anything", "--index", copy), fragment)
    one_line(run("info", copy), fragment)


@pytest.mark.parametrize(
    ("name", "damage", "fragment"),
    [
        ("index.faiss", "zero", "checksum mismatch"),
        ("docs.arrow", "truncate", "checksum mismatch"),
        ("transform.npz", "delete", "is missing"),
        ("manifest.json", "delete", "not a complete index"),
        ("manifest.json", "truncate", "not valid JSON"),
    ],
)
@case(
    "index dir",
    "a file zeroed, truncated or deleted (index, docs, transform, manifest)",
    "one line naming the file; `info --verify` too",
)
def test_damaged_files(copy: Path, name: str, damage: str, fragment: str) -> None:
    path = copy / name
    if damage == "zero":
        path.write_bytes(bytes(path.stat().st_size))
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        path.unlink()
    one_line(run("search", "anything", "--index", copy), fragment)
    one_line(run("info", copy, "--verify"), fragment)


@case(
    "index dir",
    "extra files a user put inside an index",
    "searches ignore them; add, refit and --overwrite carry them over",
)
def test_extra_files_inside_an_index(copy: Path, tmp_path: Path) -> None:
    (copy / "NOTES.md").write_text("mine")
    (copy / "results").mkdir()
    (copy / "results" / "r.json").write_text("{}")
    ok(run("search", "document", "--index", copy))
    ok(run("refit", copy, "--dim", 4))
    ok(run("add", copy, new_docs(tmp_path / "more.parquet")))
    assert (copy / "NOTES.md").read_text() == "mine" and (copy / "results" / "r.json").read_text() == "{}"


@contextmanager
def read_only(directory: Path) -> Iterator[str]:
    """``directory`` read-only: a read-only bind mount where this machine allows mounts (as root, where write
    permissions are not enforced, a chmod would prove nothing), else write calls failing with EROFS."""
    if os.geteuid() == 0 and shutil.which("mount"):
        bind = subprocess.run(["mount", "--bind", str(directory), str(directory)], capture_output=True)
        if bind.returncode == 0:
            remount = subprocess.run(["mount", "-o", "remount,ro,bind", str(directory)], capture_output=True)
            try:
                if remount.returncode == 0:
                    yield "mount"
                    return
            finally:
                subprocess.run(["umount", str(directory)], capture_output=True)
    with pytest.MonkeyPatch.context() as mp:
        real_open = os.open

        def refuse(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            if str(path).startswith(str(directory)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                raise OSError(30, "Read-only file system", str(path))
            return real_open(path, flags, *args, **kwargs)

        mp.setattr(os, "open", refuse)
        yield "simulated"


@case("index dir", "the index on a read-only file system", "search works; add, refit and remove refuse in one line")
def test_read_only_index(copy: Path, tmp_path: Path) -> None:
    more = new_docs(tmp_path / "more.parquet")
    expected = ok(run("search", "document number 3", "--index", copy, "--json")).stdout
    with read_only(copy.parent):
        assert ok(run("search", "document number 3", "--index", copy, "--json")).stdout == expected
        one_line(run("add", copy, more), "cannot write", "writable directory")
        one_line(run("refit", copy, "--dim", 4), "cannot write", "writable directory")
        one_line(run("remove", copy, "doc3"), "cannot write", "writable directory")
    assert leftovers(copy) == []


@case(
    "index dir",
    "a write-protected index (`chmod -R a-w`)",
    "search works; add, refit and remove refuse in one line saying `chmod -R u+w` (they replaced it, then could not "
    "remove the old version, and every later writer failed)",
)
def test_write_protected_index(copy: Path, tmp_path: Path) -> None:
    expected = ok(run("search", "document number 3", "--index", copy, "--json")).stdout
    before = snapshot(copy)
    for path in [copy, *copy.rglob("*")]:
        path.chmod(path.stat().st_mode & ~0o222)
    try:
        assert ok(run("search", "document number 3", "--index", copy, "--json")).stdout == expected
        one_line(run("add", copy, new_docs(tmp_path / "more.parquet")), "is write-protected", "chmod -R u+w")
        one_line(run("refit", copy, "--dim", 4), "is write-protected")
        one_line(run("remove", copy, "doc3"), "is write-protected")
    finally:
        for path in [copy, *copy.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)
    assert snapshot(copy) == before and leftovers(copy) == []


@case(
    "index dir",
    "the index folder is itself a mount point (a container's volume)",
    "search works; writers refuse in one line before encoding, saying to mount the folder that holds it (a "
    "traceback, Device or resource busy, after the encoding)",
)
def test_index_that_is_a_mount_point(copy: Path, tmp_path: Path) -> None:
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("a bind mount needs root")
    if subprocess.run(["mount", "--bind", str(copy), str(copy)], capture_output=True).returncode != 0:
        pytest.skip("this machine allows no mounts")
    try:
        before = snapshot(copy)
        ok(run("search", "document", "--index", copy))
        one_line(run("add", copy, new_docs(tmp_path / "more.parquet")), "is a mount point", "mount the folder")
        one_line(run("refit", copy, "--dim", 4), "is a mount point")
        assert snapshot(copy) == before
    finally:
        subprocess.run(["umount", str(copy)], capture_output=True)
    assert leftovers(copy) == []


@case(
    "index dir",
    "a private index (folders 700, files 600) updated by a writer whose umask is 022",
    "the new version keeps 700/600 (it became 755/644: readable by all)",
)
def test_private_index_stays_private(copy: Path, tmp_path: Path) -> None:
    for path in [copy, *copy.rglob("*")]:
        path.chmod(0o700 if path.is_dir() else 0o600)
    umask = os.umask(0o022)
    try:
        ok(run("add", copy, new_docs(tmp_path / "more.parquet")))
        ok(run("refit", copy, "--dim", 4))
    finally:
        os.umask(umask)
    modes = {path.stat().st_mode & 0o777 for path in [copy, *copy.rglob("*")] if path.is_dir()}
    assert modes == {0o700}
    assert {path.stat().st_mode & 0o777 for path in copy.rglob("*") if path.is_file()} == {0o600}


@case(
    "index dir",
    "`remove` with ids the index does not hold",
    "one line naming the first of them; nothing removed (`--missing-ok` removes the others)",
)
def test_remove_unknown_ids(fake_index: Path) -> None:
    before = snapshot(fake_index)
    one_line(run("remove", fake_index, "doc3", "no-such-doc"), "1 of the 2 ids", "first: no-such-doc", "--missing-ok")
    assert snapshot(fake_index) == before and leftovers(fake_index) == []


@case(
    "index dir",
    "the index reached through a symbolic link",
    "search works; add works again and again and the link keeps pointing at the index",
)
def test_symlinked_index(copy: Path, tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(copy)
    ok(run("search", "document", "--index", link))
    ok(run("add", link, new_docs(tmp_path / "a.parquet", prefix="a")))
    ok(run("add", link, new_docs(tmp_path / "b.parquet", prefix="b")))
    assert link.is_symlink() and Manifest.load(link).n == 160 == Manifest.load(copy).n


@case(
    "index dir",
    "a second writer through a symbolic link to the same index",
    "refused: the lock is on the real directory",
)
def test_lock_is_on_the_resolved_directory(copy: Path, tmp_path: Path) -> None:
    link = tmp_path / "alias"
    link.symlink_to(copy)
    with files.writing(files.resolved(copy)):
        one_line(run("refit", link, "--dim", 4), "another retrieval process is writing")


@case("index dir", "`add` with an encoder of another model", "refused: the index was built with another model")
def test_add_with_another_model(fake_index: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="built with model 'fake'.* query encoder uses 'other'"):
        update.add(fake_index, CorpusSpec(new_docs(tmp_path / "m.parquet")), FakeEncoder(name="other"))


@case(
    "index dir",
    "stash.json naming a part outside the index (../../secret.npy)",
    "refused before anything is read or linked",
)
def test_stash_paths_outside_the_index(fake_index: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.npy"
    np.save(secret, np.zeros((3, 16), dtype=np.float32))
    state_path = fake_index / STASH / "stash.json"
    state = json.loads(state_path.read_text())
    state["parts"][0]["vectors"]["mean"] = "../../secret.npy"
    state_path.write_text(json.dumps(state))
    with pytest.raises(IndexDirError, match="outside the stash"):
        IndexDir(fake_index).stash()
    with pytest.raises(IndexDirError):  # refit verifies stash.json against the manifest first
        update.refit(fake_index, TransformSpec(dim=4))
    assert not list(fake_index.rglob("secret.npy"))


@pytest.mark.parametrize("damage", ["garbage", "shuffled"])
@case(
    "index dir",
    "a stash part overwritten with garbage, or its rows shuffled, then refit / tune / calibrate / re-score (a "
    "one-shot search included)",
    "refused (checksum mismatch; a one-shot search checks sizes and sampled hashes of the parts it maps); the "
    "index is not rebuilt from garbage",
)
def test_garbage_in_the_stash(fake_index: Path, damage: str) -> None:
    stash = IndexDir(fake_index).stash()
    part = stash.root / stash.parts[0].vectors["mean"]
    if damage == "garbage":
        part.write_bytes(part.read_bytes()[:128] + os.urandom(part.stat().st_size - 128))  # same size, garbage
    else:  # a one-shot search re-scored these and answered other documents' ids with exit 0
        rows = np.load(part)
        np.save(part, rows[np.random.default_rng(1).permutation(len(rows))])
    before = snapshot(fake_index)
    with pytest.raises(IndexDirError, match="corrupt"):
        update.refit(fake_index, TransformSpec(dim=4))
    assert snapshot(fake_index) == before and leftovers(fake_index) == []
    dev = (Queries(["q"], ["document number 1"]), {"q": {"doc1": 1}})
    with pytest.raises(IndexDirError, match="corrupt"):
        tune_index(fake_index, dev, dims=[4], gammas=[0.5])
    with pytest.raises(IndexDirError, match="corrupt"):  # a searcher that re-scores loads with full checks
        Searcher.load(fake_index, encoder=FakeEncoder())
    with pytest.raises(IndexDirError, match="corrupt"):  # ... and a one-shot search with quick ones
        Searcher.load(fake_index, encoder=FakeEncoder(), verify="quick")
    with pytest.raises(IndexDirError, match="corrupt"):
        update.calibrate_index(fake_index, FakeEncoder().encode(["a query"]), 0.9)


def flip_middle_byte(data: bytes) -> bytes:
    return data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + data[len(data) // 2 + 1 :]


@pytest.mark.parametrize(
    ("name", "damage", "message"),
    [
        (INDEX, flip_middle_byte, "checksum mismatch"),
        # a readable file still, saying something else: it would have been copied on as true
        (f"{STASH}/part-00000.parquet", lambda data: data.replace(b"document", b"DOCUMENT", 1), "is corrupt"),
    ],
)
@case(
    "index dir",
    "`add` on an index with a flipped byte in index.faiss, or a stashed (id, text) part altered at the same size",
    "refused (checksum mismatch) before anything is read from it; nothing republished with fresh checksums",
)
def test_add_on_a_damaged_index(
    fake_index: Path, tmp_path: Path, name: str, damage: Callable[[bytes], bytes], message: str
) -> None:
    path = fake_index / name
    damaged = damage(path.read_bytes())
    assert damaged != path.read_bytes() and len(damaged) == path.stat().st_size
    path.write_bytes(damaged)
    before = snapshot(fake_index)
    with pytest.raises(IndexDirError, match=message):
        update.add(fake_index, CorpusSpec(new_docs(tmp_path / "m.parquet")), FakeEncoder())
    assert snapshot(fake_index) == before


@case(
    "input",
    "`add` without ids after a build that skipped empty rows, and of a folder without ids",
    "row-number ids continue past the highest one; a folder's rows keep their file:row ids",
)
def test_add_ids_without_an_id_column(tmp_path: Path) -> None:
    corpus = table_file(tmp_path / "c.parquet", text=["", *texts(39)])  # row 0 skipped: ids "1".."39"
    out = tmp_path / "idx"
    build_index(CorpusSpec(corpus, skip_empty=True), FakeEncoder(), out, TransformSpec(dim=4))
    update.add(out, CorpusSpec(table_file(tmp_path / "more.parquet", text=texts(2, "more"))), FakeEncoder())
    (tmp_path / "folder").mkdir()
    table_file(tmp_path / "folder" / "x.parquet", text=texts(2, "folder"))
    update.add(out, CorpusSpec(tmp_path / "folder"), FakeEncoder())
    ids = list(IndexDir(out).docs().ids)
    assert ids == [str(i) for i in range(1, 42)] + ["x.parquet:0", "x.parquet:1"]


@pytest.mark.parametrize("dim", [8, None])
@case(
    "concurrency",
    "a searcher loaded just before `index --overwrite` publishes, then re-scoring (by default, or asked for on "
    "a raw index, whose stash is mapped on first use)",
    "re-scores with its own version's stashed vectors, never the new version's; or refuses: load it again",
)
def test_a_searcher_rescores_its_own_version(tmp_path: Path, dim: int | None) -> None:
    out = tmp_path / "idx"
    build_index(CorpusSpec(write_corpus(tmp_path / "a.parquet", 300)), FakeEncoder(), out, TransformSpec(dim=dim))
    params = SearchParams(k=5, rescore=20)
    reference = Searcher.load(shutil.copytree(out, tmp_path / "copy"), encoder=FakeEncoder())
    expected = [[(h.id, h.score) for h in hits] for hits in reference.search_batch(texts(5), params)]
    searcher = Searcher.load(out, encoder=FakeEncoder(), verify="quick")  # loaded, not yet searched
    other = table_file(tmp_path / "b.parquet", id=[f"b{i}" for i in range(200)], text=texts(200, "other words"))
    build_index(CorpusSpec(other), FakeEncoder(), out, TransformSpec(dim=dim), options=BuildOptions(overwrite=True))
    if dim is None:  # raw: no re-scoring by default, so nothing was mapped at load
        assert searcher.manifest.rescoring.depth == 0
        with pytest.raises(IndexDirError, match="replaced since it was loaded"):
            searcher.search_batch(texts(5), params)
        return
    assert searcher.manifest.rescoring.depth > 0
    got = [[(h.id, h.score) for h in hits] for hits in searcher.search_batch(texts(5), params)]
    assert got == expected


@pytest.mark.parametrize("through", ["path", "symlink"])
@case(
    "concurrency",
    "a reader (by the path or a symbolic link to it) arriving between a publish's two renames",
    "waits for the publish and reads the index; one that saw the directory missing retries",
)
def test_a_reader_in_the_publish_gap(fake_index: Path, tmp_path: Path, through: str) -> None:
    path = fake_index
    if through == "symlink":
        path = tmp_path / "link"
        path.symlink_to(fake_index)
    old = files.work_dir(fake_index, "old")
    with files.writing(fake_index):  # a writer holds the lock, between rename(target, old) and rename(work, target)
        os.rename(fake_index, old)
        timer = threading.Timer(0.3, lambda: os.rename(old, fake_index))
        timer.start()
        start = time.monotonic()
        assert load(path, "quick").manifest.n == 300
        assert time.monotonic() - start >= 0.25
        timer.join()


def test_a_reader_that_saw_the_gap_retries(fake_index: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The directory missing when the read starts, back (publish done) before the failure is judged."""
    old = files.work_dir(fake_index, "old")
    real_load_once = indexdir._load_once
    calls = []

    def load_once(directory: IndexDir, verify: Any) -> Any:
        calls.append(directory)
        try:
            return real_load_once(directory, verify)
        finally:
            if len(calls) == 1:
                os.rename(old, fake_index)

    monkeypatch.setattr(indexdir, "_load_once", load_once)
    with files.writing(fake_index):
        os.rename(fake_index, old)
        assert indexdir.load(fake_index, "quick").manifest.n == 300
    assert len(calls) == 2


@case(
    "index dir",
    "`index` without --overwrite onto an index left renamed aside by a publish killed between its renames",
    "refused in one line (it exists); the old index put back, unchanged",
)
def test_build_after_an_interrupted_publish_needs_overwrite(fake_index: Path, tmp_path: Path) -> None:
    before = snapshot(fake_index)
    os.rename(fake_index, files.work_dir(fake_index, "old"))
    with pytest.raises(ConfigError, match="already exists"):
        build_index(CorpusSpec(write_corpus(tmp_path / "b.parquet", 50)), FakeEncoder(), fake_index)
    assert snapshot(fake_index) == before and leftovers(fake_index) == []


@case(
    "index dir",
    "a symbolic link planted inside an unfinished build, then --resume",
    "refused; nothing outside the index deleted or written",
)
def test_planted_symlink_in_a_work_dir(tmp_path: Path) -> None:
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    out = tmp_path / "idx"
    work = files.work_dir(out)
    (work / STASH).mkdir(parents=True)
    (work / STASH / "stash.json").write_text("{}")
    (work / STASH / "planted").symlink_to(outside)
    corpus = write_corpus(tmp_path / "c.parquet", n=50)
    with pytest.raises(IndexDirError, match="symbolic link"):
        build_index(CorpusSpec(corpus), FakeEncoder(), out, TransformSpec(dim=4), options=BuildOptions(resume=True))
    assert (outside / "keep.txt").read_text() == "mine"


# ----- faults ------------------------------------------------------------------------------------------------
def writer(argv: list[str]) -> int:
    """The process the fault tests kill: ``writer add|refit|remove INDEX [CORPUS] --pause POINT --marker FILE``."""
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


REMOVED = [f"doc{i}" for i in range(3, 40)]  # what the fault tests' `remove` takes out


def start_writer(tmp_path: Path, action: str, index: Path, pause: str) -> tuple[subprocess.Popen, Path]:
    marker = tmp_path / f"paused-{action}-{pause}"
    marker.unlink(missing_ok=True)
    corpus = [str(new_docs(tmp_path / "w.parquet", 30))] if action == "add" else []
    command = [
        sys.executable,
        str(HERE),
        "writer",
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


def results(index: Path) -> list[list[str]]:
    searcher = Searcher.load(index, encoder=FakeEncoder())
    return [[h.id for h in hits] for hits in searcher.search_batch(texts(5), SearchParams(k=5))]


@pytest.mark.parametrize(
    ("action", "pause"),
    [
        ("add", "encode"),
        ("add", "write"),
        ("add", "publish"),
        ("refit", "write"),
        ("refit", "publish"),
        ("remove", "write"),
        ("remove", "publish"),
    ],
)
@case(
    "faults",
    "SIGKILL of `add`, `refit` or `remove` while encoding, writing, or between publish's two renames",
    "the old index searches with identical results (left aside by the publish: the next writer puts it back, a "
    "search says where it is); the next writer clears the stale work; a rerun works",
)
def test_sigkill_of_a_writer(fake_index: Path, tmp_path: Path, action: str, pause: str) -> None:
    before, expected = snapshot(fake_index), results(fake_index)
    process, marker = start_writer(tmp_path, action, fake_index, pause)
    wait_for(marker, process)
    process.send_signal(signal.SIGKILL)
    process.wait()
    if pause == "publish":  # left aside: a reader says where and moves nothing; a writer's first step restores it
        with pytest.raises(IndexDirError, match="its previous version is at"):
            results(fake_index)
        files.restore(fake_index)
    assert results(fake_index) == expected
    assert snapshot(fake_index) == before
    if action == "add":
        update.add(fake_index, CorpusSpec(new_docs(tmp_path / "again.parquet", 30)), FakeEncoder())
    elif action == "remove":
        assert update.remove(fake_index, REMOVED) is not None and IndexDir(fake_index).manifest().n == 263
    else:
        update.refit(fake_index, TransformSpec(dim=4))
    assert leftovers(fake_index) == []


@pytest.mark.parametrize("action", ["add", "refit", "remove"])
@case(
    "faults",
    "Ctrl-C (SIGINT) of `add`, `refit` or `remove`",
    "exit 130; the old index unchanged; no work directory or lock left",
)
def test_sigint_of_a_writer(fake_index: Path, tmp_path: Path, action: str) -> None:
    before = snapshot(fake_index)
    process, marker = start_writer(tmp_path, action, fake_index, "write")
    wait_for(marker, process)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=30) == 130
    assert snapshot(fake_index) == before and leftovers(fake_index) == []


@pytest.mark.parametrize(
    ("action", "pause"), [("add", "write"), ("add", "publish"), ("refit", "publish"), ("remove", "publish")]
)
@case(
    "faults",
    "SIGTERM (kill, timeout, docker stop) of `add`, `refit` or `remove`, also between publish's two renames",
    "exit 143; the old index unchanged; no work directory or lock left",
)
def test_sigterm_of_a_writer(fake_index: Path, tmp_path: Path, action: str, pause: str) -> None:
    before = snapshot(fake_index)
    process, marker = start_writer(tmp_path, action, fake_index, pause)
    wait_for(marker, process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 143
    with files.writing(fake_index):  # what any writer does first: puts back a version renamed aside
        pass
    assert snapshot(fake_index) == before and leftovers(fake_index) == []


@case(
    "faults", "SIGTERM of `retrieval add` while it encodes", "exit 143; the old index unchanged; nothing left beside it"
)
def test_sigterm_of_the_add_command(copy: Path, tmp_path: Path) -> None:
    before = snapshot(copy)
    corpus = new_docs(tmp_path / "many.parquet", 3000)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-m", "retrieval", "add", str(copy), str(corpus)], stderr=subprocess.PIPE, text=True, env=env
    )
    deadline = time.monotonic() + 120
    while not (files.work_dir(copy, "adding") / STASH).exists():
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read() if process.stderr else ""
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr
    assert "Traceback" not in stderr
    assert snapshot(copy) == before and leftovers(copy) == []


@pytest.mark.parametrize(
    ("stop", "status", "word"), [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
)
@case(
    "faults",
    "Ctrl-C or SIGTERM of `retrieval index`",
    "exit 130 / 143 and one line saying the encoded parts are kept and --resume continues; a resumed build completes",
)
def test_sigint_of_a_build(tiny_bert: Path, tmp_path: Path, stop: int, status: int, word: str) -> None:
    corpus = write_corpus(tmp_path / "c.parquet", n=3000)
    out = tmp_path / "idx"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RETRIEVAL_INDEX_ROOT": str(tmp_path / "root")}
    command = [sys.executable, "-m", "retrieval", "index", str(corpus), "--model", str(tiny_bert), "--out", str(out)]
    # SIGINT as a terminal delivers it: started in the background (`make test &`), the suite hands its children
    # SIGINT ignored, Python then installs no handler, and the build ran to the end (exit 0) under the signal.
    process = subprocess.Popen(
        command,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while not (files.work_dir(out) / STASH / "part-00000.parquet").exists():
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read() if process.stderr else ""
        time.sleep(0.02)
    process.send_signal(stop)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == status, stderr
    lines = [line for line in stderr.splitlines() if line.strip() and word in line]
    assert lines and "--resume" in lines[-1] and "Traceback" not in stderr
    done = subprocess.run([*command, "--resume"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert Manifest.load(out).n == 3000 and leftovers(out) == []


@case("faults", "Ctrl-C while the command line starts (importing its modules)", "exit 130 and one line, no traceback")
def test_sigint_while_the_cli_starts(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RETRIEVAL_INDEX_ROOT": str(tmp_path / "root")}
    process = subprocess.Popen(
        [sys.executable, "-m", "retrieval", "info", str(tmp_path / "none")],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal delivers it (above)
    )
    maps, deadline = Path(f"/proc/{process.pid}/maps"), time.monotonic() + 60
    while "_multiarray_umath" not in maps.read_text():  # numpy loaded: the CLI's imports are under way
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read() if process.stderr else ""
        time.sleep(0.002)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert (process.returncode, stderr) == (130, "error: interrupted\n")


@case("faults", "Ctrl-C while typer parses a command's arguments", "exit 130 and one line (it exited 130 silently)")
def test_sigint_while_arguments_are_parsed(fake_index: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(typer.core.TyperCommand, "parse_args", interrupted)
    result = runner.invoke(app, ["info", str(fake_index)])
    assert (result.exit_code, result.stderr) == (130, "error: interrupted\n")


def signalled_when(process: subprocess.Popen, ready: Callable[[], bool], stop: int) -> tuple[int, str]:
    """Send ``stop`` once ``ready()``; the exit status and stderr."""
    deadline = time.monotonic() + 120
    while not ready():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.005)
    process.send_signal(stop)
    _, stderr = process.communicate(timeout=60)
    return process.returncode, stderr


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
@case(
    "faults",
    "Ctrl-C or SIGTERM after a command has finished, while the interpreter tears down (~1.5 s after torch)",
    "ignored: the command's own exit status (a published `add` had exited 130 / 143, as if it had failed)",
)
def test_a_signal_after_the_command_keeps_its_exit_status(fake_index: Path, tmp_path: Path, stop: int) -> None:
    marker = tmp_path / "tearing-down"
    # a slow teardown: an exit handler registered before the CLI's, so it runs after everything the CLI does
    probe = (
        "import atexit, pathlib, runpy, sys, time\n"
        "atexit.register(lambda marker=sys.argv[1]: (pathlib.Path(marker).touch(), time.sleep(2)))\n"
        "sys.argv = ['retrieval', 'info', sys.argv[2], '--json']\n"
        "runpy.run_module('retrieval', run_name='__main__')\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", probe, str(marker), str(fake_index)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal delivers it (above)
    )
    code, stderr = signalled_when(process, marker.exists, stop)
    assert (code, stderr) == (0, "")


@pytest.mark.parametrize(
    ("stop", "status", "word"), [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
)
@case(
    "faults",
    "Ctrl-C or SIGTERM of a command that only reads (`search --queries -` waiting for its queries)",
    "exit 130 / 143 and one line, as for a writer (SIGTERM had killed it silently: status -15)",
)
def test_sigterm_of_a_reading_command(fake_index: Path, stop: int, status: int, word: str) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "retrieval", "search", "--queries", "-", "--index", str(fake_index)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    syscall = Path(f"/proc/{process.pid}/syscall")
    code, stderr = signalled_when(process, lambda: syscall.read_text().startswith("0 0x0 "), stop)  # read(0, ...)
    assert (code, stderr) == (status, f"error: {word}\n")


@pytest.mark.parametrize("fault", ["disk full", "read-only", "interrupted"])
@case(
    "faults",
    "`tune --results` and `eval ir --per-query` writing to a full disk or a read-only place, or interrupted "
    "while they write",
    "one line (or exit 130); the results whole or as they were: no half file, no stale plot beside new "
    "numbers, no empty folder made",
)
def test_results_are_whole_or_untouched(
    cli_index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    queries = table_file(tmp_path / "q.parquet", **QUERIES)
    qrels = table_file(tmp_path / "r.parquet", **QRELS)
    judged = ("--queries", queries, "--qrels", qrels)
    old = tmp_path / "old"
    old.mkdir()
    (old / "tune.json").write_text("earlier results")
    (old / "tune.png").write_bytes(b"earlier plot")
    (old / "pq.jsonl").write_text("earlier per-query lines")
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    error = {"disk full": OSError(28, "No space left on device"), "read-only": OSError(30, "Read-only file system")}
    fail = KeyboardInterrupt() if fault == "interrupted" else error[fault]
    real_fsync = os.fsync

    def failing(fd: int) -> None:  # the file's bytes are written (to its temporary name) when the fault comes
        raise fail

    monkeypatch.setattr(os, "fsync", failing)
    fragment = {"disk full": "no space left on the device while writing", "read-only": "cannot write"}
    code = 130 if fault == "interrupted" else 1
    for results in (old, tmp_path / "new" / "results"):
        result = run("tune", cli_index, *judged, "--dims", 4, "--gammas", 0, "--results", results)
        last = result.stderr.splitlines()[-1]  # after the sweep's own warnings (a 120-row corpus)
        assert result.exit_code == code and "Traceback" not in result.output, result.output
        assert last == "error: interrupted" if code == 130 else fragment[fault] in last and str(results) in last
    result = run("eval", "ir", cli_index, *judged, "--per-query", old / "pq.jsonl")
    assert result.exit_code == code and "Traceback" not in result.output
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before
    assert not (tmp_path / "new" / "results").exists()

    monkeypatch.setattr(os, "fsync", real_fsync)
    ok(run("tune", cli_index, *judged, "--dims", 4, "--gammas", 0, "--results", old))
    assert json.loads((old / "tune.json").read_text())["metric"] == "nDCG@10"
    assert (old / "tune.png").read_bytes()[:4] == b"\x89PNG" and sorted(p.name for p in old.iterdir()) == [
        "pq.jsonl", "tune.json", "tune.png"
    ]  # fmt: skip


@contextmanager
def small_disk(directory: Path, size: str) -> Iterator[str]:
    """A ``size`` tmpfs mounted at ``directory`` where mounts are allowed; else writes of more than ~1 MB under
    it fail with ENOSPC."""
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0 and shutil.which("mount"):
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], capture_output=True
        )
        if mounted.returncode == 0:
            try:
                yield "tmpfs"
            finally:
                subprocess.run(["umount", "-l", str(directory)], capture_output=True)
            return
    with pytest.MonkeyPatch.context() as mp:
        real = files.write_atomic

        def full(path: Path, data: bytes) -> None:
            if str(path).startswith(str(directory)) and len(data) > 200_000:
                raise OSError(28, "No space left on device", str(path))
            real(path, data)

        mp.setattr(files, "write_atomic", full)
        mp.setattr("retrieval.stash.write_atomic", full)
        yield "simulated"


@case(
    "faults",
    "the disk fills up during a build over an existing index",
    "one line (no space left); the old index intact; no work directory left",
)
def test_disk_full_during_a_build(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    with small_disk(disk, "1m"):
        out = disk / "idx"
        build_index(
            CorpusSpec(write_corpus(tmp_path / "small.parquet", n=40)), FakeEncoder(), out, TransformSpec(dim=4)
        )
        before = snapshot(out)
        big = write_corpus(tmp_path / "big.parquet", n=20_000)
        with pytest.raises(IndexDirError, match="no space left on the device"):
            build_index(CorpusSpec(big), FakeEncoder(), out, TransformSpec(dim=4), options=BuildOptions(overwrite=True))
        assert snapshot(out) == before and leftovers(out) == []
        assert Searcher.load(out, encoder=FakeEncoder()).manifest.n == 40


@pytest.mark.parametrize("first", ["add", "refit", "remove", "info --verify"])
@case(
    "faults",
    "a publish killed between its two renames (the index moved aside), then `add`, `refit`, `remove` or "
    "`info --verify` before any search",
    "a writer puts the previous version back and works; `info` (a reader: it never moves anything) says where the "
    "previous version is and how to put it back",
)
def test_an_index_left_aside_is_restored_by_whichever_writer_comes_first(
    fake_index: Path, tmp_path: Path, first: str
) -> None:
    before = snapshot(fake_index)
    os.rename(fake_index, files.work_dir(fake_index, "old"))  # the state a kill after publish's first rename leaves
    argv = {
        "add": ["add", fake_index, new_docs(tmp_path / "more.parquet")],
        "refit": ["refit", fake_index, "--dim", 4],
        "remove": ["remove", fake_index, "doc3"],
        "info --verify": ["info", fake_index, "--verify"],
    }[first]
    result = run(*argv) if first == "info --verify" else None
    if result is None:  # the writers load the fake encoder's index through the library, as the CLI would
        if first == "add":
            update.add(fake_index, update.read_like_build(fake_index, argv[2]), FakeEncoder())
        elif first == "refit":
            update.refit(fake_index, update.transform_spec(fake_index, dim=4))
        else:
            update.remove(fake_index, ["doc3"])
    else:
        one_line(result, "its previous version is at", "the next `retrieval add`, `retrieval remove` or")
        assert not fake_index.exists()
        update.current(fake_index)
        assert snapshot(fake_index) == before
    assert leftovers(fake_index) == []


@case(
    "faults",
    "a refit whose kept settings were read before another writer published",
    "refused in one line (its unset options would undo the other writer's change); run again",
)
def test_a_refit_based_on_an_older_version_is_refused(fake_index: Path, tmp_path: Path) -> None:
    generation = IndexDir(fake_index).manifest().generation
    spec = update.transform_spec(fake_index, gamma=1.0)  # read as `retrieval refit --gamma 1` reads it ...
    update.refit(fake_index, update.transform_spec(fake_index, dim=6))  # ... when another refit publishes first
    with pytest.raises(IndexDirError, match=r"changed since this refit read it \(version 1 -> 2, .*\): run it again"):
        update.refit(fake_index, spec, generation=generation)
    assert IndexDir(fake_index).manifest().transform.k == 6  # the other writer's change stands


@case(
    "faults",
    "a killed update's work directory (`.IDX.refitting`) when a writer of another kind runs next",
    "removed by the next writer of any kind; a build's `.IDX.building` is kept for `--resume`",
)
def test_a_killed_update_s_work_is_cleared_by_any_next_writer(fake_index: Path, tmp_path: Path) -> None:
    for purpose in (*files.UPDATE_PURPOSES, "building"):
        (files.work_dir(fake_index, purpose) / "index.faiss").parent.mkdir()
        (files.work_dir(fake_index, purpose) / "index.faiss").write_bytes(b"a killed writer's")
    update.add(fake_index, CorpusSpec(new_docs(tmp_path / "m.parquet")), FakeEncoder())
    assert leftovers(fake_index) == [files.work_dir(fake_index).name]  # .fidx.building only


@pytest.mark.parametrize(
    ("said", "message"),
    [
        ("write error in x: 0 != 4096 (No space left on device)", "no space left on the device"),
        ("something FAISS could not do", r"FAISS could not write .*index.faiss \(.*: something FAISS could not do\)"),
    ],
)
@case(
    "faults",
    "FAISS fails to write `index.faiss` (a full disk) in `add` or a build",
    "one line (no space left, or FAISS's own reason); the old index intact; no work directory left",
)
def test_a_failed_faiss_write_is_one_line(fake_index: Path, tmp_path: Path, said: str, message: str) -> None:
    import faiss

    before = snapshot(fake_index)

    def refuse(*args: Any) -> None:
        raise RuntimeError(f"Error in void faiss::write_index: {said}")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(faiss, "write_index", refuse)
        with pytest.raises(IndexDirError, match=message):
            update.add(fake_index, CorpusSpec(new_docs(tmp_path / "m.parquet")), FakeEncoder())
        corpus = write_corpus(tmp_path / "c.parquet", n=50)
        with pytest.raises(IndexDirError, match=message):
            build_index(
                CorpusSpec(corpus),
                FakeEncoder(),
                fake_index,
                TransformSpec(dim=4),
                options=BuildOptions(overwrite=True),
            )
    assert snapshot(fake_index) == before and leftovers(fake_index) == []


@case(
    "faults",
    "two writers at once (`add` while `refit` runs)",
    "the second is refused at once in one line; the first completes",
)
def test_two_writers(fake_index: Path, tmp_path: Path) -> None:
    process, marker = start_writer(tmp_path, "refit", fake_index, "write")
    try:
        wait_for(marker, process)
        with pytest.raises(IndexDirError, match="another retrieval process is writing"):
            update.add(fake_index, CorpusSpec(new_docs(tmp_path / "m.parquet")), FakeEncoder())
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)
    update.add(fake_index, CorpusSpec(new_docs(tmp_path / "m.parquet")), FakeEncoder())  # free again afterwards


@case("faults", "`retrieval search` processes in a loop while `add` publishes three times", "zero failed searches")
def test_searches_while_add_publishes(copy: Path, tmp_path: Path, tiny_bert: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RETRIEVAL_INDEX_ROOT": str(tmp_path / "root")}
    loop = (
        "import sys, time\nfrom retrieval.search import Searcher, SearchParams\nfails = runs = 0\n"
        "end = time.monotonic() + float(sys.argv[2])\nwhile time.monotonic() < end:\n"
        "    try:\n        Searcher.load(sys.argv[1], verify='quick').search('document', SearchParams(k=3))\n"
        "        runs += 1\n"
        "    except Exception as err:\n        fails += 1; print(repr(err), file=sys.stderr)\nprint(runs, fails)"
    )
    searcher = subprocess.Popen(
        [sys.executable, "-c", loop, str(copy), "25"], stdout=subprocess.PIPE, text=True, env=env
    )
    for i in range(3):
        update.add(copy, CorpusSpec(new_docs(tmp_path / f"n{i}.parquet", prefix=f"n{i}-")))
    out, _ = searcher.communicate(timeout=120)
    runs, fails = map(int, out.split())
    assert fails == 0 and runs > 3


# ----- safety ------------------------------------------------------------------------------------------------
@case(
    "safety",
    "`--out .`, `--out /` or a home-like folder of files, with --overwrite",
    "refused in one line; nothing touched",
)
def test_overwrite_never_takes_a_folder_that_is_not_an_index(tiny_bert: Path, tmp_path: Path, monkeypatch) -> None:
    corpus = write_corpus(tmp_path / "c.parquet", n=20)
    home = tmp_path / "home"
    (home / ".config").mkdir(parents=True)
    (home / "thesis.tex").write_text("years")
    monkeypatch.chdir(home)
    for target in (".", "/", str(home)):
        one_line(run("index", corpus, "--model", tiny_bert, "--out", target, "--overwrite"), "not a retrieval index")
    assert (home / "thesis.tex").read_text() == "years" and sorted(p.name for p in home.iterdir()) == [
        ".config",
        "thesis.tex",
    ]


@case(
    "safety", "`--out` naming an existing file, with or without --overwrite", "refused in one line; the file untouched"
)
def test_out_is_a_file(tiny_bert: Path, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.parquet", n=20)
    (tmp_path / "f").write_text("keep")
    one_line(run("index", corpus, "--model", tiny_bert, "--out", tmp_path / "f"), "already exists")
    one_line(run("index", corpus, "--model", tiny_bert, "--out", tmp_path / "f", "--overwrite"), "is a file")
    assert (tmp_path / "f").read_text() == "keep" and leftovers(tmp_path / "f") == []


@case(
    "options",
    "the default-index pointer cannot be written (`RETRIEVAL_INDEX_ROOT` is a file, a read-only working directory)",
    "the build succeeds (exit 0) with one warning naming `--index DIR`; the index is complete",
)
def test_a_pointer_that_cannot_be_written_is_a_warning(tiny_bert: Path, tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("RETRIEVAL_INDEX_ROOT", str(tmp_path / "afile"))
    corpus = write_corpus(tmp_path / "c.parquet", n=20)
    result = run("index", corpus, "--model", tiny_bert, "--out", tmp_path / "idx")
    assert result.exit_code == 0, result.stderr
    assert "could not be recorded as the default index" in result.stderr and "Traceback" not in result.stderr
    assert Manifest.load(tmp_path / "idx").n == 20 and leftovers(tmp_path / "idx") == []


@case(
    "safety",
    "pickle, allow_pickle=True, trust_remote_code anywhere in the package",
    "none: .npz/.npy/Arrow/FAISS files only; model code never runs",
)
def test_no_pickle_and_no_remote_code() -> None:
    source = "\n".join(p.read_text() for p in (ROOT / "retrieval").glob("*.py"))
    assert not re.search(
        r"^\s*import pickle|^\s*from pickle|allow_pickle\s*=\s*True|trust_remote_code\s*=\s*True", source, re.M
    )
    assert len(re.findall(r"allow_pickle=False", source)) >= 4


@case(
    "safety",
    "rich markup ([/], [/bold]) in a query, a document or an index path",
    "shown literally; never a MarkupError",
)
def test_markup_is_never_interpreted(tiny_bert: Path, tmp_path: Path) -> None:
    rows = ["closing tag [/] here", "[/bold] and [red]x[/red]", *texts(20)]
    corpus = table_file(tmp_path / "c.parquet", id=[f"d{i}" for i in range(22)], text=rows)
    out = tmp_path / "in[/]dex[/bold]"
    result = ok(build_from(tiny_bert, corpus, out))
    assert str(out) in result.stderr
    shown = ok(run("search", "[/bold] query [/]", "--index", out, "-k", 22)).stdout
    assert "[/] here" in shown and "[/bold]" in shown and "[red]x[/red]" in shown
    one_line(run("search", "x", "--index", tmp_path / "no[/]such"), "no index directory", "no[/]such")


def test_the_docs_table_is_this_registry() -> None:
    """docs/reliability.md's table is generated from the cases above (python tests/test_reliability.py --table)."""
    page = (ROOT / "docs" / "reliability.md").read_text()
    assert table() in page, "regenerate: python tests/test_reliability.py --table"
    assert len(CASES) >= 40


if __name__ == "__main__":
    if sys.argv[1:2] == ["writer"]:
        sys.exit(writer(sys.argv[2:]))
    if sys.argv[1:2] == ["--table"]:
        print(table(), end="")
