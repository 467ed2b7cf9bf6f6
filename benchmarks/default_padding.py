"""Padding of the default placement against "flat" and explicit "rows", on
the benchmark models (layout math only: no ranks, no tensors), and how many
parameters of 2+ dimensions the default makes "flat" (issue 34).

    .venv/bin/python -m benchmarks.default_padding
"""

from __future__ import annotations

import torch

from benchmarks.run import SCENARIOS
from fsdp_compose.setup.units import assign_placements
from fsdp_compose.buffers.records import BufferPolicy, buffer_layout, group_records
from fsdp_compose.testing import GPT
from fsdp_compose.tools.planner.units import resolve_units

PLAIN = BufferPolicy(None, None, None, False, False)  # fp32, no offload


def padding(model: torch.nn.Module, world: int, placement: object) -> tuple[int, int, int, int]:
    """(padding, elements, n-D parameters "flat", n-D parameters) over the
    blocks + root units of ``model`` under ``placement``."""
    pad = numel = flat = n_dim = 0
    for spec in resolve_units(model, [*model.blocks, model]):
        assign_placements(spec.records, placement, None, world)
        for group in group_records(spec.records):
            layout = buffer_layout(group, world, PLAIN)
            pad, numel = pad + layout.padding, numel + layout.numel
        many = [r for r in spec.records if len(r.shape) > 1]
        flat, n_dim = flat + sum(r.placement == "flat" for r in many), n_dim + len(many)
    return pad, numel, flat, n_dim


def main() -> None:
    print("| model | ranks | \"flat\" | explicit \"rows\" | default | n-D params flat under the default |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in ("default", "many-small"):
        with torch.device("meta"):
            model = GPT(SCENARIOS[name]["cfg"])
        for world in (2, 8, 64):
            cells = [padding(model, world, p) for p in ("flat", "rows", None)]
            shares = " | ".join(f"{pad / numel:.2%}" for pad, numel, _, _ in cells)
            print(f"| {name} | {world} | {shares} | {cells[2][2]} / {cells[2][3]} |")


if __name__ == "__main__":
    main()
