"""Every ``rlstream`` option with a fixed set of values is an Enum: typer refuses anything else (exit 2)
and names the allowed values, before the command runs; ``--log-level`` sets the level that is logged."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from rlstream.cli.app import app


@pytest.mark.parametrize(
    ("args", "option", "allowed"),
    [
        (["--log-format", "xml", "config", "validate"], "'--log-format'", "'auto', 'json', 'console'"),
        (["--log-level", "LOUD", "config", "validate"], "'--log-level'", "'debug', 'info', 'warning', 'error'"),
        (["up", "--model", "huge"], "'--model'", "'tiny', 'smollm2'"),
        (["inference", "sync", "--backend", "tgi"], "'--backend'", "'vllm'"),
        (["rollout", "run", "--mode", "forever"], "'--mode'", "'epoch', 'continuous'"),
        (["streams", "worker", "--log-level", "loud"], "'--log-level'", "'debug', 'info', 'warning', 'error'"),
        (["tail", "nope"], "'kind'", "'metrics', 'groups', 'dlq', 'versions'"),
        (["tail", "dlq", "--format", "xml"], "'--format'", "'table', 'json'"),
        (["status", "--format", "xml"], "'--format'", "'table', 'json'"),
        (["replay", "--run-id", "r", "--format", "xml"], "'--format'", "'table', 'json'"),
    ],
)
def test_a_value_outside_the_choices_is_a_usage_error(args: list[str], option: str, allowed: str) -> None:
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert f"Invalid value for {option}" in result.output
    assert allowed in result.output


def test_tail_kinds_are_the_kinds_tail_reads() -> None:
    from rlstream.cli.ops import TailKind
    from rlstream.ops.tail import TAIL_KINDS

    assert [k.value for k in TailKind] == list(TAIL_KINDS)


def test_rollout_modes_are_the_config_modes() -> None:
    from typing import get_args

    from rlstream.cli.rollout import RolloutMode
    from rlstream.schemas.config import RolloutConfig

    assert [m.value for m in RolloutMode] == list(get_args(RolloutConfig.model_fields["mode"].annotation))


def test_log_level_filters_what_is_logged(capsys: pytest.CaptureFixture[str]) -> None:
    from rlstream.transport.log import configure_logging, get_logger

    try:
        assert CliRunner().invoke(app, ["--log-level", "error", "--log-format", "json", "config", "validate"]
                                  ).exit_code == 0
        get_logger("cli-level").warning("hidden warning")
        get_logger("cli-level").error("shown error")
        err = capsys.readouterr().err
        assert "shown error" in err and "hidden warning" not in err
    finally:
        configure_logging("console", level="WARNING")  # back to the test session's setting
