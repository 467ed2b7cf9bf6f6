"""Ranks agree or raise: tiny all-gathers of 63-bit fingerprints.

Used before the first data collective of a model (its layout), after
materialisation (the initialised values) and by the rank-divergence checks:
every rank sees the same gathered values, so every rank raises the same
error together instead of one rank raising while the others hang.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from .collectives import all_gather_flat, release_after_collective
from .groups import ShardGroup


def fingerprint_of(text: str) -> int:
    """A 63-bit fingerprint of ``text`` (the same on every rank for the same text)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


class Disagreement(NamedTuple):
    """Which global ranks hold a fingerprint other than the reference rank's."""

    differing: list[int]
    reference: int


def disagreement(fingerprint: int, group: ShardGroup) -> Optional[Disagreement]:
    """Gather every rank's ``fingerprint`` over ``group`` (shard group, then
    replicas); ``None`` when all are equal, else the global ranks that differ
    from the first. Collective: every rank of ``group`` must call it."""
    every = all_gather_fingerprints(fingerprint, group)
    if len(set(every)) == 1:
        return None
    ranks = fingerprint_ranks(group)
    return Disagreement(sorted({ranks[i] for i, f in enumerate(every) if f != every[0]}),
                        ranks[0])


def all_gather_fingerprints(fingerprint: int, group: ShardGroup,
                            include_replicas: bool = True) -> list[int]:
    """Every rank's 63-bit ``fingerprint``: the shard group's in rank order,
    then (hybrid sharding, unless ``include_replicas`` is off) those of this
    rank's replicas (one or two tiny all-gathers)."""
    every = _gather_int(fingerprint, group.process_group, group.world_size, group.device)
    replicate = group.replicate_process_group
    if include_replicas and replicate is not None and group.replicate_size > 1:
        every += _gather_int(fingerprint, replicate, group.replicate_size, group.device)
    return every


def agreed_max(value: int, group: ShardGroup) -> int:
    """The largest ``value`` over every rank of ``group``'s mesh (the shard
    group's maximum, then the maximum of those over the replicas): the same
    on every rank. Collective (one or two tiny all-gathers)."""
    largest = max(_gather_int(value, group.process_group, group.world_size, group.device))
    replicate = group.replicate_process_group
    if replicate is not None and group.replicate_size > 1:
        largest = max(_gather_int(largest, replicate, group.replicate_size, group.device))
    return largest


def fingerprint_ranks(group: ShardGroup, include_replicas: bool = True) -> list[int]:
    """The global rank behind each position of :func:`all_gather_fingerprints`'s
    result (for messages)."""
    ranks = dist.get_process_group_ranks(group.process_group)
    replicate = group.replicate_process_group
    if include_replicas and replicate is not None and group.replicate_size > 1:
        ranks += dist.get_process_group_ranks(replicate)
    return ranks


def _gather_int(value: int, process_group: dist.ProcessGroup, size: int,
                device: torch.device) -> list[int]:
    if size == 1:
        return [value]
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    every = torch.empty(size, dtype=torch.int64, device=device)
    all_gather_flat(every, mine, group=process_group)
    values = every.tolist()
    release_after_collective(mine, every)  # tiny, but at every root forward
    return values



# [Note: forward agreement]
# Collectives pair by issue order, and gloo aborts a process that receives a
# message of another size than it posted (SIGABRT, nothing to catch). A rank
# that runs one more forward than the others (an evaluation on rank 0 only)
# issues collectives that the others pair with their backward's; after the
# verified iterations nothing would notice before gloo aborts. So every root
# forward of a model over several ranks starts with an agreement through
# the rendezvous store (not a collective: it can never pair with a data
# collective, and no backend can abort on it): each rank writes a small
# row (what it is about to do, what it did since the last agreement) under
# a key numbered by the forward, waits for the other ranks' rows and
# compares (``rendezvous.meet``). A rank that waits at a collective call of
# the library instead is named at once ([Note: where each rank waits]); a
# rank stuck in a data collective makes the others wait here, and the
# stall is reported through the flight log. On CUDA no device is touched.
# A training forward (gradients on) also ends with such an agreement, on the
# units it ran, in order: a unit skipped or reordered on some ranks would
# pair the backward's reduce-scatters of units of different sizes (forward
# prefetch often pairs the forward's all-gathers anyway), so the ranks
# compare before the backward communicates.

