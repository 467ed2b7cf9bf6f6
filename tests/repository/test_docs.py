"""Every fenced ``python`` block in README.md and docs/*.md runs as written.

A block runs, by default, on 2 ranks under ``tests/harness.py`` (gloo on
loopback, the default process group initialised), after its page's setup
block, in a fresh namespace and a fresh temporary working directory. An HTML
comment on the line before the fence changes that (several options are
separated by commas)::

    <!-- snippet: setup -->            the page's preamble: runs before every other block of the
                                       page (the page says so in its text)
    <!-- snippet: continues -->        runs after the python block before it, in one namespace
    <!-- snippet: ranks=4 -->          on 4 ranks instead of 2
    <!-- snippet: torch=2.13 -->       skips on an older torch (the block uses what it added)
    <!-- snippet: local -->            in one plain process, no process group, no setup block
    <!-- snippet: torchrun -->         a complete script, run as torchrun --standalone --nproc-per-node 2
                                       runs it (tests/_torchrun_env.py: torchrun's environment, store
                                       and ``__main__`` on ranks forked from the harness's server)
    <!-- snippet: slow (reason) -->    marked slow: only ``pytest -m slow`` runs it
    <!-- snippet: no-run (reason) -->  not run; the reason is required

and before a ``text`` block::

    <!-- snippet: output -->           what the python block before it prints on rank 0
    <!-- snippet: output, rank=1 -->   ... on rank 1; a line "..." stands for any lines

Also checked: no block imports a private module (``fsdp_compose._x``,
``fsdp_compose.pkg._x``), and every relative link in these files points to a
file that exists (and, with ``#anchor``, to one of its headings).
"""

from __future__ import annotations

import contextlib
import io
import linecache
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests._torchrun_env import run_like_torchrun
from tests.harness import run_distributed

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DEFAULT_RANKS = 2
OPTIONAL = ("transformers", "peft", "safetensors", "lightning", "accelerate")  # snippets importing these skip without them
OPTIONS = {"setup", "continues", "ranks", "local", "torchrun", "slow", "no-run", "output", "rank",
           "torch"}

_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(?P<body>.*?)\s*-->\s*$")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    options: dict[str, str] = field(default_factory=dict)
    reason: str = ""
    previous: Block | None = None  # the fenced block before this one on the page
    previous_python: Block | None = None  # the python block before this one on the page
    setup: Block | None = None  # the page's setup block

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.lang == "python" and "no-run" not in self.options


def _parse_marker(body: str) -> tuple[dict[str, str], str]:
    reason = ""
    m = re.search(r"\((.*)\)\s*$", body)
    if m:
        reason, body = m.group(1).strip(), body[:m.start()]
    options = {}
    for item in filter(None, (part.strip() for part in body.split(","))):
        key, _, value = item.partition("=")
        options[key.strip()] = value.strip()
    return options, reason


