"""The package's privacy rule (docs/design.md, "Privacy"), checked on its
sources: a leading underscore marks a module private to the package that
holds it (importable from that package and its subpackages only) and a name
private to the module that defines it (never imported by another module of
the package). Tests may reach anything."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fsdp_compose"


def _module_name(path: Path, package: Path) -> tuple[str, bool]:
    parts = path.relative_to(package.parent).with_suffix("").parts
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def _imports(path: Path, package_dir: Path) -> list[tuple[str, list[str]]]:
    """(absolute module, imported names) for every import in ``path``."""
    name, is_package = _module_name(path, package_dir)
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((target, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((a.name, []) for a in node.names)
    return found


def _private(component: str) -> bool:
    return component.startswith("_") and not component.startswith("__")


def violations(package_dir: Path = PACKAGE) -> list[str]:
    out = []
    for path in sorted(package_dir.rglob("*.py")):
        importer, _ = _module_name(path, package_dir)
        for target, names in _imports(path, package_dir):
            if not target.startswith("fsdp_compose"):
                continue
            parts = target.split(".")
            for i, component in enumerate(parts):
                owner = ".".join(parts[:i])  # the package the private module belongs to
                if _private(component) and not (importer == owner or importer.startswith(owner + ".")):
                    out.append(f"{importer} imports {target}: private to {owner}")
            for imported in names:
                submodule = package_dir.parent.joinpath(*parts, imported)
                is_module = submodule.with_suffix(".py").exists() or submodule.is_dir()
                if _private(imported) and not is_module:
                    out.append(f"{importer} imports {imported} from {target}: private to that module")
                elif _private(imported) and not importer.startswith(target):
                    out.append(f"{importer} imports module {target}.{imported}: private to {target}")
    return out


def test_the_privacy_rule_holds():
    assert violations() == []


def test_the_checker_finds_planted_violations(tmp_path):
    """The check can fail: a copy of the package where one module imports
    another's private name and another imports a subpackage's private
    module from outside it."""
    copy = tmp_path / "fsdp_compose"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "runtime" / "planted_a.py").write_text("from .state import _planted_name\n")
    (copy / "runtime" / "planted_b.py").write_text("from ..checkpoint._optim import register_optimizer\n")
    found = violations(copy)
    assert any("_planted_name" in v for v in found), found
    assert any("planted_b imports fsdp_compose.checkpoint._optim" in v for v in found), found
    assert len(found) == 2, found
