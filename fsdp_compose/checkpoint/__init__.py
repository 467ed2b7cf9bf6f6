"""Checkpointing of annotated models in torch FSDP2's layout (docs/checkpointing.md).

``model.state_dict()`` and ``optimizer.state_dict()`` return managed values
as ``DTensor``s placed as FSDP2 places them, so DCP works unchanged and
checkpoints load across world sizes, into FSDP2 and into unsharded models.
Values are converted only when first used (``_lazy.py``).
:func:`flat_state_dict` with the flat planners writes the shards' pieces as
they lie. Also :class:`CheckpointStore`, :func:`scatter_full_state_dict`,
:func:`load_safetensors` and :func:`register_optimizer`.
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
