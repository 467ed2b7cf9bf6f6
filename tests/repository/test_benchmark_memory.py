"""The benchmarks' memory method (``benchmarks/memory.py``) counts frees
made by other threads.

gloo's worker thread may drop the last reference to a finished collective's
tensors (torch FSDP2's, DDP's). The PyTorch profiler reports only the frees
of the threads it watches, so a running sum of its events counted such
memory as live for ever, and FSDP2's memory on the CPU grew by a block a
step. The method now reads c10's count
over every thread. Run in a fresh process (``harness.run_fresh``: forked from
the harness's server, nothing run yet): the count is a process-wide flag this
suite's other processes should not carry.
"""

from __future__ import annotations

import contextlib
import io
import json

from tests.harness import run_fresh

SCRIPT = """
import json, threading, torch
import benchmarks.memory as memory

MiB = 2 ** 20
held = {}

def build():
    model = torch.nn.Linear(512, 512, bias=False)  # 1 MiB of parameters
    return model, torch.optim.SGD(model.parameters(), lr=0.1)

def step(model, optim, i):
    held["t"] = torch.empty(MiB)  # 4 MiB that another thread frees
    thread = threading.Thread(target=held.pop, args=("t",))
    thread.start()
    thread.join()
    model(torch.randn(4, 512)).sum().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)

report = memory.measure_training_memory(build, step, 4, lambda: None)
print(json.dumps([[round(b / MiB, 3) for b in report.after_step],
                  round(report.persistent / MiB, 3), round(max(report.step_peaks) / MiB, 3)]))
"""


def _exec(script: str) -> str:
    """In the fresh process: what ``script`` prints. Module-level: run_fresh pickles it."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(script, "<benchmark memory script>", "exec"), {"__name__": "__main__"})  # noqa: S102
    return out.getvalue()


def _run(script: str) -> str:
    return run_fresh(_exec, script, timeout=120).strip().splitlines()[-1]


def test_a_free_in_another_thread_is_counted():
    after, persistent, peak = json.loads(_run(SCRIPT))
    assert after == [1.0] * 4 and persistent == 1.0, (after, persistent)
    assert 5.0 <= peak < 6.5, peak  # the 4 MiB tensor, the parameters and their gradient


def test_the_sum_of_the_events_would_miss_it():
    """The check above can fail: with the old method (the running sum of the
    profiler's events) the 4 MiB freed by the other thread stay counted."""
    script = SCRIPT.replace("import benchmarks.memory as memory",
                            "import benchmarks.memory as memory\n"
                            "memory.count_every_thread = lambda: False")
    after, persistent, _ = json.loads(_run(script))
    assert after == [5.0, 9.0, 13.0, 17.0] and persistent == 17.0, (after, persistent)
