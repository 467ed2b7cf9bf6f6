"""Detect ranks whose collectives belong to different units.

[Note: rank divergence]
Collectives pair by issue order, not by unit, so rank-dependent control
flow makes ranks hang or mix values. *Verification* all-gathers what each
rank is about to issue before every data collective, until the ranks
agree at the end of two last backwards (or always, with
``set_check_rank_divergence(True)``). The *fingerprint* (always on), a
rolling hash per group, rides on the used flags' MAX all-reduce as bytes
and their complements (summing to 255 iff every rank had it). A changed
count of collectives stalls a wait instead ([Note: flight log]).
"""

from __future__ import annotations

import os
from collections import deque
from enum import IntEnum
from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from ..buffers.flat_buffer import FlatBuffer
from ..comm.agreement import all_gather_fingerprints
from ..comm.groups import ShardGroup
from ..runtime.model_settings import ModelSettings
from ..runtime.protocols import CollectiveObserver, ObservedUnit
from ..runtime.training_state import TrainingState
from .flight_log import FlightRecorder, Ring
from .forward_agreement import CHECK_ENV, MODE_BITS, ForwardAgreement, divergence_advice

VERIFICATION_ITERATIONS = 2
"""Last backwards the ranks agree on before verification stops."""
VERIFICATION_FORWARD_LIMIT = 8
"""Root forwards without gradients verified by default."""
_LOG_LIMIT = 4096  # per window
_MASK = (1 << 64) - 1
_FNV_OFFSET, _FNV_PRIME = 0xCBF29CE484222325, 0x100000001B3


class Kind(IntEnum):
    """Its value is part of the compared code."""

    ALL_GATHER = 0
    REDUCE_SCATTER = 1
    END_OF_BACKWARD = 2
    FORWARD = 3
    """A unit's place in the forward order."""


class Phase(IntEnum):

    FORWARD = 0
    BACKWARD = 1
    NONE = 2


_KIND_TEXT = {Kind.ALL_GATHER: "all-gather", Kind.REDUCE_SCATTER: "reduce-scatter",
              Kind.END_OF_BACKWARD: "end of backward", Kind.FORWARD: "forward"}
FINGERPRINT_BYTES = 16
"""Bytes appended to one group's used flags."""


class Collective(NamedTuple):

    kind: Kind
    unit: int  # in the root's state list
    buffer: int  # in its unit
    phase: Phase

    @property
    def code(self) -> int:
        """The 63-bit value the verification compares."""
        return (self.kind << 56) | (self.phase << 52) | (self.unit << 20) | self.buffer

    def describe(self, units: Sequence[ObservedUnit]) -> str:
        if self.kind is Kind.END_OF_BACKWARD:
            return "end-of-backward all-reduce (no more unit collectives)"
        name = units[self.unit].name if self.unit < len(units) else f"unit #{self.unit}"
        if self.kind is Kind.FORWARD:
            return f"forward of {name} (in the root's forward order)"
        return (f"{_KIND_TEXT[self.kind]} of {name} (buffer {self.buffer}) in "
                f"{self.phase.name.lower()}")


def _decode(code: int) -> Collective:
    return Collective(Kind((code >> 56) & 0x7F), (code >> 20) & 0xFFFFFFFF, code & 0xFFFFF,
                      Phase((code >> 52) & 0xF))


