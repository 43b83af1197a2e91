"""The HTTP service in-process (TestClient, fake encoder): every route, every bad input, the API key, hot reload,
a refused corrupt version, and micro-batching that batches concurrent requests without changing their answers."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import FakeEncoder, write_corpus

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from retrieval import update  # noqa: E402
from retrieval.build import build_index  # noqa: E402
from retrieval.corpus import CorpusSpec  # noqa: E402
from retrieval.errors import ConfigError  # noqa: E402
from retrieval.indexdir import INDEX  # noqa: E402
from retrieval.info import describe_index  # noqa: E402
from retrieval.search import Searcher, SearchParams  # noqa: E402
from retrieval.serve.app import create_app  # noqa: E402
from retrieval.serve.autothreads import ThreadChooser  # noqa: E402
from retrieval.serve.batching import Batcher, BatchStats, Overloaded  # noqa: E402
from retrieval.serve.service import NotReady, ServeOptions, Service  # noqa: E402
from retrieval.text import visible_pattern  # noqa: E402
from retrieval.whitening import DEFAULT_GAMMA, TransformSpec  # noqa: E402

QUERY = "document number 5 about topic 5"  # the exact text of doc5: the fake encoder puts it first


def build(tmp_path: Path, n: int = 300, name: str = "idx") -> Path:
    corpus = write_corpus(tmp_path / f"{name}.parquet", n=n)
    build_index(CorpusSpec(corpus), FakeEncoder(), tmp_path / name, TransformSpec(dim=8))
    return tmp_path / name


def wait_ready(client: TestClient, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while client.get("/ready").status_code != 200:
        assert time.monotonic() < deadline, client.get("/info").json()
        time.sleep(0.02)


@pytest.fixture
def index(tmp_path: Path) -> Path:
    return build(tmp_path)


def serve(index: Path, api_key: str | None = None, **options: Any) -> tuple[TestClient, Service]:
    service = Service(index, ServeOptions(**{"watch_interval": 0, **options}), encoder=FakeEncoder())
    return TestClient(create_app(service, api_key=api_key)), service


@pytest.fixture
def client(index: Path) -> Iterator[TestClient]:
    test_client, _ = serve(index, max_body_bytes=20_000)
    with test_client:
        wait_ready(test_client)
        yield test_client


def metric(client: TestClient, line_start: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric line {line_start}")


# ----- the routes ----------------------------------------------------------------------------------------------
def test_get_search_ranks_the_exact_document_first(client: TestClient) -> None:
    response = client.get("/search", params={"q": QUERY, "k": 3})
    assert response.status_code == 200
    body = response.json()
    hits = body["results"][0]["hits"]
    assert [h["rank"] for h in hits] == [1, 2, 3]
    assert hits[0]["id"] == "doc5" and hits[0]["text"] == QUERY
    assert hits[0]["score"] >= hits[1]["score"] >= hits[2]["score"]
    assert body["generation"] == 1 and body["took_ms"] > 0


def test_post_search_answers_one_query_and_a_batch_as_the_library_does(client: TestClient, index: Path) -> None:
    searcher = Searcher.load(index, encoder=FakeEncoder())
    queries = [QUERY, "topic 3", "whitening vectors"]
    batch = client.post("/search", json={"queries": queries, "k": 4}).json()["results"]
    single = client.post("/search", json={"query": queries[1], "k": 4}).json()["results"]
    for got, query in zip(batch, queries, strict=True):
        want = searcher.search(query, SearchParams(k=4))
        assert [h["id"] for h in got["hits"]] == [h.id for h in want]
        np.testing.assert_allclose([h["score"] for h in got["hits"]], [h.score for h in want], rtol=1e-5)
    assert [h["id"] for h in single[0]["hits"]] == [h["id"] for h in batch[1]["hits"]]  # scores: float32 rounding


def test_hits_name_their_title_where_the_index_has_a_title_column(client: TestClient, tmp_path: Path) -> None:
    assert client.get("/search", params={"q": QUERY, "k": 1}).json()["results"][0]["hits"][0]["title"] is None
    corpus = write_corpus(tmp_path / "titled.parquet", n=40, title=[f"Title {i}" for i in range(40)])
    build_index(CorpusSpec(corpus, title_column="title"), FakeEncoder(), tmp_path / "titled", TransformSpec(dim=8))
    titled, _ = serve(tmp_path / "titled")
    with titled:
        wait_ready(titled)
        hit = titled.get("/search", params={"q": "Title 5 " + QUERY}).json()["results"][0]["hits"][0]
    assert (hit["id"], hit["title"], hit["text"]) == ("doc5", "Title 5", "Title 5 " + QUERY)


def test_search_knobs_pass_through(client: TestClient) -> None:
    response = client.post("/search", json={"query": QUERY, "k": 2, "rescore": 20})
    assert response.status_code == 200
    assert response.json()["results"][0]["hits"][0]["id"] == "doc5"


def test_embed_returns_raw_or_transformed_vectors(client: TestClient, index: Path) -> None:
    texts = ["a first text", "a second text"]
    raw = client.post("/embed", json={"inputs": texts}).json()
    assert raw["dim"] == 16 and raw["transformed"] is False
    np.testing.assert_allclose(raw["embeddings"], FakeEncoder().encode(texts), rtol=1e-6)
    one = client.post("/embed", json={"inputs": texts[0], "transformed": True}).json()
    searcher = Searcher.load(index, encoder=FakeEncoder())
    np.testing.assert_allclose(
        one["embeddings"], searcher.transform.transform(FakeEncoder().encode(texts[:1])), atol=1e-6
    )
    assert one["dim"] == 8 and abs(np.linalg.norm(one["embeddings"][0]) - 1) < 1e-5


def test_health_ready_info_and_the_page(client: TestClient) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").json() == {"ready": True, "generation": 1}
    info = client.get("/info").json()
    assert info["ready"] is True
    index = info["index"]
    assert (index["model"], index["pooling"], index["d"], index["dim"], index["n"]) == ("fake", "mean", 16, 8, 300)
    assert index["gamma"] == DEFAULT_GAMMA and index["index_kind"] == "flat" and index["generation"] == 1
    assert "dims" in index["summary"] and index["summary"]["rows (N)"] == "300"
    assert index["stash"] is True and index["rescore_depth"] == 50  # reduced (8 of 16 dims): re-scored by default
    assert info["server"]["last_reload_error"] is None and info["server"]["limits"]["max_k"] == 100
    threads = info["server"]["threads"]
    assert threads["torch"] == "auto" and threads["torch_auto"]["choices"][0] == 1  # the default: measured
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "textContent" in page.text and "innerHTML" not in page.text
    assert 'max="100" value="10"' in page.text and "__" not in page.text  # the server's k limit, written in
    assert client.get("/openapi.json").json()["paths"]["/search"]["post"]


def test_info_shows_what_retrieval_info_json_shows(client: TestClient, index: Path) -> None:
    served = client.get("/info").json()["index"]
    local = describe_index(index)
    assert served["summary"] == local["summary"] and "kernel drift" in served["summary"]
    assert served["spectrum"] == local["spectrum"] and len(served["spectrum"]["top"]) == 10
    assert served["drift"] == local["drift"] and served["drift"]["rows_now"] == 300


def test_info_shows_no_drift_of_a_version_whose_directory_was_replaced(index: Path, tmp_path: Path) -> None:
    test_client, service = serve(index)
    with test_client as client:
        wait_ready(client)
        add_documents(index, tmp_path, 0)  # the next version is published; this one is still served (no watcher)
        served = client.get("/info").json()["index"]
        assert served["generation"] == 1 and served["drift"] == {} and "kernel drift" not in served["summary"]
        assert len(served["spectrum"]["top"]) == 10
        client.post("/reload")
        served = client.get("/info").json()["index"]
        assert served["generation"] == 2 and served["drift"]["rows_now"] == 320


def test_head_is_answered_as_get_without_a_body(client: TestClient) -> None:
    for path in ("/health", "/ready", "/info", "/metrics", "/", "/docs", "/search?q=x"):
        get, head = client.get(path), client.head(path)
        assert head.status_code == get.status_code == 200, path
        assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"], path
    assert client.head("/search").status_code == 422  # the GET's answer: q is required
    assert client.request("PUT", "/health").headers["allow"] == "GET, HEAD"
    assert metric(client, 'retrieval_requests_total{method="HEAD",route="/health",status="200"}') == 1


def test_the_docs_pages_load_their_assets_from_the_server(client: TestClient) -> None:
    for page, asset in (("/docs", "swagger-ui-bundle.js"), ("/redoc", "redoc.standalone.js")):
        html = client.get(page).text
        assert f"/docs/assets/{asset}" in html and "cdn." not in html and "fonts.googleapis" not in html, page
        script = client.get(f"/docs/assets/{asset}")
        assert script.status_code == 200 and len(script.content) > 100_000, asset


def test_the_spec_states_the_servers_own_limits(index: Path) -> None:
    test_client, _ = serve(index, max_k=50, max_query_chars=300, max_queries=7, max_rescore=400)
    with test_client as client:
        spec = client.get("/openapi.json").json()
    models = spec["components"]["schemas"]
    search = models["SearchRequest"]["properties"]
    assert {"type": "integer", "minimum": 1, "maximum": 50} in search["k"]["anyOf"] and search["k"]["default"] == 10
    assert {"type": "integer", "minimum": 0, "maximum": 400} in search["rescore"]["anyOf"]
    text = {"type": "string", "minLength": 1, "maxLength": 300, "pattern": visible_pattern()}
    assert text in search["query"]["anyOf"]
    queries = next(b for b in search["queries"]["anyOf"] if b["type"] == "array")
    assert (queries["maxItems"], queries["items"]["maxLength"]) == (7, 300)
    inputs = {b["type"]: b for b in models["EmbedRequest"]["properties"]["inputs"]["anyOf"]}
    assert inputs["string"]["maxLength"] == 300 and inputs["array"]["maxItems"] == 7
    assert "maxItems" not in inputs["string"] and "maxLength" not in inputs["array"]
    get = {p["name"]: p["schema"] for p in spec["paths"]["/search"]["get"]["parameters"]}
    assert {"type": "integer", "minimum": 1, "maximum": 50} in get["k"]["anyOf"] and get["q"]["maxLength"] == 300
    assert get["k"]["default"] == 10
    for path, method in (("/ready", "get"), ("/info", "get"), ("/reload", "post")):
        assert spec["paths"][path][method]["responses"]["200"]["content"]["application/json"]["schema"] != {}, path


def test_the_request_schemas_refuse_what_the_server_refuses(client: TestClient) -> None:
    """A client validating against the spec must not send what the server answers with 422: neither or both of
    `query` and `queries`, a text of whitespace alone (the schemas took all of these)."""
    jsonschema = pytest.importorskip("jsonschema")
    spec = client.get("/openapi.json").json()

    def valid(model: str, body: dict[str, Any]) -> bool:
        schema = {**spec["components"]["schemas"][model], "components": spec["components"]}
        return jsonschema.Draft202012Validator(schema).is_valid(body)

    for body in ({"query": "a"}, {"queries": ["a", "b"], "k": 3}, {"query": "a", "queries": None}):
        assert valid("SearchRequest", body), body
        assert client.post("/search", json=body).status_code == 200, body
    for body in ({}, {"query": "a", "queries": ["b"]}, {"query": "  "}, {"queries": ["a", "\t"]}):
        assert not valid("SearchRequest", body), body
        assert client.post("/search", json=body).status_code == 422, body
    assert valid("EmbedRequest", {"inputs": "a"}) and not valid("EmbedRequest", {"inputs": " "})
    assert client.post("/embed", json={"inputs": " "}).status_code == 422


def test_metrics_count_requests_errors_and_batches(client: TestClient) -> None:
    client.get("/search", params={"q": QUERY})
    client.get("/search", params={"q": ""})
    text = client.get("/metrics").text
    assert text.endswith("\n") and "# TYPE retrieval_request_duration_seconds histogram" in text
    assert metric(client, 'retrieval_requests_total{method="GET",route="/search",status="200"}') >= 1
    assert metric(client, 'retrieval_requests_total{method="GET",route="/search",status="422"}') == 1
    assert metric(client, 'retrieval_errors_total{code="empty_query"}') == 1
    assert metric(client, "retrieval_batch_size_count") >= 1
    assert metric(client, "retrieval_index_generation") == 1
    assert metric(client, "retrieval_ready") == 1
    assert metric(client, 'retrieval_request_duration_seconds_bucket{route="/search",le="+Inf"}') >= 2
    client.get("/docs")
    client.get("/openapi.json")
    assert metric(client, 'retrieval_requests_total{method="GET",route="/docs",status="200"}') == 1
    assert metric(client, 'retrieval_requests_total{method="GET",route="/openapi.json",status="200"}') == 1
    client.get("/docs/assets/swagger-ui.css")
    assert metric(client, 'retrieval_requests_total{method="GET",route="/docs/assets",status="200"}') == 1
    assert 'route="unmatched"' not in client.get("/metrics").text
    for i in range(3):  # made-up methods (h11 passes any token): one bounded label value, not one per method
        client.request(f"BREW{i}", "/search")
    assert metric(client, 'retrieval_requests_total{method="other",route="/search",status="405"}') == 3


def test_metrics_name_the_draining_version_while_stopping(index: Path) -> None:
    """A scrape during shutdown: not ready, and still the version that answers what is in flight."""
    test_client, service = serve(index)
    with test_client:
        wait_ready(test_client)
        service.stop(10)
        assert metric(test_client, "retrieval_ready") == 0
        assert metric(test_client, "retrieval_index_generation") == 1
        assert metric(test_client, "retrieval_index_documents") == 300
        info = test_client.get("/info").json()
        assert info["ready"] is False and info["index"]["generation"] == 1


def test_whole_numbers_written_with_a_zero_fraction_are_integers(client: TestClient) -> None:
    """JSON Schema's `integer` admits 48.0 (and a query string's "2.0"): the spec says integer, so they are taken
    as 48 and 2. A fraction, a bool or a number in a JSON string stays refused."""
    assert client.post("/search", json={"query": QUERY, "k": 2.0}).status_code == 200
    assert len(client.post("/search", json={"query": QUERY, "k": 3.0}).json()["results"][0]["hits"]) == 3
    assert len(client.get("/search", params={"q": QUERY, "k": "2.0"}).json()["results"][0]["hits"]) == 2
    assert client.post("/search", json={"query": QUERY, "rescore": 48.0}).status_code == 200
    for bad in (2.5, True, "2"):
        assert client.post("/search", json={"query": QUERY, "k": bad}).status_code == 422, bad


# ----- bad input: always a 4xx with one JSON error shape, never a 500 or a traceback ---------------------------
LONG = "x" * 2001
JSON_TYPE = {"content-type": "application/json"}
JSON = {"headers": {"Content-Type": "application/json"}}
BAD: list[tuple[str, str, dict[str, Any], int, str, str | None]] = [
    ("get", "/search", {}, 422, "invalid_request", "q"),
    ("get", "/search", {"params": {"q": ""}}, 422, "empty_query", "q"),
    ("get", "/search", {"params": {"q": "  \t "}}, 422, "empty_query", "q"),
    ("get", "/search", {"params": {"q": LONG}}, 422, "query_too_long", "q"),
    ("get", "/search", {"params": {"q": "a", "k": "0"}}, 422, "invalid_param", "k"),
    ("get", "/search", {"params": {"q": "a", "k": "101"}}, 422, "invalid_param", "k"),
    ("get", "/search", {"params": {"q": "a", "k": "ten"}}, 422, "invalid_request", "k"),
    ("get", "/search", {"params": {"q": "a", "ef_search": "0"}}, 422, "invalid_param", "ef_search"),
    ("get", "/search", {"params": {"q": "a", "ef": "8"}}, 422, "invalid_request", "ef"),  # its old name: refused
    ("post", "/search", {"json": {"query": "a", "ef": 8}}, 422, "invalid_request", "ef"),
    ("get", "/search", {"params": {"q": "a", "nprobe": "99999"}}, 422, "invalid_param", "nprobe"),
    ("get", "/search", {"params": {"q": "a", "limit": "3"}}, 422, "invalid_request", "limit"),
    ("get", "/search", {"params": [("q", "a"), ("q", "b")]}, 422, "invalid_request", "q"),
    ("get", "/search", {"params": [("q", "a"), ("k", "5"), ("k", "6")]}, 422, "invalid_request", "k"),
    ("post", "/search", {"json": {}}, 422, "invalid_request", "query"),
    # a key given twice: the parser keeps the last, which the client may not have meant (refused as in GET)
    ("post", "/search", {"content": '{"query": "a", "k": 3, "k": 5}', **JSON}, 422, "invalid_request", "k"),
    ("post", "/embed", {"content": '{"inputs": ["a"], "inputs": ["b"]}', **JSON}, 422, "invalid_request", "inputs"),
    ("post", "/search", {"json": {"query": "a", "queries": ["b"]}}, 422, "invalid_request", "query"),
    ("post", "/search", {"json": {"query": ""}}, 422, "empty_query", "query"),
    ("post", "/search", {"json": {"query": LONG}}, 422, "query_too_long", "query"),
    ("post", "/search", {"json": {"query": 5}}, 422, "invalid_request", "query"),
    ("post", "/search", {"json": {"query": "a", "k": "10"}}, 422, "invalid_request", "k"),
    ("post", "/search", {"json": {"query": "a", "k": True}}, 422, "invalid_request", "k"),
    ("post", "/search", {"json": {"query": "a", "k": 2.5}}, 422, "invalid_request", "k"),
    ("post", "/search", {"json": {"query": "a", "k": 0}}, 422, "invalid_param", "k"),
    ("post", "/search", {"json": {"query": "a", "k": 10_001}}, 422, "invalid_param", "k"),
    ("post", "/search", {"json": {"query": "a", "rescore": -1}}, 422, "invalid_param", "rescore"),
    ("post", "/search", {"json": {"query": "a", "ef_search": 0}}, 422, "invalid_param", "ef_search"),
    ("post", "/search", {"json": {"query": "a", "limit": 3}}, 422, "invalid_request", "limit"),
    ("post", "/search", {"json": {"queries": []}}, 422, "empty_query", "queries"),
    ("post", "/search", {"json": {"queries": ["a", " "]}}, 422, "empty_query", "queries"),
    # what the tokenizer drops encodes as "" does: every such query matched every such text at 1.0
    ("get", "/search", {"params": {"q": "\u200b"}}, 422, "empty_query", "q"),
    ("post", "/search", {"json": {"queries": ["a", "\x00\ufeff"]}}, 422, "empty_query", "queries"),
    ("post", "/search", {"json": {"queries": ["a", None]}}, 422, "invalid_request", "queries"),
    ("post", "/search", {"json": {"queries": "a"}}, 422, "invalid_request", "queries"),
    ("post", "/search", {"json": {"queries": ["a"] * 65}}, 422, "too_many_queries", "queries"),
    # counted before validation: pydantic reporting each of a million wrong-typed items held the event loop seconds
    ("post", "/search", {"json": {"queries": [1] * 5000}}, 422, "too_many_queries", "queries"),
    ("post", "/embed", {"json": {"inputs": [None] * 3000}}, 422, "too_many_queries", "inputs"),
    # JSON Schema's integers only, as POST: int() (which FastAPI used) took "+5", " 5", "1_0"
    ("get", "/search", {"params": {"q": "a", "k": "5.5"}}, 422, "invalid_request", "k"),
    ("get", "/search", {"params": {"q": "a", "k": "+5"}}, 422, "invalid_request", "k"),
    ("get", "/search", {"params": {"q": "a", "k": " 5"}}, 422, "invalid_request", "k"),
    ("get", "/search", {"params": {"q": "a", "rescore": "1_0"}}, 422, "invalid_request", "rescore"),
    # a compressed body was read as bytes that are not UTF-8 ("invalid_json")
    (
        "post",
        "/search",
        {"content": b"\x1f\x8b\x08\x00", "headers": {"content-type": "application/json", "content-encoding": "gzip"}},
        415,
        "unsupported_media_type",
        None,
    ),
    ("post", "/search", {"json": [1, 2]}, 422, "invalid_request", None),
    (
        "post",
        "/search",
        {"content": b"{not json", "headers": {"content-type": "application/json"}},
        422,
        "invalid_json",
        None,
    ),
    # a body that is not sent as JSON is 415 (RFC 9110 15.5.16), as a compressed one is; it was 422
    *[
        ("post", path, {"content": b'{"query": "a"}', "headers": {"content-type": kind}}, 415, code, None)
        for path, kind, code in (
            ("/search", "text/plain", "unsupported_media_type"),
            ("/search", "application/x-www-form-urlencoded", "unsupported_media_type"),
            ("/embed", "multipart/form-data; boundary=x", "unsupported_media_type"),
        )
    ],
    # Content-Encoding is a list, possibly over several lines: a gzip on the second line was missed (422)
    (
        "post",
        "/search",
        {
            "content": b"\x1f\x8b\x08\x00",
            "headers": [
                ("content-type", "application/json"),
                ("content-encoding", "identity"),
                ("content-encoding", "gzip"),
            ],
        },
        415,
        "unsupported_media_type",
        None,
    ),
    ("post", "/search", {"json": {"query": "a" * 1500, "queries": ["b" * 1500] * 20}}, 413, "payload_too_large", None),
    ("post", "/embed", {"json": {}}, 422, "invalid_request", "inputs"),
    ("post", "/embed", {"json": {"inputs": 3}}, 422, "invalid_request", "inputs"),
    ("post", "/embed", {"json": {"inputs": []}}, 422, "empty_query", "inputs"),
    ("post", "/embed", {"json": {"inputs": "a", "transformed": "yes"}}, 422, "invalid_request", "transformed"),
    ("post", "/embed", {"json": {"inputs": ["a"] * 65}}, 422, "too_many_queries", "inputs"),
    (
        "post",
        "/search",
        {"content": b'{"queries": ["a", "\\ud800"]}', "headers": {"content-type": "application/json"}},
        422,
        "invalid_text",
        "queries",
    ),
    (
        "post",
        "/embed",
        {"content": b'{"inputs": "\\udfff"}', "headers": {"content-type": "application/json"}},
        422,
        "invalid_text",
        "inputs",
    ),
    ("post", "/search", {"headers": {"content-type": "application/json"}}, 422, "invalid_request", None),
    # a key that is no text (a lone surrogate) was told "the body must be a JSON object"
    (
        "post",
        "/search",
        {"content": b'{"query": "a", "\\ud800": 1}', "headers": {"content-type": "application/json"}},
        422,
        "invalid_text",
        None,
    ),
    # JSON that json.loads cannot read (FastAPI's own 400, undocumented): not UTF-8, too deep, a 5,000-digit number
    *[
        ("post", "/search", {"content": body, "headers": JSON_TYPE}, 422, "invalid_json", None)
        for body in (
            b'{"query": "caf\xe9"}',
            b'{"query": "a", "k": ' + b"[" * 2000 + b"]" * 2000 + b"}",
            b'{"query": "a", "k": ' + b"9" * 5000 + b"}",
        )
    ],
    # percent-escapes that are not UTF-8 (Latin-1 e-acute, an encoded surrogate): refused, not searched as U+FFFD
    ("get", "/search?q=caf%E9&k=1", {}, 422, "invalid_text", "q"),
    ("get", "/search?q=%ED%A0%80", {}, 422, "invalid_text", "q"),
    ("get", "/search?q=a&%FF=1", {}, 422, "invalid_text", None),
    ("get", "/nowhere", {}, 404, "not_found", None),
    ("delete", "/search", {}, 405, "method_not_allowed", None),
    ("get", "/embed", {}, 405, "method_not_allowed", None),
]


@pytest.mark.parametrize(("method", "path", "kwargs", "status", "code", "param"), BAD)
def test_bad_input_gets_a_clear_json_error(
    client: TestClient, method: str, path: str, kwargs: dict[str, Any], status: int, code: str, param: str | None
) -> None:
    response = getattr(client, method)(path, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error
    assert error["message"] and "\n" not in error["message"] and "Traceback" not in response.text
    if param:
        assert f"`{param}`" in error["message"]
    if param == "ef":  # the old HTTP name of the HNSW width: refused, saying the new one
        assert error["message"].endswith("it is `ef_search` now"), error


def test_json_bodies_are_taken_by_media_type_and_only_routes_with_a_body_read_one(client: TestClient) -> None:
    body = b'{"query": "' + QUERY.encode() + b'", "k": 1}'
    for headers in (
        {"content-type": "application/json; charset=utf-8"},
        {"content-type": "Application/JSON"},
        {"content-type": "application/vnd.retrieval+json"},
        {"content-type": "application/json", "content-encoding": "identity, identity"},
        {"content-type": "application/json", "content-encoding": ""},
    ):
        response = client.post("/search", content=body, headers=headers)
        assert response.status_code == 200 and response.json()["results"][0]["hits"], (headers, response.text)
    bare = client.post("/search", content=body)  # no Content-Type: FastAPI reads no body (its strict default)
    assert (bare.status_code, bare.json()["error"]["code"]) == (415, "unsupported_media_type")
    compressed = client.post(
        "/embed", content=b"x", headers={"content-type": "application/json", "content-encoding": "br"}
    )
    assert (compressed.status_code, compressed.headers["accept-encoding"]) == (415, "identity")
    # POST /reload takes no body: what is sent is not read, so not refused (it got 415, 413 too_many_queries, or
    # a repeated-key 422 for a body it ignores)
    for content, headers in (
        (b'{"a": 1, "a": 2}', {"content-type": "application/json"}),
        (json.dumps({"queries": ["q"] * 500}).encode(), {"content-type": "application/json"}),
        (b"\x1f\x8b", {"content-encoding": "gzip"}),
    ):
        response = client.post("/reload", content=content, headers=headers)
        assert response.status_code == 200 and response.json()["generation"] == 1, response.text


def test_an_index_of_precomputed_vectors_refuses_texts_with_no_encoder(tmp_path: Path) -> None:
    """Searching it by text named a Python call (`search_vectors()`) under `invalid_param`; now `no_encoder`, as
    /embed says."""
    np.save(tmp_path / "v.npy", FakeEncoder().encode([f"t{i}" for i in range(60)]))
    build_index(CorpusSpec(tmp_path / "v.npy"), None, tmp_path / "vec", TransformSpec(dim=4))
    service = Service(tmp_path / "vec", ServeOptions(watch_interval=0))
    with TestClient(create_app(service)) as client:
        wait_ready(client)
        for response in (
            client.get("/search", params={"q": "a text"}),
            client.post("/search", json={"queries": ["a", "b"]}),
            client.post("/embed", json={"inputs": "a"}),
        ):
            assert response.status_code == 422, response.text
            error = response.json()["error"]
            assert error["code"] == "no_encoder" and "search_vectors" not in error["message"], error


def drive(
    app: Any, method: str, path: str, query: bytes = b"", messages: Any = (), cancel_after: float | None = None
) -> tuple[str, list[dict[str, Any]]]:
    """One request straight to the ASGI app, as TestClient cannot send it: from a client that leaves, or one that
    uvicorn cancels (its shutdown timeout). ``messages`` are what ``receive`` returns in turn (a float: sleep that
    long first; then nothing more ever comes). ("answered" or "cancelled", the messages the app sent)."""
    import asyncio

    sent: list[dict[str, Any]] = []
    pending = list(messages)

    async def receive() -> Any:
        while pending and isinstance(pending[0], float):
            await asyncio.sleep(pending.pop(0))
        if pending:
            return pending.pop(0)
        await asyncio.sleep(3600)  # a client with nothing more to say

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [(b"host", b"testserver"), (b"content-type", b"application/json")]
    if method == "POST":
        headers.append((b"content-length", b"100"))
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "", "headers": headers,
        "client": ("127.0.0.1", 5000), "server": ("testserver", 80),
    }  # fmt: skip

    async def run() -> str:
        task = asyncio.ensure_future(app(scope, receive, send))
        if cancel_after is not None:
            await asyncio.sleep(cancel_after)
            task.cancel()
        try:
            await asyncio.wait_for(task, 30)
        except asyncio.CancelledError:
            return "cancelled"
        return "answered"

    return asyncio.run(run()), sent


GET_BODY = {"type": "http.request", "body": b"", "more_body": False}


def test_a_request_cancelled_at_the_shutdown_timeout_gets_503_json(index: Path) -> None:
    """On SIGTERM uvicorn waits --shutdown-timeout, then cancels the requests still running: those got uvicorn's
    plain-text 500 and a logged traceback. Once the service is shutting down (`begin_shutdown`, which `run` calls
    from the signal), a cancelled request gets 503 `shutting_down`, JSON; any other cancellation passes on."""
    import json

    release = threading.Event()
    test_client, service = serve(index)

    def cancelled_request() -> tuple[str, list[dict[str, Any]]]:
        """A GET /search cancelled while the engine holds it (queued behind, or inside, the held encode)."""
        return drive(test_client.app, "GET", "/search", b"q=held", [GET_BODY], cancel_after=0.3)

    with test_client:
        wait_ready(test_client)
        searcher = service.searcher()
        encode = searcher.encode
        searcher.encode = lambda texts: (release.wait(10), encode(texts))[1]  # type: ignore[method-assign]
        try:
            outcome, sent = cancelled_request()
            assert outcome == "cancelled" and not sent  # not shutting down: as before
            service.begin_shutdown()
            outcome, sent = cancelled_request()
            assert outcome == "answered" and sent[0]["status"] == 503, sent
            error = json.loads(sent[1]["body"])["error"]
            assert error["code"] == "shutting_down" and "shutting down" in error["message"], error
        finally:
            release.set()


def test_a_body_still_arriving_at_the_shutdown_timeout_gets_503_json(index: Path) -> None:
    """uvicorn cancels a request whose body is still being read when the shutdown timeout runs out: that got its
    plain-text 500 and a logged traceback (only requests waiting for the engine got the JSON 503)."""
    import json

    test_client, service = serve(index)

    with test_client:
        wait_ready(test_client)
        service.begin_shutdown()
        partial = [{"type": "http.request", "body": b'{"query"', "more_body": True}]  # the rest never comes
        outcome, sent = drive(test_client.app, "POST", "/search", b"", partial, cancel_after=0.3)
    assert outcome == "answered" and sent[0]["status"] == 503, sent
    assert json.loads(sent[1]["body"])["error"]["code"] == "shutting_down"


def test_method_not_allowed_names_every_method_of_the_path(client: TestClient) -> None:
    paths = [("/search", "GET, HEAD, POST"), ("/embed", "POST"), ("/health", "GET, HEAD")]
    paths.append(("/docs/assets/swagger-ui.css", "GET, HEAD"))  # under the docs' mount: was empty
    for path, allowed in paths:
        response = client.request("PUT", path)
        assert response.status_code == 405 and response.headers["allow"] == allowed, path


class RecordingEncoder(FakeEncoder):
    def __init__(self) -> None:
        super().__init__()
        self.texts: list[str] = []

    def encode(self, texts: Any) -> np.ndarray:
        self.texts.extend(texts)
        return super().encode(texts)


def test_a_client_that_leaves_while_queued_is_withdrawn_not_encoded(index: Path) -> None:
    """A client that closes its connection while its request waits for a busy engine: its text is withdrawn
    (it was encoded for nobody, and under overload such requests filled the queue), counted as 499."""
    encoder = RecordingEncoder()
    service = Service(index, ServeOptions(watch_interval=0), encoder=encoder)
    app = create_app(service)
    with TestClient(app) as client:
        wait_ready(client)
        running, release = threading.Event(), threading.Event()
        service.batcher.call(lambda: (running.set(), release.wait(10)))  # the engine is busy
        assert running.wait(10)
        _, sent = drive(app, "GET", "/search", b"q=abandoned%20text", [GET_BODY, 0.3, {"type": "http.disconnect"}])
        status = sent[0]["status"]
        release.set()
        assert client.get("/search", params={"q": QUERY}).status_code == 200
        assert status == 499 and "abandoned text" not in encoder.texts and QUERY in encoder.texts
        assert metric(client, 'retrieval_errors_total{code="client_closed"}') == 1
        assert metric(client, 'retrieval_requests_total{method="GET",route="/search",status="499"}') == 1


def test_a_get_declaring_a_body_over_the_limit_is_answered(client: TestClient) -> None:
    """The body of a GET is never read; the disconnect watcher's receive met LimitBody's 413 for its declared
    length, and took that for the client leaving: a live client got 499 `client_closed`."""
    response = client.request("GET", "/search", params={"q": QUERY}, content=b"a" * 30_000)
    assert response.status_code == 200, response.text
    assert response.json()["results"][0]["hits"][0]["id"] == "doc5"


def test_a_client_that_leaves_mid_body_is_not_an_internal_error(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    """It was logged as a bug (two tracebacks) and counted as a 500 `internal`: anyone could flood the log."""
    cut = [{"type": "http.request", "body": b'{"query"', "more_body": True}, {"type": "http.disconnect"}]
    with caplog.at_level(logging.WARNING):
        assert drive(client.app, "POST", "/search", b"", cut)[1][0]["status"] == 499
    assert not caplog.records
    assert metric(client, 'retrieval_errors_total{code="client_closed"}') == 1
    assert "internal" not in client.get("/metrics").text


def test_a_body_streamed_without_a_length_is_cut_off_at_the_limit(client: TestClient) -> None:
    chunks = (b'{"query": "' + b"a" * 10_000 for _ in range(4))  # no Content-Length: chunked upload
    response = client.post("/search", content=chunks, headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "payload_too_large"


def test_searches_wait_for_the_index_with_503_not_500(index: Path) -> None:
    service = Service(index, ServeOptions(watch_interval=0), encoder=FakeEncoder())
    with TestClient(create_app(service, manage=False)) as client:  # never started: nothing loaded
        response = client.get("/search", params={"q": "a"})
        assert response.status_code == 503 and response.json()["error"]["code"] == "not_ready"
        not_ready = client.get("/ready")
        assert not_ready.status_code == 503 and not_ready.json()["ready"] is False
        assert response.headers["retry-after"] == not_ready.headers["retry-after"] == "1"  # when to come back
        assert metric(client, 'retrieval_errors_total{code="not_ready"}') == 2  # the search's and /ready's
        assert client.get("/info").json() == {
            "ready": False,
            "index": None,
            "server": client.get("/info").json()["server"],
        }
        assert client.get("/health").status_code == 200


# ----- the API key ---------------------------------------------------------------------------------------------
def test_an_api_key_protects_everything_but_health_the_page_and_the_docs(index: Path) -> None:
    test_client, _ = serve(index, api_key="s3cret")
    with test_client as client:
        assert client.get("/health").status_code == 200
        assert client.get("/").status_code == 200 and client.get("/docs").status_code == 200
        for method, path in (("get", "/ready"), ("get", "/info"), ("get", "/metrics"), ("post", "/reload")):
            response = getattr(client, method)(path)
            assert response.status_code == 401, path
            assert response.json()["error"]["code"] == "unauthorized"
            assert response.headers["www-authenticate"] == "Bearer"
        assert client.get("/search", params={"q": QUERY}).status_code == 401
        wrong = {"Authorization": "Bearer s3cre"}
        response = client.post("/search", json={"query": QUERY}, headers=wrong)
        assert response.status_code == 401  # a key sent and wrong: RFC 6750 3.1's invalid_token
        assert response.headers["www-authenticate"] == 'Bearer error="invalid_token"'
        assert client.post("/embed", json={"inputs": "a"}, headers={"Authorization": "s3cret"}).status_code == 401
        good = {"Authorization": "Bearer s3cret"}
        broken, json_type = b'{"query": ', {"Content-Type": "application/json"}
        assert client.post("/search", content=broken, headers=json_type).status_code == 401  # key first, then body
        response = client.post("/search", content=broken, headers=json_type | good)
        assert response.status_code == 422 and response.json()["error"]["code"] == "invalid_json"
        assert (
            'retrieval_requests_total{method="POST",route="/search",status="401"} 2'
            in client.get("/metrics", headers=good).text
        )
        wait_ready_with = time.monotonic() + 20
        while client.get("/ready", headers=good).status_code != 200:
            assert time.monotonic() < wait_ready_with
            time.sleep(0.02)
        response = client.get("/search", params={"q": QUERY}, headers=good)
        assert response.status_code == 200 and response.json()["results"][0]["hits"][0]["id"] == "doc5"
        spec = client.get("/openapi.json").json()  # tells clients (and their generators) to send the key
        assert list(spec["components"]["securitySchemes"].values()) == [
            {"type": "http", "scheme": "bearer", "description": "The server's API key"}
        ]
        operations = {f"{m} {p}": op for p, ops in spec["paths"].items() for m, op in ops.items()}
        assert [route for route, op in operations.items() if not op.get("security")] == ["get /health"]
    keyless, _ = serve(index)
    with keyless:
        assert "securitySchemes" not in keyless.get("/openapi.json").json().get("components", {})


def test_the_spec_lists_every_status_a_route_answers_with(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    statuses = {
        f"{method.upper()} {path}": set(op["responses"]) for path, ops in paths.items() for method, op in ops.items()
    }
    assert all("401" in codes for route, codes in statuses.items() if route != "GET /health"), statuses  # the key
    assert {"503"} <= statuses["GET /ready"] and {"409"} <= statuses["POST /reload"]
    assert {"413", "422", "429", "503"} <= statuses["POST /search"] & statuses["GET /search"] & statuses["POST /embed"]
    assert "415" in statuses["POST /search"] & statuses["POST /embed"] and "415" not in statuses["GET /search"]
    assert statuses["POST /reload"] == {"200", "401", "409", "503"}  # it reads no body: none of the body's errors
    error = {"$ref": "#/components/schemas/ErrorResponse"}  # JSON, even where the route's own answer is text
    assert paths["/metrics"]["get"]["responses"]["401"]["content"] == {"application/json": {"schema": error}}
    assert paths["/ready"]["get"]["responses"]["503"]["content"] == {"application/json": {"schema": error}}


# ----- reload --------------------------------------------------------------------------------------------------
def add_documents(index: Path, tmp_path: Path, first: int, n: int = 20) -> list[str]:
    texts = [f"brand new document {i} about whitening" for i in range(first, first + n)]
    corpus = write_corpus(
        tmp_path / f"more-{first}.parquet", n=n, id=[f"new{i}" for i in range(first, first + n)], text=texts
    )
    update.add(index, CorpusSpec(corpus), encoder=FakeEncoder())
    return texts


def test_post_reload_serves_the_new_version_and_refuses_a_corrupt_one(index: Path, tmp_path: Path) -> None:
    test_client, service = serve(index)
    with test_client as client:
        wait_ready(client)
        texts = add_documents(index, tmp_path, 0)
        assert client.get("/search", params={"q": texts[3]}).json()["generation"] == 1  # not watching
        reloaded = client.post("/reload")
        assert reloaded.status_code == 200 and reloaded.json()["generation"] == 2
        found = client.get("/search", params={"q": texts[3], "k": 1}).json()
        assert found["generation"] == 2 and found["results"][0]["hits"][0]["id"] == "new3"

        unchanged = client.post("/reload")  # the version served: nothing read, nothing counted
        assert unchanged.status_code == 200 and unchanged.json() == {"reloaded": False, "generation": 2, "seconds": 0}
        assert service.reloads == {"ok": 2, "failed": 0}

        bad = tmp_path / "bad"  # a corrupt replacement, published as writers publish: renamed into place
        shutil.copytree(index, bad)
        data = bytearray((bad / INDEX).read_bytes())
        data[len(data) // 2] ^= 0xFF  # one flipped byte: the full checksum of a reload catches it
        (bad / INDEX).write_bytes(bytes(data))
        index.rename(tmp_path / "replaced")
        bad.rename(index)
        refused = client.post("/reload")
        assert refused.status_code == 409
        assert refused.json()["error"]["code"] == "reload_refused" and refused.json()["generation"] == 2
        assert "checksum" in refused.json()["error"]["message"]
        assert metric(client, 'retrieval_errors_total{code="reload_refused"}') == 1
        still = client.get("/search", params={"q": texts[3], "k": 1})
        assert still.status_code == 200 and still.json()["generation"] == 2
        info = client.get("/info").json()
        assert info["index"]["generation"] == 2 and "checksum" in info["server"]["last_reload_error"]
        assert metric(client, "retrieval_index_loads_failed") == 1
        assert service.reloads == {"ok": 2, "failed": 1}


def test_a_version_damaged_in_place_is_verified_refused_and_the_old_one_serves_on(index: Path) -> None:
    """index.faiss and manifest.json rewritten in place (the directory itself unchanged): POST /reload answered
    reloaded:false, as if nothing had changed. It now checks what it would serve and refuses it in one line."""
    test_client, service = serve(index)
    with test_client as client:
        wait_ready(client)
        data = bytearray((index / INDEX).read_bytes())
        data[len(data) // 2] ^= 0xFF
        with (index / INDEX).open("r+b") as out:  # in place: same inode, same directory entry
            out.write(bytes(data))
        manifest = json.loads((index / "manifest.json").read_text())
        manifest["created"] = "2000-01-01T00:00:00Z"
        with (index / "manifest.json").open("r+") as out:
            out.truncate(0)
            out.write(json.dumps(manifest))
        refused = client.post("/reload")
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert error["code"] == "reload_refused" and "checksum" in error["message"] and "\n" not in error["message"]
        assert "still serving generation 1" in error["message"]
        assert client.get("/ready").status_code == 200
        found = client.get("/search", params={"q": QUERY, "k": 1}).json()
        assert found["generation"] == 1 and found["results"][0]["hits"][0]["id"] == "doc5"
        assert service.reloads == {"ok": 1, "failed": 1}
        again = client.post("/reload")  # the same damaged files: refused again, not taken as the version served
        assert again.status_code == 409


def test_reloads_that_arrive_during_a_load_read_nothing_again(index: Path, tmp_path: Path) -> None:
    """Every POST /reload was a full verified load, even of the version served, one after another: 50 at once
    took 167 s on a 126 MB index. Those that wait while a version loads now find it served: one load."""
    service = Service(index, ServeOptions(watch_interval=0), encoder=FakeEncoder())
    service.start(background=False)
    try:
        load, loads = service._load, []

        def slow_load() -> Searcher:
            loads.append(1)
            time.sleep(0.3)  # the others arrive meanwhile
            return load()

        service._load = slow_load  # type: ignore[method-assign]
        add_documents(index, tmp_path, 0)
        with ThreadPoolExecutor(8) as pool:
            outcomes = list(pool.map(lambda _: service.reload(), range(8)))
        assert len(loads) == 1 and service.reloads == {"ok": 2, "failed": 0}
        assert sorted(o.reloaded for o in outcomes) == [False] * 7 + [True]
        assert {(o.generation, o.error) for o in outcomes} == {(2, None)}
    finally:
        service.stop(10)


def test_post_reload_after_the_signal_loads_nothing_and_answers_503(index: Path, tmp_path: Path) -> None:
    """A reload that came after SIGTERM loaded the new version for nobody and answered 409 `reload_refused`
    ("shutting down"); reloads queued that way delayed the exit by a load each."""
    test_client, service = serve(index)
    with test_client as client:
        wait_ready(client)
        add_documents(index, tmp_path, 0)
        service.begin_shutdown()
        answer = client.post("/reload")
        assert (answer.status_code, answer.json()["error"]["code"]) == (503, "shutting_down"), answer.text
        assert service.reloads == {"ok": 1, "failed": 0} and service.searcher().manifest.generation == 1


def test_a_calibrated_knob_is_served_after_a_reload(tmp_path: Path) -> None:
    """`calibrate --apply` publishes a version like any writer: the server takes it, and /info says where its
    default knob came from."""
    from retrieval.index import IndexSpec

    corpus = write_corpus(tmp_path / "c.parquet", n=1000)
    index = tmp_path / "ivf"
    build_index(CorpusSpec(corpus), FakeEncoder(), index, TransformSpec(dim=8), IndexSpec("IVF16,Flat"))
    test_client, _ = serve(index)
    with test_client as client:
        wait_ready(client)
        before = client.get("/info").json()["index"]
        assert before["search_defaults"] == {"nprobe": 4}
        assert before["summary"]["search default"].startswith("nprobe 4, as built")
        queries = FakeEncoder().encode([f"a question on topic {i}" for i in range(100)])
        measured, _ = update.calibrate_index(index, queries, 0.99, "questions", apply=True)
        assert measured.value != 4
        assert client.post("/reload").json()["generation"] == 2
        after = client.get("/info").json()["index"]
        assert after["search_defaults"] == {"nprobe": measured.value}
        assert after["summary"]["search default"].startswith(f"nprobe {measured.value}: measured on 100 queries")
        assert client.get("/search", params={"q": "a question on topic 3"}).status_code == 200


def test_the_watcher_swaps_versions_under_load_without_a_failed_request(index: Path, tmp_path: Path) -> None:
    # no admission budget: the adds encode on the same cores, and a 429 for queued work is not a failed swap
    test_client, _ = serve(index, watch_interval=0.05, max_queue_ms=0)
    statuses: list[int] = []
    stop = threading.Event()
    with test_client as client:
        wait_ready(client)

        def hammer() -> None:
            while not stop.is_set():
                statuses.append(client.post("/search", json={"query": QUERY, "k": 3}).status_code)

        with ThreadPoolExecutor(4) as pool:
            for _ in range(4):
                pool.submit(hammer)
            texts = add_documents(index, tmp_path, 0)
            deadline = time.monotonic() + 20
            while client.get("/ready").json()["generation"] != 2:
                assert time.monotonic() < deadline, client.get("/info").json()["server"]
                time.sleep(0.02)
            more = add_documents(index, tmp_path, 100)
            while client.get("/ready").json()["generation"] != 3:
                assert time.monotonic() < deadline, client.get("/info").json()["server"]
                time.sleep(0.02)
            stop.set()
        hits = client.post("/search", json={"queries": [texts[0], more[-1]], "k": 1}).json()["results"]
    assert [r["hits"][0]["id"] for r in hits] == ["new0", "new119"]
    assert len(statuses) > 20 and set(statuses) == {200}


# ----- micro-batching ------------------------------------------------------------------------------------------
def test_the_engine_batches_waiting_jobs_and_answers_each_as_alone(index: Path) -> None:
    searcher = Searcher.load(index, encoder=FakeEncoder())
    sizes: list[int] = []
    batcher = Batcher(lambda: searcher, max_batch=8, on_batch=lambda stats: sizes.append(stats.queries))
    queries = [f"document number {i} about topic {i % 7}" for i in range(10)] + ["a", "whitening"]
    params = [SearchParams(k=3), SearchParams(k=5, rescore=10)]
    futures = [batcher.submit_search([q], params[i % 2]) for i, q in enumerate(queries)]  # queued before start
    futures.append(batcher.submit_search(queries[:3], SearchParams(k=2)))
    embedded = batcher.submit_embed(queries[:2], transformed=True)
    batcher.start()
    try:
        for i, (future, query) in enumerate(zip(futures, queries, strict=False)):
            got = future.result(10).hits[0]
            want = searcher.search(query, params[i % 2])
            assert [h.id for h in got] == [h.id for h in want]
            np.testing.assert_allclose([h.score for h in got], [h.score for h in want], rtol=1e-5)
        assert [hits[0].id for hits in futures[-1].result(10).hits] == ["doc0", "doc1", "doc2"]
        np.testing.assert_allclose(
            embedded.result(10).vectors, searcher.transform.transform(FakeEncoder().encode(queries[:2])), atol=1e-6
        )
    finally:
        batcher.stop()
    assert sizes[0] == 8 and sum(sizes) == 17 and max(sizes) <= 8  # 12 singles, one 3-query job, one 2-text embed


def test_a_request_that_fails_to_encode_fails_alone(index: Path) -> None:
    """One job's text breaks the encoder (what validation cannot foresee): it gets the error, the jobs batched
    with it are encoded again without it and answered."""

    class Fussy(FakeEncoder):
        def encode(self, texts: list[str]) -> np.ndarray:
            if "boom" in texts:
                raise ValueError("the tokenizer choked")
            return super().encode(texts)

    searcher = Searcher.load(index, encoder=Fussy())
    sizes: list[int] = []
    batcher = Batcher(lambda: searcher, max_batch=8, on_batch=lambda stats: sizes.append(stats.queries))
    good = [batcher.submit_search([f"document number {i} about topic {i % 7}"], SearchParams(k=1)) for i in range(3)]
    bad = batcher.submit_search(["boom"], SearchParams(k=1))
    embedded = batcher.submit_embed(["document number 5"], transformed=False)
    batcher.start()
    try:
        assert [f.result(10).hits[0][0].id for f in good] == ["doc0", "doc1", "doc2"]
        with pytest.raises(ValueError, match="choked"):
            bad.result(10)
        np.testing.assert_allclose(embedded.result(10).vectors, FakeEncoder().encode(["document number 5"]))
    finally:
        batcher.stop()
    assert sizes == [5]  # one batch of all five texts, whatever became of them


@pytest.mark.parametrize("workers", [1, 2])
def test_engine_workers_process_batches_side_by_side(index: Path, workers: int) -> None:
    """Two workers hold two batches at once (both wait at a barrier inside encode); one worker holds one, so its
    second batch can only start after the first left the barrier by timing out."""
    searcher = Searcher.load(index, encoder=FakeEncoder())
    queries = ("document number 1 about topic 1", "document number 2 about topic 2")
    want = [searcher.search(q, SearchParams(k=1))[0].id for q in queries]
    barrier = threading.Barrier(2, timeout=2 if workers == 1 else 30)
    encode = searcher.encode
    met: list[bool] = []

    def encode_at_the_barrier(texts: list[str]) -> np.ndarray:
        try:
            barrier.wait()
            met.append(True)
        except threading.BrokenBarrierError:
            met.append(False)
        return encode(texts)

    searcher.encode = encode_at_the_barrier  # type: ignore[method-assign]
    batcher = Batcher(lambda: searcher, max_batch=1, workers=workers)
    futures = [batcher.submit_search([q], SearchParams(k=1)) for q in queries]
    batcher.start()
    try:
        hits = [future.result(60).hits[0][0].id for future in futures]
    finally:
        batcher.stop(timeout=10)
    assert hits == want
    assert met == ([True, True] if workers == 2 else [False, False])
    with pytest.raises(ValueError, match="workers"):
        Batcher(lambda: searcher, workers=0)


def test_a_failing_batch_hook_ends_neither_the_batch_nor_the_engine(index: Path) -> None:
    """The metrics hook runs after a batch's callers are answered; when it raises, the engine thread goes on (it
    used to end, and every later request waited forever)."""
    searcher = Searcher.load(index, encoder=FakeEncoder())

    def broken_metrics(stats: BatchStats) -> None:
        raise RuntimeError("metrics broke")

    batcher = Batcher(lambda: searcher, max_batch=1, on_batch=broken_metrics)
    batcher.start()
    try:
        for i in range(3):
            future = batcher.submit_search([f"document number {i} about topic {i}"], SearchParams(k=1))
            assert future.result(10).hits[0][0].id == f"doc{i}"  # answered before the hook ran
    finally:
        batcher.stop(timeout=10)


def test_the_engine_lets_its_thread_chooser_time_each_encoding(index: Path) -> None:
    """--torch-threads auto: the chooser picks before each batch's encoding and is told what it cost."""
    searcher = Searcher.load(index, encoder=FakeEncoder())
    encode = searcher.encode

    def slow_encode(texts: list[str]) -> np.ndarray:
        time.sleep(0.01)
        return encode(texts)

    searcher.encode = slow_encode  # type: ignore[method-assign]
    applied: list[int] = []
    chooser = ThreadChooser(applied.append, (1, 2))
    timed: list[tuple[int, int, float]] = []
    record = chooser.record
    chooser.record = lambda q, t, s: (timed.append((q, t, s)), record(q, t, s))  # type: ignore[method-assign]
    batcher = Batcher(lambda: searcher, max_batch=4, threads=chooser)
    futures = [
        batcher.submit_search([f"document number {i} about topic {i % 7}"], SearchParams(k=1)) for i in range(16)
    ]
    batcher.start()
    try:
        assert [f.result(10).hits[0][0].id for f in futures] == [f"doc{i}" for i in range(16)]
    finally:
        batcher.stop(timeout=10)
    assert [q for q, _, _ in timed] == [4, 4, 4, 4]  # one timing per batch, of its queries
    assert [t for _, t, _ in timed] == [1, 1, 1, 2] and applied == [1, 2]  # each setting measured in turn
    assert all(0.01 <= s < 5 for _, _, s in timed)
    assert chooser.describe()["ms_per_query"]["4-7"]["1"] >= 2.5  # 10 ms for 4 queries


