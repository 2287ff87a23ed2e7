"""`rlstream gateway serve` as a process: `--api-key` (repeatable) lets it serve a routable address, and each of those
keys authenticates while any other is refused; without keys it serves loopback and says so at start."""
from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from rlstream.ops.ports import free_port
from rlstream.schemas.config import RlstreamConfig
from rlstream.schemas.topics import TopicNames
from tests.chaos.test_gateway_spool import MESSAGES, GatewayProcess
from tests.integration.test_gateway_upstream_key import recording_upstream

KEY_1, KEY_2, OTHER_KEY = "cli-key-one-0123456789", "cli-key-two-0123456789", "cli-key-three-0123456789"


async def test_api_keys_from_the_cli_open_a_routable_address_and_only_they_authenticate(
        rl_config: RlstreamConfig, created_topics: TopicNames, tmp_path: Path) -> None:
    seen: list[str] = []
    async with recording_upstream(seen) as port:
        upstream = f"http://127.0.0.1:{port}"
        keyed = GatewayProcess(rl_config, upstream, free_port(), tmp_path / "keyed.log", "-o", "gateway.spool", "false",
                               "--host", "0.0.0.0", "--api-key", KEY_1, "--api-key", KEY_2)
        open_ = GatewayProcess(rl_config, upstream, free_port(), tmp_path / "open.log", "-o", "gateway.spool", "false")
        for gateway in (keyed, open_):
            gateway.env["RLSTREAM_GATEWAY_API_KEYS"] = ""
            gateway.start()
        try:
            async with httpx.AsyncClient(timeout=30) as http:
                await asyncio.gather(keyed.ready(http), open_.ready(http))
                chat = {"model": rl_config.policy, "messages": MESSAGES}
                url = f"{keyed.url}/v1/chat/completions"  # bound on 0.0.0.0, reached through loopback
                for key in (KEY_1, KEY_2):
                    r = await http.post(url, json=chat, headers={"authorization": f"Bearer {key}"})
                    assert r.status_code == 200 and r.headers["x-rlstream-feedback-token"], r.text
                r = await http.post(url, json=chat, headers={"authorization": f"Bearer {OTHER_KEY}"})
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
                r = await http.post(url, json=chat)
                assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key", r.text
                assert (await http.post(f"{open_.url}/v1/chat/completions", json=chat)).status_code == 200
        finally:
            keyed.stop()
            open_.stop()
    assert seen == ["", "", ""]  # the two keyed calls and the open one; a client's key never goes upstream
    keyed_log, open_log = keyed.log_path.read_text(), open_.log_path.read_text()
    assert "clients authenticate with API keys (2 loaded)" in keyed_log, keyed.log_tail()
    assert KEY_1 not in keyed_log and KEY_2 not in keyed_log and OTHER_KEY not in keyed_log
    assert "no API keys: serving loopback only" in open_log, open_.log_tail()
    assert "no API keys" not in keyed_log and "API keys (" not in open_log
