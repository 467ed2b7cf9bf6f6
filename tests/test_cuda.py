"""What only a GPU shows: NCCL at world size 1, where the buffers live, and
GPU memory counted by the CUDA caching allocator. CUDA mode only (``make
test-gpu``: ``FSDP_COMPOSE_TEST_DEVICE=cuda``); the default suite skips them.

Parity on CUDA is the CPU suite's own tests run in CUDA mode (``make
test-gpu`` lists them): the model and the batches are built on the CPU with
the same seeds and moved to the GPU, ranks share the GPU over gloo, and the
one-process reference runs on the same GPU.
"""

import pytest
import torch
import torch.distributed as dist

from fsdp_compose import fully_shard
from fsdp_compose.testing import GPT, GPTConfig
from tests._owners import buffer_of
from tests._training import assert_parity, train_reference, train_sharded
from tests.harness import TEST_DEVICE, run_distributed, run_nccl

pytestmark = pytest.mark.skipif(TEST_DEVICE.type != "cuda",
                                reason="CUDA mode only (make test-gpu)")

ATOL = 1e-5
UNEVEN = GPTConfig(vocab_size=101, seq_len=16, d_model=40, n_heads=4, n_layers=3)


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_nccl_world_size_1_equals_one_process(optim):
    results = run_nccl(1, train_sharded, "blocks+root", optim, 3)
    assert_parity(results, train_reference(1, optim, 3), ATOL)


def buffers_and_gradients_on_the_gpu():
    """fully_shard with no mesh, over gloo, on a model already on the GPU:
    parameters, gradients and optimizer state stay on it."""
    model = GPT(UNEVEN).to(TEST_DEVICE)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(UNEVEN.vocab_size, (2, UNEVEN.seq_len), device=TEST_DEVICE)
    model.loss(x, x).backward()
    optim.step()
    return {"params": {p.device.type for p in model.parameters()},
            "grads": {p.grad.device.type for p in model.parameters() if p.grad is not None},
            "state": {s.device.type for st in optim.state.values() for s in st.values()
                      if torch.is_tensor(s) and s.dim() > 0}}


def test_default_mesh_follows_the_parameters_onto_the_gpu():
    for result in run_distributed(2, buffers_and_gradients_on_the_gpu):
        assert result == {"params": {"cuda"}, "grads": {"cuda"}, "state": {"cuda"}}


def sharded_bytes_on_the_gpu():
    """GPU bytes the caching allocator holds for the model before and after
    fully_shard (the unsharded originals must be freed), and the bytes of
    the shards the library says it holds, each rounded up to the
    allocator's 512-byte blocks."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model = GPT(UNEVEN).to(TEST_DEVICE)
    full = torch.cuda.memory_allocated() - before
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    torch.cuda.synchronize()
    sharded = torch.cuda.memory_allocated() - before
    buffers = {id(buffer_of(p)): buffer_of(p) for p in model.parameters()}.values()
    shards = sum(-(-b.sharded.numel() * b.sharded.element_size() // 512) * 512 for b in buffers)
    return full, sharded, shards


@pytest.mark.parametrize("world", [2, 3])
def test_sharding_frees_the_unsharded_parameters_on_the_gpu(world):
    for full, sharded, shards in run_distributed(world, sharded_bytes_on_the_gpu):
        assert shards <= sharded <= shards + 64 * 1024, (full, sharded, shards)
        assert sharded < full / world * 1.1, (full, sharded)


def peak_during_a_step(shard: bool):
    """Peak GPU bytes of one training step above what is held before it."""
    model = GPT(UNEVEN).to(TEST_DEVICE)
    if shard:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    x = torch.randint(UNEVEN.vocab_size, (4, UNEVEN.seq_len), device=TEST_DEVICE)
    model.loss(x, x).backward()  # gradients allocated once
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated()
    model.loss(x, x).backward()
    torch.cuda.synchronize()
    return held, torch.cuda.max_memory_allocated() - held


def test_a_sharded_step_holds_less_than_an_unsharded_one():
    sharded = run_distributed(2, peak_during_a_step, True)
    unsharded = run_distributed(2, peak_during_a_step, False)
    for (held_s, _), (held_u, _) in zip(sharded, unsharded):
        # between steps: sharded parameters and gradients, about half
        assert held_s < 0.6 * held_u, (held_s, held_u)
