"""The design pages stay short enough to read: ``docs/design.md`` has at
most :data:`MAX_DESIGN_LINES` lines, and no table cell of it or of
``docs/decisions.md`` holds more than :data:`MAX_CELL_WORDS` words. A cell
that needs more is prose, and belongs in a Note at the code or an entry of
``docs/decisions.md``; every link to a section of either page names a
heading it has.

Run: ``PYTHONPATH=. python -m pytest -q tests/repository/test_design_page.py``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
MAX_CELL_WORDS = 60
MAX_DESIGN_LINES = 450
SEPARATOR_ROW = re.compile(r"^\|[\s:|-]+\|$")


def cells(row: str) -> list[str]:
    """The cells of a Markdown table row; a ``|`` inside backticks is text."""
    found, cell, in_code = [], "", False
    for char in row.strip().strip("|"):
        if char == "`":
            in_code = not in_code
        if char == "|" and not in_code:
            found.append(cell)
            cell = ""
        else:
            cell += char
    return [*found, cell]


def sections(page: str) -> dict[str, str]:
    """The page's text by ``## `` section (the part before the first: "")."""
    parts = re.split(r"^(## .*)$", (DOCS / page).read_text(), flags=re.M)
    return {"": parts[0], **{parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}}


def long_cells(text: str) -> list[str]:
    """``<words> words: <start of cell>`` for each cell over the limit."""
    rows = [line for line in text.splitlines()
            if line.lstrip().startswith("|") and not SEPARATOR_ROW.match(line.strip())]
    return [f"{len(cell.split())} words: {cell.strip()[:60]}..." for row in rows
            for cell in cells(row) if len(cell.split()) > MAX_CELL_WORDS]


def _cases() -> list:
    return [pytest.param(page, heading, id=f"{page}:{heading[:14]}")
            for page in ("design.md", "decisions.md") for heading in sections(page)]


@pytest.mark.parametrize("page, heading", _cases())
def test_no_table_cell_is_over_the_limit(page: str, heading: str) -> None:
    found = long_cells(sections(page)[heading])
    assert not found, f"docs/{page} {heading!r}: cells over {MAX_CELL_WORDS} words:\n" + \
        "\n".join(found)


def test_the_cell_check_can_fail() -> None:
    wide = "| a | " + "word " * 61 + "|\n| --- | --- |\n| `x | y` | b |"
    assert long_cells(wide) == [f"61 words: {('word ' * 61).strip()[:60]}..."]
    assert cells("| `x | y` | b |") == [" `x | y` ", " b "]


def test_the_design_page_is_short_enough_to_read_end_to_end() -> None:
    lines = len((DOCS / "design.md").read_text().splitlines())
    assert lines <= MAX_DESIGN_LINES, (
        f"docs/design.md has {lines} lines, more than {MAX_DESIGN_LINES}: move a decision's "
        "reasoning to docs/decisions.md or a Note at the code, and cut restatements")


SECTION_LINK = re.compile(r"\]\((design|decisions)\.md#([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading's text."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: str) -> set[str]:
    return {anchor(h) for h in re.findall(r"^#{1,6} (.*)$", (DOCS / page).read_text(), re.M)}


def test_every_link_to_a_design_page_section_resolves() -> None:
    """A reference to a decision (``decisions.md#<title>``) or to a section
    of the design names a heading the page has."""
    pages = {"design": anchors("design.md"), "decisions": anchors("decisions.md")}
    broken = [f"{doc.name}: {page}.md#{target}" for doc in sorted(DOCS.glob("*.md"))
              for page, target in SECTION_LINK.findall(doc.read_text())
              if target not in pages[page]]
    assert not broken, "links to headings the page does not have:\n" + "\n".join(broken)


def test_the_anchor_is_github_s() -> None:
    assert anchor("The objects the hooks read declare `__slots__`") == \
        "the-objects-the-hooks-read-declare-__slots__"
    assert anchor("Checkpoint layout: `Shard(0)` DTensors, one all-to-all per buffer") == \
        "checkpoint-layout-shard0-dtensors-one-all-to-all-per-buffer"
    assert anchor("9. Glossary") == "9-glossary"
