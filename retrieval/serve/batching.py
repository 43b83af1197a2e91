"""Dynamic micro-batching: worker threads (one by default) encode and search together whatever queries are waiting.

Concurrent requests would otherwise each pay a whole forward pass and a whole scan for one text. The worker
instead takes the queued jobs, up to ``max_batch`` queries, waiting at most ``max_wait`` seconds after the
first for more to arrive, encodes all their texts in one call (short texts packed several to a row, so a batch
costs its tokens, not its padding) and searches each group of jobs that asked the same knobs in one FAISS call
(one matrix product for the batch instead of one pass over the index per query).

The searcher is read once per batch (``current()``), so a reload swaps it between batches: a batch that has
started finishes on the version it started with.

``workers`` threads take batches from the one queue, so on a machine with several cores one batch is encoded
while another is: the encoder's forward pass and FAISS release the GIL, and a warmed-up encoder lets concurrent
callers run side by side (it locks only its tokenizer).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from retrieval.errors import ConfigError, RetrievalError
from retrieval.search import Hit, Searcher, SearchParams
from retrieval.serve.autothreads import ThreadChooser

log = logging.getLogger(__name__)


class Overloaded(RetrievalError):
    """More queries are waiting than the queue holds: the client should retry later (HTTP 429)."""


class Stopped(RetrievalError):
    """The engine is shutting down and takes no new work (HTTP 503)."""


@dataclass(frozen=True)
class SearchResult:
    """Hits for each query of one job, and which index version answered."""

    hits: list[list[Hit]]
    generation: int


@dataclass(frozen=True)
class EmbedResult:
    vectors: np.ndarray  # (n, d) float32: raw encoder output, or in the index's space when transformed
    generation: int


@dataclass
class _Job:
    texts: list[str]
    params: SearchParams | None  # None: an embedding job (or a call)
    transformed: bool
    future: Future[Any]
    dims: int | None = None  # an embedding in the index's space keeping this many directions (``Searcher.project``)
    enqueued: float = field(default_factory=time.perf_counter)
    call: Callable[[], Any] | None = None  # a function to run in an engine thread (``Batcher.call``)


@dataclass(frozen=True)
class BatchStats:
    """What one engine batch did, for metrics: queries, jobs, seconds queued (oldest job), seconds running."""

    queries: int
    jobs: int
    waited: float
    seconds: float


class Batcher:
    """The micro-batching engine. ``submit_search`` / ``submit_embed`` return futures; ``start``; ``stop``.

    ``current`` returns the searcher to use for the next batch. ``max_queue`` bounds the queries waiting
    (beyond it ``Overloaded`` is raised at submission), and so does ``max_queue_wait`` (seconds; 0: no limit): a
    request is refused at once when the queries ahead of it and its own would take the engine longer than that
    at the pace of its recent batches, since a client served after such a wait is served too late (the wait
    follows the machine: a fixed count of queries is seconds on a busy one). A job larger than ``max_batch``
    runs as a batch of its own; jobs are never split. ``workers`` threads process batches (one each at a time).
    ``setup`` runs first in each worker thread (thread-local settings such as FAISS's OpenMP thread count);
    ``on_batch`` is called after each batch with its ``BatchStats``. ``threads``: a ``ThreadChooser`` that sets
    torch's thread count before each batch's encoding and is told how long the encoding took.
    """

    def __init__(
        self,
        current: Callable[[], Searcher],
        max_batch: int = 32,
        max_wait: float = 0.0,
        max_queue: int = 1024,
        fill_wait: float = 0.0,
        setup: Callable[[], None] | None = None,
        on_batch: Callable[[BatchStats], None] | None = None,
        workers: int = 1,
        threads: ThreadChooser | None = None,
        max_queue_wait: float = 0.0,
    ):
        if max_batch < 1 or max_wait < 0 or fill_wait < 0 or max_queue < 1 or workers < 1 or max_queue_wait < 0:
            raise ValueError(
                "max_batch, max_queue and workers must be positive, max_wait, fill_wait and max_queue_wait non-negative"
            )
        self.max_queue_wait = max_queue_wait
        self._per_query = 0.0  # engine seconds per query, a moving average over batches (0: none measured yet)
        self.current = current
        self.max_batch = max_batch
        self.max_wait = max_wait
        self.fill_wait = fill_wait
        self._last_size = 0  # queries the last batch took: with those waiting, what ``fill_wait`` waits for
        self.max_queue = max_queue
        self._setup = setup
        self._on_batch = on_batch
        self._jobs: deque[_Job] = deque()
        self._queued = 0  # queries in self._jobs
        self._cond = threading.Condition()
        self._stopping = False
        self.workers = workers
        self.threads = threads
        self._threads: list[threading.Thread] = []

    # ----- submitting ------------------------------------------------------------------------------------
    def submit_search(self, texts: Sequence[str], params: SearchParams) -> Future[SearchResult]:
        return self._submit(_Job(list(texts), params, False, Future()))

    def submit_embed(
        self, texts: Sequence[str], transformed: bool = False, dims: int | None = None
    ) -> Future[EmbedResult]:
        """Raw vectors, or (``transformed``) in the index's space, its first ``dims`` directions when given."""
        return self._submit(_Job(list(texts), None, transformed, Future(), dims=dims))

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn`` in an engine thread, before the next batch there: for what must happen in the thread that
        encodes (thread-local settings, warming them up)."""
        return self._submit(_Job([], None, False, Future(), call=fn))

    @property
    def running(self) -> bool:
        return bool(self._threads) and not self._stopping

    def _submit(self, job: _Job) -> Future[Any]:
        with self._cond:
            if self._stopping:
                raise Stopped("the server is shutting down")
            if self._queued and self._queued + len(job.texts) > self.max_queue:
                raise Overloaded(f"{self._queued} queries are already waiting (the limit is {self.max_queue})")
            wait = self.expected_wait(len(job.texts))
            if self._queued and self.max_queue_wait and wait > self.max_queue_wait:
                raise Overloaded(
                    f"{self._queued} queries are already waiting, about {wait * 1000:.0f} ms of work (the limit is "
                    f"{self.max_queue_wait * 1000:.0f} ms)"
                )
            self._jobs.append(job)
            self._queued += len(job.texts)
            self._cond.notify()
        return job.future

    @property
    def queued(self) -> int:
        """Queries waiting for the worker."""
        return self._queued

    def expected_wait(self, more: int = 0) -> float:
        """Seconds the engine needs for the queries waiting and ``more``, at the pace of its recent batches."""
        return (self._queued + more) * self._per_query / self.workers

    def _paced(self, queries: int, seconds: float) -> None:
        """Fold a finished batch into the pace (seconds per query): a moving average over about ten batches, so
        the estimate follows the load (a busier machine, longer texts) within a second or so. Only batches at
        least half full count: a batch's fixed cost spread over a few queries made the pace several times what
        the queued queries cost once they are batched, and 4 clients of a busy machine were refused."""
        if queries and 2 * queries >= self.max_batch:
            pace = seconds / queries
            self._per_query = pace if not self._per_query else 0.9 * self._per_query + 0.1 * pace

    # ----- the worker ------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._stopping:
            raise RuntimeError("this engine was stopped and cannot start again: make a new one")
        if not self._threads:
            for i in range(self.workers):
                thread = threading.Thread(target=self._run, name=f"retrieval-batcher-{i}", daemon=True)
                thread.start()
                self._threads.append(thread)

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new work, finish what is queued, and end the workers (``timeout``: for all of them)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        if self._setup is not None:
            self._setup()
        while True:
            jobs = self._take()
            if not jobs:
                return
            self._process(jobs)

    def _take(self) -> list[_Job]:
        """The next batch: the first waiting job, then more while they fit, waiting at most max_wait for them, and
        while the batch holds fewer queries than were in flight when the last one ended, at most fill_wait.

        The fill wait is for closed-loop clients (each sends its next request when the last is answered): the
        clients answered by one batch send again while the engine starts the next with the few that arrived
        during the last, and batches alternate between a few queries and many, each paying a forward pass and a
        search. Waiting a moment for the queries in flight when the last batch ended (those it answered, which
        come back, and those already waiting) lets them join: the batches settle at the number of clients. A
        single client never waits (its batches hold one query, as the last did); when the load drops, one batch
        waits in vain."""
        with self._cond:
            # the queries in flight when the last batch ended: those it answered and those already waiting
            target = min(self._last_size + self._queued, self.max_batch)
            while not self._jobs:
                if self._stopping:
                    return []
                self._cond.wait()
            jobs = [self._jobs.popleft()]
            size = len(jobs[0].texts)
            first = time.perf_counter()
            while size < self.max_batch:
                if self._jobs:
                    if size + len(self._jobs[0].texts) > self.max_batch:
                        break
                    job = self._jobs.popleft()
                    jobs.append(job)
                    size += len(job.texts)
                    continue
                deadline = first + max(self.max_wait, self.fill_wait if size < target else 0.0)
                left = deadline - time.perf_counter()
                if left <= 0 or self._stopping:
                    break
                self._cond.wait(left)
            self._queued -= size
            self._last_size = size
            return jobs

    def _process(self, jobs: list[_Job]) -> None:
        start = time.perf_counter()
        live = [job for job in jobs if job.future.set_running_or_notify_cancel()]
        for job in live:
            if job.call is not None:
                try:
                    job.future.set_result(job.call())
                except BaseException as err:  # noqa: BLE001 - handed to the caller
                    job.future.set_exception(err)
        live = [job for job in live if job.call is None]
        if not live:
            return
        texts = [text for job in live for text in job.texts]
        asked = live  # the requests whose texts this batch encodes (not the cancelled ones, nor calls)
        searcher: Searcher | None = None
        try:
            searcher = self.current()
            chooser = self.threads if texts else None
            chosen = chooser.choose(len(texts)) if chooser is not None else 0
            began = time.perf_counter()
            raw = searcher.encode(texts) if texts else np.empty((0, 0), np.float32)
            if chooser is not None:
                chooser.record(len(texts), chosen, time.perf_counter() - began)
        except BaseException as err:  # noqa: BLE001 - every waiting caller must hear of it, whatever it was
            if not isinstance(err, RetrievalError):
                log.exception("a batch of %d queries failed to encode", len(texts))
            # A request's own fault (its text) must not fail the others batched with it: they are encoded again
            # one request at a time. The rest (no index loaded yet, shutting down, an interrupt) reaches them all.
            shared_fault = isinstance(err, RetrievalError) and not isinstance(err, ConfigError)
            if searcher is None or len(live) == 1 or shared_fault or not isinstance(err, Exception):
                for job in live:
                    job.future.set_exception(err)
                return
            live, raw = self._encode_alone(searcher, live)
        offsets = np.cumsum([0] + [len(job.texts) for job in live])
        vectors = {id(job): raw[offsets[i] : offsets[i + 1]] for i, job in enumerate(live)}
        generation = searcher.manifest.generation
        groups: dict[SearchParams, list[_Job]] = {}
        for job in live:
            if job.params is None:
                self._embed(searcher, job, vectors[id(job)], generation)
            else:
                groups.setdefault(job.params, []).append(job)
        for params, group in groups.items():
            self._search(searcher, params, group, vectors, generation)
        self._paced(len(texts), time.perf_counter() - start)
        if self._on_batch is not None:
            waited = start - min(job.enqueued for job in asked)
            try:
                self._on_batch(BatchStats(len(texts), len(asked), waited, time.perf_counter() - start))
            except Exception:  # noqa: BLE001 - a broken hook must not end the worker: every later request would hang
                log.exception("the batch hook failed")

    @staticmethod
    def _encode_alone(searcher: Searcher, jobs: list[_Job]) -> tuple[list[_Job], np.ndarray]:
        """Encode each job's texts on its own after a batch failed: a job that fails again gets its error, the
        others go on (the jobs that encoded, and their vectors in the same order)."""
        done, vectors = [], []
        for job in jobs:
            try:
                vectors.append(searcher.encode(job.texts))
            except Exception as err:  # noqa: BLE001 - handed to the caller
                job.future.set_exception(err)
            else:
                done.append(job)
        return done, (np.concatenate(vectors) if vectors else np.empty((0, 0), np.float32))

    @staticmethod
    def _embed(searcher: Searcher, job: _Job, raw: np.ndarray, generation: int) -> None:
        try:
            out = searcher.project(raw, job.dims) if job.transformed else raw
            job.future.set_result(EmbedResult(np.asarray(out, dtype=np.float32), generation))
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            job.future.set_exception(err)

    @staticmethod
    def _search(
        searcher: Searcher, params: SearchParams, group: list[_Job], vectors: dict[int, np.ndarray], generation: int
    ) -> None:
        """One FAISS call for every job of the group (same knobs), its rows handed back job by job."""
        try:
            texts = [text for job in group for text in job.texts]  # lexical and hybrid searches read them
            raw = np.concatenate([vectors[id(job)] for job in group])
            scores, rows = searcher.search_raw(raw, params, texts=texts)
            hits = searcher.hits(scores, rows)
        except BaseException as err:  # noqa: BLE001 - handed to the callers
            for job in group:
                job.future.set_exception(err)
            return
        start = 0
        for job in group:
            job.future.set_result(SearchResult(hits[start : start + len(job.texts)], generation))
            start += len(job.texts)
