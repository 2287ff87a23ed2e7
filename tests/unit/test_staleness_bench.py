"""bench/staleness.py's ratios: the gain above the shared start, checked against the recorded 2026-11-25 curves."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("staleness_bench", ROOT / "bench" / "staleness.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["staleness_bench"] = module
    spec.loader.exec_module(module)
    return module


def test_gain_ratio_recomputes_the_recorded_lag_4_figures() -> None:
    bench = _bench()
    steps = [0, 5, 10, 15, 20, 25, 30, 35, 40]
    on = bench.RunResult(list(zip(steps, [0.308, 0.487, 0.599, 0.667, 0.750, 0.836, 0.745, 0.812, 0.875])))
    stale = bench.RunResult(list(zip(steps, [0.308, 0.418, 0.467, 0.562, 0.603, 0.657, 0.711, 0.786, 0.841])))
    assert on.auc == pytest.approx(0.686, abs=1e-3) and stale.auc == pytest.approx(0.597, abs=1e-3)
    assert stale.auc / on.auc == pytest.approx(0.871, abs=1e-3)  # the lenient area ratio of seed 0, tis
    assert bench.gain_ratio(on, stale) == pytest.approx(0.765, abs=2e-3)  # "keeps only 0.77 of the gain"
    flat = bench.RunResult(list(zip(steps, [0.308] * 9)))
    assert bench.gain_ratio(flat, stale) is None  # nothing gained on-policy: no ratio
    assert bench.gain_ratio(on, on) == 1.0
