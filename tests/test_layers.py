"""The layers of DESIGN.md as an import-linter contract (pyproject.toml): the tree keeps it, and the
contract really refuses a reverse import (shown on a copy of the tree with one bad module added)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mesh", "station", "orchestrator")


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        pytest.fail(f"lint-imports is not installed beside {sys.executable} (the test extra installs import-linter)")
    env = {**os.environ, "PYTHONPATH": str(cwd)}  # the tree in `cwd` shadows the installed one
    return subprocess.run([str(exe), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_tree_keeps_the_layers() -> None:
    run = _lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Contracts: 2 kept, 0 broken." in run.stdout


def _copy_tree(dest: Path) -> None:
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, dest / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.html"))


@pytest.mark.parametrize("module, source, broken", [
    # a station reaching up into the orchestrator, hidden inside a function
    ("station/upward.py", "def f():\n    from orchestrator import engine\n    return engine\n", "station is not allowed"),
    # the core reaching up into the control plane
    ("mesh/core/upward.py", "import mesh.control.cluster\n", "mesh.core is not allowed"),
    # the scheduler taking torch in
    ("orchestrator/scheduler_extra.py", "", None),
])
def test_contract_refuses_a_reverse_import(tmp_path: Path, module: str, source: str, broken: str | None) -> None:
    _copy_tree(tmp_path)
    if broken is None:  # torch in the scheduler: append to the real module
        path = tmp_path / "orchestrator" / "scheduler.py"
        path.write_text(path.read_text() + "\nimport torch  # noqa: E402\n")
        broken = "the scheduler is pure Python: no torch BROKEN"
    else:
        (tmp_path / module).write_text(source)
    run = _lint_imports(tmp_path)
    assert run.returncode != 0, run.stdout
    assert broken in run.stdout, run.stdout
