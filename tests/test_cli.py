"""The command line on the real transformers path (the tiny random BERT as --model): index, search, info,
help text, and every bad input from issue 2 giving one clear line on stderr, a non-zero exit, nothing written."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer
from conftest import write_corpus
from typer.testing import CliRunner, Result

from retrieval.cli.app import app
from retrieval.cli.shell import safe

runner = CliRunner()


def run(*args: str | Path) -> Result:
    return runner.invoke(app, [str(a) for a in args])


def stderr_lines(result: Result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


def assert_one_clear_error(result: Result, *fragments: str) -> str:
    """Exit 1, exactly one non-empty line on stderr, no traceback, nothing on stdout; returns the line."""
    lines = stderr_lines(result)
    assert result.exit_code == 1, (result.exit_code, result.output, result.exception)
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.output and result.stdout == ""
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def assert_nothing_written(root: Path) -> None:
    """No index, no hidden work directory, no default-index pointer under the index root."""
    found = sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []
    assert found == []


@pytest.fixture(scope="module")
def built(tiny_bert: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One index built through the CLI, shared by the read-only tests (module-scoped: set the index root
    here too, since the autouse isolated_home fixture is not active yet when this runs)."""
    root = tmp_path_factory.mktemp("cli")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RETRIEVAL_INDEX_ROOT", str(root / "indexes"))
        corpus = write_corpus(root / "corpus.parquet", n=200)
        result = run("index", corpus, "--model", tiny_bert, "--dim", 8, "--out", root / "idx")
        assert result.exit_code == 0, result.output
    yield root / "idx"


# ----- the happy path --------------------------------------------------------------------------------------
def test_index_then_search_uses_the_last_built_index(tiny_bert: Path, corpus: Path, isolated_home: Path) -> None:
    result = run("index", corpus, "--model", tiny_bert, "--dim", 8, "--precision", "fp32")
    assert result.exit_code == 0, result.output
    out = isolated_home / "corpus"
    assert (out / "manifest.json").is_file()
    assert "built " in result.stderr and "300 rows, 32 -> 8 dims" in result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["encoder"]["model_path"] == str(tiny_bert.resolve())
    assert (manifest["encoder"]["pooling"], manifest["encoder"]["precision"]) == ("mean", "fp32")
    assert (manifest["transform"]["d"], manifest["transform"]["dim"], manifest["index"]["ntotal"]) == (32, 8, 300)

    result = run("search", "document number 42 about topic 0", "-k", 3, "--json")
    assert result.exit_code == 0, result.output
    hits = [json.loads(line) for line in result.stdout.splitlines()]
    assert [h["rank"] for h in hits] == [1, 2, 3]
    assert set(hits[0]) == {"rank", "id", "score", "text"}
    # the document's own text finds itself, with cosine 1 up to float32 rounding
    assert hits[0]["id"] == "doc42" and hits[0]["text"] == "document number 42 about topic 0"
    assert hits[0]["score"] == pytest.approx(1.0, abs=1e-5)


def test_search_prints_a_table(built: Path) -> None:
    result = run("search", "document number 7 about topic 0", "--index", built, "-k", 2)
    assert result.exit_code == 0, result.output
    header = next(line for line in result.stdout.splitlines() if "rank" in line)
    assert all(name in header for name in ("rank", "score", "id", "text"))
    rows = [line for line in result.stdout.splitlines() if "│ doc" in line]
    # the document's own text first; cosine 1 up to bf16 rounding where `--precision auto` encoded it in bf16
    assert len(rows) == 2 and "doc7 " in rows[0] and float(rows[0].split("│")[2]) >= 0.9999


