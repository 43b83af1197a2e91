"""Counters, gauges and histograms for the service, written out in Prometheus' text exposition format (0.0.4).

A few dozen lines instead of prometheus_client: the service needs three metric types, labels, and one text
rendering; no process collectors, multiprocess mode or push gateway. Updates come from the event loop and the
engine thread, so every change takes the registry's lock.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence

Labels = tuple[tuple[str, str], ...]


def _labels(labels: dict[str, str] | None) -> Labels:
    return tuple(sorted((labels or {}).items()))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _render_labels(labels: Labels, extra: tuple[str, str] | None = None) -> str:
    items = list(labels) + ([extra] if extra else [])
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in items) + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class _Metric:
    kind = ""

    def __init__(self, registry: Registry, name: str, help: str):
        self.name, self.help = name, help
        self._lock = registry.lock
        registry.metrics.append(self)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def lines(self) -> list[str]:
        raise NotImplementedError


class Counter(_Metric):
    kind = "counter"

    def __init__(self, registry: Registry, name: str, help: str):
        super().__init__(registry, name, help)
        self.values: dict[Labels, float] = {}

    def inc(self, labels: dict[str, str] | None = None, amount: float = 1.0) -> None:
        key = _labels(labels)
        with self._lock:
            self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, labels: dict[str, str] | None = None) -> float:
        return self.values.get(_labels(labels), 0.0)

    def lines(self) -> list[str]:
        return [f"{self.name}{_render_labels(k)} {_number(v)}" for k, v in sorted(self.values.items())]


class Gauge(_Metric):
    """A value read when the metrics are rendered (``fn``), so it is never stale."""

    kind = "gauge"

    def __init__(self, registry: Registry, name: str, help: str, fn: Callable[[], float | None]):
        super().__init__(registry, name, help)
        self.fn = fn

    def lines(self) -> list[str]:
        value = self.fn()
        return [] if value is None else [f"{self.name} {_number(value)}"]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, registry: Registry, name: str, help: str, buckets: Sequence[float]):
        super().__init__(registry, name, help)
        self.buckets = sorted(buckets)
        self.series: dict[Labels, list[float]] = {}  # per-bucket counts (not cumulative), then sum, then count

    def observe(self, value: float, labels: dict[str, str] | None = None) -> None:
        key = _labels(labels)
        with self._lock:
            series = self.series.setdefault(key, [0.0] * (len(self.buckets) + 2))
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    series[i] += 1
                    break
            series[-2] += value
            series[-1] += 1

    def count(self, labels: dict[str, str] | None = None) -> int:
        series = self.series.get(_labels(labels))
        return int(series[-1]) if series else 0

    def lines(self) -> list[str]:
        out = []
        for key, series in sorted(self.series.items()):
            cumulative = 0.0
            for bound, n in zip(self.buckets, series, strict=False):
                cumulative += n
                out.append(f"{self.name}_bucket{_render_labels(key, ('le', _number(bound)))} {_number(cumulative)}")
            out.append(f"{self.name}_bucket{_render_labels(key, ('le', '+Inf'))} {_number(series[-1])}")
            out.append(f"{self.name}_sum{_render_labels(key)} {_number(series[-2])}")
            out.append(f"{self.name}_count{_render_labels(key)} {_number(series[-1])}")
        return out


class Registry:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.metrics: list[_Metric] = []

    def render(self) -> str:
        lines: list[str] = []
        for metric in self.metrics:
            with self.lock:
                body = metric.lines()
            lines += metric.header() + body
        return "\n".join(lines) + "\n"
