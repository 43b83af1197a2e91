"""Which of a few ways of doing the same work is faster on this machine: each timed in turn, interleaved, so a
burst from the machine's neighbours falls on all of them alike, and the best run of each kept."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping


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