def test_a_narrow_terminal_shows_whole_scores_and_ids(built: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At 30 columns the id and score columns were cut to "d…" and "0…": ids that could not be read."""
    import io

    from rich.console import Console

    import retrieval.cli.search as cli

    narrow = Console(width=30, file=io.StringIO(), highlight=False)
    monkeypatch.setattr(cli, "out", narrow)
    result = run("search", "document number 117 about topic 5", "--index", built, "-k", 1)
    assert result.exit_code == 0, result.output
    rows = [line.split("│") for line in narrow.file.getvalue().splitlines() if line.startswith("│")]
    assert re.fullmatch(r" +1 ", rows[0][1]) and re.fullmatch(r" +[01]\.\d{4} ", rows[0][2])
    assert "".join(row[3].strip() for row in rows) == "doc117"  # folded over lines, every character shown


def test_search_json_is_one_object_per_line(built: Path) -> None:
    result = run("search", "topic 3", "--index", built, "-k", 5, "--json")
    assert result.exit_code == 0, result.output
    hits = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(hits) == 5 and [h["rank"] for h in hits] == [1, 2, 3, 4, 5]
    scores = [h["score"] for h in hits]
    assert scores == sorted(scores, reverse=True)


QUERIES = ["document number 7 about topic 0", "topic 3", "document number 150 about topic 3", "nothing like it"]


def assert_hits_of_each_query(lines: list[str], ids: list[str], built: Path, k: int) -> None:
    """JSON lines of a --queries search: k hits per query, in file order, each as the library finds it alone."""
    from retrieval.search import Searcher, SearchParams

    hits = [json.loads(line) for line in lines]
    assert [h["query_id"] for h in hits] == [i for i in ids for _ in range(k)]
    searcher = Searcher.load(built)
    for n, query in enumerate(QUERIES):
        alone = searcher.search(query, SearchParams(k=k))
        got = hits[n * k : (n + 1) * k]
        assert [h["id"] for h in got] == [h.id for h in alone] and [h["rank"] for h in got] == list(range(1, k + 1))
        # hybrid (the default) scores are min-max scaled over each side's candidates, which turns the encoder's
        # batch-against-single rounding (~1e-5 in a cosine) into ~1e-3: the same hits, in the same order
        assert [h["score"] for h in got] == pytest.approx([h.score for h in alone], abs=5e-3)


def test_search_every_query_of_a_text_file(built: Path, tmp_path: Path) -> None:
    """One query per line (CRLF too), blank lines skipped, ids the line numbers; hits as each query alone."""
    path = tmp_path / "q.txt"
    path.write_bytes(f"\ufeff{QUERIES[0]}\n\n  \n{QUERIES[1]}\r\n{QUERIES[2]}\n{QUERIES[3]}".encode())  # BOM too
    result = run("search", "--queries", path, "--index", built, "-k", 3, "--json")
    assert result.exit_code == 0, result.output
    assert_hits_of_each_query(result.stdout.splitlines(), ["1", "4", "5", "6"], built, 3)

    stdin = runner.invoke(
        app, ["search", "--queries", "-", "--index", str(built), "-k", "3", "--json"], "\n".join(QUERIES)
    )
    assert stdin.exit_code == 0, stdin.output
    assert_hits_of_each_query(stdin.stdout.splitlines(), ["1", "2", "3", "4"], built, 3)

    table = run("search", "--queries", path, "--index", built, "-k", 2)
    titles = [line.strip() for line in table.stdout.splitlines() if line.strip().startswith(("1:", "4:", "5:", "6:"))]
    assert table.exit_code == 0 and titles == [f"{n}: {q!r}" for n, q in zip([1, 4, 5, 6], QUERIES, strict=True)]


def test_search_every_query_of_a_parquet(built: Path, tmp_path: Path) -> None:
    with_ids = tmp_path / "q.parquet"
    pq.write_table(pa.table({"query_id": [10, 11, 12, 13], "question": QUERIES}), with_ids)
    result = run("search", "--queries", with_ids, "--text-column", "question", "--index", built, "-k", 2, "--json")
    assert result.exit_code == 0, result.output
    assert_hits_of_each_query(result.stdout.splitlines(), ["10", "11", "12", "13"], built, 2)
    without = tmp_path / "rows.PQ"  # parquet by its first bytes, whatever the name
    pq.write_table(pa.table({"text": QUERIES}), without)
    result = run("search", "--queries", without, "--index", built, "-k", 2, "--json")
    assert result.exit_code == 0, result.output
    assert_hits_of_each_query(result.stdout.splitlines(), ["0", "1", "2", "3"], built, 2)
    # pandas writes a categorical column as a dictionary of strings; arrow also has a string_view layout
    for layout, column in [
        ("dictionary", pa.array(QUERIES).dictionary_encode()),
        ("view", pa.array(QUERIES, pa.string_view())),
    ]:
        pq.write_table(pa.table({"query_id": ["a", "b", "c", "d"], "text": column}), tmp_path / f"{layout}.parquet")
        result = run("search", "--queries", tmp_path / f"{layout}.parquet", "--index", built, "-k", 2, "--json")
        assert result.exit_code == 0, (layout, result.output)
        assert_hits_of_each_query(result.stdout.splitlines(), ["a", "b", "c", "d"], built, 2)


def test_a_query_file_is_read_in_chunks_and_checked_whole_first(built: Path, tmp_path: Path) -> None:
    """600 queries come out in file order across chunks of 256; a bad line past the first chunk is refused
    before any hit is printed (the file is checked in one streamed pass, then read again chunk by chunk)."""
    lines = [f"document number {i % 200} about topic {i % 200 % 7}" for i in range(600)]  # the docs texts
    (tmp_path / "many.txt").write_text("\n".join(lines) + "\n")
    result = run("search", "--queries", tmp_path / "many.txt", "--index", built, "-k", 1, "--json")
    assert result.exit_code == 0, result.output
    hits = [json.loads(line) for line in result.stdout.splitlines()]
    assert [h["query_id"] for h in hits] == [str(i) for i in range(1, 601)]
    assert [h["id"] for h in hits[:3]] == ["doc0", "doc1", "doc2"] and hits[599]["id"] == "doc199"
    (tmp_path / "late.txt").write_bytes(("\n".join(lines[:400]) + "\n\xff\n").encode("latin-1"))
    assert_one_clear_error(run("search", "--queries", tmp_path / "late.txt", "--index", built), "line 401 of")


def test_bad_query_files_are_one_line(built: Path, tmp_path: Path) -> None:
    (tmp_path / "bad.txt").write_bytes(b"fine\n\xff\xfe not utf-8\n")
    (tmp_path / "blank.txt").write_text("\n  \n")
    pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "null.parquet")
    pq.write_table(pa.table({"query": ["a"]}), tmp_path / "column.parquet")
    (tmp_path / "q.npy").write_bytes(b"\x93NUMPY")
    # hits are printed under their query id, so two queries under one id could not be told apart
    pq.write_table(
        pa.table({"query_id": [f"q{i}" for i in range(300)] + ["q7"], "text": ["a"] * 301}), tmp_path / "twice.parquet"
    )
    (tmp_path / "lines.txt").write_text("one query\n")
    cases = [
        (["x", "--queries", tmp_path / "blank.txt"], "give a QUERY or --queries (a file of queries), not both"),
        ([], "give a QUERY to search for, or --queries"),
        (["--queries", tmp_path / "nope.txt"], "queries file not found"),
        (["--queries", tmp_path / "bad.txt"], "line 2 of"),
        (["--queries", tmp_path / "blank.txt"], "holds no query"),
        (["--queries", tmp_path / "null.parquet"], "query 1 of"),
        (["--queries", tmp_path / "column.parquet"], "has no column 'text' (columns: query)"),
        (["--queries", tmp_path / "q.npy"], "is a .npy: --queries takes query texts"),
        (["--queries", tmp_path / "twice.parquet"], "query id 'q7' appears more than once in"),
        (
            ["--queries", tmp_path / "lines.txt", "--text-column", "q"],
            "one query per line: --text-column applies to a parquet",
        ),
    ]
    for args, fragment in cases:
        assert_one_clear_error(run("search", *args, "--index", built), fragment)


def test_info_shows_what_the_index_holds(built: Path, tiny_bert: Path) -> None:
    result = run("info", built)
    assert result.exit_code == 0, result.output
    for fragment in ("32 -> 8", "whitening", "mean", "200", "spectrum", str(tiny_bert)):
        assert fragment in result.stdout, fragment
    result = run("info", built, "--json", "--verify")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["manifest"]["transform"]["dim"] == 8 and report["manifest"]["index"]["ntotal"] == 200
    assert len(report["spectrum"]["top"]) == 10


def command_paths(group: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path, sub-commands included (typer vendors click: groups are known by their commands)."""
    paths = []
    for name, command in group.commands.items():
        paths.append((*prefix, name))
        if hasattr(command, "commands"):
            paths += command_paths(command, (*prefix, name))
    return paths


COMMANDS = command_paths(typer.main.get_command(app))  # type: ignore[arg-type]


def test_the_core_commands_exist() -> None:
    assert {("index",), ("search",), ("info",), ("demo",), ("eval", "ir"), ("eval", "sts")} <= set(COMMANDS)


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_every_command_has_help_text(path: tuple[str, ...]) -> None:
    command: Any = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]  # type: ignore[attr-defined]
    assert (command.help or "").strip(), f"{' '.join(path)} has no docstring"
    result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "400"})  # wide: no help text cut short
    assert result.exit_code == 0, result.output
    assert command.help.strip().splitlines()[0][:40] in " ".join(result.stdout.split())
    for param in command.params:
        if param.param_type_name == "option" and param.name != "help":  # typer vendors click: no isinstance
            assert (param.help or "").strip(), f"{' '.join(path)} {param.opts[0]} has no help"
            # Rich markup would swallow an unescaped "[default: ...]": every word of the help must be shown.
            shown = re.sub(r"[\s│]+", "", result.stdout)
            assert re.sub(r"\s+", "", param.help.replace("\\[", "[")) in shown, param.opts[0]


