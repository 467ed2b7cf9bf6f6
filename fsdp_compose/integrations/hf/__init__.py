"""fsdp_compose under Hugging Face's ``Trainer`` (and trainers built on it,
such as TRL's): :class:`ShardedTrainer`, or :class:`ShardedTrainerMixin` in
front of another ``Trainer`` subclass. Importing this package imports
transformers and accelerate (the ``[hf]`` extra)."""

from .trainer import ShardedTrainer, ShardedTrainerMixin

__all__ = ["ShardedTrainer", "ShardedTrainerMixin"]
