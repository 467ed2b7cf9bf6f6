"""Multi-process harness for testing ``torch.distributed`` code on CPU (gloo).

Usage, in a test module (``tests`` is a package; always import it as ``tests.harness``)::

    import torch
    import torch.distributed as dist
    from tests.harness import run_distributed

    def _sum_ranks(scale):              # module-level: it is pickled by reference
        t = torch.tensor([float(dist.get_rank())]) * scale
        dist.all_reduce(t)
        return t                        # tensors come back detached, on CPU

    def test_sum_ranks():
        assert [t.item() for t in run_distributed(2, _sum_ranks, 10.0)] == [10.0, 10.0]

or with the ``distributed`` fixture from ``tests/conftest.py``:
``distributed.run(2, _sum_ranks, 10.0)``.

``run_distributed(world_size, fn, *args, timeout=90.0, **kwargs)`` calls ``fn(*args, **kwargs)``
on every rank and returns the results as a list indexed by rank.  Inside ``fn`` the default
process group is initialised (gloo, 60 s collective timeout), so ``dist.get_rank()`` etc. work.
Arguments and results must be picklable; tensors in the (nested list/tuple/dict) result are
detached and moved to CPU.  ``timeout`` belongs to the harness (``fn`` cannot get a keyword
argument of that name).  If ``fn`` destroys the default process group, the pool is replaced.

Devices: ``TEST_DEVICE`` is the CPU, or CUDA when ``FSDP_COMPOSE_TEST_DEVICE=cuda`` (``make
test-gpu``): then each worker computes on GPU ``rank % device_count`` and gloo carries CUDA
tensors, so several ranks share one GPU. ``run_nccl(world_size, fn, ...)`` runs ``fn`` over NCCL
(one GPU per rank; skip the test where fewer GPUs are visible).

Workers: one pool of ``world_size`` processes per world size and backend, started lazily,
kept alive across tests, shut down at session end (``shutdown_pools``; also run at exit), and
replaced after a call that leaves a worker with over ``THREAD_LIMIT`` threads (the process
groups tests make are never destroyed; their idle gloo threads cost CPU).
Workers are forked from multiprocessing's fork server, which imports torch, ``torch._dynamo``
and ``fsdp_compose`` once and freezes its heap (``_PRELOAD``, ``tests/_forkserver_preload.py``):
a new or replaced pool costs a fork per rank instead of a fresh interpreter importing torch
(seconds of CPU per rank). The server never computes, so
no thread, CUDA context or process group is inherited; each worker takes the parent's
``sys.path`` and environment as they are when the pool starts, as a spawned process would.  Each
pool rendezvouses through its own ``TCPStore``, served by this process on a port the system picks
(torchrun's kind of store: a blocked ``wait`` on it costs nothing, where a ``FileStore`` re-reads its
file every 10 ms).  Before every call each worker
runs ``gc.collect()`` (then ``gc.freeze()``: what survived is never scanned again), reseeds
``random``/``torch`` with 0, sets one thread, enables grad and resets the default dtype, so
tests do not depend on their order.

``run_fresh(fn, *args)`` runs ``fn`` once in a new process forked from the same server: a fresh
interpreter's state (torch, ``torch._dynamo`` and ``fsdp_compose`` imported, nothing run) without
importing torch again.

Failures raise ``DistributedTestError`` (an ``AssertionError``) with a ``[rank N]`` section per rank:
* a rank raised: its traceback.  If the others finished, a quick all-reduce health check keeps
  the pool (recreated if the check fails);
* the call ran past ``timeout`` (``DistributedTimeoutError``): each stuck rank's Python stack,
  dumped by ``faulthandler`` on SIGUSR1; the pool is killed and recreated on next use. Once a
  rank has raised, the others get ``FAILURE_GRACE`` seconds to finish (they are likely waiting
  for it in a collective), so a rank failing alone is reported in seconds, not at ``timeout``;
* a worker died (``WorkerDiedError``): its exit code (and crash dump, if any), reported as soon
  as the death is seen; the pool is killed and recreated on next use.
Every timeout here (a call's, a pool's start, the workers' collectives) is multiplied by
``FSDP_COMPOSE_TEST_TIMEOUT_SCALE`` (default 1), for machines loaded several times over.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import importlib.util
import multiprocessing as mp
import multiprocessing.forkserver
import os
import pickle
import random
import resource
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_TIMEOUT",
    "DistRunner",
    "DistributedTestError",
    "DistributedTimeoutError",
    "TEST_DEVICE",
    "WorkerDiedError",
    "pool_pids",
    "run_distributed",
    "run_fresh",
    "run_nccl",
    "shutdown_pools",
]

# Every timeout of the harness (a call's, the pool's start) is multiplied by this: on a
# machine loaded several times over, FSDP_COMPOSE_TEST_TIMEOUT_SCALE=3 keeps a slow rank
# from reading as a hung one. Collective timeouts inside the workers scale with it.
TIMEOUT_SCALE = float(os.environ.get("FSDP_COMPOSE_TEST_TIMEOUT_SCALE", "1"))
DEFAULT_TIMEOUT = 90.0  # seconds per run_distributed call, before TIMEOUT_SCALE
STARTUP_TIMEOUT = 180.0 * TIMEOUT_SCALE  # forking and joining 4 workers on a loaded machine
HEALTH_CHECK_TIMEOUT = 10.0
DEATH_GRACE = 1.0  # after a worker dies, how long the others get to report
FAILURE_GRACE = 5.0  # after a rank raises, how long the others get to report
PG_TIMEOUT = timedelta(seconds=60 * TIMEOUT_SCALE)  # gloo collective timeout inside the workers
THREAD_LIMIT = 24
"""A pool whose worker has more threads than this after a call is replaced. Every process group
a test makes (a 2-D mesh's, a ``new_group``) keeps a few gloo threads that wake on their own
while idle; a worker never destroys them, so they pile up: 600 threads in each of 4 workers
by the end of the suite took about a core between the tests (100k context switches/s). An
idle worker with 34 threads uses 1.5% of a core, with 94 threads 4%; a replaced pool costs a
fork per rank (24 rather than 64: the default suite 10 s shorter on 2 cores)."""
# Where the tests compute: "cpu" (the default suite) or "cuda" (make test-gpu).
TEST_DEVICE = torch.device(os.environ.get("FSDP_COMPOSE_TEST_DEVICE", "cpu"))
if TEST_DEVICE.type == "cuda":
    # the same kernels for the same shapes in every process (the one-process
    # references compare at the CPU suite's tolerances): deterministic
    # algorithms, a fixed cuBLAS workspace
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    # attention by its math kernel: the fused ones' backward use atomics
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)


class DistributedTestError(AssertionError):
    """A distributed call failed on at least one rank."""


class DistributedTimeoutError(DistributedTestError):
    """A distributed call did not finish within its timeout."""


class WorkerDiedError(DistributedTestError):
    """A worker process exited during a distributed call."""


# --------------------------------------------------------------------------- worker side


def _worker_main(
    rank: int, world_size: int, backend: str, store_port: int, log_file: str, conn: Connection,
    sys_path: list[str], environ: dict[str, str], origins: dict[str, str | None],
) -> None:
    sys.path[:] = sys_path
    os.environ.clear()  # the fork server's environment is the parent's at its start, not now
    os.environ.update(environ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    log = open(log_file, "w")  # noqa: SIM115 - must stay open for faulthandler
    faulthandler.enable(file=log, all_threads=True)  # crash dumps
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)  # "where are you stuck?"
    try:
        _check_preloaded(origins)
        torch.set_num_threads(1)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass
        if backend == "nccl" or TEST_DEVICE.type == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False,
                              timeout=PG_TIMEOUT)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=PG_TIMEOUT)
        conn.send_bytes(pickle.dumps((True, None, True)))
    except BaseException:
        conn.send_bytes(pickle.dumps((False, traceback.format_exc(), False)))
        return
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):  # the parent went away
            break
        if not msg:  # empty message: shut down
            break
        conn.send_bytes(_run_call(msg))
    try:
        dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # skip interpreter teardown: it takes seconds with torch loaded


def _run_call(msg: bytes) -> bytes:
    """Run one pickled ``(fn, args, kwargs)``; reply ``(ok, result or traceback, pg_alive)``."""
    try:
        fn, args, kwargs = pickle.loads(msg)
        _reset_state()
        result = _to_cpu(fn(*args, **kwargs))
        try:
            reply = pickle.dumps((True, result, dist.is_initialized()))
        except Exception as e:
            raise TypeError(f"the result of {fn.__qualname__} cannot be pickled: {e}") from None
    except BaseException as e:
        tb = e.__traceback__
        if tb is not None and tb.tb_next is not None:
            tb = tb.tb_next  # drop this frame: it is noise
        text = "".join(traceback.format_exception(type(e), e, tb))
        reply = pickle.dumps((False, text, dist.is_initialized()))
    sys.stdout.flush()
    sys.stderr.flush()
    return reply


def _reset_state() -> None:
    gc.collect()
    # What survived a collection is mostly torch's and the imported modules'
    # objects (250k+ of them): kept out of later collections, which then take
    # microseconds instead of ~0.1 s per call and rank. Garbage made by a test
    # is younger than this and still collected before the next call.
    gc.freeze()
    random.seed(0)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.set_grad_enabled(True)
    torch.set_default_dtype(torch.float32)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, tuple):
        items = [_to_cpu(x) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        return [_to_cpu(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def _health_check() -> float:
    t = torch.ones(1, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t)
    dist.barrier()
    return t.item()


# --------------------------------------------------------------------------- parent side

Reply = tuple[bool, Any, bool]  # (ok, result or traceback text, process group still initialised)


@dataclass
class _Outcome:
    replies: dict[int, Reply] = field(default_factory=dict)
    dead: dict[int, str] = field(default_factory=dict)  # rank -> exit description + crash log
    stuck: dict[int, str] = field(default_factory=dict)  # rank -> Python stack dump
    cut_short: bool = False  # the stuck ranks were given FAILURE_GRACE after a rank raised

    @property
    def failed(self) -> bool:
        return bool(self.dead or self.stuck) or not all(ok for ok, _, _ in self.replies.values())

    @property
    def broken(self) -> bool:
        """The pool cannot be reused (a worker died or hung, or the process group is gone)."""
        return bool(self.dead or self.stuck) or not all(pg for _, _, pg in self.replies.values())


def _exit_description(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"exit code {code} (killed by {signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exit code {code}"


# What the fork server imports once, before it forks any worker (what every worker imports);
# the last one also imports torch._dynamo and freezes the heap (its docstring says why).
_PRELOAD = ["torch", "torch.distributed", "fsdp_compose", "tests._forkserver_preload"]


def _context() -> mp.context.BaseContext:
    """The fork server's context, the server started with this process's ``sys.path``.

    Python 3.11's server ignores the ``sys_path`` it is given: without ``PYTHONPATH`` it
    would preload an installed ``fsdp_compose`` where this process imports another
    checkout's (``_check_preloaded`` refuses such a worker)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        mp.forkserver.ensure_running()  # type: ignore[attr-defined]
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return ctx


def _origins() -> dict[str, str | None]:
    """Where this process imports each preloaded module from."""
    return {name: getattr(importlib.util.find_spec(name), "origin", None) for name in _PRELOAD}


def _check_preloaded(origins: dict[str, str | None]) -> None:
    for name, origin in origins.items():
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None) != origin:
            raise ImportError(f"the fork server preloaded {name} from {module.__file__}, the "
                              f"tests import it from {origin}: start pytest with PYTHONPATH set "
                              f"to the checkout under test")