# ----- bad input: one clear line, exit 1, nothing written --------------------------------------------------
def write(path: Path, **columns: list) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


BAD_CORPORA = {
    "missing file": (lambda d: d / "absent.parquet", [], ["corpus file not found"]),
    "not parquet": (lambda d: _text(d / "bad.parquet", "id,text\n1,hello\n"), [], ["not a readable parquet file"]),
    "missing text column": (
        lambda d: write(d / "c.parquet", id=["a", "b"], body=["x", "y"]),
        [],
        ["no column 'text'", "columns: id, body", "--text-column"],
    ),
    "missing id column": (
        lambda d: write(d / "c.parquet", text=["x", "y"]),
        ["--id-column", "doc_id"],
        ["no column 'doc_id'", "columns: text"],
    ),
    "empty texts": (
        lambda d: write(d / "c.parquet", id=["a", "b", "c", "d"], text=["x", None, "", "y"]),
        [],
        ["2 of 4 rows have null or empty text", "first ids: b, c", "--skip-empty"],
    ),
    "duplicate ids": (
        lambda d: write(d / "c.parquet", id=["a", "b", "a"], text=["x", "y", "z"]),
        [],
        ["duplicate id 'a'"],
    ),
    "empty corpus": (
        lambda d: write(d / "c.parquet", id=pa.array([], pa.string()), text=pa.array([], pa.string())),
        [],
        ["holds no rows"],
    ),
    "one row": (lambda d: write(d / "c.parquet", id=["a"], text=["x"]), [], ["at least 2 are needed"]),
    "dim 0": (lambda d: write_corpus(d / "c.parquet", n=20), ["--dim", "0"], ["--dim must be at least 1 (got 0)"]),
    "dim above d": (
        lambda d: write_corpus(d / "c.parquet", n=20),
        ["--dim", "33"],
        ["--dim must be between 1", "dimension 32 (got 33)"],
    ),
    "unknown pooling": (
        lambda d: write_corpus(d / "c.parquet", n=20),
        ["--pooling", "max"],
        ["unknown --pooling 'max'"],
    ),
}


