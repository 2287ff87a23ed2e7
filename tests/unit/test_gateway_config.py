"""The gateway's settings are the ``gateway`` section of the main configuration: YAML, RLSTREAM_GATEWAY__* and -o
set them (in that order of precedence), one process's flags override them, and what the section leaves unset comes
from the rest of the configuration."""
from __future__ import annotations

from pathlib import Path

import pytest

from rlstream.gateway.config import GatewaySettings, default_spool_dir
from rlstream.gateway.service import GatewayOptions, GatewayStartError, prepare_gateway
from rlstream.schemas.config import ConfigError, load_config

pytestmark = pytest.mark.unit

YAML = """
inference: {url: "http://vllm:8000", served_model: base, api_key: upstream-secret-1}
streams: {max_allowed_group_size: 16, reward_window_s: 600}
gateway:
  port: 9001
  session_stitching: gateway
  max_body_bytes: 4096
  request_logprobs: false
  spool: false
  feedback_categories: {great: 1.0, awful: -1.0}
"""


@pytest.fixture
def config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in ("RLSTREAM_GATEWAY__PORT", "RLSTREAM_GATEWAY__MAX_BODY_BYTES", "RLSTREAM_GATEWAY__HOST",
                "RLSTREAM_GATEWAY_API_KEYS"):
        monkeypatch.delenv(var, raising=False)
    path = tmp_path / "rlstream.yaml"
    path.write_text(YAML)
    return path


def test_yaml_env_and_overrides_set_the_gateway_section_in_that_order(config_file: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(config_file)
    assert (cfg.gateway.port, cfg.gateway.session_stitching, cfg.gateway.max_body_bytes) == (9001, "gateway", 4096)
    assert cfg.gateway.request_logprobs is False and cfg.gateway.feedback_categories == {"great": 1.0, "awful": -1.0}
    monkeypatch.setenv("RLSTREAM_GATEWAY__PORT", "9002")
    monkeypatch.setenv("RLSTREAM_GATEWAY__MAX_BODY_BYTES", "8192")
    cfg = load_config(config_file)
    assert (cfg.gateway.port, cfg.gateway.max_body_bytes) == (9002, 8192)  # the environment over the file
    assert cfg.gateway.session_stitching == "gateway"  # keys the environment does not name stay the file's
    cfg = load_config(config_file, [("gateway.port", "9003"), ("gateway.feedback_categories", "{fine: 0.5}")])
    assert (cfg.gateway.port, cfg.gateway.max_body_bytes) == (9003, 8192)  # -o over the environment
    assert cfg.gateway.feedback_categories == {"great": 1.0, "awful": -1.0, "fine": 0.5}  # tables merge by key


def test_a_bad_gateway_key_or_value_is_refused_with_its_name(config_file: Path) -> None:
    with pytest.raises(ConfigError, match="gateway.max_body_bytes"):
        load_config(config_file, [("gateway.max_body_bytes", "10")])  # below its 1024 floor
    with pytest.raises(ConfigError, match="gateway.session_stitching"):
        load_config(config_file, [("gateway.session_stitching", "nowhere")])
    with pytest.raises(ConfigError, match="gateway.max_body"):
        load_config(config_file, [("gateway.max_body", "4096")])  # no such key
    assert load_config(config_file, [("gateway.max_body_bytes", "2048")]).gateway.max_body_bytes == 2048


def test_the_unset_keys_come_from_the_rest_of_the_configuration(config_file: Path) -> None:
    gw = GatewaySettings.resolve(load_config(config_file))
    assert (gw.upstream_url, gw.served_model, gw.max_choices, gw.upstream_key) == (
        "http://vllm:8000", "base", 16, "upstream-secret-1")
    assert gw.upstream_base == "http://vllm:8000/v1" and gw.spool_dir is None and gw.max_body_bytes == 4096
    cfg = load_config(config_file, [("gateway.upstreams", "[http://a:1, http://b:2]"), ("gateway.served_model", "m"),
                                    ("gateway.max_choices", "4"), ("gateway.spool", "true")])
    gw = GatewaySettings.resolve(cfg)
    assert (gw.upstream_url, gw.served_model, gw.max_choices) == ("http://a:1", "m", 4)
    assert gw.spool_dir == default_spool_dir(9001)


def test_one_process_flags_override_the_section(config_file: Path, tmp_path: Path) -> None:
    cfg = load_config(config_file)
    prepared = prepare_gateway(cfg, GatewayOptions(upstreams=["http://r1:8000", "http://r2:8000"], port=9100,
                                                   gateway_id="g1", spool_dir=tmp_path / "spool"))
    gw = prepared.gw
    assert (gw.port, gw.gateway_id, gw.upstream_url) == (9100, "g1", "http://r1:8000")
    assert prepared.upstreams == ["http://r1:8000", "http://r2:8000"]
    assert prepared.access.feedback_token_ttl_s == 600  # streams.reward_window_s
    assert gw.max_body_bytes == 4096 and gw.request_logprobs is False  # the section's
    assert prepare_gateway(cfg).gw.port == 9001  # without flags: the section as configured
    with pytest.raises(GatewayStartError, match="port"):
        prepare_gateway(cfg, GatewayOptions(port=70_000))
    with pytest.raises(GatewayStartError, match="API keys"):  # a routable address needs keys
        prepare_gateway(cfg, GatewayOptions(host="0.0.0.0"))
