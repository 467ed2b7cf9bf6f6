"""Ranks agree or raise: small all-gathers of 63-bit fingerprints. Every rank
sees the same gathered values, so all raise the same error together instead
of one raising while others hang.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from .wire import all_gather_flat, release_after_collective
from .groups import ShardGroup


def fingerprint_of(text: str) -> int:
    """A 63-bit fingerprint of ``text`` (the same on every rank for the same text)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


class Disagreement(NamedTuple):
    """Which global ranks hold a fingerprint other than the reference rank's."""

    differing: list[int]
    reference: int


def disagreement(fingerprint: int, group: ShardGroup) -> Optional[Disagreement]:
    """``None`` when every rank of ``group`` (shard group, then replicas) holds
    the same ``fingerprint``, else the global ranks differing from the first.
    Collective."""
    every = all_gather_fingerprints(fingerprint, group)
    if len(set(every)) == 1:
        return None
    ranks = fingerprint_ranks(group)
    return Disagreement(sorted({ranks[i] for i, f in enumerate(every) if f != every[0]}),
                        ranks[0])


def all_gather_fingerprints(fingerprint: int, group: ShardGroup,
                            include_replicas: bool = True) -> list[int]:
    """Every rank's ``fingerprint``: the shard group's in rank order, then
    (hybrid, if ``include_replicas``) this rank's replicas'. Collective."""
    every = _gather_int(fingerprint, group.process_group, group.world_size, group.device)
    replicate = group.replicate_process_group
    if include_replicas and replicate is not None and group.replicate_size > 1:
        every += _gather_int(fingerprint, replicate, group.replicate_size, group.device)
    return every


def agreed_max(value: int, group: ShardGroup) -> int:
    """The largest ``value`` over ``group``'s mesh, equal on every rank. Collective."""
    largest = max(_gather_int(value, group.process_group, group.world_size, group.device))
    replicate = group.replicate_process_group
    if replicate is not None and group.replicate_size > 1:
        largest = max(_gather_int(largest, replicate, group.replicate_size, group.device))
    return largest


def fingerprint_ranks(group: ShardGroup, include_replicas: bool = True) -> list[int]:
    """The global rank behind each entry of :func:`all_gather_fingerprints`."""
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
