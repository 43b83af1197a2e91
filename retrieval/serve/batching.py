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
    """Hits for each query of one job, which index version answered, the seconds the job waited in the queue
    and those its batch ran until these hits were ready."""

    hits: list[list[Hit]]
    generation: int
    waited: float = 0.0
    ran: float = 0.0


@dataclass(frozen=True)
class EmbedResult:
    vectors: np.ndarray  # (n, d) float32: raw encoder output, or in the index's space when transformed
    generation: int
    waited: float = 0.0
    ran: float = 0.0
    tokens: list[int] | None = None  # tokens of each text, counted in the engine thread when the job asked


@dataclass
class _Job:
    texts: list[str]
    params: SearchParams | None  # None: an embedding job (or a call)
    transformed: bool
    future: Future[Any]
    dims: int | None = None  # an embedding in the index's space keeping this many directions (``Searcher.project``)
    enqueued: float = field(default_factory=time.perf_counter)
    call: Callable[[], Any] | None = None  # a function to run in an engine thread (``Batcher.call``)
    count_tokens: bool = False  # an embedding job that wants its texts' token counts (``EmbedResult.tokens``)


class Admission:
    """A request let in by ``Batcher.admit`` before its body was read: counted as one query of work ahead of
    later requests until it is submitted (``submit_*(..., admission=)``) or ``release``d (it ended without
    reaching the engine: a validation error, a disconnect). Either is idempotent."""

    __slots__ = ("_batcher", "open")

    def __init__(self, batcher: Batcher):
        self._batcher, self.open = batcher, True

    def release(self) -> None:
        with self._batcher._cond:
            self._close()

    def _close(self) -> None:  # the batcher's lock held
        if self.open:
            self.open = False
            self._batcher._pending -= 1


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
        self._call_ended = 0.0  # when a call (``call``) last ended: time behind it is not lateness
        self._pending = 0  # requests admitted (``admit``) and not yet submitted: each one query of work ahead
        # requests refused by ``admit`` / at submission / when taken after waiting longer than the budget
        self.refused = {"edge": 0, "queue": 0, "late": 0}
        # A batch's engine seconds, fitted over recent batches as fixed + per query (``_paced``); 0: none yet.
        self._fixed = 0.0
        self._per_query = 0.0
        self._fit = (0.0, 0.0, 0.0, 0.0, 0.0)  # decayed sums over batches: weight, n, seconds, n * n, n * seconds
        self._running: dict[int, tuple[float, int]] = {}  # per worker thread: its batch's start and queries
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
    def admit(self) -> Admission:
        """Let one more request in, before its body is read, or refuse it (``Overloaded``) when the work ahead of
        it would already take the engine longer than ``max_queue_wait`` (or exceed ``max_queue``): the queries
        queued and the requests admitted but not yet submitted, each counted as one query at the engine's pace.
        Refusing here costs the event loop almost nothing; refusing at submission came after the body was read,
        parsed and validated, and 256 clients' refusals took the loop that the accepted requests waited for."""
        with self._cond:
            if self._stopping:
                raise Stopped("the server is shutting down")
            ahead = self._queued + self._pending
            if ahead and ahead + 1 > self.max_queue:
                self.refused["edge"] += 1
                raise Overloaded(f"{ahead} queries are already waiting (the limit is {self.max_queue})")
            wait = self.expected_wait(1)
            if ahead and self.max_queue_wait and wait > self.max_queue_wait:
                self.refused["edge"] += 1
                raise Overloaded(
                    f"{ahead} queries are already waiting, about {wait * 1000:.0f} ms of work (the limit is "
                    f"{self.max_queue_wait * 1000:.0f} ms)"
                )
            self._pending += 1
            return Admission(self)

    @property
    def pending(self) -> int:
        """Requests admitted (``admit``) and not yet submitted."""
        return self._pending

    @property
    def pace(self) -> float:
        """Engine seconds per query of a full batch, as measured over recent batches (0: none measured yet)."""
        return self._fixed / self.max_batch + self._per_query

    @property
    def batch_cost(self) -> tuple[float, float]:
        """A batch's engine seconds as fitted over recent batches: (fixed, per query)."""
        return self._fixed, self._per_query

    def submit_search(
        self, texts: Sequence[str], params: SearchParams, admission: Admission | None = None
    ) -> Future[SearchResult]:
        return self._submit(_Job(list(texts), params, False, Future()), admission)

    def submit_embed(
        self,
        texts: Sequence[str],
        transformed: bool = False,
        dims: int | None = None,
        admission: Admission | None = None,
        count_tokens: bool = False,
    ) -> Future[EmbedResult]:
        """Raw vectors, or (``transformed``) in the index's space, its first ``dims`` directions when given;
        ``count_tokens``: with each text's token count, counted in the engine thread."""
        job = _Job(list(texts), None, transformed, Future(), dims=dims, count_tokens=count_tokens)
        return self._submit(job, admission)

    def call(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn`` in an engine thread, before the next batch there: for what must happen in the thread that
        encodes (thread-local settings, warming them up)."""
        return self._submit(_Job([], None, False, Future(), call=fn))

    @property
    def running(self) -> bool:
        return bool(self._threads) and not self._stopping

    def _submit(self, job: _Job, admission: Admission | None = None) -> Future[Any]:
        """Queue ``job``. One admitted (``admission``) with one query was counted when it was let in: it is
        taken. Any other is checked against the limits now, behind the queries queued and the requests admitted."""
        with self._cond:
            admitted = admission is not None and admission.open
            if admission is not None:
                admission._close()
            if self._stopping:
                raise Stopped("the server is shutting down")
            ahead = self._queued + self._pending
            if not admitted or len(job.texts) > 1:
                if ahead and ahead + len(job.texts) > self.max_queue:
                    self.refused["queue"] += 1
                    raise Overloaded(f"{ahead} queries are already waiting (the limit is {self.max_queue})")
                wait = self.expected_wait(len(job.texts))
                if ahead and self.max_queue_wait and wait > self.max_queue_wait:
                    self.refused["queue"] += 1
                    raise Overloaded(
                        f"{ahead} queries are already waiting, about {wait * 1000:.0f} ms of work (the limit is "
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
        """Seconds before the engine is done with the queries waiting (and the requests admitted, one query
        each) and ``more``, at the pace of its recent batches: what is left of the batches running too. Without
        them a request accepted behind a full batch that had just begun waited that whole batch beyond the
        budget (256 clients: queue p99 127 ms at a 100 ms budget)."""
        now, fixed, per_query = time.perf_counter(), self._fixed, self._per_query
        running = sum(
            max(0.0, fixed + queries * per_query - (now - began)) for began, queries in list(self._running.values())
        )
        waiting = self._queued + self._pending + more
        batches = -(-waiting // self.max_batch)  # the batches they take at least
        return (batches * fixed + waiting * per_query + running) / self.workers

    def _paced(self, queries: int, seconds: float) -> None:
        """Fold a finished batch into the cost model: seconds = fixed + per query x queries, a least-squares fit
        over recent batches (weights decaying by 5% a batch, so it follows the load: a busier machine, longer
        texts). Batches of one size alone tell only what such a batch costs: all of it is taken as fixed.
        A single pace per query, learnt from batches at least half full only (a small batch's fixed cost spread
        over its few queries made it several times what queued queries cost once batched), went stale at 256
        clients, whose batches under a 100 ms budget held fewer queries than half of ``max_batch``."""
        if not queries:
            return
        if self._fit[0]:  # a batch counts at most 3x its queries at a batch of one's cost (a bound above what the
            # model says for any size): a single 2 s query (a 2,000-character text on a slow encoder) otherwise
            # set the fixed cost for dozens of batches, and every request with anything ahead of it was refused;
            # a machine that really slowed is followed, 3x a batch
            seconds = min(seconds, 3 * queries * (self._fixed + self._per_query))
        w, n, t, nn, nt = (0.95 * x for x in self._fit)
        w, n, t, nn, nt = w + 1, n + queries, t + seconds, nn + queries * queries, nt + queries * seconds
        self._fit = (w, n, t, nn, nt)
        mean_n, mean_t = n / w, t / w
        spread = nn / w - mean_n * mean_n
        fixed, per_query = mean_t, 0.0
        if spread > 0.25:  # sizes that differ: the slope is measured
            per_query = max(0.0, (nt / w - mean_n * mean_t) / spread)
            fixed = mean_t - per_query * mean_n
            if fixed < 0:  # no fixed part measurable: all of it per query
                fixed, per_query = 0.0, mean_t / mean_n
        self._fixed, self._per_query = fixed, per_query

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
            try:
                self._process(jobs)
            finally:
                self._running.pop(threading.get_ident(), None)

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
            if size:  # a call (``call``) is no batch of the model's
                self._running[threading.get_ident()] = (time.perf_counter(), size)
            return jobs

    def _process(self, jobs: list[_Job]) -> None:
        start = time.perf_counter()
        live = [job for job in jobs if job.future.set_running_or_notify_cancel()]
        if self.max_queue_wait:
            live = self._shed_late(live, start)
        for job in live:
            if job.call is not None:
                try:
                    job.future.set_result(job.call())
                except BaseException as err:  # noqa: BLE001 - handed to the caller
                    job.future.set_exception(err)
                finally:
                    self._call_ended = time.perf_counter()
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
        tokens = self._count_tokens(searcher, [job for job in live if job.count_tokens])
        for job in live:
            if job.params is None:
                self._embed(searcher, job, vectors[id(job)], generation, start, tokens.get(id(job)))
            else:
                groups.setdefault(job.params, []).append(job)
        for params, group in groups.items():
            self._search(searcher, params, group, vectors, generation, start)
        self._paced(len(texts), time.perf_counter() - start)
        if self._on_batch is not None:
            waited = start - min(job.enqueued for job in asked)
            try:
                self._on_batch(BatchStats(len(texts), len(asked), waited, time.perf_counter() - start))
            except Exception:  # noqa: BLE001 - a broken hook must not end the worker: every later request would hang
                log.exception("the batch hook failed")

    def _shed_late(self, jobs: list[_Job], start: float) -> list[_Job]:
        """Refuse (``Overloaded``, HTTP 429) the requests that waited longer than ``max_queue_wait`` before their
        batch began, rather than serve them late: admission is an estimate at the engine's recent pace, and when
        the machine slows (another process takes the cores) the requests already admitted wait longer than it
        said. 256 clients on two busy cores: p99 of accepted 480 ms at a 100 ms budget, with the queue's p99 at
        230 ms. A batch with nothing queued behind it is served whatever its wait: refusing it would speed up no
        one, and only a slow machine made it late. The jobs that stay are the rest of the batch."""
        with self._cond:
            behind = self._queued + self._pending
        if not behind:
            return jobs
        kept = []
        # Not lateness: the engine's own waits for a batch to fill, and time behind a call (warming a new index
        # version): a reload under 3 clients, and 16 requests batched with a 30 ms max_wait, were refused.
        allowed = self.max_queue_wait + self.max_wait + self.fill_wait
        for job in jobs:
            waited = start - max(job.enqueued, self._call_ended)
            if job.call is None and waited > allowed:
                with self._cond:
                    self.refused["late"] += 1
                job.future.set_exception(
                    Overloaded(
                        f"the request waited {waited * 1000:.0f} ms for the engine, longer than the limit of "
                        f"{allowed * 1000:.0f} ms"
                    )
                )
            else:
                kept.append(job)
        return kept

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
    def _count_tokens(searcher: Searcher, jobs: list[_Job]) -> dict[int, list[int]]:
        """The token counts of the jobs that asked, in one tokenizer call for them all, here in the engine
        thread: counted by the route handler, each request's tokenizing was another thread's hop and a turn of
        the event loop. A job whose texts fail to count gets the error (the others are counted alone)."""
        if not jobs:
            return {}
        try:
            counts = searcher.token_counts([text for job in jobs for text in job.texts])
        except Exception:  # noqa: BLE001 - counted again one job at a time, below
            counts = None
        out, at = {}, 0
        for job in jobs:
            if counts is not None:
                out[id(job)] = counts[at : at + len(job.texts)]
                at += len(job.texts)
                continue
            try:
                out[id(job)] = searcher.token_counts(job.texts)
            except Exception as err:  # noqa: BLE001 - handed to the caller
                job.future.set_exception(err)
        return out

    @staticmethod
    def _embed(
        searcher: Searcher,
        job: _Job,
        raw: np.ndarray,
        generation: int,
        start: float,
        tokens: list[int] | None = None,
    ) -> None:
        if job.future.done():  # its tokens failed to count
            return
        try:
            out = searcher.project(raw, job.dims) if job.transformed else raw
            vectors = np.asarray(out, dtype=np.float32)
            now = time.perf_counter()
            job.future.set_result(EmbedResult(vectors, generation, start - job.enqueued, now - start, tokens))
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            job.future.set_exception(err)

    @staticmethod
    def _search(
        searcher: Searcher,
        params: SearchParams,
        group: list[_Job],
        vectors: dict[int, np.ndarray],
        generation: int,
        start: float,
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
        at, ran = 0, time.perf_counter() - start
        for job in group:
            job.future.set_result(SearchResult(hits[at : at + len(job.texts)], generation, start - job.enqueued, ran))
            at += len(job.texts)
