"""The HTTP API keeps its own contract: schemathesis generates requests from the served OpenAPI document for every
operation and checks each answer against that same document (all checks: status codes, response schemas, content
types, headers, positive data accepted, negative data rejected, no 5xx). Seeded and bounded, so the run is the
same every time and stays short; scripts/api_contract.py runs the long version before a release."""

from __future__ import annotations

import datetime
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
from conftest import FakeEncoder, write_corpus

pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402

from retrieval.build import build_index  # noqa: E402
from retrieval.corpus import CorpusSpec  # noqa: E402
from retrieval.serve.app import create_app  # noqa: E402
from retrieval.serve.service import ServeOptions, Service  # noqa: E402
from retrieval.whitening import TransformSpec  # noqa: E402

API_KEY = "contract-test-key"
# A column of each kind a filter compares with, and one it can only test for null: the OpenAPI document states the
# filter grammar over these (names, value types), so generated filters reach the server's checks of each.
COLUMNS = {
    "year": pa.int16(),
    "score": pa.float64(),
    "source": pa.string(),
    "open": pa.bool_(),
    "published": pa.date32(),
    "blob": pa.binary(),
}


def metadata(n: int) -> dict[str, pa.Array]:
    values = {
        "year": [1990 + i % 35 for i in range(n)],
        "score": [i / 7 for i in range(n)],
        "source": [("pubmed", "arxiv", "acl")[i % 3] for i in range(n)],
        "open": [i % 2 == 0 for i in range(n)],
        "published": [datetime.date(2000, 1, 1) + datetime.timedelta(days=37 * i) for i in range(n)],
        "blob": [bytes([i % 256]) for i in range(n)],
    }
    # every fifth row without a value: null tests and SQL's unknown get exercised
    return {
        name: pa.array([None if i % 5 == 4 else v for i, v in enumerate(column)], COLUMNS[name])
        for name, column in values.items()
    }


@pytest.fixture(scope="module")
def served_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    root = tmp_path_factory.mktemp("contract")
    n = 120
    corpus = write_corpus(root / "corpus.parquet", n=n, **metadata(n))
    build_index(CorpusSpec(corpus, columns=tuple(COLUMNS)), FakeEncoder(), root / "idx", TransformSpec(dim=8))
    service = Service(root / "idx", ServeOptions(watch_interval=0), encoder=FakeEncoder())
    # The service is started here, not by the app's lifespan: schemathesis' state machine runs the lifespan of the
    # app once per scenario, and its end would stop the service for every test after
    app = create_app(service, api_key=API_KEY, manage=False)
    from fastapi.testclient import TestClient

    service.start()
    try:
        with TestClient(app) as client:
            auth = {"Authorization": f"Bearer {API_KEY}"}
            deadline = time.monotonic() + 30
            while client.get("/ready", headers=auth).status_code != 200:
                assert time.monotonic() < deadline, "the index did not load"
                time.sleep(0.02)
            yield app
    finally:
        service.stop()


