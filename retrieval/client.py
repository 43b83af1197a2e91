"""A Python client of the HTTP service (``retrieval serve``): search, embed, info, ready, with typed answers.

Standard library HTTP only (``urllib``). Every error the server answers, and a server that cannot be reached,
is raised as one ``ServerError`` carrying the server's JSON error code, message, field and HTTP status::

    from retrieval.client import Client

    client = Client("http://127.0.0.1:8000", api_key=None)
    for hit in client.search("how do whitening transforms work", k=5).hits:
        print(hit.rank, hit.id, round(hit.score, 3), hit.text[:60])
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from retrieval.errors import RetrievalError

DEFAULT_TIMEOUT = 30.0


class ServerError(RetrievalError):
    """What the server refused or failed to do: its ``code`` (e.g. ``invalid_param``, ``not_ready``,
    ``unauthorized``), ``message``, the request field it is about (``param``) and the HTTP ``status``; status 0
    and code ``unreachable`` when no answer came."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None):
        super().__init__(f"{status} {code}: {message}" if status else f"{code}: {message}")
        self.status, self.code, self.message, self.param = status, code, message, param


@dataclass(frozen=True)
class Hit:
    """One ranked result, as ``retrieval.search.Hit`` (without its row, which is the server's business)."""

    rank: int
    id: str
    score: float
    text: str


@dataclass(frozen=True)
class SearchResult:
    """The hits of one query, best first, and the index version (``generation``) that answered."""

    hits: tuple[Hit, ...]
    generation: int
    took_ms: float


@dataclass(frozen=True)
class Embeddings:
    """Vectors of texts (float32, one row per text); ``transformed``: whitened + L2-normalised, the index's
    space; else the encoder's raw vectors."""

    vectors: np.ndarray
    transformed: bool
    generation: int

    @property
    def dim(self) -> int:
        return int(self.vectors.shape[1])


class Client:
    """The service at ``url`` (e.g. ``http://127.0.0.1:8000``). ``api_key``: sent as ``Authorization: Bearer``
    (the server's ``RETRIEVAL_API_KEY``). ``timeout``: seconds for one request."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT):
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ServerError(0, "invalid_url", f"`url` must be an http:// or https:// address (got {url!r})")
        if timeout <= 0:
            raise ServerError(0, "invalid_timeout", f"`timeout` must be positive seconds (got {timeout})")
        self.url, self.api_key, self.timeout = url.rstrip("/"), api_key, timeout

    def __repr__(self) -> str:
        return f"Client({self.url!r})"

    @overload
    def search(
        self,
        query: str,
        k: int | None = ...,
        rescore: int | None = ...,
        ef_search: int | None = ...,
        nprobe: int | None = ...,
        **options: Any,
    ) -> SearchResult: ...

    @overload
    def search(
        self,
        query: Sequence[str],
        k: int | None = ...,
        rescore: int | None = ...,
        ef_search: int | None = ...,
        nprobe: int | None = ...,
        **options: Any,
    ) -> list[SearchResult]: ...

    def search(
        self,
        query: str | Sequence[str],
        k: int | None = None,
        rescore: int | None = None,
        ef_search: int | None = None,
        nprobe: int | None = None,
        **options: Any,
    ) -> SearchResult | list[SearchResult]:
        """Hits for one query (a ``SearchResult``) or a batch (one per query, in order). ``k``, ``rescore``,
        ``ef_search`` (HNSW beam width), ``nprobe`` (IVF lists probed): None takes the index's defaults. ``options``:
        further fields of the request body, passed as given (any option the server's POST /search takes)."""
        body: dict[str, Any] = {"query": query} if isinstance(query, str) else {"queries": list(query)}
        knobs = {"k": k, "rescore": rescore, "ef_search": ef_search, "nprobe": nprobe, **options}
        body.update({name: value for name, value in knobs.items() if value is not None})
        answer = self._call("POST", "/search", body)
        results = [
            SearchResult(
                tuple(Hit(h["rank"], h["id"], h["score"], h["text"]) for h in result["hits"]),
                answer["generation"],
                answer["took_ms"],
            )
            for result in answer["results"]
        ]
        return results[0] if isinstance(query, str) else results

    def embed(self, texts: str | Sequence[str], transformed: bool = False) -> Embeddings:
        """Vectors of ``texts`` by the index's own encoder (one row for a single text)."""
        inputs = texts if isinstance(texts, str) else list(texts)
        answer = self._call("POST", "/embed", {"inputs": inputs, "transformed": transformed})
        vectors = np.asarray(answer["embeddings"], dtype=np.float32).reshape(-1, answer["dim"])
        return Embeddings(vectors, answer["transformed"], answer["generation"])

    def info(self) -> dict[str, Any]:
        """What is served (``retrieval info`` as JSON) and the server's state and limits."""
        answer: dict[str, Any] = self._call("GET", "/info")
        return answer

    def ready(self) -> bool:
        """True when an index version is loaded and warmed; False while it loads or the server stops."""
        try:
            return bool(self._call("GET", "/ready").get("ready"))
        except ServerError as err:
            if err.status == 503:
                return False
            raise

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            raise _server_error(err.code, err.read()) from None
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise ServerError(0, "unreachable", f"no answer from {self.url}: {reason}") from None
        except ValueError as err:  # a 200 that is not JSON: not this service
            raise ServerError(0, "not_json", f"{self.url}{path} answered something that is not JSON ({err})") from None


def _server_error(status: int, raw: bytes) -> ServerError:
    """The server's JSON error, or a proxy's page (its first line) when the answer is not the service's."""
    try:
        error = json.loads(raw)["error"]
        return ServerError(status, str(error["code"]), str(error["message"]), error.get("param"))
    except (ValueError, KeyError, TypeError):
        first = raw.decode("utf-8", "replace").strip().splitlines()[:1]
        return ServerError(status, "http_error", first[0][:200] if first else f"HTTP {status}")
