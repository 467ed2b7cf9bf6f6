"""A script on N ranks as ``torchrun --standalone --nproc-per-node N`` starts it,
without importing torch N + 1 times: each rank is forked from the harness's fork
server (torch and ``fsdp_compose`` imported once, ``tests/harness.py``).

    proc = run_like_torchrun(2, "examples/train_gpt.py", "--steps", "6", cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    print(proc.stdout)   # rank 0's stdout, then rank 1's

What each rank gets is what torchrun's agent gives its workers (torch's
``LocalElasticAgent._start_workers``): the environment variables (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_*``, ``OMP_NUM_THREADS=1``),
a TCP store hosted by the launcher (``TORCHELASTIC_USE_AGENT_STORE=True``:
``env://`` rendezvous connects every rank as a client, as under torchrun), the
script run as ``__main__`` with ``sys.argv`` and ``sys.path[0]`` set as
``python -u script`` sets them (``PYTHONPATH`` of ``env`` before the rest),
stdout and stderr unbuffered, to files (not a terminal, as under a pipe).

With ``fresh_interpreters=True`` each rank is a new ``python -u script`` in that
environment instead (for what a process's start or end does: its first imports,
its exit handlers), still without the agent's process.

What it leaves out is the agent itself: restarts, signal forwarding, the
failure summary. When a rank exits non-zero the others get ``FAILURE_GRACE``
seconds, then are killed, as the agent stops them. Tests of what the agent
does (a failing rank ending the job, Ctrl-C, ``--max-restarts``) run the real
``torchrun``.

The result is a ``subprocess.CompletedProcess``: ``returncode`` 0 when every
rank exited 0, else the exit status of the rank that failed first (a signal as
a negative number; the ranks killed after it do not count); ``stdout``/``stderr``
the ranks' streams concatenated by rank.
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests import harness

__all__ = ["run_like_torchrun"]

# After a rank exits non-zero, how long the others get before they are killed
# (torchrun's agent looks every 0.1 s, --monitor-interval, then stops them).
FAILURE_GRACE = 0.5


def _torchrun_environ(rank: int, world_size: int, port: int, run_id: str) -> dict[str, str]:
    """The variables torchrun's agent sets for a worker of a one-node job."""
    return {
        "LOCAL_RANK": str(rank), "RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(world_size),
        "WORLD_SIZE": str(world_size), "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }


def _unbuffered(fd: int) -> io.TextIOWrapper:
    """A text stream on ``fd`` as ``python -u`` makes it: every write reaches the file."""
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8",
                            errors="backslashreplace", write_through=True)


def _exec_script(script: str, argv: list[str], cwd: str, environ: dict[str, str],
                 sys_path: list[str], out: str, err: str) -> int:
    """In the rank's process: run ``script`` as ``__main__``; its exit status."""
    os.environ.clear()
    os.environ.update(environ)
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, out, os.O_WRONLY | os.O_CREAT),
                           (2, err, os.O_WRONLY | os.O_CREAT)):
        opened = os.open(path, mode)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdout = sys.__stdout__ = _unbuffered(1)
    sys.stderr = sys.__stderr__ = _unbuffered(2)
    sys.argv = [script, *argv]
    sys.path[:] = sys_path
    os.chdir(cwd)
    torch.set_num_threads(int(environ.get("OMP_NUM_THREADS", "1")))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:  # sys.exit(code), as the interpreter reads it
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - an uncaught exception, as the interpreter prints it
        traceback.print_exc()
        return 1
    return 0


def _rank_main(conn: Connection, script: str, argv: list[str], cwd: str, environ: dict[str, str],
               sys_path: list[str], origins: dict[str, str | None], out: str, err: str) -> None:
    """Fork the rank (so that ``os._exit`` and signals end it as they would a process of
    torchrun's), wait for it, report ``(exit status, CPU seconds)``."""
    os.setpgid(0, 0)  # the launcher kills the rank's whole process group
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            harness._check_preloaded(origins)
            code = _exec_script(script, argv, cwd, environ, sys_path, out, err)
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    _, status, usage = os.wait4(pid, 0)
    conn.send((os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime))
    os._exit(0)


def _script_path(pythonpath: str) -> list[str]:
    return [p for p in pythonpath.split(os.pathsep) if p]


class _ForkedRank:
    """A rank forked from the harness's server (``_rank_main``)."""

    def __init__(self, ctx: Any, script: str, argv: list[str], cwd: str, environ: dict[str, str],
                 sys_path: list[str], origins: dict[str, str | None], out: str, err: str) -> None:
        self.conn, child_conn = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_rank_main, name=f"torchrun-env-rank{environ['RANK']}",
                                args=(child_conn, script, argv, cwd, environ, sys_path, origins,
                                      out, err))
        self.proc.start()
        child_conn.close()

    def waitable(self) -> Any:
        return self.conn

    def exit_status(self) -> int:
        try:
            code, cpu = self.conn.recv()
        except EOFError:  # the supervising process itself died
            return -signal.SIGKILL
        harness.fresh_cpu_seconds += cpu  # not this process's child: tests/_cputime.py adds it
        return code

    def kill(self) -> None:
        if self.proc.is_alive() and self.proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.join(5.0)
        self.conn.close()


