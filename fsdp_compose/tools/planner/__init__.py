"""Per-rank memory of a ``fully_shard`` annotation, planned in one process
with no process group and no real memory (the model may live on ``meta``).

Usage::

    from fsdp_compose.tools.planner import estimate_memory, propose_units

    with torch.device("meta"):
        model = Transformer(cfg)                 # shapes only
    print(estimate_memory(model, world_size=8))  # every block, then the root
    estimate_memory(model, world_size=8, mp_policy=bf16, batch_fn=lambda m: m.loss(x, y))
    estimate_memory(model, world_size=8, bucket_cap_mb=4, split_root=True)
    units, estimate = propose_units(model, world_size=8, budget_bytes=20 * 2**30)
    for unit in units:                           # bottom-up, the root last
        fully_shard(unit)

``fully_shard`` needs a process group, so the annotation is given as
``units``: what would be passed to ``fully_shard``, in call order. Each unit
takes the parameters of its subtrees that no earlier unit took and groups
them into flat buffers as ``group_records`` does: the same functions
``fully_shard`` runs (``fsdp_compose/setup/units.py``); the estimate then replays
one training step of the library's schedule.
``tests/tools/test_planner.py`` checks it against the profiler on 2 gloo ranks.

Parts: ``units.py`` (which parameters each unit takes, through
``fully_shard``'s own setup code), ``split.py`` (the units
``fully_shard_root`` adds), ``buckets.py`` (which units share their
collectives, ``BucketPlan``'s rule), ``simulation.py`` (the step replayed on
byte counts, [Note: the simulated step]), ``activations.py`` (fake-tensor
forward), ``report.py`` (the table), ``estimate.py`` (entry points).
"""

from .estimate import BACKENDS, OPTIMIZER_MOMENTS, Proposal, estimate_memory, propose_units
from .report import MemoryEstimate, PeakParts
from .units import default_units

__all__ = ["BACKENDS", "OPTIMIZER_MOMENTS", "MemoryEstimate", "PeakParts", "Proposal",
           "default_units", "estimate_memory", "propose_units"]
