"""Reading the library's parameter registry from tests."""

from __future__ import annotations

from typing import Optional

import torch

from fsdp_compose.buffers.flat_buffer import FlatBuffer
from fsdp_compose.runtime.owners import owner_of


def buffer_of(param: torch.Tensor) -> Optional[FlatBuffer]:
    """The flat buffer managing ``param`` (``None``: not managed)."""
    owner = owner_of(param)
    return None if owner is None else owner.buffer