class _Pool:
    """``world_size`` forked workers sharing one process group (gloo or NCCL)."""

    def __init__(self, world_size: int, backend: str = "gloo") -> None:
        self.world_size = world_size
        self.tmpdir = tempfile.mkdtemp(prefix=f"dist-harness-ws{world_size}-")
        ctx = _context()
        origins = _origins()
        self.procs: list[mp.process.BaseProcess] = []
        self.conns: list[Connection] = []
        self.logs = [os.path.join(self.tmpdir, f"rank{r}.log") for r in range(world_size)]
        self.log_offsets = [0] * world_size
        # the pool's rendezvous store, served from this process on a port the system picks
        self.store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                                   wait_for_workers=False, timeout=PG_TIMEOUT)
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, world_size, backend, self.store.port, self.logs[rank], child_conn,
                      list(sys.path), dict(os.environ), origins),
                name=f"dist-ws{world_size}-rank{rank}",
            )
            proc.start()
            child_conn.close()
            self.procs.append(proc)
            self.conns.append(parent_conn)
        outcome = self._collect(STARTUP_TIMEOUT)
        if outcome.failed:
            self.close()
            what = f"starting a pool of {world_size} workers (their stderr may say more)"
            raise _make_error(what, outcome, STARTUP_TIMEOUT)

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self.procs]

    def most_threads(self) -> int:
        """The largest thread count of a live worker (0 where ``/proc`` cannot say)."""
        counts = [0]
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/status") as f:
                    counts += [int(line.split()[1]) for line in f if line.startswith("Threads:")]
            except (OSError, ValueError):
                continue
        return max(counts)

    def call(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float
    ) -> _Outcome:
        try:
            payload = pickle.dumps((fn, args, kwargs))
        except Exception as e:
            raise TypeError(
                f"cannot pickle {fn!r} and its arguments for the workers: fn must be a "
                f"module-level function and its arguments picklable ({e})"
            ) from e
        self.log_offsets = [self._log_size(r) for r in range(self.world_size)]
        for conn in self.conns:
            try:
                conn.send_bytes(payload)
            except OSError:
                pass  # a dead worker; _collect reports it
        return self._collect(timeout)

    def _collect(self, timeout: float) -> _Outcome:
        """Wait for one reply per rank, noticing dead workers at once."""
        out = _Outcome()
        deadline = time.monotonic() + timeout
        pending = set(range(self.world_size))
        while pending and (left := deadline - time.monotonic()) > 0:
            handles: dict[Any, int] = {}
            for r in pending:
                handles[self.conns[r]] = r
                handles[self.procs[r].sentinel] = r
            for handle in wait(list(handles), timeout=left):
                rank = handles[handle]
                if rank not in pending:
                    continue
                pending.discard(rank)
                reply = self._receive(rank)
                if reply is not None:
                    out.replies[rank] = reply
                    if not reply[0] and pending and deadline - time.monotonic() > FAILURE_GRACE:
                        # the others may be waiting for this rank in a collective
                        deadline = time.monotonic() + FAILURE_GRACE
                        out.cut_short = True
                    continue
                self.procs[rank].join(1.0)
                desc = "worker process died, " + _exit_description(self.procs[rank].exitcode)
                crash = self._read_log(rank)
                out.dead[rank] = desc + (f"; crash log:\n{crash}" if crash else "")
                deadline = min(deadline, time.monotonic() + DEATH_GRACE)
        if pending:
            out.stuck = self._dump_stacks(sorted(pending))
        return out

    def _receive(self, rank: int) -> Reply | None:
        conn = self.conns[rank]
        try:
            if not conn.poll():
                return None  # the sentinel fired: the process is gone
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return None
        try:
            reply: Reply = pickle.loads(data)
            return reply
        except Exception:
            return (False, "could not unpickle the result:\n" + traceback.format_exc(), True)

    def _log_size(self, rank: int) -> int:
        try:
            return os.path.getsize(self.logs[rank])
        except OSError:  # not created yet: the worker died or hangs very early
            return 0

    def _read_log(self, rank: int) -> str:
        try:
            with open(self.logs[rank]) as f:
                f.seek(self.log_offsets[rank])
                return f.read().strip()
        except OSError:
            return ""

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """SIGUSR1 makes faulthandler write every thread's Python stack to the rank's log."""
        sizes = {r: self._log_size(r) for r in ranks}
        for r in ranks:
            pid = self.procs[r].pid
            if pid is not None and self.procs[r].is_alive():
                os.kill(pid, signal.SIGUSR1)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            if all(self._log_size(r) > sizes[r] for r in ranks):
                time.sleep(0.2)  # let the dumps finish
                break
            time.sleep(0.05)
        return {r: self._read_log(r) or "(no stack dump obtained)" for r in ranks}

    def close(self, join_timeout: float = 0.0) -> None:
        """Give the workers ``join_timeout`` seconds to exit (see ``request_stop``), then kill."""
        deadline = time.monotonic() + join_timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(5.0)
        for c in self.conns:
            c.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)

    def request_stop(self) -> None:
        for c in self.conns:
            try:
                c.send_bytes(b"")
            except OSError:
                pass


