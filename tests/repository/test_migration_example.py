"""The worked migration example (``examples/fsdp2_migration/``,
``docs/migrating-from-fsdp2.md``): the FSDP2 script and its fsdp_compose
port train alike, the guide shows the scripts as they are, and the
``isinstance(m, FSDPModule)`` gate the guide warns about really changes the
numbers.

Run: ``PYTHONPATH=. python -m pytest -q tests/repository/test_migration_example.py``.
"""

from __future__ import annotations

import difflib
import importlib
import re
import sys
from pathlib import Path
from types import ModuleType

from tests.harness import run_distributed

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "fsdp2_migration"
GUIDE = ROOT / "docs" / "migrating-from-fsdp2.md"
STEPS = 5
TIMEOUT = 120


def _script(name: str) -> ModuleType:
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))  # the scripts import migration_model as a sibling
    return importlib.import_module(name)


def run_script(name: str) -> dict:
    return _script(name).train(steps=STEPS, seed=0)


def run_port_with_fsdp2_gate() -> dict:
    """The port, but still gating on ``isinstance(m, FSDPModule)``."""
    port = _script("train_fsdp_compose")
    original = port.disable_gradient_division
    port.disable_gradient_division = _script("train_fsdp2").disable_gradient_division
    try:
        return port.train(steps=STEPS, seed=0)
    finally:
        port.disable_gradient_division = original


def test_fsdp2_script_and_its_port_train_alike():
    fsdp2 = run_distributed(2, run_script, "train_fsdp2", timeout=TIMEOUT)
    ported = run_distributed(2, run_script, "train_fsdp_compose", timeout=TIMEOUT)
    for rank in range(2):
        for key in ("losses", "grad_norms"):
            for step, (a, b) in enumerate(zip(fsdp2[rank][key], ported[rank][key])):
                assert abs(a - b) <= 1e-5, f"rank {rank}, step {step}: {key} {a} vs {b}"
    assert fsdp2[0]["grad_norms"][0] > 1.0  # clipping bites: max_norm=1.0
    assert fsdp2[0]["losses"][-1] < fsdp2[0]["losses"][0]


def test_an_fsdpmodule_gate_would_silently_divide_the_gradients():
    fsdp2 = run_distributed(2, run_script, "train_fsdp2", timeout=TIMEOUT)[0]
    gated = run_distributed(2, run_port_with_fsdp2_gate, timeout=TIMEOUT)[0]
    assert abs(gated["grad_norms"][0] * 2 - fsdp2["grad_norms"][0]) <= 1e-5  # halved by world 2
    assert abs(gated["losses"][-1] - fsdp2["losses"][-1]) > 1e-4


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def _code(script: str) -> list[str]:
    """The script's lines after its module docstring."""
    return script[script.index('"""', 3) + 4:].splitlines(keepends=True)


def port_diff() -> str:
    """What the guide shows: the port as a diff of the code (docstrings aside)."""
    return "".join(difflib.unified_diff(
        _code((EXAMPLE / "train_fsdp2.py").read_text()),
        _code((EXAMPLE / "train_fsdp_compose.py").read_text()),
        "train_fsdp2.py", "train_fsdp_compose.py", n=1))


def test_the_guide_shows_the_scripts_as_they_are():
    guide = GUIDE.read_text()
    fsdp2 = (EXAMPLE / "train_fsdp2.py").read_text()
    assert fsdp2 in _blocks(guide, "python"), "the FSDP2 listing differs from train_fsdp2.py"
    diff = port_diff()
    assert diff in _blocks(guide, "diff"), "the guide's diff is not the scripts' diff:\n" + diff
