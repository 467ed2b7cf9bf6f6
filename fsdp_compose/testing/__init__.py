"""Small models and data shared by the tests, examples and benchmarks."""

from .gpt import GPT, GPTConfig, synthetic_tokens

__all__ = ["GPT", "GPTConfig", "synthetic_tokens"]
