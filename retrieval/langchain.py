"""LangChain over the HTTP service (the ``[langchain]`` extra): a retriever, a vector store and embeddings,
each a thin layer on ``retrieval.client.Client``.

    from retrieval.client import Client
    from retrieval.langchain import RetrievalRetriever

    retriever = RetrievalRetriever(client=Client("http://127.0.0.1:8000"), k=5)
    docs = retriever.invoke("how do whitening transforms work")  # Documents; metadata: id, score, rank

A hit becomes a ``Document`` whose ``page_content`` is the hit's text, ``id`` the document's id, and
``metadata`` holds ``id``, ``score`` (cosine in the index's space, higher is closer), ``rank`` and the index
``generation`` that answered.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.retrievers import BaseRetriever
from langchain_core.vectorstores import VectorStore
from pydantic import ConfigDict, Field

from retrieval.client import Client, SearchResult

READ_ONLY = (
    "the retrieval service has no write API: add documents with `retrieval add INDEX CORPUS` (the server loads "
    "the new version by itself), or build an index with `retrieval index CORPUS`"
)


def documents(result: SearchResult) -> list[tuple[Document, float]]:
    """The hits of one query as (Document, score), best first."""
    return [
        (
            Document(
                page_content=hit.text,
                id=hit.id,
                metadata={"id": hit.id, "score": hit.score, "rank": hit.rank, "generation": result.generation},
            ),
            hit.score,
        )
        for hit in result.hits
    ]


class RetrievalRetriever(BaseRetriever):
    """The service's top ``k`` hits for a query. ``search_options``: further fields of each search (``rescore``,
    ``ef_search``, ``nprobe``, ...), as ``Client.search`` takes them."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    client: Client
    k: int = 4
    search_options: dict[str, Any] = Field(default_factory=dict)

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        result = self.client.search(query, k=self.k, **self.search_options)
        return [document for document, _ in documents(result)]


class RetrievalEmbeddings(Embeddings):
    """The index's own encoder, through ``POST /embed``. ``transformed``: vectors in the index's whitened space
    (what it searches with); else the encoder's raw vectors."""

    def __init__(self, client: Client, transformed: bool = False):
        self.client, self.transformed = client, transformed

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        if not texts:
            return []
        return [list(map(float, row)) for row in self.client.embed(texts, self.transformed).vectors]

    def embed_query(self, text: str) -> list[float]:
        return self.embed_documents([text])[0]


class RetrievalVectorStore(VectorStore):
    """A served index as a LangChain vector store: ``similarity_search``, ``similarity_search_with_score``,
    ``as_retriever()``, ``embeddings``. Read-only: the service has no write API, so ``add_texts`` and
    ``from_texts`` raise ``NotImplementedError`` saying how documents are added (``retrieval add``)."""

    def __init__(self, client: Client, **search_options: Any):
        self.client, self.search_options = client, search_options

    @property
    def embeddings(self) -> Embeddings:
        return RetrievalEmbeddings(self.client, transformed=True)

    def similarity_search_with_score(self, query: str, k: int = 4, **kwargs: Any) -> list[tuple[Document, float]]:
        """(Document, cosine score) of the top ``k`` hits; ``kwargs``: search options for this call."""
        return documents(self.client.search(query, k=k, **{**self.search_options, **kwargs}))

    def similarity_search(self, query: str, k: int = 4, **kwargs: Any) -> list[Document]:
        return [document for document, _ in self.similarity_search_with_score(query, k, **kwargs)]

    def _select_relevance_score_fn(self) -> Any:
        return lambda score: (1.0 + score) / 2.0  # cosine in [-1, 1] -> relevance in [0, 1]

    def add_texts(self, texts: Iterable[str], metadatas: list[dict[Any, Any]] | None = None, **kwargs: Any) -> Any:
        raise NotImplementedError(READ_ONLY)

    @classmethod
    def from_texts(
        cls, texts: list[str], embedding: Embeddings, metadatas: list[dict[Any, Any]] | None = None, **kwargs: Any
    ) -> RetrievalVectorStore:
        raise NotImplementedError(READ_ONLY)
