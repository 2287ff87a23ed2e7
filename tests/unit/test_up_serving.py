"""What serves under ``rlstream up``: the settings its serve replica's sync worker and its gateway start with, with
the promotion gate on and off."""
from __future__ import annotations

import pytest

from rlstream.gateway.service import prepare_gateway
from rlstream.ops.up import serving_overrides
from rlstream.schemas.config import RlstreamConfig, load_config

pytestmark = pytest.mark.unit


def _pairs(flags: tuple[str, ...]) -> list[tuple[str, str]]:
    """``("-o", KEY, VALUE, ...)`` as the CLI reads it."""
    assert len(flags) % 3 == 0 and all(flag == "-o" for flag in flags[::3]), flags
    return [(flags[i + 1], flags[i + 2]) for i in range(0, len(flags), 3)]


def _child_config(flags: tuple[str, ...], user: list[tuple[str, str]] | None = None) -> RlstreamConfig:
    """The configuration a child started with ``flags`` after the run's own settings (``user``) loads."""
    return load_config(None, [*(user or []), *_pairs(flags)])


def test_without_the_gate_every_loaded_version_serves() -> None:
    ungated = serving_overrides(gated=False)
    gateway = prepare_gateway(_child_config(ungated.gateway)).gw
    assert gateway.serve_unpromoted  # no serving pointer ever comes: policy = the newest loaded version, not 503
    sync = _child_config(ungated.sync, user=[("inference.full_weights_follow", "serving")])
    assert sync.inference.full_weights_follow == "newest"  # full weights replace the base on the serve replica


def test_with_the_gate_only_promoted_versions_serve() -> None:
    gated = serving_overrides(gated=True)
    assert gated.gateway == ()  # the gateway's default: no pointer means 503
    assert not prepare_gateway(_child_config(gated.gateway)).gw.serve_unpromoted
    sync = _child_config(gated.sync, user=[("inference.full_weights_follow", "newest")])
    assert sync.inference.full_weights_follow == "serving"  # a candidate never replaces what serves
