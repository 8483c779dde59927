"""Counters, gauges and histograms with Prometheus text rendering and a JSON snapshot.

Cheap on hot paths: an update is one attribute add (no lock, no allocation). Each metric
object should be updated from one thread (a partition's worker, or the event loop); reads for
rendering may come from any thread and see a value at most one update old. Metrics are
identified by name plus a fixed label set given at creation; look them up once and keep the
object, never per event.

The text is exposition format 0.0.4 as ``promtool check metrics`` and prometheus_client's parser
want it: a counter created as ``x`` is the family ``x_total`` (``# TYPE x_total counter``, sample
``x_total``), so no counter may be named ``..._total`` and no other metric either; every family
has a ``# HELP`` line.
"""

from __future__ import annotations

import bisect
import math
import os
import re
import resource
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Final

from .eventloop import loop_name
from .memlimit import memory_limit

DEFAULT_BUCKETS: Final = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                          2.5, 5.0, 10.0)


def _labels_text(labels: Mapping[str, str], extra: str = "") -> str:
    parts = [f'{k}="{_escape(str(v))}"' for k, v in labels.items()]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(value: str) -> str:
    """HELP text escapes only backslash and newline (a ``\\"`` there would be read literally)."""
    return value.replace("\\", "\\\\").replace("\n", "\\n")


def _le(bound: float) -> str:
    """A bucket's ``le`` label."""
    return f'le="{_num(float(bound))}"'


