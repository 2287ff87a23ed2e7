"""Every mistake on the command line is answered with one line naming what is wrong and what to do, exit code 2 for
a usage error and 1 for a failure, never a traceback; ``--debug`` shows the traceback instead."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlstream.cli.app import app
from rlstream.cli.common import UsageProblem, explain, plain_type, require_writable_dir
from rlstream.ops.replay import Position, ReplayError, check_range

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
#: nothing listens there: a command that reached for Redis or Kafka would fail with another answer
CLOSED = ["-o", "redis.url", "redis://127.0.0.1:9/0", "-o", "kafka.bootstrap_servers", "127.0.0.1:9"]
#: a location no process may create anything in (a read-only mount has the same answer: the write probe fails)
UNWRITABLE = Path("/proc/rlstream-cli-test")


def _is_log_record(line: str) -> bool:
    try:
        return "event" in json.loads(line)
    except ValueError:
        return False


def answer(args: list[str], env: dict[str, str] | None = None) -> tuple[int, list[str], str]:
    """Exit code, the lines on stderr that are not log records, and all the output."""
    result = CliRunner().invoke(app, ["--log-format", "json", *args], env={"COLUMNS": "200", **(env or {})})
    lines = [line for line in result.stderr.splitlines() if line.strip() and not _is_log_record(line)]
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result.exit_code, lines, result.output


def assert_one_line(args: list[str], code: int, *phrases: str, env: dict[str, str] | None = None) -> str:
    exit_code, lines, output = answer(args, env)
    assert exit_code == code, output
    assert len(lines) == 1, output
    assert "Traceback" not in output
    for phrase in phrases:
        assert phrase in lines[0], lines[0]
    return lines[0]


def test_a_learner_model_that_does_not_exist_is_answered_before_the_lease(tmp_path: Path) -> None:
    """No Redis or Kafka at the configured addresses: the answer is about the model, so nothing was reached for."""
    started = time.monotonic()
    assert_one_line(["learner", "run", "-o", "learner.model", "/nonexistent/model", *CLOSED,
                     "-o", "learner.output_dir", str(tmp_path)], 2,
                    "model directory /nonexistent/model does not exist", "never downloaded", "rlstream models tiny")
    assert time.monotonic() - started < 60


def test_a_model_directory_needs_a_config_json(tmp_path: Path) -> None:
    from rlstream.learner.policy import ModelDirectoryError, require_model_dir

    with pytest.raises(ModelDirectoryError, match="has no config.json"):
        require_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert require_model_dir(tmp_path) == tmp_path


def test_an_unknown_kafka_host_is_one_line_naming_it() -> None:
    line = assert_one_line(["topics", "create"], 1, "cannot reach Kafka at kafak:9092", "RLSTREAM_KAFKA_BOOTSTRAP",
                           env={"RLSTREAM_KAFKA_BOOTSTRAP": "kafak:9092"})
    assert line.startswith("error: ")


def test_models_tiny_into_a_file_is_refused_before_building(tmp_path: Path) -> None:
    afile = tmp_path / "afile.txt"
    afile.write_text("x")
    started = time.monotonic()
    assert_one_line(["models", "tiny", str(afile)], 2, f"{afile} is a file, not a directory")
    assert_one_line(["models", "tiny", str(afile / "sub")], 2, "Not a directory")
    assert time.monotonic() - started < 30  # nothing was built
    assert afile.read_text() == "x"


def test_a_reward_function_that_cannot_be_imported_is_a_usage_error() -> None:
    assert_one_line(["rollout", "shadow", "--reward", "nosuch.module:fn", *CLOSED], 2,
                    "cannot import module 'nosuch.module'")


def test_infra_state_dir_under_a_file_or_unwritable_is_refused(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    assert_one_line(["infra", "up", "--state-dir", str(afile / "state")], 2, "--state-dir", "Not a directory")
    assert_one_line(["infra", "up", "--state-dir", str(UNWRITABLE)], 2, "--state-dir", f"cannot write {UNWRITABLE}")
    assert not (afile.parent / "state").exists()


def test_export_to_an_unwritable_place_names_the_file_not_kafka() -> None:
    line = assert_one_line(["export", "--out", str(UNWRITABLE / "x.parquet"), *CLOSED], 2, "--out", "cannot write")
    assert "Kafka" not in line


def test_up_with_an_invalid_config_is_one_line_before_anything_starts(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("learner:\n  nosuch: 1\n  lr: abc\n")
    line = assert_one_line(["up", "--dry-run", "-c", str(bad), "--runs-dir", str(tmp_path / "runs")], 2,
                           "invalid configuration (2 problems)", "learner.nosuch", "learner.lr")
    assert line.startswith("error: ")
    assert not (tmp_path / "runs").exists()


def test_console_on_an_address_it_cannot_listen_on_is_one_line() -> None:
    """A port in use or a host that is not this machine's: one line naming the address and --port / --host, before
    the page's address is printed; control: the same port binds once it is free."""
    import socket

    from rlstream.ops.console.app import listening_socket

    blocker = socket.create_server(("127.0.0.1", 0))
    port = blocker.getsockname()[1]
    try:
        exit_code, lines, output = answer(["console", "--port", str(port), *CLOSED])
        assert exit_code == 2 and len(lines) == 1, output
        assert lines[0].startswith(f"error: cannot listen on 127.0.0.1:{port}") and "--port" in lines[0]
        assert "console http" not in output and "Traceback" not in output
    finally:
        blocker.close()
    listening_socket("127.0.0.1", port).close()
    assert_one_line(["console", "--host", "nosuch.invalid", "--api-key", "k" * 32, *CLOSED], 2,
                    "cannot listen on nosuch.invalid:8790", "--host")


