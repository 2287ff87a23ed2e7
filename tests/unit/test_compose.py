"""docker-compose.yml: it parses, every rlstream service runs a real ``rlstream`` command with options that
command declares, and every RLSTREAM_* variable (and every ``-o KEY``) names a config key whose value loads.

The command tree is taken from the typer app at test time, so a service pointing at a command that is not
registered (or was renamed) fails here.

The file, interpolated the way compose does it, also validates against the Compose Specification schema:
tests/data/compose-spec.json is ``schema/compose-spec.json`` of github.com/compose-spec/compose-spec at commit
170098ba07d9f53c383a41bfd4c5166b0a4529a6 (the file last changed in a08f8d51631b7127ddac3d2c65537db429d0f1d0).
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import typer.main
import yaml
from pydantic import BaseModel

from rlstream.cli.app import app
from rlstream.schemas.config import ENV_PREFIX, ENV_SHORTCUTS, RlstreamConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_SPEC = ROOT / "tests" / "data" / "compose-spec.json"
VLLM_REQUIREMENTS = ROOT / "rlstream" / "ops" / "requirements-vllm.txt"
COMPONENT_COMMANDS = {("streams", "worker"), ("learner", "run"), ("rollout", "run"), ("inference", "sync"),
                      ("topics", "create")}
#: The variables docker-compose.yml requires (``${VAR:?message}``), with values for the tests.
REQUIRED_ENV = {"MODEL_DIR": "/srv/models/base", "DATASET": "/srv/data/train.jsonl",
                "ROLLOUT_REWARD": "mytask.reward:score", "WEIGHT_STORE_USER": "rlstream",
                "WEIGHT_STORE_PASSWORD": "weight-store-password-0123456789",
                **{f"RLSTREAM_REDIS_{user}_PASSWORD": f"{user.lower()}-password-0123456789"
                   for user in ("SYNC", "LEARNER", "STREAMS", "ROLLOUT", "ADMIN")}}
#: The Redis user of each service that uses Redis (the users of the compose file's redis-acl config).
REDIS_USERS = {"inference-sync": "sync", "inference-sync-1": "sync", "streams": "streams", "learner": "learner",
               "rollout": "rollout"}
#: compose-go always sets the project name for interpolation.
TEST_ENV = {**REQUIRED_ENV, "COMPOSE_PROJECT_NAME": "rlstream-test"}
LOOPBACK = {"127.0.0.1", "::1", "localhost"}
# compose-go's template pattern: $$, $NAME, ${NAME}, ${NAME<op>arg} with op one of :- - :? ? :+ +, else invalid
_INTERPOLATION = re.compile(r"\$(?:(?P<escaped>\$)|(?P<named>[_a-z][_a-z0-9]*)"
                            r"|\{(?:(?P<braced>[_a-z][_a-z0-9]*)(?P<op>:?[-+?])?(?P<arg>[^}]*)\}|(?P<invalid>)))",
                            re.IGNORECASE)


class MissingVariable(ValueError):
    """A ``${VAR:?message}`` / ``${VAR?message}`` whose variable is missing (compose refuses the file)."""


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def interpolate(value: str, env: Mapping[str, str] | None = None) -> str:
    """Compose's interpolation of one value (``$$``, ``$VAR``, ``${VAR}``, ``${VAR:-d}``, ``${VAR-d}``,
    ``${VAR:?err}``, ``${VAR?err}``, ``${VAR:+r}``, ``${VAR+r}``; no nesting); ``env`` None = every VAR unset."""
    env = env or {}

    def one(m: re.Match[str]) -> str:
        if m.group("escaped"):
            return "$"
        if m.group("named"):
            return env.get(m.group("named"), "")
        if m.group("invalid") is not None or (m.group("op") is None and m.group("arg")):
            raise ValueError(f"invalid interpolation in {value!r}")
        name, op, arg = m.group("braced"), m.group("op") or "", m.group("arg")
        is_set = name in env
        is_full = bool(env.get(name))
        if op in (":?", "?") and not (is_full if op == ":?" else is_set):
            raise MissingVariable(f"required variable {name} is missing a value: {arg}")
        if op == ":-":
            return env[name] if is_full else arg
        if op == "-":
            return env[name] if is_set else arg
        if op == ":+":
            return arg if is_full else ""
        if op == "+":
            return arg if is_set else ""
        return env.get(name, "")

    return _INTERPOLATION.sub(one, value)


def interpolate_tree(node: Any, env: Mapping[str, str] | None = None) -> Any:
    """Every string value of a parsed compose file interpolated (keys are not, as in compose)."""
    if isinstance(node, dict):
        return {k: interpolate_tree(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate_tree(v, env) for v in node]
    return interpolate(node, env) if isinstance(node, str) else node


def resolved(env: Mapping[str, str] = TEST_ENV) -> dict[str, Any]:
    return interpolate_tree(compose(), env)


def schema_errors(document: dict[str, Any]) -> list[str]:
    """The Compose Specification schema's complaints about a (interpolated) compose file."""
    schema = json.loads(COMPOSE_SPEC.read_text())
    assert "draft-07" in schema["$schema"]  # written without the trailing '#' that jsonschema looks up
    jsonschema.Draft7Validator.check_schema(schema)
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