def _text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", list(BAD_CORPORA))
def test_bad_input_to_index(case: str, tiny_bert: Path, tmp_path: Path, isolated_home: Path) -> None:
    make, options, fragments = BAD_CORPORA[case]
    source = tmp_path / "src"
    source.mkdir()
    corpus = make(source)
    result = run("index", corpus, "--model", tiny_bert, *options)
    assert_one_clear_error(result, *fragments)
    assert_nothing_written(isolated_home)


def test_skip_empty_builds_and_says_how_many(tiny_bert: Path, tmp_path: Path, isolated_home: Path) -> None:
    texts = [f"document number {i}" for i in range(30)]
    texts[4] = None
    corpus = write(tmp_path / "c.parquet", id=[f"d{i}" for i in range(30)], text=texts)
    result = run("index", corpus, "--model", tiny_bert, "--dim", 4, "--skip-empty")
    assert result.exit_code == 0, result.output
    assert "skipping 1 of 30 rows" in result.stderr and "29 rows" in result.stderr


def test_unknown_model_says_how_to_install_the_default(corpus: Path, isolated_home: Path) -> None:
    pytest.importorskip("torch")
    result = run("index", corpus, "--model", "no-such-org/no-such-model")
    assert_one_clear_error(result, "cannot load model 'no-such-org/no-such-model'", "pip install")
    assert_nothing_written(isolated_home)


