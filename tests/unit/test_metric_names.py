"""Every metric name rlstream emits is a constant of ``rlstream.transport.metric_names``.

A static scan of the package: each ``<...metrics>.emit(name, ...)`` / ``emit_many({name: ...})`` /
``MetricEvent(name=...)`` call, and each call of a local helper that forwards one of its parameters
into such a call (``self._emit(name, ...)``), must name a ``metric_names`` constant; a string, an
f-string or a module's own constant fails. The stream app's counters (``telemetry.count("...")`` and
the assembler's ``counts["..."]``) must map to a ``STREAMS_*`` name. Runtime checks cover the figure
builders whose keys a scan cannot see (``Telemetry.report``, ``learner.step.step_figures``).
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from rlstream.transport import metric_names as mn

PACKAGE = Path(__file__).resolve().parents[2] / "rlstream"
METRIC_NAMES_MODULE = "rlstream.transport.metric_names"
#: Functions whose result may be handed to ``emit_many``: their keys are checked at run time below.
CHECKED_BUILDERS = {"step_figures"}
#: Functions whose result (a (name, reason) pair: ``emit(split_streams_figure(key)[0], ...)``) may name a metric:
#: the stream app's figure keys are checked at run time below (Telemetry.report keys are STREAMS_* names).
CHECKED_NAMERS = {"split_streams_figure"}
#: The publisher itself (it passes any name it is given on).
IMPLEMENTATION = {"transport/metrics.py"}
#: Files that still emit names of their own, owned by others while this check was written: each entry
#: must still hold a violation (remove it once the file uses metric_names).
PENDING: dict[str, str] = {}


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.text}"


def dotted(node: ast.AST) -> str:
    """``self.context.metrics`` for an attribute chain, ``""`` for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = dotted(node.value)
        return f"{inner}.{node.attr}" if inner else ""
    return ""


class ModuleScan:
    """The metric emit sites of one module and whether each names a metric_names constant."""

    def __init__(self, path: Path, root: Path = PACKAGE) -> None:
        self.path = path
        self.rel = path.relative_to(root).as_posix()
        self.tree = ast.parse(path.read_text(), filename=str(path))
        self.module_aliases: set[str] = set()   # names bound to the metric_names module
        self.constant_aliases: dict[str, str] = {}  # local name -> metric_names attribute
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom) and node.module == METRIC_NAMES_MODULE:
                for alias in node.names:
                    self.constant_aliases[alias.asname or alias.name] = alias.name
            elif isinstance(node, ast.ImportFrom) and node.module == "rlstream.transport":
                for alias in node.names:
                    if alias.name == "metric_names":
                        self.module_aliases.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == METRIC_NAMES_MODULE and alias.asname:
                        self.module_aliases.add(alias.asname)
        self.forwarders = self._forwarders()
        self.sites = 0

    # -- what counts as an emit -------------------------------------------------------------------------------
    @staticmethod
    def metrics_call(call: ast.Call) -> str | None:
        """``emit`` / ``emit_many`` on a metrics publisher, or ``MetricEvent``; None for any other call."""
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr in ("emit", "emit_many"):
            receiver = dotted(func.value).rsplit(".", 1)[-1]
            return func.attr if "metrics" in receiver.lower() else None
        if (isinstance(func, ast.Name) and func.id == "MetricEvent") or \
                (isinstance(func, ast.Attribute) and func.attr == "MetricEvent"):
            return "MetricEvent"
        return None

    @staticmethod
    def name_arg(call: ast.Call, kind: str, position: int = 0, keyword: str = "name") -> ast.expr | None:
        """The argument that names the metric(s): ``emit(name, ...)``, ``emit_many(figures, ...)``,
        ``MetricEvent(name=...)``, or a forwarder's parameter at ``position`` / ``keyword``."""
        if kind == "emit_many":
            keyword = "figures"
        if kind != "MetricEvent" and len(call.args) > position:
            return call.args[position]
        return next((kw.value for kw in call.keywords if kw.arg == keyword), None)

    def _forwarders(self) -> dict[str, tuple[int, str]]:
        """Local functions that pass one of their parameters on as a metric name: name -> (position, param)."""
        found: dict[str, tuple[int, str]] = {}
        for fn in ast.walk(self.tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            params = [a.arg for a in fn.args.posonlyargs + fn.args.args if a.arg not in ("self", "cls")]
            for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
                kind = self.metrics_call(call)
                arg = self.name_arg(call, kind) if kind else None
                if isinstance(arg, ast.Name) and arg.id in params:
                    found[fn.name] = (params.index(arg.id), arg.id)
        return found

    # -- the check --------------------------------------------------------------------------------------------
    def is_constant(self, node: ast.expr) -> bool:
        """A reference to a metric_names constant whose value is a known metric name."""
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.value.id in self.module_aliases:
            return getattr(mn, node.attr, None) in mn.ALL
        if isinstance(node, ast.Name) and node.id in self.constant_aliases:
            return getattr(mn, self.constant_aliases[node.id], None) in mn.ALL
        return False

    def check_name(self, node: ast.expr | None, kind: str, params: set[str]) -> str | None:
        """Why ``node`` is not an acceptable metric name (None when it is)."""
        if node is None:
            return "no metric name found"
        if isinstance(node, ast.Name) and node.id in params:
            return None  # forwarded: the callers of this helper are checked
        if kind == "emit_many":
            if isinstance(node, ast.Dict):
                bad = [ast.unparse(k) for k in node.keys if k is None or not self.is_constant(k)]
                return f"emit_many keys {bad} are not metric_names constants" if bad else None
            if isinstance(node, ast.Call) and dotted(node.func).rsplit(".", 1)[-1] in CHECKED_BUILDERS:
                return None
            return f"emit_many({ast.unparse(node)}) does not name metric_names constants"
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Call) and \
                dotted(node.value.func).rsplit(".", 1)[-1] in CHECKED_NAMERS:
            return None
        return None if self.is_constant(node) else f"{ast.unparse(node)} is not a metric_names constant"

    def violations(self) -> Iterator[Violation]:
        for fn_params, call in self._calls():
            kind = self.metrics_call(call)
            if kind is not None:
                node = self.name_arg(call, kind)
            else:
                target = dotted(call.func)
                head, _, name = target.rpartition(".")
                if name not in self.forwarders or head not in ("", "self"):
                    continue
                position, param = self.forwarders[name]
                kind = "forwarded"
                node = self.name_arg(call, kind, position, param)
            self.sites += 1
            problem = self.check_name(node, kind, fn_params)
            if problem:
                yield Violation(self.rel, call.lineno, problem)

    def _calls(self) -> Iterator[tuple[set[str], ast.Call]]:
        """Every call with the parameter names of its innermost enclosing function."""
        def visit(node: ast.AST, params: set[str]) -> Iterator[tuple[set[str], ast.Call]]:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    args = child.args
                    yield from visit(child, {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs})
                    continue
                if isinstance(child, ast.Call):
                    yield params, child
                yield from visit(child, params)
        yield from visit(self.tree, set())