def published_beyond_loopback(port: Any) -> bool:
    """Whether a ``ports:`` entry (short string, number or long syntax) listens on more than loopback."""
    if isinstance(port, dict):
        return port.get("published") is not None and port.get("host_ip", "0.0.0.0") not in LOOPBACK
    text = str(port).split("/", 1)[0]
    if text.startswith("["):  # [IPv6]:host:container
        return text[1:text.index("]")] not in LOOPBACK
    parts = text.split(":")
    return len(parts) < 3 or parts[0] not in LOOPBACK  # CONTAINER or HOST:CONTAINER = every interface


def host_binds_created_by_default(service: dict[str, Any]) -> list[str]:
    """Host-path mounts of a service that compose would create as empty directories when missing."""
    out = []
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source = volume.split(":", 1)[0] if ":" in volume else ""
            if source.startswith((".", "/", "~", "$")):
                out.append(volume)
        elif volume.get("type") == "bind" and (volume.get("bind") or {}).get("create_host_path") is not False:
            out.append(str(volume.get("source")))
    return out


def gpu_device_ids(service: dict[str, Any]) -> set[str]:
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    return {str(d) for dev in devices if "gpu" in dev["capabilities"] for d in dev.get("device_ids", [])}


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
    for needed in ("kafka", "topics-init", "redis", "schema-registry", "vllm", "inference-sync", "vllm-1",
                   "inference-sync-1", "weight-store", "weight-store-init", "streams", "learner", "rollout",
                   "prometheus"):
        assert needed in services, f"service {needed} missing"
    assert services["kafka"]["image"].startswith("apache/kafka:")
    assert "broker,controller" in services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"]  # KRaft, no ZooKeeper
    assert services["schema-registry"]["image"].startswith("confluentinc/cp-schema-registry:")
    assert interpolate(services["vllm"]["image"]).startswith("vllm/vllm-openai:")
    for name in ("vllm", "vllm-1", "learner"):
        gpu = services[name]["deploy"]["resources"]["reservations"]["devices"][0]
        assert gpu["capabilities"] == ["gpu"] and gpu["driver"] == "nvidia", name
    for name in ("streams", "learner", "rollout", "inference-sync", "inference-sync-1"):
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
        monkeypatch.setenv(var, interpolate(value, TEST_ENV))
    cfg = load_config(None, [(k, interpolate(v, TEST_ENV)) for k, v in overrides])  # values of the right type
    assert cfg.kafka.bootstrap_servers == "kafka:9092"
    user = REDIS_USERS.get(service)  # each service's own Redis user (docs/security.md), with its password
    password = TEST_ENV[f"RLSTREAM_REDIS_{user.upper()}_PASSWORD"] if user else ""
    assert cfg.redis.url == (f"redis://{user}:{password}@redis:6379/0" if user else "redis://redis:6379/0")


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
    for name, svc in services.items():  # every service that serves metrics is scraped there, and only those
        port = next((v for k, v in (svc.get("environment") or {}).items() if k.endswith("__PROMETHEUS_PORT")), None)
        if port is not None:
            assert targets.get(name) == int(port), f"{name} serves metrics on {port}; scraped: {targets.get(name)}"
    assert set(targets) <= set(services), f"scraped hosts that are no service: {set(targets) - set(services)}"


def test_the_check_catches_mistakes():
    assert not config_key_exists(["learner", "no_such_key"])
    assert not config_key_exists(["kafka", "bootstrap_servers", "deeper"])
    assert config_key_exists(["learner", "lora", "r"]) and config_key_exists(["run_id"])
    with pytest.raises(AssertionError, match="not a registered command"):
        resolve(["streams", "no-such-command"])
    assert interpolate("${A:-x}/${B}") == "x/"