def _describe_fn(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _make_error(what: str, out: _Outcome, timeout: float) -> DistributedTestError:
    problems = []
    if out.dead:
        problems.append(f"worker(s) of rank(s) {sorted(out.dead)} died")
    failed = sorted(r for r, (ok, _, _) in out.replies.items() if not ok)
    if out.stuck and out.cut_short:
        problems.append(f"rank(s) {sorted(out.stuck)} still running {FAILURE_GRACE:g} s after "
                        f"rank(s) {failed} raised (waiting for them in a collective?)")
    elif out.stuck:
        problems.append(f"rank(s) {sorted(out.stuck)} still running after {timeout:g} s")
    if failed:
        problems.append(f"rank(s) {failed} raised")
    lines = [f"{what} failed: {'; '.join(problems)}"]
    for rank in sorted({*out.replies, *out.dead, *out.stuck}):
        if rank in out.dead:
            lines.append(f"[rank {rank}] {out.dead[rank]}")
        elif rank in out.stuck:
            lines.append(f"[rank {rank}] timed out; Python stack:\n{out.stuck[rank]}")
        elif rank in out.replies:
            ok, value, _ = out.replies[rank]
            lines.append(f"[rank {rank}] returned normally" if ok else f"[rank {rank}] {value}")
    cls = WorkerDiedError if out.dead else DistributedTimeoutError if out.stuck else DistributedTestError
    return cls("\n".join(line.rstrip() for line in lines))


_pools: dict[tuple[int, str], _Pool] = {}  # (world size, backend) -> pool


def _discard(key: tuple[int, str]) -> None:
    pool = _pools.pop(key, None)
    if pool is not None:
        pool.close()


def _healthy(pool: _Pool) -> bool:
    out = pool.call(_health_check, (), {}, HEALTH_CHECK_TIMEOUT)
    return not out.failed and all(v == pool.world_size for _, v, _ in out.replies.values())


def run_distributed(
    world_size: int, fn: Callable[..., Any], /, *args: Any, timeout: float = DEFAULT_TIMEOUT, **kwargs: Any
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the results by rank.

    Raises ``DistributedTestError`` (an ``AssertionError``) if any rank raised, hung past
    ``timeout`` seconds (``DistributedTimeoutError``) or died (``WorkerDiedError``).
    """
    return _run_on_pool(world_size, "gloo", fn, args, kwargs, timeout)


def run_nccl(
    world_size: int, fn: Callable[..., Any], /, *args: Any, timeout: float = DEFAULT_TIMEOUT, **kwargs: Any
) -> list[Any]:
    """``run_distributed`` over NCCL, rank r on GPU r (needs ``world_size`` GPUs)."""
    if torch.cuda.device_count() < world_size:
        raise RuntimeError(f"run_nccl({world_size}, ...) needs {world_size} GPU(s), "
                           f"{torch.cuda.device_count()} visible")
    return _run_on_pool(world_size, "nccl", fn, args, kwargs, timeout)


def _run_on_pool(world_size: int, backend: str, fn: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any], timeout: float) -> list[Any]:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    key = (world_size, backend)
    pool = _pools.get(key)
    if pool is None:
        pool = _pools[key] = _Pool(world_size, backend)
    timeout *= TIMEOUT_SCALE
    try:
        out = pool.call(fn, args, kwargs, timeout)
    except TypeError:
        raise  # nothing was sent: the pool is fine
    except BaseException:  # e.g. KeyboardInterrupt while waiting: the workers are in an unknown state
        _discard(key)
        raise
    if out.broken or (out.failed and not _healthy(pool)) or pool.most_threads() > THREAD_LIMIT:
        _discard(key)
    if out.failed:
        raise _make_error(f"{_describe_fn(fn)} on {world_size} rank(s)", out, timeout)
    return [out.replies[r][1] for r in range(world_size)]


fresh_cpu_seconds = 0.0  # CPU used by run_fresh's processes so far (tests/_cputime.py adds it)


def _fresh_main(conn: Connection, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                sys_path: list[str], environ: dict[str, str], origins: dict[str, str | None]) -> None:
    sys.path[:] = sys_path
    os.environ.clear()
    os.environ.update(environ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _check_preloaded(origins)
        torch.set_num_threads(1)
        reply: tuple[bool, Any] = (True, _to_cpu(fn(*args, **kwargs)))
    except BaseException:
        reply = (False, traceback.format_exc())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    conn.send_bytes(pickle.dumps((*reply, usage.ru_utime + usage.ru_stime)))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_fresh(fn: Callable[..., Any], /, *args: Any, timeout: float = DEFAULT_TIMEOUT, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a new process forked from the fork server; its result.

    The process is in a fresh interpreter's state at a fork's cost: torch, ``torch.distributed``,
    ``torch._dynamo`` and ``fsdp_compose`` imported (``_PRELOAD``), nothing else run: no model
    built, no process group, no step taken. For what a process does once (its first model, a
    process-wide setting); where the state must not have ``torch._dynamo``, a new interpreter
    (``subprocess``). Raises as ``run_distributed`` does."""
    global fresh_cpu_seconds
    ctx = _context()
    parent_conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_fresh_main, name="fresh",
                       args=(child_conn, fn, args, kwargs, list(sys.path), dict(os.environ), _origins()))
    proc.start()
    child_conn.close()
    what = f"{_describe_fn(fn)} in a fresh process"
    timeout *= TIMEOUT_SCALE
    try:
        if not parent_conn.poll(timeout):
            raise DistributedTimeoutError(f"{what} still running after {timeout:g} s")
        try:
            ok, value, cpu = pickle.loads(parent_conn.recv_bytes())
        except EOFError:
            proc.join(5.0)
            raise WorkerDiedError(f"{what}: the process died, {_exit_description(proc.exitcode)}") from None
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5.0)
        parent_conn.close()
    fresh_cpu_seconds += cpu
    if not ok:
        raise DistributedTestError(f"{what} failed:\n{value}")
    return value


def pool_pids(world_size: int) -> list[int | None]:
    """PIDs of the live gloo pool for ``world_size`` (empty if none); lets tests see restarts."""
    pool = _pools.get((world_size, "gloo"))
    return pool.pids if pool is not None else []


def shutdown_pools(timeout: float = 10.0) -> None:
    """Stop every pool: ask all workers to exit, then kill whatever is left after ``timeout``."""
    pools = list(_pools.values())
    _pools.clear()
    for pool in pools:
        pool.request_stop()
    deadline = time.monotonic() + timeout
    for pool in pools:
        pool.close(join_timeout=max(0.0, deadline - time.monotonic()))


atexit.register(shutdown_pools)


class DistRunner:
    """What the ``distributed`` fixture returns: ``distributed.run(world_size, fn, *args, **kw)``."""

    def run(
        self,
        world_size: int,
        fn: Callable[..., Any],
        /,
        *args: Any,
        timeout: float = DEFAULT_TIMEOUT,
        **kwargs: Any,
    ) -> list[Any]:
        return run_distributed(world_size, fn, *args, timeout=timeout, **kwargs)
