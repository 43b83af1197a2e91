"""The search service without HTTP: its options, the serving Searcher, hot reload, and the directory watcher.

A ``Service`` loads its index directory in the background (``ready`` once loaded and warmed), serves it through
one micro-batching engine (``batching.Batcher``), and replaces it when the directory is replaced: a watcher
polls the directory's identity (a few ``stat``s: writers publish a new directory by renaming it into place; a file
edited in place is seen too, and refused when it no longer matches its checksum), and
``reload()`` can be called at any time. A reload reads the new version fully checked, with the current encoder
reused when the new version was built with the same one, warms it, then swaps it in between two batches;
a batch already running finishes on the old version. A replacement that fails to load is refused: the old
version keeps serving, and ``last_error`` says why.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from retrieval.encode.spec import Encoder
from retrieval.errors import ConfigError, RetrievalError
from retrieval.indexdir import Identity, IndexDir, Verify, check_verify
from retrieval.manifest import now
from retrieval.options import option
from retrieval.search import MAX_K, STASH_READS, Searcher
from retrieval.serve.autothreads import IdleCores, ThreadChooser
from retrieval.serve.batching import Batcher, BatchStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeOptions:
    """The service's limits and engine settings, each declared once (``options.option``): the CLI's `serve` options,
    /info and the documentation's table are generated from these fields.

    Engine defaults were measured with scripts/bench_serve.py on a 100k-document MiniLM index on this project's
    2-core machine (results/serve/): see the comments on each.
    """

    # Micro-batching: queries per engine batch (B) and how long the engine waits for more after the first (T).
    # T = 0: a wait only adds latency, since requests queue up by themselves while a batch runs (T = 10 ms:
    # 1 client 26 QPS, p50 33 ms, against 50 QPS, p50 20 ms at T = 0; 16 clients 26 against 64 QPS).
    # B: see README "Serving" (B = 1, no batching, to 64; 16 and 64 clients).
    max_batch: int = option(32, "Micro-batching: queries per engine batch.", group="batching")
    max_wait_ms: float = option(
        0.0, "Micro-batching: wait this long for more queries after the first.", group="batching"
    )
    # While a batch holds fewer queries than were in flight when the last one ended (those it answered and those
    # waiting), wait up to this long for the rest (``Batcher``):
    # closed-loop clients otherwise split into alternating batches of a few and many queries. HNSW 100k, bf16
    # machine, 16 clients: see README "Micro-batching" for the measurements behind the value.
    fill_wait_ms: float = option(
        2.0,
        "Micro-batching: while a batch holds fewer queries than were in flight when the last one ended (those it "
        "answered and those waiting), wait this long for the rest.",
        group="batching",
    )
    # Threads of torch's intra-op pool (process-wide): "auto" measures (``autothreads``). Neither fixed
    # count wins everywhere: on the quiet 2-core machine two threads answered more (HNSW 100k: 16 clients 161 vs
    # 130 QPS), with three other busy processes far less (1 client 13 vs 32 QPS; at load average 10-12 on the
    # shared machine: 6 vs 50). "auto" needs one engine worker (the setting is the whole process's).
    # FAISS's OpenMP pool in the engine thread: one; two FAISS threads: 1 client p99 69 against 30 ms, 16 clients
    # 51 against 64 QPS (flat; HNSW 16 clients 108 vs 130 QPS).
    torch_threads: int | str = option(
        "auto", "torch intra-op threads, or auto: the engine times its batches and keeps the faster.", cli_type=str
    )
    faiss_threads: int = option(1, "FAISS OpenMP threads in the engine.")
    # Threads of numpy's BLAS (process-wide), which runs the flat scan's matrix product for batches of 4-19
    # queries (retrieval/scan.py). OpenBLAS's threads spin after each product, taking the core the forward pass
    # of the next batch needs: 100k flat index, 16 clients, 34 QPS with its default (2 threads), 50 with one.
    blas_threads: int = option(1, "numpy BLAS threads (flat scans).")
    # Engine workers: batches processed at once, each on one torch thread and one FAISS thread.
    engine_workers: int = option(1, "Engine threads, each encoding and searching one batch at a time.")
    # Limits of one request: queries in a batch request, characters of one query, hits per query.
    max_queries: int = option(64, "Queries in one request.", group="limits")
    max_query_chars: int = option(2000, "Characters in one query.", group="limits")
    max_k: int = option(100, "Hits per query.", group="limits")
    max_rescore: int = option(1000, "Candidates one query may re-score.", cli=False, group="limits")
    # ef_search / nprobe: beyond this one query could occupy the engine for seconds
    max_ef_nprobe: int = option(
        4096, "The largest ef_search or nprobe one query may ask for.", cli=False, group="limits"
    )
    max_body_bytes: int = option(1 << 20, "Request body size (413 above).", group="limits")
    # Queries waiting for the engine before new requests get 429.
    max_queue: int = option(1024, "Queries waiting before 429.", group="limits")
    # ... and the work ahead, in milliseconds at the engine's recent pace, before new requests get 429 (0: no
    # limit); a request taken after waiting longer than this is refused too (429), not served late. 256
    # closed-loop clients on a 2-core machine queued ~1 s of work each time (p99 ~1 s, no 429) with only the
    # count. scripts/bench_overload.py, 256 clients, two cores shared with other jobs, two runs back to back:
    # p99 of accepted 258 ms at 50 ms, 375 ms at 100 ms, with as many answered (319 vs 310 a second).
    max_queue_ms: float = option(
        50.0,
        "Work ahead of a request, in ms at the engine's recent pace, before 429; also the longest a request "
        "waits for the engine before it is refused (0: no limit).",
        group="limits",
    )
    # Seconds between two looks at the index directory (0: never; POST /reload still works).
    watch_interval: float = option(1.0, "Seconds between looks at the index directory for a new version (0: off).")
    # Re-scored rows read from the stash by pread rather than maps: the server's resident set stays at what it
    # allocates (1M binary rows with an int8 stash: docs/benchmarks/codes.md), each read a system call.
    stash_reads: str = option("map", "How re-scoring reads the stash: map (memory maps, kept resident) or pread.")
    verify: Verify = "full"

    def check(self) -> None:
        positive = {
            "faiss_threads": self.faiss_threads,
            "blas_threads": self.blas_threads,
            "engine_workers": self.engine_workers,
            "max_batch": self.max_batch,
            "max_queries": self.max_queries,
            "max_query_chars": self.max_query_chars,
            "max_k": self.max_k,
            "max_ef_nprobe": self.max_ef_nprobe,
            "max_body_bytes": self.max_body_bytes,
            "max_queue": self.max_queue,
        }
        for name, value in positive.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"`{name}` must be a positive integer (got {value!r})", name)
        # after the counts: `engine_workers` 0 is wrong in itself, not for want of a `torch_threads` number
        if self.torch_threads == "auto":
            if self.engine_workers != 1:
                raise ConfigError(
                    "`torch_threads` auto times one engine worker's batches: with `engine_workers` above 1, give "
                    "`torch_threads` a number (1: one thread per worker)",
                    "torch_threads",
                )
        elif isinstance(self.torch_threads, (str, bool)) or self.torch_threads < 1:
            raise ConfigError(
                f"`torch_threads` must be auto or a positive integer (got {self.torch_threads!r})", "torch_threads"
            )
        waits = (
            ("max_wait_ms", self.max_wait_ms),
            ("fill_wait_ms", self.fill_wait_ms),
            ("max_queue_ms", self.max_queue_ms),
        )
        for name, seconds in (*waits, ("watch_interval", self.watch_interval)):
            if not 0 <= seconds <= 3600:
                raise ConfigError(f"`{name}` must be between 0 and 3600 (got {seconds!r})", name)
        if self.max_k > MAX_K:
            limit = f"at most {MAX_K:,}, the most hits a search returns"
            raise ConfigError(f"`max_k` must be {limit} (got {self.max_k:,})", "max_k")
        if self.max_rescore < 0:
            raise ConfigError(f"`max_rescore` must be at least 0 (got {self.max_rescore})", "max_rescore")
        if self.stash_reads not in STASH_READS:
            choices = " or ".join(STASH_READS)
            raise ConfigError(f"`stash_reads` must be {choices} (got {self.stash_reads!r})", "stash_reads")
        check_verify(self.verify)


# What the engine encodes at each torch thread count before /ready (``Service._warm_thread_counts``): a full
# batch of short texts of mixed lengths, packed as real queries are.
WARM_TEXTS = [f"warm-up query {i}: " + " ".join(["retrieval"] * (i % 24)) for i in range(32)]
WARM_TIMEOUT_S = 300.0
SHUTTING_DOWN = "the server is shutting down"


class NotReady(RetrievalError):
    """No index version is loaded yet (HTTP 503)."""


@dataclass(frozen=True)
class ReloadOutcome:
    """What ``Service.reload`` did: ``reloaded``, a new version swapped in; else ``error`` says why it was
    refused, or is None when the directory still holds the version served (nothing was read)."""

    reloaded: bool
    generation: int | None
    seconds: float
    error: str | None = None


class Service:
    """One index directory served: ``start()``, ``searcher()``, ``reload()``, ``stop()``.

    ``encoder``: use this encoder for the first load (tests pass a fake one); later loads reuse the serving
    encoder whenever the new version was built with the same model, pooling and max length.
    ``on_batch``: called by the engine after each batch (metrics).
    """

    def __init__(
        self,
        directory: Path | str,
        options: ServeOptions = ServeOptions(),
        encoder: Encoder | None = None,
        on_batch: Any = None,
    ):
        options.check()
        self.directory = Path(directory)
        self.options = options
        self._encoder = encoder
        self._searcher: Searcher | None = None
        self._identity: Identity | None = None  # the directory's identity when the serving version was read
        self._failed_identity: Identity | None = None  # ... when a load last failed: not retried unchanged
        self._reload_lock = threading.Lock()
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self.last_error: str | None = None
        self.last_error_at: str | None = None
        self.loaded_at: str | None = None
        self.reloads = {"ok": 0, "failed": 0}  # loads, the first one included
        self.on_batch = on_batch  # called with each batch's BatchStats (the app's metrics set it)
        self._torch_encoder = False  # the serving version encodes with torch (its thread count is ours to set)
        auto = options.torch_threads == "auto"
        self.threads = ThreadChooser(self._set_torch_threads, idle=IdleCores()) if auto else None
        self.batcher = Batcher(
            self.searcher,
            max_batch=options.max_batch,
            max_wait=options.max_wait_ms / 1000,
            fill_wait=options.fill_wait_ms / 1000,
            max_queue=options.max_queue,
            max_queue_wait=options.max_queue_ms / 1000,
            setup=self._engine_thread_setup,
            on_batch=self._batch_done,
            workers=options.engine_workers,
            threads=self.threads,
        )

    # ----- state -----------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """A version is loaded and the service is not stopping (``stop`` ends readiness before it drains)."""
        return self._searcher is not None and not self._stopping.is_set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def serving(self) -> Searcher | None:
        """The loaded version, if any, also while stopping (it still answers what is in flight)."""
        return self._searcher

    def searcher(self) -> Searcher:
        """The version serving now (one attribute read: a reload swaps it whole)."""
        searcher = self._searcher
        if searcher is None:
            raise NotReady(self.last_error or "the index is still loading")
        return searcher

    def kept_columns(self) -> pa.Schema | None:
        """The metadata columns the serving version kept, what a filter may name (an empty schema: none); None
        while no version is loaded."""
        searcher = self._searcher
        if searcher is None:
            return None
        table = searcher.loaded.columns
        return pa.schema([]) if table is None else table.schema

    def _batch_done(self, stats: BatchStats) -> None:
        if self.on_batch is not None:
            self.on_batch(stats)

    # ----- life cycle ------------------------------------------------------------------------------------
    def start(self, background: bool = True) -> None:
        """Start the engine, then load the index (in a thread when ``background``) and watch the directory.
        A stopped service does not start again: make a new one."""
        self.batcher.start()
        if background:
            self._watcher = threading.Thread(target=self._load_and_watch, name="retrieval-reload", daemon=True)
            self._watcher.start()
        else:
            self.reload()
            if self.options.watch_interval:
                self._watcher = threading.Thread(target=self._watch, name="retrieval-reload", daemon=True)
                self._watcher.start()

    def begin_shutdown(self) -> None:
        """The server was told to stop (SIGTERM): no longer ready, no more reloads; what is queued still runs."""
        self._stopping.set()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop watching, let the engine finish what is queued, and end it."""
        self.begin_shutdown()
        self.batcher.stop(timeout)
        # Not while it loads a version: one that would never serve (a first load takes seconds; the thread is a
        # daemon, and loading writes nothing). Waiting made a server stopped during start-up take that long.
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(0 if self._reload_lock.locked() else timeout)

    def _load_and_watch(self) -> None:
        self.reload()
        if self.options.watch_interval:
            self._watch()

    def _watch(self) -> None:
        directory = IndexDir(self.directory)
        while not self._stopping.wait(self.options.watch_interval):
            identity = directory.identity()
            if identity is None or identity in (self._identity, self._failed_identity):
                continue
            log.info("%s was replaced: loading the new version", self.directory)
            self.reload()

    # ----- reload ----------------------------------------------------------------------------------------
    def reload(self) -> ReloadOutcome:
        """Load the directory's current version, warm it, and swap it in; on failure keep serving the old one.
        Nothing is read when the directory still holds the version served: each ``POST /reload`` was a full
        verified load (3-4 s for a 126 MB index), and 50 at once queued for minutes. Calls that wait here while
        a version loads find it served when their turn comes, so they cost nothing either."""
        with self._reload_lock:
            start = time.perf_counter()
            serving = self._searcher.manifest.generation if self._searcher else None
            if self.stopping:  # nor after the shutdown began: queued reloads kept loading and delayed the exit
                return ReloadOutcome(False, serving, 0.0, SHUTTING_DOWN)
            identity = IndexDir(self.directory).identity()
            if self._searcher is not None and identity is not None and identity == self._identity:
                return ReloadOutcome(False, serving, time.perf_counter() - start)
            try:
                searcher = self._load()
            except Exception as err:  # noqa: BLE001 - any failure refuses the new version; the old one serves on
                self._failed_identity = identity
                self.reloads["failed"] += 1
                self.last_error = str(err) if isinstance(err, RetrievalError) else f"{type(err).__name__}: {err}"
                self.last_error_at = now()
                if isinstance(err, RetrievalError):
                    log.error("refused to load %s (still serving %s): %s", self.directory, serving, err)
                else:
                    log.exception("refused to load %s (still serving %s)", self.directory, serving)
                return ReloadOutcome(False, serving, time.perf_counter() - start, self.last_error)
            if self.stopping:  # loaded after the shutdown began: it would serve nothing
                return ReloadOutcome(False, serving, time.perf_counter() - start, SHUTTING_DOWN)
            self._searcher = searcher  # the swap: the engine's next batch reads this attribute
            self._identity, self._failed_identity = identity, None
            self.loaded_at = now()
            self.last_error = self.last_error_at = None
            self.reloads["ok"] += 1
            seconds = time.perf_counter() - start
            log.info(  # a normal load: INFO (``retrieval serve`` shows the service's INFO lines)
                "serving %s generation %d (%d documents; loaded and warmed in %.2fs)",
                self.directory,
                searcher.manifest.generation,
                searcher.manifest.n,
                seconds,
            )
            return ReloadOutcome(True, searcher.manifest.generation, seconds)

    def _load(self) -> Searcher:
        manifest = IndexDir(self.directory).manifest()
        encoder = self._searcher.encoder if self._searcher is not None else self._encoder
        if encoder is not None and manifest.encoder.encodes_text:
            try:
                manifest.encoder.check_query(encoder.info())
            except ConfigError:
                log.warning("the new version of %s uses another encoder: loading it", self.directory)
                encoder = None
        if encoder is None and manifest.encoder.kind == "transformers":
            threads = self.options.torch_threads
            if isinstance(threads, int):
                set_torch_threads(threads)
            elif not self._torch_encoder:  # auto starts at one, then measures
                # Not while a torch encoder serves: the setting is process-wide, and this (reload) thread would
                # change the count under the engine's batches; the engine warms the new encoder at each count.
                set_torch_threads(1)
        searcher = Searcher.load(
            self.directory, encoder=encoder, verify=self.options.verify, stash_reads=self.options.stash_reads
        )
        searcher.warm_up()
        self._torch_encoder = searcher.manifest.encoder.kind == "transformers"
        if encoder is None and self._torch_encoder and self.threads is not None and self.batcher.running:
            self.batcher.call(lambda: self._warm_thread_counts(searcher)).result(WARM_TIMEOUT_S)
        return searcher

    def _warm_thread_counts(self, searcher: Searcher) -> None:
        """In the engine thread, with a newly loaded encoder: encode a batch at every thread count ``auto`` may
        choose, so each count's threads and buffers exist before /ready (the server starts at the memory it
        keeps, and no request pays for a first use). The chooser applies its own choice at the next batch."""
        assert self.threads is not None
        for threads in self.threads.choices:
            set_torch_threads(threads)
            searcher.encode(WARM_TEXTS)
        self.threads.forget_applied()

    def _set_torch_threads(self, threads: int) -> None:
        """What ``--torch-threads auto`` applies before a batch: nothing for encoders that are not torch's."""
        if self._torch_encoder:
            set_torch_threads(threads)

    def _engine_thread_setup(self) -> None:
        set_faiss_threads(self.options.faiss_threads)
        # After FAISS is imported: its wheel brings an OpenMP OpenBLAS, whose setting is per thread, like OpenMP's.
        set_blas_threads(self.options.blas_threads)


def set_torch_threads(threads: int | None) -> None:
    """torch's intra-op pool size (process-wide; read lazily by every thread that runs torch)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def set_blas_threads(threads: int | None) -> None:
    """numpy's BLAS pool size (OpenBLAS, MKL: process-wide), through threadpoolctl."""
    if threads:
        from threadpoolctl import threadpool_limits

        threadpool_limits(threads, user_api="blas")


def set_faiss_threads(threads: int | None) -> None:
    """FAISS's OpenMP pool size for the calling thread (OpenMP keeps the setting per thread)."""
    if threads:
        import faiss

        faiss.omp_set_num_threads(threads)
