"""The repository speaks of the project, not of its making: no sessions or
sittings, no "round N" of work, no dates of measurements, no issue numbers
outside CHANGELOG.md (the one place for history, which cites issues and
dates its releases but narrates no sessions or rounds either)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXEMPT = {"CHANGELOG.md", "tests/repository/test_repository_voice.py"}
SUFFIXES = {".py", ".md", ".toml", ".sh", ".txt", ".cfg", ".ini", ".yml", ".yaml", ""}

NARRATION = {
    "a session or sitting of work": re.compile(
        r"\b(?:first|second|third|\w+th|this|that|last|next|previous|earlier|same|helper's)"
        r" (?:session|sitting)\b|\bsitting\b|\bsession \d", re.I),
    "a round of work": re.compile(r"\bround[- ]\d\b|\b(?:this|last|next|previous|second|third)"
                                  r" round\b(?! of)|\bround \d+ \(", re.I),
    "a dated measurement": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
    "an issue number": re.compile(r"\bissues? #?\d+|\(#\d+\)", re.I),
    "a measurement diary": re.compile(r"\bwe measured on\b|\bmeasured (?:today|yesterday)\b", re.I),
}
NARRATION = {kind: re.compile(p.pattern.replace(" ", r"\s+"), p.flags)
             for kind, p in NARRATION.items()}


def _tracked() -> list[str]:
    out = subprocess.run(["git", "-C", str(REPO), "ls-files"], capture_output=True, text=True,
                         check=True).stdout.split()
    return [p for p in out if p not in EXEMPT and Path(p).suffix in SUFFIXES
            and (REPO / p).is_file()]


def hits(paths: list[str], kinds: tuple[str, ...] = tuple(NARRATION)) -> list[str]:
    """``path:line: kind: text`` for every line that narrates in one of ``kinds``."""
    found = []
    for path in paths:
        text = (REPO / path).read_text(errors="replace")
        for kind in kinds:
            pattern = NARRATION[kind]
            for match in pattern.finditer(text):  # across line breaks too
                number = text.count("\n", 0, match.start()) + 1
                found.append(f"{path}:{number}: {kind}: {match.group(0)!r}")
    return found


def test_no_narration_of_the_making() -> None:
    found = hits(_tracked())
    assert not found, "narration of the project's making:\n" + "\n".join(found)


def test_the_changelog_cites_issues_but_narrates_no_sessions() -> None:
    kinds = ("a session or sitting of work", "a round of work", "a measurement diary")
    found = hits(["CHANGELOG.md"], kinds)
    assert not found, "narration of the project's making:\n" + "\n".join(found)


def test_the_patterns_catch_narration_and_spare_ordinary_words() -> None:
    bad = ["measured in the twenty-first session", "perf round 2: gloo", "see issue 36",
           "2026-11-27: 1.2x", "this round's change", "fixed (#12)", "the seventh sitting", "the twelfth\n  session"]
    good = ["rounds of a benchmark", "round-robin over rounds", "round(x, 2)",
            "a session of training", "the round's median", "tissue 3"]
    for line in bad:
        assert any(p.search(line) for p in NARRATION.values()), line
    for line in good:
        assert not any(p.search(line) for p in NARRATION.values()), line
