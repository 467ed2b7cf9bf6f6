"""A bucket's packed temporaries hold no memory once its collective is done
([Note: freeing what a collective read] in
``runtime/collective_queue.py``; the packing is the wire's, ``comm/wire.py``).

gloo keeps a finished collective's input and output tensors alive for a
while, sometimes through the next step (6 MiB held after the step on one
rank of the many-small benchmark). The test holds every tensor a bucketed
collective was given, as gloo may, and checks that the memory is gone
anyway after the step."""

import torch
import torch.distributed as dist

from fsdp_compose.comm import wire as coalesced
from fsdp_compose.runtime.state import state_of
from fsdp_compose.testing import GPT, GPTConfig
from tests._training import local_batch, make_optimizer, shard_blocks_and_root
from tests.harness import run_distributed


def _held_collective_tensors_after_a_step():
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = shard_blocks_and_root(GPT(GPTConfig(n_layers=4)))
    model.set_bucket_cap_mb(4)
    optim = make_optimizer(model, "adamw")
    units = [state_of(b).unit for b in model.blocks] + [state_of(model).unit]
    shards = {b.sharded.untyped_storage().data_ptr() for u in units for b in u.buffers}
    held: list[tuple[str, torch.Tensor]] = []
    gather, reduce = coalesced.all_gather_into, coalesced.reduce_scatter_scaled
    # a buffer's own collectives (a bucket of one) move one buffer's padded size;
    # only a bucket's packed collectives move another (the sum of its members')
    alone = {b.layout.padded_numel for u in units for b in u.buffers}

    def gather_and_hold(output, shard, *args, **kwargs):
        if output.numel() not in alone:
            held.extend([("all-gather output", output), ("all-gather input", shard)])
        return gather(output, shard, *args, **kwargs)

    def reduce_and_hold(output, flat, *args, **kwargs):
        if flat.numel() not in alone:
            held.extend([("reduce output", output), ("reduce input", flat)])
        return reduce(output, flat, *args, **kwargs)

    coalesced.all_gather_into, coalesced.reduce_scatter_scaled = gather_and_hold, reduce_and_hold
    try:
        for step in range(3):  # the bucket plan is in use from the third step
            x, y = local_batch(step, rank, world)
            model.loss(x, y).backward()
            optim.step()
            optim.zero_grad()
    finally:
        coalesced.all_gather_into, coalesced.reduce_scatter_scaled = gather, reduce
    buckets = [len(b.units) for b in state_of(model).context.collectives.buckets.buckets]
    return buckets, [(what, t.untyped_storage().nbytes()) for what, t in held
                     if t.untyped_storage().data_ptr() not in shards]


def test_packed_temporaries_are_freed_when_their_collective_is_done():
    for buckets, still_held in run_distributed(2, _held_collective_tensors_after_a_step):
        assert max(buckets) > 1, buckets  # some units are gathered and reduced together
        kinds = {what for what, _ in still_held}
        assert kinds == {"all-gather output", "all-gather input", "reduce output",
                         "reduce input"}, kinds
        assert all(nbytes == 0 for _, nbytes in still_held), still_held
