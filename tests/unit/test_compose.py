"""docker-compose.yml: it parses, every rlstream service runs a real ``rlstream`` command with options that
command declares, and every RLSTREAM_* variable (and every ``-o KEY``) names a config key whose value loads.

The command tree is taken from the typer app at test time, so a service pointing at a command that is not
registered (or was renamed) fails here.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer.main
import yaml
from pydantic import BaseModel

from rlstream.cli.app import app
from rlstream.schemas.config import ENV_PREFIX, ENV_SHORTCUTS, RlstreamConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
COMPONENT_COMMANDS = {("streams", "worker"), ("learner", "run"), ("rollout", "run"), ("inference", "sync"),
                      ("topics", "create")}
_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?[-?]([^}]*))?\}")


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def interpolate(value: str) -> str:
    """Compose's ``${VAR:-default}``, with every VAR unset."""
    return _INTERPOLATION.sub(lambda m: m.group(2) or "", value)


def rlstream_services() -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in compose()["services"].items()
            if isinstance(svc.get("command"), list) and svc["command"][:1] == ["rlstream"]}


def resolve(tokens: list[str]) -> tuple[Any, list[str], list[str]]:
    """Walk the click tree of the typer app: (leaf command, its path, the remaining tokens)."""
    command: Any = typer.main.get_command(app)
    path: list[str] = []
    rest = list(tokens)
    while hasattr(command, "commands") and rest and not rest[0].startswith("-"):
        name = rest.pop(0)
        assert name in command.commands, (
            f"`rlstream {' '.join(path + [name])}` is not a registered command; "
            f"known under `rlstream {' '.join(path)}`: {sorted(command.commands)}")
        command = command.commands[name]
        path.append(name)
    assert not hasattr(command, "commands"), f"`rlstream {' '.join(path)}` is a group, not a command"
    return command, path, rest


def config_key_exists(dotted: list[str]) -> bool:
    model: Any = RlstreamConfig
    for i, part in enumerate(dotted):
        fields = model.model_fields
        if part not in fields:
            return False
        annotation = fields[part].annotation
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        if model is None:
            return i == len(dotted) - 1
    return False


def env_key(var: str) -> list[str]:
    if var in ENV_SHORTCUTS:
        return list(ENV_SHORTCUTS[var])
    return [p.lower() for p in var[len(ENV_PREFIX):].split("__")]


def test_compose_parses_and_holds_the_deployment():
    services = compose()["services"]
    for needed in ("kafka", "topics-init", "redis", "schema-registry", "vllm", "inference-sync", "streams", "learner",
                   "rollout", "prometheus"):
        assert needed in services, f"service {needed} missing"
    assert services["kafka"]["image"].startswith("apache/kafka:")
    assert "broker,controller" in services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"]  # KRaft, no ZooKeeper
    assert services["schema-registry"]["image"].startswith("confluentinc/cp-schema-registry:")
    assert interpolate(services["vllm"]["image"]).startswith("vllm/vllm-openai:")
    gpu = services["vllm"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"] and services["learner"]["deploy"] == services["vllm"]["deploy"]
    for name in ("streams", "learner", "rollout", "inference-sync"):
        assert services[name]["depends_on"]["topics-init"]["condition"] == "service_completed_successfully"
    assert (ROOT / "Dockerfile").exists() and (ROOT / "rlstream" / "ops" / "prometheus.yml").exists()


def test_every_component_runs_its_rlstream_command():
    commands = {name: tuple(resolve(svc["command"][1:])[1]) for name, svc in rlstream_services().items()}
    assert set(commands.values()) == COMPONENT_COMMANDS, commands


@pytest.mark.parametrize("service", sorted(rlstream_services()))
def test_service_options_and_environment_are_real(service, monkeypatch):
    svc = rlstream_services()[service]
    command, path, rest = resolve(svc["command"][1:])
    by_flag = {opt: param for param in command.params
               for opt in list(getattr(param, "opts", [])) + list(getattr(param, "secondary_opts", []))}
    positional = [p for p in command.params if getattr(p, "param_type_name", "") == "argument"]
    overrides: list[tuple[str, str]] = []
    i = 0
    while i < len(rest):
        token = rest[i]
        if token in ("-o", "--override"):
            overrides.append((rest[i + 1], rest[i + 2]))
            i += 3
            continue
        if not token.startswith("-"):
            assert positional, f"{service}: `rlstream {' '.join(path)}` takes no argument {token!r}"
            i += 1
            continue
        flag = token.split("=", 1)[0]
        assert flag in by_flag, f"{service}: `rlstream {' '.join(path)}` has no option {flag} (has {sorted(by_flag)})"
        takes_value = not getattr(by_flag[flag], "is_flag", False) and "=" not in token
        i += 2 if takes_value else 1
    for key, _ in overrides:
        assert config_key_exists(key.split(".")), f"{service}: -o {key} is not a config key"

    env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
    assert env, f"{service} sets no environment"
    for var, value in env.items():
        if not var.startswith(ENV_PREFIX):
            continue
        assert config_key_exists(env_key(var)), f"{service}: {var} names no config key"
        monkeypatch.setenv(var, interpolate(value))
    cfg = load_config(None, [(k, interpolate(v)) for k, v in overrides])  # values of the right type
    assert cfg.kafka.bootstrap_servers == "kafka:9092" and cfg.redis.url == "redis://redis:6379/0"


def test_prometheus_scrapes_the_ports_the_services_serve():
    prom = yaml.safe_load((ROOT / "rlstream" / "ops" / "prometheus.yml").read_text())
    targets = {}
    for job in prom["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            for name in sd["names"]:
                targets[name] = sd["port"]
        for sc in job.get("static_configs", []):
            for target in sc["targets"]:
                host, port = target.split(":")
                targets[host] = int(port)
    services = compose()["services"]
    assert targets["streams"] == int(services["streams"]["environment"]["RLSTREAM_STREAMS__PROMETHEUS_PORT"])
    assert targets["learner"] == int(services["learner"]["environment"]["RLSTREAM_LEARNER__PROMETHEUS_PORT"])


def test_the_check_catches_mistakes():
    assert not config_key_exists(["learner", "no_such_key"])
    assert not config_key_exists(["kafka", "bootstrap_servers", "deeper"])
    assert config_key_exists(["learner", "lora", "r"]) and config_key_exists(["run_id"])
    with pytest.raises(AssertionError, match="not a registered command"):
        resolve(["streams", "no-such-command"])
    assert interpolate("${A:-x}/${B}") == "x/"
