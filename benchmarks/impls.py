"""The four data-parallel implementations under comparison, one ``build_<name>``
function each. Not run directly: ``benchmarks/run.py`` uses them, e.g.

    .venv/bin/python -m benchmarks.run --scenario all

Every builder takes the plain, freshly seeded ``GPT`` (the same initial values
on every rank) and returns the module to call for the forward pass. Nothing
else differs between implementations: the loss, the optimizer (AdamW over the
returned module's ``parameters()``) and the data are built by the caller.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_compose.testing import GPT
from fsdp_compose.testing.gpt import Block


def build_ddp(model: GPT) -> nn.Module:
    """torch ``DistributedDataParallel`` (replicated parameters, bucketed
    all-reduce of gradients overlapped with backward)."""
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(model)


def build_fsdp2(model: GPT) -> nn.Module:
    """torch FSDP2: ``torch.distributed.fsdp.fully_shard`` on every block,
    then on the root (DTensor parameters)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def build_fsdp1(model: GPT) -> nn.Module:
    """torch FSDP1: ``FullyShardedDataParallel(use_orig_params=True)`` with a
    transformer auto-wrap policy on ``Block`` (so the units are the blocks and
    the root, as for the other two FSDP implementations)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    return FullyShardedDataParallel(model, auto_wrap_policy=policy, use_orig_params=True,
                                    device_id=torch.device("cpu"))


def build_fsdp_compose(model: GPT, gloo_all_reduce: bool = True,
                       retain_staging: bool = False, bf16: Optional[str] = None,
                       placement: Optional[str] = None, bucket_cap_mb: Optional[float] = None,
                       split_root: bool = False, check_divergence: Optional[bool] = None,
                       quantize: Optional[str] = None,
                       shard_placement_fn: Optional[Callable] = None,
                       separate_reduce_scatter_group: bool = False) -> nn.Module:
    """This project: ``fsdp_compose.fully_shard`` on every block, then on the
    root. The keyword arguments make the A/B variants below (defaults: the
    library's defaults)."""
    from fsdp_compose import (MixedPrecisionPolicy, PrefetchPolicy, fully_shard,
                              fully_shard_root, set_gloo_reduce_scatter_via_all_reduce)
    comm = quantized_comm_policy(quantize)
    mp = None
    if bf16 is not None:  # bf16 compute, fp32 reduction; "comm": the collective in bf16
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                  reduce_comm_dtype=torch.bfloat16 if bf16 == "comm" else None)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp, placement=placement, comm_policy=comm,
                    shard_placement_fn=shard_placement_fn)
    if split_root:  # the root's parameters gathered and reduced where they are used
        fully_shard_root(model, mp_policy=mp, placement=placement)
    else:
        fully_shard(model, mp_policy=mp, placement=placement, comm_policy=comm,
                    shard_placement_fn=shard_placement_fn)
    if bucket_cap_mb is not None:
        model.set_bucket_cap_mb(bucket_cap_mb)
    if retain_staging:
        model.set_prefetch_policy(PrefetchPolicy(retain_staging=True))
    if check_divergence is not None:
        model.set_check_rank_divergence(check_divergence)
    if separate_reduce_scatter_group:
        model.set_separate_reduce_scatter_group()
    # the gloo setting is process-wide: each variant sets its own at its forward
    def set_gloo_path(*_) -> None:
        set_gloo_reduce_scatter_via_all_reduce(gloo_all_reduce)

    model.register_forward_pre_hook(set_gloo_path)
    return model


def build_compute_alone(model: GPT) -> nn.Module:
    """The model as it is, every rank stepping on its own batch with no
    collective: the compute floor of any data-parallel step here (its loss
    differs from the reference, by design)."""
    return model


def shard_large_params(param: nn.Parameter):
    """A ``shard_placement_fn``: ``Shard(0)`` for the parameters of 1 MiB or
    more (each split over every rank, as FSDP2 splits every parameter),
    the default placement for the rest."""
    from torch.distributed.tensor import Shard
    return Shard(0) if param.numel() * param.element_size() >= 2 ** 20 else None


QUANTIZED_MODES = ("int8-weights", "int8", "fp8")
"""``CommPolicy`` modes the benchmarks compare: int8 all-gather only, int8
all-gather and reduction, fp8 e4m3 both."""


