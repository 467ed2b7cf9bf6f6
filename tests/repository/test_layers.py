"""The package's layer order and acyclicity (docs/design.md, "Layers of the
package") are enforced by import-linter's contracts in ``pyproject.toml``
(``test_contracts_hold`` runs ``lint-imports``). These tests check that the contracts
hold, and that they *fail* on a planted cycle or an upward import, so a
future change cannot slip one in.

Run: ``PYTHONPATH=. python -m pytest -q tests/repository/test_layers.py``
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(tree: Path) -> subprocess.CompletedProcess:
    assert LINT.exists(), "import-linter is a test dependency: pip install -e '.[test]'"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([str(LINT), "--no-cache"], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=120)


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "fsdp_compose", tmp_path / "fsdp_compose",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_contracts_hold():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout


def _plant(tree: Path, module: str, lines: str) -> None:
    path = tree / "fsdp_compose" / module
    path.write_text(path.read_text() + "\n" + lines + "\n")


def test_a_type_only_cycle_breaks_the_acyclic_contract(tmp_path):
    tree = _copy(tmp_path)
    _plant(tree, "runtime/prefetch_order.py",
           "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .unit import Unit")
    result = _lint(tree)
    assert result.returncode != 0
    assert "No cycles are allowed in fsdp_compose.runtime" in result.stdout


def test_an_upward_import_breaks_the_layers_contract(tmp_path):
    tree = _copy(tmp_path)
    _plant(tree, "buffers/flat_buffer.py", "def _late():\n    from ..runtime import unit")
    result = _lint(tree)
    assert result.returncode != 0
    assert "fsdp_compose.buffers.flat_buffer -> fsdp_compose.runtime.unit" in result.stdout