class DivergenceMonitor(CollectiveObserver):
    """The model's ``CollectiveObserver``. Invariant: ``_fingerprints`` and
    ``_logs`` hold a group's collectives since its last comparison."""

    def __init__(self) -> None:
        self._settings: ModelSettings = ModelSettings()
        self.verifying: bool = False
        self.iterations: int = 0
        self.agreed_forwards: int = 0
        self.agreed_backwards: int = 0
        self.backwards: int = 0
        self._agreement: Optional[ForwardAgreement] = None
        self._since_agreement: int = _FNV_OFFSET
        self._units: list[ObservedUnit] = []
        self._groups: list[ShardGroup] = []
        self._communicates: bool = False
        self._where: dict[int, tuple[int, int]] = {}
        self._index: dict[int, int] = {}
        self._fingerprints: dict[int, int] = {}
        self._logs: dict[int, deque[Collective]] = {}
        self.flight: FlightRecorder = FlightRecorder(
            lambda code: _decode(code).describe(self._units),
            lambda codes: divergence_advice(any(_decode(c).phase is Phase.FORWARD for c in codes)))
        self._rings: dict[int, Ring] = {}
        """id(process group) -> its ring in :attr:`flight`."""

    def bind(self, units: Sequence[ObservedUnit], settings: ModelSettings) -> None:
        """Number the units."""
        self._settings = settings
        self._units = list(units)
        self._index = {id(unit): u for u, unit in enumerate(units)}
        self._where = {id(b): (u, i) for u, unit in enumerate(units)
                       for i, b in enumerate(unit.buffers)}
        self._groups = _groups_of(self._units)
        for group in self.groups():
            if group.world_size > 1:
                self._rings[group.key] = self.flight.attach(group.process_group)
        self._agreement = ForwardAgreement.of(units, self.flight, self._groups) if units else None
        self._communicates = any(group.world_size > 1 for group in self._groups)

    def start_iteration(self) -> None:
        """The root's pre-forward ([Note: forward agreement])."""
        self.iterations += 1
        if self._agreement is not None and self._settings.check_rank_divergence is not False:
            row = [int(torch.is_grad_enabled()), self.iterations, self.backwards,
                   self._since_agreement >> 1, self._training_modes()]
            self._since_agreement = _FNV_OFFSET
            self._agreement.before_forward(row)
        self.verifying = self._should_verify()

    def _training_modes(self) -> int:
        """Bit ``u``: unit ``u`` trains."""
        modes = 0
        for u, unit in enumerate(self._units[:MODE_BITS]):
            if unit.modules[0].training:
                modes |= 1 << u
        return modes

    def will_verify(self) -> bool:
        return self._should_verify()

    def _should_verify(self) -> bool:
        """Read only where every rank's counters are equal."""
        forced = self._settings.check_rank_divergence
        if forced is not None:
            return forced
        window = self.agreed_backwards < VERIFICATION_ITERATIONS and \
            self.agreed_forwards < VERIFICATION_FORWARD_LIMIT
        return window or os.environ.get(CHECK_ENV, "0") not in ("", "0")

    def before_all_gather(self, buffer: FlatBuffer, issuer_state: TrainingState) -> None:
        """Right before ``buffer``'s all-gather."""
        phase = Phase.FORWARD if issuer_state is TrainingState.FORWARD else Phase.BACKWARD
        self._issue(Kind.ALL_GATHER, buffer, phase)

    def before_reduce_scatter(self, buffer: FlatBuffer) -> None:
        if buffer.group.world_size > 1:  # else nothing is communicated
            self._issue(Kind.REDUCE_SCATTER, buffer, Phase.BACKWARD)

    def _issue(self, kind: Kind, buffer: FlatBuffer, phase: Phase) -> None:
        group = buffer.group
        if group.world_size == 1:
            return
        unit_index, buffer_index = self._where.get(id(buffer), (0xFFFFF, 0))
        entry = Collective(kind, unit_index, buffer_index, phase)
        self._record(group, entry)
        if self.verifying:
            self._verify(entry, group)

    def _record(self, group: ShardGroup, entry: Collective) -> None:
        key, code = group.key, entry.code
        self._fingerprints[key] = _mix(self._fingerprints.get(key, _FNV_OFFSET), code)
        self._logs.setdefault(key, deque(maxlen=_LOG_LIMIT)).append(entry)
        self._since_agreement = _mix(self._since_agreement, code)
        ring = self._rings.get(key)
        if ring is not None:
            ring.entries.append((next(ring.serial), self.iterations - 1, code))  # 0-based

    def after_root_forward(self, order: Sequence[ObservedUnit]) -> None:
        """When verifying, compare the forward order."""
        if not self._communicates and self._agreement is None:
            return  # one rank
        entries = [Collective(Kind.FORWARD, self._index.get(id(u), 0xFFFFF), 0, Phase.FORWARD)
                   for u in order]
        combined = _FNV_OFFSET
        for entry in entries:
            combined = _mix(combined, entry.code)
        # grad mode in bit 0
        compared = ((combined >> 2) << 1) | int(torch.is_grad_enabled())
        verified = False
        for group in self.groups():
            if group.world_size == 1:
                continue
            for entry in entries:
                self._record(group, entry)
            if self.verifying:
                codes = all_gather_fingerprints(compared, group, include_replicas=False)
                if len({code >> 1 for code in codes}) == 1 and len(set(codes)) > 1:
                    _raise_grad_modes(group, codes)
                if len(set(codes)) > 1:
                    self._raise(group, None)
                verified = True
        if verified and not torch.is_grad_enabled():
            self.agreed_forwards += 1
            self.verifying = self._should_verify()
        elif (not verified and torch.is_grad_enabled() and self._agreement is not None
              and self._settings.check_rank_divergence is not False):
            self._agreement.after_forward(self.iterations, [entry.unit for entry in entries])

    def _verify(self, entry: Collective, group: ShardGroup) -> None:
        codes = all_gather_fingerprints(entry.code, group, include_replicas=False)
        if len(set(codes)) > 1:
            about = {rank: _decode(code) for rank, code in enumerate(codes)}
            self._raise(group, about)

    def before_publish(self) -> None:
        """End of the last backward."""
        self.backwards += 1
        if not self.verifying:
            return
        verified = False
        for group in self.groups():
            if group.world_size > 1:
                self._verify(Collective(Kind.END_OF_BACKWARD, 0, 0, Phase.NONE), group)
                verified = True
        if verified:
            self.agreed_backwards += 1
            self.verifying = self._should_verify()

    def payload(self, group: ShardGroup) -> list[int]:
        value = self._fingerprints.get(group.key, _FNV_OFFSET)
        raw = list(value.to_bytes(8, "little"))
        return raw + [255 - b for b in raw]

    def check(self, group: ShardGroup, reduced: Sequence[int]) -> None:
        """Raise if the reduced payloads differed."""
        if any(reduced[i] + reduced[8 + i] != 255 for i in range(8)):
            self._raise(group, None)
        key = group.key
        self._fingerprints.pop(key, None)
        self._logs.pop(key, None)

    def groups(self) -> list[ShardGroup]:
        return self._groups

    def _raise(self, group: ShardGroup, about: Optional[dict[int, Collective]]) -> None:
        """On every rank of ``group`` together."""
        log = list(self._logs.get(group.key, ()))
        logs: list = [None] * group.world_size
        dist.all_gather_object(logs, [c.code for c in log], group=group.process_group)
        logs = [[_decode(code) for code in codes] for codes in logs]
        lines = []
        if about is not None:
            for rank, entry in about.items():
                lines.append(f"  rank {rank} is about to issue the {entry.describe(self._units)}")
            forward = any(e.phase is Phase.FORWARD for e in about.values())
            where = "before issuing it"
        else:
            first = _first_difference(logs)
            for rank, entries in enumerate(logs):
                entry = entries[first] if first < len(entries) else None
                text = entry.describe(self._units) if entry is not None else \
                    "nothing more (its sequence ended)"
                lines.append(f"  rank {rank}: event #{first} since the last check is the {text}")
            forward = any(first < len(e) and e[first].phase is Phase.FORWARD for e in logs)
            where = ("after the root's forward, by comparing forward orders" if self.verifying
                     and any(first < len(e) and e[first].kind is Kind.FORWARD for e in logs) else
                     "at the end of backward, by the fingerprint of the collective sequence")
        advice = divergence_advice(forward)
        raise RuntimeError(
            f"[rank {group.rank}] fully_shard ranks diverged: they were about to pair "
            f"collectives of different units (detected {where}; rank-dependent control flow "
            f"would otherwise hang or mix parameters of different units):\n"
            + "\n".join(lines) + f"\n{advice} Set {CHECK_ENV}=1 (or call "
            "set_check_rank_divergence(True) on the root) to check every iteration.")


