"""``benchmarks/host_cost/ab.py`` compares this tree with another revision's
package in one process: the exported package must be that revision's code
alone. One that still imported a module of this tree would compare the tree
with itself, a silent zero."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = """
import json
import sys
from benchmarks.host_cost.ab import BASELINE_PACKAGE, export_baseline
folder = sys.argv[1]
export_baseline("HEAD", folder)
sys.path.insert(0, folder)
before = set(sys.modules)
import importlib
baseline = importlib.import_module(BASELINE_PACKAGE)
loaded = set(sys.modules) - before
ours = sorted(m for m in loaded if m.split(".")[0] == BASELINE_PACKAGE)
outside = [m for m in ours if not (sys.modules[m].__file__ or "").startswith(folder)]
tree = [m for m in loaded if m.split(".")[0] == "fsdp_compose"]
import os, re
name = re.compile(r"\\bfsdp_compose\\b")
for place, _, files in os.walk(folder):  # modules this process had loaded already
    tree += [os.path.join(place, f) for f in files
             if f.endswith(".py") and name.search(open(os.path.join(place, f)).read())]
assert callable(baseline.fully_shard)
print(json.dumps({"count": len(ours), "outside": outside, "tree": tree}))
"""


def test_the_baseline_package_is_the_revision_alone(tmp_path):
    proc = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["count"] > 20, found  # the whole package, not an empty shell
    assert found["outside"] == [], f"baseline modules loaded from elsewhere: {found['outside']}"
    assert found["tree"] == [], f"the baseline imported this tree's modules: {found['tree']}"
