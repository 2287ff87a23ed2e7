"""The stream app's figures: counters, rates, assembly latency percentiles, consumer lag.

Every figure is named by a constant of :mod:`rlstream.transport.metric_names` (``STREAMS_*``), optionally
followed by ``.<reason>`` (see :func:`~rlstream.transport.metric_names.split_streams_figure`).
"""
from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from math import isfinite
from typing import Mapping

from rlstream.transport import metric_names as mn


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


def counter_key(name: str, reason: str | None = None) -> str:
    """The figure key of a counter: a ``STREAMS_*`` name, or a bare counter name (``events_in``, ``dlq.bad_key``:
    what the assembler's ``Outcome.counts`` hold) that gets the ``streams.`` prefix; then ``.<reason>`` if given."""
    key = name if name.startswith(mn.STREAMS_PREFIX) else mn.STREAMS_PREFIX + name
    return f"{key}.{reason}" if reason else key


#: Reward components a tool task's reward function reports (rlstream/ops/tool_task.py: tool_reward) and the app
#: counts: the tool calls the server parsed, and 1.0 when the model wrote a call that did not parse.
TOOL_CALLS_COMPONENT = "tool_calls"
TOOL_CALL_UNPARSED_COMPONENT = "tool_call_unparsed"


def tool_use_counts(components: Mapping[str, float]) -> tuple[str, ...]:
    """The counters one scored episode moves, from its reward components: none unless they carry
    ``TOOL_CALLS_COMPONENT`` (a tool task's episode); then ``STREAMS_TOOL_EPISODES``, and
    ``STREAMS_TOOL_CALL_PARSE_FAILURES`` when the model wrote a call that did not parse, else
    ``STREAMS_TOOL_EPISODES_WITHOUT_CALL`` when it made no call at all."""
    calls = components.get(TOOL_CALLS_COMPONENT)
    if calls is None or not isfinite(calls):
        return ()
    unparsed = components.get(TOOL_CALL_UNPARSED_COMPONENT, 0.0)
    if isfinite(unparsed) and unparsed > 0:
        return mn.STREAMS_TOOL_EPISODES, mn.STREAMS_TOOL_CALL_PARSE_FAILURES
    if calls <= 0:
        return mn.STREAMS_TOOL_EPISODES, mn.STREAMS_TOOL_EPISODES_WITHOUT_CALL
    return (mn.STREAMS_TOOL_EPISODES,)


#: The counters turned into per-second rates at each report, and the names of those rates.
RATES = {mn.STREAMS_EVENTS_IN: mn.STREAMS_EVENTS_IN_PER_S, mn.STREAMS_EVENTS_OUT: mn.STREAMS_EVENTS_OUT_PER_S}


@dataclass
class Telemetry:
    """Counts since start plus a snapshot taken at each report, to turn counts into rates."""

    #: counters an alert watches exist from the start at 0, so their first increase is seen (Prometheus convention)
    counts: Counter[str] = field(default_factory=lambda: Counter({
        mn.STREAMS_UNPROVEN_GAPS: 0, mn.STREAMS_TOOL_EPISODES: 0, mn.STREAMS_TOOL_CALL_PARSE_FAILURES: 0,
        mn.STREAMS_TOOL_EPISODES_WITHOUT_CALL: 0}))
    latencies_s: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    positions: dict[tuple[str, int], int] = field(default_factory=dict)
    _last_counts: Counter[str] = field(default_factory=Counter)
    _last_report: float = field(default_factory=time.monotonic)

    def count(self, name: str, n: int = 1, reason: str | None = None) -> None:
        """Add ``n`` to a counter (see :func:`counter_key` for ``name`` and ``reason``)."""
        self.counts[counter_key(name, reason)] += n

    def count_tool_use(self, components: Mapping[str, float]) -> None:
        """Count a scored episode's tool use (:func:`tool_use_counts`)."""
        for name in tool_use_counts(components):
            self.count(name)

    def observe_latency(self, seconds: float) -> None:
        self.latencies_s.append(max(0.0, seconds))

    def processed(self, topic: str, partition: int, offset: int) -> None:
        self.positions[(topic, partition)] = offset + 1

    def report(self) -> dict[str, float]:
        """Totals, per-second rates of the in/out counters since the last report, latency p50/p99,
        keyed ``<STREAMS_* name>[.<reason>]``."""
        now = time.monotonic()
        elapsed = max(1e-6, now - self._last_report)
        figures: dict[str, float] = {k: float(v) for k, v in self.counts.items()}
        for counter, rate in RATES.items():
            figures[rate] = (self.counts[counter] - self._last_counts[counter]) / elapsed
        if self.latencies_s:
            lat = list(self.latencies_s)
            figures[mn.STREAMS_ASSEMBLY_LATENCY_P50_S] = percentile(lat, 50)
            figures[mn.STREAMS_ASSEMBLY_LATENCY_P99_S] = percentile(lat, 99)
        self._last_counts = Counter(self.counts)
        self._last_report = now
        return figures
