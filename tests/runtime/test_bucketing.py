"""Bucketing across units ([Note: bucketing] in
``runtime/collective_queue.py``): the same numbers bit for bit as without it, fewer
collectives, counted, and the unsharded memory bound kept."""

import pytest
import torch
import torch.distributed as dist

from fsdp_compose import PrefetchPolicy, describe
from fsdp_compose.runtime.buckets import DEFAULT_BUCKET_CAP_MB
from fsdp_compose.runtime.state import state_of
from fsdp_compose.testing import GPT, GPTConfig
from tests._comm_counter import ALL_GATHER as AG, REDUCE_SCATTER as RS, CollectiveCounter
from tests._training import local_batch, make_optimizer, shard_blocks_and_root, shard_on_a_new_group
from tests.harness import TEST_DEVICE, run_distributed

CFG = GPTConfig(n_layers=5)
DEFAULT = DEFAULT_BUCKET_CAP_MB


def _train(cap_mb, optim_name, steps=4, count=False):
    """Every rank: ``steps`` steps with ``set_bucket_cap_mb(cap_mb)``; the
    parameters after them, and the collectives of the last step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = shard_blocks_and_root(GPT(CFG).to(TEST_DEVICE))
    if cap_mb is not None:
        model.set_bucket_cap_mb(cap_mb)
    optim = make_optimizer(model, optim_name)
    units = [state_of(b).unit for b in model.blocks] + [state_of(model).unit]
    peak = [0]

    def probe(*_):  # the unsharded bytes at every block's forward and backward
        held = sum(b.layout.padded_numel * 4 for u in units for b in u.buffers
                   if b.is_unsharded or b.is_gathering)
        peak[0] = max(peak[0], held)
    for block in model.blocks:
        block.register_forward_pre_hook(probe)
        block.register_full_backward_pre_hook(probe)
    counts = None
    for step in range(steps):
        x, y = local_batch(step, rank, world)
        if count and step == steps - 1:
            with CollectiveCounter() as comm:
                model.loss(x, y).backward()
            counts = dict(comm.counts)
        else:
            model.loss(x, y).backward()
        optim.step()
        optim.zero_grad()
    collectives = state_of(model).context.collectives
    return {"params": [p.detach().clone() for p in model.parameters()],
            "all_gathers": counts and counts.get(AG, 0),
            "reduce_scatters": counts and counts.get(RS, 0),
            "buckets": [len(b.units) for b in collectives.buckets.buckets],
            "described": describe(model).buckets,
            "described_text": str(describe(model)),
            "block_bytes": sum(b.layout.padded_numel * 4 for b in units[0].buffers),
            "root_bytes": sum(b.layout.padded_numel * 4 for b in units[-1].buffers),
            "peak_unsharded": peak[0]}


@pytest.mark.parametrize("world,optim_name", [
    pytest.param(2, "adamw", marks=pytest.mark.slow), (3, "sgd")])
def test_bucketing_is_bit_identical(world, optim_name):
    off = run_distributed(world, _train, 0, optim_name)
    on = run_distributed(world, _train, None, optim_name)  # the default: on
    for a, b in zip(off, on):
        assert a["buckets"] == [] and b["buckets"] == [CFG.n_layers]
        assert a["described"] == () and b["described"] == (
            tuple(f"blocks.{i}" for i in range(CFG.n_layers)),)
        assert "bucket of" not in a["described_text"]
        assert f"bucket of {CFG.n_layers} units (one all-gather in forward, one per unit in " \
            "backward (the first bucket backward reaches), one reduce-scatter): blocks.0, " \
            "blocks.1" in b["described_text"]
        assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"]))


def test_bucketing_counts_collectives_and_keeps_the_memory_bound():
    off = run_distributed(2, _train, 0, "sgd", 3, True)[0]
    on = run_distributed(2, _train, DEFAULT, "sgd", 3, True)[0]
    blocks = CFG.n_layers
    # off: the root once, every block in forward and backward; one reduction each
    assert (off["all_gathers"], off["reduce_scatters"]) == (1 + 2 * blocks, blocks + 1)
    # on: the root once, the bucket of all blocks in forward; in backward, where
    # it is the first bucket reached, every block alone; one bucket reduction
    assert (on["all_gathers"], on["reduce_scatters"]) == (2 + blocks, 2)
    # unsharded at once: at most max_inflight_all_gathers (2) buckets, each at most
    # the cap (here: every block), plus the root
    limit = PrefetchPolicy().max_inflight_all_gathers
    assert on["peak_unsharded"] <= on["root_bytes"] + limit * blocks * on["block_bytes"]
    assert off["peak_unsharded"] <= off["root_bytes"] + (limit + 1) * off["block_bytes"]


def _steps(model, optim, steps: int, before_each) -> None:
    """``steps`` training steps of this rank's batches, ``before_each()`` first in each."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(steps):
        before_each()
        x, y = local_batch(step, rank, world)
        model.loss(x, y).backward()
        optim.step()
        optim.zero_grad()


