"""The public surface: identities and names, views inside and outside
forward, manual unshard/reshard, output containers, no_grad/eval forwards,
and the composable-API registry."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_compose import ShardedModule, fully_shard, param_info
from tests._owners import buffer_of
from fsdp_compose.testing import GPT
from tests._training import shard_blocks_and_root
from tests.harness import run_distributed


def identity_names_and_shapes():
    model = GPT()
    before = dict(model.named_parameters())
    shapes = {n: p.shape for n, p in before.items()}
    buffers_before = dict(model.named_buffers())
    modules_before = [n for n, _ in model.named_modules()]
    shard_blocks_and_root(model)
    after = dict(model.named_parameters())
    assert list(after) == list(before) and all(after[n] is before[n] for n in before)
    assert dict(model.named_buffers()).keys() == buffers_before.keys()
    assert [n for n, _ in model.named_modules()] == modules_before
    assert isinstance(model, GPT) and isinstance(model, ShardedModule)
    assert isinstance(model.blocks[0], ShardedModule) and not isinstance(model.ln_f, ShardedModule)

    seen_in_forward = {}

    def record(module, args):
        seen_in_forward[module] = (module.ln1.weight.shape, module.attn.qkv.weight.shape)
    for block in model.blocks:
        block.register_forward_pre_hook(record)

    local_total = 0
    for name, p in model.named_parameters():
        info = param_info(p)
        assert info.fqn == name, (info.fqn, name)
        assert info.shape == shapes[name]
        assert p.ndim == len(info.shape) and p.numel() == info.local_numel  # rows: ndim kept
        local_total += p.numel()
    assert param_info(nn.Parameter(torch.ones(1))) is None

    tokens = torch.randint(97, (2, 16))
    model.loss(tokens, tokens).backward()
    for shape_ln, shape_qkv in seen_in_forward.values():
        assert shape_ln == (24,) and shape_qkv == (72, 24)
    for name, p in model.named_parameters():
        assert p.ndim == len(shapes[name]) and p is before[name]
        if p.numel():
            assert p.grad is not None and p.grad.shape == p.shape
    return local_total


def test_identity_names_and_shapes():
    totals = run_distributed(3, identity_names_and_shapes)
    full = sum(p.numel() for p in GPT().parameters())
    assert sum(totals) == full  # every element owned by exactly one rank


def manual_unshard_reshard():
    torch.manual_seed(0)
    model = GPT()
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    shard_blocks_and_root(model)
    originals = dict(model.named_parameters())
    handle = model.blocks[1].unshard(async_op=True)
    handle.wait()
    w = model.blocks[1].attn.qkv.weight
    assert not isinstance(w, nn.Parameter) and torch.equal(w, reference["blocks.1.attn.qkv.weight"])
    assert model.blocks[0].attn.qkv.weight is originals["blocks.0.attn.qkv.weight"]  # still sharded
    model.blocks[1].reshard()
    assert model.blocks[1].attn.qkv.weight is originals["blocks.1.attn.qkv.weight"]
    assert buffer_of(originals["blocks.1.attn.qkv.weight"]).unsharded.untyped_storage().nbytes() == 0

    model.unshard(recurse=True)
    for name, want in reference.items():
        owner, _, attr = name.rpartition(".")
        got = getattr(model.get_submodule(owner) if owner else model, attr)
        assert torch.equal(got, want), name
    model.reshard(recurse=True)
    for n, p in model.named_parameters():  # local pieces again, registered as before
        assert p is originals[n] and p.numel() == param_info(p).local_numel, n
        assert buffer_of(p).unsharded.untyped_storage().nbytes() == 0, n
    return True


def test_manual_unshard_and_reshard():
    assert all(run_distributed(2, manual_unshard_reshard))


@dataclasses.dataclass
class Output:
    hidden: torch.Tensor
    note: str


class ContainerModel(nn.Module):
    """Returns a different kind of container per ``kind``."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 4)

    def forward(self, x, kind):
        h = self.a(x)
        y = self.b(h)
        if kind == "tuple":
            return (y, h.detach())
        if kind == "dict":
            return {"y": y, "aux": [h]}
        if kind == "dataclass":
            return Output(hidden=y, note="ok")
        if kind == "nograd":
            return y.detach()
        return y


def _loss(out, kind):
    if kind == "tuple":
        return out[0].sum()
    if kind == "dict":
        return out["y"].sum() + out["aux"][0].sum()
    if kind == "dataclass":
        return out.hidden.sum()
    return out.sum()