def _num(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if math.isnan(v):
        return "NaN"
    return repr(float(v))


_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")  # ":" is for recording rules


class _Value:
    """One number with labels, kept here or read from a callback at render time."""

    __slots__ = ("labels", "value", "_fn", "_head")

    def __init__(self, labels: Mapping[str, str], fn: Callable[[], float] | None = None) -> None:
        self.labels = dict(labels)
        self.value: float = 0
        self._fn = fn
        self._head: tuple[str, str] = ("", "")  #: (name, its sample line up to the value), made at first render

    def read(self) -> float:
        return self._fn() if self._fn is not None else self.value

    def render_into(self, name: str, out: list[str]) -> None:
        """Append this metric's sample line to ``out`` (the text before the value is made once)."""
        head = self._head
        if head[0] != name:
            self._head = head = (name, f"{name}{_labels_text(self.labels)} ")
        out.append(head[1] + _num(self.read()))


class Counter(_Value):
    """A monotonically increasing count, incremented or read from a callback at render time (a
    count the owner keeps as a plain int anyway)."""

    __slots__ = ()
    kind = "counter"

    def inc(self, n: int = 1) -> None:
        self.value += n


class Gauge(_Value):
    """A value that goes up and down, set directly or read from a callback at render time."""

    __slots__ = ()
    kind = "gauge"

    def set(self, value: float) -> None:
        self.value = value


#: :meth:`Histogram.observe_many` sorts batches of this many values or more (measured: below
#: about 8, a bisection of the bounds per value costs less than sorting and a bisection per bucket)
OBSERVE_SORTED_FROM: Final = 8


class Histogram:
    """Observations in fixed buckets (seconds by default), with sum and count."""

    __slots__ = ("labels", "bounds", "counts", "sum", "count", "_head")
    kind = "histogram"

    def __init__(self, labels: Mapping[str, str], buckets: Iterable[float] = DEFAULT_BUCKETS) -> None:
        self.labels = dict(labels)
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0
        #: (name, bucket line heads, sum line head, count line head), made at first render
        self._head: tuple[str, tuple[str, ...], str, str] = ("", (), "", "")

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def observe_many(self, values: Sequence[float]) -> None:
        """:meth:`observe` of each value (a batch's: one call)."""
        n = len(values)
        if n < OBSERVE_SORTED_FROM:  # a bisection each costs less than sorting (batches of 1 at many partitions)
            counts, bounds, at = self.counts, self.bounds, bisect.bisect_left
            for value in values:
                counts[at(bounds, value)] += 1
            self.sum += sum(values)
            self.count += n
            return
        # Sorted, each bucket's share is a bisection: one step per bucket reached, not per value.
        ordered = sorted(values)
        counts, upto = self.counts, bisect.bisect_right
        below = 0  # values at or under the previous bound
        for i, bound in enumerate(self.bounds):
            if below == n:
                break
            at_or_under = upto(ordered, bound, below)
            counts[i] += at_or_under - below
            below = at_or_under
        else:
            counts[-1] += n - below
        self.sum += sum(values)
        self.count += n

    def quantile(self, q: float) -> float:
        """Upper bucket bound holding quantile ``q`` (coarse; for summaries, not for science)."""
        if not self.count:
            return 0.0
        target = q * self.count
        seen = 0
        for bound, n in zip(self.bounds + (math.inf,), self.counts, strict=True):
            seen += n
            if seen >= target:
                return bound
        return math.inf

    def render_into(self, name: str, out: list[str]) -> None:
        """Append the bucket, sum and count lines to ``out`` (the text before each value is made
        once: at hundreds of partitions, remaking it was most of a scrape's time)."""
        head = self._head
        if head[0] != name:
            labels = _labels_text(self.labels)
            buckets = tuple(f"{name}_bucket{_labels_text(self.labels, _le(bound))} " for bound in self.bounds + (math.inf,))
            self._head = head = (name, buckets, f"{name}_sum{labels} ", f"{name}_count{labels} ")
        cumulative = 0
        for bucket, n in zip(head[1], self.counts, strict=True):
            cumulative += n
            out.append(f"{bucket}{cumulative}")
        out.append(head[2] + _num(self.sum))
        out.append(f"{head[3]}{self.count}")


Metric = Counter | Gauge | Histogram


class MetricsRegistry:
    """Named metric families. Creating the same name and labels twice returns the same object.

    Family names are ``<prefix>_<name>``; the text format adds ``_total`` to a counter's (the JSON
    snapshot does not).
    """

    def __init__(self, prefix: str = "waltz") -> None:
        self.prefix = prefix
        self._families: dict[str, tuple[str, str, dict[tuple[tuple[str, str], ...], Metric]]] = {}

    def _get(self, kind: str, name: str, help: str, labels: Mapping[str, str] | None, make: Callable[[], Metric]) -> Metric:
        full = f"{self.prefix}_{name}" if self.prefix else name
        family = self._families.get(full)
        if family is None:
            if not _NAME.fullmatch(full) or full.endswith("_total"):
                raise ValueError(f"bad metric name {full!r}: letters, digits and _ only, and no _total suffix "
                                 "(a counter gets it when rendered; anything else must not have it)")
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

    def counter(self, name: str, help: str = "", labels: Mapping[str, str] | None = None,
                fn: Callable[[], float] | None = None) -> Counter:
        return self._get("counter", name, help, labels, lambda: Counter(labels or {}, fn))  # type: ignore[return-value]

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
        """Prometheus text exposition format 0.0.4 ("" when there is nothing to show)."""
        lines: list[str] = []
        for full, (kind, help, metrics) in sorted(self._families.items()):
            if not metrics:
                continue
            name = full + "_total" if kind == "counter" else full
            # promtool rejects a family without help; the name is better than nothing.
            lines.append(f"# HELP {name} {_escape_help(help or full.replace('_', ' '))}")
            lines.append(f"# TYPE {name} {kind}")
            for metric in list(metrics.values()):
                metric.render_into(name, lines)
        return "\n".join(lines) + "\n" if lines else ""

    def snapshot(self) -> dict[str, list[dict[str, object]]]:
        """A JSON-friendly view: name -> [{labels, value | count/sum/p50/p99}]."""
        out: dict[str, list[dict[str, object]]] = {}
        for full, (_kind, _help, metrics) in sorted(self._families.items()):
            rows: list[dict[str, object]] = []
            for m in list(metrics.values()):
                row: dict[str, object] = {"labels": dict(m.labels)}
                if isinstance(m, Histogram):
                    row.update(count=m.count, sum=m.sum, p50=m.quantile(0.5), p99=m.quantile(0.99))
                else:
                    row["value"] = m.read()
                rows.append(row)
            out[full] = rows
        return out


def _proc_stat() -> list[bytes]:
    """The fields of /proc/self/stat after the command name (which may hold spaces and parens)."""
    with open("/proc/self/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()


def process_registry(service: str, version: str) -> MetricsRegistry:
    """``process_*`` (the names, types and units of prometheus_client's ProcessCollector, read
    from /proc at render time) and ``waltz_build_info{service, version, python, event_loop} 1``
    (``event_loop``: uvloop or asyncio, the loop running the call, see :mod:`waltz_core.eventloop`):
    what every dashboard expects of a process, beside the process's own metrics. Without /proc
    (not Linux) only the build info, CPU time and the descriptor limit."""
    reg = MetricsRegistry(prefix="")
    python = ".".join(map(str, sys.version_info[:3]))
    reg.gauge("waltz_build_info", "Waltz build of this process (the value is always 1)",
              {"service": service, "version": version, "python": python, "event_loop": loop_name()}).set(1)
    reg.counter("process_cpu_seconds", "Total user and system CPU time spent in seconds.",
                fn=lambda: sum(os.times()[:2]))
    reg.gauge("process_max_fds", "Maximum number of open file descriptors.",
              fn=lambda: resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    try:
        with open("/proc/stat", "rb") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith(b"btime "))
        ticks = os.sysconf("SC_CLK_TCK")
        start = boot + float(_proc_stat()[19]) / ticks
    except (OSError, StopIteration, ValueError):
        return reg
    page = os.sysconf("SC_PAGESIZE")
    reg.gauge("process_start_time_seconds", "Start time of the process since unix epoch in seconds.").set(start)
    reg.gauge("process_virtual_memory_bytes", "Virtual memory size in bytes.", fn=lambda: int(_proc_stat()[20]))
    reg.gauge("process_resident_memory_bytes", "Resident memory size in bytes.",
              fn=lambda: int(_proc_stat()[21]) * page)
    reg.gauge("process_open_fds", "Number of open file descriptors.", fn=lambda: len(os.listdir("/proc/self/fd")))
    reg.gauge("waltz_process_memory_limit_bytes", "Memory this process may use: its cgroup's limit, or the host's "
              "memory if lower (compare process_resident_memory_bytes).", fn=_memory_limit_bytes)
    return reg


def _memory_limit_bytes() -> float:
    found = memory_limit()
    return float("nan") if found is None else float(found[0])
