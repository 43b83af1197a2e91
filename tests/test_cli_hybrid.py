"""--lexical, --columns, --mode and --where on the command line, and mode and filter on HTTP /search: results that
obey them, and one clear line (a 422 JSON over HTTP) naming each bad filter, mode or column."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import FakeEncoder
from test_cli import assert_nothing_written, assert_one_clear_error, run

from retrieval.build import BuildOptions, build_index
from retrieval.corpus import CorpusSpec
from retrieval.whitening import TransformSpec

N = 120


def corpus(path: Path) -> Path:
    rng = np.random.default_rng(0)
    words = "cell gene protein tumour study river music".split()
    table = pa.table(
        {
            "id": [f"doc{i}" for i in range(N)],
            "text": [" ".join(rng.choice(words, size=5)) + f" number {i}" for i in range(N)],
            "year": pa.array([2000 + i % 25 for i in range(N)], pa.int32()),
            "source": ["pubmed" if i % 3 else "arxiv" for i in range(N)],
        }
    )
    pq.write_table(table, path)
    return path


@pytest.fixture(scope="module")
def built(tiny_bert: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("cli-hybrid")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RETRIEVAL_INDEX_ROOT", str(root / "indexes"))
        source = corpus(root / "c.parquet")
        result = run("index", source, "--model", tiny_bert, "--columns", "year,source", "--out", root / "idx")
        assert result.exit_code == 0, result.output
        yield root / "idx"


def hit_ids(output: str) -> list[int]:
    import json

    return [int(json.loads(line)["id"].removeprefix("doc")) for line in output.splitlines() if line.startswith("{")]


def test_where_and_mode_on_search(built: Path) -> None:
    for mode in ("dense", "lexical", "hybrid"):
        result = run(
            "search", "gene protein", "--index", built, "--mode", mode, "--where",
            "year >= 2020 and source = 'pubmed'", "-k", 50, "--json",
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        rows = hit_ids(result.stdout)
        assert rows and all(2000 + i % 25 >= 2020 and i % 3 for i in rows), (mode, rows)


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (("--where", "venue = 'x'"), ("no column 'venue'", "year, source")),
        (("--where", "year >= "), ("expected a value",)),
        (("--where", "year = 'x'"), ("column 'year' holds int32",)),
        (("--mode", "sparse"), ("unknown --mode 'sparse'",)),
        (("--fusion", "sum"), ("unknown --fusion 'sum'",)),
        (("--fusion-weight", "3"), ("--fusion-weight must be between 0 and 1",)),
    ],
)
def test_bad_filters_and_modes_are_one_line(built: Path, args: tuple[str, ...], fragments: tuple[str, ...]) -> None:
    assert_one_clear_error(run("search", "gene", "--index", built, *args), *fragments)


def test_eval_ir_takes_mode_and_where(built: Path, tmp_path: Path) -> None:
    pq.write_table(pa.table({"query_id": ["q1"], "text": ["number 77"]}), tmp_path / "q.parquet")
    pq.write_table(pa.table({"query_id": ["q1"], "doc_id": ["doc77"], "score": [1]}), tmp_path / "r.parquet")
    common = ("eval", "ir", built, "--queries", tmp_path / "q.parquet", "--qrels", tmp_path / "r.parquet", "--json")
    lexical = run(*common, "--mode", "lexical")
    assert lexical.exit_code == 0, lexical.output
    filtered_out = run(*common, "--mode", "lexical", "--where", "year != 2002")  # doc77's year: its hit is gone
    assert filtered_out.exit_code == 0, filtered_out.output
    import json

    assert json.loads(lexical.stdout)["MRR@10"] > 0 and json.loads(filtered_out.stdout)["MRR@10"] == 0


def test_index_columns_and_no_lexical(tiny_bert: Path, tmp_path: Path, isolated_home: Path) -> None:
    source = corpus(tmp_path / "c.parquet")
    result = run("index", source, "--model", tiny_bert, "--columns", "year,venue", "--out", tmp_path / "bad")
    assert_one_clear_error(result, "no column 'venue'")
    assert not (tmp_path / "bad").exists()
    assert_nothing_written(isolated_home)
    result = run("index", source, "--model", tiny_bert, "--no-lexical", "--out", tmp_path / "dense")
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "dense" / "lexical").exists()
    assert_one_clear_error(
        run("search", "gene", "--index", tmp_path / "dense", "--mode", "lexical"), "no lexical index"
    )


# ----- HTTP -----------------------------------------------------------------------------------------------------
@pytest.fixture
def client(tmp_path: Path) -> Iterator:
    pytest.importorskip("fastapi")
    from test_server import serve, wait_ready

    source = corpus(tmp_path / "c.parquet")
    spec = CorpusSpec(source, columns=("year", "source"))
    build_index(spec, FakeEncoder(), tmp_path / "idx", TransformSpec(dim=8))
    build_index(
        CorpusSpec(source), FakeEncoder(), tmp_path / "dense", TransformSpec(dim=8), options=BuildOptions(lexical=None)
    )
    test_client, _ = serve(tmp_path / "idx")
    with test_client:
        wait_ready(test_client)
        yield test_client


def test_http_search_takes_mode_and_a_json_filter(client) -> None:
    where = {
        "and": [{"column": "year", "op": ">=", "value": 2020}, {"column": "source", "op": "in", "value": ["pubmed"]}]
    }
    for mode in ("dense", "lexical", "hybrid"):
        response = client.post("/search", json={"query": "gene protein", "k": 50, "mode": mode, "filter": where})
        assert response.status_code == 200, response.json()
        rows = [int(h["id"].removeprefix("doc")) for h in response.json()["results"][0]["hits"]]
        assert rows and all(2000 + i % 25 >= 2020 and i % 3 for i in rows)
    response = client.get("/search", params={"q": "gene", "where": "source = 'arxiv'", "k": 30})
    assert response.status_code == 200
    assert all(int(h["id"].removeprefix("doc")) % 3 == 0 for h in response.json()["results"][0]["hits"])


def test_info_names_the_modes_and_columns_the_search_page_offers(client) -> None:
    """The search page shows a mode switch and one filter per kept column from these /info fields, and sends
    filters with the operators the filter grammar takes (tests/test_server_page.py checks the page's side)."""
    index = client.get("/info").json()["index"]
    assert index["modes"] == ["dense", "lexical", "hybrid"] and index["default_mode"] == "hybrid"
    assert [(c["name"], c["type"]) for c in index["columns"]] == [("year", "int32"), ("source", "string")]
    page_filter = {
        "and": [{"column": "year", "op": ">=", "value": 2020}, {"column": "source", "op": "=", "value": "x"}]
    }
    assert client.post("/search", json={"query": "gene", "mode": "lexical", "filter": page_filter}).status_code == 200


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"filter": {"column": "venue", "op": "=", "value": 1}}, "filter", "no column 'venue'"),
        ({"filter": {"column": "year", "op": "=", "value": "x"}}, "filter", "holds int32"),
        ({"filter": {"sql": "select 1"}}, "filter", "must be"),
        ({"mode": "sparse"}, "mode", ""),  # refused by the schema: the enum
    ],
)
def test_http_bad_filter_or_mode_is_a_422_naming_it(client, body: dict, param: str, fragment: str) -> None:
    response = client.post("/search", json={"query": "gene", **body})
    assert response.status_code == 422, response.json()
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    response = client.get("/search", params={"q": "gene", "where": "year >="})
    assert response.status_code == 422 and response.json()["error"]["param"] == "where"
