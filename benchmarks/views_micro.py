"""Micro-benchmark: what the parameter views of a unit cost the host, and
what the FSDP2-like alternative (leaf parameters made once) would cost.

    PYTHONPATH=. .venv/bin/python -m benchmarks.views_micro
    PYTHONPATH=. .venv/bin/python -m benchmarks.views_micro --units 48 --rounds 15

Issue 36 asks for less host time per unit. The last notes proposed
replacing the per-forward views node (``SplitIntoParams``: one custom
autograd node per buffer and forward, an ``as_strided`` per parameter, one
concatenation in backward) by leaf parameters made once per unshard, as
FSDP2 does. This measures that choice alone, without the rest of the
library: a chain of ``--units`` GPT-like blocks (d=16, 12 parameters each,
the host-cost proxy's block) whose parameters are one flat buffer per block,
forward + backward + clearing the gradients, in one thread:

* ``plain``: every parameter its own leaf tensor (the unsharded model);
* ``views_node``: a custom ``autograd.Function`` per block and forward that
  returns the ``as_strided`` views and concatenates their gradients into the
  flat gradient in backward (the shape of ``SplitIntoParams``);
* ``native_split``: torch's differentiable ``split_with_sizes`` and a
  ``view`` per multi-dimensional parameter, per block and forward, with one
  pre-hook on the split's backward node (what used-parameter tracking
  needs): C++ backward nodes (a ``ViewBackward`` per parameter, one
  ``SplitWithSizesBackward``) instead of the Python one;
* ``leaves``: views of the flat buffer made once as leaf tensors, a small
  ``autograd.Function`` on each block's input per forward (FSDP2's
  post-backward trigger), the flat gradient concatenated from the leaves'
  ``.grad`` after backward;
* ``leaves_in_place``: as ``leaves``, but each leaf's ``.grad`` is a view
  of the flat gradient set once, so ``AccumulateGrad`` adds in place and
  nothing is concatenated (the flat gradient is zeroed per step).

Reported: the best round's median step and µs per block over ``plain``, and
the median over rounds of that per-block difference (variants run one after
another within each round). CPU time of the thread (``time.thread_time_ns``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

WIDTH = 16
SHAPES = [(WIDTH,), (WIDTH,), (3 * WIDTH, WIDTH), (3 * WIDTH,), (WIDTH, WIDTH), (WIDTH,),
          (WIDTH,), (WIDTH,), (4 * WIDTH, WIDTH), (4 * WIDTH,), (WIDTH, 4 * WIDTH), (WIDTH,)]
"""A GPT block's parameters: two layer norms, qkv, attention out, the MLP."""
SIZES = [torch.Size(shape).numel() for shape in SHAPES]
OFFSETS = [sum(SIZES[:i]) for i in range(len(SIZES))]
STRIDES = [torch.empty(shape, device="meta").stride() for shape in SHAPES]
TOTAL = sum(SIZES)


def _views(flat: torch.Tensor) -> list[torch.Tensor]:
    return [flat.as_strided(s, st, o) for s, st, o in zip(SHAPES, STRIDES, OFFSETS)]


def _block(x: torch.Tensor, p: list[torch.Tensor]) -> torch.Tensor:
    h = F.linear(F.layer_norm(x, (WIDTH,), p[0], p[1]), p[2], p[3])[..., :WIDTH]
    x = x + F.linear(h, p[4], p[5])
    h = F.layer_norm(x, (WIDTH,), p[6], p[7])
    return x + F.linear(F.gelu(F.linear(h, p[8], p[9])), p[10], p[11])


class _ViewsNode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, flat):  # type: ignore[override]
        return tuple(_views(flat))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        return torch.cat([g.reshape(-1) for g in grads])


class _PostBackwardTrigger(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad


class _Leaves:
    def __init__(self, flat: torch.Tensor, in_place: bool) -> None:
        self.flat_grad = torch.zeros_like(flat)
        self.params = [v.requires_grad_() for v in _views(flat.detach())]
        self.in_place = in_place
        if in_place:
            for param, grad in zip(self.params, _views(self.flat_grad)):
                param.grad = grad

    def after_backward(self) -> None:
        if self.in_place:
            self.flat_grad.zero_()
            return
        torch.cat([p.grad.reshape(-1) for p in self.params], out=self.flat_grad)
        for p in self.params:
            p.grad = None


def _saw_gradients(grads) -> None:
    """What the buffer's used-parameter flags read: which parts got a gradient."""
    [g is not None for g in grads]


def _step_fn(variant: str, units: int) -> Callable[[], None]:
    x0 = torch.randn(2, 8, WIDTH)
    if variant == "plain":
        blocks = [[torch.randn(s, requires_grad=True) for s in SHAPES] for _ in range(units)]

        def step() -> None:
            x = x0
            for params in blocks:
                x = _block(x, params)
            x.sum().backward()
            for params in blocks:
                for p in params:
                    p.grad = None
        return step
    flats = [torch.randn(TOTAL, requires_grad=True) for _ in range(units)]
    if variant == "views_node":
        def step() -> None:
            x = x0
            for flat in flats:
                x = _block(x, list(_ViewsNode.apply(flat)))
            x.sum().backward()
            for flat in flats:
                flat.grad = None
        return step
    if variant == "native_split":
        def step() -> None:
            x = x0
            for flat in flats:
                parts = flat.split_with_sizes(SIZES)
                parts[0].grad_fn.register_prehook(_saw_gradients)
                x = _block(x, [p.view(s) if len(s) > 1 else p for p, s in zip(parts, SHAPES)])
            x.sum().backward()
            for flat in flats:
                flat.grad = None
        return step
    leaves = [_Leaves(flat, in_place=variant == "leaves_in_place") for flat in flats]

    def step() -> None:
        x = x0
        for unit in leaves:
            x = _block(_PostBackwardTrigger.apply(x), unit.params)
        x.sum().backward()
        for unit in leaves:
            unit.after_backward()
    return step


def _median_step_us(step: Callable[[], None], steps: int) -> float:
    times = []
    for _ in range(steps):
        begin = time.thread_time_ns()
        step()
        times.append(time.thread_time_ns() - begin)
    return statistics.median(times) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--units", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    variants = ["plain", "views_node", "native_split", "leaves", "leaves_in_place"]
    steps = {v: _step_fn(v, args.units) for v in variants}
    for step in steps.values():
        step()  # warm-up
    rounds: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            rounds[v].append(_median_step_us(steps[v], args.steps))
    plain = rounds["plain"]
    print(f"{args.units} blocks (d={WIDTH}, {len(SHAPES)} parameters each); {args.rounds} rounds x "
          f"{args.steps} steps; thread CPU time; torch {torch.__version__}")
    print("| variant | best round's median step µs | µs per block over plain (best) | "
          "µs per block over plain, median of rounds |")
    print("|---|---|---|---|")
    for v in variants:
        per_round = [(r - p) / args.units for r, p in zip(rounds[v], plain)]
        print(f"| {v} | {min(rounds[v]):.0f} | {(min(rounds[v]) - min(plain)) / args.units:.1f} | "
              f"{statistics.median(per_round):.1f} |")


if __name__ == "__main__":
    main()