def quantized_comm_policy(mode: Optional[str]):
    """The ``CommPolicy`` of a mode of :data:`QUANTIZED_MODES` (``None``: exact)."""
    from fsdp_compose import CommPolicy
    if mode is None:
        return None
    if mode == "int8-weights":
        return CommPolicy(all_gather=torch.int8)
    code = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[mode]
    return CommPolicy(all_gather=code, reduce_scatter=code)


BUILDERS: dict[str, Callable[[GPT], nn.Module]] = {
    "fsdp_compose": build_fsdp_compose,
    "fsdp2": build_fsdp2,
    "fsdp1": build_fsdp1,
    "ddp": build_ddp,
}
"""Name -> builder, in the order tables and plots list them."""

VARIANTS: dict[str, Callable[[GPT], nn.Module]] = {
    "fsdp_compose_rs": functools.partial(build_fsdp_compose, gloo_all_reduce=False),
    "fsdp_compose_retain": functools.partial(build_fsdp_compose, retain_staging=True),
    "fsdp_compose_bf16": functools.partial(build_fsdp_compose, bf16="fp32-comm"),
    "fsdp_compose_bf16comm": functools.partial(build_fsdp_compose, bf16="comm"),
    "fsdp_compose_rows": functools.partial(build_fsdp_compose, placement="rows"),
    "fsdp_compose_flat": functools.partial(build_fsdp_compose, placement="flat"),
    "fsdp_compose_owned": functools.partial(build_fsdp_compose, placement="owned"),
    "fsdp_compose_nobucket": functools.partial(build_fsdp_compose, bucket_cap_mb=0),
    # no forward agreement (nor verification): its cost, against "fsdp_compose"
    "fsdp_compose_noagree": functools.partial(build_fsdp_compose, check_divergence=False),
    "fsdp_compose_bucket1": functools.partial(build_fsdp_compose, bucket_cap_mb=1),
    "fsdp_compose_bucket4": functools.partial(build_fsdp_compose, bucket_cap_mb=4),
    "fsdp_compose_split": functools.partial(build_fsdp_compose, split_root=True),
    "fsdp_compose_int8w": functools.partial(build_fsdp_compose, quantize="int8-weights"),
    "fsdp_compose_int8": functools.partial(build_fsdp_compose, quantize="int8"),
    "fsdp_compose_fp8": functools.partial(build_fsdp_compose, quantize="fp8"),
    "fsdp_compose_shard0": functools.partial(build_fsdp_compose, placement=None,
                                             shard_placement_fn=shard_large_params),
    "fsdp_compose_rsgroup": functools.partial(build_fsdp_compose,
                                              separate_reduce_scatter_group=True),
    "compute_alone": build_compute_alone,
}
"""A/B variants of fsdp_compose, only run when named in ``--impls``: gloo's
own reduce-scatter (``set_gloo_reduce_scatter_via_all_reduce(False)``), and
the staging pool kept between steps (``PrefetchPolicy(retain_staging=True)``),
bf16 compute with fp32 reduction communicated in fp32 or (``reduce_comm_dtype``)
in bf16, the ``"rows"`` / ``"flat"`` / ``"owned"`` placements
(``docs/placements.md``; ``"fsdp_compose"`` has the library's default,
``"rows"`` with a buffer of its own on a CPU mesh for a parameter a rank
would hold much more of than FSDP2 does),
bucketing off (``set_bucket_cap_mb(0)``; the default is 2 MiB) or with a 1
or 4 MiB cap (4: the earlier default), the root's embeddings and its
final norm + head annotated as units of their own (``fully_shard_root``: gathered and reduced where they are used, the
head's reduction overlaps the rest of backward), and quantized collectives
(``CommPolicy``: int8 all-gather; int8 all-gather and reduction; fp8 both),
``Shard(0)`` for the parameters of 1 MiB or more (``shard_large_params``:
each read through an assembled copy, ``docs/placements.md``), the
reduce-scatters on a process group of their own
(``set_separate_reduce_scatter_group()``: gloo runs one collective at a
time per group), and the compute floor (``compute_alone``: no collective)."""


def units_of(model: GPT) -> list[list[nn.Parameter]]:
    """The sharding units every FSDP implementation here uses: one per block,
    plus the root (embeddings, final norm, head). Used by the analytic bound."""
    taken: set[int] = set()
    units = []
    for block in model.blocks:
        params = list(block.parameters())
        taken.update(id(p) for p in params)
        units.append(params)
    units.append([p for p in model.parameters() if id(p) not in taken])
    return units
