"""The forward agreement: ranks about to run different forwards raise on
every rank before anything pairs wrongly.

[Note: forward agreement]
Collectives pair by issue order, and gloo aborts a process receiving a
message of another size than it posted: a rank running one more forward (an
evaluation on rank 0 only) would pair its collectives with the others'
backward. So every root forward over several ranks starts with a meeting
through the rendezvous store (which cannot mis-pair or abort), comparing
what each rank is about to do and did since the last meeting. A training
forward also ends with a meeting on the units it ran, in order, so a
skipped or reordered unit is caught before backward.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch.distributed as dist

from .._torch_private import default_store
from ..comm.agreement import agreed_max
from ..comm.groups import ShardGroup
from ..comm.rendezvous import CALL_TIMEOUT_ENV, LEFT, call_timeout, meet
from ..comm.wire import stall_seconds
from ..comm.whereabouts import Doing
from ..runtime.protocols import ObservedUnit
from .flight_log import FlightRecorder

CHECK_ENV = "FSDP_COMPOSE_CHECK_ORDER"
"""Set to ``1`` to verify the collective order in every iteration."""
MODE_BITS = 62
"""Units whose ``module.training`` the agreement compares (bits of one int64)."""


class ForwardAgreement:
    """The ranks of one model and its store keys (``<prefix>/<forward>/<rank>``)."""

    _models: dict[tuple[int, ...], int] = {}
    """ranks -> models set up over them so far in this process."""

    def __init__(self, ranks: list[int], prefix: str, units: Sequence[ObservedUnit],
                 flight: FlightRecorder, groups: Sequence[ShardGroup]) -> None:
        self.ranks: list[int] = ranks
        self.prefix: str = prefix
        self.me: int = dist.get_rank()
        self.forwards: int = 0
        self.last_key: Optional[str] = None
        self.last_end_key: Optional[str] = None
        self.moment: str = "starts"
        self.stalls: int = 0
        """Flight-log comparisons made while waiting at the current meeting."""
        self._units: Sequence[ObservedUnit] = units
        self._flight: FlightRecorder = flight
        self._groups: Sequence[ShardGroup] = groups

    @classmethod
    def of(cls, units: Sequence[ObservedUnit], flight: FlightRecorder,
           groups: Sequence[ShardGroup]) -> Optional["ForwardAgreement"]:
        """The agreement of a model whose root is ``units[0]``, or ``None`` over one
        rank or without a store. Collective (one small all-gather)."""
        group = units[0].group
        ranks = sorted(group.mesh.mesh.flatten().tolist())  # every shard group and replica
        if len(ranks) == 1:
            return None
        try:
            default_store()
        except (RuntimeError, ValueError):
            return None  # no default group: nothing to meet through
        members = tuple(ranks)
        number = agreed_max(cls._models.get(members, 0), group)
        cls._models[members] = number + 1
        return cls(ranks, f"fsdp_compose/agree/{'-'.join(map(str, members))}/{number}",
                   units, flight, groups)

    def before_forward(self, row: list[int]) -> None:
        """At the root's pre-forward: exchange ``row``; raise on every rank if the
        rows differ."""
        rows = self.exchange(row)
        if any(other != rows[0] for other in rows):
            _raise_forward_disagreement(self.ranks, rows, self._units)

    def after_forward(self, forward: int, order: Sequence[int]) -> None:
        """A training forward ended outside the verified iterations: agree on the
        units it ran before the backward's first collective."""
        rows = self.exchange_after_forward([forward, *order])
        if any(row != rows[0] for row in rows):
            _raise_forward_orders(self.ranks, rows, self._units)

    def exchange_after_forward(self, row: list[int]) -> list[list[int]]:
        """Every rank's ``row`` at the end of the current forward."""
        key = f"{self.prefix}/{self.forwards}/end"
        self.moment, self.stalls = "ends", 0
        values = meet(key, self.ranks, self.me, ",".join(map(str, row)),
                      f"the end of root forward #{self.forwards}", self._waiting,
                      self.last_end_key)
        self.last_end_key = f"{key}/{self.me}"
        return self._rows(values)

    def exchange(self, row: list[int]) -> list[list[int]]:
        self.forwards += 1
        self.moment, self.stalls = "starts", 0
        key = f"{self.prefix}/{self.forwards}"
        values = meet(key, self.ranks, self.me, ",".join(map(str, row)),
                      f"the forward agreement of root forward #{self.forwards}", self._waiting,
                      self.last_key)
        self.last_key = f"{key}/{self.me}"
        return self._rows(values)

    def _rows(self, values: Sequence[str]) -> list[list[int]]:
        left = {rank: value[len(LEFT):] for rank, value in zip(self.ranks, values)
                if value.startswith(LEFT)}
        if left:
            _raise_waiting_elsewhere(self.forwards, left, self.moment)
        return [[int(v) for v in value.split(",")] for value in values]

    def _waiting(self, waited: float, elsewhere: dict[int, str],
                 doing: dict[int, Doing]) -> None:
        """``rendezvous.meet``'s callback: raise if a missing rank waits at another
        library call or is blocked in a user's collective; every
        :func:`stall_seconds`, compare the flight logs."""
        other = {rank: what for rank, what in elsewhere.items() if what}
        moment = self.moment
        if other:
            _raise_waiting_elsewhere(self.forwards, other, moment)
        # one blocked in a data collective of ours is left to the flight logs
        blocked = {rank: d for rank, d in doing.items() if d.kind == "blocked" and not d.ours}
        if blocked:
            _raise_blocked(self.forwards, blocked, moment)
        if waited >= call_timeout():
            _raise_waiting_elsewhere(self.forwards, {
                rank: f"no collective call of fsdp_compose for {waited:.0f} s "
                      f"({CALL_TIMEOUT_ENV})" for rank in elsewhere}, moment)
        if waited // stall_seconds() > self.stalls:
            self.stalls += 1
            for group in self._groups:
                if group.world_size > 1:
                    self._flight.stalled(group.process_group, None, waited)
                    self._flight.recovered(group.process_group)


