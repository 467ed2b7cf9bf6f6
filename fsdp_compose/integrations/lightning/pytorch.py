"""fsdp_compose under the Lightning Trainer: Lightning's strategy loads a
checkpoint only into ``DTensor`` parameters and reduces every micro-batch;
:class:`ModelParallelStrategy` also loads fsdp_compose models and turns
reduction off in ``block_backward_sync``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from lightning.pytorch.strategies import ModelParallelStrategy as _LightningModelParallelStrategy

from ._checkpoints import is_sharded, load
from ._gradient_sync import gradient_sync_off
from ._replicas import check_ranks_synchronise

__all__ = ["ModelParallelStrategy"]


class ModelParallelStrategy(_LightningModelParallelStrategy):
    """The Lightning Trainer's ``ModelParallelStrategy`` (same arguments) for
    models ``configure_model()`` shards with :func:`fsdp_compose.fully_shard`.
    Without fsdp_compose units, Lightning's own."""

    def setup(self, trainer: Any) -> None:
        if self.model is not None:  # configure_model() has run
            check_ranks_synchronise(self.model)
        super().setup(trainer)

    def load_checkpoint(self, checkpoint_path: Union[str, Path],
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        model = self.model
        if model is None or not is_sharded(model):
            return super().load_checkpoint(checkpoint_path, weights_only)
        path = Path(self.broadcast(checkpoint_path))
        state = {"state_dict": model,
                 **{f"optimizer_{index}": opt for index, opt in enumerate(self.optimizers)}}
        assert self.lightning_module is not None
        return load(path, state, model, strict=self.lightning_module.strict_loading,
                    weights_only=weights_only)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        model = self.model
        if model is None or not is_sharded(model):
            with super().block_backward_sync():
                yield
            return
        with gradient_sync_off(model):
            yield
