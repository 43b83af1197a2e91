"""Reliability, bad input: corpora, texts, ids, vectors, query and pair files a build or an evaluation is given."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from conftest import ROOT, FakeEncoder, write_corpus
from reliability import (
    PAIRS,
    QRELS,
    QUERIES,
    build_from,
    case,
    leftovers,
    ok,
    one_line,
    run,
    snapshot,
    table_file,
    texts,
)

from retrieval import update
from retrieval.build import build_index
from retrieval.corpus import CorpusSpec
from retrieval.indexdir import IndexDir
from retrieval.search import Searcher, SearchParams
from retrieval.whitening import TransformSpec


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


@pytest.mark.process
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
