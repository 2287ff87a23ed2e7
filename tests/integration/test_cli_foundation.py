"""`rlstream infra up|status|down` and `rlstream topics` as real processes."""
from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from rlstream.ops.processes import pid_alive, stop_pid

ROOT = Path(__file__).resolve().parents[2]


def rlstream(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLSTREAM_")}
    env["COLUMNS"] = "200"
    return subprocess.run([sys.executable, "-m", "rlstream.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def processes_mentioning(text: str) -> list[int]:
    """PIDs of live processes whose command line contains ``text`` (e.g. a data directory)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if text in (proc / "cmdline").read_bytes().decode(errors="replace") and pid_alive(int(proc.name)):
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


async def kafka_round_trip(bootstrap: str, topic: str) -> bytes:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(topic, b"hello")
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                group_id=f"g-{uuid.uuid4().hex[:6]}")
    await consumer.start()
    try:
        record = await asyncio.wait_for(consumer.getone(), timeout=20)
    finally:
        await consumer.stop()
    return record.value


def test_infra_up_status_down(tmp_path: Path) -> None:
    state_dir = tmp_path / "infra"
    up = rlstream("infra", "up", "--state-dir", str(state_dir))
    state_file = state_dir / "infra.json"
    pids: list[int] = []
    try:
        assert up.returncode == 0, up.stderr
        if state_file.exists():
            state = json.loads(state_file.read_text())
            pids = [state["kafka"]["pid"], state["redis"]["pid"]]
        bootstrap = re.search(r"^RLSTREAM_KAFKA_BOOTSTRAP=(\S+)$", up.stdout, re.M).group(1)
        redis_url = re.search(r"^RLSTREAM_REDIS_URL=(\S+)$", up.stdout, re.M).group(1)
        assert all(pid_alive(p) for p in pids) and len(pids) == 2

        # aiokafka can use the printed broker address
        assert asyncio.run(kafka_round_trip(bootstrap, f"t{uuid.uuid4().hex[:8]}")) == b"hello"
        # redis-cli can use the printed Redis URL
        cli = subprocess.run([shutil.which("redis-cli") or "redis-cli", "-u", redis_url, "PING"],
                             capture_output=True, text=True, timeout=10)
        assert cli.stdout.strip() == "PONG", cli.stderr

        status = rlstream("infra", "status", "--state-dir", str(state_dir))
        assert status.returncode == 0, status.stderr
        rows = {line.split()[1]: line for line in status.stdout.splitlines() if line.split()[1:2] in (["kafka"], ["redis"])}
        assert bootstrap in rows["kafka"] and "True" in rows["kafka"], status.stdout
        assert redis_url in rows["redis"] and "True" in rows["redis"], status.stdout

        # a second `up` refuses and points at what runs
        again = rlstream("infra", "up", "--state-dir", str(state_dir))
        assert again.returncode == 1 and bootstrap in again.stdout

        # topics create/list against the printed address
        created = rlstream("topics", "create", "-o", "kafka.bootstrap_servers", bootstrap,
                           "-o", "topics.prefix", "cli.", "-o", "topics.partitions", "2")
        assert created.returncode == 0, created.stderr
        listed = rlstream("topics", "list", "-o", "kafka.bootstrap_servers", bootstrap)
        assert listed.returncode == 0, listed.stderr
        assert re.search(r"cli\.trajectories\s+\S*\s*2", listed.stdout), listed.stdout

        down = rlstream("infra", "down", "--state-dir", str(state_dir))
        assert down.returncode == 0, down.stderr
        assert not any(pid_alive(p) for p in pids), "a service outlived `infra down`"
        assert processes_mentioning(str(state_dir)) == [], "a child process outlived `infra down`"
        assert not state_file.exists()
        after = rlstream("infra", "status", "--state-dir", str(state_dir))
        assert after.returncode == 1 and "not running" in after.stdout
    finally:
        for pid in pids:  # never leave a broker behind, even when an assertion failed
            if pid_alive(pid):
                stop_pid(pid, timeout_s=5)


# --- global options (no services needed) -------------------------------------------------------------------
def test_version_prints_the_installed_distribution_version() -> None:
    from importlib.metadata import version

    out = rlstream("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"rlstream {version('rlstream')}\n"


def test_log_format_outside_its_choices_is_a_usage_error() -> None:
    out = rlstream("--log-format", "xml", "config", "validate")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "'xml' is not one of 'auto', 'json', 'console'" in out.stderr
    assert "ok" not in out.stdout  # the command never ran


def test_log_level_is_accepted_in_any_case_and_validated() -> None:
    for level in ("DEBUG", "warning", "Error"):
        ok = rlstream("--log-level", level, "--log-format", "json", "config", "validate")
        assert ok.returncode == 0 and ok.stdout.strip() == "ok", (level, ok.stderr)
    bad = rlstream("--log-level", "LOUD", "config", "validate")
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert "'LOUD' is not one of 'debug', 'info', 'warning', 'error'" in bad.stderr


def test_models_tiny_writes_a_model_transformers_loads_under_the_id_a_nat_config_names(tmp_path: Path) -> None:
    """``rlstream models tiny DIR``: a local stand-in for a model id (no download), with a tool-calling chat
    template, that transformers loads as it is."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from typer.testing import CliRunner

    from rlstream.cli.app import app

    target = tmp_path / "Qwen" / "Qwen2.5-3B-Instruct"
    result = CliRunner().invoke(app, ["models", "tiny", str(target)])
    assert result.exit_code == 0, result.output
    assert str(target.resolve()) in result.output.replace("\n", "")
    model = AutoModelForCausalLM.from_pretrained(target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    assert model.config.num_hidden_layers == 2 and model.config.model_type == "qwen2"
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "", "tool_calls": [call]},
                                            {"role": "tool", "content": "42", "tool_call_id": "c1"}], tokenize=False)
    assert '<tool_call>lookup {"q": "x"}</tool_call>' in prompt and "<|im_start|>tool\n42" in prompt
    second = CliRunner().invoke(app, ["models", "tiny", str(tmp_path / "other"), "--seed", "1"])
    assert second.exit_code == 0, second.output
    other = AutoModelForCausalLM.from_pretrained(tmp_path / "other")
    assert any(not a.equal(b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
