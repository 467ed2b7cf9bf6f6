"""Two torchrun agents on this machine as two nodes (``--nnodes 2
--nproc-per-node 2``, c10d rendezvous on 127.0.0.1) train
``examples/train_gpt.py`` with hybrid sharding (shard within a node,
replicate across nodes); the losses must equal one process (torch DDP at
world size 1) training on the same global batch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
MODEL = ["--layers", "2", "--width", "32", "--heads", "2", "--vocab", "97", "--seq", "16",
         "--steps", "4", "--no-progress"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(out_dir: Path, impl: str) -> list[float]:
    runs = json.loads((out_dir / "summary.json").read_text())["runs"]
    return next(r["losses"] for r in runs if r["impl"] == impl)


def _run_two_nodes(out_dir: Path, *flags: str, timeout: float = 180) -> list[str]:
    port = _free_port()
    cmd = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"test-{port}",
           "examples/train_gpt.py", *MODEL, "--batch-per-rank", "2", "--out-dir", str(out_dir),
           *flags]
    agents = [subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = []
    try:
        for agent in agents:
            out, _ = agent.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.communicate()
    for agent, out in zip(agents, outputs):
        assert agent.returncode == 0, out[-4000:]
    return outputs


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> list[float]:
    """The reference: torch DDP on one rank over the global batch (4 x 2 rows)."""
    out = tmp_path_factory.mktemp("reference")
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "1",
                           "examples/train_gpt.py", *MODEL, "--batch-per-rank", "8", "--compare",
                           "--out-dir", str(out)], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return _losses(out, "ddp")


def test_two_nodes_hsdp_matches_one_process(tmp_path, one_process):
    outputs = _run_two_nodes(tmp_path, "--hsdp")
    assert any("HSDP 2 replicas x 2 shards" in out for out in outputs), outputs
    got = _losses(tmp_path, "fsdp_compose")
    assert got == pytest.approx(one_process, abs=1e-5), (got, one_process)
