"""Living next to torch's ``replicate`` (DDP as a composable annotation).

The two split a model by subtrees, each leaving alone what the other manages:
``replicate(root)`` skips modules annotated by ``fully_shard`` (torch looks
for "fully_shard" in the composable-API registry, where ``fully_shard``
registers), and ``fully_shard(root)`` skips subtrees annotated by
``replicate``. Either order of annotation works. One module cannot be both:
torch raises for ``replicate`` after ``fully_shard`` and
:func:`check_not_replicated` for ``fully_shard`` after ``replicate``.
"""

from __future__ import annotations

from typing import Iterable

import torch.nn as nn
from .._torch_private import REGISTRY_KEY


def is_replicated(module: nn.Module) -> bool:
    """Whether torch's composable ``replicate`` annotated ``module`` (checked
    on every forward: read the registry from ``__dict__``, where ``contract``
    keeps it, rather than through ``nn.Module.__getattr__``)."""
    registry = module.__dict__.get(REGISTRY_KEY)
    return registry is not None and "replicate" in registry


def check_not_replicated(modules: Iterable[nn.Module]) -> None:
    """Refuse to shard a module that ``replicate`` manages (DDP would find
    no parameters left and fail with an unrelated message)."""
    for m in modules:
        if is_replicated(m):
            raise ValueError(
                f"{type(m).__name__} module is already annotated by replicate(); a module is "
                "either replicated or fully sharded, not both. Annotate its children with "
                "fully_shard before calling replicate on it (replicate then leaves them "
                "alone), or call fully_shard on an ancestor instead (fully_shard leaves "
                "replicated subtrees alone).")
