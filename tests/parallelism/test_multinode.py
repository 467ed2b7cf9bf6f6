"""Two torchrun agents on this machine as two nodes (``--nnodes 2
--nproc-per-node 2``, c10d rendezvous on 127.0.0.1) train
``examples/train_gpt.py`` with hybrid sharding (shard within a node,
replicate across nodes); the losses must equal one process (torch DDP at
world size 1) training on the same global batch.

The 3-D test (``slow``): two agents of four ranks train the HSDP x TP model
of ``tests/parallelism/test_hsdp_tp.py`` on a (2, 2, 2) ``(dp_replicate, dp_shard, tp)``
mesh, replicated across the agents, sharded and tensor-parallel inside one
(``tests/_multinode_3d.py``); losses and parameters must match one process
on the global batch (1e-5)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
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
    return _two_agents(["examples/train_gpt.py", *MODEL, "--batch-per-rank", "2",
                        "--out-dir", str(out_dir), *flags], 2, timeout)


def _two_agents(script: list[str], per_node: int, timeout: float) -> list[str]:
    port = _free_port()
    cmd = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"test-{port}", *script]
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
                          text=True, timeout=600)  # a hang detector: generous under load
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return _losses(out, "ddp")


@pytest.mark.slow  # ~2.5 min (two torchrun agents); HSDP parity: tests/parallelism/test_hsdp.py
def test_two_nodes_hsdp_matches_one_process(tmp_path, one_process):
    outputs = _run_two_nodes(tmp_path, "--hsdp")
    assert any("HSDP 2 replicas x 2 shards" in out for out in outputs), outputs
    got = _losses(tmp_path, "fsdp_compose")
    assert got == pytest.approx(one_process, abs=1e-5), (got, one_process)


@pytest.mark.slow
def test_two_nodes_hsdp_x_tp_matches_one_process(tmp_path):
    from tests.parallelism.test_tensor_parallel import train_reference
    out = tmp_path / "result.pt"
    _two_agents(["tests/_multinode_3d.py", str(out)], 4, timeout=400)
    got = torch.load(out)
    assert got["shape"] == (2, 2, 2)
    # ranks 0-3 on one agent, 4-7 on the other: the replicate dim (stride 4) spans them
    assert got["agents"] == [0, 0, 0, 0, 1, 1, 1, 1] or got["agents"] == [1, 1, 1, 1, 0, 0, 0, 0]
    reference = train_reference("adamw", steps=3, dp=4)
    assert got["losses"] == pytest.approx(reference["losses"], abs=1e-5)
    for name, want in reference["params"].items():
        diff = (got["params"][name] - want).abs().max().item()
        assert diff <= 1e-5, f"{name} differs by {diff}"
