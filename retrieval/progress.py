"""How the library reports progress and stage timings to its front ends (CLI bars, service logs, benchmarks)."""

from __future__ import annotations

import time
from collections.abc import Callable

# progress(stage, rows_done_now, rows_total): called as work advances.
Progress = Callable[[str, int, int], None]


def no_progress(stage: str, advance: int, total: int) -> None:
    return None


class Timer:
    """Wall time per stage, in seconds, in the order the stages ran."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def stage(self, name: str) -> _Stage:
        return _Stage(self, name)


class _Stage:
    def __init__(self, timer: Timer, name: str):
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        elapsed = time.perf_counter() - self.start
        self.timer.seconds[self.name] = round(self.timer.seconds.get(self.name, 0.0) + elapsed, 4)
