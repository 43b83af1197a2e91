"""OpenAI's embeddings dialect (POST /v1/embeddings, GET /v1/models): the schema's fields in-process against the
library's own vectors, then the official `openai` package as the client of a real `retrieval serve` process."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import SHARED_DATA, FakeEncoder, needs_minilm, needs_shared, write_corpus

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from retrieval.build import build_index  # noqa: E402
from retrieval.corpus import CorpusSpec  # noqa: E402
from retrieval.search import Searcher  # noqa: E402
from retrieval.serve.app import create_app  # noqa: E402
from retrieval.serve.service import ServeOptions, Service  # noqa: E402
from retrieval.whitening import TransformSpec, l2_normalize  # noqa: E402

TEXTS = ["document number 5 about topic 5", "a query about topic 2", "something else entirely"]


def served(index: Path) -> TestClient:
    service = Service(index, ServeOptions(watch_interval=0), encoder=FakeEncoder())
    return TestClient(create_app(service))


def ready(client: TestClient) -> TestClient:
    import time

    deadline = time.monotonic() + 20
    while client.get("/ready").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return client


@pytest.fixture(scope="module")
def whitened(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("v1")
    build_index(CorpusSpec(write_corpus(root / "c.parquet", n=200)), FakeEncoder(), root / "idx", TransformSpec(dim=6))
    return root / "idx"


@pytest.fixture
def client(whitened: Path) -> Iterator[TestClient]:
    with served(whitened) as test_client:
        yield ready(test_client)


def vectors(answer: dict) -> np.ndarray:
    assert [item["index"] for item in answer["data"]] == list(range(len(answer["data"])))
    assert {item["object"] for item in answer["data"]} == {"embedding"} and answer["object"] == "list"
    return np.array([item["embedding"] for item in answer["data"]], dtype=np.float64)


def test_models_lists_the_served_encoder(client: TestClient) -> None:
    answer = client.get("/v1/models").json()
    assert answer["object"] == "list" and [m["id"] for m in answer["data"]] == ["fake"]
    assert answer["data"][0]["object"] == "model" and answer["data"][0]["created"] > 1_600_000_000


def test_without_dimensions_the_models_own_embedding_normalised(client: TestClient) -> None:
    answer = client.post("/v1/embeddings", json={"model": "fake", "input": TEXTS}).json()
    expected = l2_normalize(FakeEncoder().encode(TEXTS).astype(np.float64))
    # float32 encoder output normalised in float32, sent as JSON floats: 1e-6 relative
    np.testing.assert_allclose(vectors(answer), expected, rtol=0, atol=1e-6)
    assert answer["model"] == "fake"
    other = client.post("/v1/embeddings", json={"model": "text-embedding-3-small", "input": TEXTS}).json()
    assert other["model"] == "fake" and vectors(other).tolist() == vectors(answer).tolist()  # one model served
    words = sum(len(t.split()) for t in TEXTS)  # the fake encoder has no tokenizer: it counts words
    assert answer["usage"] == {"prompt_tokens": words, "total_tokens": words}


@pytest.mark.parametrize("dims", [1, 3, 6])
def test_dimensions_keep_the_kernels_leading_directions(client: TestClient, whitened: Path, dims: int) -> None:
    """The index's kernel truncated to its first `dims` columns, then normalised: checked against a float64
    one-shot reference computed from the saved kernel (float32 transform: 1e-5)."""
    answer = client.post("/v1/embeddings", json={"model": "fake", "input": TEXTS, "dimensions": dims}).json()
    got = vectors(answer)
    searcher = Searcher.load(whitened, encoder=FakeEncoder())
    w = searcher.transform
    raw = FakeEncoder().encode(TEXTS).astype(np.float64)
    centred = raw - w.mean if w.center else raw  # the default kernel may be uncentred
    reference = l2_normalize(centred @ w.kernel[:, :dims])
    assert got.shape == (len(TEXTS), dims)
    np.testing.assert_allclose(got, reference, rtol=0, atol=1e-5)
    if dims == 6:  # all of them: exactly the index's own space
        np.testing.assert_allclose(got, searcher.transform.transform(raw), rtol=0, atol=1e-6)


def test_a_single_string_and_base64(client: TestClient) -> None:
    floats = client.post("/v1/embeddings", json={"model": "fake", "input": TEXTS[0], "dimensions": 4}).json()
    packed = client.post(
        "/v1/embeddings", json={"model": "fake", "input": TEXTS[0], "dimensions": 4, "encoding_format": "base64"}
    ).json()
    decoded = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), dtype="<f4")
    assert len(floats["data"]) == 1 and decoded.shape == (4,)
    np.testing.assert_array_equal(decoded, np.array(floats["data"][0]["embedding"], dtype=np.float32))


@pytest.mark.parametrize(
    ("body", "status", "code", "says"),
    [
        ({"model": "fake", "input": "a", "dimensions": 7}, 400, "invalid_dimensions", "between 1 and 6"),
        ({"model": "fake", "input": "a", "dimensions": 0}, 400, "invalid_dimensions", "between 1 and 6"),
        ({"model": "fake", "input": [1, 2, 3]}, 422, "invalid_request", "input"),
        ({"model": "fake", "input": "a", "encoding_format": "int8"}, 422, "invalid_request", "encoding_format"),
        ({"model": "fake", "input": []}, 422, "empty_query", "input"),
        ({"input": "a"}, 422, "invalid_request", "model"),
    ],
)
def test_bad_requests_name_the_problem(client: TestClient, body: dict, status: int, code: str, says: str) -> None:
    answer = client.post("/v1/embeddings", json=body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["code"] == code and says in error["message"] + str(error["param"]), error


def test_a_raw_index_offers_only_its_full_width(tmp_path: Path) -> None:
    build_index(CorpusSpec(write_corpus(tmp_path / "c.parquet", n=100)), FakeEncoder(), tmp_path / "raw")
    with served(tmp_path / "raw") as test_client:
        client = ready(test_client)
        full = client.post("/v1/embeddings", json={"model": "fake", "input": TEXTS, "dimensions": 16})
        assert full.status_code == 200 and len(full.json()["data"][0]["embedding"]) == 16
        short = client.post("/v1/embeddings", json={"model": "fake", "input": TEXTS, "dimensions": 8})
        assert short.status_code == 400 and "must be 16" in short.json()["error"]["message"]


def wait_ready(url: str, key: str, server: object, timeout: float = 180.0) -> None:
    import time
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.proc.poll() is None, server.log.read_text()  # type: ignore[attr-defined]
        try:
            with urllib.request.urlopen(request, timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)
    raise AssertionError("the server was not ready in time")


@pytest.mark.process
def test_the_official_openai_client_against_a_live_server(tiny_bert: Path, tmp_path: Path) -> None:
    """`openai.OpenAI(base_url=...).embeddings.create(...)` against a real `retrieval serve` process (the tiny
    BERT): the vectors equal the library's own for the same texts (cosine >= 0.9999), with and without
    `dimensions`, as floats and as base64 (the client's default), and the usage counts the tokenizer's tokens."""
    openai = pytest.importorskip("openai")
    from test_server_process import start

    from retrieval.encode.spec import EncoderSpec

    encoder = EncoderSpec(str(tiny_bert), precision="fp32").load()
    corpus = write_corpus(tmp_path / "c.parquet", n=200)
    build_index(CorpusSpec(corpus), encoder, tmp_path / "idx", TransformSpec(dim=8))
    server = start(tmp_path / "idx", tmp_path, "--api-key", "secret-key")
    try:
        wait_ready(server.url("/ready"), "secret-key", server)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="secret-key", max_retries=0)
        model = client.models.list().data[0].id
        searcher = Searcher.load(tmp_path / "idx", encoder=encoder)
        raw = encoder.encode(TEXTS)
        for dims, expected in ((None, l2_normalize(raw)), (4, searcher.project(raw, 4)), (8, searcher.project(raw))):
            extra: dict = {} if dims is None else {"dimensions": dims}
            for encoding in (None, "float", "base64"):  # None: the client asks for base64 and decodes it itself
                if encoding is not None:
                    extra["encoding_format"] = encoding
                answer = client.embeddings.create(model=model, input=TEXTS, **extra)
                rows = [d.embedding for d in answer.data]
                if encoding == "base64":  # asked for by name, the client hands over the text as it came
                    rows = [np.frombuffer(base64.b64decode(row), dtype="<f4") for row in rows]
                got = l2_normalize(np.array(rows, dtype=np.float64))
                cosines = np.sum(got * expected, axis=1)
                assert cosines.min() >= 0.9999, (dims, encoding, cosines)
        assert answer.usage.prompt_tokens == sum(encoder.count_tokens(TEXTS)) == answer.usage.total_tokens
        with pytest.raises(openai.BadRequestError, match="between 1 and 8"):
            client.embeddings.create(model=model, input="x", dimensions=9)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0).embeddings.create(
                model=model, input="x"
            )
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.process
@needs_shared
@needs_minilm
def test_the_official_openai_client_with_the_real_minilm(tmp_path: Path) -> None:
    """The default model served as a user builds it (precision as chosen for the machine): `dimensions=64` works
    and the full vectors are the library's own for the same texts, cosine >= 0.9999 (the issue's target; the
    served engine batches and packs texts differently from a one-off encode)."""
    openai = pytest.importorskip("openai")
    import pyarrow.parquet as pq
    from test_server_process import start

    table = pq.read_table(SHARED_DATA / "scifact" / "corpus.parquet").slice(0, 300)
    corpus = tmp_path / "c.parquet"
    pq.write_table(table.rename_columns(["id", "title", "text"]), corpus)
    from retrieval.encode.spec import EncoderSpec

    encoder = EncoderSpec("all-MiniLM-L6-v2").load()
    build_index(CorpusSpec(corpus), encoder, tmp_path / "idx", TransformSpec(dim=128))
    queries = pq.read_table(SHARED_DATA / "scifact" / "queries-test.parquet").column("text").to_pylist()[:32]
    server = start(tmp_path / "idx", tmp_path, "--api-key", "secret-key")
    try:
        wait_ready(server.url("/ready"), "secret-key", server)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="secret-key", max_retries=0)
        model = client.models.list().data[0].id
        assert model == "all-MiniLM-L6-v2"
        searcher = Searcher.load(tmp_path / "idx")  # the library as a user loads the index: its own encoder
        assert searcher.encoder is not None
        raw = searcher.encoder.encode(queries)
        full = client.embeddings.create(model=model, input=queries)
        short = client.embeddings.create(model=model, input=queries, dimensions=64)
        got = np.array([d.embedding for d in full.data], dtype=np.float64)
        got64 = np.array([d.embedding for d in short.data], dtype=np.float64)
        assert got.shape == (32, 384) and got64.shape == (32, 64)
        cosines = np.sum(l2_normalize(got) * l2_normalize(raw.astype(np.float64)), axis=1)
        cosines64 = np.sum(l2_normalize(got64) * searcher.project(raw, 64).astype(np.float64), axis=1)
        print(f"MiniLM served vs library: min cosine full {cosines.min():.7f}, dimensions=64 {cosines64.min():.7f}")
        assert cosines.min() >= 0.9999 and cosines64.min() >= 0.9999, (cosines.min(), cosines64.min())
    finally:
        server.stop()


def test_the_spec_states_the_dimensions_the_served_index_offers(client: TestClient) -> None:
    """A client validating against the spec knows the limit: 1 to the kernel's 6 directions here."""
    dims = client.get("/openapi.json").json()["components"]["schemas"]["EmbeddingsRequest"]["properties"]["dimensions"]
    assert {"type": "integer", "minimum": 1, "maximum": 6} in dims["anyOf"]
