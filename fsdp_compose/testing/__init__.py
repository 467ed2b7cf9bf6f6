"""Small models and data shared by the tests, examples and benchmarks."""

from .gpt import GPT, GPTConfig, synthetic_tokens, train_losses
from .launch import init_from_torchrun
from .moe import TinyMoELM, enable_expert_parallel

__all__ = ["GPT", "GPTConfig", "TinyMoELM", "enable_expert_parallel", "init_from_torchrun",
           "synthetic_tokens", "train_losses"]
