"""Reusing unsharded buffers' memory on the CPU: a :class:`StagingPool` keeps released memory
by size and lends it by swapping the storage's data pointer (saved views stay valid).

[Note: releasing what no fill will take]
Once an iteration filled a size as often as the most of the last :data:`HISTORY`, that size's
pooled memory is freed.

[Note: the pool across the end of forward]
The end of the root's forward frees the pool (unless ``retain_staging``).

[Note: staging and memory trackers]
Trackers do not see pointer swaps: a drain ends with ``resize_(0)``.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Optional

import torch

from .._torch_private import CAN_SWAP_STORAGE_DATA, swap_storage_data

HISTORY = 4


class StagingPool:
    """Released storages by size. Invariant: each holds exactly its key's bytes."""

    def __init__(self) -> None:
        self.enabled: bool = CAN_SWAP_STORAGE_DATA
        self._free: dict[int, list[torch.Tensor]] = {}
        """Bytes -> pooled tensors."""
        self._fills: Counter[int] = Counter()
        self._history: deque[Counter[int]] = deque(maxlen=HISTORY)
        self._expected: Optional[Counter[int]] = None
        self._first_iteration: bool = True

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        if storage.nbytes() != 0:
            raise AssertionError(f"staging: storage to fill holds {storage.nbytes()} bytes")
        if not self.enabled:
            storage.resize_(nbytes)
            return
        free = self._free.get(nbytes)
        if free:
            swap_storage_data(storage, free.pop().untyped_storage())
        else:
            storage.resize_(nbytes)
        self._fills[nbytes] += 1
        if not self._wanted(nbytes):
            self._free.pop(nbytes, None)  # its last fill

    def drain(self, storage: torch.UntypedStorage) -> None:
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        if not self.enabled or not self._wanted(nbytes):
            storage.resize_(0)
            return
        shell = torch.UntypedStorage(0, device=storage.device)
        swap_storage_data(shell, storage)
        storage.resize_(0)
        kept = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(shell)
        self._free.setdefault(nbytes, []).append(kept)

    def _wanted(self, nbytes: int) -> bool:
        if self._expected is None:  # no history yet
            return not self._first_iteration
        return self._fills[nbytes] < self._expected[nbytes]

    def release(self) -> None:
        self._free.clear()

    def keep(self) -> None:
        """End of an iteration under ``retain_staging``."""
        self._first_iteration = False

    def clear(self) -> None:
        """End of an iteration: free the pool."""
        self._first_iteration = False
        self._free.clear()
        if self._fills:
            self._history.append(self._fills)
            self._expected = Counter()
            for counts in self._history:
                self._expected |= counts
        self._fills = Counter()

    @property
    def pooled_bytes(self) -> int:
        return sum(n * len(items) for n, items in self._free.items())
