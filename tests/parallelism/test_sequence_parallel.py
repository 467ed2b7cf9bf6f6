"""SequenceParallel in the TP plan (dp 2 x tp 2, 4 ranks): inside each block
the residual stream is sharded on the sequence dim over tp, the norms run
on their sequence shard (``SequenceParallel``: TP-replicated parameters
whose gradients are partial sums over tp), the Colwise projections gather
the sequence, the Rowwise ones reduce-scatter back to it. The block takes
and gives the full sequence (``PrepareModuleInputOutput``), so the
embedding, final norm and head stay plain. Parity with one process on the
global batch (1e-5), clipping, and the tp collectives SP adds, counted.

Run: PYTHONPATH=. python -m pytest -q tests/parallelism/test_sequence_parallel.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInputOutput,
                                               RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from fsdp_compose import fully_shard
from tests.harness import run_distributed
from tests.parallelism.test_tensor_parallel import (DIM, HEADS, LAYERS, Block, Model, _assert_parity,
                                        _local, train_loop)
import tests.parallelism.test_tensor_parallel as tp_test

SEQ = 6  # sharded over tp=2 on the sequence dim


class SPBlock(Block):
    """``Block`` whose attention reads the sequence length from the
    projections (under SP the block's input is a sequence shard)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        h = self.norm1(x)
        q, k, v = (proj(h) for proj in (self.q, self.k, self.v))
        t = q.shape[1]  # the whole sequence: Colwise gathered it
        q, k, v = (z.view(b, t, -1, DIM // HEADS).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, t, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


SP_PLAN = {
    "norm1": SequenceParallel(), "norm2": SequenceParallel(),
    "q": ColwiseParallel(input_layouts=Shard(1)), "k": ColwiseParallel(input_layouts=Shard(1)),
    "v": ColwiseParallel(input_layouts=Shard(1)), "o": RowwiseParallel(output_layouts=Shard(1)),
    "up": ColwiseParallel(input_layouts=Shard(1)), "down": RowwiseParallel(output_layouts=Shard(1)),
}
BLOCK_IO = PrepareModuleInputOutput(
    input_layouts=Replicate(), desired_input_layouts=Shard(1), use_local_input=True,
    output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True)
"""The block's input (the full sequence on every tp rank) becomes this tp
rank's sequence shard; its output (a sequence shard) is all-gathered."""


def build_model() -> Model:
    return tp_test.build_model(SPBlock)


def global_batch(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, tp_test.VOCAB, (2 * dp, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _train(optim_name, steps=3, max_norm=None, count_step=None):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = build_model()
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], BLOCK_IO)
        parallelize_module(block, mesh["tp"], SP_PLAN)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return train_loop(model, mesh, optim_name, lambda t: _local(t, mesh), 2, steps=steps,
                      max_norm=max_norm, count_step=count_step, batch=global_batch)


def train_reference(optim_name, steps=3, max_norm=None):
    return tp_test.train_reference(optim_name, steps, max_norm, dp=2, build=build_model,
                                   batch=global_batch)


@pytest.mark.parametrize("optim_name", ["sgd", "adamw"])
def test_parity_with_one_process(optim_name):
    """AdamW: also the SP norms' gradients, partial sums over tp, must be
    summed over tp exactly once (Adam's update would hide a uniform scale,
    but not a missing tp rank's part)."""
    results = run_distributed(4, _train, optim_name, count_step=2 if optim_name == "sgd" else None,
                              timeout=120)
    _assert_parity(results, train_reference(optim_name))
    if optim_name == "sgd":
        for res in results:
            got = res["counts"]
            # per block, over tp: forward all-gathers the sequence for each
            # Colwise input (q, k, v, up) and the block's output; backward
            # all-gathers the gradients of the Rowwise outputs (o, down) and of
            # the block's input (its forward was a local chunk). Reduce-scatters:
            # the Rowwise outputs in forward, the Colwise input gradients in
            # backward. All-reduces: the SP norms' weight and bias gradients.
            # Over dp: FSDP's, as without SP (the blocks one bucket: the
            # root once, the bucket in forward, each block in backward, where
            # it is the first bucket reached; two reductions).
            blocks = LAYERS
            assert got == {("all_gather_into_tensor", "tp"): 8 * blocks,
                           ("reduce_scatter_tensor", "tp"): 6 * blocks,
                           ("all_reduce", "tp"): 4 * blocks,
                           ("_allgather_base_", "dp"): 2 + blocks,
                           ("_reduce_scatter_base_", "dp"): 2,
                           ("allreduce_", "dp"): 1}, got


def test_clipping_matches_one_process():
    results = run_distributed(4, _train, "sgd", max_norm=0.5, timeout=120)
    reference = train_reference("sgd", max_norm=0.5)
    assert all(n > 0.5 for n in reference["norms"]), reference["norms"]
    _assert_parity(results, reference)
