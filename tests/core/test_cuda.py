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

from fsdp_compose import fully_shard
from fsdp_compose.testing import GPT, GPTConfig
from tests._owners import buffer_of
from tests._training import assert_parity, train_reference, train_sharded
from tests.harness import TEST_DEVICE, run_distributed, run_nccl

pytestmark = pytest.mark.skipif(TEST_DEVICE.type != "cuda",
                                reason="CUDA mode only (make test-gpu)")

ATOL = 1e-5
UNEVEN = GPTConfig(vocab_size=101, seq_len=16, d_model=40, n_heads=4, n_layers=3)
MEDIUM = GPTConfig(vocab_size=1001, seq_len=32, d_model=128, n_heads=4, n_layers=4)


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


def held_between_steps(shard: bool) -> int:
    """GPU bytes a model holds after a backward (parameters and gradients),
    counted from after a warm-up product that allocates cuBLAS's workspace
    (once per stream, through the caching allocator)."""
    warm = torch.randn(64, 64, device=TEST_DEVICE, requires_grad=True)
    (warm @ warm).sum().backward()
    del warm
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    model = GPT(MEDIUM).to(TEST_DEVICE)
    if shard:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    x = torch.randint(MEDIUM.vocab_size, (4, MEDIUM.seq_len), device=TEST_DEVICE)
    model.loss(x, x).backward()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - base


def test_a_sharded_model_holds_half_between_steps():
    sharded = run_distributed(2, held_between_steps, True)
    unsharded = run_distributed(2, held_between_steps, False)
    for held_s, held_u in zip(sharded, unsharded):
        # unsharded: parameters + gradients; sharded: half of each, plus padding
        assert held_s < 0.55 * held_u, (held_s, held_u)