class _FreshRank:
    """A rank in a new interpreter, ``python -u script argv...``, as torchrun starts it."""

    def __init__(self, script: str, argv: list[str], cwd: str, environ: dict[str, str],
                 out: str, err: str) -> None:
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
            self.proc = subprocess.Popen([sys.executable, "-u", script, *argv], cwd=cwd,
                                         env=environ, stdin=subprocess.DEVNULL, stdout=stdout,
                                         stderr=stderr, start_new_session=True)
        self.pidfd = os.pidfd_open(self.proc.pid)  # readable once the process has exited

    def waitable(self) -> Any:
        return self.pidfd

    def exit_status(self) -> int:
        return self.proc.wait()

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        os.close(self.pidfd)


def run_like_torchrun(world_size: int, script: str | os.PathLike[str], *argv: str,
                      cwd: str | os.PathLike[str], env: dict[str, str | None] | None = None,
                      timeout: float = 240.0,
                      fresh_interpreters: bool = False) -> subprocess.CompletedProcess:
    """Run ``script argv...`` on ``world_size`` ranks as torchrun would; see the module's
    docstring. ``env`` adds to (and overrides) this process's environment; a ``None``
    value removes the variable. ``fresh_interpreters``: each rank a new
    ``python -u script`` (for what a process's start or end does: its imports, its
    exit handlers), in the same environment, still without torchrun's agent. Raises
    ``harness.DistributedTimeoutError`` with every rank's output when a rank is still
    running after ``timeout`` seconds (times ``FSDP_COMPOSE_TEST_TIMEOUT_SCALE``)."""
    cwd = os.fspath(cwd)
    script = os.path.join(cwd, os.fspath(script))
    timeout *= harness.TIMEOUT_SCALE
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    outdir = tempfile.mkdtemp(prefix=f"torchrun-env-ws{world_size}-")
    base = {"OMP_NUM_THREADS": "1", **os.environ}
    for name, value in (env or {}).items():
        if value is None:
            base.pop(name, None)
        else:
            base[name] = value
    front = [os.path.dirname(script), *_script_path(base.get("PYTHONPATH", ""))]
    sys_path = [*front, *(p for p in sys.path if p and p not in front)]
    if fresh_interpreters:  # what this process imports from, after the script's own PYTHONPATH
        base["PYTHONPATH"] = os.pathsep.join(
            [*_script_path(base.get("PYTHONPATH", "")), str(Path(harness.__file__).parents[1])])
    else:
        ctx, origins = harness._context(), harness._origins()
    outs = [os.path.join(outdir, f"{rank}.out") for rank in range(world_size)]
    errs = [os.path.join(outdir, f"{rank}.err") for rank in range(world_size)]
    ranks: list[_ForkedRank | _FreshRank] = []
    codes: dict[int, int] = {}
    first_failure = 0
    try:
        for rank in range(world_size):
            environ = {**base, **_torchrun_environ(rank, world_size, store.port, Path(outdir).name)}
            ranks.append(_FreshRank(script, list(argv), cwd, environ, outs[rank], errs[rank])
                         if fresh_interpreters else
                         _ForkedRank(ctx, script, list(argv), cwd, environ, sys_path, origins,
                                     outs[rank], errs[rank]))
        deadline = time.monotonic() + timeout
        while len(codes) < world_size and (left := deadline - time.monotonic()) > 0:
            pending = {ranks[r].waitable(): r for r in range(world_size) if r not in codes}
            for ready in wait(list(pending), timeout=left):
                code = codes[pending[ready]] = ranks[pending[ready]].exit_status()
                if code != 0 and first_failure == 0:  # torchrun stops the others at once
                    first_failure = code
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE)
    finally:
        for started in ranks:
            started.kill()
        del store
    stdout, stderr = (
        "".join(Path(p).read_text(errors="backslashreplace") if os.path.exists(p) else ""
                for p in paths) for paths in (outs, errs))
    shutil.rmtree(outdir, ignore_errors=True)
    if first_failure == 0 and len(codes) < world_size:
        stuck = sorted(set(range(world_size)) - set(codes))
        raise harness.DistributedTimeoutError(
            f"{script} {' '.join(argv)}: rank(s) {stuck} still running after {timeout:g} s\n"
            f"--- stdout\n{stdout[-3000:]}\n--- stderr\n{stderr[-5000:]}")
    return subprocess.CompletedProcess([script, *argv], first_failure, stdout, stderr)
