"""The stream app's figures: counters, rates, assembly latency percentiles, consumer lag."""
from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


@dataclass
class Telemetry:
    """Counts since start plus a snapshot taken at each report, to turn counts into rates."""

    counts: Counter[str] = field(default_factory=Counter)
    latencies_s: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    positions: dict[tuple[str, int], int] = field(default_factory=dict)
    _last_counts: Counter[str] = field(default_factory=Counter)
    _last_report: float = field(default_factory=time.monotonic)

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def observe_latency(self, seconds: float) -> None:
        self.latencies_s.append(max(0.0, seconds))

    def processed(self, topic: str, partition: int, offset: int) -> None:
        self.positions[(topic, partition)] = offset + 1

    def report(self) -> dict[str, float]:
        """Totals, per-second rates of the in/out counters since the last report, latency p50/p99."""
        now = time.monotonic()
        elapsed = max(1e-6, now - self._last_report)
        figures: dict[str, float] = {f"streams.{k}": float(v) for k, v in self.counts.items()}
        for name in ("events_in", "events_out"):
            delta = self.counts[name] - self._last_counts[name]
            figures[f"streams.{name}_per_s"] = delta / elapsed
        if self.latencies_s:
            lat = list(self.latencies_s)
            figures["streams.assembly_latency_p50_s"] = percentile(lat, 50)
            figures["streams.assembly_latency_p99_s"] = percentile(lat, 99)
        self._last_counts = Counter(self.counts)
        self._last_report = now
        return figures