def parse(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    setup = None
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, start = len(m.group("indent")), i
        body = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            text = lines[i]
            body.append(text[indent:] if text[:indent].strip() == "" else text)
            i += 1
        i += 1  # the closing fence
        before = start - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        marker = _MARKER.match(lines[before]) if before >= 0 else None
        options, reason = _parse_marker(marker.group("body")) if marker else ({}, "")
        block = Block(path, start + 1, m.group("lang"), "\n".join(body) + "\n", options, reason,
                      blocks[-1] if blocks else None,
                      next((b for b in reversed(blocks) if b.lang == "python"), None))
        if "setup" in options:
            setup = block
        block.setup = setup
        blocks.append(block)
    return blocks


ALL_BLOCKS = [b for path in DOCS for b in parse(path)]
RUNNABLE = [b for b in ALL_BLOCKS if b.runs and "setup" not in b.options]


def _chain(block: Block) -> list[Block]:
    """The blocks to run, in order, for ``block``: its setup, the blocks it continues, itself."""
    chain = [block]
    while "continues" in chain[0].options:
        chain.insert(0, chain[0].previous_python)
    mode = _mode(block)
    if mode == "ranks" and block.setup is not None and block.setup not in chain:
        chain.insert(0, block.setup)
    return chain


def _mode(block: Block) -> str:
    if "local" in block.options:
        return "local"
    if "torchrun" in block.options:
        return "torchrun"
    return "ranks"


def _output_block(block: Block) -> Block | None:
    for other in ALL_BLOCKS:
        if other.previous is block and "output" in other.options:
            return other
    return None


# ----------------------------------------------------------------- running


def _exec_chain(steps: list[tuple[str, str]], workdir: str) -> str:
    """Run ``steps`` (``(filename, source)``) in one namespace inside ``workdir``;
    return what the last one printed. Module-level: the harness pickles it."""
    namespace: dict[str, object] = {"__name__": "__snippet__"}
    out = io.StringIO()
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        for i, (filename, source) in enumerate(steps):
            linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
            code = compile(source, filename, "exec")
            if i == len(steps) - 1:
                with contextlib.redirect_stdout(out):
                    exec(code, namespace)  # noqa: S102 - running the docs is the point
            else:
                exec(code, namespace)  # noqa: S102
    finally:
        os.chdir(cwd)
        sys.stdout.flush()
    return out.getvalue()


def _matches(expected: str, actual: str) -> bool:
    """Line by line, trailing spaces ignored; a line "..." matches any lines."""
    parts = []
    for line in expected.strip("\n").splitlines():
        parts.append(r"(?:[^\n]*\n)*?" if line.strip() == "..." else re.escape(line.rstrip()) + r"\n")
    text = "".join(line.rstrip() + "\n" for line in actual.strip("\n").splitlines())
    return re.fullmatch("".join(parts), text) is not None


def _run_torchrun(block: Block, tmp_path: Path) -> str:
    script = tmp_path / "snippet.py"
    script.write_text(block.code)
    proc = run_like_torchrun(DEFAULT_RANKS, script.name, cwd=tmp_path, timeout=180)
    assert proc.returncode == 0, (f"{block.name} failed under torchrun (exit {proc.returncode}):\n"
                                  f"{proc.stdout}\n{proc.stderr}")
    return proc.stdout


@pytest.mark.parametrize("block", [
    pytest.param(b, id=b.name, marks=[pytest.mark.slow] if "slow" in b.options else [])
    for b in RUNNABLE])
def test_snippet_runs(block: Block, tmp_path: Path) -> None:
    chain = _chain(block)
    for extra in OPTIONAL:  # the `hf` / `safetensors` extras, as tests/tools/test_hf.py
        if re.search(rf"^\s*(from|import)\s+{extra}\b", "".join(b.code for b in chain),
                     re.MULTILINE):
            pytest.importorskip(extra)
    needed = max((b.options["torch"] for b in chain if "torch" in b.options),
                 key=_release, default=None)
    if needed is not None and _release(torch.__version__) < _release(needed):
        pytest.skip(f"{block.name} needs torch {needed}, this is {torch.__version__}")
    steps = [(b.name, b.code) for b in chain]
    mode = _mode(block)
    expected = _output_block(block)
    if mode == "torchrun":
        printed = _run_torchrun(block, tmp_path)
    elif mode == "local":
        printed = _exec_chain(steps, str(tmp_path))
    else:
        ranks = int(block.options.get("ranks") or DEFAULT_RANKS)
        results = run_distributed(ranks, _exec_chain, steps, str(tmp_path), timeout=120)
        printed = results[int(expected.options.get("rank") or 0)] if expected else results[0]
    if expected is not None:
        same = _matches(expected.code, printed)
        assert same, (
            f"{block.name} printed something else than the output shown at {expected.name}:\n"
            f"--- shown\n{expected.code}--- printed\n{printed}")


def _release(version: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


# ------------------------------------------------------------------ checks


def test_every_python_block_is_run_or_excluded_with_a_reason() -> None:
    problems = []
    for b in ALL_BLOCKS:
        unknown = set(b.options) - OPTIONS
        if unknown:
            problems.append(f"{b.name}: unknown snippet option(s) {sorted(unknown)}")
        for needs_reason in ("no-run", "slow"):
            if needs_reason in b.options and not b.reason:
                problems.append(f"{b.name}: {needs_reason} needs a reason: "
                                f"<!-- snippet: {needs_reason} (why) -->")
        if b.lang in ("py", "python3", "pycon"):
            problems.append(f"{b.name}: tag the block ```python (run) or ```text (not code)")
        if "output" in b.options and (b.previous is None or not b.previous.runs):
            problems.append(f"{b.name}: an output block must follow a python block that runs")
        if "continues" in b.options and (b.previous_python is None or not b.previous_python.runs):
            problems.append(f"{b.name}: 'continues' must follow a python block that runs")
        if "setup" in b.options and b.lang != "python":
            problems.append(f"{b.name}: a setup block must be python")
    assert not problems, "\n".join(problems)


_PRIVATE = re.compile(r"\bfsdp_compose(?:\.\w+)*\._\w+|\bfrom\s+fsdp_compose(?:\.\w+)*\s+import\s+"
                      r"(?:\(\s*)?(?:[\w\s,]*,\s*)?_\w+")


def test_no_snippet_imports_a_private_module() -> None:
    bad = [f"{b.name}: {m.group(0)}" for b in ALL_BLOCKS if b.runs
           for m in _PRIVATE.finditer(b.code)]
    assert not bad, "snippets must use public names only:\n" + "\n".join(bad)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"<[^>]+>", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors, in_code = set(), False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            anchors.add(_slug(line.lstrip("#")))
    return anchors


_LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def test_relative_links_resolve() -> None:
    problems = []
    for path in DOCS:
        in_code = False
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                in_code = not in_code
            if in_code:
                continue
            for m in _LINK.finditer(line):
                target = m.group("target")
                if re.match(r"[a-z]+:", target):
                    continue  # http:, https:, mailto:
                file_part, _, anchor = target.partition("#")
                dest = (path.parent / file_part).resolve() if file_part else path
                where = f"{path.relative_to(ROOT)}:{n}: {target}"
                if not dest.exists():
                    problems.append(f"{where}: no such file")
                elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                    problems.append(f"{where}: no heading with that anchor")
    assert not problems, "\n".join(problems)
