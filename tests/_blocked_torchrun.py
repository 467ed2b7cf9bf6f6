"""Run by ``tests/checks/test_blocked_rank.py`` under torchrun (2 gloo ranks): the
FSDP2 habits that save from rank 0 only, then ``dist.barrier()``. Each rank
prints ``MISTAKE <time>`` before the mistake and ``ERROR <time> ...`` when
it raises (uncaught: the job ends as a user's would).

    PYTHONPATH=. FSDP_COMPOSE_POLL_SECONDS=0.5 torchrun --standalone \\
        --nproc-per-node 2 tests/_blocked_torchrun.py a /tmp/model.pt

Cases: ``a`` ``torch.save(model.state_dict(), f)`` on rank 0; ``b``
``sd = model.state_dict()`` on every rank, ``torch.save(sd, f)`` on rank 0;
``late`` rank 0 evaluates 8 s, then every rank saves its own file.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_compose import fully_shard
from fsdp_compose.testing.launch import init_from_torchrun


def say(text: str) -> None:
    os.write(1, f"RANK {dist.get_rank()} {text}\n".encode())  # one write: no interleaving


def main(case: str, path: str) -> None:
    init_from_torchrun()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 15), nn.Tanh(), nn.Linear(15, 3))
    fully_shard(model[0])
    fully_shard(model)
    model(torch.randn(4, 7)).sum().backward()
    say(f"MISTAKE {time.time()}")
    try:
        if case == "a":
            if rank == 0:
                torch.save(model.state_dict(), path)
        elif case == "b":
            sd = model.state_dict()
            if rank == 0:
                torch.save(sd, path)
        else:
            if rank == 0:
                time.sleep(8)  # an evaluation: late, not wrong
            torch.save(model.state_dict(), f"{path}.{rank}")
        dist.barrier()
    except Exception as error:
        say(f"ERROR {time.time()} {type(error).__name__}: {error}")
        raise
    say("DONE")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
