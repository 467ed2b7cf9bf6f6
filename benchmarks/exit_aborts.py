"""Count aborts at exit of 2-rank torchrun jobs (issue 32: "terminate called
without an active exception" after ``destroy_process_group()``).

    .venv/bin/python -m benchmarks.exit_aborts --runs 50            # README script and make demo
    .venv/bin/python -m benchmarks.exit_aborts --runs 20 --which readme

Each run is a fresh ``torchrun --standalone --nproc-per-node 2`` job; a run
counts as an abort when it exits non-zero or prints "terminate called".
Prints one line per script: runs, aborts, other failures.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_script() -> str:
    """The README's torchrun snippet (the block after the ``snippet: torchrun`` marker)."""
    text = (ROOT / "README.md").read_text()
    found = re.search(r"<!-- snippet: torchrun.*?-->\s*```python\n(.*?)```", text, re.DOTALL)
    assert found, "README has no torchrun snippet"
    return found[1]


def count(args: list[str], runs: int) -> tuple[int, int]:
    """(aborts, other failures) in ``runs`` jobs; the first abort's stderr
    is printed (its last lines: which rank, which signal)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    aborts = failures = 0
    for _ in range(runs):
        proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", *args],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        if "terminate called" in proc.stderr:
            if not aborts:
                print("first abort, stderr:\n" + proc.stderr[-4000:], flush=True)
            aborts += 1
        elif proc.returncode != 0:
            failures += 1
    return aborts, failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--which", choices=["readme", "demo", "both"], default="both")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        jobs = {}
        if options.which in ("readme", "both"):
            script = Path(tmp) / "readme_torchrun.py"
            script.write_text(readme_script())
            jobs["README torchrun script"] = [str(script)]
        if options.which in ("demo", "both"):
            jobs["make demo (examples/train_gpt.py)"] = [
                "examples/train_gpt.py", "--no-progress", "--out-dir", str(Path(tmp) / "runs")]
        for name, args in jobs.items():
            aborts, failures = count(args, options.runs)
            print(f"{name}: {options.runs} runs, {aborts} aborts at exit, {failures} other "
                  f"failures (torch {__import__('torch').__version__})", flush=True)


if __name__ == "__main__":
    main()
