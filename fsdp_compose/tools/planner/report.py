"""What the planner reports: :class:`MemoryEstimate` and its table."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

from .._format import format_bytes


class PeakParts(NamedTuple):
    """What the peak moment holds (bytes; sums to ``total_peak``)."""

    sharded_state: int  # parameter shards + optimizer state (0 with offload)
    grads: int  # gradient shards of the units reduced so far
    working_set: int  # unsharded parameters and gradients, copies, temporaries
    comm_staging: int
    activations: int


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated bytes on one rank (rank 0: it owns the most optimizer state).

    Attributes:
        world_size, num_units: the sharding factor, the ``fully_shard`` calls.
        backend: ``"nccl"`` or ``"gloo"``; ``backend_assumed``: this machine's
            default, not given.
        sharded_params: this rank's slice of every flat buffer, with padding.
        grads: the trainable buffers' gradient shards.
        optimizer_state: per-element state of this rank's trainable elements
            (plus Adam's ``step``); ``persistent``: the sum of these three.
        transient_unsharded_peak: peak of the working set (unsharded
            parameters, gradients in flight, copies, optimizer temporaries).
        comm_staging: peak of gloo's copies (0 for nccl).
        activations: bytes saved in one ``batch_fn`` forward (``None`` without).
        state_peak: the largest moment without staging and activations.
        total_peak: the largest moment on the compute device (parts in
            ``peak_parts``, moment in ``peak_at``), excluding ``cpu_bytes``.
            Not modelled: activation gradients, workspaces, fragmentation.
        cpu_bytes: persistent bytes offloaded to host memory.
        largest_unit, largest_unit_bytes: the unit with the most unsharded bytes.
        bucket_cap_mb, buckets: the cap (0: off) and the units sharing
            collectives, names per bucket.
        kept_unsharded: unsharded bytes held always (``keep_unsharded_storage``)."""

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
        """Which units share their collectives."""
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
        """The table: what persists, what peaks, and the peak's parts."""
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
