"""A log-bucketed latency histogram (HdrHistogram-like): constant memory, ~1 % relative error.

Values are recorded in seconds and bucketed by ``floor(log(value_us) / log(1 + precision))``, so
every bucket spans the same *relative* width: p99.9 of a long run costs no more memory than p50.
Only the bucket counts are kept (a dict), so a run of millions of transactions stays small.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


class LatencyHistogram:
    """Latencies in seconds; percentiles are reported as the upper edge of their bucket.

    Not thread-safe: record from one thread (the event loop) or merge per-thread histograms.
    """

    __slots__ = ("precision", "_log_base", "_counts", "count", "total", "min", "max")

    def __init__(self, precision: float = 0.01) -> None:
        if not 0 < precision < 1:
            raise ValueError("precision must be in (0, 1)")
        self.precision = precision
        self._log_base = math.log1p(precision)
        self._counts: dict[int, int] = {}
        self.count = 0
        self.total = 0.0
        self.min = math.inf
        self.max = 0.0

    def record(self, seconds: float) -> None:
        """Add one latency (negative values count as 0)."""
        us = seconds * 1e6
        index = int(math.log(us) / self._log_base) if us > 1.0 else 0
        counts = self._counts
        counts[index] = counts.get(index, 0) + 1
        self.count += 1
        self.total += seconds
        if seconds < self.min:
            self.min = seconds
        if seconds > self.max:
            self.max = seconds

    def merge(self, other: LatencyHistogram) -> None:
        """Add ``other``'s counts (same precision) into this histogram."""
        if other.precision != self.precision:
            raise ValueError("cannot merge histograms of different precision")
        for index, n in other._counts.items():
            self._counts[index] = self._counts.get(index, 0) + n
        self.count += other.count
        self.total += other.total
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)

    def _upper(self, index: int) -> float:
        return math.exp((index + 1) * self._log_base) / 1e6

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile (0..100) in seconds, clamped to the observed max; 0 if empty."""
        if self.count == 0:
            return 0.0
        rank = max(1, math.ceil(self.count * q / 100.0))
        seen = 0
        for index in sorted(self._counts):
            seen += self._counts[index]
            if seen >= rank:
                return min(self._upper(index), self.max)
        return self.max

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    def buckets(self) -> Iterable[tuple[float, int]]:
        """``(upper edge in seconds, count)`` per non-empty bucket, ascending (for plots)."""
        for index in sorted(self._counts):
            yield self._upper(index), self._counts[index]

    def summary_ms(self, quantiles: Iterable[float] = (50, 90, 99, 99.9)) -> dict[str, float]:
        """``{"p50": ms, ..., "mean": ms, "max": ms}`` rounded to microseconds."""
        out = {f"p{q:g}": round(self.percentile(q) * 1e3, 3) for q in quantiles}
        out["mean"] = round(self.mean * 1e3, 3)
        out["max"] = round(self.max * 1e3, 3) if self.count else 0.0
        return out
