"""What loading a checkpoint allocates, in tensor bytes: torch's recipe
(``get_state_dict`` + ``dcp.load`` + ``set_state_dict``) and the flat path
(``flat_state_dict`` + ``FlatLoadPlanner``) into a fresh model and a fresh
AdamW allocate the optimizer state and nothing else, less than torch FSDP2
allocates for the same load.

The bytes are those of the new storages that tensor operations return
(counted by a ``TorchDispatchMode``), per phase: not the process's resident
set, which depends on what the allocator kept from earlier work and on the
machine. What FSDP2 allocates besides the state (the zero gradients and the
temporaries of torch's initialising zero step) fsdp_compose does not
(``checkpoint/_init_state.py``); its values are read in place
(``checkpoint/_lazy.py``, [Note: lazy checkpoint values]), so ``dcp.load``
and ``set_state_dict`` allocate nothing. DCP's reader (``torch.load`` of each
stored item, then a copy into the value) allocates outside tensor
operations: the same for both, not counted.

Run: PYTHONPATH=$PWD python -m pytest -q tests/checkpoint/test_checkpoint_load_memory.py
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from fsdp_compose.checkpoint import FlatLoadPlanner, FlatSavePlanner, flat_state_dict
from tests._training import build_model, make_optimizer
from tests.harness import run_distributed
from tests.core.test_placements import _adamw_step, shard_with

WORLD = 3  # uneven: the model's shapes leave padding in the flat shards
TIMEOUT = 120
PHASES = ("get_state_dict", "dcp.load", "set_state_dict")
FLAT = "fsdp_compose flat"  # flat_state_dict + FlatLoadPlanner


class _NewValueBytes(TorchDispatchMode):
    """Bytes of the floating-point storages that tensor operations return
    and did not get as inputs (a view or an in-place result is not new), by
    phase. Wrapper subclasses (``DTensor``) count through their inner
    tensors. Integer storages are left out: object collectives (DCP's plans,
    the optimizer state's summary) travel as bytes, a size per parameter or
    per plan, not per element. Meta tensors hold no memory."""

    def __init__(self) -> None:
        super().__init__()
        self.phase: str = ""
        self.bytes: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {_storage_key(t) for t in _storages(tree_leaves((args, kwargs)))}
        new = {_storage_key(t): t.untyped_storage().nbytes() for t in _storages(tree_leaves(out))
               if t.is_floating_point() and t.device.type != "meta"}
        self.bytes[self.phase] += sum(n for key, n in new.items() if key not in given)
        return out


def _storages(leaves: list) -> list[torch.Tensor]:
    """The tensors with storage among ``leaves``, wrapper subclasses unwrapped
    (a lazy chunk has none until it is converted)."""
    out = []
    for t in leaves:
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            out += _storages([getattr(t, name) for name in names])
        elif isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, nn.Parameter):
            out.append(t)
    return out


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _build(impl: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = build_model("gpt")
    if impl == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        shard_with(model, "rows")
    return model, make_optimizer(model, "adamw")


def _save(impl: str, model: nn.Module, optim: torch.optim.Optimizer, path: str) -> None:
    if impl == FLAT:
        msd, osd = flat_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path, planner=FlatSavePlanner())
    else:
        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def _take_and_read(impl: str, model: nn.Module, optim: torch.optim.Optimizer, path: str,
                   counter: "_NewValueBytes") -> tuple[dict, dict]:
    """The first two phases of the load (the state dict, ``dcp.load`` into it)."""
    counter.phase = "get_state_dict"
    msd, osd = (flat_state_dict if impl == FLAT else get_state_dict)(model, optim)
    counter.phase = "dcp.load"
    planner = FlatLoadPlanner() if impl == FLAT else None
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path, planner=planner)
    return msd, osd


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    msd, _ = get_state_dict(model, [])
    return {k: v.full_tensor() for k, v in msd.items()}


def load_allocations(impl: str, path: str) -> dict:
    """Train one step, save, then load into a fresh model and optimizer,
    counting what each phase of the load allocates on this rank."""
    model, optim = _build(impl)
    _adamw_step(model, optim, 0)
    _save(impl, model, optim, path)
    saved = _full(model)
    fresh, fresh_optim = _build(impl)
    counter = _NewValueBytes()
    with counter:
        msd, osd = _take_and_read(impl, fresh, fresh_optim, path, counter)
        counter.phase = "set_state_dict"
        set_state_dict(fresh, fresh_optim, model_state_dict=msd, optim_state_dict=osd)
    loaded = _full(fresh)
    state = sum(t.untyped_storage().nbytes() for s in fresh_optim.state.values()
                for t in _storages(list(s.values())))
    return {"phases": {p: counter.bytes[p] for p in PHASES}, "state": state,
            "exact": all(torch.equal(loaded[k], saved[k]) for k in saved)}


def test_load_allocates_the_optimizer_state_only_and_less_than_fsdp2(tmp_path):
    results = {impl: run_distributed(WORLD, load_allocations, impl, str(tmp_path / impl),
                                     timeout=TIMEOUT)
               for impl in ("fsdp_compose", FLAT, "fsdp2")}
    for impl, ranks in results.items():
        for rank, res in enumerate(ranks):
            print(f"{impl}, rank {rank}: {res}")
            assert res["exact"], f"{impl}, rank {rank}: the loaded values differ from the saved"
    for impl in ("fsdp_compose", FLAT):
        for rank, (ours, fsdp2) in enumerate(zip(results[impl], results["fsdp2"])):
            phases, where = ours["phases"], f"{impl}, rank {rank}"
            # the state, made directly (no zero gradient, no step); nothing converted
            assert phases["get_state_dict"] == ours["state"], (where, ours)
            # read and set in place: no copy of any value
            assert phases["dcp.load"] == 0 and phases["set_state_dict"] == 0, (where, phases)
            # FSDP2 allocates the same state, plus the zero step's gradients
            assert sum(phases.values()) < sum(fsdp2["phases"].values()), (where, ours, fsdp2)