def divergence_advice(forward: bool) -> str:
    """The fix, for divergence in forward (``forward``) or in backward."""
    if forward:
        return ("A unit's forward ran on some ranks only (or in a different order): every rank "
                "must run the forward of every unit, in the same order, in every iteration (e.g. "
                "call a unit a rank would skip on an empty or zero-weighted input). "
                "set_reduce_scatter_unused_params(True) cannot fix forward-side divergence.")
    return ("A unit's backward (or reduction) ran on some ranks only: run every unit on every "
            "rank with its output reaching the loss (e.g. add 0 * output.sum()), or call "
            "set_reduce_scatter_unused_params(True) on those units (or the root) so every "
            "rank reduces them at the end of backward.")


def _raise_waiting_elsewhere(forward: int, where: dict[int, str], moment: str = "starts") -> None:
    """Other ranks wait at another meeting of the library."""
    lines = "\n".join(f"  rank {rank} waits at {what}" for rank, what in where.items())
    raise RuntimeError(
        f"[rank {dist.get_rank()}] fully_shard ranks diverged: this rank {moment} root forward "
        f"#{forward} while other ranks wait at a collective call of fsdp_compose:\n{lines}\n"
        "Collective calls (state_dict() values, clip_grad_norm_, unshard(), checkpoint saves, "
        "...) must be made on every rank, at the same point of training.")


def _raise_blocked(forward: int, blocked: dict[int, Doing], moment: str) -> None:
    lines = "\n".join("  " + d.blocks(rank) for rank, d in sorted(blocked.items()))
    raise RuntimeError(
        f"[rank {dist.get_rank()}] fully_shard ranks diverged: this rank {moment} root forward "
        f"#{forward} while other ranks are blocked in a collective of torch.distributed:\n"
        f"{lines}\nNeither can go on (this rank raises at once, before the forward "
        "communicated anything; the blocked collective fails when this process exits). Make "
        "that collective (a barrier, an all-reduce, a torch.distributed.checkpoint call, ...) "
        "on every rank at the same point, or run the forward on every rank before it.")


