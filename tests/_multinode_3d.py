"""Entry point of the two-agent torchrun test of the 3-D mesh
(``tests/parallelism/test_multinode.py``): every rank trains the HSDP x TP model of
``tests/parallelism/test_hsdp_tp.py`` on a ``(nnodes, nproc_per_node // 2, 2)`` mesh
(replicas across the agents, shards and TP inside one), and rank 0 writes
the mean losses, the full parameters and every rank's agent to ``argv[1]``
(``torch.save``)."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from tests.parallelism.test_hsdp_tp import train_3d


def main(out: str) -> None:
    dist.init_process_group("gloo")
    try:
        nodes, per_node = int(os.environ["GROUP_WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
        shape = (nodes, per_node // 2, 2)
        agents = _agents()
        result = train_3d(shape, "adamw", steps=3)
        if dist.get_rank() == 0:
            torch.save({"shape": shape, "losses": result["losses"], "params": result["params"],
                        "agents": agents}, out)
    finally:
        dist.destroy_process_group()


def _agents() -> list[int]:
    """Each rank's agent (node rank): replicas must span the agents."""
    mine = torch.tensor([int(os.environ["GROUP_RANK"])])
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [int(t) for t in every]


if __name__ == "__main__":
    main(sys.argv[1])
