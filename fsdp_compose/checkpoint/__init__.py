"""Checkpointing of annotated models in torch FSDP2's layout.

``model.state_dict()`` returns every managed parameter as a ``DTensor`` of
its original shape placed ``Shard(0)`` on its unit's mesh, and
``optimizer.state_dict()`` does the same for per-element state, so
``torch.distributed.checkpoint`` (DCP) and its ``state_dict`` functions
(``get_state_dict``, ``set_state_dict``, ``StateDictOptions``) work
unchanged, and checkpoints load across world sizes, into torch FSDP2 and
into unsharded models. The values are converted only when first used: DCP
writes and reads the flat shards' pieces in place (``_lazy.py``). See
docs/checkpointing.md.

The zero-copy path (:func:`flat_state_dict` with :class:`FlatSavePlanner` /
:class:`FlatLoadPlanner`) writes the flat shards' pieces as DCP boxes as they
lie and reads them straight back: same files, no conversion.

Also here: :class:`CheckpointStore` (crash-safe, rotating DCP directories),
:func:`scatter_full_state_dict` and :func:`load_safetensors` (whole weights
into shards without a whole copy per rank; docs/large-models.md), and
:func:`register_optimizer` (for ``optimizer.load_state_dict`` before the
optimizer's first step). ``UnitStateDictHooks`` is installed by
``fully_shard`` itself, and so are the global optimizer hook of
``install_optimizer_layout_hooks`` and the direct optimizer-state
initialisation of ``install_direct_optimizer_state`` (for the package, not
in ``__all__``).
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
