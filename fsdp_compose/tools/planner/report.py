"""What the planner reports: :class:`MemoryEstimate` and its table."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

from .._format import format_bytes


class PeakParts(NamedTuple):
    """What the simulated step holds at its peak moment (bytes; sums to
    ``total_peak``)."""

    sharded_state: int  # parameter shards + optimizer state (0 with offload)
    grads: int  # gradient shards of the units reduced so far
    working_set: int  # unsharded parameters and gradients, copies, optimizer temporaries
    comm_staging: int
    activations: int


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated bytes on one rank (rank 0: it owns the most optimizer state).

    Attributes:
        world_size: the sharding factor.
        backend: ``"nccl"`` (CUDA) or ``"gloo"`` (CPU; see the module notes).
        backend_assumed: ``True`` when no backend was given and ``backend``
            is this machine's default (``"gloo"`` without CUDA).
        num_units: ``fully_shard`` calls in the annotation.
        sharded_params: this rank's slice of every flat buffer, padding included.
        grads: the gradient shards of the trainable buffers (all alive at
            the optimizer step).
        optimizer_state: per-element state of the trainable elements this
            rank owns (AdamW 2 tensors, SGD momentum 1), plus Adam's 4-byte
            ``step`` per parameter.
        persistent: ``sharded_params + grads + optimizer_state``.
        transient_unsharded_peak: peak of the working set: unsharded
            parameters (compute dtype), the gradients of the unit in backward
            and of the reduce-scatter in flight, extra reduce-scatter outputs,
            cast shard copies, optimizer temporaries (gloo: the pool's
            high-water mark instead of the unsharded parameters in use).
        comm_staging: peak of the copies the backend makes of what it
            communicates (gloo; 0 for nccl; see the module notes for the
            copies gloo may keep longer, not counted).
        activations: bytes autograd saves in one ``batch_fn`` forward
            (measured on fake tensors); ``None`` without ``batch_fn``.
        state_peak: the largest moment of sharded state, gradients and
            working set alone (no staging, no activations).
        total_peak: the largest moment of the step on the compute device
            (parts in ``peak_parts``; less than the sum of the fields, which
            peak at different moments). Without ``batch_fn`` activations
            count 0. With offload it excludes ``cpu_bytes``. Not modelled:
            activation gradients, kernel workspaces, fragmentation.
        peak_at: that moment, e.g. "backward of 'blocks.3': reduce-scatter".
        peak_parts: what the peak moment holds.
        cpu_bytes: persistent bytes in host memory through offload (0
            without it, and with gloo, where offload changes nothing).
        largest_unit: the unit with the most unsharded bytes, and
        largest_unit_bytes: those bytes (compute dtype).
        bucket_cap_mb: the bucket cap the step was planned with
            (``set_bucket_cap_mb``; 0: bucketing off).
        buckets: the units that share their collectives, one tuple of unit
            names per bucket (forward order); ``()``: none is bucketed.
        kept_unsharded: unsharded bytes held at every moment because every
            unit keeps its unsharded storage (``keep_unsharded_storage=True``,
            ``set_keep_unsharded_storage``); 0 otherwise.
    """

    world_size: int
    backend: str
    num_units: int
    sharded_params: int
    grads: int
    optimizer_state: int
    persistent: int
    transient_unsharded_peak: int
    comm_staging: int
    activations: Optional[int]
    state_peak: int
    total_peak: int
    peak_at: str
    peak_parts: PeakParts
    cpu_bytes: int
    largest_unit: str
    largest_unit_bytes: int
    backend_assumed: bool = False
    bucket_cap_mb: float = 0.0
    buckets: tuple[tuple[str, ...], ...] = ()
    kept_unsharded: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "peak_parts": self.peak_parts._asdict()}

    def _buckets_row(self) -> str:
        """Which units share their collectives, e.g. "2 (8 of 12 units) at
        4 MiB: [blocks.0 .. blocks.3], [blocks.4 .. blocks.7]"."""
        if self.bucket_cap_mb <= 0:
            return "off (bucket_cap_mb=0)"
        cap = f"{self.bucket_cap_mb:g} MiB"
        if not self.buckets:
            return f"none at {cap} (no consecutive units small enough)"
        names = ", ".join(f"[{b[0]} .. {b[-1]}]" if len(b) > 2 else f"[{b[0]}, {b[1]}]"
                          for b in self.buckets)
        count = sum(len(b) for b in self.buckets)
        return f"{len(self.buckets)} ({count} of {self.num_units} units) at {cap}: {names}"

    def __str__(self) -> str:
        """The table: what persists, what peaks, and the peak moment with
        its parts (which add up to the total peak)."""
        acts = "-- (pass batch_fn)" if self.activations is None else \
            f"{format_bytes(self.activations)} (saved by one batch's forward)"
        parts = self.peak_parts
        breakdown = " + ".join(f"{name} {format_bytes(value)}" for name, value in (
            ("state", parts.sharded_state), ("grads", parts.grads),
            ("working set", parts.working_set), ("staging", parts.comm_staging),
            ("activations", parts.activations)))
        rows = [("sharded parameters", format_bytes(self.sharded_params)),
                ("gradients", format_bytes(self.grads)),
                ("optimizer state", format_bytes(self.optimizer_state)),
                ("persistent", format_bytes(self.persistent) + (" (CPU)" if self.cpu_bytes else "")),
                ("unsharded working set", f"{format_bytes(self.transient_unsharded_peak)} (peak)"),
                ("comm staging", f"{format_bytes(self.comm_staging)} (peak)"),
                ("activations", acts),
                ("peak w/o staging, activations", format_bytes(self.state_peak)),
                ("total peak", f"{format_bytes(self.total_peak)} at {self.peak_at}"),
                ("", f"= {breakdown}"),
                ("largest unit", f"{self.largest_unit} ({format_bytes(self.largest_unit_bytes)})"),
                ("buckets", self._buckets_row())]
        width = max(len(name) for name, _ in rows)
        backend = f"{self.backend}, assumed: " + \
            ("CUDA is available" if self.backend == "nccl" else "no CUDA on this machine") \
            if self.backend_assumed else self.backend
        return "\n".join([f"per-rank memory of {self.num_units} units on {self.world_size} "
                          f"ranks ({backend})"]
                         + [f"  {name:<{width}}  {value}" for name, value in rows]
                         + ["  (the parts peak at different moments: the total is the largest "
                            "moment, not their sum)"])
