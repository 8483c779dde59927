"""Counters, gauges and histograms with Prometheus text rendering and a JSON snapshot.

Cheap on hot paths: an update is one attribute add (no lock, no allocation). Each metric
object should be updated from one thread (a partition's worker, or the event loop); reads for
rendering may come from any thread and see a value at most one update old. Metrics are
identified by name plus a fixed label set given at creation; look them up once and keep the
object, never per event.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Final

DEFAULT_BUCKETS: Final = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                          2.5, 5.0, 10.0)


def _labels_text(labels: Mapping[str, str], extra: str = "") -> str:
    parts = [f'{k}="{_escape(str(v))}"' for k, v in labels.items()]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


class Counter:
    """A monotonically increasing count."""

    __slots__ = ("labels", "value")
    kind = "counter"

    def __init__(self, labels: Mapping[str, str]) -> None:
        self.labels = dict(labels)
        self.value = 0

    def inc(self, n: int = 1) -> None:
        self.value += n

    def samples(self, name: str) -> Iterable[tuple[str, str, float]]:
        yield name + "_total", _labels_text(self.labels), self.value


class Gauge:
    """A value that goes up and down, set directly or read from a callback at render time."""

    __slots__ = ("labels", "value", "_fn")
    kind = "gauge"

    def __init__(self, labels: Mapping[str, str], fn: Callable[[], float] | None = None) -> None:
        self.labels = dict(labels)
        self.value: float = 0
        self._fn = fn

    def set(self, value: float) -> None:
        self.value = value

    def read(self) -> float:
        return self._fn() if self._fn is not None else self.value

    def samples(self, name: str) -> Iterable[tuple[str, str, float]]:
        yield name, _labels_text(self.labels), self.read()


class Histogram:
    """Observations in fixed buckets (seconds by default), with sum and count."""

    __slots__ = ("labels", "bounds", "counts", "sum", "count")
    kind = "histogram"

    def __init__(self, labels: Mapping[str, str], buckets: Iterable[float] = DEFAULT_BUCKETS) -> None:
        self.labels = dict(labels)
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def quantile(self, q: float) -> float:
        """Upper bucket bound holding quantile ``q`` (coarse; for summaries, not for science)."""
        if not self.count:
            return 0.0
        target = q * self.count
        seen = 0
        for bound, n in zip(self.bounds + (math.inf,), self.counts):
            seen += n
            if seen >= target:
                return bound
        return math.inf

    def samples(self, name: str) -> Iterable[tuple[str, str, float]]:
        cumulative = 0
        for bound, n in zip(self.bounds + (math.inf,), self.counts):
            cumulative += n
            yield name + "_bucket", _labels_text(self.labels, f'le="{_num(bound)}"'), cumulative
        yield name + "_sum", _labels_text(self.labels), self.sum
        yield name + "_count", _labels_text(self.labels), self.count


Metric = Counter | Gauge | Histogram


class MetricsRegistry:
    """Named metric families. Creating the same name and labels twice returns the same object."""

    def __init__(self, prefix: str = "waltz") -> None:
        self.prefix = prefix
        self._families: dict[str, tuple[str, str, dict[tuple[tuple[str, str], ...], Metric]]] = {}

    def _get(self, kind: str, name: str, help: str, labels: Mapping[str, str] | None, make: Callable[[], Metric]) -> Metric:
        full = f"{self.prefix}_{name}" if self.prefix else name
        family = self._families.get(full)
        if family is None:
            family = (kind, help, {})
            self._families[full] = family
        elif family[0] != kind:
            raise ValueError(f"metric {full} is a {family[0]}, not a {kind}")
        key = tuple(sorted((labels or {}).items()))
        metric = family[2].get(key)
        if metric is None:
            metric = make()
            family[2][key] = metric
        return metric

    def counter(self, name: str, help: str = "", labels: Mapping[str, str] | None = None) -> Counter:
        return self._get("counter", name, help, labels, lambda: Counter(labels or {}))  # type: ignore[return-value]

    def gauge(self, name: str, help: str = "", labels: Mapping[str, str] | None = None,
              fn: Callable[[], float] | None = None) -> Gauge:
        return self._get("gauge", name, help, labels, lambda: Gauge(labels or {}, fn))  # type: ignore[return-value]

    def histogram(self, name: str, help: str = "", labels: Mapping[str, str] | None = None,
                  buckets: Iterable[float] = DEFAULT_BUCKETS) -> Histogram:
        return self._get("histogram", name, help, labels, lambda: Histogram(labels or {}, buckets))  # type: ignore[return-value]

    def remove(self, labels: Mapping[str, str]) -> None:
        """Drop every metric carrying exactly these label values (e.g. a partition that left)."""
        items = set(labels.items())
        for _kind, _help, metrics in self._families.values():
            for key in [k for k in metrics if items <= set(k)]:
                del metrics[key]

    def render_prometheus(self) -> str:
        """Prometheus text exposition format 0.0.4."""
        lines: list[str] = []
        for full, (kind, help, metrics) in sorted(self._families.items()):
            if not metrics:
                continue
            if help:
                lines.append(f"# HELP {full} {_escape(help)}")
            lines.append(f"# TYPE {full} {kind}")
            for metric in list(metrics.values()):
                for sample, labels, value in metric.samples(full):
                    lines.append(f"{sample}{labels} {_num(value)}")
        return "\n".join(lines) + "\n"

    def snapshot(self) -> dict[str, list[dict[str, object]]]:
        """A JSON-friendly view: name -> [{labels, value | count/sum/p50/p99}]."""
        out: dict[str, list[dict[str, object]]] = {}
        for full, (_kind, _help, metrics) in sorted(self._families.items()):
            rows: list[dict[str, object]] = []
            for m in list(metrics.values()):
                row: dict[str, object] = {"labels": dict(m.labels)}
                if isinstance(m, Histogram):
                    row.update(count=m.count, sum=m.sum, p50=m.quantile(0.5), p99=m.quantile(0.99))
                elif isinstance(m, Gauge):
                    row["value"] = m.read()
                else:
                    row["value"] = m.value
                rows.append(row)
            out[full] = rows
        return out