def test_existing_index_needs_overwrite(built: Path, tiny_bert: Path, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.parquet", n=20)
    before = (built / "manifest.json").read_bytes()
    result = run("index", corpus, "--model", tiny_bert, "--out", built)
    assert_one_clear_error(result, "already exists", "--overwrite")
    assert (built / "manifest.json").read_bytes() == before


def test_overwrite_refuses_a_folder_of_user_files(tiny_bert: Path, tmp_path: Path, isolated_home: Path) -> None:
    corpus = write_corpus(tmp_path / "c.parquet", n=20)
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    result = run("index", corpus, "--model", tiny_bert, "--out", folder, "--overwrite")
    assert_one_clear_error(result, "not a retrieval index", "--overwrite only replaces")
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    assert (folder / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["search", "x", "-k", "abc"], "Invalid value for '-k'"),
        (["index"], "Missing argument 'corpus'"),
        (["search", "x", "--no-such-option"], "No such option: --no-such-option"),
        (["index", "c.parquet", "--gamma", "half"], "Invalid value for '--gamma'"),
    ],
)
def test_usage_errors_are_one_line_too(args: list[str], fragment: str) -> None:
    """typer's own usage errors (wrong type, missing argument, unknown option): one line and exit 2, not a
    usage box or a traceback."""
    result = run(*args)
    lines = stderr_lines(result)
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], lines
    assert "Traceback" not in result.output


def test_search_with_no_index_built(isolated_home: Path) -> None:
    assert_one_clear_error(run("search", "anything"), "no index has been built yet", "or pass --index DIR")
    # each command says how it names another directory: info and serve take it as an argument, not --index
    assert_one_clear_error(run("info"), "no index has been built yet", "or name it: `retrieval info DIR`")
    if importlib.util.find_spec("fastapi") is not None:  # without the [server] extra, serve says that first
        assert_one_clear_error(run("serve"), "no index has been built yet", "or name it: `retrieval serve DIR`")
    assert_nothing_written(isolated_home)


def test_search_when_the_last_built_index_was_moved_away(isolated_home: Path) -> None:
    """It said "no index directory at .../lb; build one", as if the user had named that folder."""
    isolated_home.mkdir(parents=True)
    (isolated_home / ".last-built").write_text("lb\n")
    line = assert_one_clear_error(run("search", "anything"), "the default index (the last one built", "is gone from")
    assert "pass --index DIR to use another index" in line and "retrieval index CORPUS" in line


