"""The package's prose: words of docstrings and comments, and a check that a
prose-only change leaves the code as it was.

Run: ``PYTHONPATH=. python -m tests.repository.prose_count`` (words by
folder and in all) or ``... --check REV`` (every package file changed since
``REV`` has the same code as at ``REV``: the same syntax tree once docstrings,
``pass`` and ``...`` statements are dropped; comments are not in the tree).
"""

from __future__ import annotations

import argparse
import ast
import collections
import io
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fsdp_compose"


def _is_prose(statement: ast.stmt) -> bool:
    return (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
            and isinstance(statement.value.value, str))


def prose_words(source: str) -> int:
    """Words of the comments and of the string statements (docstrings of
    modules, classes, functions and attributes) of one module."""
    words = sum(len(token.string.lstrip("#").split())
                for token in tokenize.generate_tokens(io.StringIO(source).readline)
                if token.type == tokenize.COMMENT)
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        for statement in body if isinstance(body, list) else []:
            if _is_prose(statement):
                words += len(statement.value.value.split())
    return words


def package_words(package: Path = PACKAGE) -> dict[str, int]:
    """Prose words by top-level folder or module of the package."""
    by_part: collections.Counter[str] = collections.Counter()
    for path in sorted(package.rglob("*.py")):
        by_part[path.relative_to(package).parts[0]] += prose_words(path.read_text())
    return dict(by_part)


class _DropProse(ast.NodeTransformer):
    def generic_visit(self, node: ast.AST) -> ast.AST:
        super().generic_visit(node)
        for name in ("body", "orelse", "finalbody"):
            body = getattr(node, name, None)
            if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
                setattr(node, name, [s for s in body if not _is_prose(s) and not isinstance(s, ast.Pass)
                                     and not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                              and s.value.value is Ellipsis)])
        return node


def code_of(source: str) -> str:
    """The module's syntax tree without its prose, as text."""
    return ast.dump(_DropProse().visit(ast.parse(source)))


def changed_code(rev: str) -> list[str]:
    """Package files whose code differs from ``rev`` (new and deleted files included)."""
    names = subprocess.run(["git", "diff", "--name-only", rev, "--", "fsdp_compose"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    changed = []
    for name in names:
        if not name.endswith(".py"):
            continue
        old = subprocess.run(["git", "show", f"{rev}:{name}"], cwd=ROOT, capture_output=True, text=True)
        new = ROOT / name
        if old.returncode != 0 or not new.exists() or code_of(old.stdout) != code_of(new.read_text()):
            changed.append(name)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", metavar="REV", help="refuse code changes since REV")
    args = parser.parse_args(argv)
    if args.check:
        changed = changed_code(args.check)
        for name in changed:
            print(f"code changed: {name}")
        return 1 if changed else 0
    words = package_words()
    for part, count in sorted(words.items(), key=lambda kv: -kv[1]):
        print(f"{count:7,d}  {part}")
    print(f"{sum(words.values()):7,d}  in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
