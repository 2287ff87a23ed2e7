"""``rlstream up --dry-run``: one resolved config file per process, the process plan, nothing started; the tool-call
parser checked against the model's tokenizer before anything starts (dry run and real run)."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import psutil
import yaml
import pytest
from typer.testing import CliRunner

from rlstream.cli.app import app
from rlstream.ops.ports import port_open
from rlstream.ops.up import dry_run_up, run_up
from rlstream.ops.up_config import UpOptions, toy_model_tokenizer
from rlstream.ops.vllm import ToolParserMismatch, resolve_tool_call_parser, tool_call_parser_for
from rlstream.schemas.config import load_config

pytestmark = pytest.mark.unit


def model_dir(path: Path, model_type: str, tokens: list[str]) -> Path:
    """A model directory with a config.json and a tokenizer.json holding ``tokens`` (no weights: nothing loads them)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    (path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {t: i for i, t in enumerate(tokens)}},
                                                     "added_tokens": []}))
    return path


@pytest.fixture(scope="module")
def smollm2_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct's own tokens (read from the packaged GGUF) in a llama-family model directory."""
    smollm2 = toy_model_tokenizer("smollm2")
    assert len(smollm2.tokens) == 49152 and "<|im_start|>" in smollm2.tokens and smollm2.model_type == "llama"
    return model_dir(tmp_path_factory.mktemp("smollm2") / "model", "llama", sorted(smollm2.tokens))


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_dry_run_writes_one_config_per_process_and_starts_nothing(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    model = model_dir(tmp_path / "model", "qwen2", ["<|im_start|>", "a"])
    before, started = _children(), time.monotonic()
    plan = dry_run_up(UpOptions(model=str(model), task="tool-agent", traffic="production",
                                runs_dir=tmp_path / "runs", users=12))
    assert time.monotonic() - started < 30
    assert _children() - before == set()  # no broker, Redis, vLLM or service
    names = [p.name for p in plan]
    assert {"vllm", "streams", "learner", "inference-sync", "gate", "gateway", "users", "console"} <= set(names)
    assert "rollout" not in names  # production traffic: the users go through the gateway
    assert len(set(names)) == len(names)
    run_dir = plan[0].config_file.parent.parent
    assert sorted(p.config_file.name for p in plan) == sorted(f.name for f in (run_dir / "config").iterdir())
    for process in plan:
        assert process.config_file.is_file()
        if process.name.startswith("vllm"):
            continue
        assert process.argv[-2:] == ("-c", str(process.config_file))  # the file is what the process runs with
        assert "-o" not in process.argv
        cfg = load_config(process.config_file)
        assert cfg.inference.api_key is None and cfg.rollout.api_key is None  # secrets go through the environment
        assert not port_open("127.0.0.1", int(cfg.kafka.bootstrap_servers.rsplit(":", 1)[1]))
    gate = load_config(run_dir / "config" / "gate.yaml")
    assert str(gate.gate.dataset) == str(run_dir / "heldout.jsonl") and gate.gate.samples == 2
    gateway = load_config(run_dir / "config" / "gateway.yaml")
    assert gateway.gateway.session_idle_s == 30 and not gateway.gateway.serve_unpromoted  # gated: promoted only
    assert load_config(run_dir / "config" / "learner.yaml").gateway.session_idle_s != 30  # only the gateway's
    console = plan[names.index("console")]  # the read-only web page, on loopback, of this run
    assert console.argv[console.argv.index("console") + 1:-2] == ("--port", console.argv[-3])
    assert load_config(console.config_file).run_id == gate.run_id
    users = plan[names.index("users")].argv
    assert users[users.index("--concurrency") + 1] == "12"  # --users reaches the simulated users
    gateway_port = int(plan[names.index("gateway")].argv[plan[names.index("gateway")].argv.index("--port") + 1])
    assert not port_open("127.0.0.1", gateway_port)
    every_file = "".join(p.config_file.read_text() for p in plan)
    assert not re.search(r"vllm-[A-Za-z0-9_-]{20,}", every_file)  # vLLM's key is in no file
    out = capsys.readouterr().out
    assert "nothing started" in out and all(f"config:  {p.config_file}" in out for p in plan)


def test_dry_run_of_synthetic_traffic_without_gate_plans_the_rollout_runner(tmp_path: Path) -> None:
    model = model_dir(tmp_path / "model", "qwen2", ["a"])
    plan = dry_run_up(UpOptions(model=str(model), gate=False, runs_dir=tmp_path / "runs"))
    names = {p.name for p in plan}
    assert "rollout" in names and not names & {"gate", "gateway", "users", "vllm-eval"}
    sync = load_config(next(p.config_file for p in plan if p.name == "inference-sync"))
    assert sync.inference.full_weights_follow == "newest"  # ungated: every version serves


def test_parser_check_refuses_llama3_json_for_smollm2(smollm2_tokenizer: Path) -> None:
    with pytest.raises(ToolParserMismatch) as refused:
        resolve_tool_call_parser(smollm2_tokenizer, "llama3_json", [])
    message = str(refused.value)
    assert "'llama3_json'" in message and "<|python_tag|>" in message and "--tool-call-parser" in message
    with pytest.raises(ToolParserMismatch):  # given as a vLLM option too
        resolve_tool_call_parser(smollm2_tokenizer, "auto", ["--tool-call-parser", "llama3_json"])
    # control: a parser that needs no token SmolLM2 lacks passes; so does llama3_json where the token exists
    assert resolve_tool_call_parser(smollm2_tokenizer, "hermes", []) == "hermes"
    assert resolve_tool_call_parser(smollm2_tokenizer, "none", []) is None


def test_parser_check_passes_llama3_json_where_the_tokenizer_has_its_token(tmp_path: Path) -> None:
    llama3 = model_dir(tmp_path / "llama3", "llama", ["<|python_tag|>", "a"])
    assert resolve_tool_call_parser(llama3, "llama3_json", []) == "llama3_json"
    assert tool_call_parser_for(llama3) == "llama3_json"


def test_auto_gives_smollm2_a_parser_vllm_starts_with(smollm2_tokenizer: Path) -> None:
    parser = tool_call_parser_for(smollm2_tokenizer)
    assert parser != "llama3_json"
    assert resolve_tool_call_parser(smollm2_tokenizer, "auto", []) == parser


def test_cli_dry_run_answers_a_wrong_parser_in_one_line(smollm2_tokenizer: Path, tmp_path: Path) -> None:
    """A parser the model's tokenizer cannot serve is a usage error: one stderr line (not wrapped, however long),
    exit code 2, naming the parser and --tool-call-parser."""
    result = CliRunner().invoke(app, ["--log-format", "json", "up", "--dry-run", "--model", str(smollm2_tokenizer),
                                      "--tool-call-parser", "llama3_json", "--runs-dir", str(tmp_path / "runs")],
                                env={"COLUMNS": "80"})
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("{")]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "'llama3_json'" in lines[0] and "choose another parser with --tool-call-parser" in lines[0]
    assert "Traceback" not in result.output
    ok = CliRunner().invoke(app, ["up", "--dry-run", "--model", str(smollm2_tokenizer), "--runs-dir",
                                  str(tmp_path / "runs")])
    assert ok.exit_code == 0, ok.output
    assert "--tool-call-parser pythonic" in ok.output


