"""Options declared once: the specs' fields give the command line's options, /info and the docs' tables."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from conftest import ROOT, FakeEncoder, write_corpus
from typer.testing import CliRunner

from retrieval.build import BuildOptions, build_index
from retrieval.cli.app import app
from retrieval.corpus import CorpusSpec
from retrieval.fusion import FusionSpec
from retrieval.index import IndexSpec
from retrieval.options import described, markdown_table
from retrieval.search import SearchParams
from retrieval.whitening import TransformSpec

runner = CliRunner()


def flags(command: list[str]) -> str:
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "400", "TERMINAL_WIDTH": "400"})
    assert result.exit_code == 0, result.output
    return " ".join(result.output.replace("│", " ").split())  # one line: rich wraps help over several


def flag_of(item) -> str:  # type: ignore[no-untyped-def]
    return (item.metadata.get("flag_decls") or ["--" + item.name.replace("_", "-")])[0].split("/")[0]


def _serve_options() -> type:
    pytest.importorskip("fastapi")
    from retrieval.serve.service import ServeOptions

    return ServeOptions


SPECS = {
    "serve": (lambda: _serve_options(), [["serve"]]),
    "transform": (lambda: TransformSpec, [["index"], ["refit"]]),
    "index": (lambda: IndexSpec, [["index"], ["refit"]]),
    "build": (lambda: BuildOptions, [["index"]]),
    "search": (lambda: SearchParams, [["search"], ["eval", "ir"]]),
    "fusion": (lambda: FusionSpec, [["search"], ["eval", "ir"]]),
}


@pytest.mark.parametrize("name", SPECS)
def test_each_documented_field_is_an_option_of_its_commands_with_its_help(name: str) -> None:
    spec, commands = SPECS[name][0](), SPECS[name][1]
    for command in commands:
        shown = flags(command)
        for item in described(spec):
            if item.metadata.get("cli") is False:
                assert flag_of(item) not in shown.split()
                continue
            assert flag_of(item) in shown, (command, flag_of(item))
            assert " ".join(item.help.split()) in shown, (command, item.name)  # the field's own help, whole


def test_the_options_main_gained_are_declared_once_too() -> None:
    """codes, rotation, rerank, stash dtype, lexical, columns, mode, fusion, fusion weight and where: fields with
    help."""
    columns = {item.name for item in described(CorpusSpec)}
    assert columns == {"columns"} and "--columns" in flags(["index"])
    assert {"codes", "rotation", "rerank"} <= {item.name for item in described(IndexSpec)}
    assert {"stash_dtype", "lexical"} <= {item.name for item in described(BuildOptions)}
    assert {item.name for item in described(SearchParams)} == {"mode", "rerank", "where"}
    assert [flag_of(item) for item in described(FusionSpec)] == ["--fusion", "--fusion-weight"]
    lexical = next(item for item in described(BuildOptions) if item.name == "lexical")
    assert (lexical.type, lexical.default) == ("bool", True)  # as the command line reads it: a flag


def test_eval_sts_takes_the_transform_options_it_needs_from_the_spec() -> None:
    shown = flags(["eval", "sts"])
    assert "--dim" in shown and "--gamma" in shown and "--epsilon" not in shown


def test_refit_keeps_what_it_is_not_given() -> None:
    shown = flags(["refit"])
    assert "Output dimension: whitens down to it. [default: keep]" in shown


def test_the_markdown_table_has_one_row_per_documented_field() -> None:
    serve_options = _serve_options()
    table = markdown_table(serve_options).splitlines()
    assert table[0] == "| option | type | default | meaning |"
    names = [item.name for item in described(serve_options)]
    assert len(table) == 2 + len(names)
    assert table[2].startswith("| `--max-batch` | `int` | `32` | Micro-batching")
    assert any(row.startswith("| `max_rescore` |") for row in table)  # not a flag: named as the field is
    assert "| `--torch-threads` | `str` | `auto` |" in markdown_table(serve_options)  # as the command line reads it
    assert "`int \\| None`" in markdown_table(TransformSpec)  # a | in a type does not split the row
    documented = {field.name for field in dataclasses.fields(serve_options) if "help" in field.metadata}
    assert documented == set(names) and "verify" not in documented


def test_a_field_s_help_is_the_same_in_help_in_info_and_in_the_docs(tmp_path: Path) -> None:
    """One ServeOptions field: its help is what `serve --help` prints, what /info says of it, and what the serving
    page's generated table holds. Changing the field changes all three."""
    serve_options = _serve_options()
    from fastapi.testclient import TestClient

    from retrieval.serve.app import create_app
    from retrieval.serve.service import Service

    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    import options_tables

    corpus = write_corpus(tmp_path / "c.parquet", n=50)
    build_index(CorpusSpec(corpus), FakeEncoder(), tmp_path / "idx", TransformSpec(dim=8))
    service = Service(tmp_path / "idx", serve_options(watch_interval=0, max_k=7), encoder=FakeEncoder())
    with TestClient(create_app(service, manage=False)) as client:
        info = client.get("/info").json()["server"]
    page = options_tables.tables((ROOT / "docs" / "serving.md").read_text())
    help_text = flags(["serve"])
    for item in described(serve_options):
        assert info["options"][item.name]["help"] == item.help
        assert f"| {item.help} |" in page, item.name
        if item.metadata.get("cli", True):
            assert " ".join(item.help.split()) in help_text, item.name
    assert info["options"]["max_k"] == {"value": 7, "default": 100, "help": "Hits per query."}
    assert info["limits"]["max_k"] == 7 and info["limits"]["max_ef_nprobe"] == 4096
    assert "<!-- options:" not in page  # every marker became its table
