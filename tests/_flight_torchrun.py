"""Run by ``tests/checks/test_flight_log.py`` under torchrun (2 gloo ranks): rank 1
skips blocks.2 at step ``sys.argv[1]``; each rank prints the error it gets
and exits 0 (torchrun stops the job at the first non-zero exit, before the
other rank could print).

    PYTHONPATH=. FSDP_COMPOSE_STALL_SECONDS=3 torchrun --standalone \\
        --nproc-per-node 2 tests/_flight_torchrun.py 5
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from fsdp_compose import fully_shard
from fsdp_compose.testing.launch import init_from_torchrun
from tests.checks.test_flight_log import Uniform


def main(at_step: int) -> None:
    init_from_torchrun()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Uniform()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.set_bucket_cap_mb(0)  # unbucketed: buckets pair and are named at the end of backward
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(at_step + 3):
        start = time.perf_counter()
        skip = 2 if rank == 1 and step == at_step else None
        try:
            model(torch.randn(4, 16), skip).sum().backward()
        except RuntimeError as error:
            # one write: print() writes the text and its newline separately, and
            # the other rank's report could land between them
            os.write(1, f"RANK {rank} STEP {step} AFTER {time.perf_counter() - start:.1f} S\n"
                        f"{error}\nEND\n".encode())
            os._exit(0)  # the group paired mismatched collectives: no clean teardown
        optim.step()
        optim.zero_grad()
    os.write(1, f"RANK {rank} TRAINED THROUGH\n".encode())
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]))
