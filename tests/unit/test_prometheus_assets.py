"""The operator assets of ``rlstream/ops``: alert rules, the Grafana dashboard and its provisioning, the
Prometheus config. Every series they name is one rlstream serves (``metric_names.SPECS``, the process/GC/platform
collectors) or ``up``; ``promtool`` accepts the rules and the config."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector, generate_latest

from rlstream.transport import metric_names as mn

pytestmark = pytest.mark.unit

OPS = Path(__file__).resolve().parents[2] / "rlstream" / "ops"
ALERTS = OPS / "alerts.yml"
DASHBOARD = OPS / "grafana" / "dashboards" / "rlstream.json"
DATASOURCES = OPS / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDERS = OPS / "grafana" / "provisioning" / "dashboards" / "rlstream.yml"
PROMETHEUS = OPS / "prometheus.yml"
#: Metric names of PromQL expressions: ours, the standard collectors', and Prometheus' ``up`` (no label name of the
#: assets takes one of these forms).
SERIES_NAME = re.compile(r"\b(rlstream_[a-z0-9_]+|process_[a-z0-9_]+|python_[a-z0-9_]+|up)\b")


def served_series() -> set[str]:
    """Every series name an rlstream endpoint can serve."""
    names = {"up"}
    for spec in mn.SPECS.values():
        if spec.prometheus is None:
            continue
        if spec.kind == "histogram":
            names |= {spec.prometheus + suffix for suffix in ("_bucket", "_count", "_sum", "_created")}
        elif spec.kind == "counter":
            names |= {spec.prometheus, spec.prometheus.removesuffix("_total") + "_created"}
        else:
            names.add(spec.prometheus)
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    GCCollector(registry=registry)
    PlatformCollector(registry=registry)
    for line in generate_latest(registry).decode().splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    names |= {"process_cpu_seconds_total", "process_resident_memory_bytes"}  # the Linux collector's, on any OS
    return names


def unknown_series(expression: str, known: set[str]) -> list[str]:
    """The metric names of a PromQL expression that no endpoint serves."""
    return sorted({name for name in SERIES_NAME.findall(expression) if name not in known})


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])


def dashboard_expressions() -> list[str]:
    return [t["expr"] for p in panels(dashboard()) for t in p.get("targets", [])]


def test_alerts_and_dashboard_name_only_served_series() -> None:
    known = served_series()
    expressions = [rule["expr"] for rule in alert_rules()] + dashboard_expressions()
    assert len(expressions) >= 20
    problems = {e: unknown_series(e, known) for e in expressions if unknown_series(e, known)}
    assert not problems, f"series no rlstream endpoint serves: {problems}"
    named = {name for e in expressions for name in SERIES_NAME.findall(e)}
    assert {"up", "process_cpu_seconds_total", "rlstream_streams_assembly_latency_seconds_bucket"} <= named


def test_the_series_check_reports_what_is_not_served() -> None:
    """Negative controls: an unknown name, a histogram suffix on a counter, a topic-only rate."""
    known = served_series()
    rule = 'sum(rate(rlstream_no_such_metric[5m])) > 0 and on() rlstream_streams_consumer_lag{worker="w"} > 1'
    assert unknown_series(rule, known) == ["rlstream_no_such_metric"]
    assert unknown_series("rate(rlstream_streams_dead_letters_total_bucket[5m])", known) == \
        ["rlstream_streams_dead_letters_total_bucket"]
    assert unknown_series("scalar(max(rlstream_streams_events_in_per_s)) != 0", known) == \
        ["rlstream_streams_events_in_per_s"]
    assert unknown_series('sum by (job) (up{job=~"rlstream-.*"})', known) == []


def test_every_alert_has_a_duration_a_severity_and_annotations() -> None:
    rules = alert_rules()
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
    exprs = " ".join(rule["expr"] for rule in rules)
    for needed in ("rlstream_learner_policy_lag_max", "rlstream_streams_dead_letters_total",
                   "rlstream_streams_consumer_lag", 'up{job="rlstream-learner"}', 'up{job="rlstream-inference-sync"}',
                   "rlstream_inference_load_failed_total", "rlstream_inference_loaded_version"):
        assert needed in exprs, needed


def test_the_dashboard_is_a_provisionable_grafana_dashboard() -> None:
    board = dashboard()
    assert board["uid"] == "rlstream" and 36 <= board["schemaVersion"] <= 41
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids))
    for panel in panels(board):
        assert panel["type"] in ("timeseries", "stat", "row"), panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
        assert panel["targets"] and all(t["datasource"] == panel["datasource"] for t in panel["targets"])
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
    exprs = " ".join(dashboard_expressions())
    for needed in ("rlstream_reward_mean", "rlstream_validation_reward_mean", "rlstream_inference_loaded_version",
                   "rlstream_learner_policy_lag_max", "rlstream_streams_groups_emitted_total",
                   "rlstream_streams_groups_filtered_total", "rlstream_streams_dead_letters_total",
                   "histogram_quantile(0.99, sum by (le) (rate(rlstream_streams_assembly_latency_seconds_bucket",
                   "rlstream_learner_step_seconds_bucket", "rlstream_learner_loss", "rlstream_inference_load_seconds",
                   "rlstream_gateway_overhead_seconds_bucket", "process_cpu_seconds_total",
                   "process_resident_memory_bytes"):
        assert needed in exprs, needed


def test_grafana_provisioning_files() -> None:
    sources = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert [(s["type"], s["uid"], s["url"]) for s in sources] == [("prometheus", "prometheus", "http://prometheus:9090")]
    providers = yaml.safe_load(DASHBOARD_PROVIDERS.read_text())["providers"]
    assert [(p["type"], p["options"]["path"]) for p in providers] == [("file", "/var/lib/grafana/dashboards")]


def test_prometheus_config_loads_the_alert_rules() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    assert {"rlstream-streams", "rlstream-learner", "rlstream-inference-sync", "rlstream-rollout"} <= jobs
    assert set(re.findall(r'job="([^"]+)"', ALERTS.read_text())) <= jobs, "an alert names a job nobody scrapes"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed: run scripts/bootstrap.sh (it installs Debian's prometheus package)")
    return subprocess.run([path, *args], capture_output=True, text=True, timeout=60)


def test_promtool_checks_config_and_rules(tmp_path: Path) -> None:
    rules = promtool("check", "rules", str(ALERTS))
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in rules.stdout
    config = yaml.safe_load(PROMETHEUS.read_text())
    config["rule_files"] = [str(ALERTS)]  # where the compose file mounts it, /etc/prometheus, is not here
    copy = tmp_path / "prometheus.yml"
    copy.write_text(yaml.safe_dump(config, sort_keys=False))
    checked = promtool("check", "config", str(copy))
    assert checked.returncode == 0, checked.stdout + checked.stderr


#: ``promtool test rules`` cases: input series (1 minute apart), then per alert when it must not fire yet and when it
#: must, with the labels it fires with (besides severity).
ALERT_CASES: list[dict[str, Any]] = [
    {"series": {'rlstream_learner_policy_lag_max{policy="p",run_id="r",source="learner"}': "6x30"},
     "alert": "RlstreamPolicyLagHigh", "quiet_at": "5m", "fires_at": "15m", "labels": [{"policy": "p"}]},
    {"series": {'rlstream_streams_dead_letters_total{reason="bad_key",run_id="r",source="s",worker="w"}': "0+2x30"},
     "alert": "RlstreamStreamsDeadLetters", "quiet_at": "10m", "fires_at": "25m", "labels": [{"reason": "bad_key"}]},
    {"series": {'rlstream_learner_dead_letters_total{policy="p",run_id="r",source="learner"}': "0+1x30"},
     "alert": "RlstreamLearnerDeadLetters", "quiet_at": "10m", "fires_at": "25m", "labels": [{"policy": "p"}]},
    {"series": {'rlstream_learner_groups_skipped_total{policy="p",reason="stale",run_id="r",source="learner"}':
                "0+1x30",
                'rlstream_learner_groups_skipped_total{policy="q",reason="other_run",run_id="r",source="learner"}':
                "0+1x30"},
     "alert": "RlstreamLearnerDroppingStaleGroups", "quiet_at": "10m", "fires_at": "25m", "labels": [{"policy": "p"}]},
    {"series": {'rlstream_streams_consumer_lag{run_id="r",source="s",worker="w"}': "900+50x40"},
     "alert": "RlstreamConsumerLagGrowing", "quiet_at": "10m", "fires_at": "35m", "labels": [{}]},
    {"series": {'up{job="rlstream-learner",instance="learner:9102"}': "1 1 0x20"},
     "alert": "RlstreamLearnerLeaseLostOrDown", "quiet_at": "2m", "fires_at": "6m",
     "labels": [{"job": "rlstream-learner", "instance": "learner:9102"}]},
    {"series": {'rlstream_learner_lease_held{policy="p",run_id="r",source="learner"}': "1 1 1 0x10"},
     "alert": "RlstreamLearnerLeaseNotConfirmed", "quiet_at": "3m", "fires_at": "6m",
     "labels": [{"policy": "p", "run_id": "r", "source": "learner"}]},
    {"series": {'rlstream_streams_groups_emitted_total{reason="full",run_id="r",source="s",worker="w"}': "0+3x60"},
     "alert": "RlstreamLearnerNotTraining", "quiet_at": "10m", "fires_at": "35m", "labels": [{}]},
    {"series": {'up{job="rlstream-inference-sync",instance="inference-sync:9103"}': "0x10"},
     "alert": "RlstreamInferenceWorkerDown", "quiet_at": "1m", "fires_at": "5m",
     "labels": [{"job": "rlstream-inference-sync", "instance": "inference-sync:9103"}]},
    {"series": {'rlstream_inference_engine_down_total{run_id="r",source="inference:a",worker="a"}': "0x3 1x20",
                'rlstream_inference_engine_down_total{run_id="r",source="inference:b",worker="b"}': "0x23"},
     "alert": "RlstreamInferenceEngineDied", "quiet_at": "3m", "fires_at": "6m", "labels": [{"worker": "a"}]},
    {"series": {'rlstream_inference_engine_up{run_id="r",source="inference:a",worker="a"}': "1x3 0x10",
                'rlstream_inference_engine_up{run_id="r",source="inference:b",worker="b"}': "1x3 0 1x9"},
     "alert": "RlstreamInferenceEngineDown", "quiet_at": "5m", "fires_at": "8m", "labels": [{"worker": "a"}]},
    {"series": {'rlstream_inference_load_failed_total{reason="HTTPError",run_id="r",source="i",worker="w"}': "0 1x20"},
     "alert": "RlstreamInferenceLoadsFailing", "quiet_at": "3m", "fires_at": "10m", "labels": [{"worker": "w"}]},
    {"series": {'rlstream_inference_fleet_load_failed{run_id="r",source="inference:b",worker="b"}': "0x3 1x10",
                'rlstream_inference_fleet_load_failed{run_id="r",source="inference:a",worker="a"}': "0x13"},
     "alert": "RlstreamReplicaFailedFleetVersion", "quiet_at": "4m", "fires_at": "6m", "labels": [{"worker": "b"}]},
    {"series": {'rlstream_gate_decisions_total{run_id="r",source="gate",policy="p",decision="rollback"}': "0x5 1x20",
                'rlstream_gate_decisions_total{run_id="r",source="gate",policy="p",decision="promote"}': "0 1 2 3x20"},
     "alert": "RlstreamCanaryRolledBack", "quiet_at": "4m", "fires_at": "8m", "labels": [{"policy": "p"}]},
    {"series": {'rlstream_inference_loaded_version{run_id="r",source="inference:a",worker="a"}': "3x30",
                'rlstream_inference_loaded_version{run_id="r",source="inference:b",worker="b"}': "6x30"},
     "alert": "RlstreamInferenceWorkerBehind", "quiet_at": "10m", "fires_at": "20m",
     "labels": [{"run_id": "r", "source": "inference:a", "worker": "a"}]},
    {"series": {'rlstream_streams_unproven_gaps_total{run_id="r",source="s",worker="w"}': "0x5 1 2 3x20"},
     "alert": "RlstreamStreamsPartitionStopped", "quiet_at": "5m", "fires_at": "9m", "labels": [{"worker": "w"}]},
    # 2 tool episodes a minute, 3 of every 4 with a call that did not parse (control: 1 of 4 on another worker)
    {"series": {'rlstream_streams_tool_episodes_total{run_id="r",source="s",worker="w"}': "0+2x60",
                'rlstream_streams_tool_call_parse_failures_total{run_id="r",source="s",worker="w"}': "0+1.5x60",
                'rlstream_streams_tool_episodes_without_call_total{run_id="r",source="s",worker="w"}': "0+0.5x60"},
     "alert": "RlstreamToolCallsNotParsing", "quiet_at": "12m", "fires_at": "40m", "labels": [{}]},
    {"series": {'rlstream_streams_tool_episodes_total{run_id="r",source="s",worker="w"}': "0+2x60",
                'rlstream_streams_tool_call_parse_failures_total{run_id="r",source="s",worker="w"}': "0+0.5x60",
                'rlstream_streams_tool_episodes_without_call_total{run_id="r",source="s",worker="w"}': "0+1.5x60"},
     "alert": "RlstreamToolTaskWithoutToolCalls", "quiet_at": "12m", "fires_at": "40m", "labels": [{}]},
]


def test_alert_rules_fire_on_synthetic_series(tmp_path: Path) -> None:
    """``promtool test rules`` on the alert rules (annotations left out: only the expressions, durations and labels
    are under test): each alert is quiet before its ``for`` has passed and fires after, with the expected labels."""
    rules = yaml.safe_load(ALERTS.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations")
    severities = {rule["alert"]: rule["labels"]["severity"] for rule in alert_rules()}
    bare = tmp_path / "alerts.yml"
    bare.write_text(yaml.safe_dump(rules))
    tests = []
    for case in ALERT_CASES:
        tests.append({
            "interval": "1m",
            "input_series": [{"series": series, "values": values} for series, values in case["series"].items()],
            "alert_rule_test": [
                {"eval_time": case["quiet_at"], "alertname": case["alert"], "exp_alerts": []},
                {"eval_time": case["fires_at"], "alertname": case["alert"],
                 "exp_alerts": [{"exp_labels": {**labels, "severity": severities[case["alert"]]}}
                                for labels in case["labels"]]},
            ]})
    spec = tmp_path / "alerts_test.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [str(bare)], "evaluation_interval": "1m", "tests": tests}))
    assert {case["alert"] for case in ALERT_CASES} <= set(severities)
    result = promtool("test", "rules", str(spec))
    assert result.returncode == 0, result.stdout + result.stderr