def _raise_grad_modes(group: ShardGroup, codes: Sequence[int]) -> None:
    """Grad modes differ across ranks."""
    ranks = dist.get_process_group_ranks(group.process_group)
    without = [ranks[i] for i, code in enumerate(codes) if not code & 1]
    with_grad = [ranks[i] for i, code in enumerate(codes) if code & 1]
    raise RuntimeError(
        f"[rank {group.rank}] fully_shard ranks diverged: ranks {without} ran a forward of the "
        f"root without gradients (torch.no_grad(), e.g. an evaluation) where ranks {with_grad} "
        "ran one with gradients (training), so their next collectives would pair a forward "
        "with a backward (detected after the root's forward, by comparing forward orders and "
        "grad modes). Every rank must run the same forwards: run the evaluation on every rank "
        "(each on its part of the data, then reduce the metric), or on a separate, unsharded "
        f"copy of the model. Set {CHECK_ENV}=1 (or call set_check_rank_divergence(True) on the "
        "root) to check every iteration.")


def _mix(fingerprint: int, code: int) -> int:
    return ((fingerprint ^ code) * _FNV_PRIME) & _MASK


def _first_difference(logs: list[list[Collective]]) -> int:
    index = 0
    while all(index < len(log) for log in logs) and len({log[index] for log in logs}) == 1:
        index += 1
    return index


def _groups_of(units: Sequence[ObservedUnit]) -> list[ShardGroup]:
    seen: dict[int, ShardGroup] = {}
    for unit in units:
        seen.setdefault(unit.group.key, unit.group)
        for buffer in unit.buffers:  # on another mesh (shard_placement_fn)
            seen.setdefault(buffer.group.key, buffer.group)
    return list(seen.values())
