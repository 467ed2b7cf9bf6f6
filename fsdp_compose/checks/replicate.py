"""Living next to torch's ``replicate``: each skips the subtrees the other
annotated, in either order; one module cannot be both (torch raises for
``replicate`` after ``fully_shard``, :func:`check_not_replicated` for the
reverse).
"""

from __future__ import annotations

from typing import Iterable

import torch.nn as nn
from .._torch_private import REGISTRY_KEY


def is_replicated(module: nn.Module) -> bool:
    """Whether ``replicate`` annotated ``module`` (read from ``__dict__``, not
    ``__getattr__``: checked every forward)."""
    registry = module.__dict__.get(REGISTRY_KEY)
    return registry is not None and "replicate" in registry


def check_not_replicated(modules: Iterable[nn.Module]) -> None:
    """Refuse to shard a module ``replicate`` manages."""
    for m in modules:
        if is_replicated(m):
            raise ValueError(
                f"{type(m).__name__} module is already annotated by replicate(); a module is "
                "either replicated or fully sharded, not both. Annotate its children with "
                "fully_shard before calling replicate on it (replicate then leaves them "
                "alone), or call fully_shard on an ancestor instead (fully_shard leaves "
                "replicated subtrees alone).")
