"""One log pipeline: in JSON mode every line a process writes is a JSON object with "event" and "level", whether
it comes from structlog or from a library logging through `logging` (aiokafka, asyncio, urllib3, transformers
with its own handler, Faust's worker set-up, warnings, an uncaught exception); in console mode foreign lines are
rendered like rlstream's own."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;]*m")

SCRIPT = r"""
import logging, sys, warnings
mode = sys.argv[1]
if mode != "none":
    from rlstream.transport.log import configure_logging, logging_dict_config
    configure_logging(mode, "INFO")
else:  # negative control: plain logging, as a library would set it up
    logging.basicConfig(level="INFO")
from rlstream.transport.log import get_logger
logging.getLogger("aiokafka").warning("Unable to connect to node %s", "127.0.0.1:1")
logging.getLogger("asyncio").error("Task exception was never retrieved")
logging.getLogger("urllib3.connectionpool").warning("Retrying after connection broken")
get_logger("rlstream.test").info("structlog event", answer=42)
# transformers adds its own StreamHandler to its top logger and stops propagation on first use
lib = logging.getLogger("transformers")
lib.addHandler(logging.StreamHandler())
lib.propagate = False
logging.getLogger("transformers.modeling_utils").warning("Some weights were not initialized")
warnings.warn("a deprecation of some library")
try:
    raise ValueError("bad value")
except ValueError:
    logging.getLogger("faust.worker").exception("crashed")
if mode != "none":
    import mode.utils.logging as mode_logging  # what faust.Worker does at start: replace the root handlers
    mode_logging.setup_logging(loglevel="INFO", logging_config=logging_dict_config("INFO"))
logging.getLogger("mode.services").info("after the worker set up logging")
get_logger("rlstream.test").warning("structlog after the worker", k=1)
raise RuntimeError("uncaught at the top")
"""


def run(mode: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLSTREAM_")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1, proc.stderr  # the uncaught exception
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]


def parses(line: str) -> dict | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def test_json_mode_every_line_is_a_json_event() -> None:
    lines = run("json")
    events = [parses(line) for line in lines]
    assert all(e is not None for e in events), [line for line, e in zip(lines, events) if e is None]
    assert all("event" in e and "level" in e and "timestamp" in e for e in events)  # type: ignore[operator]
    by_logger = {e["logger"]: e for e in events}  # type: ignore[index]
    assert by_logger["aiokafka"]["event"] == "Unable to connect to node 127.0.0.1:1"
    assert by_logger["aiokafka"]["level"] == "warning" and by_logger["asyncio"]["level"] == "error"
    assert by_logger["transformers.modeling_utils"]["level"] == "warning"
    assert "ValueError: bad value" in by_logger["faust.worker"]["exception"]
    assert by_logger["mode.services"]["event"] == "after the worker set up logging"
    assert by_logger["py.warnings"]["level"] == "warning"
    assert "RuntimeError: uncaught at the top" in by_logger["rlstream"]["exception"]
    structlog_events = [e for e in events if e["logger"] == "rlstream.test"]  # type: ignore[index]
    assert [e["event"] for e in structlog_events] == ["structlog event", "structlog after the worker"]
    assert structlog_events[0]["answer"] == 42
    assert by_logger["urllib3.connectionpool"]["level"] == "warning"


def test_negative_control_plain_logging_is_not_json() -> None:
    lines = run("none")
    assert any(parses(line) is None for line in lines)
    assert any("Unable to connect to node" in line and parses(line) is None for line in lines)


def test_console_mode_renders_foreign_lines_like_our_own() -> None:
    lines = [ANSI.sub("", line) for line in run("console")]
    foreign = next(line for line in lines if "Unable to connect to node 127.0.0.1:1" in line)
    own = next(line for line in lines if "structlog event" in line)
    shape = re.compile(r"^\d{4}-\d\d-\d\dT[\d:.]+Z \[(\w+)\s*\] (.+?)\s+\[([\w.]+)\]")
    assert shape.match(foreign).groups() == ("warning", "Unable to connect to node 127.0.0.1:1", "aiokafka")
    assert shape.match(own).groups() == ("info", "structlog event", "rlstream.test")
    assert all(parses(line) is None for line in lines)
    assert not any(line.startswith("WARNING:aiokafka") for line in lines)  # not the plain logging format
    assert not any(line.startswith("[transformers]") for line in lines)    # not transformers' own handler
