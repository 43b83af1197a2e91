"""Metadata filters: the --where grammar and the JSON form give the same tree, evaluation matches a plain Python
reading of the rows (SQL's nulls), and every bad filter is one FilterError naming the problem."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pyarrow as pa
import pytest

from retrieval.filters import And, Cond, FilterError, Not, Or, evaluate, from_json, parse, to_json

ROWS = [
    {"year": 2019, "source": "pubmed", "open": True, "score": 0.5, "day": dt.date(2019, 3, 1)},
    {"year": 2020, "source": "arxiv", "open": False, "score": 1.5, "day": dt.date(2020, 6, 1)},
    {"year": None, "source": "pubmed", "open": True, "score": 2.5, "day": None},
    {"year": 2022, "source": None, "open": None, "score": None, "day": dt.date(2022, 1, 1)},
    {"year": 2021, "source": "pubmed", "open": False, "score": 3.0, "day": dt.date(2021, 1, 1)},
]
TABLE = pa.Table.from_pylist(ROWS)


def rows_where(test) -> list[bool]:
    """The reference: Python over the rows, a comparison with a null being false (SQL's unknown, then dropped)."""
    out = []
    for row in ROWS:
        try:
            out.append(bool(test(row)))
        except TypeError:  # a comparison with None
            out.append(False)
    return out


@pytest.mark.parametrize(
    ("text", "reference"),
    [
        ("year >= 2020 and source = 'pubmed'", lambda r: r["year"] >= 2020 and r["source"] == "pubmed"),
        ("year >= 2020 or source = 'pubmed'", lambda r: (r["year"] or 0) >= 2020 or r["source"] == "pubmed"),
        ("not (year >= 2021)", lambda r: r["year"] < 2021),
        ("source in ('pubmed', 'x')", lambda r: r["source"] in ("pubmed", "x")),
        ("source not in ('pubmed')", lambda r: r["source"] is not None and r["source"] != "pubmed"),
        ("year is null", lambda r: r["year"] is None),
        ("source IS NOT NULL AND open = true", lambda r: r["source"] is not None and r["open"] is True),
        ("score > 1 and score <= 3", lambda r: 1 < r["score"] <= 3),
        ("year != 2019", lambda r: r["year"] != 2019 and r["year"] is not None),
        ("year > 2019.5", lambda r: r["year"] > 2019.5),
        ("day >= '2020-01-01'", lambda r: r["day"] >= dt.date(2020, 1, 1)),
        ("source = 'it''s'", lambda r: r["source"] == "it's"),
    ],
)
def test_where_evaluates_as_the_rows_read(text: str, reference) -> None:
    assert evaluate(parse(text), TABLE).tolist() == rows_where(reference)


def test_text_and_json_forms_are_one_structure() -> None:
    tree = parse("year >= 2020 and (source in ('a', 'b') or not open = true) and score is not null")
    assert tree == And(
        (
            Cond("year", ">=", 2020),
            Or((Cond("source", "in", ("a", "b")), Not(Cond("open", "=", True)))),
            Cond("score", "is not null"),
        )
    )
    assert from_json(to_json(tree)) == tree
    assert hash(tree) == hash(from_json(to_json(tree)))  # the service groups searches by their parameters
    as_json = {"and": [{"column": "year", "op": ">=", "value": 2020}, {"not": {"column": "score", "op": "is null"}}]}
    assert from_json(as_json) == parse("year >= 2020 and not score is null")


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("year >=", "expected a value"),
        ("year >= 'x'", "column 'year' holds int64"),
        ("foo = 1", "no column 'foo'"),
        ("year = 1 and", "expected a column name"),
        ("(year = 1", "expected ')'"),
        ("year = 1; drop table docs", "cannot read ';"),
        ("source > 3", "column 'source' holds string"),
        ("open = 1", "column 'open' holds bool"),
        ("day > 'not a date'", "cannot be compared with column 'day'"),
        ("", "`where` is empty"),
        ("year", "expected a comparison"),
        ("upper(source) = 'X'", "expected a comparison"),
        ("year in ()", "expected a value"),
    ],
)
def test_bad_where_is_one_line_naming_the_problem(text: str, said: str) -> None:
    with pytest.raises(FilterError, match=None) as err:
        evaluate(parse(text), TABLE)
    assert said in str(err.value) and "\n" not in str(err.value)
    assert err.value.param == "where"


@pytest.mark.parametrize(
    ("data", "said"),
    [
        ([1, 2], "must be an object"),
        ({"and": []}, "non-empty list"),
        ({"column": "year", "op": "~", "value": 1}, "is not one of"),
        ({"column": "year", "op": "in", "value": 3}, "non-empty list"),
        ({"column": "year", "op": "=", "value": {"$gt": 1}}, "string, number or boolean"),
        ({"column": "year", "op": "is null", "value": 1}, "takes no value"),
        ({"sql": "select 1"}, "must be"),
    ],
)
def test_bad_json_filter_is_refused(data, said: str) -> None:
    with pytest.raises(FilterError) as err:
        from_json(data)
    assert said in str(err.value)


def test_an_index_without_columns_names_the_fix() -> None:
    with pytest.raises(FilterError, match="kept no columns"):
        evaluate(parse("year = 1"), None)


def test_a_huge_or_deep_filter_is_refused() -> None:
    with pytest.raises(FilterError, match="more than 1,000 conditions"):
        parse(" or ".join(["y=1"] * 1200))
    with pytest.raises(FilterError, match="nested more than"):
        parse("(" * 3000 + "y = 1" + ")" * 3000)
    with pytest.raises(FilterError, match="nested more than"):
        parse("not " * 2000 + "y = 1")
    deep: dict = {"column": "y", "op": "=", "value": 1}
    for _ in range(3000):
        deep = {"not": deep}
    with pytest.raises(FilterError, match="nested more than"):
        from_json(deep)


def test_evaluate_returns_one_bool_per_row() -> None:
    mask = evaluate(parse("year >= 0"), TABLE)
    assert mask.dtype == np.bool_ and mask.shape == (len(ROWS),)
