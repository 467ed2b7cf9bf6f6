"""BENCHMARKS.md is what ``make bench-report`` generates from the committed
records (``benchmarks/results/record/``), so its tables cannot drift from the
runs, and it stays a page of record (at most 300 lines)."""

from __future__ import annotations

import json

import pytest

from benchmarks import record


def test_benchmarks_md_is_generated_from_the_records() -> None:
    text = record.BENCHMARKS_MD.read_text()
    assert text == record.regenerate(text, record.load_records()), (
        "BENCHMARKS.md differs from benchmarks/results/record/: run `make bench-report`")
    assert len(text.splitlines()) <= 300


def test_every_record_is_on_the_page_with_its_command_commit_and_calibration() -> None:
    text = record.BENCHMARKS_MD.read_text()
    records = record.load_records()
    assert len(records) >= 7
    for r in records:
        assert f"### {r['question']}" in text
        assert f"Commit `{r['commit']}`" in text and r["command"] in text
        assert r["calibration"].strip(), f"{r['question']}: no calibration line"


def test_write_record_round_trips(tmp_path) -> None:
    path = record.write_record("q", question="Q?", order=1, command="python -m x",
                               calibration="DDP 1 ms", columns=["a", "b"], rows=[[1, 2.5]],
                               out_dir=tmp_path)
    (only,) = record.load_records(tmp_path)
    assert only["rows"] == [["1", "2.5"]] and only["commit"]
    assert json.loads(path.read_text())["machine"]
    page = record.regenerate(f"x\n{record.BEGIN}\nstale\n{record.END}\ny\n", [only])
    assert "stale" not in page and "| 1 | 2.5 |" in page and page.endswith(f"{record.END}\ny\n")
    with pytest.raises(ValueError):
        record.write_record("bad", question="Q", order=1, command="c", calibration="c",
                            columns=["a"], rows=[[1, 2]], out_dir=tmp_path)