def output_containers(kind):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = ContainerModel()
    reference = ContainerModel()
    reference.load_state_dict(model.state_dict())
    fully_shard(model.a)
    fully_shard(model.b)
    fully_shard(model)
    x = torch.randn(world * 2, 6, generator=torch.Generator().manual_seed(1))
    out = model(x[rank * 2:(rank + 1) * 2], kind)
    buffers = {id(buffer_of(p)): buffer_of(p) for p in model.parameters()}.values()
    if kind == "nograd":
        assert not any(b.is_unsharded for b in buffers), "no backward can come: all resharded"
        return True
    _loss(out, kind).backward()
    _loss(reference(x, kind), kind).backward()
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        info = param_info(p)
        want = r.grad.reshape(-1)[info.local_offset:info.local_offset + info.local_numel] / world
        if info.local_numel:
            assert torch.allclose(p.grad.reshape(-1), want, atol=1e-6), name
    assert not any(b.is_unsharded for b in buffers)
    return True


@pytest.mark.parametrize("kind", ["tensor", "tuple", "dict", "dataclass", "nograd"])
def test_output_containers(kind):
    assert all(run_distributed(2, output_containers, kind))


def no_grad_and_eval_forward():
    model = GPT()
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=False)
    fully_shard(model)
    tokens = torch.randint(97, (2, 16))
    model.eval()
    with torch.no_grad():
        model(tokens)
    with torch.inference_mode():
        model(tokens)
    buffers = {id(buffer_of(p)): buffer_of(p) for p in model.parameters()}.values()
    return [b.is_unsharded for b in buffers]


def test_no_grad_and_eval_forward_reshard_everything():
    for flags in run_distributed(2, no_grad_and_eval_forward):
        assert flags and not any(flags)


def registry_and_replicate():
    from torch.distributed._composable.contract import _get_registry
    model = GPT()
    fully_shard(model.blocks[0])
    fully_shard(model)
    assert "fully_shard" in _get_registry(model)
    return True


def test_composable_registry():
    assert all(run_distributed(1, registry_and_replicate))


IMPORT_CHANGES_NOTHING = """
import sys, tempfile, torch, torch.distributed as dist
from torch.optim.optimizer import _global_optimizer_pre_hooks as step_hooks
before = len(step_hooks)
zero_grad = torch.optim.Optimizer.zero_grad
import torch.distributed.checkpoint.state_dict as dcp_state_dict
init_optim_state = dcp_state_dict._init_optim_state
import fsdp_compose, fsdp_compose.checkpoint, fsdp_compose.tools
from fsdp_compose.gradients.torch_norms import is_routed
assert len(step_hooks) == before and not is_routed(), "importing the package changed the process"
assert torch.optim.Optimizer.zero_grad is zero_grad, "importing the package changed zero_grad"
assert dcp_state_dict._init_optim_state is init_optim_state, "importing changed _init_optim_state"
compiler = {"torch._dynamo", "torch._inductor"}
assert not compiler & set(sys.modules), "importing the package imported torch.compile's machinery"
dist.init_process_group("gloo", init_method="file://" + tempfile.mkdtemp() + "/rdzv", rank=0,
                        world_size=1)
fsdp_compose.fully_shard(torch.nn.Linear(2, 2))
assert len(step_hooks) == before + 5 and is_routed(), (len(step_hooks), before)
installed = torch.optim.Optimizer.zero_grad
assert installed is not zero_grad and installed.__wrapped__.__wrapped__ is zero_grad
model = fsdp_compose.fully_shard(torch.nn.Linear(2, 2))
assert len(step_hooks) == before + 5, "installed twice"
assert torch.optim.Optimizer.zero_grad is installed, "zero_grad replaced twice"
direct = dcp_state_dict._init_optim_state
assert direct is not init_optim_state and direct.__module__ == "fsdp_compose.checkpoint._init_state"
model(torch.randn(3, 2)).sum().backward()
assert not compiler & set(sys.modules), "a step without torch.compile imported torch._dynamo"
dist.destroy_process_group()
print("ok")
"""


def test_importing_changes_nothing_and_the_first_fully_shard_installs_each_hook_once():
    """Process-wide changes (norm routing, five optimizer step pre-hooks,
    ``Optimizer.zero_grad`` giving back kept gradient memory, a fresh
    optimizer's state for torch's state-dict functions made without a step)
    come with the first ``fully_shard``, not with ``import fsdp_compose``
    (a fresh interpreter: this one has annotated models already); neither
    imports torch.compile's machinery (``torch._dynamo``, half a second), nor
    does a forward and backward without ``torch.compile``."""
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-c", IMPORT_CHANGES_NOTHING], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