def test_interpolation_follows_compose():
    env = {"SET": "v", "EMPTY": ""}
    cases = {"${SET}": "v", "${UNSET}": "", "$SET/$UNSET": "v/", "$$SET": "$SET", "a$$": "a$", "$1": "$1",
             "${SET:-d}": "v", "${EMPTY:-d}": "d", "${UNSET:-d}": "d",
             "${SET-d}": "v", "${EMPTY-d}": "", "${UNSET-d}": "d",
             "${SET:?e}": "v", "${SET?e}": "v", "${EMPTY?e}": "",
             "${SET:+r}": "r", "${EMPTY:+r}": "", "${EMPTY+r}": "r", "${UNSET+r}": "",
             "${UNSET:-a-b:c d}": "a-b:c d"}
    for template, expected in cases.items():
        assert interpolate(template, env) == expected, template
    for template in ("${UNSET:?need it}", "${EMPTY:?need it}", "${UNSET?need it}"):
        with pytest.raises(MissingVariable, match="is missing a value: need it"):
            interpolate(template, env)
    with pytest.raises(ValueError, match="invalid interpolation"):
        interpolate("${1BAD}", env)


@pytest.mark.parametrize("var", sorted(REQUIRED_ENV))
def test_an_unset_required_variable_stops_compose(var):
    """The model dir, dataset and reward function fail fast, unset or empty, with a message naming them."""
    assert resolved(TEST_ENV)  # all set: fine
    for value in (None, ""):
        env = {k: v for k, v in TEST_ENV.items() if k != var} | ({} if value is None else {var: value})
        with pytest.raises(MissingVariable, match=f"required variable {var} is missing a value: set {var} "):
            resolved(env)


def test_compose_file_validates_against_the_compose_spec():
    assert schema_errors(resolved()) == []
    assert schema_errors(interpolate_tree(compose(), {**TEST_ENV, "LEARNER_GPU": "2", "VLLM_GPU": "3"})) == []


@pytest.mark.parametrize("breakage", ["ports as a number", "unknown top-level key", "unknown service key",
                                      "device_ids not a list"])
def test_schema_validation_catches_a_broken_file(breakage):
    """Negative controls: the schema check is not vacuous."""
    doc = resolved()
    services = doc["services"]
    if breakage == "ports as a number":
        services["prometheus"]["ports"] = 9090
    elif breakage == "unknown top-level key":
        doc["servces"] = {}
    elif breakage == "unknown service key":
        services["vllm"]["gpus_ids"] = ["1"]
    else:
        services["learner"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] = 0
    assert schema_errors(doc), breakage


def test_vllm_and_internal_ports_are_not_published_beyond_loopback():
    """vLLM's dev endpoints (/pause, /collective_rpc) and every other published port: 127.0.0.1 at most."""
    services = resolved()["services"]
    assert not any(published_beyond_loopback(p) for p in services["vllm"].get("ports", []))
    for name, svc in services.items():
        exposed = [p for p in svc.get("ports", []) if published_beyond_loopback(p)]
        assert not exposed, f"{name} publishes {exposed} on every interface"
    for internal in ("kafka", "redis", "vllm"):
        assert "ports" not in services[internal], f"{internal} is reached on the compose network only"
    assert published_beyond_loopback("8000:8000") and published_beyond_loopback(8000)
    assert published_beyond_loopback("0.0.0.0:8000:8000") and published_beyond_loopback({"target": 8000,
                                                                                          "published": 8000})
    assert not published_beyond_loopback("127.0.0.1:8000:8000/tcp") and not published_beyond_loopback("[::1]:1:1")
    assert not published_beyond_loopback({"target": 8000, "published": 8000, "host_ip": "127.0.0.1"})


def test_learner_and_vllm_reserve_different_gpus():
    services = resolved()["services"]
    learner, vllm = gpu_device_ids(services["learner"]), gpu_device_ids(services["vllm"])
    assert learner and vllm and not learner & vllm, (learner, vllm)
    for name in ("learner", "vllm"):  # compose refuses count next to device_ids
        assert all("count" not in d for d in services[name]["deploy"]["resources"]["reservations"]["devices"])
    assert "--gpu-memory-utilization" in services["vllm"]["command"]  # the single-GPU split is one variable away
    shared = interpolate_tree(compose(), {**TEST_ENV, "LEARNER_GPU": "0", "VLLM_GPU": "0"})["services"]
    assert gpu_device_ids(shared["learner"]) == gpu_device_ids(shared["vllm"]) == {"0"}
    second = gpu_device_ids(services["vllm-1"])  # the second replica has a GPU of its own
    assert second and not second & (learner | vllm), (learner, vllm, second)