def test_an_empty_export_range_is_a_usage_error_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "x.parquet"
    assert_one_line(["export", "--out", str(out), "--from", "5", "--to", "2", *CLOSED], 2,
                    "--from 5 is not before --to 2")
    assert not out.exists()
    assert_one_line(["replay", "--run-id", "r", "--from", "0:7", "--to", "0:3", *CLOSED], 2,
                    "--from 7 is not before --to 3 on partition 0")


def test_check_range_refuses_only_ranges_that_must_be_empty() -> None:
    for first, last in [(Position(offset=5), Position(offset=2)), (Position(offset=2), Position(offset=2)),
                        (Position(per_partition={0: 4, 1: 1}), Position(offset=3)),
                        (Position(timestamp_ms=10), Position(timestamp_ms=5))]:
        with pytest.raises(ReplayError, match="not before"):
            check_range(first, last)
    for first, last in [(Position(offset=2), Position(offset=5)), (None, Position(offset=0)),
                        (Position(per_partition={0: 1}), Position(per_partition={0: 2, 1: 0})),
                        (Position(offset=9), Position(timestamp_ms=5))]:
        check_range(first, last)


def test_mlflow_without_its_environment_is_refused_at_start(monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path) -> None:
    """MLflow's default store (no MLFLOW_TRACKING_URI) is a database; without its packages the learner says so before
    it loads anything; a tracking server URI is accepted (negative control)."""
    from rlstream.learner.reporting import mlflow_store_problems

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    database_ready = find_spec("alembic") is not None and find_spec("sqlalchemy") is not None
    args = ["learner", "run", "-o", "learner.report_to", "[mlflow]", "-o", "learner.model", "/nonexistent/model",
            *CLOSED, "-o", "learner.output_dir", str(tmp_path)]
    if database_ready:
        assert mlflow_store_problems() == []
    else:
        started = time.monotonic()
        assert_one_line(args, 1, "MLFLOW_TRACKING_URI is not set", "alembic")
        assert time.monotonic() - started < 60
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    assert mlflow_store_problems() == []


def test_a_path_error_names_the_path_and_never_kafka() -> None:
    answer_ = explain(OSError(errno.EROFS, os.strerror(errno.EROFS), "/data/x.parquet"))
    assert answer_.exit_code == 1
    assert answer_.message.startswith("cannot write /data/x.parquet: Read-only file system")
    assert "Kafka" not in answer_.message


