"""Pipeline parallelism with ``torch.distributed.pipelining`` over
fully_shard-annotated stages: 2 pipeline stages x 2-way data parallel = 4
ranks, 4 micro-batches per step, ``ScheduleGPipe`` and ``Schedule1F1B``,
through :class:`fsdp_compose.pipelining.PipelineStage`.

The model is ``tests/parallelism/test_tensor_parallel.py``'s (no TP here): stage 0 is the
embedding and block 0, stage 1 is block 1, the final norm and the head; the
loss is the mean cross-entropy of a micro-batch, and the schedule divides
the accumulated gradients by the number of micro-batches, so a step equals
one process training on the global batch (parity 1e-5, SGD-momentum and
AdamW). All-gathers over dp are counted per step: with
``reshard_after_forward=False`` every unit is gathered once per step under
both schedules; with the default (blocks reshard after each forward) a
block is gathered once per micro-batch's forward and once for all the
backwards (they keep it unsharded until the last). Gradients are reduced
once per step (one reduce-scatter per unit). Memory between micro-batches:
after each micro-batch's forward, GPipe holds no block whole by default and
the stage's block with ``reshard_after_forward=False``; every unit is
resharded when ``step()`` returns.

Run: PYTHONPATH=. python -m pytest -q tests/parallelism/test_pipeline.py
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from fsdp_compose import fully_shard
from fsdp_compose.pipelining import PipelineStage
from tests._comm_counter import ALL_GATHER, REDUCE_SCATTER, CollectiveCounter
from fsdp_compose.runtime.state import state_of
from tests._owners import buffer_of
from tests.harness import run_distributed
from tests.parallelism.test_tensor_parallel import DIM, SEQ, VOCAB, build_model, make_optimizer

MICRO, ROWS = 4, 1  # micro-batches per step, rows per micro-batch
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class FirstStage(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.embed = model.embed
        self.blocks = nn.ModuleList([model.blocks[0]])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return x


class LastStage(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([model.blocks[1]])
        self.norm = model.norm
        self.head = model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _full_name(stage_index: int, name: str) -> str:
    """A stage's parameter name in the whole model (stage 1's block 0 is block 1)."""
    if stage_index == 1 and name.startswith("blocks."):
        _, i, rest = name.split(".", 2)
        return f"blocks.{int(i) + 1}.{rest}"
    return name


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def global_batch(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``dp * MICRO * ROWS`` rows: each dp rank's slice is split into MICRO
    micro-batches by the schedule."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (dp * MICRO * ROWS, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _train(schedule_name, optim_name, steps=3, reshard_after_forward=None, count_step=None,
           static=True):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank = mesh["pp"].get_local_rank()
    model = build_model()
    stage_module = (FirstStage if pp_rank == 0 else LastStage)(model)
    for block in stage_module.blocks:
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
    fully_shard(stage_module, mesh=mesh["dp"])
    # static shapes (no shape-inference pass); activations require grad
    example_in = (torch.zeros(ROWS, SEQ, dtype=torch.long) if pp_rank == 0
                  else torch.zeros(ROWS, SEQ, DIM, requires_grad=True))
    example_out = torch.zeros(ROWS, SEQ, DIM if pp_rank == 0 else VOCAB, requires_grad=True)
    shapes = {"input_args": example_in, "output_args": example_out} if static else {}
    stage = PipelineStage(stage_module, pp_rank, 2, torch.device("cpu"),
                          group=mesh["pp"].get_group(), **shapes)
    schedule = SCHEDULES[schedule_name](stage, n_microbatches=MICRO, loss_fn=loss_fn)
    whole_blocks: list[int] = []  # after each micro-batch's forward: blocks held unsharded

    def census(module, args, output):
        whole_blocks.append(sum(any(b.unsharded.untyped_storage().size() > 0
                                    for b in state_of(block).unit.buffers)
                                for block in stage_module.blocks))

    stage_module.register_forward_hook(census)
    res = _run_steps(schedule, [stage_module], optim_name, mesh, steps, count_step)
    if res["counts"] is not None:
        res["counts"]["whole_blocks"] = whole_blocks[-MICRO * (steps - count_step):][:MICRO]
    res["params"] = {_full_name(pp_rank, k): v.full_tensor()
                     for k, v in stage_module.state_dict().items()}
    return res


def _run_steps(schedule, modules, optim_name, mesh, steps, count_step) -> dict:
    """``steps`` steps of ``schedule`` over this rank's stage ``modules``
    (pp rank 0 feeds the tokens, pp rank 1 computes the losses), each dp
    rank on its slice of the global batch. Returns this rank's pp rank, the
    mean losses (pp rank 1), the all-gathers and reduce-scatters of step
    ``count_step`` and whether every unit was resharded after every step."""
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    optims = [make_optimizer(m, optim_name) for m in modules]
    losses, counts, resharded = [], None, []
    for step in range(steps):
        x, y = global_batch(step, 2)
        # contiguous: torch 2.11's stage checks the inputs' strides against input_args
        x, y = x.chunk(2)[dp_rank].contiguous(), y.chunk(2)[dp_rank]
        counter = CollectiveCounter()
        with counter if step == count_step else _null():
            if pp_rank == 0:
                schedule.step(x)
            else:
                mb_losses: list = []
                schedule.step(target=y, losses=mb_losses)
        if step == count_step:
            counts = {"all_gather": counter.counts[ALL_GATHER],
                      "reduce_scatter": counter.counts[REDUCE_SCATTER]}
        resharded.append(all(buffer_of(p).unsharded.untyped_storage().size() == 0
                             for m in modules for p in m.parameters()))
        for optim in optims:
            optim.step()
            optim.zero_grad()
        if pp_rank == 1:
            loss = torch.stack([l.detach() for l in mb_losses]).mean()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
            losses.append(loss.item())
    return {"stage": pp_rank, "losses": losses, "counts": counts, "resharded": all(resharded)}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@functools.cache
def _reference(optim_name, steps=3):
    """One process on the global batch (the mean loss over all rows); once
    per configuration (callers only read it)."""
    model = build_model()
    optim = make_optimizer(model, optim_name)
    losses = []
    for step in range(steps):
        x, y = global_batch(step, 2)
        loss = model.loss(x, y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "params": params}


def _assert_parity(results, reference, atol=1e-5):
    seen = set()
    for res in results:
        for name, got in res["params"].items():
            diff = (got - reference["params"][name]).abs().max().item()
            assert diff <= atol, f"stage {res['stage']}: {name} differs by {diff}"
            seen.add(name)
        if res["stage"] == 1:
            assert res["losses"] == pytest.approx(reference["losses"], abs=atol)
    assert seen == set(reference["params"]), seen ^ set(reference["params"])


@pytest.mark.parametrize("schedule_name,optim_name", [("gpipe", "sgd"), ("1f1b", "adamw")])
def test_parity_with_one_process_and_one_gather_per_unit(schedule_name, optim_name):
    """``reshard_after_forward=False`` (FSDP2's advice for pipelining): each
    stage's two units (its block and the stage root) are gathered once per
    step and reduced once per step, whatever the schedule interleaves."""
    results = run_distributed(4, _train, schedule_name, optim_name, reshard_after_forward=False,
                              count_step=2, timeout=150)
    _assert_parity(results, _reference(optim_name))
    for res in results:
        counts = dict(res["counts"])
        whole = counts.pop("whole_blocks")
        assert counts == {"all_gather": 2, "reduce_scatter": 2}, res
        # memory: the stage's block stays whole between micro-batches
        assert whole == [1] * MICRO, whole
        assert res["resharded"], res  # every unit resharded between steps


def test_dynamic_shapes():
    """Without ``input_args`` / ``output_args`` torch infers the shapes with
    one real forward and backward at the first step; the steps still equal
    one process, and the counted step gathers and reduces each unit once."""
    results = run_distributed(4, _train, "gpipe", "adamw", reshard_after_forward=False,
                              count_step=2, static=False, timeout=150)
    _assert_parity(results, _reference("adamw"))
    for res in results:
        counts = dict(res["counts"])
        counts.pop("whole_blocks")
        assert counts == {"all_gather": 2, "reduce_scatter": 2}, res
        assert res["resharded"], res


@pytest.mark.parametrize("schedule_name", ["gpipe", "1f1b"])
def test_default_resharding_gathers_per_micro_batch_forward(schedule_name):
    """Default ``reshard_after_forward`` (the blocks reshard after each
    forward; the root keeps its parameters until backward). A non-last
    backward keeps the block unsharded, so a forward that follows a
    backward gathers nothing. GPipe (F0..F3 then B0..B3): a block is
    gathered by each forward and by the first backward: MICRO + 1. 1F1B on
    2 stages (stage 0: F0 F1 B0 F2 B1 F3 B2 B3; stage 1: F0 B0 F1 B1 ...):
    also MICRO + 1 (stage 0: F0 F1 B0 B1 B2; stage 1: F0 B0 B1 B2 B3). Plus
    the root once. Gradients are still reduced once per step. With torch's
    own PipelineStage (no DP integration for a module that is not torch's
    FSDPModule) this step measures 8 all-gathers and 8 reduce-scatters."""
    results = run_distributed(4, _train, schedule_name, "sgd", count_step=2, timeout=150)
    _assert_parity(results, _reference("sgd"))
    for res in results:
        counts = dict(res["counts"])
        whole = counts.pop("whole_blocks")
        assert counts == {"all_gather": MICRO + 2, "reduce_scatter": 2}, res
        if schedule_name == "gpipe":  # between GPipe's forwards no block is whole
            assert whole == [0] * MICRO, whole
        assert res["resharded"], res


def _refusals():
    plain = nn.Linear(4, 4)
    out = {}
    try:
        PipelineStage(plain, 0, 2, torch.device("cpu"))
    except TypeError as e:
        out["plain"] = str(e)
    fully_shard(plain)
    stage = PipelineStage(plain, dist.get_rank(), 2, torch.device("cpu"),
                          input_args=torch.zeros(1, 4), output_args=torch.zeros(1, 4))
    try:  # what a zero-bubble schedule asks for
        stage.backward_maybe_with_nosync("input", {}, last_backward=False)
    except NotImplementedError as e:
        out["split"] = str(e)
    return out


def test_refusals_name_the_combination():
    for res in run_distributed(2, _refusals, timeout=60):
        assert "needs a stage module annotated by fully_shard, got Linear" in res["plain"], res
        assert "split backward ('input')" in res["split"] and "zero-bubble" in res["split"], res


class _Part(nn.Module):
    """One of four interleaved stages: a slice of the model's modules, in order."""

    def __init__(self, **parts: nn.Module) -> None:
        super().__init__()
        for name, module in parts.items():
            setattr(self, name, module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in self.children():
            if isinstance(module, nn.ModuleList):
                for block in module:
                    x = block(x)
            else:
                x = module(x)
        return x


def _interleaved_stages(model: nn.Module) -> list[nn.Module]:
    """embed + block 0 | block 1 | final norm | head: stage ``i`` runs on pp
    rank ``i % 2``, so each rank holds two stages (Interleaved1F1B)."""
    return [_Part(embed=model.embed, blocks=nn.ModuleList([model.blocks[0]])),
            _Part(blocks=nn.ModuleList([model.blocks[1]])),
            _Part(norm=model.norm), _Part(head=model.head)]


_INTERLEAVED_NAMES = [{"embed": "embed", "blocks.0": "blocks.0"}, {"blocks.0": "blocks.1"},
                      {"norm": "norm"}, {"head": "head"}]


def _train_interleaved(optim_name, steps=3, count_step=None):
    from torch.distributed.pipelining import ScheduleInterleaved1F1B
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank = mesh["pp"].get_local_rank()
    parts = _interleaved_stages(build_model())
    mine = [i for i in range(4) if i % 2 == pp_rank]
    stages, modules = [], []
    for i in mine:
        module = parts[i]
        for block in getattr(module, "blocks", []):
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
        fully_shard(module, mesh=mesh["dp"])
        modules.append(module)
        stages.append(PipelineStage(module, i, 4, torch.device("cpu"),
                                    group=mesh["pp"].get_group()))
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=MICRO, loss_fn=loss_fn)
    res = _run_steps(schedule, modules, optim_name, mesh, steps, count_step)
    params = {}
    for i, module in zip(mine, modules):
        for k, v in module.state_dict().items():
            prefix = next(p for p in _INTERLEAVED_NAMES[i] if k.startswith(p + "."))
            params[_INTERLEAVED_NAMES[i][prefix] + k[len(prefix):]] = v.full_tensor()
    res["params"] = params
    return res


def test_interleaved_1f1b_two_stages_per_rank():
    """Four stages on two pp ranks (each rank runs stages i and i + 2, each
    its own root): parity with one process; per step each rank gathers and
    reduces each of its flat buffers once: pp rank 0 holds block 0, stage
    0's root (the embedding) and stage 2's (the norm); pp rank 1 holds block
    1 and stage 3's root (the head); stage 1's root owns no parameter."""
    results = run_distributed(4, _train_interleaved, "adamw", count_step=2, timeout=150)
    _assert_parity(results, _reference("adamw"))
    for res in results:
        want = 3 if res["stage"] == 0 else 2
        assert res["counts"] == {"all_gather": want, "reduce_scatter": want}, res
        assert res["resharded"], res
