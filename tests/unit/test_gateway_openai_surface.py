"""The gateway's OpenAI surface beyond chat: JSON errors for unserved routes, the model list without server paths,
the Responses API's token data taken in and filtered out, and vLLM's tool-calling options."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from typer.testing import CliRunner

from rlstream.ops.toy import CHATML_TEMPLATE
from rlstream.ops.vllm import tool_call_args, tool_call_parser_for
from rlstream.gateway.app import Gateway, create_app
from rlstream.gateway.config import GatewaySettings
from rlstream.gateway.feedback_otlp import JSON_TYPE, OtlpRequestError, evaluation_records
from rlstream.gateway.feedback_shapes import FeedbackShapeError, reward_of
from rlstream.gateway.responses import (ResponsesAsked, ResponsesStreamCapture, filter_response_payload,
                                                response_tokens, responses_upstream_request)
from tests.unit.test_gateway_sessions import FakePublisher

HERMES_TEMPLATE = '{% for tool_call in message.tool_calls %}<tool_call>\n{"name": "{{ tool_call.name }}", ' \
                  '"arguments": {{ tool_call.arguments | tojson }}}\n</tool_call>{% endfor %}'


def model_dir(tmp_path: Path, model_type: str, template: str | None) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    if template is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return tmp_path


@pytest.mark.unit
def test_vllm_starts_with_the_model_familys_tool_call_parser(tmp_path: Path) -> None:
    assert tool_call_parser_for(model_dir(tmp_path / "q", "qwen2", HERMES_TEMPLATE)) == "hermes"
    assert tool_call_parser_for(model_dir(tmp_path / "l", "llama", None)) == "llama3_json"
    assert tool_call_parser_for(model_dir(tmp_path / "u", "unknown_family", None)) == "hermes"
    toy = model_dir(tmp_path / "t", "qwen2", None)
    (toy / "chat_template.jinja").write_text(CHATML_TEMPLATE)  # tool calls written without JSON
    assert tool_call_parser_for(toy) == "pythonic"
    assert tool_call_args(toy, "auto", []) == ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]
    assert tool_call_args(toy, "hermes", []) == ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    assert tool_call_args(toy, "none", []) == [] and tool_call_args(toy, None, []) == []
    assert tool_call_args(toy, "auto", ["--tool-call-parser=hermes"]) == ["--enable-auto-tool-choice"]
    assert tool_call_args(toy, "auto", ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]) == []


@pytest.mark.unit
def test_inference_serve_passes_vllm_options_through(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import rlstream.ops.vllm as vllm
    from rlstream.cli.app import app

    seen: dict[str, Any] = {}

    def start(model_dir: Path, served: str, **kwargs: Any) -> None:
        seen.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(vllm, "start_vllm_server", start)
    result = CliRunner().invoke(app, ["inference", "serve", str(tmp_path), "--vllm-arg=--max-num-seqs=8",
                                      "--tool-call-parser", "hermes", "--", "--enforce-eager", "--block-size", "32"])
    assert result.exit_code == 1 and "RuntimeError: stop here" in result.output, result.output  # the one-line answer
    assert seen["extra_args"] == ["--max-num-seqs=8", "--enforce-eager", "--block-size", "32"]
    assert seen["tool_call_parser"] == "hermes"


def test_inference_serve_starts_vllm_with_lora_and_automatic_tool_choice(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    """The command line ``rlstream inference serve`` gives vLLM (the process start itself is cut off)."""
    import rlstream.ops.vllm as vllm
    from rlstream.cli.app import app

    seen: list[list[str]] = []

    def spawn(cmd: list[str], **kwargs: Any) -> None:
        seen.append(list(cmd))
        raise RuntimeError("stop here")

    monkeypatch.setattr(vllm, "ensure_vllm_venv", lambda venv_dir=None: Path("/venv/bin/python"))
    monkeypatch.setattr(vllm, "spawn", spawn)
    result = CliRunner().invoke(app, ["inference", "serve", str(tmp_path), "--served-model", "Qwen/Qwen2.5-3B",
                                      "--tool-call-parser", "hermes"])
    assert result.exit_code == 1 and "RuntimeError: stop here" in result.output, result.output  # the one-line answer
    (cmd,) = seen
    assert cmd[cmd.index("--model") + 1] == str(tmp_path) and "Qwen/Qwen2.5-3B" in cmd
    assert "--enable-lora" in cmd and "--enable-auto-tool-choice" in cmd
    assert cmd[cmd.index("--tool-call-parser") + 1] == "hermes"


def test_up_hands_its_tool_call_parser_to_every_vllm_server_it_starts(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    import rlstream.ops.up as up
    import rlstream.ops.vllm as vllm
    from rlstream.cli.app import app

    asked: list[Any] = []
    monkeypatch.setattr(up, "run_up", lambda opts: asked.append(opts))
    result = CliRunner().invoke(app, ["up", "--tool-call-parser", "llama3_json", "--no-live"])
    assert result.exit_code == 0, result.output
    assert asked[0].tool_call_parser == "llama3_json"

    started: dict[str, dict[str, Any]] = {}

    def start(model_dir: Path, **kwargs: Any) -> vllm.VllmServer:
        started[kwargs["workdir"].name] = kwargs
        return vllm.VllmServer(url="http://x", model="m", model_dir=str(model_dir), pid=0, log_file="", port=1,
                               workdir=str(kwargs["workdir"]))

    monkeypatch.setattr(vllm, "start_vllm_server", start)

    class Sup:
        extra_pids: dict[str, int] = {}

    supervisor: Any = Sup()
    up._start_vllm_servers(supervisor, tmp_path, "policy", tmp_path, "key", [], {"vllm": 1, "vllm-eval": 2},
                           tool_call_parser="llama3_json")
    assert {name: kw["tool_call_parser"] for name, kw in started.items()} == {"vllm": "llama3_json",
                                                                            "vllm-eval": "llama3_json"}
    # each server's options are in the file up --dry-run writes for it, the same file (config/NAME.yaml)
    planned = up.plan_vllm("vllm", tmp_path, "policy", 1, [], "llama3_json", tmp_path / "dry" / "config")
    assert (tmp_path / "config" / "vllm.yaml").read_text() == planned.config_file.read_text()
    assert "tool_call_parser: llama3_json" in (tmp_path / "config" / "vllm-eval.yaml").read_text()


async def models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [
        {"id": "policy", "object": "model", "root": "/srv/models/qwen", "parent": None},
        {"id": "policy-v3", "object": "model", "root": "/srv/versions/3", "parent": "policy"}]})


@pytest.mark.unit
async def test_unserved_routes_answer_json_errors_and_models_hide_server_paths() -> None:
    upstream = Starlette(routes=[Route("/v1/models", models)])
    gateway = Gateway(GatewaySettings(session_stitching="gateway"), FakePublisher(), client=httpx.AsyncClient(
        transport=httpx.ASGITransport(upstream), base_url="http://up"))
    await gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(create_app(gateway)), base_url="http://gw") as c:
            # an endpoint the gateway serves but this upstream lacks answers the upstream's 404, as a JSON error
            for path in ("/v1/completions", "/v1/embeddings", "/s/abc/v1/completions", "/v1/images/generations"):
                r = await c.post(path, json={"model": "policy", "prompt": "a"})
                assert r.status_code == 404 and r.headers["content-type"] == "application/json", (path, r.text)
                error = r.json()["error"]
                assert error["type"] == "not_found_error" and error["code"] == 404 and error["message"]
            assert "embeddings" in (await c.post("/v1/embeddings", json={})).json()["error"]["message"]
            r = await c.get("/v1/chat/completions")
            assert r.status_code == 405 and r.json()["error"]["code"] == 405
            listed = (await c.get("/v1/models")).json()["data"]
            assert [(m["id"], m["root"], m["parent"]) for m in listed] == [("policy", "policy", None),
                                                                           ("policy-v3", "policy-v3", "policy")]
    finally:
        await gateway.stop()


VLLM_ANSWER = {"id": "resp_1", "model": "policy", "status": "completed", "output": [
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "cc", "logprobs": [
        {"token": "c", "logprob": -0.5, "top_logprobs": []}, {"token": "c", "logprob": -0.25, "top_logprobs": []}]}]}],
    "input_messages": [{"message": "<prompt>", "tokens": [1, 2, 3], "type": "raw_message_tokens"}],
    "output_messages": [{"message": "cc", "tokens": [9, 9], "type": "raw_message_tokens"}]}


@pytest.mark.unit
def test_responses_token_data_is_asked_for_recorded_and_filtered_out() -> None:
    sent = responses_upstream_request({"model": "m", "input": "x", "include": ["reasoning.encrypted_content"]},
                                      True, True)
    assert sent["enable_response_messages"] is True
    assert sent["include"] == ["reasoning.encrypted_content", "message.output_text.logprobs"]
    assert "include" not in responses_upstream_request({"input": "x"}, True, False)
    assert responses_upstream_request({"input": "x"}, False, True) == {"input": "x"}
    tokens = response_tokens(json.loads(json.dumps(VLLM_ANSWER)))
    assert (tokens.prompt_ids, tokens.completion_ids, tokens.logprobs) == ([1, 2, 3], [9, 9], [-0.5, -0.25])
    short = json.loads(json.dumps(VLLM_ANSWER))
    short["output_messages"][0]["tokens"] = [9, 9, 2]  # logprobs that miss a token: Gateway.finish counts them
    assert response_tokens(short).logprobs == [-0.5, -0.25] and response_tokens(short).completion_ids == [9, 9, 2]
    client = filter_response_payload(json.loads(json.dumps(VLLM_ANSWER)), ResponsesAsked())
    assert client["input_messages"] is None and client["output_messages"] is None
    assert client["output"][0]["content"][0]["logprobs"] is None
    asked = filter_response_payload(json.loads(json.dumps(VLLM_ANSWER)), ResponsesAsked(messages=True, logprobs=True))
    assert asked == VLLM_ANSWER


@pytest.mark.unit
def test_a_streamed_response_is_followed_and_filtered() -> None:
    capture = ResponsesStreamCapture(ResponsesAsked(), "policy-v2", "policy")
    created = {"type": "response.created", "response": {"id": "resp_9", "model": "policy-v2", "output": []}}
    deltas = [{"type": "response.output_text.delta", "delta": "c", "logprobs": [{"token": "c", "logprob": -0.5}]},
              {"type": "response.output_text.delta", "delta": "c", "logprobs": [{"token": "c", "logprob": -0.25}]}]
    final = {**VLLM_ANSWER, "model": "policy-v2"}
    final["output"] = [{"type": "message", "content": [{"type": "output_text", "text": "cc", "logprobs": None}]}]
    lines = ["event: response.created", "data: " + json.dumps(created), ""]
    for delta in deltas:
        lines += ["data: " + json.dumps(delta), ""]
    lines += ["data: " + json.dumps({"type": "response.completed", "response": final}), "", "data: not json"]
    out = [capture.render(line) for line in lines]
    assert out[0] == "event: response.created\n" and out[-1] == "data: not json\n"
    events = [json.loads(line[5:]) for line in out if line.startswith("data: {")]
    assert all(not e.get("logprobs") for e in events)
    assert events[0]["response"]["model"] == "policy" and events[-1]["response"]["input_messages"] is None
    assert capture.response_id == "resp_9"
    tokens = capture.tokens()
    assert tokens is not None and (tokens.prompt_ids, tokens.completion_ids, tokens.logprobs) == (
        [1, 2, 3], [9, 9], [-0.5, -0.25])


@pytest.mark.unit
def test_feedback_shapes_rewards_and_otlp_records() -> None:
    table = {"Thumbs_Up": 1.0, "thumbs_down": -1.0}
    assert reward_of(True, table) == 1.0 and reward_of(False, table) == 0.0 and reward_of(3, table) == 3.0
    assert reward_of("THUMBS_UP", table) == 1.0 and reward_of(" thumbs_down ", table) == -1.0
    for bad in ("great", None, [1], float("nan")):
        with pytest.raises(FeedbackShapeError):
            reward_of(bad, table)
    body = {"resourceLogs": [{"scopeLogs": [{"logRecords": [
        {"eventName": "gen_ai.evaluation.result", "attributes": [
            {"key": "gen_ai.response.id", "value": {"stringValue": "chatcmpl-1"}},
            {"key": "gen_ai.evaluation.score.value", "value": {"doubleValue": 0.5}}]},
        {"attributes": [{"key": "event.name", "value": {"stringValue": "gen_ai.evaluation.result"}},
                        {"key": "n", "value": {"intValue": "7"}}]},
        {"eventName": "other"}, "garbage"]}]}]}
    assert evaluation_records(json.dumps(body).encode(), JSON_TYPE, 64) == [{"gen_ai.response.id": "chatcmpl-1", "gen_ai.evaluation.score.value": 0.5},
                                        {"event.name": "gen_ai.evaluation.result", "n": 7}]
    for bad_body in ({}, {"resourceLogs": {}}, [], "x"):
        with pytest.raises(OtlpRequestError):
            evaluation_records(json.dumps(bad_body).encode(), JSON_TYPE, 64)


@pytest.mark.unit
def test_gateway_serve_takes_the_feedback_categories_table(monkeypatch: pytest.MonkeyPatch) -> None:
    import rlstream.gateway.service as gateway_service
    from rlstream.cli.app import app

    served: list[GatewaySettings] = []

    async def serve(cfg: Any, gw: GatewaySettings, *args: Any) -> None:
        served.append(gw)

    monkeypatch.setattr(gateway_service, "_serve", serve)
    monkeypatch.setattr(gateway_service, "run", lambda coro: __import__("asyncio").run(coro))
    env = {"RLSTREAM_GATEWAY_API_KEYS": ""}
    bad = CliRunner().invoke(app, ["gateway", "serve", "-o", "gateway.feedback_categories", "{great: very}"], env=env)
    assert bad.exit_code == 2 and "gateway.feedback_categories.great" in bad.output, bad.output
    ok = CliRunner().invoke(app, ["gateway", "serve", "-o", "gateway.spool", "false", "-o",
                                  "gateway.feedback_categories", "{great: 1, awful: -1}"], env=env)
    assert ok.exit_code == 0, ok.output
    assert served[0].feedback_categories == {"great": 1.0, "awful": -1.0}


@pytest.mark.unit
def test_malformed_responses_token_data_is_recorded_without_it_never_raised() -> None:
    from rlstream.gateway.responses import finish_reason, response_message

    for payload in ({"output": 5, "input_messages": [{"tokens": ["x"]}]},
                    {"output": [{"type": "message", "content": [{"type": "output_text", "logprobs": [{"no": 1}]}]}],
                     "output_messages": [{"tokens": [1]}]},
                    {"output": [{"type": "message", "content": 7}], "input_messages": {"tokens": [1]}}):
        tokens = response_tokens(payload)
        assert tokens.logprobs is None and (tokens.prompt_ids is None or tokens.completion_ids is None)
        response_message(payload), finish_reason(payload), filter_response_payload(payload, ResponsesAsked())
    capture = ResponsesStreamCapture(ResponsesAsked(), "m", "m")
    bad_delta = {"type": "response.output_text.delta", "logprobs": [{"logprob": "high"}]}
    assert capture.render("data: " + json.dumps(bad_delta)).startswith("data: ")  # handed on
    final = {**VLLM_ANSWER, "output": [{"type": "message", "content": [{"type": "output_text", "text": "cc"}]}]}
    capture.render("data: " + json.dumps({"type": "response.completed", "response": final}))
    tokens = capture.tokens()
    assert tokens is not None and tokens.completion_ids == [9, 9] and tokens.logprobs is None
    with pytest.raises(FeedbackShapeError):
        reward_of(10 ** 400, {})
