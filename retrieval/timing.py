"""Which of a few ways of doing the same work is faster on this machine: each timed in turn, interleaved, so a
burst from the machine's neighbours falls on all of them alike, and the best run of each kept; and the one
``Policy`` every such choice in the library goes through, which tests replace and one environment variable
makes deterministic.

The choices, by site name (each with the way a deterministic policy takes, untimed):

    precision   "fp32", "bf16" or "int8": precision "auto" of the transformers encoder, on a CPU with native bf16
                (int8 only where precision.INT8_IN_AUTO lets auto weigh it) (fp32)
    trace       "fp32" or "bf16": the traced single-text model, among the traces that agree with fp32 (fp32)
    attention   "sdpa" or "chunked": the bf16 model's attention kernel (sdpa, the model's own)
    scan        "faiss" or "numpy": the flat scan's path for batches of queries (faiss)
    threads     a torch thread count: ``--torch-threads auto`` while serving (all of the choices' cores)

``RETRIEVAL_DETERMINISTIC=1`` in the environment: every choice takes its deterministic way, nothing is timed,
so two runs on one machine compute alike whatever its load (and a run's vectors do not depend on a timing).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

DETERMINISTIC_ENV = "RETRIEVAL_DETERMINISTIC"


def best_times(candidates: Mapping[str, Callable[[], object]], rounds: int, warm_up: int = 0) -> dict[str, float]:
    """Seconds of each candidate's fastest run: ``warm_up`` rounds that are not counted, then ``rounds`` that are,
    each round running every candidate once, in order."""
    best = dict.fromkeys(candidates, float("inf"))
    for round_ in range(warm_up + rounds):
        for name, run in candidates.items():
            start = time.perf_counter()
            run()
            if round_ >= warm_up:
                best[name] = min(best[name], time.perf_counter() - start)
    return best


@dataclass(frozen=True)
class Policy:
    """How the self-timing choices are made. ``timed`` True (the default): each site times its ways
    (``best_times``) and takes the fastest; False: each takes its deterministic way, untimed. ``answers`` fixes
    the way of named sites whatever ``timed`` says (site -> way; for ``threads``, the count as a string)."""

    timed: bool = True
    answers: Mapping[str, str] = field(default_factory=dict)

    def fixed(self, site: str, default: str) -> str | None:
        """The way ``site`` takes without timing (its answer, or ``default`` when untimed), else None: time it."""
        if site in self.answers:
            return self.answers[site]
        return None if self.timed else default

    def fastest(
        self, site: str, ways: Mapping[str, Callable[[], object]], default: str, rounds: int, warm_up: int = 0
    ) -> str:
        """The way ``site`` takes: fixed (``fixed``), or the fastest of ``ways`` by ``best_times``."""
        way = self.fixed(site, default)
        if way is not None:
            return way
        seconds = best_times(ways, rounds, warm_up)
        chosen = min(seconds, key=seconds.__getitem__)
        log.info("%s: %s (%s)", site, chosen, ", ".join(f"{name} {s * 1e3:.2f} ms" for name, s in seconds.items()))
        return chosen


_chosen: Policy | None = None
_lock = threading.Lock()


def policy() -> Policy:
    """The policy in force: the one ``use`` set, else the environment's (``RETRIEVAL_DETERMINISTIC=1``: untimed)."""
    if _chosen is not None:
        return _chosen
    deterministic = os.environ.get(DETERMINISTIC_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    return Policy(timed=not deterministic)


@contextmanager
def use(chosen: Policy) -> Iterator[Policy]:
    """Make ``chosen`` the policy in force inside the block (process-wide), then restore the one before."""
    global _chosen
    with _lock:
        before, _chosen = _chosen, chosen
    try:
        yield chosen
    finally:
        with _lock:
            _chosen = before
