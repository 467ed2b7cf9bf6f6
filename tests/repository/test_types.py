"""The type checker passes over the modules ``[tool.mypy]`` in ``pyproject.toml`` names
(the runtime, the buffers, the module methods).

A test rather than a separate step of ``make test``, so that it runs beside the other
tests (pytest-xdist) instead of before them: about 15 s of CPU from a clean clone, under
a second with mypy's cache (``.mypy_cache``) warm.

Run: ``PYTHONPATH=. python -m pytest -q tests/repository/test_types.py``
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_finds_no_errors() -> None:
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "Success: no issues found" in result.stdout, result.stdout