def test_replicas_load_versions_from_the_weight_store_by_url():
    """Two vLLM replicas, each with its own sync worker and volume; the learner uploads to the weight store and the
    sync workers accept exactly that prefix, with no filesystem shared between learner and replicas."""
    services = resolved()["services"]
    learner_env = services["learner"]["environment"]
    store = learner_env["RLSTREAM_LEARNER__WEIGHT_STORE"]
    assert store.startswith("s3://")
    endpoint = json.loads(learner_env["RLSTREAM_LEARNER__WEIGHT_STORE_OPTIONS"])["client_kwargs"]["endpoint_url"]
    assert endpoint.split("//", 1)[1].split(":", 1)[0] == "weight-store" and "weight-store" in services
    bucket = store.split("/")[2]
    assert f"store/{bucket}" in services["weight-store-init"]["command"][0]  # the bucket exists before the learner
    assert services["learner"]["depends_on"]["weight-store-init"]["condition"] == "service_completed_successfully"

    def volume_names(service: dict[str, Any]) -> set[str]:
        return {v.split(":", 1)[0] for v in service.get("volumes", []) if isinstance(v, str)}

    urls = set()
    for sync, server in (("inference-sync", "vllm"), ("inference-sync-1", "vllm-1")):
        env = services[sync]["environment"]
        assert json.loads(env["RLSTREAM_INFERENCE__WEIGHTS_ROOTS"]) == [store]
        assert json.loads(env["RLSTREAM_INFERENCE__WEIGHT_STORE_OPTIONS"]) == json.loads(
            learner_env["RLSTREAM_LEARNER__WEIGHT_STORE_OPTIONS"])
        command = services[sync]["command"]
        urls.add(command[command.index("--url") + 1])
        assert command[command.index("--url") + 1] == f"http://{server}:8000"
        assert services[sync]["depends_on"][server]["condition"] == "service_healthy"
        # vLLM reads the staged copy its own sync worker wrote: one volume, mounted at the same path in both
        shared = volume_names(services[sync]) & volume_names(services[server])
        assert len(shared) == 1, (sync, server)
        mount = next(v for v in services[server]["volumes"] if isinstance(v, str) and v.startswith(f"{shared.pop()}:"))
        assert env["RLSTREAM_INFERENCE__STAGING_DIR"].startswith(mount.split(":")[1] + "/")
        assert not volume_names(services[sync]) & volume_names(services["learner"])  # nothing shared with the learner
    assert len(urls) == 2
    worker_ids = {services[s]["environment"]["RLSTREAM_INFERENCE__WORKER_ID"] for s in ("inference-sync",
                                                                                         "inference-sync-1")}
    assert len(worker_ids) == 2  # each replica acknowledges its versions under its own id


def test_vllm_image_is_on_the_tested_version_line():
    """The default image tag carries the version of rlstream/ops/requirements-vllm.txt (its major.minor)."""
    pins = re.findall(r"^vllm(?:-cpu)?==(\d+)\.(\d+)\.(\d+)\s*$", VLLM_REQUIREMENTS.read_text(), re.MULTILINE)
    assert len(pins) == 1, pins
    image = compose()["services"]["vllm"]["image"]
    assert image.startswith("${VLLM_IMAGE:-"), "the image stays overridable with VLLM_IMAGE"
    tag = re.fullmatch(r"vllm/vllm-openai:v(\d+)\.(\d+)\.(\d+)", interpolate(image))
    assert tag, interpolate(image)
    assert tag.groups()[:2] == pins[0][:2], f"image {tag.group(0)} vs requirements {'.'.join(pins[0])}"
    assert interpolate(image, {"VLLM_IMAGE": "mirror/vllm:x"}) == "mirror/vllm:x"


def test_host_bind_mounts_are_never_created_empty():
    for name, svc in resolved()["services"].items():
        assert not host_binds_created_by_default(svc), f"{name}: {host_binds_created_by_default(svc)}"
    assert host_binds_created_by_default({"volumes": ["./models:/m:ro", "/srv/x:/x", "named:/data"]}) == [
        "./models:/m:ro", "/srv/x:/x"]
    assert host_binds_created_by_default({"volumes": [{"type": "bind", "source": "/x", "target": "/x"}]}) == ["/x"]


