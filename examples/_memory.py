"""Memory figures for the examples: resident memory (now and high-water),
CUDA memory, and a short per-rank rendering. Used by ``train_gpt.py``."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import resource
import sys

import torch


def _maxrss_mib() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (1024 * 1024 if sys.platform == "darwin" else 1024)


def rss_mib() -> tuple[float, float]:
    """This process's resident memory now and its high-water mark, in MiB
    (``/proc/self/status``; elsewhere both are ``getrusage``'s maximum)."""
    found: dict[str, float] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    found[line[:5]] = int(line.split()[1]) / 1024
    except OSError:
        pass
    if len(found) < 2:
        return _maxrss_mib(), _maxrss_mib()
    return found["VmRSS"], found["VmHWM"]


def reset_peak_memory(device: torch.device) -> None:
    """Start a new high-water mark: return freed heap to the OS (glibc), then
    reset VmHWM to the current RSS (where the kernel allows it; elsewhere the
    peak is the process's since its start) and CUDA's peak statistics."""
    gc.collect()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def cuda_mib(device: torch.device) -> tuple[float, float]:
    if device.type != "cuda":
        return 0.0, 0.0
    return torch.cuda.memory_allocated() / 2**20, torch.cuda.max_memory_allocated() / 2**20


def per_rank(values: list[float], unit: str = "M", sep: str = " ") -> str:
    """``"412M 410M"`` for a few ranks, ``"403M..415M"`` (min..max) for many."""
    if len(values) <= 4:
        return sep.join(f"{v:.0f}{unit}" for v in values)
    return f"{min(values):.0f}{unit}..{max(values):.0f}{unit}"