def _filled_at_each_block():
    """Two buckets, blocks 0-2 and 3-4: right after each block's unit
    unsharded for its forward and for its backward in the last step, which
    blocks' unsharded storages hold memory, and which are still gathering."""
    from fsdp_compose.runtime.unit import Unit
    torch.manual_seed(0)
    model = shard_blocks_and_root(GPT(CFG).to(TEST_DEVICE))
    block_bytes = sum(b.layout.padded_numel * 4 for b in state_of(model.blocks[0]).unit.buffers)
    model.set_bucket_cap_mb(3.5 * block_bytes / 2 ** 20)
    optim = make_optimizer(model, "sgd")
    units = [state_of(b).unit for b in model.blocks]
    seen = []
    original = Unit.pre_forward, Unit.pre_backward

    def record(moment, unit):
        if unit in units:
            seen.append((moment, units.index(unit),
                         [any(b.unsharded.untyped_storage().nbytes() > 0 for b in u.buffers)
                          for u in units],
                         [any(b.is_gathering for b in u.buffers) for u in units]))

    def pre_forward(self, *args):
        original[0](self, *args)
        record("forward", self)

    def pre_backward(self):
        original[1](self)
        record("backward", self)
    Unit.pre_forward, Unit.pre_backward = pre_forward, pre_backward
    try:
        _steps(model, optim, 4, seen.clear)
    finally:
        Unit.pre_forward, Unit.pre_backward = original
    buckets = [len(b.units) for b in state_of(model).context.collectives.buckets.buckets]
    return buckets, seen


def test_a_bucket_fills_each_member_at_its_own_wait():
    # [Note: a bucket's copies]: the members a bucket's all-gather brings
    # are given memory one by one, when each unit runs, not all at the
    # first member's wait (which held twice the bucket's bytes at once)
    blocks = CFG.n_layers
    for buckets, seen in run_distributed(2, _filled_at_each_block):
        assert buckets == [3, 2]
        assert [(moment, index) for moment, index, _, _ in seen] == \
            [("forward", i) for i in range(blocks)] + \
            [("backward", i) for i in reversed(range(blocks))]
        for moment, index, filled, gathering in seen:
            assert filled[index] and not gathering[index], (moment, index, filled)
            bucket = range(3) if index < 3 else range(3, blocks)
            if moment == "backward" and index >= 3:
                # the first bucket backward reaches: each member its own all-gather,
                # the next one prefetched alone (filled at issue); block 3 prefetches
                # the other bucket as one (filled at each member's wait)
                expected = [False] * blocks
                if index == 4:
                    expected[3] = True
                assert filled == [j == index or expected[j] for j in range(blocks)], \
                    (index, filled)
                assert gathering == [j < 3 if index == 3 else j == 3 for j in range(blocks)], \
                    (index, gathering)
                continue
            ahead = [j for j in bucket if (j > index if moment == "forward" else j < index)]
            assert not any(filled[j] for j in ahead), (moment, index, filled)
            assert all(gathering[j] for j in ahead), (moment, index, gathering)


def test_a_cap_below_the_unit_size_changes_nothing():
    # units above the cap are never bucketed: a model of large units runs as before
    small = run_distributed(2, _train, 1e-3, "sgd", 3, True)[0]
    assert small["buckets"] == []
    assert (small["all_gathers"], small["reduce_scatters"]) == (1 + 2 * CFG.n_layers,
                                                                CFG.n_layers + 1)