def test_repo_files_mounted_into_prometheus_and_grafana_exist():
    services = resolved()["services"]
    mounts = {(name, v["target"]): v["source"] for name, svc in services.items() for v in svc.get("volumes", [])
              if isinstance(v, dict) and v["type"] == "bind" and v["source"].startswith("./")}
    expected = {("prometheus", "/etc/prometheus/prometheus.yml"): "./rlstream/ops/prometheus.yml",
                ("prometheus", "/etc/prometheus/alerts.yml"): "./rlstream/ops/alerts.yml",
                ("grafana", "/etc/grafana/provisioning"): "./rlstream/ops/grafana/provisioning",
                ("grafana", "/var/lib/grafana/dashboards"): "./rlstream/ops/grafana/dashboards"}
    assert {k: mounts.get(k) for k in expected} == expected
    missing = sorted(source for source in mounts.values() if not (ROOT / source).exists())
    assert not missing, f"mounted from the repo but missing: {missing}"
    assert (ROOT / "rlstream/ops/alerts.yml").is_file() and (ROOT / "rlstream/ops/grafana/dashboards").is_dir()


def test_stream_workers_have_stable_ids():
    """Static membership: each streams worker has a fixed --worker-id, unique, and cannot be --scale'd."""
    ids = {}
    for name, svc in resolved()["services"].items():
        command = svc.get("command") or []
        if command[:3] != ["rlstream", "streams", "worker"]:
            continue
        assert "--worker-id" in command, f"{name}: no --worker-id, so the id changes when the container does"
        worker_id = command[command.index("--worker-id") + 1]
        assert "$" not in worker_id and worker_id not in ids.values(), (name, worker_id)
        ids[name] = worker_id
        assert svc.get("container_name"), f"{name}: without container_name, --scale gives one id to N workers"
    assert ids == {"streams": "streams-0"}


def test_schema_registry_enforces_full_transitive_compatibility():
    env = compose()["services"]["schema-registry"]["environment"]
    assert env["SCHEMA_REGISTRY_SCHEMA_COMPATIBILITY_LEVEL"].lower() == "full_transitive"


def test_redis_acl_lets_only_the_sync_workers_write_heartbeats(tmp_path: Path) -> None:
    """The compose file's Redis users on a real redis-server: every service reads the control plane, only ``sync``
    writes ``rlstream:*:worker:*`` (a forged heartbeat is what would steer gateways); the default user only PINGs."""
    import shutil
    import subprocess
    import time

    import redis

    acl = tmp_path / "users.acl"
    acl.write_text(interpolate(compose()["configs"]["redis-acl"]["content"], TEST_ENV))
    socket = tmp_path / "redis.sock"
    server = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", "0", "--unixsocket",
                               str(socket), "--save", "", "--appendonly", "no", "--aclfile", str(acl)],
                              stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not socket.exists():
            assert server.poll() is None and time.monotonic() < deadline, "redis-server refused the ACL file"
            time.sleep(0.02)

        def client(user: str | None) -> redis.Redis:
            password = TEST_ENV[f"RLSTREAM_REDIS_{user.upper()}_PASSWORD"] if user else None
            return redis.Redis(unix_socket_path=str(socket), username=user, password=password)

        heartbeat = "rlstream:policy:worker:w0"
        client("sync").hset(heartbeat, mapping={"version": 1, "url": "http://vllm:8000"})
        client("sync").expire(heartbeat, 60)
        for user in ("learner", "streams", "rollout"):
            assert client(user).hgetall(heartbeat)[b"url"] == b"http://vllm:8000"  # everyone reads
            with pytest.raises(redis.exceptions.NoPermissionError):
                client(user).hset(heartbeat, "url", "http://attacker:8000")
        client("learner").hset("rlstream:policy:latest", "version", 2)  # its own key
        client("rollout").hset("rlstream:run:status", "rollout_groups", 1)
        assert client(None).ping()
        with pytest.raises(redis.exceptions.NoPermissionError):
            client(None).hgetall(heartbeat)
        # control: the admin user (the operator's) may write it: the refusals above are the per-service users'
        client("admin").hset(heartbeat, "note", "ok")
    finally:
        server.terminate()
        server.wait(10)
