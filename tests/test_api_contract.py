"""The HTTP API keeps its own contract: schemathesis generates requests from the served OpenAPI document for every
operation and checks each answer against that same document (all checks: status codes, response schemas, content
types, headers, positive data accepted, negative data rejected, no 5xx). Seeded and bounded, so the run is the
same every time and stays short; scripts/api_contract.py runs the long version before a release."""

from __future__ import annotations

import time
from collections.abc import Iterator

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


@pytest.fixture(scope="module")
def served_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    root = tmp_path_factory.mktemp("contract")
    corpus = write_corpus(root / "corpus.parquet", n=120)
    build_index(CorpusSpec(corpus), FakeEncoder(), root / "idx", TransformSpec(dim=8))
    service = Service(root / "idx", ServeOptions(watch_interval=0), encoder=FakeEncoder())
    app = create_app(service, api_key=API_KEY)
    from fastapi.testclient import TestClient

    with TestClient(app) as client:  # runs the lifespan: the index is loaded before any generated request
        auth = {"Authorization": f"Bearer {API_KEY}"}
        deadline = time.monotonic() + 30
        while client.get("/ready", headers=auth).status_code != 200:
            assert time.monotonic() < deadline, "the index did not load"
            time.sleep(0.02)
        yield app


@pytest.fixture(scope="module")
def api_schema(served_app: object) -> object:
    return schemathesis.openapi.from_asgi("/openapi.json", served_app)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=25, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_operation_keeps_the_schema(case: object) -> None:
    case.call_and_validate(headers={"Authorization": f"Bearer {API_KEY}"})  # type: ignore[attr-defined]
