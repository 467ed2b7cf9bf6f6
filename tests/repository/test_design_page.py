"""The design pages stay short enough to read: no table cell of
``docs/design.md`` or ``docs/decisions.md`` holds more than
:data:`MAX_CELL_WORDS` words. A cell that needs more is prose, and belongs
in a Note at the code or an entry of ``docs/decisions.md``.

Run: ``PYTHONPATH=. python -m pytest -q tests/repository/test_design_page.py``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
MAX_CELL_WORDS = 60
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
    cases = []
    for page in ("design.md", "decisions.md"):
        for heading in sections(page):
            marks = []
            if heading == "## 5. Layers of the package":
                marks = [pytest.mark.xfail(strict=True, reason="the layers table is not condensed "
                                                               "to one line per folder yet")]
            cases.append(pytest.param(page, heading, marks=marks, id=f"{page}:{heading[:14]}"))
    return cases


@pytest.mark.parametrize("page, heading", _cases())
def test_no_table_cell_is_over_the_limit(page: str, heading: str) -> None:
    found = long_cells(sections(page)[heading])
    assert not found, f"docs/{page} {heading!r}: cells over {MAX_CELL_WORDS} words:\n" + \
        "\n".join(found)


def test_the_cell_check_can_fail() -> None:
    wide = "| a | " + "word " * 61 + "|\n| --- | --- |\n| `x | y` | b |"
    assert long_cells(wide) == [f"61 words: {('word ' * 61).strip()[:60]}..."]
    assert cells("| `x | y` | b |") == [" `x | y` ", " b "]
