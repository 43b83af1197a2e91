"""The LangChain retriever, vector store and embeddings over a live server, through langchain-core's own
interfaces (``invoke``, ``similarity_search*``, ``as_retriever``, ``embed_*``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import FakeEncoder

pytest.importorskip("langchain_core")
from langchain_core.documents import Document  # noqa: E402
from langchain_core.retrievers import BaseRetriever  # noqa: E402
from langchain_core.vectorstores import VectorStore  # noqa: E402
from test_client import KEY, QUERY, live  # noqa: E402,F401  # the live server fixture

from retrieval.client import Client  # noqa: E402
from retrieval.langchain import RetrievalEmbeddings, RetrievalRetriever, RetrievalVectorStore  # noqa: E402
from retrieval.search import Searcher, SearchParams  # noqa: E402


@pytest.fixture
def client(live: tuple[str, Path]) -> Client:  # noqa: F811
    return Client(live[0], api_key=KEY, timeout=10)


def test_the_retriever_returns_documents_with_id_and_score(client: Client, live: tuple[str, Path]) -> None:  # noqa: F811
    retriever = RetrievalRetriever(client=client, k=3, search_options={"rescore": 20})
    assert isinstance(retriever, BaseRetriever)
    docs = retriever.invoke(QUERY)
    want = Searcher.load(live[1], encoder=FakeEncoder()).search(QUERY, SearchParams(k=3, rescore=20))
    assert all(isinstance(d, Document) for d in docs)
    assert [d.metadata["id"] for d in docs] == [h.id for h in want] and docs[0].id == "doc5"
    assert docs[0].page_content == QUERY and [d.metadata["rank"] for d in docs] == [1, 2, 3]
    np.testing.assert_allclose([d.metadata["score"] for d in docs], [h.score for h in want], rtol=1e-5)
    assert [d.metadata["id"] for d in retriever.batch([QUERY, QUERY])[1]] == [h.id for h in want]


def test_the_vector_store_searches_and_is_read_only(client: Client) -> None:
    store = RetrievalVectorStore(client)
    assert isinstance(store, VectorStore)
    scored = store.similarity_search_with_score(QUERY, k=4)
    assert len(scored) == 4 and scored[0][0].metadata["id"] == "doc5"
    assert [s for _, s in scored] == sorted((s for _, s in scored), reverse=True)
    assert [d.id for d in store.similarity_search(QUERY, k=4)] == [d.id for d, _ in scored]
    relevance = store.similarity_search_with_relevance_scores(QUERY, k=2)
    assert all(0 <= r <= 1 for _, r in relevance)
    via = store.as_retriever(search_kwargs={"k": 2}).invoke(QUERY)
    assert [d.id for d in via] == [d.id for d, _ in scored[:2]]
    with pytest.raises(NotImplementedError, match="no write API: add documents with `retrieval add"):
        store.add_texts(["a new text"])
    with pytest.raises(NotImplementedError, match="no write API"):
        RetrievalVectorStore.from_texts(["a"], RetrievalEmbeddings(client))


def test_the_embeddings_are_the_encoders(client: Client) -> None:
    embeddings = RetrievalEmbeddings(client)
    texts = ["a first text", "a second text"]
    np.testing.assert_allclose(embeddings.embed_documents(texts), FakeEncoder().encode(texts), rtol=1e-6)
    np.testing.assert_allclose(embeddings.embed_query(texts[0]), FakeEncoder().encode(texts[:1])[0], rtol=1e-6)
    assert embeddings.embed_documents([]) == []