@pytest.fixture(scope="module")
def api_schema(served_app: object) -> object:
    return schemathesis.openapi.from_asgi("/openapi.json", served_app)


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.mark.contract
@schema.parametrize()
@settings(max_examples=12, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_operation_keeps_the_schema(case: object) -> None:
    case.call_and_validate(headers={"Authorization": f"Bearer {API_KEY}"})  # type: ignore[attr-defined]


@pytest.mark.contract
def test_linked_operations_keep_the_schema(api_schema: object) -> None:
    """The stateful phase: schemathesis follows the document's links (POST /reload -> GET /info and /ready,
    GET /info -> POST /v1/embeddings at the widest `dimensions` and POST /search in the default mode,
    GET /v1/models -> POST /v1/embeddings with the model listed, POST /search -> GET /info), each step checked as
    above. Bounded: a few short scenarios, derandomized."""
    machine = api_schema.as_state_machine()  # type: ignore[attr-defined]

    followed: Counter[str] = Counter()

    class Keyed(machine):  # type: ignore[misc, valid-type]
        def get_call_kwargs(self, case: object) -> dict[str, object]:
            return {"headers": {"Authorization": f"Bearer {API_KEY}"}}

        def step(self, input: Any) -> Any:
            if input.transition is not None and input.is_applied:
                followed[input.transition.id] += 1
            return super().step(input)

    document = api_schema.raw_schema  # type: ignore[attr-defined]
    every = {
        f"{method.upper()} {path} -> [200] {name} -> {link['operationRef'].split('/')[-1].upper()} "
        + link["operationRef"].split("/")[2].replace("~1", "/")
        for path, methods in document["paths"].items()
        for method, operation in methods.items()
        for name, link in operation["responses"].get("200", {}).get("links", {}).items()
    }
    assert "POST /reload -> [200] ServedVersion -> GET /info" in every
    # Which transitions a scenario takes depends on the answers before it (a link applies after a 200 only, and a
    # busy engine may answer 429), so one derandomized run need not reach every link: up to three runs, each
    # derandomized with its own scenario length, until every link has been followed and checked.
    for steps in (6, 8, 10):
        Keyed.run(
            settings=settings(
                max_examples=20,
                stateful_step_count=steps,
                derandomize=True,
                deadline=None,
                suppress_health_check=list(HealthCheck),
            )
        )
        if set(followed) == every:
            break
    assert set(followed) == every, followed


VALID_FILTERS = [
    {"column": "year", "op": ">=", "value": 2000},
    {
        "and": [
            {"column": "source", "op": "in", "value": ["arxiv", "acl"]},
            {"not": {"column": "open", "op": "=", "value": True}},
        ]
    },
    {"or": [{"column": "published", "op": "<", "value": "2003-04-05"}, {"column": "score", "op": "!=", "value": 1.5}]},
    {"column": "blob", "op": "is not null"},
    {"column": "year", "op": "is null", "value": None},
    {"column": "year", "op": "<", "value": 10**30},  # beyond int16 and int64: every year is below it
    {"column": "year", "op": "in", "value": [2000.0, 2.5, -(10**30)]},
]
INVALID_FILTERS = [
    {"column": "title", "op": "=", "value": "x"},  # a column the index did not keep
    {"column": "year", "op": "=", "value": "2000"},  # text against a number
    {"column": "blob", "op": "=", "value": "a"},  # a column nothing compares with
    {"column": "open", "op": "in", "value": []},
    {"column": "source", "op": "like", "value": "a%"},
    {"and": []},
    {"not": {"column": "year", "op": ">", "value": 1}, "and": [{"column": "year", "op": ">", "value": 1}]},
    {"column": "year", "op": "is null", "value": 1},
    {"column": "year", "op": ">"},
]


def test_the_filter_is_described_over_the_served_columns(served_app: object) -> None:
    """POST /search's `filter` is in the document as the filter grammar over the columns this index kept, with
    each column's value type; a filter is valid by that schema exactly when the server runs it (200), and refused
    with a 422 otherwise."""
    jsonschema = pytest.importorskip("jsonschema")
    from fastapi.testclient import TestClient

    client = TestClient(served_app)  # type: ignore[arg-type]
    auth = {"Authorization": f"Bearer {API_KEY}"}
    document = client.get("/openapi.json").json()
    models = document["components"]["schemas"]
    assert models["SearchRequest"]["properties"]["filter"]["anyOf"][0] == {"$ref": "#/components/schemas/Filter"}
    named = {b["properties"]["column"]["enum"][0]: b for b in models["FilterCondition"]["anyOf"]}
    assert set(named) == set(COLUMNS)
    blob_ops = [b["properties"]["op"]["enum"] for b in models["FilterCondition"]["anyOf"] if "blob" in str(b)]
    assert blob_ops == [["is null", "is not null"]]
    validator = jsonschema.Draft202012Validator(
        {"$ref": "#/components/schemas/Filter", "components": document["components"]}
    )
    for where, expected in [(f, True) for f in VALID_FILTERS] + [(f, False) for f in INVALID_FILTERS]:
        assert validator.is_valid(where) == expected, where
        answer = client.post("/search", json={"query": "topic 3", "filter": where}, headers=auth)
        assert answer.status_code == (200 if expected else 422), (where, answer.text)
        if not expected:
            assert answer.json()["error"]["param"] == "filter"
    # not expressible in JSON Schema, refused by the server: a lone surrogate (no UTF-8 form), as in a query
    lone = client.post(
        "/search",
        content=b'{"query": "topic", "filter": {"column": "source", "op": "=", "value": "\\ud800"}}',
        headers={**auth, "Content-Type": "application/json"},
    )
    assert lone.status_code == 422 and "surrogate" in lone.json()["error"]["message"]
