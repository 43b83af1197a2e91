"""Choosing torch's thread count while serving, by measuring it: ``--torch-threads auto``.

Neither fixed setting is right on a 2-core machine. Quiet, two torch threads answered more (HNSW, 100k MiniLM
index: 77 vs 66 QPS at one client, 161 vs 130 at sixteen); with three other busy processes, two threads wait
at every OpenMP barrier for a core that is elsewhere, and answered less (13 vs 32 QPS at one client, 36 vs 51 at
sixteen; results/serve/). So the engine times its own encodes and keeps whichever setting was faster lately.

Batches are compared only with batches of about the same size (the cost of a query falls as batches grow), in
size classes 1, 2-3, 4-7, 8+. Each setting's estimate for a class is the median of its last ``SAMPLES``
timings, and the lower estimate wins. A setting with fewer timings, or none lately, is tried on the next batch
of that class: the setting in use follows a change of load within a couple of batches (it is timed on every
one); the others are re-tried after ``EXPLORE_S`` seconds, a wait that doubles, up to ``EXPLORE_MAX_S``, each
time a try is slower than the setting in use, and falls back to ``EXPLORE_S`` when a try is faster or the choice
changes. Each try is a batch run at a worse setting, and with 16 clients a batch and the one queued behind it
are ~2% of requests: tried every 5 s, that put the tries into p99 (HNSW, 16 clients, quiet, 40 s runs: p99
109 / 136 ms with tries every 5 s, 97 / 94 with every 40 s, 99 / 101 with two threads fixed).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from retrieval import timing

EXPLORE_S = 5.0  # a setting not timed for this long (for a size class) is tried again ...
EXPLORE_MAX_S = 40.0  # ... a wait doubled after each try that lost, up to this
SAMPLES = 3  # timings per setting and size class: the estimate is their median
SIZE_CLASSES = 4  # 1, 2-3, 4-7, 8+ queries
CLASS_NAMES = {1: "1", 2: "2-3", 3: "4-7", 4: "8+"}


def default_choices(cpus: int | None = None) -> tuple[int, ...]:
    """1 thread, half the cores, all of them (duplicates dropped): (1, 2) on 2 cores, (1, 4, 8) on 8."""
    cpus = max(1, cpus if cpus is not None else os.cpu_count() or 1)
    return tuple(sorted({1, max(1, cpus // 2), cpus}))


def size_class(queries: int) -> int:
    return min(max(1, queries).bit_length(), SIZE_CLASSES)


class ThreadChooser:
    """``choose(queries)`` before a batch (applies the setting through ``apply`` when it changes and returns
    it); ``record(queries, threads, seconds)`` after. Safe to call from several threads, though a process-wide
    setting is only meaningful with one engine worker."""

    def __init__(
        self,
        apply: Callable[[int], None],
        choices: Sequence[int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        idle: Callable[[], float | None] | None = None,
    ):
        self.choices = tuple(choices) if choices else default_choices()
        if not self.choices or min(self.choices) < 1:
            raise ValueError("thread choices must be positive")
        self._apply = apply
        self._clock = clock
        self._idle = idle  # idle cores lately (``IdleCores``); None: every setting may be tried at any time
        self._lock = threading.Lock()
        self._timings: dict[tuple[int, int], deque[tuple[float, float]]] = {}
        self._wait: dict[int, float] = {}  # per size class: how long a setting out of use waits to be tried
        self._trying: dict[int, int] = {}  # per size class: the setting just tried (its timing not yet judged)
        self._winner: dict[int, int] = {}  # per size class: the setting chosen last by its estimate
        self.current: int | None = None  # the setting applied last
        self.switches = 0

    def choose(self, queries: int) -> int:
        """The setting for a batch of ``queries``: the estimates' (``timing.policy`` site ``threads``; all the
        choices' cores, untimed, when the policy is deterministic)."""
        fixed = timing.policy().fixed("threads", str(max(self.choices)))
        with self._lock:
            threads = int(fixed) if fixed is not None else self._pick(size_class(queries), self._clock())
            if threads != self.current:
                self._apply(threads)
                self.switches += self.current is not None
                self.current = threads
            return threads

    def forget_applied(self) -> None:
        """The thread count was changed behind the chooser's back: apply its choice again at the next batch."""
        with self._lock:
            self.current = None

    def record(self, queries: int, threads: int, seconds: float) -> None:
        if queries < 1 or seconds < 0:
            return
        with self._lock:
            key = (size_class(queries), threads)
            self._timings.setdefault(key, deque(maxlen=SAMPLES)).append((self._clock(), seconds / queries))

    def _room(self, threads: int) -> bool:
        """A setting may be tried or chosen: it is no more threads than in use now, or the cores it adds beyond
        those are idle. With other processes on every core, each try at two threads was a batch run at several
        times the cost (every OpenMP barrier waits for a core that is elsewhere): 256 clients on two busy cores,
        engine p99 320 ms against p50 68 ms."""
        in_use = self.current or min(self.choices)
        if self._idle is None or threads <= in_use:
            return True
        idle = self._idle()
        return idle is None or idle >= threads - in_use - 0.25

    def _pick(self, cls: int, now: float) -> int:
        wait = self._wait.get(cls, EXPLORE_S)
        estimates = {}
        for threads in self.choices:
            if not self._room(threads):
                continue
            timings = self._timings.get((cls, threads), deque())
            if len(timings) < SAMPLES:
                return threads  # not measured enough: measure it
            # Not used lately: try it. Not the setting in use, though: after a pause in traffic it is stale too,
            # and "trying" it would replace the pending try with the winner's own timing, judged a loss.
            if now - timings[-1][0] > wait and threads != self._winner.get(cls):
                self._trying[cls] = threads
                return threads
            estimates[threads] = _estimate(timings)
        best = min(estimates, key=estimates.__getitem__)
        tried = self._trying.pop(cls, None)
        faster = tried is not None and self._timings[(cls, tried)][-1][1] < estimates[best]
        if best != self._winner.get(cls) or faster:
            self._wait[cls] = EXPLORE_S  # the choice changed, or a try was faster: look again soon
        elif tried is not None:
            self._wait[cls] = min(2 * wait, EXPLORE_MAX_S)  # the try lost: try less often
        self._winner[cls] = best
        return best

    def describe(self) -> dict[str, Any]:
        """For /info: the choices, the setting in use, switches so far, and each setting's estimate in
        milliseconds per query by batch size ({"8+": {"1": 8.1, "2": 6.2}, ...})."""
        with self._lock:
            recent: dict[str, dict[str, float]] = {}
            for cls, name in CLASS_NAMES.items():
                for threads in self.choices:
                    if timings := self._timings.get((cls, threads)):
                        recent.setdefault(name, {})[str(threads)] = round(1000 * _estimate(timings), 3)
            return {
                "choices": list(self.choices),
                "current": self.current,
                "switches": self.switches,
                "ms_per_query": recent,
                "retry_after_s": {CLASS_NAMES[cls]: wait for cls, wait in sorted(self._wait.items())},
            }


class IdleCores:
    """Cores idle lately, machine-wide, from /proc/stat: measured over at least ``interval`` seconds since the
    last measure (the value is kept in between); None where /proc/stat cannot be read."""

    def __init__(self, interval: float = 0.25, path: str = "/proc/stat"):
        self.interval, self.path = interval, path
        self._last: tuple[float, float, float] | None = None  # (when, idle jiffies, all jiffies)
        self._value: float | None = None

    def _read(self) -> tuple[float, float] | None:
        try:
            with open(self.path) as f:
                fields = [float(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        return fields[3] + (fields[4] if len(fields) > 4 else 0.0), sum(fields[:8])

    def __call__(self) -> float | None:
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self.interval:
            return self._value
        sample = self._read()
        if sample is None:
            return None
        if self._last is not None and sample[1] > self._last[2]:
            share = (sample[0] - self._last[1]) / (sample[1] - self._last[2])
            self._value = max(0.0, share) * (os.cpu_count() or 1)
        self._last = (now, *sample)
        return self._value


def _estimate(timings: deque[tuple[float, float]]) -> float:
    """Seconds per query of a setting: the median of its kept (time, seconds per query) timings."""
    return statistics.median(seconds for _, seconds in timings)
