"""Per-rank memory: a measured peak (separate pass, not during timing) and an
analytic bound. Not run directly: ``benchmarks/run.py`` uses it, e.g.

    .venv/bin/python -m benchmarks.run --scenario default

Measurement method: the PyTorch profiler with ``profile_memory=True``. On CPU,
every tensor storage comes from c10's CPU allocator, which reports each
allocation and free to an active profiler, but only those made by a thread
the profiler watches: a free in gloo's worker thread (which may drop the
last reference to a finished collective's tensors, torch FSDP2's and DDP's)
is never reported, and a running sum of the events counts that memory as
live for ever. So this module turns on c10's own count of live CPU bytes
over every thread (``FLAGS_caffe2_report_cpu_memory_usage``, set by
:func:`count_every_thread` before the first measurement) and reads that total from each event (``total_allocated``): the
live tensor bytes of the whole process at each allocation or free the
profiler saw, counted from the moment the profiler started; we start it
before the model is built, so it covers the model, the wrapper's flat
buffers/DTensors/DDP buckets, gradients, optimizer states, activations,
unsharded parameters and collective staging buffers. Memory allocated before
the profiler started (the other implementations' models) is not counted,
so each implementation is measured in isolation within one process. (Summing the
events instead makes FSDP2's memory on the CPU grow by 12-36 MiB a step
that gloo's thread had freed.)

A third pass runs torch's ``MemTracker`` (what users run to compare FSDP
setups) for every implementation: :func:`measure_mem_tracker`, through
``fsdp_compose.tools.ShardedMemTracker``, which is ``MemTracker`` except that
it installs no post-accumulate-grad hooks on non-leaf parameters (the views
of fsdp_compose's and FSDP1's flat buffers, on which the plain tracker
raises); its peak and after-step figures sit next to a direct count of the
distinct storages of parameters, gradients and optimizer state. It only sees
storages created by dispatched ops or registered with ``track_external``, so
it misses C++-side buffers (DDP's buckets, gloo's copies). Process RSS
measures glibc's heap, not tensors (:func:`measure_process_memory`).
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import resource
import statistics
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile, record_function

MiB = 2 ** 20
_PHASE_PREFIX = "bench_phase:"


@functools.cache
def count_every_thread() -> bool:
    """Turn on c10's count of live CPU allocator bytes over every thread
    (``FLAGS_caffe2_report_cpu_memory_usage``, a flag of ``libc10``), for
    the rest of the process; the profiler's allocation events then carry it
    as ``total_allocated``. Returns whether it is on (``False``: a torch
    without the flag, whose measurements miss frees made by other threads)."""
    try:
        library = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"))
        flag = ctypes.c_bool.in_dll(library, "FLAGS_caffe2_report_cpu_memory_usage")
    except (OSError, ValueError):
        warnings.warn("this torch's libc10 has no FLAGS_caffe2_report_cpu_memory_usage: frees "
                      "made by gloo's threads are not counted", stacklevel=2)
        return False
    flag.value = True
    return True


@dataclass
class MemoryReport:
    """Live tensor bytes of one rank, counted from just before the model is built.

    Attributes:
        setup_peak: peak while building the model, wrapping it and creating
            the optimizer (every implementation builds the full model first).
        step_peaks: peak within each training step (forward, backward,
            optimizer step, zero_grad).
        after_step: live bytes right after each step.
        persistent: live bytes after the last step once every rank passed a
            barrier and Python collected garbage: parameters, gradients if
            kept, optimizer states, wrapper buffers (gloo sometimes frees the
            staging copy of a finished collective a little later, which
            ``after_step`` may still count).
    """

    setup_peak: int = 0
    step_peaks: list[int] = field(default_factory=list)
    after_step: list[int] = field(default_factory=list)
    persistent: int = 0

    @property
    def train_peak(self) -> int:
        """Peak over the steady-state steps (all but the first, which creates
        the optimizer states and runs lazy initialisation)."""
        steady = self.step_peaks[1:] or self.step_peaks
        return max(steady)


def _walk(nodes) -> Iterator:
    stack = list(nodes)
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children)


def measure_training_memory(build: Callable[[], tuple[nn.Module, torch.optim.Optimizer]],
                            step: Callable[[nn.Module, torch.optim.Optimizer, int], None],
                            steps: int, settle: Callable[[], None]) -> MemoryReport:
    """Run ``build()``, then ``steps`` calls of ``step(module, optim, i)``, then
    ``settle()`` (e.g. a barrier and ``gc.collect()``) under the profiler and
    return this rank's live-tensor-byte profile. What ``build`` returns is
    dropped before this function returns."""
    every_thread = count_every_thread()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function(_PHASE_PREFIX + "setup"):
            module, optim = build()
        for i in range(steps):
            with record_function(_PHASE_PREFIX + f"step{i}"):
                step(module, optim, i)
        with record_function(_PHASE_PREFIX + "settle"):
            settle()
        del module, optim
    return _report_from(prof, steps, every_thread)


def _report_from(prof: profile, steps: int, every_thread: bool) -> MemoryReport:
    tree = prof.profiler.kineto_results.experimental_event_tree()
    allocations: list[tuple[int, int, int]] = []  # time, size (frees negative), process total
    phases: dict[str, tuple[int, int]] = {}
    for node in _walk(tree):
        fields = node.extra_fields
        if isinstance(fields, torch._C._profiler._ExtraFields_Allocation):
            allocations.append((node.start_time_ns, fields.alloc_size, fields.total_allocated))
        elif node.name.startswith(_PHASE_PREFIX):
            phases[node.name[len(_PHASE_PREFIX):]] = (node.start_time_ns, node.end_time_ns)
    allocations.sort()
    times = [t for t, _, _ in allocations]
    live: list[int] = []
    if every_thread and allocations:
        _, size, total = allocations[0]
        base = total - size  # live bytes of the whole process when the profiler started
        live = [total - base for _, _, total in allocations]
    else:
        total = 0
        for _, size, _ in allocations:
            total += size  # frees come as negative sizes
            live.append(total)

    def live_at(t_ns: int) -> int:
        i = bisect.bisect_right(times, t_ns)
        return live[i - 1] if i else 0

    def peak_in(name: str) -> int:
        start, end = phases[name]
        lo, hi = bisect.bisect_left(times, start), bisect.bisect_right(times, end)
        return max(live[lo:hi], default=live_at(start))

    report = MemoryReport(setup_peak=peak_in("setup"))
    for i in range(steps):
        report.step_peaks.append(peak_in(f"step{i}"))
        report.after_step.append(live_at(phases[f"step{i}"][1]))
    report.persistent = live_at(phases["settle"][1])
    return report


# ------------------------------------------------------------ process side
@dataclass
class ProcessReport:
    """What the kernel sees of one rank, without a profiler attached.

    Attributes:
        rss_peak_growth: the resident set's high-water mark over the
            steady-state steps (``VmHWM`` reset after the first step) minus
            the resident set just before the model was built (after
            ``malloc_trim``): includes glibc's free-but-kept heap.
        rss_held_after: resident set after the last step and ``settle()``
            (and ``malloc_trim``) minus that baseline: memory held between
            steps, as the kernel sees it.
        minor_faults_per_step: median over the steady-state steps of the
            minor page faults of the process (all threads, gloo's included).
    """

    rss_peak_growth: int = 0
    rss_held_after: int = 0
    minor_faults_per_step: float = 0.0


def _status_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give glibc's free heap back first
    except OSError:
        pass


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def measure_process_memory(build: Callable[[], tuple[nn.Module, torch.optim.Optimizer]],
                           step: Callable[[nn.Module, torch.optim.Optimizer, int], None],
                           steps: int, settle: Callable[[], None]) -> ProcessReport:
    """Like :func:`measure_training_memory`, but measured by the kernel
    (RSS high-water mark, page faults) and with no profiler attached."""
    settle()
    _trim()
    baseline = _status_kib("VmRSS") * 1024
    module, optim = build()
    step(module, optim, 0)  # lazy init, optimizer states
    _trim()
    _reset_hwm()
    faults = []
    for i in range(1, steps):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step(module, optim, i)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    peak = _status_kib("VmHWM") * 1024
    settle()
    _trim()
    held = _status_kib("VmRSS") * 1024
    del module, optim
    return ProcessReport(rss_peak_growth=peak - baseline, rss_held_after=held - baseline,
                         minor_faults_per_step=statistics.median(faults))


# ------------------------------------------------------------ MemTracker
@dataclass
class TrackerReport:
    """torch's ``MemTracker`` over the steady-state steps, next to a direct count.

    Attributes:
        tracker_peak: the tracker's peak over steps 2.. (its "peak" snapshot).
        tracker_after: the tracker's live bytes right after the last step.
        direct_after: the distinct storages of the parameters, their
            gradients and the optimizer state right after the last step.
        tracker_categories: the tracker's after-step bytes by category.
    """

    tracker_peak: int = 0
    tracker_after: int = 0
    direct_after: int = 0
    tracker_categories: dict[str, int] = field(default_factory=dict)


def direct_state_bytes(module: nn.Module, optim: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages of ``module``'s parameters, their
    ``.grad`` and ``optim``'s tensor state (local shards of DTensors)."""
    from torch.distributed._tools.common_utils import get_untyped_storages
    tensors = [*module.parameters()] + [p.grad for p in module.parameters() if p.grad is not None]
    tensors += [t for state in optim.state.values() for t in state.values()
                if isinstance(t, torch.Tensor)]
    storages = {}
    for tensor in tensors:
        for storage in get_untyped_storages(tensor):
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def measure_mem_tracker(build: Callable[[], tuple[nn.Module, torch.optim.Optimizer]],
                        step: Callable[[nn.Module, torch.optim.Optimizer, int], None],
                        steps: int, settle: Callable[[], None]) -> TrackerReport:
    """Step 1 untracked (lazy init, optimizer states), then the others
    under the tracker (``reset_mod_stats()`` after each, as it requires)."""
    from fsdp_compose.tools import ShardedMemTracker
    settle()
    module, optim = build()
    step(module, optim, 0)
    tracker = ShardedMemTracker()
    tracker.track_external(module, optim)
    with tracker:
        for i in range(1, steps):
            step(module, optim, i)
            tracker.reset_mod_stats()
    device = torch.device("cpu")
    current = tracker.get_tracker_snapshot("current").get(device, {})
    peak = tracker.get_tracker_snapshot("peak").get(device, {})
    report = TrackerReport(tracker_peak=peak.get("Total", 0),
                           tracker_after=current.get("Total", 0),
                           direct_after=direct_state_bytes(module, optim),
                           tracker_categories={str(getattr(k, "value", k)): v
                                               for k, v in current.items()})
    del module, optim, tracker
    return report


# ------------------------------------------------------------ analytic side
@contextmanager
def _saved_tensor_bytes(exclude: set[int], out: dict[int, int]):
    """Record the storages autograd saves for backward (keyed by storage
    address, so views of one storage count once), except ``exclude``."""
    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            out[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def activation_bytes(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor]) -> int:
    """Bytes of the tensors autograd keeps between forward and backward for one
    per-rank batch of the plain (unwrapped) model: a measured estimate of the
    activation memory, which is the same for every implementation here."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    with _saved_tensor_bytes(params, saved):
        loss = loss_fn(model)
    del loss
    return sum(saved.values())


def analytic_bounds(units: list[list[nn.Parameter]], world: int, activations: int,
                    logits_bytes: int) -> dict[str, int]:
    """Per-rank memory estimates in bytes (fp32, AdamW).

    * ``sharded_state``: parameters + gradients + AdamW's two moments, each
      1/world of the model (with each unit padded to a multiple of ``world``);
    * ``two_largest_units``: parameters + flat gradients of the two largest
      units, unsharded (the transient working set of FSDP with prefetch);
    * ``fsdp_bound``: the two above + activations + the logits gradient;
    * ``ddp_state``: replicated parameters, gradients, AdamW moments and the
      gradient buckets (one more gradient-sized buffer);
    * ``ddp_bound``: ``ddp_state`` + activations + the logits gradient.
    """
    sizes = [sum(p.numel() for p in unit) for unit in units]
    padded = [-(-n // world) * world for n in sizes]
    elem = 4
    total = sum(sizes)
    sharded_state = 4 * sum(padded) // world * elem
    largest = sorted(sizes, reverse=True)[:2]
    two_largest = 2 * sum(largest) * elem
    ddp_state = 5 * total * elem
    return {
        "params_total": total * elem,
        "sharded_state": sharded_state,
        "two_largest_units": two_largest,
        "activations": activations,
        "logits_grad": logits_bytes,
        "fsdp_bound": sharded_state + two_largest + activations + logits_bytes,
        "ddp_state": ddp_state,
        "ddp_bound": ddp_state + activations + logits_bytes,
    }
