"""fsdp_compose under Hugging Face's ``Trainer``: :class:`ShardedTrainer`,
or :class:`ShardedTrainerMixin` before another ``Trainer`` subclass."""

from .trainer import ShardedTrainer, ShardedTrainerMixin

__all__ = ["ShardedTrainer", "ShardedTrainerMixin"]
