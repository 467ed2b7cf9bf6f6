"""Checkpointing of annotated models in torch FSDP2's layout (docs/checkpointing.md).

``model.state_dict()`` returns every managed parameter as a ``DTensor`` of its original shape
placed as FSDP2 places it, and ``optimizer.state_dict()`` does the same for per-element state,
so DCP and its ``state_dict`` functions work unchanged, and checkpoints load across world
sizes, into torch FSDP2 and into unsharded models. Values are converted only when first used
(``_lazy.py``). :func:`flat_state_dict` with :class:`FlatSavePlanner` /
:class:`FlatLoadPlanner` writes and reads the shards' pieces as they lie.

Also: :class:`CheckpointStore` (crash-safe, rotating DCP directories),
:func:`scatter_full_state_dict` and :func:`load_safetensors` (whole weights into shards;
docs/large-models.md), :func:`register_optimizer` (``load_state_dict`` before an optimizer's
first step). ``fully_shard`` installs the rest itself.
"""

from ._full import load_safetensors, scatter_full_state_dict
from .flat import FlatLoadPlanner, FlatSavePlanner, flat_state_dict
from ._model import UnitStateDictHooks
from ._init_state import install as install_direct_optimizer_state  # noqa: F401 (for the package)
from ._optim import install_optimizer_layout_hooks, register_optimizer  # noqa: F401 (the first for the package)
from .store import CheckpointError, CheckpointStore

__all__ = ["CheckpointError", "CheckpointStore", "FlatLoadPlanner", "FlatSavePlanner",
           "flat_state_dict", "load_safetensors", "register_optimizer",
           "scatter_full_state_dict", "UnitStateDictHooks"]
