"""Largest difference between sharded training and the single-process
reference for the main parity cases of ``tests/test_parity.py`` (the tests
assert 1e-5; this prints what is actually reached).

    .venv/bin/python -m benchmarks.parity_report      # ~1 min on 2 cores
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests._training import assert_parity, train_reference, train_sharded  # noqa: E402
from tests.harness import run_distributed, shutdown_pools  # noqa: E402

CASES = [  # world, recipe, optimizer, mode, lora
    (1, "blocks+root", "sgd", "plain", False),
    (4, "blocks+root", "adamw", "plain", False),
    (3, "siblings", "sgd", "plain", False),
    (3, "blocks+root", "adamw", "plain", True),
    (3, "blocks+root", "sgd", "accum-nosync", False),
    (3, "no-reshard-after-forward", "sgd", "two-forwards", False),
]


def main() -> None:
    try:
        print("| ranks | annotation | optimizer | mode | frozen | max abs diff (losses, params) |")
        print("|---|---|---|---|---|---|")
        for world, recipe, optim, mode, lora in CASES:
            results = run_distributed(world, train_sharded, recipe, optim, 3, mode, "gpt", lora)
            reference = train_reference(world, optim, 3, mode, "gpt", lora)
            worst = assert_parity(results, reference, 1e-5)
            print(f"| {world} | {recipe} | {optim} | {mode} | {'yes' if lora else 'no'} | {worst:.1e} |")
    finally:
        shutdown_pools()


if __name__ == "__main__":
    main()
