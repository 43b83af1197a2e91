"""What the service takes in headers and says in its own: oversized requests get 431, every response carries the
headers that tell a browser how it may be used, and the pages served still work under them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conftest import FakeEncoder, write_corpus

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from retrieval.build import build_index  # noqa: E402
from retrieval.corpus import CorpusSpec  # noqa: E402
from retrieval.serve.app import create_app  # noqa: E402
from retrieval.serve.middleware import MAX_HEADER_BYTES, MAX_HEADERS  # noqa: E402
from retrieval.serve.service import ServeOptions, Service  # noqa: E402
from retrieval.whitening import TransformSpec  # noqa: E402


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    root = tmp_path_factory.mktemp("headers")
    build_index(CorpusSpec(write_corpus(root / "c.parquet", n=100)), FakeEncoder(), root / "idx", TransformSpec(dim=8))
    service = Service(root / "idx", ServeOptions(watch_interval=0), encoder=FakeEncoder())
    with TestClient(create_app(service)) as test_client:
        service_ready = False
        for _ in range(1000):
            if test_client.get("/ready").status_code == 200:
                service_ready = True
                break
        assert service_ready
        yield test_client


@pytest.mark.parametrize(
    "headers",
    [{"X-Big": "a" * 200_000}, {f"X-H{i}": "v" for i in range(5000)}, {"X-Big": "a" * MAX_HEADER_BYTES}],
    ids=["200 KB header", "5,000 headers", "just over the byte limit"],
)
def test_oversized_headers_are_refused_with_431_json(client: TestClient, headers: dict[str, str]) -> None:
    response = client.get("/health", headers=headers)
    assert response.status_code == 431
    error = response.json()["error"]
    assert error["code"] == "headers_too_large" and f"{MAX_HEADERS:,} fields" in error["message"]
    assert response.headers["x-content-type-options"] == "nosniff"


def test_headers_within_the_limits_are_answered(client: TestClient) -> None:
    many = {f"X-H{i}": "v" for i in range(MAX_HEADERS - 10)}  # TestClient adds a few of its own
    assert client.get("/health", headers=many).status_code == 200
    assert client.get("/health", headers={"X-Big": "a" * (MAX_HEADER_BYTES - 1000)}).status_code == 200


@pytest.mark.parametrize(
    "method, path, status",
    [
        ("GET", "/health", 200),
        ("GET", "/", 200),
        ("GET", "/docs", 200),
        ("GET", "/nowhere", 404),
        ("POST", "/search", 422),
        ("GET", "/docs/assets/swagger-ui.css", 200),
    ],
)
def test_every_response_says_how_a_browser_may_use_it(client: TestClient, method: str, path: str, status: int) -> None:
    response = client.request(method, path)
    assert response.status_code == status
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers["x-frame-options"] == "DENY"
    csp = response.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in csp and "default-src 'self'" in csp and "object-src 'none'" in csp


def test_the_docs_pages_load_only_assets_their_policy_allows(client: TestClient) -> None:
    """Under the CSP, a page may load scripts and styles from the server itself only: every asset /docs and
    /redoc name is a path on this server, and it is served."""
    import re

    for page in ("/docs", "/redoc"):
        html = client.get(page).text
        assets = re.findall(r'(?:src|href)="([^"]+)"', html)
        assert assets, page
        for asset in assets:
            assert asset.startswith("/docs/assets/"), (page, asset)
            assert client.get(asset).status_code == 200, asset