def _raise_forward_disagreement(ranks: Sequence[int], rows: Sequence[Sequence[int]],
                                units: Sequence[ObservedUnit]) -> None:
    """Each row: grad mode, root forwards, last backwards, digest, training modes."""
    me = dist.get_rank()
    grad = [row[0] for row in rows]
    if len(set(grad)) == 1 and all(row[:4] == rows[0][:4] for row in rows):
        _raise_training_modes(ranks, rows, units)
    if len(set(grad)) > 1 and all(row[1:4] == rows[0][1:4] for row in rows):
        without = [r for r, g in zip(ranks, grad) if not g]
        with_grad = [r for r, g in zip(ranks, grad) if g]
        raise RuntimeError(
            f"[rank {me}] fully_shard ranks diverged: ranks {without} are starting a forward of "
            f"the root without gradients (torch.no_grad(), e.g. an evaluation) where ranks "
            f"{with_grad} start one with gradients (training), at root forward #{rows[0][1]}; "
            "their collectives would pair a forward with a backward (detected before the "
            "forward, nothing was communicated). Every rank must run the same forwards: run the "
            "evaluation on every rank (each on its part of the data, then reduce the metric), "
            "or on a separate, unsharded copy of the model.")
    lines = [f"  rank {r}: root forward #{row[1]} "
             f"{'with' if row[0] else 'without'} gradients, root in "
             f"{'training' if row[4] & 1 else 'eval'} mode, after {row[2]} finished backwards, "
             f"collectives since the last forward {row[3]:#x}" for r, row in zip(ranks, rows)]
    raise RuntimeError(
        f"[rank {me}] fully_shard ranks diverged before a forward of the root (detected "
        "before it communicated anything, by comparing what each rank ran since the last "
        "forward):\n" + "\n".join(lines) + "\nEvery rank must run the same forwards and "
        "backwards of the model, in the same order (an evaluation, an extra forward or a "
        "skipped backward on some ranks only). Set "
        f"{CHECK_ENV}=1 (or call set_check_rank_divergence(True) on the root) to find the "
        "first collective that differs.")


def _raise_training_modes(ranks: Sequence[int], rows: Sequence[Sequence[int]],
                          units: Sequence[ObservedUnit]) -> None:
    modes = [row[4] for row in rows]
    if all(m & 1 == modes[0] & 1 for m in modes):  # the root agrees, some unit does not
        differing = [u for u in range(min(len(units), MODE_BITS))
                     if len({(m >> u) & 1 for m in modes}) > 1]
        what = "modules " + ", ".join(units[u].name for u in differing)
        by_rank = "; ".join(
            f"rank {r}: {', '.join(units[u].name for u in differing if not (m >> u) & 1) or 'none'}"
            for r, m in zip(ranks, modes))
        detail = f"{what} are in eval mode on some ranks only (in eval mode: {by_rank})"
    else:
        evaluating = [r for r, m in zip(ranks, modes) if not m & 1]
        training = [r for r, m in zip(ranks, modes) if m & 1]
        detail = (f"ranks {evaluating} have the model in eval mode (model.eval(), e.g. left "
                  f"from an evaluation) where ranks {training} have it in training mode")
    raise RuntimeError(
        f"[rank {dist.get_rank()}] fully_shard ranks diverged: at root forward #{rows[0][1]}, "
        f"{detail}, so the ranks would compute different functions (dropout, batch norm: "
        "nothing was computed yet). Call model.train() on every rank before training (after an "
        "evaluation on some ranks), or model.eval() on every rank for an evaluation on all of "
        "them.")


def _raise_forward_orders(ranks: Sequence[int], rows: Sequence[Sequence[int]],
                          units: Sequence[ObservedUnit]) -> None:
    """Each row: root forward number, then the units run, in order."""
    def names(row: Sequence[int]) -> str:
        return "[" + ", ".join(units[u].name if u < len(units) else f"unit #{u}"
                               for u in row[1:]) + "]"
    lines = [f"  rank {r} ran {names(row)}" for r, row in zip(ranks, rows)]
    raise RuntimeError(
        f"[rank {dist.get_rank()}] fully_shard ranks diverged: the ranks ran different units "
        f"in root forward #{rows[0][0]} (detected at the end of the forward, before the "
        "backward communicated anything):\n" + "\n".join(lines) + "\n" + divergence_advice(True))