def scan_package() -> tuple[list[ModuleScan], list[Violation]]:
    scans = [ModuleScan(p) for p in sorted(PACKAGE.rglob("*.py"))]
    scans = [s for s in scans if s.rel not in IMPLEMENTATION]
    return scans, [v for s in scans for v in s.violations()]


def test_every_emitted_metric_name_is_a_metric_names_constant() -> None:
    scans, violations = scan_package()
    assert sum(s.sites for s in scans) >= 12, "the scan found too few emit sites: it no longer sees them"
    unexpected = [str(v) for v in violations if v.path not in PENDING]
    assert not unexpected, "metric names written at the emit site (add them to metric_names):\n" + \
        "\n".join(unexpected)
    still_pending = {v.path for v in violations}
    stale = sorted(set(PENDING) - still_pending)
    assert not stale, f"{stale} now use metric_names: remove them from PENDING"


PROBE = '''
from rlstream.transport import metric_names as mn
from rlstream.transport.metric_names import REWARD_MEAN
from rlstream.schemas.models import MetricEvent
LOCAL = "rollout/published"


class Probe:
    async def _emit(self, name, value):
        await self.metrics.emit(name, value)

    async def run(self, k, other):
        await self.metrics.emit(mn.ROLLOUT_PUBLISHED, 1.0)
        await self.metrics.emit(REWARD_MEAN, 1.0)
        await self._emit(mn.ROLLOUT_GENERATION_FAILED, 1.0)
        await self.context.metrics.emit_many({mn.LEARNER_KL: 1.0, mn.LEARNER_LOSS: 2.0})
        await other.emit("not a metrics publisher", 1.0)
        await self.metrics.emit("rollout/published", 1.0)  # bad: a literal
        await self.metrics.emit(f"learner/{k}", 1.0)  # bad: an f-string
        await self.metrics.emit(LOCAL, 1.0)  # bad: a module's own constant
        await self._emit("rollout/other", 1.0)  # bad: a literal through the forwarder
        await self.metrics.emit_many({f"learner/{k}": 1.0 for k in "ab"})  # bad: built names
        await self.metrics.emit_many({mn.LEARNER_KL: 1.0, "learner/x": 2.0})  # bad: one literal key
        MetricEvent(source="s", run_id="r", name="replay/published", value=1.0)  # bad: a literal
        await self.metrics.emit(mn.STEP_TAG, 1.0)  # bad: a metric_names constant that is no metric name
'''