def test_calls_run_in_an_engine_thread_and_are_not_batches(index: Path) -> None:
    searcher = Searcher.load(index, encoder=FakeEncoder())
    sizes: list[int] = []
    batcher = Batcher(lambda: searcher, on_batch=lambda stats: sizes.append(stats.queries))
    batcher.start()
    try:
        assert batcher.call(lambda: threading.current_thread().name).result(10).startswith("retrieval-batcher")
        with pytest.raises(ZeroDivisionError):
            batcher.call(lambda: 1 / 0).result(10)
        assert batcher.submit_search(["whitening"], SearchParams(k=1)).result(10).hits[0]
    finally:
        batcher.stop(timeout=10)
    assert sizes == [1]
    assert not batcher.running


def test_auto_threads_warm_every_count_in_the_engine_thread_before_ready(
    tiny_bert: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A newly loaded torch encoder is run at each thread count auto may choose, in the engine thread (where the
    setting and its threads live), before the version is ready; a reload that keeps the encoder does not."""
    import torch

    from retrieval.build import BuildOptions
    from retrieval.encode.spec import EncoderSpec
    from retrieval.serve import service as service_module

    index = tmp_path / "idx"
    corpus = write_corpus(tmp_path / "corpus.parquet", n=60)
    build_index(CorpusSpec(corpus), EncoderSpec(str(tiny_bert), precision="fp32").load(), index, TransformSpec(dim=8))
    seen: list[tuple[int, str]] = []
    real = service_module.set_torch_threads

    def spy(threads: int | None) -> None:
        seen.append((threads or 0, threading.current_thread().name))
        real(threads)

    monkeypatch.setattr(service_module, "set_torch_threads", spy)
    before = torch.get_num_threads()
    service = Service(index, ServeOptions(watch_interval=0))
    try:
        service.start(background=False)
        assert service.ready and service.threads is not None
        warmed = [n for n, name in seen if name.startswith("retrieval-batcher")]
        assert warmed == list(service.threads.choices) and service.threads.current is None
        hits = service.batcher.submit_search(["document number 3 about topic 3"], SearchParams(k=1)).result(30)
        assert hits.hits[0] and service.threads.current == service.threads.choices[0]  # its own choice applied
        seen.clear()
        assert not service.reload().reloaded  # the version served: nothing read
        os.utime(index)  # a new identity, the same version and encoder: loaded, and nothing to warm
        assert service.reload().reloaded
        assert not [n for n, name in seen if name.startswith("retrieval-batcher")]
        # Another encoder (cls pooling): warmed in the engine thread at every count, and the reload thread leaves
        # the process-wide count alone while the old encoder still serves.
        cls = EncoderSpec(str(tiny_bert), pooling="cls", precision="fp32")
        build_index(CorpusSpec(corpus), cls.load(), index, TransformSpec(dim=8), options=BuildOptions(overwrite=True))
        seen.clear()
        assert service.reload().reloaded and service.searcher().encoder.info().pooling == "cls"
        assert seen == [(n, name) for n, name in seen if name.startswith("retrieval-batcher")]
        assert [n for n, _ in seen] == list(service.threads.choices)
    finally:
        service.stop(10)
        torch.set_num_threads(before)


def test_a_new_version_with_another_encoder_is_served_with_its_own(tiny_bert: Path, tmp_path: Path) -> None:
    """The serving encoder is reused while the new version's record matches it; a version rebuilt with another
    pooling gets its own encoder, loaded from its record (queries must be pooled as its documents were)."""
    from retrieval.build import BuildOptions
    from retrieval.encode.spec import EncoderSpec

    index = tmp_path / "idx"
    corpus = write_corpus(tmp_path / "corpus.parquet", n=40)
    build_index(CorpusSpec(corpus), EncoderSpec(str(tiny_bert), precision="fp32").load(), index, TransformSpec(dim=8))
    service = Service(index, ServeOptions(watch_interval=0, torch_threads=1))
    try:
        service.start(background=False)
        first = service.searcher().encoder
        assert first is not None and first.info().pooling == "mean"
        os.utime(index)  # a new identity: loaded again
        assert service.reload().reloaded and service.searcher().encoder is first  # same record: reused
        cls = EncoderSpec(str(tiny_bert), pooling="cls", precision="fp32").load()
        build_index(CorpusSpec(corpus), cls, index, TransformSpec(dim=8), options=BuildOptions(overwrite=True))
        outcome = service.reload()
        assert outcome.reloaded and service.last_error is None
        assert service.searcher().encoder is not first and service.searcher().encoder.info().pooling == "cls"
        found = service.batcher.submit_search(["document number 3 about topic 3"], SearchParams(k=1)).result(30)
        assert found.hits[0][0].id == "doc3" and found.hits[0][0].score == pytest.approx(1.0, abs=1e-4)
    finally:
        service.stop(10)


def test_auto_torch_threads_need_one_engine_worker() -> None:
    with pytest.raises(ConfigError, match="engine_workers"):
        ServeOptions(engine_workers=2).check()
    ServeOptions(engine_workers=2, torch_threads=1).check()
    for bad in (0, "two", True):
        with pytest.raises(ConfigError, match="torch_threads"):
            ServeOptions(torch_threads=bad).check()


def test_a_full_queue_is_refused_and_a_stopped_engine_takes_nothing(index: Path) -> None:
    searcher = Searcher.load(index, encoder=FakeEncoder())
    batcher = Batcher(lambda: searcher, max_queue=4)
    batcher.submit_search(["a", "b", "c"], SearchParams())
    with pytest.raises(Overloaded):
        batcher.submit_search(["d", "e"], SearchParams())
    batcher.start()
    batcher.stop(timeout=10)
    with pytest.raises(Exception, match="shutting down"):
        batcher.submit_search(["f"], SearchParams())


def test_concurrent_http_requests_are_batched(index: Path) -> None:
    # batching, not admission (tested above): on busy cores a burst of 16 waits past the 50 ms budget and is refused
    test_client, _ = serve(index, max_wait_ms=30, max_queue_ms=0)
    with test_client as client:
        wait_ready(client)
        queries = [f"document number {i} about topic {i % 7}" for i in range(16)]
        with ThreadPoolExecutor(16) as pool:
            responses = list(pool.map(lambda q: client.get("/search", params={"q": q, "k": 1}), queries))
        assert [r.json()["results"][0]["hits"][0]["id"] for r in responses] == [f"doc{i}" for i in range(16)]
        batches = metric(client, "retrieval_batch_size_count")
        total = metric(client, "retrieval_batch_size_sum")
        assert total / batches > 1.5, (total, batches)  # warm-up excluded: it runs outside the engine
        assert metric(client, 'retrieval_batch_size_bucket{le="1"}') < batches


# ----- the command -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["serve", "{missing}"], "no index directory"),
        (["serve", "{index}", "--port", "70000"], "--port"),
        (["serve", "{index}", "--max-batch", "0"], "--max-batch"),
        (["serve", "{index}", "--max-wait-ms", "-1"], "--max-wait-ms"),
        (["serve", "{index}", "--fill-wait-ms", "-1"], "--fill-wait-ms"),
        (["serve", "{index}", "--engine-workers", "0"], "--engine-workers"),
        (["serve", "{index}", "--blas-threads", "-2"], "--blas-threads"),
        (["serve", "{index}", "--torch-threads", "many"], "--torch-threads"),
        (["serve", "{index}", "--torch-threads", "0"], "--torch-threads"),
        (["serve", "{index}", "--engine-workers", "2"], "--torch-threads"),  # auto needs one worker
        (["serve", "{index}", "--api-key", "clé"], "--api-key must be printable ASCII"),  # never matchable
        (["serve", "{index}", "--api-key", " key"], "--api-key must be printable ASCII"),
        (["serve", "{index}", "--max-k", "20000"], "--max-k must be at most 10,000"),
        (["serve", "{index}", "--shutdown-timeout", "-5"], "--shutdown-timeout must be 0 or more seconds"),
    ],
)
def test_serve_refuses_bad_options_in_one_line_before_starting(
    index: Path, tmp_path: Path, args: list[str], message: str, monkeypatch
) -> None:
    """Refused before the server starts. The server's run is replaced, so that an option let through fails this
    test instead of starting a real server on port 8000 that never stops."""
    from typer.testing import CliRunner

    from retrieval.cli.app import app
    from retrieval.serve import app as server

    started: list[ServeOptions] = []
    monkeypatch.setattr(server, "run", lambda directory, options, **kwargs: started.append(options))
    argv = [a.format(index=index, missing=tmp_path / "missing") for a in args]
    sigint = signal.getsignal(signal.SIGINT)
    try:
        result = CliRunner().invoke(app, argv)
    finally:
        signal.signal(signal.SIGINT, sigint)  # served, the command ignores Ctrl-C for the interpreter's exit
    assert not started
    assert result.exit_code == 1 and message in result.stderr and "Traceback" not in result.stderr


def test_serve_hands_the_batching_options_typed_to_the_server(index: Path, monkeypatch) -> None:
    """`retrieval serve --max-batch --max-wait-ms --fill-wait-ms`: the values typed are the ones served (the
    server's run is replaced: nothing listens)."""
    from typer.testing import CliRunner

    from retrieval.cli.app import app
    from retrieval.serve import app as server

    served: list[ServeOptions] = []
    monkeypatch.setattr(server, "run", lambda directory, options, **kwargs: served.append(options))
    argv = ["serve", str(index), "--max-batch", "5", "--max-wait-ms", "1.5", "--fill-wait-ms", "7"]
    sigint = signal.getsignal(signal.SIGINT)
    try:
        result = CliRunner().invoke(app, argv)
    finally:
        signal.signal(signal.SIGINT, sigint)  # served, the command ignores Ctrl-C for the interpreter's exit
    assert result.exit_code == 0, result.stderr
    assert [(options.max_batch, options.max_wait_ms, options.fill_wait_ms) for options in served] == [(5, 1.5, 7.0)]


def test_a_request_without_k_gets_the_default_or_the_server_s_max_k_when_lower(index: Path) -> None:
    """With --max-k below 10, leaving k out was refused ("`k` must be between 1 and 7 (got 10)")."""
    test_client, _ = serve(index, max_k=7)
    with test_client:
        wait_ready(test_client)
        got = test_client.get("/search", params={"q": "document number 3"})
        assert got.status_code == 200 and len(got.json()["results"][0]["hits"]) == 7, got.text
        posted = test_client.post("/search", json={"queries": ["document number 3", "topic 2"]})
        assert posted.status_code == 200 and [len(r["hits"]) for r in posted.json()["results"]] == [7, 7]
        assert test_client.get("/search", params={"q": "a", "k": 8}).status_code == 422
        spec = test_client.get("/openapi.json").json()
        assert spec["components"]["schemas"]["SearchRequest"]["properties"]["k"]["default"] == 7  # what is used
    test_client, _ = serve(index)
    with test_client:
        wait_ready(test_client)
        assert len(test_client.get("/search", params={"q": "document 3"}).json()["results"][0]["hits"]) == 10


def test_a_max_k_beyond_what_a_search_returns_is_refused() -> None:
    """--max-k 20000 was accepted and advertised (spec, /info, the page) while every k over 10,000 was refused."""
    with pytest.raises(ConfigError, match="`max_k` must be at most 10,000"):
        ServeOptions(max_k=20_000).check()
    ServeOptions(max_k=10_000).check()


@pytest.mark.parametrize("key", ["clé", " key", ""])
def test_the_app_refuses_a_key_no_client_can_send(index: Path, key: str) -> None:
    """The library's create_app checks the key as the command does (a non-ASCII key would never match)."""
    with pytest.raises(ConfigError, match="printable ASCII"):
        create_app(Service(index, ServeOptions(), encoder=FakeEncoder()), api_key=key)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_engine_runs_with_the_blas_threads_asked(index: Path, threads: int) -> None:
    """Every BLAS the process has loaded (numpy's, FAISS's) runs as many threads as asked in the engine thread,
    where the flat scans' products run (OpenBLAS's spinning threads took the core the forward pass needed)."""
    from threadpoolctl import threadpool_info, threadpool_limits

    encoder = FakeEncoder()
    encode = encoder.encode
    seen: list[set[int]] = []

    def spy(texts: Any) -> Any:
        seen.append({pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"})
        return encode(texts)

    encoder.encode = spy  # type: ignore[method-assign]
    with threadpool_limits(None):  # whatever the service sets is undone after the test
        service = Service(index, ServeOptions(watch_interval=0, blas_threads=threads), encoder=encoder)
        test_client = TestClient(create_app(service))
        with test_client:
            wait_ready(test_client)
            assert test_client.post("/embed", json={"inputs": ["a text"]}).status_code == 200
            assert test_client.get("/info").json()["server"]["threads"]["blas"] == threads
    assert seen and seen[-1] == {min(threads, os.cpu_count() or 1)}


# ----- engine limits, draining and isolation (each kills a mutant the tests above let through) -----------------
def wait_for(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_the_queue_holds_exactly_max_queue_queries_and_an_idle_one_takes_a_larger_job(index: Path) -> None:
    searcher = Searcher.load(index, encoder=FakeEncoder())
    batcher = Batcher(lambda: searcher, max_queue=4)
    batcher.submit_search(["a", "b", "c"], SearchParams(k=1))
    fourth = batcher.submit_search(["d"], SearchParams(k=1))  # 4 of 4: still taken
    assert batcher.queued == 4
    with pytest.raises(Overloaded):
        batcher.submit_search(["e"], SearchParams(k=1))
    batcher.start()
    try:
        assert fourth.result(10).hits[0]
        wait_for(lambda: batcher.queued == 0)  # every query of a batch of several jobs leaves the count
        # an empty queue takes a job larger than the limit (it could never be taken otherwise), as a batch of its own
        big = batcher.submit_search([f"document number {i}" for i in range(6)], SearchParams(k=1))
        assert len(big.result(10).hits) == 6
        wait_for(lambda: batcher.queued == 0)
        more = [batcher.submit_search([f"q{i}"], SearchParams(k=1)) for i in range(4)]  # not refused by a stale count
        assert all(f.result(10).hits[0] for f in more)
    finally:
        batcher.stop(timeout=10)


class SlowEncoder(FakeEncoder):
    """20 ms per text: an engine of known pace."""

    def encode(self, texts: Any) -> np.ndarray:
        time.sleep(0.02 * len(texts))
        return super().encode(texts)


def test_the_queue_is_bounded_by_the_time_its_work_takes_too(index: Path) -> None:
    """``max_queue_wait``: a request is refused at once (``Overloaded``, HTTP 429) when the queries ahead of it
    and its own would take the engine longer than that at its measured pace, here 20 ms a query and 100 ms:
    about five wait, however many ``max_queue`` allows; a job alone in the queue is always taken."""
    searcher = Searcher.load(index, encoder=SlowEncoder())
    batcher = Batcher(lambda: searcher, max_batch=1, max_queue=1000, max_queue_wait=0.1)
    batcher.start()
    running, release = threading.Event(), threading.Event()
    try:
        batcher.submit_search(["a"], SearchParams(k=1)).result(10)  # the pace: one batch measured
        assert batcher.expected_wait(1) >= 0.02
        batcher.call(lambda: (running.set(), release.wait(10)))  # the engine busy: what follows waits
        assert running.wait(10)
        accepted = []
        with pytest.raises(Overloaded, match="the limit is 100 ms"):
            for i in range(100):
                accepted.append(batcher.submit_search([f"q{i}"], SearchParams(k=1)))
        assert 1 <= len(accepted) <= 5 and batcher.expected_wait(1) > 0.1
        batcher.max_queue_wait = 0  # those taken are answered, however long this took (not refused as late)
        release.set()
        assert all(f.result(10).hits[0] for f in accepted)  # those taken are answered
        wait_for(lambda: batcher.queued == 0)
        assert batcher.submit_search(["again"], SearchParams(k=1)).result(10).hits[0]  # and new work taken again
    finally:
        release.set()
        batcher.stop(timeout=10)


def test_the_cost_of_a_batch_is_fitted_as_a_fixed_part_and_a_part_per_query(index: Path) -> None:
    """Batches of one size alone tell only what such a batch costs: a batch of 1 (20 ms) sets the fixed part,
    so 100 queued queries are 13 batches of at most 8, 260 ms, not 100 of 20 ms. Batches of other sizes measure
    the part per query (here all of it: 20 ms a query, no fixed part)."""
    searcher = Searcher.load(index, encoder=SlowEncoder())
    seconds: list[float] = []
    # a budget turns the cost fit on; one no wait here comes near, so a busy machine refuses nothing as late
    batcher = Batcher(lambda: searcher, max_batch=8, max_queue_wait=60, on_batch=lambda b: seconds.append(b.seconds))
    batcher.start()
    try:
        batcher.submit_search(["alone"], SearchParams(k=1)).result(10)
        wait_for(lambda: len(seconds) == 1)
        fixed, per_query = batcher.batch_cost
        assert fixed == pytest.approx(seconds[0], abs=0.002) and fixed >= 0.02 and per_query == 0.0
        assert batcher.expected_wait(100) == pytest.approx(13 * fixed)
        batcher.submit_search([f"q{i}" for i in range(4)], SearchParams(k=1)).result(10)
        fixed, per_query = batcher.batch_cost
        assert fixed < seconds[0] and per_query >= 0.015  # most of a batch's cost is now per query
        assert batcher.expected_wait(1) >= 0.02  # 20 ms a query
    finally:
        batcher.stop(timeout=10)


def test_a_full_queue_is_a_429_that_says_when_to_retry(index: Path) -> None:
    service = Service(index, ServeOptions(watch_interval=0, max_queue_ms=30, max_batch=1), encoder=SlowEncoder())
    with TestClient(create_app(service)) as client:
        wait_for(lambda: client.get("/ready").status_code == 200)
        client.post("/search", json={"query": "pace"})
        running, release = threading.Event(), threading.Event()
        service.batcher.call(lambda: (running.set(), release.wait(10)))
        assert running.wait(10)
        try:
            # one waiting (always taken), and one more would be two queries of >= 20 ms: over 30 ms
            answers = [service.batcher.submit_search(["waiting"], SearchParams(k=1))]
            response = client.post("/search", json={"query": "one too many"})
        finally:
            service.batcher.max_queue_wait = 0  # the held query is answered, however long this took
            release.set()
        assert response.status_code == 429 and response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "overloaded" and "the limit is 30 ms" in response.text
        assert all(a.result(10).hits for a in answers)
        assert client.get("/info").json()["server"]["limits"]["max_queue_ms"] == 30


def test_requests_admitted_but_not_yet_queued_count_as_work_ahead(index: Path) -> None:
    """``admit`` lets a request in before its body is read: until it is submitted, it counts as one query of
    work ahead of later ones (a batch of 2 of at least 40 ms, a budget of 1.5 batches: two admitted, the third
    refused, whatever the machine's speed). Submitting one with its
    admission is never refused (it was counted when let in); releasing one that never reached the engine frees
    its place."""
    searcher = Searcher.load(index, encoder=SlowEncoder())
    batcher = Batcher(lambda: searcher, max_batch=2, max_queue_wait=1.0)
    batcher.start()
    try:
        batcher.submit_search(["a", "b"], SearchParams(k=1)).result(10)  # the pace: a full batch measured
        fixed, _ = batcher.batch_cost
        assert fixed >= 0.04 and batcher.pace >= 0.02
        batcher.max_queue_wait = 1.5 * fixed
        first, second = batcher.admit(), batcher.admit()
        assert batcher.pending == 2 and batcher.expected_wait() == pytest.approx(fixed)
        with pytest.raises(Overloaded, match="the limit is"):
            batcher.admit()
        assert batcher.refused == {"edge": 1, "queue": 0, "late": 0}
        with pytest.raises(Overloaded):  # one not admitted is checked at submission against the admitted too
            batcher.submit_search(["unadmitted"], SearchParams(k=1))
        assert batcher.refused == {"edge": 1, "queue": 1, "late": 0}
        answer = batcher.submit_search(["admitted"], SearchParams(k=1), admission=first)
        assert batcher.pending == 1
        second.release()
        second.release()  # idempotent
        assert batcher.pending == 0
        assert answer.result(10).hits[0]
        result = answer.result()
        assert result.waited >= 0 and result.ran >= 0.02  # its batch encoded for 20 ms
    finally:
        batcher.stop(timeout=10)


def test_one_slow_batch_counts_at_most_three_times_what_the_model_said(index: Path) -> None:
    """A single pathological batch (here 1 s where batches take 20 ms) must not set the cost for the batches
    after it: it counts as at most 3x the prediction, and a lasting slowdown is followed 3x a batch."""
    searcher = Searcher.load(index, encoder=SlowEncoder())
    batcher = Batcher(lambda: searcher)
    batcher._paced(1, 0.02)
    batcher._paced(1, 1.0)
    fixed, _ = batcher.batch_cost
    assert fixed < 0.06
    for _ in range(3):
        batcher._paced(1, 1.0)
    assert batcher.batch_cost[0] > 0.1  # it keeps being slow: followed


def test_the_work_ahead_counts_what_is_left_of_the_running_batch(index: Path) -> None:
    """A request queued behind a batch that has just begun waits for all of it: the expected wait counts what
    is left of it at the engine's pace (here 2 queries of 20 ms: about 40 ms, falling as it runs, 0 once done)."""
    searcher = Searcher.load(index, encoder=SlowEncoder())
    batcher = Batcher(lambda: searcher, max_batch=2)
    batcher.start()
    try:
        batcher.submit_search(["a", "b"], SearchParams(k=1)).result(10)  # the pace
        assert batcher.expected_wait() == 0.0
        running = batcher.submit_search(["c", "d"], SearchParams(k=1))
        wait_for(lambda: batcher.queued == 0)
        assert 0.0 < batcher.expected_wait() <= 2 * batcher.pace + 1e-9
        running.result(10)
        wait_for(lambda: batcher.expected_wait() == 0.0)
    finally:
        batcher.stop(timeout=10)


@pytest.mark.parametrize(("budget", "refused", "behind"), [(0.05, 1, True), (0.0, 0, True), (0.05, 0, False)])
def test_a_request_that_waited_longer_than_the_budget_is_refused_not_served_late(
    index: Path, budget: float, refused: int, behind: bool
) -> None:
    """Admission estimates; when the engine turns out slower than it said, a request taken after waiting longer
    than ``max_queue_wait`` gets ``Overloaded`` (429) instead of a late answer, so that the requests queued behind
    it are served sooner. The one that did not wait so long, in the same batch, is answered; with no budget (0),
    or with nothing queued behind the batch (refusing would speed up no one), nothing is refused so."""
    running, release = threading.Event(), threading.Event()

    class Blocking(FakeEncoder):
        def encode(self, texts: Any) -> np.ndarray:
            if "block" in texts:
                running.set()
                release.wait(10)
            return super().encode(texts)

    searcher = Searcher.load(index, encoder=Blocking())
    batcher = Batcher(lambda: searcher, max_batch=2, max_queue_wait=budget)
    batcher.start()
    try:
        blocking = batcher.submit_search(["block"], SearchParams(k=1))  # a batch the engine is slower on
        assert running.wait(10)
        early = batcher.submit_search(["early"], SearchParams(k=1))
        time.sleep(0.08)
        late = batcher.submit_search(["late"], SearchParams(k=1))  # one batch: 80 ms and about none
        after = [batcher.submit_search(["after"], SearchParams(k=1))] if behind else []  # the next batch
        release.set()
        assert late.result(10).hits[0] and all(job.result(10).hits[0] for job in after)
        if refused:
            with pytest.raises(Overloaded, match="longer than the limit of 50 ms"):
                early.result(10)
        else:
            assert early.result(10).hits[0]
        assert batcher.refused["late"] == refused and blocking.result(10).hits[0]
    finally:
        release.set()
        batcher.stop(timeout=10)


def test_waiting_behind_a_call_or_for_a_batch_to_fill_is_not_lateness(index: Path) -> None:
    """Time behind the server's own work in the engine (a call: warming a new version) and the engine's own
    wait for a batch to fill (``max_wait``) are not counted against ``max_queue_wait``."""
    searcher = Searcher.load(index, encoder=FakeEncoder())
    batcher = Batcher(lambda: searcher, max_batch=8, max_queue_wait=0.02, max_wait=0.05)
    running, release = threading.Event(), threading.Event()
    batcher.start()
    try:
        batcher.call(lambda: (running.set(), release.wait(10)))
        assert running.wait(10)
        behind = batcher.submit_search(["behind a call"], SearchParams(k=1))
        time.sleep(0.08)
        release.set()
        assert behind.result(10).hits[0]
        assert batcher.submit_search(["alone, waiting 50 ms for company"], SearchParams(k=1)).result(10).hits[0]
        assert batcher.refused["late"] == 0
    finally:
        release.set()
        batcher.stop(timeout=10)


def _engine_busy_and_budget_spent(service: Service, client: TestClient) -> tuple[threading.Event, list[Any]]:
    """The engine's pace learnt (20 ms a query), its thread held, and one query queued: one more is 40 ms."""
    client.post("/search", json={"query": "pace"})
    running, release = threading.Event(), threading.Event()
    service.batcher.call(lambda: (running.set(), release.wait(10)))
    assert running.wait(10)
    return release, [service.batcher.submit_search(["waiting"], SearchParams(k=1))]


def test_an_overloaded_server_refuses_before_reading_the_body(index: Path) -> None:
    """The 429 comes before the body is read or parsed (ASGI ``receive`` is never called, and a body that is
    not even JSON gets 429, not 422), with ``Retry-After``; a request without the API key still gets its 401;
    /health is never refused; /info and /metrics show the admission state."""
    options = ServeOptions(watch_interval=0, max_queue_ms=30, max_batch=1)
    service = Service(index, options, encoder=SlowEncoder())
    app = create_app(service, api_key="k" * 20)
    auth = {"Authorization": "Bearer " + "k" * 20}
    with TestClient(app) as client:
        wait_for(lambda: client.get("/ready", headers=auth).status_code == 200)
        release, answers = _engine_busy_and_budget_spent(service, TestClient(app, headers=auth))
        try:
            json_type = {**auth, "Content-Type": "application/json"}
            response = client.post("/search", content=b"{not json", headers=json_type)
            assert response.status_code == 429 and response.headers["retry-after"] == "1"
            assert response.json()["error"]["code"] == "overloaded" and "the limit is 30 ms" in response.text
            assert response.headers["x-content-type-options"] == "nosniff"
            assert client.post("/search", json={"query": "no key"}).status_code == 401
            assert client.post("/v1/embeddings", json={"model": "m", "input": "x"}, headers=auth).status_code == 429
            assert client.get("/search", params={"q": "x"}, headers=auth).status_code == 429
            assert client.get("/health").status_code == 200

            sent: list[dict[str, Any]] = []

            async def receive() -> dict[str, Any]:
                raise AssertionError("the body was read")

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)

            scope = {
                "type": "http",
                "asgi": {"version": "3.0"},
                "http_version": "1.1",
                "method": "POST",
                "scheme": "http",
                "path": "/embed",
                "raw_path": b"/embed",
                "query_string": b"",
                "root_path": "",
                "headers": [(b"host", b"testserver"), (b"authorization", auth["Authorization"].encode())],
                "client": ("127.0.0.1", 1),
                "server": ("testserver", 80),
                "state": {},
            }
            client.portal.call(app, scope, receive, send)  # type: ignore[union-attr]
            assert sent[0]["status"] == 429

            info = client.get("/info", headers=auth).json()["server"]["admission"]
            assert info["queued_queries"] == 1 and info["admitted_requests"] == 0
            assert info["pace_ms_per_query"] >= 20 and info["expected_wait_ms"] >= 20 and info["max_queue_ms"] == 30
            assert info["refused"] == {"edge": 4, "queue": 0, "late": 0}
            text = client.get("/metrics", headers=auth).text
            wait = next(line for line in text.splitlines() if line.startswith("retrieval_admission_expected_wait_s"))
            assert float(wait.split()[1]) >= 0.02
            assert 'retrieval_errors_total{code="overloaded"} 4' in text
            assert 'retrieval_requests_total{method="POST",route="/search",status="429"} 1' in text
        finally:
            service.batcher.max_queue_wait = 0  # the held query is answered, however long this took
            release.set()
        assert all(a.result(10).hits for a in answers)
        assert service.batcher.pending == 0


def test_answers_say_where_their_time_went(client: TestClient) -> None:
    """``Server-Timing`` on the engine's routes: the app's time, of which the queue's and the engine's."""
    timing = client.post("/search", json={"query": QUERY}).headers["server-timing"]
    parts = dict(part.strip().split(";dur=") for part in timing.split(","))
    assert set(parts) == {"app", "queue", "engine"}
    assert float(parts["app"]) >= float(parts["queue"]) + float(parts["engine"]) - 0.5 >= -0.5
    assert "app;dur=" in client.post("/search", json={}).headers["server-timing"]  # a 422 too: no engine part
    assert "server-timing" not in client.get("/health").headers


def test_embedding_jobs_get_their_token_counts_from_the_engine_thread(index: Path) -> None:
    encoder = FakeEncoder()
    searcher = Searcher.load(index, encoder=encoder)
    seen: list[str] = []
    original = searcher.token_counts

    def counted(texts: Any) -> list[int]:
        seen.append(threading.current_thread().name)
        return original(texts)

    searcher.token_counts = counted  # type: ignore[method-assign]
    batcher = Batcher(lambda: searcher)
    batcher.start()
    try:
        texts = ["one two three", "four"]
        result = batcher.submit_embed(texts, count_tokens=True).result(10)
        assert result.tokens == original(texts) == [3, 1]
        assert batcher.submit_embed(texts).result(10).tokens is None
        assert seen == ["retrieval-batcher-0"]
    finally:
        batcher.stop(timeout=10)


def test_stop_answers_every_queued_job_before_the_engine_ends(index: Path) -> None:
    """Shutdown drains: jobs queued while a batch runs are still answered after stop() was called."""
    searcher = Searcher.load(index, encoder=FakeEncoder())
    batcher = Batcher(lambda: searcher, max_batch=32)
    running, release = threading.Event(), threading.Event()
    batcher.start()
    blocker = batcher.call(lambda: (running.set(), release.wait(10)))
    assert running.wait(10)
    queued = [batcher.submit_search([f"document number {i} about topic {i % 7}"], SearchParams(k=1)) for i in range(3)]
    stopper = threading.Thread(target=batcher.stop, kwargs={"timeout": 10})
    stopper.start()
    wait_for(lambda: not batcher.running)  # stopping: no new work from here on
    release.set()
    stopper.join(15)
    assert not stopper.is_alive() and blocker.done()
    assert [f.result(0).hits[0][0].id for f in queued] == ["doc0", "doc1", "doc2"]


@pytest.mark.parametrize("workers", [1, 2])
def test_stop_ends_every_idle_worker_at_once(index: Path, workers: int) -> None:
    searcher = Searcher.load(index, encoder=FakeEncoder())
    batcher = Batcher(lambda: searcher, workers=workers)
    batcher.start()
    assert batcher.submit_search(["whitening"], SearchParams(k=1)).result(10).hits[0]
    began = time.monotonic()
    batcher.stop(timeout=10)
    assert time.monotonic() - began < 5  # every waiting worker woken, not left to the join's timeout
    assert not any(thread.is_alive() for thread in batcher._threads)


def recording_batcher(searcher: Searcher, **options: Any) -> tuple[Batcher, list[int]]:
    """A Batcher over one searcher, and the query count of each batch it ran, in order."""
    sizes: list[int] = []
    return Batcher(lambda: searcher, on_batch=lambda stats: sizes.append(stats.queries), **options), sizes


@pytest.mark.parametrize("fill_wait", [0.0, 0.001])
def test_the_engine_waits_up_to_max_wait_for_more_queries(index: Path, fill_wait: float) -> None:
    """max_wait: a job taken alone waits for more; one arriving meanwhile joins its batch. (Whenever the second
    job comes, within the 10 s, the two are one batch; without the wait they are only when it comes first.)
    After a full batch of 2, the lone job is smaller than the last, so the fill wait applies too: the longer of
    the two is waited (an operator's 10 s max wait holds while a 1 ms fill wait applies)."""
    batcher, sizes = recording_batcher(
        Searcher.load(index, encoder=FakeEncoder()), max_batch=2, max_wait=10.0, fill_wait=fill_wait
    )
    batcher.start()
    try:
        batcher.submit_search(["document number 1"] * 2, SearchParams(k=1)).result(10)  # full: no wait
        first = batcher.submit_search(["document number 1 about topic 1"], SearchParams(k=1))
        time.sleep(0.2)  # the engine has taken it and waits (up to 10 s) for a second query
        second = batcher.submit_search(["document number 2 about topic 2"], SearchParams(k=1))
        assert [f.result(10).hits[0][0].id for f in (first, second)] == ["doc1", "doc2"]
    finally:
        batcher.stop(timeout=10)
    assert sizes == [2, 2]  # one batch of both, answered as soon as it was full (not after the 10 s)


def test_a_batch_smaller_than_the_last_waits_up_to_fill_wait_for_the_rest(index: Path) -> None:
    """fill_wait: the first batch takes the 3 queued before the engine started without waiting (no client has
    been answered yet); after it, a job taken alone waits for 2 more (they come 0.2 s later, well within the
    3 s); after that, a job alone waits in vain, once, and then one job alone (the last batch held one) does not
    wait at all."""
    batcher, sizes = recording_batcher(Searcher.load(index, encoder=FakeEncoder()), max_batch=8, fill_wait=3.0)

    def submit(n: int) -> list:
        return [batcher.submit_search([f"document number {i}"], SearchParams(k=1)) for i in range(n)]

    waited = submit(3)  # queued before the engine starts: one batch of 3, which sets the target
    began = time.monotonic()
    batcher.start()
    try:
        [f.result(10) for f in waited]
        assert time.monotonic() - began < 1.5  # all there is: no batch answered yet, so nothing to wait for
        alone = submit(1)
        time.sleep(0.2)  # the engine has taken it and waits for two more
        [f.result(10) for f in alone + submit(2)]
        began = time.monotonic()
        [f.result(10) for f in submit(1)]  # waits the 3 s: the last batch took 3
        assert time.monotonic() - began > 2.9
        began = time.monotonic()
        [f.result(10) for f in submit(1)]  # the last batch took 1: no wait
        assert time.monotonic() - began < 1.5
    finally:
        batcher.stop(timeout=10)
    assert sizes == [3, 3, 1, 1]


@pytest.mark.parametrize("requests", [[1, 1], [2]], ids=["two requests", "one request of two queries"])
def test_the_fill_target_counts_the_queries_that_waited_during_the_last_batch(index: Path, requests: list[int]) -> None:
    """Closed-loop clients: one query is being answered while two more wait. The next batch takes the two and
    waits for a third (the answered client's next query), so the batches settle at the number of clients; a
    target of the last batch's size alone (one) would split them into 2 + 1. The two are counted as queries,
    whether two requests or one request of two (counting requests, the latter made a target of two)."""
    gate = threading.Event()

    class Gated(FakeEncoder):
        def encode(self, texts: list[str]) -> np.ndarray:
            if "slow" in texts:
                assert gate.wait(10)
            return super().encode(texts)

    batcher, sizes = recording_batcher(Searcher.load(index, encoder=Gated()), max_batch=8, fill_wait=3.0)
    batcher.start()
    try:
        slow = batcher.submit_search(["slow"], SearchParams(k=1))
        deadline = time.monotonic() + 10
        while batcher.queued and time.monotonic() < deadline:  # the engine has taken it and is encoding
            time.sleep(0.01)
        waiting = [
            batcher.submit_search([f"document number {i}"] * n, SearchParams(k=1)) for i, n in enumerate(requests)
        ]
        gate.set()
        slow.result(10)
        time.sleep(0.2)  # the engine has taken the two and waits for one more
        last = batcher.submit_search(["document number 5"], SearchParams(k=1))
        [f.result(10) for f in waiting + [last]]
    finally:
        batcher.stop(timeout=10)
    assert sizes == [1, 3]


def test_the_fill_target_counts_the_queries_of_the_last_batch_not_its_requests(index: Path) -> None:
    """After a batch of one request of three queries, a request of one query waits for two more queries (one
    request each, 0.2 s apart, well within the 3 s fill wait): the batches hold what the clients send, three
    queries. Counting the last batch's requests (one) sent the single query alone."""
    batcher, sizes = recording_batcher(Searcher.load(index, encoder=FakeEncoder()), max_batch=8, fill_wait=3.0)
    batcher.start()
    try:
        batcher.submit_search(["document number 1"] * 3, SearchParams(k=1)).result(10)
        deadline = time.monotonic() + 10
        while not sizes and time.monotonic() < deadline:  # the engine is done with the batch of three
            time.sleep(0.01)
        futures = []
        for i in range(3):
            if i:
                time.sleep(0.2)  # the engine has taken the first and waits for more
            futures.append(batcher.submit_search([f"document number {i}"], SearchParams(k=1)))
        [f.result(10) for f in futures]
    finally:
        batcher.stop(timeout=10)
    assert sizes == [3, 3]


@pytest.mark.parametrize("error", [ValueError("the tokenizer choked"), ConfigError("the query is too long", "query")])
def test_a_request_error_of_one_job_fails_only_that_job(index: Path, error: Exception) -> None:
    """A ConfigError raised for one request's text is that request's fault too: the others are answered."""

    class Fussy(FakeEncoder):
        def encode(self, texts: list[str]) -> np.ndarray:
            if "boom" in texts:
                raise error
            return super().encode(texts)

    searcher = Searcher.load(index, encoder=Fussy())
    batcher = Batcher(lambda: searcher, max_batch=8)
    good = [batcher.submit_search([f"document number {i} about topic {i % 7}"], SearchParams(k=1)) for i in range(2)]
    bad = batcher.submit_search(["boom"], SearchParams(k=1))
    batcher.start()
    try:
        assert [f.result(10).hits[0][0].id for f in good] == ["doc0", "doc1"]
        with pytest.raises(type(error), match=str(error)):
            bad.result(10)
    finally:
        batcher.stop(timeout=10)


def test_a_search_that_fails_fails_only_its_own_group_and_the_engine_goes_on(index: Path) -> None:
    """Jobs with other knobs are searched apart: knobs FAISS refuses fail that group, not the batch or the engine."""
    searcher = Searcher.load(index, encoder=FakeEncoder())
    batcher = Batcher(lambda: searcher, max_batch=8)
    bad = batcher.submit_search(["document number 3 about topic 3"], SearchParams(k=0))
    good = batcher.submit_search(["document number 4 about topic 4"], SearchParams(k=1))
    batcher.start()
    try:
        with pytest.raises(ConfigError, match="`k` must be"):
            bad.result(10)
        assert good.result(10).hits[0][0].id == "doc4"
        assert batcher.submit_search(["document number 5"], SearchParams(k=1)).result(10).hits[0]
    finally:
        batcher.stop(timeout=10)


def test_a_cancelled_job_is_skipped_and_the_others_are_answered(index: Path) -> None:
    batcher, sizes = recording_batcher(Searcher.load(index, encoder=FakeEncoder()), max_batch=8)
    futures = [batcher.submit_search([f"document number {i} about topic {i % 7}"], SearchParams(k=1)) for i in range(3)]
    assert futures[1].cancel()  # the client went away while its job waited
    batcher.start()
    try:
        assert [futures[i].result(10).hits[0][0].id for i in (0, 2)] == ["doc0", "doc2"]
        assert batcher.submit_search(["document number 6"], SearchParams(k=1)).result(10).hits[0]  # engine alive
    finally:
        batcher.stop(timeout=10)
    assert sizes == [2, 1]  # the cancelled job's text was not encoded


# ----- the watcher -----------------------------------------------------------------------------------------------
def test_the_watcher_reloads_a_replaced_directory_once_and_a_refused_one_not_again(index: Path, tmp_path: Path) -> None:
    """Unchanged: never loaded again. A replacement that fails to load: refused once (not retried every interval),
    the old version serving on; the next good replacement is served and clears the error."""
    test_client, service = serve(index, watch_interval=0.01)
    with test_client as client:
        wait_ready(client)
        time.sleep(0.3)  # ~30 looks at an unchanged directory
        assert service.reloads == {"ok": 1, "failed": 0}
        good = Path(shutil.copytree(index, tmp_path / "good"))
        broken = Path(shutil.copytree(index, tmp_path / "broken"))
        data = bytearray((broken / INDEX).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (broken / INDEX).write_bytes(bytes(data))
        os.rename(index, tmp_path / "old")
        os.rename(broken, index)  # a replacement that fails its checksums
        wait_for(lambda: service.reloads["failed"] == 1)
        time.sleep(0.3)  # ~30 more looks at the refused version
        assert service.reloads == {"ok": 1, "failed": 1} and "checksum" in (service.last_error or "")
        assert client.get("/search", params={"q": QUERY, "k": 1}).json()["generation"] == 1
        os.rename(index, tmp_path / "broken-again")
        os.rename(good, index)
        wait_for(lambda: service.reloads["ok"] == 2)
        assert service.last_error is None and service.last_error_at is None
        assert client.get("/search", params={"q": QUERY, "k": 1}).status_code == 200


# ----- engine settings and batch statistics (each kills a mutant the tests above let through) -----------------
@pytest.mark.parametrize(
    "bad", [{"max_batch": 0}, {"max_wait": -0.001}, {"fill_wait": -0.001}, {"max_queue": 0}, {"workers": 0}]
)
def test_the_engine_refuses_settings_it_cannot_work_with(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        Batcher(lambda: pytest.fail("never called"), **bad)


def test_batch_results_name_their_version_and_stats_time_the_oldest_job(index: Path, tmp_path: Path) -> None:
    """Every answer carries the generation of the version that gave it; ``waited`` is how long the batch's oldest
    job queued (what a client of the batch waited at most)."""
    add_documents(index, tmp_path, 0)  # generation 2
    searcher = Searcher.load(index, encoder=FakeEncoder())
    stats: list[BatchStats] = []
    batcher = Batcher(lambda: searcher, max_batch=8, on_batch=stats.append)
    futures = [batcher.submit_search([f"document number {i} about topic {i}"], SearchParams(k=1)) for i in range(3)]
    embedded = batcher.submit_embed(["whitening"])
    cancelled = batcher.submit_search(["a request whose client went away", "and its second query"], SearchParams())
    assert cancelled.cancel()  # neither encoded nor counted
    batcher._jobs[-1].enqueued -= 500.0  # ... nor its time in the queue
    batcher._jobs[0].enqueued -= 100.0  # the first job has queued 100 s longer (a fake clock: no sleep)
    batcher.start()
    try:
        results = [f.result(10) for f in futures]
        assert [r.hits[0][0].id for r in results] == ["doc0", "doc1", "doc2"]
        assert [r.generation for r in results] == [2, 2, 2] and embedded.result(10).generation == 2
    finally:
        batcher.stop(timeout=10)
    assert [(s.queries, s.jobs) for s in stats] == [(4, 4)]
    assert 100.0 <= stats[0].waited < 150.0 and 0 <= stats[0].seconds < 10


# ----- the service's options ---------------------------------------------------------------------------------
def test_serve_options_defaults_are_the_measured_ones() -> None:
    """`serve` takes its defaults from ServeOptions: B = 32, T = 0 ms and a fill wait of 2 ms (measured, see its
    comments), a reload fully checked, at most 100 hits a query."""
    options = ServeOptions()
    assert (options.max_batch, options.max_wait_ms, options.fill_wait_ms) == (32, 0.0, 2.0)
    assert (options.verify, options.max_k) == ("full", 100)


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"max_wait_ms": 3600.5}, "max_wait_ms"),
        ({"fill_wait_ms": -1}, "fill_wait_ms"),
        ({"watch_interval": 3601}, "watch_interval"),
        ({"max_rescore": -1}, "max_rescore"),
        ({"verify": "fast"}, "verify"),
        ({"max_queue": 0}, "max_queue"),
        ({"max_batch": 0}, "max_batch"),
        ({"engine_workers": 0}, "engine_workers"),  # not "with engine_workers above 1, give torch_threads"
        ({"engine_workers": -2, "torch_threads": 2}, "engine_workers"),
    ],
)
def test_serve_options_refuse_each_bad_value_by_name(options: dict[str, Any], name: str) -> None:
    with pytest.raises(ConfigError) as refused:
        ServeOptions(**options).check()
    assert refused.value.param == name
    ServeOptions(max_wait_ms=3600, watch_interval=0, max_rescore=0, verify="none").check()  # the bounds are taken


def test_the_service_hands_its_options_to_the_engine(tmp_path: Path) -> None:
    options = ServeOptions(max_batch=3, max_wait_ms=250, fill_wait_ms=5, max_queue=7, engine_workers=2, torch_threads=1)
    batcher = Service(tmp_path, options).batcher  # nothing loaded before start()
    assert (batcher.max_batch, batcher.max_wait, batcher.fill_wait) == (3, 0.25, 0.005)
    assert (batcher.max_queue, batcher.workers) == (7, 2)


def test_info_shows_the_batching_settings_served(index: Path) -> None:
    """/info says how the engine batches, as the operator set it: max batch, max wait and fill wait."""
    options = ServeOptions(max_batch=5, max_wait_ms=1.5, fill_wait_ms=7.0, watch_interval=0)
    service = Service(index, options, encoder=FakeEncoder())
    with TestClient(create_app(service, manage=False)) as client:  # never started: the settings are known
        assert client.get("/info").json()["server"]["batching"] == {
            "max_batch": 5,
            "max_wait_ms": 1.5,
            "fill_wait_ms": 7.0,
        }


def test_stop_ends_the_watcher_too(index: Path) -> None:
    service = Service(index, ServeOptions(watch_interval=0.01), encoder=FakeEncoder())
    service.start(background=False)
    watcher = service._watcher
    assert watcher is not None and watcher.is_alive()
    service.stop(timeout=5)
    assert not watcher.is_alive()


def test_a_service_stopped_while_it_loads_stops_at_once_and_never_serves(index: Path, monkeypatch) -> None:
    """SIGTERM during start-up waited for the first load to finish (seconds with a real model), then logged
    "serving ... loaded and warmed" after the shutdown: now stop() leaves the loading thread (a daemon that
    writes nothing) and the version it loads is not swapped in."""
    loading, release = threading.Event(), threading.Event()
    load = Service._load

    def slow_load(self: Service) -> Any:
        loading.set()
        release.wait(10)
        return load(self)

    monkeypatch.setattr(Service, "_load", slow_load)
    service = Service(index, ServeOptions(watch_interval=0), encoder=FakeEncoder())
    service.start()
    assert loading.wait(5)
    began = time.monotonic()
    service.stop(timeout=30)
    assert time.monotonic() - began < 2
    release.set()
    service._watcher.join(5)  # type: ignore[union-attr]
    assert not service.ready and service.serving is None


def test_a_stopped_service_is_not_ready_and_does_not_start_again(index: Path) -> None:
    test_client, service = serve(index)
    with test_client as client:
        wait_ready(client)
        assert service.ready and not service.stopping
        service.stop(timeout=5)  # what the app's shutdown does; readiness ends before the engine drains
        ready = client.get("/ready")
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "shutting_down"
        assert ready.json()["ready"] is False and not service.ready
        searched = client.get("/search", params={"q": "document number 3"})
        assert searched.status_code == 503 and searched.json()["error"]["code"] == "shutting_down"
        assert metric(client, "retrieval_ready") == 0.0
        with pytest.raises(RuntimeError, match="stopped and cannot start again"):
            service.start(background=False)


def test_not_ready_says_why_the_index_could_not_be_loaded(tmp_path: Path) -> None:
    service = Service(tmp_path / "missing", ServeOptions(watch_interval=0), encoder=FakeEncoder())
    service.start(background=False)
    try:
        assert not service.ready and service.last_error and service.reloads == {"ok": 0, "failed": 1}
        with pytest.raises(NotReady) as refused:
            service.searcher()
        assert str(refused.value) == service.last_error
    finally:
        service.stop(timeout=5)


# ----- oneDNN's caches -----------------------------------------------------------------------------------------
def test_serving_caps_onednn_caches_before_torch_is_imported(tmp_path: Path, monkeypatch) -> None:
    """server.run caps them before its Service can import torch; a value in the environment is the user's."""
    from retrieval import runtime
    from retrieval.serve import app as server

    for variable in runtime.ONEDNN_CACHE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "512")
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # as in a fresh `retrieval serve`; restored after
    seen = {}

    class Started(Exception):
        pass

    def service_seen(directory, options):
        seen.update({v: os.environ.get(v) for v in runtime.ONEDNN_CACHE_VARIABLES})
        raise Started

    monkeypatch.setattr(server, "Service", service_seen)
    with pytest.raises(Started):
        server.run(tmp_path, ServeOptions(), port=0)
    assert seen == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "512"}  # 64: the measured cap


