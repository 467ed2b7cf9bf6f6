"""The design page and the code cite each other, and the citations resolve:
every ``[Note: X]`` cited anywhere has exactly one definition (a line that
is the note's name alone, in a docstring or a ``#`` comment); every
backticked repository path in ``docs/`` names a file or folder that
exists; every ``fsdp_compose.<name>`` that ``docs/design.md`` names can be
imported. No process group: plain reads of the tracked files."""

from __future__ import annotations

import importlib
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTE = re.compile(r"\[Note:\s+([^\]]+)\]")  # a citation may run across line breaks
LINE_BREAK = re.compile(r"\s*\n\s*(?:#\s*)?")  # a break, its indent and a comment's ``#``
NOTE_DEFINITION = re.compile(r"^\s*(?:#\s*)?\[Note: ([^\]\n]+)\]\s*$", re.M)
BACKTICKED = re.compile(r"`([^`\s]+)`")
DOTTED = re.compile(r"\bfsdp_compose(?:\.\w+)+")
EXTENSIONS = (".py", ".md", ".toml", ".sh", ".json", ".txt", ".yml", ".yaml")
# A path's first folder: one of the repository's or the package's folders.
FOLDERS = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".venv")} | \
    {p.name for p in (ROOT / "fsdp_compose").iterdir() if p.is_dir()}
ROOTS = (ROOT, ROOT / "fsdp_compose")


def _tracked(*suffixes: str) -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    return [ROOT / n for n in names if n.endswith(suffixes)]


def cited_notes(text: str) -> list[str]:
    """The name of every ``[Note: X]`` cited in ``text``, one line or several."""
    return [LINE_BREAK.sub(" ", match.group(1)).strip() for match in NOTE.finditer(text)]


def test_a_citation_across_a_line_break_is_read_whole():
    text = "x = 1  # see [Note: the life of a\n    # collective], and\n    [Note: one\n    line]"
    assert cited_notes(text) == ["the life of a collective", "one line"]


def test_every_cited_note_has_exactly_one_definition():
    definitions: dict[str, list[str]] = {}
    cited: dict[str, str] = {}
    for path in _tracked(".py", ".md"):
        if path.name == "CHANGELOG.md" or path == Path(__file__).resolve():
            continue
        text = path.read_text()
        for match in NOTE_DEFINITION.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            definitions.setdefault(match.group(1), []).append(f"{path.relative_to(ROOT)}:{line}")
        for name in cited_notes(text):
            cited.setdefault(name, str(path.relative_to(ROOT)))
    undefined = {name: where for name, where in cited.items() if name not in definitions}
    twice = {name: places for name, places in definitions.items() if len(places) > 1}
    assert not undefined, f"notes cited but never defined (name: first citing file): {undefined}"
    assert not twice, f"notes defined more than once: {twice}"


def _doc_paths() -> list[tuple[str, str]]:
    """(doc, token) for each backticked token that reads as a path of ours:
    ``folder/...`` with a first folder of the repository or the package,
    or a bare file name with a known extension."""
    found = []
    for path in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "tests" / "README.md"]:
        for match in BACKTICKED.finditer(path.read_text()):
            token = re.sub(r"(::.*|:\d+(-\d+)?)$", "", match.group(1).rstrip(".,;)"))
            first = token.split("/")[0]
            if ("/" in token and first in FOLDERS) or ("/" not in token and token.endswith(EXTENSIONS)):
                found.append((path.name, token))
    return found


def _exists(token: str, basenames: set[str]) -> bool:
    if "/" not in token:
        return token in basenames
    if any((root / token).exists() or (root / (token + ".py")).exists() for root in ROOTS):
        return True
    module, _, attributes = token.partition(".")  # runtime/unit.Unit: a module's attribute
    if attributes and (ROOT / "fsdp_compose" / (module + ".py")).exists():
        return _resolves("fsdp_compose." + module.replace("/", ".") + "." + attributes)
    return False


def test_every_backticked_path_in_the_docs_exists():
    basenames = {p.name for p in _tracked(*EXTENSIONS)} | {p.parent.name for p in _tracked(".py")}
    missing = sorted({f"{doc}: {token}" for doc, token in _doc_paths() if not _exists(token, basenames)})
    assert not missing, "docs name repository paths that do not exist:\n" + "\n".join(missing)


def test_the_path_check_can_fail():
    basenames = {p.name for p in _tracked(".py")}
    assert _exists("runtime/unit.py", basenames) and _exists("runtime/unit.Unit", basenames)
    assert not _exists("runtime/no_such_module.py", basenames)
    assert not _exists("no_such_module.py", basenames)
    assert not _exists("runtime/unit.NoSuchClass", basenames)


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


DESIGN_PAGES = ("design.md", "decisions.md")


def test_every_package_name_the_design_names_imports():
    names = {doc: sorted(set(DOTTED.findall((ROOT / "docs" / doc).read_text())))
             for doc in DESIGN_PAGES}
    assert any(names.values()), "the design pages name no fsdp_compose.<name>: a vacuous check"
    unresolved = {doc: [n for n in found if not _resolves(n)] for doc, found in names.items()}
    assert not any(unresolved.values()), f"names that cannot be imported: {unresolved}"


def test_the_readme_layout_names_every_package_folder():
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Repository layout"):]
    folders = sorted(p.name for p in (ROOT / "fsdp_compose").iterdir()
                     if p.is_dir() and (p / "__init__.py").exists())
    missing = [f for f in folders if f"`{f}/`" not in layout and f"`fsdp_compose/{f}/`" not in layout]
    assert not missing, f"README.md's repository layout omits package folders: {missing}"


BUFFER_KEY = re.compile(r"\(dtype, requires_grad[^)]*\)")
ONE_D_CLAIM = re.compile(r"(?:each|every) (?:managed|original) parameter is an? 1-D", re.I)


def _prose_files() -> list[Path]:
    return [p for p in _tracked(".py", ".md") if p.name != "CHANGELOG.md"
            and p.parts[len(ROOT.parts)] in ("fsdp_compose", "docs", "README.md")]


def test_every_stated_buffer_key_is_the_code_s():
    """A page or docstring that spells out what a flat buffer is keyed by
    names as many parts as ``group_records`` keys on."""
    import ast
    import inspect

    from fsdp_compose.buffers import records

    tree = ast.parse(inspect.getsource(records.group_records))
    key = next(node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
               and getattr(node.targets[0], "id", "") == "key")
    parts = len(key.elts)
    wrong = [f"{path.relative_to(ROOT)}: {m.group(0)}" for path in _prose_files()
             for m in BUFFER_KEY.finditer(path.read_text())
             if m.group(0).count(",") + 1 != parts]
    assert not wrong, f"buffer keys stated with other than {parts} parts:\n" + "\n".join(wrong)


def test_no_docstring_calls_every_parameter_1d():
    """The default placement keeps rows; 1-D pieces are ``"flat"``'s."""
    wrong = [f"{path.relative_to(ROOT)}: {m.group(0)}" for path in _prose_files()
             for m in ONE_D_CLAIM.finditer(re.sub(r"\s+", " ", path.read_text()))]
    assert not wrong, "claims that every parameter is 1-D:\n" + "\n".join(wrong)
    assert ONE_D_CLAIM.search("After fully_shard every original parameter is a 1-D view")
