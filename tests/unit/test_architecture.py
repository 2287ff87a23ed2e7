"""The import layers of pyproject.toml hold, and the check has teeth (negative controls on a copy)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=120)


def copy_tree(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "rlstream", tmp_path / "rlstream", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_layer_contracts_are_kept() -> None:
    proc = lint(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "BROKEN" not in proc.stdout and proc.stdout.count("KEPT") >= 3


@pytest.mark.parametrize(
    ("module", "statement", "contract"),
    [
        ("transport/log.py", "import rlstream.cli.app", "layers"),            # a lower layer importing the top
        ("learner/batch.py", "import rlstream.rollout.runner", "layers"),     # one service importing another
        ("ops/tail.py", "import faust", "Faust only in streams"),             # Faust outside streams/
        ("rollout/capture.py", "import torch", "light SDK"),       # torch in the capture SDK
        ("nat/trainer.py", "import rlstream.finetune.runtime", "nat builds on"),  # nat past finetune's public API
        ("gateway/service.py", "import typer", "typer only in the CLI"),   # a service parsing arguments
        ("gateway/core.py", "import rlstream.learner.batch", "the gateway builds on"),  # the gateway on a service
        ("rollout/capture.py", "import rlstream.gateway.core", "layers"),  # the SDK importing the gateway above it
        ("ops/processes.py", "import rlstream.ops.infra", "process handling stands alone"),  # a cycle back up
    ],
)
def test_a_forbidden_import_breaks_a_contract(tmp_path: Path, module: str, statement: str, contract: str) -> None:
    tree = copy_tree(tmp_path)
    target = tree / "rlstream" / module
    target.write_text(target.read_text() + f"\n{statement}  # planted by the negative control\n")
    proc = lint(tree)
    assert proc.returncode != 0
    broken = [line for line in proc.stdout.splitlines() if line.endswith("BROKEN")]
    assert any(line.startswith(contract) for line in broken), proc.stdout


def bench_imports_of_tests(tree: Path) -> list[str]:
    """Imports of the test suite (``tests``) in the benchmarks under ``tree/bench``: benchmarks use only rlstream and
    their own modules (the tests may import bench, not the reverse)."""
    import ast

    found = []
    for path in sorted((tree / "bench").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(tree)}: {name}" for name in names if name.split(".")[0] == "tests"]
    return found



def test_bench_imports_no_test_helpers(tmp_path: Path) -> None:
    assert bench_imports_of_tests(ROOT) == []
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "planted.py").write_text("def f():\n    from tests.support.factories import make_trajectory\n")
    assert bench_imports_of_tests(tmp_path) == ["bench/planted.py: tests.support.factories"]  # the negative control
