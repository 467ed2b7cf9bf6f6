"""Process-group setup for scripts started by ``torchrun`` (examples, benchmarks)."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def init_from_torchrun(timeout: datetime.timedelta = datetime.timedelta(minutes=5)) -> torch.device:
    """Initialise the default process group from torchrun's environment and
    return this rank's device (NCCL and its GPU with CUDA, else gloo on CPU).
    ``timeout`` bounds every collective."""
    use_cuda = torch.cuda.is_available()
    # one store serves every restart (--max-restarts): a key prefix per attempt
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"fsdp_compose/attempt_{attempt}", store)
    dist.init_process_group("nccl" if use_cuda else "gloo", store=store, rank=rank,
                            world_size=world_size, timeout=timeout)
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cuda")
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))
    return torch.device("cpu")