# ----- start-up: the API key and the socket, before anything is loaded --------------------------------------
class Loaded(Exception):
    """Raised where the service would be made: the point a server must not reach when it cannot serve."""


@pytest.fixture
def no_service(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``server.Service`` replaced: it records the directory and stops the run there (nothing loads, nothing
    listens for long), so a regression that lets a bad start through fails the test rather than serving."""
    from retrieval.serve import app as server

    made: list[str] = []

    def service(directory, options):  # type: ignore[no-untyped-def]
        made.append(str(directory))
        raise Loaded

    monkeypatch.setattr(server, "Service", service)
    return made


@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_api_key_in_the_environment_is_refused(
    index: Path, value: str, monkeypatch: pytest.MonkeyPatch, no_service: list[str]
) -> None:
    """`RETRIEVAL_API_KEY= retrieval serve IDX` served without authentication (while --api-key '' was refused)."""
    from typer.testing import CliRunner

    from retrieval.cli.app import app
    from retrieval.serve import app as server

    monkeypatch.setenv("RETRIEVAL_API_KEY", value)
    with pytest.raises(ConfigError, match="RETRIEVAL_API_KEY is set empty, which would leave the API open"):
        server.run(index, ServeOptions(), port=0)
    sigint = signal.getsignal(signal.SIGINT)
    try:
        result = CliRunner().invoke(app, ["serve", str(index), "--port", "0"])
    finally:
        signal.signal(signal.SIGINT, sigint)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1, result.stderr
    said = "RETRIEVAL_API_KEY is set empty" if value == "" else "--api-key must be printable ASCII without surrounding"
    assert said in lines[0] and "serving" not in result.stderr  # typer hands a blank variable over as the option
    assert no_service == []


def test_a_port_in_use_or_an_unknown_host_is_refused_before_anything_loads(index: Path, no_service: list[str]) -> None:
    """It loaded the model, printed "serving ... on http://...", and only then logged uvicorn's error (exit 3)."""
    import socket

    from retrieval.serve import app as server

    announced: list[str] = []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port} .*choose another `port`"):
            server.run(index, ServeOptions(), port=port, announce=announced.append)
    with pytest.raises(ConfigError, match="cannot resolve `host` 'no-such-host.invalid'"):
        server.run(index, ServeOptions(), host="no-such-host.invalid", port=0, announce=announced.append)
    assert announced == [] and no_service == []


