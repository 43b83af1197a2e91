"""The service's Prometheus metrics: requests, errors, latency, batches, the queue and the serving index."""

from __future__ import annotations

import logging

from retrieval.serve.batching import BatchStats
from retrieval.serve.service import Service
from retrieval.serve.telemetry import Counter, Gauge, Histogram, Registry

log = logging.getLogger(__name__)


class Metrics:
    LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
    BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

    def __init__(self, service: Service):
        self.registry = r = Registry()
        self.requests = Counter(r, "retrieval_requests_total", "HTTP requests by route, method and status.")
        self.errors = Counter(r, "retrieval_errors_total", "Error responses by code.")
        self.latency = Histogram(
            r, "retrieval_request_duration_seconds", "Time to answer a request, by route.", self.LATENCY_BUCKETS
        )
        self.batch_size = Histogram(r, "retrieval_batch_size", "Queries per engine batch.", self.BATCH_BUCKETS)
        self.batch_seconds = Histogram(
            r, "retrieval_batch_duration_seconds", "Time to encode and search one batch.", self.LATENCY_BUCKETS
        )
        self.queue_wait = Histogram(
            r, "retrieval_queue_wait_seconds", "Time the oldest job of a batch waited.", self.LATENCY_BUCKETS
        )
        self.queries = Counter(r, "retrieval_queries_total", "Texts encoded by the engine (searches and embeds).")
        Gauge(r, "retrieval_queue_queries", "Queries waiting for the engine.", lambda: service.batcher.queued)
        batcher = service.batcher
        Gauge(
            r,
            "retrieval_admission_pending_requests",
            "Requests admitted to the engine before their body was read, not yet queued.",
            lambda: batcher.pending,
        )
        Gauge(
            r,
            "retrieval_admission_expected_wait_seconds",
            "The engine's work ahead of a new request, at its measured pace (429 beyond --max-queue-ms).",
            lambda: batcher.expected_wait(),
        )
        Gauge(r, "retrieval_engine_pace_seconds", "Engine seconds per query, recent batches.", lambda: batcher.pace)
        Gauge(r, "retrieval_ready", "1 once an index version is loaded and warmed.", lambda: float(service.ready))
        Gauge(r, "retrieval_index_generation", "Generation of the serving index version.", lambda: _generation(service))
        Gauge(r, "retrieval_index_documents", "Documents in the serving index version.", lambda: _documents(service))
        Gauge(
            r, "retrieval_index_loads_ok", "Index versions loaded, the first included.", lambda: _loads(service, "ok")
        )
        Gauge(r, "retrieval_index_loads_failed", "Index versions refused.", lambda: _loads(service, "failed"))

    def on_batch(self, stats: BatchStats) -> None:
        self.batch_size.observe(stats.queries)
        self.batch_seconds.observe(stats.seconds)
        self.queue_wait.observe(stats.waited)
        self.queries.inc(amount=stats.queries)


def _generation(service: Service) -> float | None:
    searcher = service.serving  # not `ready`: a scrape while stopping still says which version is draining
    return None if searcher is None else float(searcher.manifest.generation)


def _loads(service: Service, result: str) -> float:
    return float(service.reloads[result])


def _documents(service: Service) -> float | None:
    searcher = service.serving
    return None if searcher is None else float(searcher.manifest.n)