def test_search_a_missing_directory(tmp_path: Path) -> None:
    assert_one_clear_error(run("search", "anything", "--index", tmp_path / "nope"), "no index directory")


def test_search_a_corrupt_index(built: Path, tmp_path: Path) -> None:
    import shutil

    copy = Path(shutil.copytree(built, tmp_path / "copy"))
    data = bytearray((copy / "index.faiss").read_bytes())
    data[-10] ^= 0xFF
    (copy / "index.faiss").write_bytes(bytes(data))
    assert_one_clear_error(run("search", "anything", "--index", copy), "index.faiss", "checksum mismatch")
    assert_one_clear_error(run("info", copy, "--verify"), "checksum mismatch")


def test_search_a_truncated_index(built: Path, tmp_path: Path) -> None:
    import shutil

    copy = Path(shutil.copytree(built, tmp_path / "copy"))
    (copy / "transform.npz").write_bytes((copy / "transform.npz").read_bytes()[:50])
    assert_one_clear_error(run("search", "anything", "--index", copy), "transform.npz", "truncated")


def test_search_k_below_one(built: Path) -> None:
    assert_one_clear_error(
        run("search", "anything", "--index", built, "-k", "0"), "-k must be an integer between 1 and 10,000 (got 0)"
    )


def test_terminal_text_escapes_controls_and_keeps_text() -> None:
    """Controls, separators and bidi overrides are escaped; every kind of space and the joiners inside emoji
    sequences and Persian words are text (str.isprintable escaped them: "Prix\\xa0: 10\\u202f€")."""
    kept = "Prix\u00a0: 10\u202f€ 日本\u3000語 👨\u200d👩\u200d👧 می\u200cخواهم soft\u00adhyphen \u200fRLM\nline\ttab"
    assert safe(kept) == kept
    assert safe("a\r\x1b[31mred\x00\x07") == "a\\r\\x1b[31mred\\x00\\x07"
    assert safe("x\u202eevil\u2066y\u2028z\x85\ud800") == "x\\u202eevil\\u2066y\\u2028z\\x85\\ud800"


def test_version_is_printed() -> None:
    from retrieval import __version__

    result = run("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"retrieval {__version__}"


def test_serve_without_the_server_extra_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The advice was `pip install -e '.[server]'`, which works only inside a checkout."""
    import sys

    import retrieval.serve

    monkeypatch.delattr(retrieval.serve, "app", raising=False)
    monkeypatch.delitem(sys.modules, "retrieval.serve.app", raising=False)
    monkeypatch.setitem(sys.modules, "fastapi", None)
    assert_one_clear_error(
        run("serve", tmp_path),
        "the server needs its extra (fastapi is missing): pip install 'retrieval[server]'",
        "(from a checkout: pip install -e '.[server]')",
    )


def test_an_index_too_big_to_train_is_refused_before_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A product quantizer of 8 bits needs 256 training rows and IVF lists one row each: a corpus of 100 rows is
    refused in one line before any model is loaded (seconds) or any row encoded, and nothing is written."""
    from retrieval.encode.spec import EncoderSpec

    def no_model(self: object) -> None:
        raise AssertionError("the model was loaded before the index type was checked")

    monkeypatch.setattr(EncoderSpec, "load", no_model)
    model = tmp_path / "model"  # a local model whose config states its width (the default may not be installed)
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 384}')
    corpus = write_corpus(tmp_path / "c.parquet", n=100)
    for kind, message in (
        ("IVF16,PQ8", "a product quantizer of 8 bits needs at least 256 training rows (got 100)"),
        ("ivf", "IVF with"),
    ):
        out = tmp_path / "idx"
        extra = ["--nlist", "200"] if kind == "ivf" else []
        result = run("index", corpus, "--out", out, "--model", model, "--index-type", kind, "--dim", "64", *extra)
        assert result.exit_code == 1, result.output
        assert message in result.output and len(result.output.strip().splitlines()) == 1, result.output
        assert not out.exists()
