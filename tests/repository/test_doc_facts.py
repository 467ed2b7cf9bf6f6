"""Facts the docs quote, checked against the code so that they cannot drift.

- Every default a page quotes (timeouts, caps, slack, environment variables'
  defaults) is found by a pattern of :data:`QUOTED_DEFAULTS` and equals the
  constant the code uses. A number quoted next to "default" that no pattern
  claims fails too, unless :data:`NOT_LIBRARY_DEFAULTS` says what else it
  is: a new quoted default needs a row here.
- Every ``FSDP_COMPOSE_*`` environment variable the docs name is read by the
  library or by the test suite, and every one they read is documented.
- No page quotes a count of tests ("772 tests", "91 passed"): counts change
  with every test added and nothing regenerates them.

The README's ``make demo`` output block is checked against what the demo
prints in tests/repository/test_train_example.py (``test_readme_shows_what_the_demo_prints``).

Run: ``PYTHONPATH=. python -m pytest -q tests/repository/test_doc_facts.py``.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Callable, NamedTuple

import pytest

from fsdp_compose.setup.default_placement import HOST_PIECE_SLACK_BYTES, ROWS_EXTRA_PADDING
from fsdp_compose.checks.divergence import CHECK_ENV, VERIFICATION_ITERATIONS
from fsdp_compose.comm.rendezvous import (CALL_TIMEOUT_ENV, DEFAULT_CALL_TIMEOUT,
                                          DEFAULT_POLL_SECONDS, LATE_NOTICE_SECONDS, POLL_ENV)
from fsdp_compose.comm.wire import DEFAULT_STALL_SECONDS, STALL_ENV
from fsdp_compose.policies import CommPolicy, MixedPrecisionPolicy, PrefetchPolicy
from fsdp_compose.runtime.buckets import DEFAULT_BUCKET_CAP_MB
from tests.harness import FAILURE_GRACE

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
WORDS = {"one": 1, "two": 2, "three": 3, "four": 4}


def _field_default(cls: type, name: str) -> object:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


class Quoted(NamedTuple):
    """A default as the docs write it: ``pattern``'s first non-empty group,
    read by ``parse``, must equal ``value`` (the code's constant)."""

    what: str
    pattern: str
    value: object
    parse: Callable[[str], object] = float


QUOTED_DEFAULTS = [
    # an environment variable, then its default in parentheses: "(30)", "(default 1800", "(1800 s)"
    Quoted(CALL_TIMEOUT_ENV, rf"`{CALL_TIMEOUT_ENV}`[^`.;]{{0,30}}?\((?:default )?(\d+(?:\.\d+)?)",
           DEFAULT_CALL_TIMEOUT),
    Quoted(POLL_ENV, rf"`{POLL_ENV}`[^`.;]{{0,30}}?\((?:default )?(\d+(?:\.\d+)?)",
           DEFAULT_POLL_SECONDS),
    Quoted(STALL_ENV, rf"`{STALL_ENV}`[^`.;]{{0,30}}?\((?:default )?(\d+(?:\.\d+)?)",
           DEFAULT_STALL_SECONDS),
    Quoted("the late-rank notice (rendezvous.LATE_NOTICE_SECONDS)", r"\bevery (\d+) s\b",
           LATE_NOTICE_SECONDS),
    Quoted("the bucket cap (runtime/buckets.DEFAULT_BUCKET_CAP_MB)",
           r"(\d+(?:\.\d+)?) MiB by default|\bdefault (\d+(?:\.\d+)?) MiB|"
           r"at most (\d+(?:\.\d+)?) MiB unsharded \(`DEFAULT_BUCKET_CAP_MB`\)",
           DEFAULT_BUCKET_CAP_MB),
    Quoted("a rank's host piece slack (default_placement.HOST_PIECE_SLACK_BYTES)",
           r"more than (\d+) MiB larger than the unit's largest", HOST_PIECE_SLACK_BYTES / 2 ** 20),
    Quoted("the default placement's padding bound (default_placement.ROWS_EXTRA_PADDING)",
           r"pad their buffer by over (\d+(?:\.\d+)?)% more", ROWS_EXTRA_PADDING * 100),
    Quoted("CommPolicy.block_size", r"`block_size` elements \(default (\d+)\)",
           _field_default(CommPolicy, "block_size"), int),
    Quoted("PrefetchPolicy.max_inflight_all_gathers", r"the default \(`PrefetchPolicy\("
           r"max_inflight_all_gathers=(\d+)\)`\)", _field_default(PrefetchPolicy,
                                                                   "max_inflight_all_gathers"), int),
    Quoted("MixedPrecisionPolicy.cast_forward_inputs",
           r"`cast_forward_inputs`(?: defaults to | \(default )`(True|False)`",
           _field_default(MixedPrecisionPolicy, "cast_forward_inputs"), lambda s: s == "True"),
    Quoted("the verified iterations (divergence.VERIFICATION_ITERATIONS)",
           r"the first (one|two|three|four) by default|in the first (one|two|three|four) training "
           r"iterations", VERIFICATION_ITERATIONS, WORDS.__getitem__),
    Quoted("the test harness's FAILURE_GRACE", r"`FAILURE_GRACE` \((\d+) s\)", FAILURE_GRACE),
]

# A number next to "default" (or "by default", or "every <n> s") in a page's text
_NEAR_DEFAULT = re.compile(r"\bdefault[^.;:]{0,25}?\b\d[\d.,]*|\b\d[\d.,]*(?: ?(?:s|MiB|seconds|%))?"
                           r"\)? by default|\bevery \d+ s\b")
# ... that is no library default: (page, text the match starts with)
NOT_LIBRARY_DEFAULTS = {
    ("README.md", "default suite 9"),  # a measured run time of `make test`
    ("docs/design.md", 'default, `"flat"` for 0'),  # a placement name, then "0-dim"
    ("docs/design.md", "default_mesh` builds a 1"),  # "a 1-D mesh"
    ("docs/migrating.md", "default (a 1"),  # "a 1-D mesh"
    ("docs/performance.md", "default 2"),  # benchmarks.host_cost's --processes
    ("docs/performance.md", "defaults), 2"),  # "2 gloo ranks"
    ("docs/performance.md", "default model 1"),  # a measured ratio
    ("docs/placements.md", "default included, leaves a 0"),  # "0-dim"
    ("docs/placements.md", "default's) | whole rows (dim 0"),  # a table's cells
    ("docs/placements.md", "default model (d512) pads 2"),  # a measured padding
    ("docs/placements.md", "default GPT (vocab 16384"),  # the benchmark's model
    ("docs/tools.md", "default GPT on 8"),  # the benchmark's model on 8 ranks
    ("docs/integrations.md", 'default `precision="32'),  # Lightning's precision flag
}


def _prose(path: Path) -> str:
    """The page without its fenced code blocks, whitespace collapsed (a
    phrase may break across lines)."""
    lines, in_code = [], False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code:
            lines.append(line)
    return " ".join(" ".join(lines).split())


PROSE = {str(p.relative_to(ROOT)): _prose(p) for p in PAGES}


def test_every_quoted_default_is_the_codes():
    wrong, found = [], {q.what: 0 for q in QUOTED_DEFAULTS}
    for page, text in PROSE.items():
        for q in QUOTED_DEFAULTS:
            for m in re.finditer(q.pattern, text):
                found[q.what] += 1
                quoted = q.parse(next(g for g in m.groups() if g is not None))
                if quoted != q.value:
                    wrong.append(f"{page}: {q.what} is {q.value!r} in the code, the page says "
                                 f"{quoted!r}: ...{m.group(0)}...")
    assert not wrong, "\n".join(wrong)
    # a pattern that finds nothing is stale: the page was reworded, the check lost
    assert all(found.values()), [what for what, n in found.items() if not n]


def test_no_number_next_to_default_is_unchecked():
    claimed = {page: [m.span() for q in QUOTED_DEFAULTS for m in re.finditer(q.pattern, text)]
               for page, text in PROSE.items()}
    loose, used = [], set()
    for page, text in PROSE.items():
        for m in _NEAR_DEFAULT.finditer(text):
            if any(a < m.end() and m.start() < b for a, b in claimed[page]):
                continue
            known = next((k for k in NOT_LIBRARY_DEFAULTS
                          if k[0] == page and m.group(0).startswith(k[1])), None)
            if known is None:
                loose.append(f"{page}: ...{text[max(0, m.start() - 40):m.end() + 20]}...")
            used.add(known)
    assert not loose, ("a number quoted next to 'default' that no row of QUOTED_DEFAULTS checks "
                       "(add one, or to NOT_LIBRARY_DEFAULTS if it is no library default):\n"
                       + "\n".join(loose))
    assert NOT_LIBRARY_DEFAULTS <= used, sorted(NOT_LIBRARY_DEFAULTS - used)  # none stale


_ENV = re.compile(r"FSDP_COMPOSE_[A-Z0-9_]+")
_ENV_LITERAL = re.compile(r"[\"'](FSDP_COMPOSE_[A-Z0-9_]+)[\"']")  # read from code, not prose


def _env_read_by(*folders: str) -> set[str]:
    return {name for folder in folders for path in (ROOT / folder).rglob("*.py")
            for name in _ENV_LITERAL.findall(path.read_text())}


def test_documented_environment_variables_are_the_ones_read():
    documented = {name for text in PROSE.values() for name in _ENV.findall(text)}
    library = _env_read_by("fsdp_compose")
    suite = _env_read_by("tests")
    assert {CALL_TIMEOUT_ENV, STALL_ENV, CHECK_ENV} <= library  # the literal scan sees them
    assert documented - (library | suite) == set(), "documented but read nowhere"
    assert (library | suite) - documented == set(), "read but not documented in README/docs"


_TEST_COUNT = re.compile(r"\b\d[\d,]*\s+(?:tests?|passed|failed|skipped|errors?|deselected|"
                         r"selected|xfailed|xpassed)\b")


@pytest.mark.parametrize("page", sorted(PROSE))
def test_no_page_quotes_a_count_of_tests(page):
    text = " ".join((ROOT / page).read_text().split())
    counts = [text[max(0, m.start() - 40):m.end() + 10] for m in _TEST_COUNT.finditer(text)]
    assert not counts, (f"{page} quotes test counts, which go stale with every test added "
                        f"(say what runs, not how many): {counts}")


# ------------------------------------------------ docs/errors.md: advice that runs
ERRORS = ROOT / "docs" / "errors.md"
# the page's short names for test files (its opening paragraph)
_PREFIX = {"E": "tests/checks/test_errors.py", "R": "tests/core/test_recovery.py",
           "F": "tests/checks/test_first_iterations.py", "C": "tests/checks/test_calls_on_some_ranks.py",
           "L": "tests/checks/test_flight_log.py", "T": "tests/parallelism/test_tensor_parallel.py"}
# a message that tells the user what to write or do
_PROPOSES_FIX = re.compile(
    r"\b[Cc]all [\w.]+\(|\b[Pp]ass (?:a |it |the |True|writeback|placement)|\b[Uu]se (?:a list|len\(|`)|"
    r"\b[Mm]ove the module|\bmake it contiguous|\b[Aa]nnotate (?:bottom-up|the common)|"
    r"\b[Ww]rap it in|\brun the evaluation on every rank|\bslice both|\bflatten them|"
    r"\bLoad a state dict with|\bload checkpoints between")
_FIX_RUNS = re.compile(r"fix (?:runs|works): (?P<refs>.*)")
_FIX_NOT_RUN = re.compile(r"fix not run \(\w[^)]*\)")
_REF = re.compile(r"`(?:(?P<file>tests/(?:\w+/)?\w+\.py)|(?P<short>[A-Z]))?::(?P<name>\w+)")


def _rows(path: Path):
    """(line, situation, raised, test) of every table row of the page."""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.startswith("| ") or line.startswith(("| ---", "| situation", "| call |")):
            continue
        cells = line.strip().strip("|").split(" | ")
        if len(cells) >= 3:
            yield n, cells[0].strip(), " | ".join(cells[1:-1]), cells[-1].strip()


def _functions(file: str) -> set[str]:
    return set(re.findall(r"^def (\w+)", (ROOT / file).read_text(), re.MULTILINE))


def _unresolved(refs: str) -> list[str]:
    """The test references in ``refs`` naming no function of their file (a
    bare ``::name`` continues the file before it)."""
    bad, file = [], None
    for m in _REF.finditer(refs):
        file = m["file"] or (_PREFIX[m["short"]] if m["short"] else file)
        if file is None or m["name"] not in _functions(file):
            bad.append(m.group(0))
    return bad


def test_every_fix_errors_md_proposes_names_the_test_that_runs_it():
    """A row whose message proposes a fix says ``fix runs: <test>`` (a test that
    executes the proposed code and shows it works) or ``fix not run (why)``."""
    problems = []
    for n, situation, raised, test in _rows(ERRORS):
        if not _PROPOSES_FIX.search(raised):
            continue
        runs = _FIX_RUNS.search(test)
        if runs is None and not _FIX_NOT_RUN.search(test):
            problems.append(f"errors.md:{n} ({situation[:60]}): proposes a fix but names no "
                            "test that runs it ('fix runs: `E::...`' or 'fix not run (why)')")
        elif runs is not None and (not _REF.search(runs["refs"]) or _unresolved(runs["refs"])):
            problems.append(f"errors.md:{n}: 'fix runs:' names no existing test: {runs['refs']}")
    assert not problems, "\n".join(problems)


def test_every_test_errors_md_names_exists():
    bad = [f"errors.md:{n}: {ref}" for n, _, _, test in _rows(ERRORS) for ref in _unresolved(test)]
    assert not bad, "\n".join(bad)


# ----------------------------- where torch keeps the custom collectives' classes
TORCH_COMM_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_api"


def test_the_custom_comm_classes_are_where_the_docs_say_and_private_there():
    """docs/migrating-from-fsdp2.md and set_custom_all_gather /
    set_custom_reduce_scatter name the module of torch's ``AllGather`` and
    ``ReduceScatter``; it holds them in the installed torch, and the public
    ``torch.distributed.fsdp`` does not export them (the docs say so)."""
    import importlib

    import torch.distributed.fsdp as fsdp

    from fsdp_compose.module_methods.comm_methods import ShardedCommMethods
    module = importlib.import_module(TORCH_COMM_MODULE)
    assert isinstance(module.AllGather, type) and isinstance(module.ReduceScatter, type)
    assert not hasattr(fsdp, "AllGather") and not hasattr(fsdp, "ReduceScatter")
    page = (ROOT / "docs" / "migrating-from-fsdp2.md").read_text()
    assert f"`{TORCH_COMM_MODULE}.AllGather`" in page and "private" in page
    for name, cls in (("set_custom_all_gather", "AllGather"),
                      ("set_custom_reduce_scatter", "ReduceScatter")):
        doc = " ".join(getattr(ShardedCommMethods, name).__doc__.split())
        assert f"{TORCH_COMM_MODULE}.{cls}" in doc and "private" in doc, (name, doc)
