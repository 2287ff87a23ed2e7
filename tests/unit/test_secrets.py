"""Secrets (Kafka SASL and SSL key passwords, passwords in Redis and registry URLs): masked in `config show`, in
logs, in `rlstream status` and in the config files a run writes; the clients still get the real values."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from rlstream.cli.app import app
from rlstream.schemas.config import RlstreamConfig, load_config
from rlstream.schemas.masking import MASK, public_config_text, secret_env

SASL = "sasl-Pa55word"
SSL_KEY = "ssl-key-pw-0001"
REDIS_PW = "redis-pw-9x9"
REGISTRY_PW = "registry-pw-77"
API_KEY = "sk-live-api-key-31"
REDIS_URL = f"redis://:{REDIS_PW}@redis.internal:6379/0"
REGISTRY_URL = f"https://svc:{REGISTRY_PW}@registry.internal:8081"
ALL_SECRETS = (SASL, SSL_KEY, REDIS_PW, REGISTRY_PW, API_KEY)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("RLSTREAM_"):
            monkeypatch.delenv(name)


def secret_overrides() -> list[tuple[str, str]]:
    return [("kafka.bootstrap_servers", "broker:9093"), ("kafka.security_protocol", "SASL_SSL"),
            ("kafka.sasl_mechanism", "PLAIN"), ("kafka.sasl_plain_username", "svc"),
            ("kafka.sasl_plain_password", SASL), ("kafka.ssl_password", SSL_KEY),
            ("kafka.schema_registry_url", REGISTRY_URL), ("redis.url", REDIS_URL), ("rollout.api_key", API_KEY)]


def secret_config() -> RlstreamConfig:
    return load_config(None, secret_overrides())


def assert_no_secret(text: str) -> None:
    for secret in ALL_SECRETS:
        assert secret not in text, f"{secret!r} leaked"


# --- config show ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("as_json", [False, True])
def test_config_show_masks_every_secret(tmp_path: Path, as_json: bool) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"kafka": {"ssl_password": SSL_KEY, "schema_registry_url": REGISTRY_URL}}))
    args = ["config", "show", "-c", str(path), "-o", "kafka.security_protocol", "SASL_SSL",
            "-o", "kafka.sasl_mechanism", "PLAIN", "-o", "redis.url", REDIS_URL,
            "-o", "rollout.api_key", API_KEY] + (["--json"] if as_json else [])
    result = CliRunner().invoke(app, args, env={"RLSTREAM_KAFKA__SASL_PLAIN_PASSWORD": SASL})
    assert result.exit_code == 0, result.output
    assert_no_secret(result.output)
    shown = json.loads(result.stdout) if as_json else yaml.safe_load(result.stdout)
    assert shown["kafka"]["sasl_plain_password"] == MASK and shown["kafka"]["ssl_password"] == MASK
    assert shown["rollout"]["api_key"] == MASK
    assert shown["redis"]["url"] == f"redis://:{MASK}@redis.internal:6379/0"
    assert shown["kafka"]["schema_registry_url"] == f"https://svc:{MASK}@registry.internal:8081"


def test_masking_leaves_urls_without_a_password_alone() -> None:
    cfg = load_config(None, [("redis.url", "redis://redis.internal:6379/0")])
    assert cfg.model_dump(mode="json")["redis"]["url"] == "redis://redis.internal:6379/0"
    assert cfg.model_dump(mode="json")["kafka"]["sasl_plain_password"] is None


def test_a_password_that_looks_like_a_number_stays_text() -> None:
    cfg = load_config(None, [("kafka.sasl_plain_password", "000123")])
    assert cfg.kafka.sasl_plain_password is not None
    assert cfg.kafka.sasl_plain_password.get_secret_value() == "000123"


def test_secrets_are_secret_str_and_hidden_in_repr() -> None:
    cfg = secret_config()
    assert SASL not in repr(cfg.kafka) and SSL_KEY not in repr(cfg.kafka) and SASL not in str(cfg)


# --- the clients get the real values ------------------------------------------------------------------------
def test_the_password_reaches_aiokafka_options(monkeypatch: pytest.MonkeyPatch) -> None:
    import aiokafka.helpers

    from rlstream.transport.kafka import client_options

    seen: dict[str, Any] = {}
    monkeypatch.setattr(aiokafka.helpers, "create_ssl_context", lambda **kw: seen.update(kw) or "ssl-context")
    opts = client_options(secret_config().kafka)
    assert opts["sasl_plain_password"] == SASL and isinstance(opts["sasl_plain_password"], str)
    assert opts["sasl_plain_username"] == "svc" and opts["ssl_context"] == "ssl-context"
    assert seen["password"] == SSL_KEY


def test_the_password_reaches_faust() -> None:
    from rlstream.streams.app import faust_settings

    cfg = load_config(None, [("kafka.bootstrap_servers", "broker:9093"), ("kafka.security_protocol", "SASL_PLAINTEXT"),
                             ("kafka.sasl_mechanism", "PLAIN"), ("kafka.sasl_plain_username", "svc"),
                             ("kafka.sasl_plain_password", SASL)])
    assert faust_settings(cfg, "w").get("broker_credentials").password == SASL


def test_validation_config_keeps_the_secrets(tmp_path: Path) -> None:
    from rlstream.finetune.run import validation_config

    val = tmp_path / "val.yaml"
    val.write_text(yaml.safe_dump({"rollout": {"temperature": 0.1}}))
    cfg = load_config(None, [*secret_overrides(), ("finetuning.validation_config_file", str(val))])
    merged = validation_config(cfg)
    assert merged is not None and merged.rollout.temperature == 0.1
    assert merged.kafka.sasl_plain_password.get_secret_value() == SASL and merged.redis.url == REDIS_URL


# --- files a run writes: no secret; the children get them through the environment ----------------------------
def test_run_config_file_holds_no_secret_and_children_get_them_by_env(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from rlstream.ops.infra import LocalStack, ServiceProcess
    from rlstream.ops.up_config import UpOptions, compose_config

    user = tmp_path / "mine.yaml"
    user.write_text(yaml.safe_dump({"learner": {"model": "/models/m"}, "rollout": {"api_key": API_KEY},
                                    "kafka": {"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN",
                                              "sasl_plain_password": SASL, "ssl_password": SSL_KEY}}))
    stack = LocalStack(kafka=ServiceProcess("kafka", "127.0.0.1:1", external=True),
                       redis=ServiceProcess("redis", REDIS_URL, external=True), root="/tmp")
    cfg, path = compose_config(UpOptions(config=user), "run-s", tmp_path, stack, None, "http://127.0.0.1:9", None)
    assert cfg.kafka.sasl_plain_password.get_secret_value() == SASL and cfg.redis.url == REDIS_URL
    written = path.read_text()
    assert_no_secret(written)
    assert yaml.safe_load(written)["kafka"]["sasl_plain_password"] is None
    # a service started with `-c path` and the Supervisor's environment sees the real values
    for name, value in secret_env(cfg).items():
        monkeypatch.setenv(name, value)
    assert load_config(path) == cfg


def test_finetune_streams_child_config_holds_no_secret(tmp_path: Path) -> None:
    from rlstream.finetune.runtime import start_streams_worker

    class Recorder:
        def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
            self.args, self.env = args, env or {}

    recorder = Recorder()
    path = start_streams_worker(secret_config(), tmp_path, recorder)  # type: ignore[arg-type]
    assert_no_secret(path.read_text())
    assert recorder.env["RLSTREAM_KAFKA__SASL_PLAIN_PASSWORD"] == SASL and recorder.env["RLSTREAM_REDIS_URL"] == REDIS_URL
    assert recorder.env["RLSTREAM_KAFKA__SSL_PASSWORD"] == SSL_KEY
    assert str(path) in recorder.args


def test_public_config_text_says_where_the_secrets_come_from() -> None:
    text = public_config_text(secret_config())
    assert text.startswith("#") and "RLSTREAM_KAFKA__SASL_PLAIN_PASSWORD" in text.splitlines()[1]
    assert_no_secret(text)


# --- logs ---------------------------------------------------------------------------------------------------
def test_a_redis_url_with_a_password_is_masked_in_log_output(capsys: pytest.CaptureFixture[str]) -> None:
    import logging

    from rlstream.transport.log import configure_logging, get_logger

    secret_config()  # the config's secrets are remembered: masked wherever they appear
    try:
        configure_logging("json", level="INFO")
        get_logger("rlstream.transport.control").warning("redis unreachable, retrying", url=REDIS_URL)
        logging.getLogger("aiokafka").error("authentication failed for %s with %s", "svc", SASL)
        get_logger("t").info(f"free text quoting {REGISTRY_URL} and the ssl key password {SSL_KEY}")
        err = capsys.readouterr().err
    finally:
        configure_logging("console", level="WARNING")  # back to the test session's setting
    lines = [json.loads(line) for line in err.splitlines() if line.strip()]
    assert len(lines) == 3, err
    assert_no_secret(err)
    assert lines[0]["url"] == f"redis://:{MASK}@redis.internal:6379/0"
    assert MASK in lines[1]["event"] and lines[1]["logger"] == "aiokafka"


# --- rlstream status ---------------------------------------------------------------------------------------
async def test_status_masks_the_redis_password(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlstream.ops import status as status_mod

    async def unreachable(url: str, policy: str, run_id: str) -> dict[str, Any]:
        raise ConnectionError(f"cannot connect to {url}")

    async def nothing(*args: Any, **kwargs: Any) -> list[Any]:
        return []

    monkeypatch.setattr(status_mod, "control_plane_status", unreachable)
    for name in ("recent_versions", "consumer_group_lags", "latest_metrics"):
        monkeypatch.setattr(status_mod, name, nothing)
    report = await status_mod.collect_status(secret_config())
    text = json.dumps(report)
    assert_no_secret(text)
    assert f"redis://:{MASK}@redis.internal:6379/0" in text


def test_a_section_update_keeps_every_secret() -> None:
    """finetune's with_section copies a section through model_dump (python mode): nothing is masked on the way."""
    from rlstream.finetune.runtime import with_section

    cfg = secret_config()
    updated = with_section(with_section(cfg, "redis", retry_max_s=5.0), "rollout", temperature=0.5)
    assert updated.redis.url == REDIS_URL and updated.redis.retry_max_s == 5.0
    assert updated.rollout.api_key.get_secret_value() == API_KEY and updated.rollout.temperature == 0.5
    assert updated.kafka.sasl_plain_password.get_secret_value() == SASL