def _negative_cap_raises() -> str:
    torch.manual_seed(0)
    model = shard_blocks_and_root(GPT(CFG).to(TEST_DEVICE))
    with pytest.raises(ValueError, match="set_bucket_cap_mb") as error:
        model.set_bucket_cap_mb(-1)
    return str(error.value)


def test_bucket_cap_must_not_be_negative():
    assert all(">= 0" in message for message in run_distributed(2, _negative_cap_raises))


class _Uneven(torch.nn.Module):
    """Four blocks of different sizes (one bucket) under a root without
    parameters; ``skip`` leaves one out."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, h), torch.nn.Tanh(), torch.nn.Linear(h, 16))
            for h in (8, 24, 40, 12))

    def forward(self, x: torch.Tensor, skip=None) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i != skip:
                x = block(x)
        return x


def _diverge_inside_a_bucket(at_step: int):
    """Rank 1 skips blocks.1 at ``at_step`` (after the verified iterations):
    its bucket collectives must still pair, and every rank raise a named
    error at the end of that backward (before: different sizes, gloo
    aborted the process)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _Uneven()
    group = shard_on_a_new_group(model, 40, DEFAULT)
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(at_step + 2):
        skip = 1 if rank == 1 and step == at_step else None
        try:
            model(torch.randn(4, 16), skip).sum().backward()
        except RuntimeError as error:
            return step, [len(b.units) for b in state_of(model).context.collectives.buckets.buckets], \
                str(error)
        optim.step()
        optim.zero_grad()
    dist.destroy_process_group(group)
    return None


def test_a_unit_skipped_inside_a_bucket_is_named_on_every_rank():
    results = run_distributed(2, _diverge_inside_a_bucket, 4, timeout=90)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} trained through the divergence"
        step, buckets, message = result
        assert (step, buckets) == (4, [4]), (step, buckets, message)
        assert message.startswith(f"[rank {rank}] fully_shard ranks diverged"), message
        assert "at the end of the forward, before the backward communicated" in message, message
        assert "'blocks.1'" in message and "'blocks.2'" in message, message
        assert "every rank must run the forward of every unit" in message, message


def _backward_bucket_gathers():
    """Two buckets of two blocks ([0, 1], [2, 3]): which unit issued each
    bucket all-gather of the last step's backward, and whether as a prefetch."""
    from fsdp_compose.runtime.collective_queue import CollectiveQueue
    torch.manual_seed(0)
    model = shard_blocks_and_root(GPT(GPTConfig(n_layers=4)).to(TEST_DEVICE))
    block_bytes = sum(b.layout.padded_numel * 4 for b in state_of(model.blocks[0]).unit.buffers)
    model.set_bucket_cap_mb(2.5 * block_bytes / 2 ** 20)
    optim = make_optimizer(model, "sgd")
    issued, original, gather = [], CollectiveQueue._gather_bucket, CollectiveQueue.gather
    issuers = []  # the unit whose pre-forward or pre-backward is gathering

    def gathering(self, unit, prefetch, ran):
        issuers.append(unit)
        try:
            return gather(self, unit, prefetch, ran)
        finally:
            issuers.pop()

    def recording(self, unit, issuer, ran, limited=False):
        before = len(self._gathers)
        done = original(self, unit, issuer, ran, limited)
        if len(self._gathers) > before and issuer.name != "FORWARD":
            issued.append((issuers[-1].name, unit.name, limited))
        return done
    CollectiveQueue._gather_bucket, CollectiveQueue.gather = recording, gathering
    try:
        _steps(model, optim, 4, issued.clear)
    finally:
        CollectiveQueue._gather_bucket, CollectiveQueue.gather = original, gather
    buckets = [[u.name for u in b.units] for b in state_of(model).context.collectives.buckets.buckets]
    return buckets, issued


def test_the_next_bucket_is_prefetched_in_backward():
    # the last bucket of forward is gathered member by member in backward
    # (the first bucket backward reaches); the one before it must then be
    # prefetched as one (in flight while block 2 runs backward), not left to
    # its own pre-backward
    for buckets, issued in run_distributed(2, _backward_bucket_gathers):
        assert buckets == [[f"'blocks.{i}' (Block)" for i in pair]
                           for pair in ((0, 1), (2, 3))], buckets
        assert [(issuer.split()[0], unit.split()[0], limited)
                for issuer, unit, limited in issued] == [
            ("'blocks.2'", "'blocks.1'", True)], issued
