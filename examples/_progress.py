"""Progress of a training loop, for the examples: a tqdm bar on a terminal,
plain lines anywhere else.

A tqdm bar redraws itself with carriage returns; in a file or a pipe (CI logs,
``nohup``, ``> log 2>&1``) those frames pile up on one line, interleaved with
the log lines. So when the stream is not a terminal (or tqdm is not
installed) `Progress` prints one complete line every tenth of the steps and
at least once a minute instead, and always after the last step::

    fsdp_compose: step 10/20 (50%), 0.5 s, loss 1.6104, 11,018 tok/s

Used by ``train_gpt.py`` and ``lora_finetune.py`` (next to it, so importable
as ``_progress`` when either runs as a script).
"""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO

try:
    from tqdm import tqdm
except ImportError:  # the `examples` extra; without it: lines only
    tqdm = None


class Progress:
    """Steps ``initial + 1 .. total`` of one run, reported on ``file``.

    Attributes:
        desc: the run's name, first on every line (and the bar's label).
        bar: the tqdm bar on a terminal; ``None`` in line mode.
        every: in line mode, a line every ``every`` steps (a tenth of the
            steps to run, at least 1)...
        min_interval_s: ...and whenever this long has passed since the last.
    """

    def __init__(self, total: int, initial: int = 0, desc: str = "", file: TextIO | None = None,
                 min_interval_s: float = 60.0) -> None:
        self.file: TextIO = file if file is not None else sys.stderr
        self.desc = desc
        self.total = total
        self.done = initial
        self.initial = initial
        self.every = max(1, math.ceil((total - initial) / 10))
        self.min_interval_s = min_interval_s
        self.started = time.monotonic()
        self.last_line = self.started
        isatty = getattr(self.file, "isatty", lambda: False)()
        self.bar = None
        if tqdm is not None and isatty:
            self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step",
                            dynamic_ncols=True, file=self.file)

    def step(self, postfix: str = "") -> None:
        """One step done; ``postfix`` (e.g. ``"loss 1.6104, 11,018 tok/s"``) describes it."""
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(postfix, refresh=False)
            self.bar.update()
            return
        now = time.monotonic()
        if ((self.done - self.initial) % self.every == 0 or self.done == self.total
                or now - self.last_line >= self.min_interval_s):
            self.last_line = now
            print(self.line(postfix, now - self.started), file=self.file, flush=True)

    def line(self, postfix: str, elapsed_s: float) -> str:
        """``"<desc>: step 10/20 (50%), 0.5 s, <postfix>"``, the line-mode report."""
        head = f"{self.desc}: " if self.desc else ""
        tail = f", {postfix}" if postfix else ""
        return (f"{head}step {self.done}/{self.total} ({100 * self.done // self.total}%), "
                f"{elapsed_s:.1f} s{tail}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def say(msg: str, file=None) -> None:
    """Print without breaking the progress bar, flushed (stdout is a pipe under torchrun)."""
    file = file or sys.stdout
    if tqdm is not None:
        tqdm.write(msg, file=file)
    else:
        print(msg, file=file)
    file.flush()
