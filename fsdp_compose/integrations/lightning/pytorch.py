"""fsdp_compose under the Lightning Trainer: the strategy to pass to
``Trainer(strategy=...)``, with ``configure_model()`` calling
:func:`fsdp_compose.fully_shard` where FSDP2's recipe calls torch's.

Lightning's Trainer saves an FSDP2 model through torch's state-dict
functions, which fsdp_compose models answer too, but it loads a checkpoint
only into a model whose parameters are ``DTensor``\\ s: with Lightning's own
strategy ``Trainer.fit(ckpt_path=...)`` raises "Could not find a distributed
model". :class:`ModelParallelStrategy` is Lightning's Trainer strategy whose
``load_checkpoint`` also takes fsdp_compose models, from either of
Lightning's formats (``_checkpoints.py``), and whose
``block_backward_sync`` (what ``accumulate_grad_batches`` enters for every
micro-batch but the last) turns gradient reduction off on fsdp_compose's
units; Lightning's reduces every micro-batch (for FSDP2 too). Gradient clipping
(``gradient_clip_val``) calls ``torch.nn.utils.clip_grad_norm_``, which
fsdp_compose routes to the norm over all ranks.
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
    """``lightning.pytorch.strategies.ModelParallelStrategy`` for models that
    ``configure_model()`` shards with :func:`fsdp_compose.fully_shard` (over
    ``self.device_mesh["data_parallel"]``). Takes the same arguments.

    Invariant: for a model without fsdp_compose units every method is
    Lightning's own."""

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
