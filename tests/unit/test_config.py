"""Configuration: defaults, YAML < env < -o precedence, every problem in one message, the CLI."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from rlstream.cli.app import app
from rlstream.schemas.config import ConfigError, load_config, overrides_to_dict

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("RLSTREAM_"):
            monkeypatch.delenv(name)


def write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "rlstream.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_defaults_follow_nat() -> None:
    cfg = load_config()
    ft = cfg.finetuning
    assert ft.num_generations == 2 and ft.num_epochs == 1 and ft.target_functions == ["<workflow>"]
    assert ft.target_model is None and ft.reward_function.name
    cur = ft.curriculum_learning
    assert (cur.enabled, cur.initial_percentile, cur.increment_percentile, cur.expansion_interval,
            cur.min_reward_diff, cur.sort_ascending, cur.random_subsample) == (False, 0.3, 0.2, 5, 0.1, False, None)
    assert cfg.kafka.bootstrap_servers == "" and cfg.redis.url == ""
    assert cfg.topics.prefix == "rlstream." and cfg.topics.partitions >= 1


@pytest.mark.parametrize("key,value", [
    ("initial_percentile", 0), ("initial_percentile", 1.01), ("increment_percentile", 0),
    ("increment_percentile", 2), ("expansion_interval", 0), ("random_subsample", 0), ("random_subsample", 1.5),
])
def test_curriculum_range_checks(key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=rf"finetuning\.curriculum_learning\.{key}"):
        load_config(None, [(f"finetuning.curriculum_learning.{key}", str(value))])


@pytest.mark.parametrize("key,value", [("initial_percentile", "1"), ("increment_percentile", "1"),
                                       ("random_subsample", "1"), ("expansion_interval", "1")])
def test_curriculum_range_edges_are_allowed(key: str, value: str) -> None:
    load_config(None, [(f"finetuning.curriculum_learning.{key}", value)])


def test_precedence_yaml_env_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, {"learner": {"lora": {"r": 4, "alpha": 32}, "learning_rate": 0.001},
                            "topics": {"partitions": 3, "prefix": "file."},
                            "kafka": {"bootstrap_servers": "file:9092"}, "redis": {"url": "redis://file:1/0"}})
    cfg = load_config(path)
    assert (cfg.learner.lora.r, cfg.topics.partitions, cfg.kafka.bootstrap_servers) == (4, 3, "file:9092")

    monkeypatch.setenv("RLSTREAM_LEARNER__LORA__R", "5")
    monkeypatch.setenv("RLSTREAM_TOPICS__PARTITIONS", "6")
    monkeypatch.setenv("RLSTREAM_KAFKA_BOOTSTRAP", "env:9092")
    monkeypatch.setenv("RLSTREAM_REDIS_URL", "redis://env:2/0")
    cfg = load_config(path)
    assert (cfg.learner.lora.r, cfg.topics.partitions) == (5, 6)
    assert (cfg.kafka.bootstrap_servers, cfg.redis.url) == ("env:9092", "redis://env:2/0")
    assert cfg.learner.lora.alpha == 32 and cfg.learner.learning_rate == 0.001  # untouched YAML keys stay

    cfg = load_config(path, [("topics.partitions", "7"), ("kafka.bootstrap_servers", "cli:9092")])
    assert (cfg.learner.lora.r, cfg.topics.partitions, cfg.kafka.bootstrap_servers) == (5, 7, "cli:9092")
    assert cfg.topics.prefix == "file."


def test_override_values_are_typed_by_their_field() -> None:
    tree = overrides_to_dict([("run_id", "1:30"), ("policy", "007"), ("learner.lora.r", "16"),
                              ("finetuning.target_functions", "[a, b]"), ("finetuning.target_model", "null"),
                              ("finetuning.curriculum_learning.enabled", "true")])
    assert tree["run_id"] == "1:30" and tree["policy"] == "007"
    assert tree["learner"] == {"lora": {"r": 16}}
    assert tree["finetuning"]["target_functions"] == ["a", "b"] and tree["finetuning"]["target_model"] is None
    cfg = load_config(None, [("run_id", "1:30"), ("finetuning.curriculum_learning.enabled", "true")])
    assert cfg.run_id == "1:30" and cfg.finetuning.curriculum_learning.enabled is True


def test_bad_file_reports_every_problem_with_its_location(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, {
        "kafka": {"max_message_bytes": 10},
        "topics": {"prefix": "bad prefix!"},
        "finetuning": {"num_generations": 0, "curriculum_learning": {"initial_percentile": 1.5,
                                                                      "expansion_interval": 0}},
        "learner": {"lora": {"r": "zero"}, "no_such_key": 1},
        "no_such_section": {},
    })
    monkeypatch.setenv("RLSTREAM_TOPICS__PARTITIONS", "many")
    with pytest.raises(ConfigError) as info:
        load_config(path, [("streams.max_policy_lag", "-1")])
    message = str(info.value)
    expected = {
        "kafka.max_message_bytes": f"in {path}",
        "topics.prefix": f"in {path}",
        "finetuning.num_generations": f"in {path}",
        "finetuning.curriculum_learning.initial_percentile": f"in {path}",
        "finetuning.curriculum_learning.expansion_interval": f"in {path}",
        "learner.lora.r": f"in {path}",
        "learner.no_such_key": f"in {path}",
        "no_such_section": f"in {path}",
        "topics.partitions": "from env RLSTREAM_TOPICS__PARTITIONS",
        "streams.max_policy_lag": "from -o streams.max_policy_lag",
    }
    assert f"({len(expected)} problems)" in message
    for dotted, origin in expected.items():
        line = next((ln for ln in message.splitlines() if ln.strip().startswith(f"- {dotted}:")), None)
        assert line is not None, f"{dotted} missing from:\n{message}"
        assert line.endswith(f"[{origin}]"), line


def test_yaml_syntax_error_points_at_the_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("learner:\n  lora: [1, 2\nrun_id: x\n")
    with pytest.raises(ConfigError, match=rf"{path}:3:\d+: not valid YAML"):
        load_config(path)


def test_missing_file_and_non_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(tmp_path / "list.yaml")


# --- the CLI ----------------------------------------------------------------------------
def test_cli_config_show_applies_file_env_and_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, {"learner": {"lora": {"r": 4}}, "topics": {"partitions": 3}})
    result = CliRunner().invoke(app, ["config", "show", "-c", str(path), "-o", "topics.partitions", "5",
                                      "-o", "run_id", "1:30", "-o", "rollout.base_url", "http://h/?a=b"],
                                env={"RLSTREAM_REDIS_URL": "redis://env:3/0"})
    assert result.exit_code == 0, result.output
    shown = yaml.safe_load(result.stdout)
    assert shown["learner"]["lora"]["r"] == 4 and shown["topics"]["partitions"] == 5
    assert shown["run_id"] == "1:30" and shown["rollout"]["base_url"] == "http://h/?a=b"
    assert shown["redis"]["url"] == "redis://env:3/0"


def test_cli_config_validate(tmp_path: Path) -> None:
    good = write(tmp_path, {"topics": {"partitions": 2}})
    ok = CliRunner().invoke(app, ["config", "validate", "-c", str(good)])
    assert ok.exit_code == 0 and "ok" in ok.stdout

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"topics": {"partitions": 0}, "finetuning": {"num_generations": 0}}))
    result = CliRunner().invoke(app, ["config", "validate", "-c", str(bad), "-o", "learner.lora.r", "0"])
    assert result.exit_code == 2
    for dotted in ("topics.partitions", "finetuning.num_generations", "learner.lora.r"):
        assert dotted in result.stderr


def test_cli_config_as_a_real_process(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLSTREAM_")}
    proc = subprocess.run([sys.executable, "-m", "rlstream.cli", "config", "show", "--json", "-o", "learner.lora.r", "12"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert '"r": 12' in proc.stdout


def test_logging_still_works_after_a_cli_run(capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI configures logging while the runner has replaced stderr; later logs must not hit that closed stream."""
    from rlstream.transport.log import configure_logging, get_logger

    assert CliRunner().invoke(app, ["--log-format", "json", "config", "validate"]).exit_code == 0
    get_logger("after-cli").warning("still logging", answer=42)
    err = capsys.readouterr().err
    assert '"answer": 42' in err and "still logging" in err
    configure_logging("console", level="WARNING")  # back to the test session's setting
