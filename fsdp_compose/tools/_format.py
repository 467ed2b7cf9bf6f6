"""Small helpers shared by the tools' reports."""

from __future__ import annotations

import torch.nn as nn


def format_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit it reaches, two decimals."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def module_paths(model: nn.Module) -> dict[int, list[str]]:
    """Every path of every module, by id."""
    paths: dict[int, list[str]] = {}
    for name, sub in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(sub), []).append(name)
    return paths