def test_the_scan_reports_every_form_a_name_must_not_take(tmp_path: Path) -> None:
    """Negative controls: each ``# bad`` line of the probe is reported, and no other line."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    scan = ModuleScan(probe, root=tmp_path)
    reported = sorted(v.line for v in scan.violations())
    wanted = [i for i, text in enumerate(PROBE.splitlines(), start=1) if "# bad" in text]
    assert len(wanted) == 8 and reported == wanted, [str(v) for v in scan.violations()]
    assert scan.sites == 13  # the forwarder's own emit, 4 accepted, 8 refused; other.emit is no metrics call


def test_every_stream_counter_maps_to_a_streams_name() -> None:
    """``telemetry.count("x")`` and ``counts["x"]`` in streams/ become ``streams.x``: each must be a constant."""
    found: dict[str, str] = {}
    for path in sorted((PACKAGE / "streams").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            key = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "count" \
                    and dotted(node.func.value).endswith("telemetry") and node.args:
                key = node.args[0]
            elif isinstance(node, ast.Subscript) and dotted(node.value).endswith("counts"):
                key = node.slice
            for text in literal_prefixes(key):
                name = (text if text.startswith(mn.STREAMS_PREFIX) else mn.STREAMS_PREFIX + text).rstrip(".")
                found[mn.split_streams_figure(name)[0]] = f"{path.relative_to(PACKAGE)}:{node.lineno}"
    assert len(found) >= 10, found
    unknown = {name: where for name, where in found.items() if name not in mn.STREAMS}
    assert not unknown, f"stream counters without a metric_names.STREAMS_* constant: {unknown}"


def literal_prefixes(node: ast.AST | None) -> Iterator[str]:
    """The string constants an expression can take; for an f-string, its text before the first field; for
    ``mn.NAME`` (metric_names imported as ``mn``), the constant's value (an unknown attribute stays unknown)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "mn":
        yield str(getattr(mn, node.attr, f"unknown constant mn.{node.attr}"))
    elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        yield str(node.values[0].value)
    elif isinstance(node, ast.IfExp):
        yield from literal_prefixes(node.body)
        yield from literal_prefixes(node.orelse)


def test_telemetry_reports_only_streams_names() -> None:
    from rlstream.streams.telemetry import Telemetry

    telemetry = Telemetry()
    telemetry.count("events_in", 3)
    telemetry.count("dlq.bad_key")
    telemetry.count(mn.STREAMS_GROUPS_FILTERED, reason="stale")
    telemetry.count(mn.STREAMS_EVENTS_OUT)
    telemetry.observe_latency(0.5)
    figures = telemetry.report()
    names = {mn.split_streams_figure(key) for key in figures}
    assert {name for name, _ in names} <= set(mn.STREAMS)
    assert (mn.STREAMS_DLQ, "bad_key") in names and (mn.STREAMS_GROUPS_FILTERED, "stale") in names
    assert figures[mn.STREAMS_EVENTS_IN] == 3 and figures[mn.STREAMS_EVENTS_OUT] == 1
    assert {mn.STREAMS_EVENTS_IN_PER_S, mn.STREAMS_EVENTS_OUT_PER_S, mn.STREAMS_ASSEMBLY_LATENCY_P99_S} <= set(figures)


def test_learner_step_figures_are_all_named() -> None:
    pytest.importorskip("torch")
    from rlstream.learner.step import STEP_METRICS, StepStats, step_figures

    stats = StepStats(**{name: 1.0 for name in StepStats.__dataclass_fields__})  # type: ignore[arg-type]
    assert set(STEP_METRICS) == set(stats.figures()), "a StepStats figure has no metric name"
    figures = step_figures(stats, n_groups=2, policy_lag=[0, 2])
    assert set(figures) == set(mn.LEARNER)
    assert figures[mn.LEARNER_POLICY_LAG_MAX] == 2.0 and figures[mn.LEARNER_GROUPS] == 2.0


def test_all_lists_every_name_once() -> None:
    not_names = {"STEP_TAG", "STEP_VERSION", "STEP_EPOCH", "STEP_LEARNER", "STREAMS_PREFIX"}
    constants = {k: v for k, v in vars(mn).items() if k.isupper() and isinstance(v, str) and k not in not_names}
    missing = sorted(k for k, v in constants.items() if v not in mn.ALL)
    assert not missing, f"metric_names constants missing from ALL: {missing}"
    assert len(set(mn.ALL)) == len(mn.ALL) == len(set(constants.values()))


def test_the_live_view_sums_each_workers_latest_filter_count() -> None:
    """``rlstream up`` reads ``STREAMS_GROUPS_FILTERED`` (running totals per worker), nothing else with 'filtered'."""
    from rlstream.ops.live import LiveFigures, Watcher
    from rlstream.schemas.config import load_config
    from rlstream.schemas.models import MetricEvent

    cfg = load_config(None, [("run_id", "r")])
    watcher = Watcher(cfg, None, LiveFigures())  # type: ignore[arg-type]

    def event(name: str, value: float, **tags: str) -> MetricEvent:
        return MetricEvent(source="streams", run_id="r", name=name, value=value, tags=tags)

    for value in (1.0, 3.0):  # one worker's running total, reported twice
        watcher._on_metric(event(mn.STREAMS_GROUPS_FILTERED, value, worker="w1", reason="stale"))
    watcher._on_metric(event(mn.STREAMS_GROUPS_FILTERED, 2.0, worker="w2", reason="stale"))
    watcher._on_metric(event(mn.REWARD_MEAN_FILTERED, 0.7))
    assert watcher.figures.filtered == {"stale": 5.0}
