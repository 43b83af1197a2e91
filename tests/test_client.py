"""retrieval.client against a live server (uvicorn in a thread, 127.0.0.1, a free port, the fake encoder):
every search option, embed, info, ready, the API key, and the server's JSON errors as one exception."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import FakeEncoder, write_corpus

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from retrieval.build import build_index  # noqa: E402
from retrieval.client import Client, Embeddings, Hit, SearchResult, ServerError  # noqa: E402
from retrieval.corpus import CorpusSpec  # noqa: E402
from retrieval.index import IndexSpec  # noqa: E402
from retrieval.search import Searcher, SearchParams  # noqa: E402
from retrieval.serve.app import create_app  # noqa: E402
from retrieval.serve.service import ServeOptions, Service  # noqa: E402
from retrieval.whitening import TransformSpec  # noqa: E402

KEY = "client-test-key"
QUERY = "document number 5 about topic 5"  # the exact text of doc5: the fake encoder puts it first


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A real HTTP server in this process: the client's urllib requests cross a socket."""
    root = tmp_path_factory.mktemp("client")
    index = root / "idx"
    corpus = write_corpus(root / "c.parquet", n=300)
    build_index(CorpusSpec(corpus), FakeEncoder(), index, TransformSpec(dim=8), IndexSpec("hnsw", m=8))
    service = Service(index, ServeOptions(watch_interval=0), encoder=FakeEncoder())
    config = uvicorn.Config(create_app(service, api_key=KEY), host="127.0.0.1", port=0, log_level="warning", ws="none")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        client = Client(url, api_key=KEY)
        while not client.ready():
            assert time.monotonic() < deadline, "the index did not load"
            time.sleep(0.02)
        yield url, index
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture
def client(live: tuple[str, Path]) -> Client:
    return Client(live[0], api_key=KEY, timeout=10)


def test_search_one_query_and_a_batch_as_the_library_does(client: Client, live: tuple[str, Path]) -> None:
    searcher = Searcher.load(live[1], encoder=FakeEncoder())
    one = client.search(QUERY, k=3)
    assert isinstance(one, SearchResult) and one.generation == 1 and one.took_ms > 0
    assert [h.rank for h in one.hits] == [1, 2, 3] and one.hits[0] == Hit(1, "doc5", one.hits[0].score, QUERY)
    batch = client.search([QUERY, "topic 3"], k=4, rescore=20, ef_search=64)
    assert len(batch) == 2
    for got, query in zip(batch, [QUERY, "topic 3"], strict=True):
        want = searcher.search(query, SearchParams(k=4, rescore=20, ef_search=64))
        assert [h.id for h in got.hits] == [h.id for h in want]
        np.testing.assert_allclose([h.score for h in got.hits], [h.score for h in want], rtol=1e-5)
    with pytest.raises(AttributeError):
        one.generation = 2  # type: ignore[misc]  # frozen


def test_every_option_reaches_the_server(client: Client) -> None:
    """Knobs are checked by the server: a refusal naming the field shows each one was sent as it spells it."""
    for option, value in (("k", 0), ("rescore", -1), ("ef_search", 0), ("nprobe", 0)):
        with pytest.raises(ServerError) as raised:
            client.search(QUERY, **{option: value})
        assert raised.value.status == 422 and raised.value.param == option, raised.value
    with pytest.raises(ServerError) as raised:  # an option this server does not take: passed on, refused there
        client.search(QUERY, colour="red")
    assert (raised.value.status, raised.value.code, raised.value.param) == (422, "invalid_request", "colour")


def test_embed_raw_and_transformed(client: Client, live: tuple[str, Path]) -> None:
    texts = ["a first text", "a second text"]
    raw = client.embed(texts)
    assert isinstance(raw, Embeddings) and raw.dim == 16 and not raw.transformed and raw.vectors.dtype == np.float32
    np.testing.assert_allclose(raw.vectors, FakeEncoder().encode(texts), rtol=1e-6)
    one = client.embed(texts[0], transformed=True)
    searcher = Searcher.load(live[1], encoder=FakeEncoder())
    np.testing.assert_allclose(one.vectors, searcher.transform.transform(FakeEncoder().encode(texts[:1])), atol=1e-6)


def test_info_and_ready(client: Client) -> None:
    info = client.info()
    assert info["ready"] is True and info["index"]["n"] == 300 and info["index"]["index_kind"] == "hnsw"
    assert client.ready() is True


def test_errors_carry_the_servers_code_message_and_status(live: tuple[str, Path]) -> None:
    with pytest.raises(ServerError) as raised:
        Client(live[0]).search(QUERY)  # no key
    assert (raised.value.status, raised.value.code) == (401, "unauthorized") and raised.value.message
    with pytest.raises(ServerError) as raised:
        Client(live[0], api_key="wrong").info()
    assert raised.value.status == 401
    with pytest.raises(ServerError) as raised:
        Client(live[0], api_key=KEY).search(["x"] * 1000)
    assert raised.value.status == 422 and raised.value.param == "queries" and "\n" not in str(raised.value)


def test_an_unreachable_server_and_a_bad_url_are_one_exception_too() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(ServerError) as raised:
        Client(f"http://127.0.0.1:{port}", timeout=5).info()
    assert (raised.value.status, raised.value.code) == (0, "unreachable")
    with pytest.raises(ServerError, match="`url` must be an http"):
        Client("127.0.0.1:8000")