def test_an_unexpected_error_is_one_line_with_the_debug_hint() -> None:
    answer_ = explain(RuntimeError("boom\nsecond line"))
    assert answer_ == type(answer_)("RuntimeError: boom second line (rerun with --debug for the traceback)", 1)
    assert explain(UsageProblem("bad value")).exit_code == 2


def test_require_writable_dir_creates_and_checks(tmp_path: Path) -> None:
    assert require_writable_dir(tmp_path / "a" / "b", "--dir").is_dir()
    with pytest.raises(UsageProblem, match="cannot write"):
        require_writable_dir(UNWRITABLE, "--dir")


def _script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rlstream.cli", "--log-format", "json", *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={k: v for k, v in os.environ.items() if k != "RLSTREAM_DEBUG"})


def test_the_script_answers_in_one_line_and_debug_shows_the_traceback() -> None:
    """The installed entry point (not only the test runner) answers in one line; with --debug (negative control) the
    same mistake ends in the traceback."""
    plain = _script("rollout", "shadow", "--reward", "nosuch.module:fn", *CLOSED)
    lines = [line for line in plain.stderr.splitlines() if line.strip() and not _is_log_record(line)]
    assert plain.returncode == 2, plain.stderr
    assert lines == ["error: cannot import module 'nosuch.module' of 'nosuch.module:fn': No module named 'nosuch'"]
    assert "Traceback" not in plain.stderr
    debug = _script("--debug", "rollout", "shadow", "--reward", "nosuch.module:fn", *CLOSED)
    assert debug.returncode == 1
    assert "Traceback" in debug.stderr and "UserCodeError" in debug.stderr


# --- help text --------------------------------------------------------------------------------------------------------
def _all_help() -> dict[str, str]:
    from typer.main import get_command

    def walk(command, path):  # type: ignore[no-untyped-def]
        yield path
        for name, sub in sorted(getattr(command, "commands", {}).items()):
            yield from walk(sub, [*path, name])

    runner = CliRunner()
    return {" ".join(path) or "rlstream": runner.invoke(app, [*path, "--help"], env={"COLUMNS": "250"}).output
            for path in walk(get_command(app), [])}


TYPE_PLACEHOLDER = r"<(?:bool|str|int|float|path|file|text|list\[[^>]*\]|[a-z]+ range)>"


def test_help_has_no_type_placeholders_or_raw_markup() -> None:
    import re

    helps = _all_help()
    assert len(helps) > 30
    for path, text in helps.items():
        assert not re.search(TYPE_PLACEHOLDER, text), (path, re.findall(TYPE_PLACEHOLDER, text))
        assert "``" not in text and "[/" not in text and "[red]" not in text, path


def test_plain_type_labels() -> None:
    """The labels typer would print become plain words (the negative control of the scan above)."""
    assert [plain_type(x) for x in ["<bool>", "<list[str]>", "<int range>", "<a|b>", "<path>"]] == [
        "", "TEXT", "INTEGER", "[a|b]", "PATH"]


def test_one_spelling_per_option() -> None:
    """Options that differ only by dashes or underscores (``--loglevel`` and ``--log-level``) are one option spelt
    one way everywhere; a single option may take NAT's name as an alias (``finetune --config_file/--config-file``)."""
    from typer.main import get_command

    spellings: dict[str, set[frozenset[str]]] = {}

    def walk(command) -> None:  # type: ignore[no-untyped-def]
        for param in command.params:
            names = frozenset(opt for opt in [*param.opts, *param.secondary_opts] if opt.startswith("--"))
            for opt in names:
                spellings.setdefault(opt.replace("-", "").replace("_", ""), set()).add(
                    frozenset(n for n in names if n.replace("-", "").replace("_", "") == opt.replace("-", "")
                              .replace("_", "")))
        for sub in getattr(command, "commands", {}).values():
            walk(sub)

    walk(get_command(app))
    assert spellings["loglevel"] == {frozenset({"--log-level"})}
    twins = {key: names for key, names in spellings.items() if len(names) > 1}
    assert not twins, twins
