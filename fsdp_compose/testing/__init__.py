"""Small models and data shared by the tests, examples and benchmarks."""

from .gpt import GPT, GPTConfig, synthetic_tokens
from .launch import init_from_torchrun

__all__ = ["GPT", "GPTConfig", "init_from_torchrun", "synthetic_tokens"]
