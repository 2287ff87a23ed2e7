"""Each model ``rlstream up --model`` offers (``tiny``, ``smollm2``) serves on real vLLM with the tool-call parser
``up`` resolves for it, and that parser turns a tool call the model writes into a tool call of the answer; the
parser check ``up`` (and ``up --dry-run``) runs before starting anything refuses exactly what vLLM itself refuses when
it starts, for every parser vLLM has, on both models' tokenizers.

The tiny model is the session's shared server (started as ``up`` starts it: ``start_vllm_server`` with the
``auto`` parser); SmolLM2 gets the one server of its own in the suite. The model writes the call under a regular
expression (vLLM's structured outputs), so that what is tested is the parser, not a 135M model's will to call.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from rlstream.ops.toy import smollm2_model_dir
from rlstream.ops.up_config import UpOptions, task_vllm_args
from rlstream.ops.vllm import (PARSER_REQUIRED_TOKENS, VLLM_TOOL_CALL_PARSERS, ToolParserMismatch, VllmServer,
                               ensure_vllm_venv, resolve_tool_call_parser, server_env, start_vllm_server)
from tests.e2e.vllm_support import SERVED_MODEL, tiny_model_dir, vllm_fixture

vllm = vllm_fixture()

LOOKUP_TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "Look up the value of a key.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}
#: the call each parser reads, as the model writes it
WRITTEN_CALL = {"pythonic": '[lookup(key="b")]', "hermes": '<tool_call>{"name": "lookup", "arguments": {"key": "b"}}'
                '</tool_call>'}
#: vLLM refusals that are not about the tokenizer's tokens (not checked before start; see PARSER_REQUIRED_TOKENS):
#: the tokenizer config's response_template, an optional package
NOT_TOKEN_CHECKS = {"hf", "cohere_command3", "cohere_command4"}
#: what vLLM refuses at start (ParserManager.get_parser with the tokenizer, as its OpenAI server does)
PROBE = """
import json, sys
from vllm.parser.parser_manager import ParserManager
from vllm.tokenizers.registry import get_tokenizer
from vllm.tool_parsers import ToolParserManager
out = {"names": sorted(ToolParserManager.list_registered()), "refused": {}}
for model in sys.argv[1:]:
    tokenizer, refused = get_tokenizer(model), {}
    for name in out["names"]:
        try:
            ParserManager.get_parser(tool_parser_name=name, enable_auto_tools=True, model_name=model,
                                     tokenizer=tokenizer)
        except Exception as exc:
            refused[name] = f"{type(exc).__name__}: {exc}"
    out["refused"][model] = refused
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct as ``up --model smollm2`` runs it (the packaged GGUF, converted; no download)."""
    return smollm2_model_dir(tmp_path_factory.mktemp("models") / "smollm2")


@pytest.fixture(scope="module")
def smollm2_vllm(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """SmolLM2 on vLLM as ``up --model smollm2`` starts it: its parser option and the task's vLLM options."""
    opts = UpOptions(model="smollm2")
    run_dir = tmp_path_factory.mktemp("smollm2-run")
    server = start_vllm_server(smollm2_dir, SERVED_MODEL, workdir=run_dir / "vllm", timeout_s=900,
                               extra_args=task_vllm_args(opts, run_dir), tool_call_parser=opts.tool_call_parser)
    try:
        yield server
    finally:
        server.stop()


def _chat(server: VllmServer, written: str, tool_choice: str) -> dict[str, Any]:
    """One chat completion whose text is ``written`` (a regular expression of it), with the lookup tool."""
    import re

    body = {"model": server.model, "messages": [{"role": "user", "content": "What is the value of b?"}],
            "tools": [LOOKUP_TOOL], "tool_choice": tool_choice, "temperature": 0, "max_tokens": 48,
            "structured_outputs": {"regex": re.escape(written)}}
    response = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    message: dict[str, Any] = response.json()["choices"][0]["message"]
    return message


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_each_up_model_serves_tool_calls_with_the_parser_up_resolves(model: str, request: pytest.FixtureRequest,
                                                                     tmp_path: Path) -> None:
    opts = UpOptions(model=model)
    server: VllmServer = request.getfixturevalue("vllm" if model == "tiny" else "smollm2_vllm")
    parser = resolve_tool_call_parser(Path(server.model_dir), opts.tool_call_parser, task_vllm_args(opts, tmp_path))
    assert parser == "pythonic"  # the tiny model's template writes no JSON; SmolLM2 lacks llama3_json's token
    if not server.external:
        assert f"--tool-call-parser {parser}" in " ".join(_server_args(server))
    message = _chat(server, WRITTEN_CALL[parser], "auto")
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "lookup" and json.loads(call["function"]["arguments"]) == {"key": "b"}
    assert not message.get("content")
    # control: the same text without automatic tool choice stays text; the parser made it a call
    plain = _chat(server, WRITTEN_CALL[parser], "none")
    assert not plain.get("tool_calls") and plain["content"] == WRITTEN_CALL[parser]


def _server_args(server: VllmServer) -> list[str]:
    """The command line the server runs with."""
    import psutil

    return list(psutil.Process(server.pid).cmdline())


def test_the_parser_check_refuses_what_vllm_refuses_at_start(smollm2_dir: Path,
                                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    """For every parser vLLM has, on the tiny model's and SmolLM2's tokenizers: rlstream's check before start
    refuses a parser exactly where vLLM's own start refuses it (vLLM run without a server: seconds)."""
    tiny = tiny_model_dir(tmp_path_factory)
    python = ensure_vllm_venv()
    probe = subprocess.run([str(python), "-c", PROBE, str(tiny), str(smollm2_dir)], capture_output=True, text=True,
                           timeout=300, env=server_env(tmp_path_factory.mktemp("probe-cache")))
    assert probe.returncode == 0, probe.stderr[-3000:]
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    assert set(found["names"]) == VLLM_TOOL_CALL_PARSERS
    assert set(PARSER_REQUIRED_TOKENS) <= VLLM_TOOL_CALL_PARSERS
    for model in (tiny, smollm2_dir):
        vllm_refuses = found["refused"][str(model)]
        assert {"llama3_json", "mistral"} <= set(vllm_refuses)  # the probe finds refusals (neither has the tokens)
        for name in sorted(VLLM_TOOL_CALL_PARSERS):
            if name in NOT_TOKEN_CHECKS:
                continue
            try:
                resolve_tool_call_parser(model, name, [])
                refused = None
            except ToolParserMismatch as exc:
                refused = str(exc)
            assert (refused is not None) == (name in vllm_refuses), (model.name, name, refused, vllm_refuses.get(name))