def test_port_0_announces_the_port_it_got_once_it_listens(index: Path, no_service: list[str]) -> None:
    import socket

    from retrieval.serve import app as server

    reached: list[str] = []

    def announce(url: str) -> None:
        port = int(url.rstrip("/").rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5):  # listening already
            reached.append(url)

    with pytest.raises(Loaded):
        server.run(index, ServeOptions(), port=0, announce=announce)
    assert len(reached) == 1 and reached[0].startswith("http://127.0.0.1:") and not reached[0].endswith(":0/")
    assert no_service == [str(index)]  # announced first, then the service made


def test_serve_prints_the_port_it_got(index: Path, no_service: list[str]) -> None:
    """`retrieval serve --port 0` printed "on http://127.0.0.1:0/"."""
    from typer.testing import CliRunner

    from retrieval.cli.app import app

    sigint = signal.getsignal(signal.SIGINT)
    try:
        result = CliRunner().invoke(app, ["serve", str(index), "--port", "0"])
    finally:
        signal.signal(signal.SIGINT, sigint)
    assert isinstance(result.exception, Loaded)
    shown = [line for line in result.stderr.splitlines() if line.startswith("serving ")]
    assert len(shown) == 1 and "on http://127.0.0.1:" in shown[0] and ":0/" not in shown[0], result.stderr