def test_real_up_refuses_the_parser_before_starting_anything(smollm2_tokenizer: Path, tmp_path: Path) -> None:
    before = _children()
    with pytest.raises(ToolParserMismatch):
        run_up(UpOptions(model=str(smollm2_tokenizer), tool_call_parser="llama3_json", runs_dir=tmp_path / "runs"))
    assert _children() - before == set()
    assert not list((tmp_path / "runs").glob("*/infra"))  # no broker or Redis was started


def test_a_parser_name_vllm_lacks_is_refused_unless_a_plugin_may_register_it(tmp_path: Path) -> None:
    model = model_dir(tmp_path / "model", "qwen2", ["a"])
    with pytest.raises(ToolParserMismatch) as refused:
        resolve_tool_call_parser(model, "hermess", [])
    assert "'hermess'" in str(refused.value) and "--tool-call-parser" in str(refused.value)
    assert resolve_tool_call_parser(model, "hermess", ["--tool-parser-plugin", "my_parsers.py"]) == "hermess"
    assert resolve_tool_call_parser(model, "auto", ["--tool-call-parser=pythonic"]) == "pythonic"


@pytest.mark.parametrize("parser,tokens,refused", [
    ("mistral", ["a"], True), ("mistral", ["[TOOL_CALLS]"], False),
    ("hy_v3", ["<tool_calls>"], True),  # the end delimiter too
    ("hy_v4", ["<tool_calls:6124c78e>", "</tool_calls:6124c78e>"], False),  # a checkpoint's token suffix
    ("jamba", ["<tool_calls>", "</tool_calls>"], False),
    ("lfm2", ["<|tool_call_start|>"], True),
])
def test_each_parser_is_checked_for_the_tokens_vllm_looks_up(tmp_path: Path, parser: str, tokens: list[str],
                                                            refused: bool) -> None:
    model = model_dir(tmp_path / "model", "qwen2", tokens)
    if refused:
        with pytest.raises(ToolParserMismatch, match=repr(parser)):
            resolve_tool_call_parser(model, parser, [])
    else:
        assert resolve_tool_call_parser(model, parser, []) == parser


def test_dry_run_of_a_toy_model_checks_its_tokenizer_without_building_it(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    plan = dry_run_up(UpOptions(model="smollm2", runs_dir=tmp_path / "runs"))
    assert not (tmp_path / "runs" / "models").exists()  # built by the first real run, not by the dry run
    vllm = yaml.safe_load(next(p.config_file for p in plan if p.name == "vllm").read_text())
    assert vllm["model"] == str((tmp_path / "runs" / "models" / "smollm2").resolve())
    assert vllm["tool_call_parser"] == "pythonic"  # SmolLM2 has no <|python_tag|>
    assert ".gguf" in capsys.readouterr().out  # checked against the packaged GGUF's tokenizer
    with pytest.raises(ToolParserMismatch, match="<|python_tag|>"):
        dry_run_up(UpOptions(model="smollm2", tool_call_parser="llama3_json", runs_dir=tmp_path / "runs"))


def test_the_tool_agent_task_runs_on_smollm2_unless_another_model_is_named(tmp_path: Path) -> None:
    runs = ["--runs-dir", str(tmp_path / "runs")]
    result = CliRunner().invoke(app, ["up", "--dry-run", "--task", "tool-agent", *runs])
    assert result.exit_code == 0, result.output
    assert f"{tmp_path / 'runs' / 'models' / 'smollm2'}" in result.output
    assert "--tool-call-parser hermes" in result.output  # the task's chat template writes <tool_call>{json}
    refused = CliRunner().invoke(app, ["up", "--dry-run", "--task", "tool-agent", "--model", "tiny", *runs])
    assert refused.exit_code == 2 and "pretrained instruct model" in refused.output  # a usage error
