"""Run a function on N local ranks, each a forked process in one ``torch.distributed`` group.

This is the launcher used by the multi-process tests (test tier 3) and by the demo: one
command runs, say, 4 gloo ranks on the local machine and gets every rank's return value back.

    from runtime.launch import run_on_ranks, RankFailure

    def work(rank, world_size, n):
        t = torch.full((n,), float(rank))
        torch.distributed.all_reduce(t)
        return t

    if __name__ == "__main__":
        sums = run_on_ranks(work, 4, 3)      # [tensor([6., 6., 6.])] * 4, index = rank

Design
------
* **Fork, not spawn.** Workers are forked (``multiprocessing`` "fork" context) from the
  already-imported parent, so starting one costs ~0.1 s instead of a fresh interpreter and a
  re-import of torch, and ``fn`` may be any callable, including a lambda or a closure defined
  in a test. The parent must not own an initialised default process group (a forked child
  would inherit a half-copied one): that is refused with a clear error. Forking needs Linux
  or macOS.
* **Free port.** The parent binds a socket to port 0 on 127.0.0.1 to get a free port and
  passes it as ``MASTER_PORT``; every worker sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``, calls ``torch.set_num_threads(1)`` (N ranks
  share the machine's cores) and ``init_process_group(backend, rank, world_size, timeout)``
  with a *short* collective timeout (``collective_timeout_s``, 60 s by default). If another
  process steals the port between the probe and rank 0's bind, the run is retried once on a
  new port (nothing of ``fn`` has run yet at that point).
* **Results.** Each worker serialises ``fn``'s return value with ``torch.save`` into bytes
  and sends them through its own one-way pipe; the parent ``torch.load``s them. Tensors thus
  come back by value (no shared-memory handles that die with the worker). A returned view
  carries its whole storage, so return ``.clone()``s of small slices of big tensors. A rank
  that has reported waits until all ranks have (an Event set by the parent) before it tears
  down its process group and exits, so no rank (rank 0 hosts the rendezvous store) closes
  its connections while a peer is still finishing a collective.
* **Timeouts.** The parent never blocks without a deadline: it multiplexes the result pipes
  and the process sentinels with ``multiprocessing.connection.wait`` bounded by the time
  left of ``timeout_s`` (whole run, startup included). On expiry it asks the unfinished
  ranks for their Python stacks (``faulthandler`` on SIGUSR1), kills every worker and raises
  ``RankTimeout`` naming the ranks that had not finished, with their stacks.
* **Failure propagation.** A worker that raises sends the exception's type, message and
  traceback text; the parent then terminates the other workers (SIGTERM, then SIGKILL after
  a short grace), since they are typically blocked in a collective waiting for the failed
  rank, and raises ``RankFailure`` naming the rank, the exception type and message, with
  the worker's traceback. When several ranks fail, the earliest failure is reported first
  (it is the likely cause; the others are usually peers noticing the lost connection) and
  the rest are listed. A worker that exits without reporting (``os._exit``, a segfault, the
  OOM killer) is reported with its exit code or signal. Workers ask the kernel to kill them
  if the parent dies (``PR_SET_PDEATHSIG`` on Linux), and the parent kills all of its
  workers on any way out of ``run_on_ranks``, ``KeyboardInterrupt`` included.
"""

from __future__ import annotations

import datetime
import faulthandler
import io
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["run_on_ranks", "world_info", "RankFailure", "RankTimeout", "find_free_port"]

_MASTER_ADDR = "127.0.0.1"
_TERM_GRACE_S = 2.0  # between SIGTERM and SIGKILL
_STACK_DUMP_WAIT_S = 0.3  # time given to workers to write their stacks on timeout
_STACK_CHARS = 3000  # per rank, in a RankTimeout message
_ROOT_CAUSE_GRACE_S = 1.0  # wait for a root cause after a peer reported a lost connection


class RankFailure(RuntimeError):
    """A worker of ``run_on_ranks`` failed.

    Attributes: ``rank`` (the rank reported first, or None), ``exc_type`` (name of the
    exception class, or None for a worker that died without reporting), ``exc_message``,
    ``worker_traceback`` (text), ``exitcode`` and ``failures`` (rank -> one-line summary for
    every rank that failed).
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        exc_type: str | None = None,
        exc_message: str | None = None,
        worker_traceback: str | None = None,
        exitcode: int | None = None,
        failures: dict[int, str] | None = None,
    ):
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.worker_traceback = worker_traceback
        self.exitcode = exitcode
        self.failures = dict(failures or {})


class RankTimeout(RankFailure, TimeoutError):
    """``run_on_ranks`` exceeded ``timeout_s``. ``unfinished`` lists the ranks still running."""

    def __init__(self, message: str, *, unfinished: list[int] | None = None, **kw: Any):
        super().__init__(message, **kw)
        self.unfinished = list(unfinished or [])


def world_info() -> tuple[int, int]:
    """(rank, world_size) of the default process group; (0, 1) when none is initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def find_free_port(host: str = _MASTER_ADDR) -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- worker side


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            PR_SET_PDEATHSIG = 1
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except Exception:  # best effort only
            pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    collective_timeout_s: float,
    conn: multiprocessing.connection.Connection,
    stack_path: str,
    parent_pid: int,
    release: Any,
    release_timeout_s: float,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
) -> None:
    # Terminate promptly on SIGTERM even if the parent had installed a Python handler
    # (a Python-level handler would not run while we are blocked in a C++ collective).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent(parent_pid)
    try:
        stack_file = open(stack_path, "w")
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    except Exception:
        stack_file = None

    phase = "init"
    try:
        torch.set_num_threads(1)
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR=_MASTER_ADDR,
            MASTER_PORT=str(port),
        )
        if "nccl" in backend and torch.cuda.is_available():
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
        phase = "fn"
        result = fn(rank, world_size, *args, **kwargs)
        phase = "result"
        buf = io.BytesIO()
        torch.save(result, buf)
        conn.send(("ok", rank, buf.getvalue()))
        # Stay up until every rank has reported: rank 0 hosts the rendezvous store, and a
        # rank that closes its sockets early could cut off a peer still finishing a collective.
        release.wait(timeout=release_timeout_s)
    except BaseException as e:  # report everything, SystemExit and KeyboardInterrupt too
        try:
            text = str(e)
        except Exception:
            text = f"<unprintable {type(e).__name__}>"
        msg = ("error", rank, phase, time.time(), type(e).__name__, text, traceback.format_exc())
        try:
            conn.send(msg)
        except Exception:
            pass
        _flush_std()
        os._exit(1)
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    conn.close()
    if stack_file is not None:
        faulthandler.unregister(signal.SIGUSR1)
        stack_file.close()
    _flush_std()
    os._exit(0)


def _flush_std() -> None:
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except Exception:
            pass


# --------------------------------------------------------------------------- parent side


class _PortInUse(Exception):
    pass


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120,
    backend: str = "gloo",
    collective_timeout_s: float = 60,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` forked local ranks.

    Each rank has initialised the default process group (``backend``, collective timeout
    ``collective_timeout_s``) before ``fn`` runs. Returns the ranks' return values, index =
    rank (they must be ``torch.save``-able). Raises ``RankFailure`` if any rank raises or dies
    (the others are killed), ``RankTimeout`` (a ``RankFailure`` and a ``TimeoutError``) if the
    whole run takes longer than ``timeout_s`` seconds.
    """
    if not callable(fn):
        raise TypeError(f"run_on_ranks: fn must be callable, got {type(fn).__name__}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"run_on_ranks: world_size must be an int >= 1, got {world_size!r}")
    if not timeout_s > 0:
        raise ValueError(f"run_on_ranks: timeout_s must be > 0, got {timeout_s!r}")
    if not collective_timeout_s > 0:
        raise ValueError(f"run_on_ranks: collective_timeout_s must be > 0, got {collective_timeout_s!r}")
    if "fork" not in multiprocessing.get_all_start_methods():
        raise RuntimeError(
            "run_on_ranks forks its workers and this platform has no 'fork' start method; use torchrun instead"
        )
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "run_on_ranks: this process already has an initialised default process group "
            f"(rank {dist.get_rank()} of {dist.get_world_size()}); forked workers would inherit "
            "it. Call it from a process without one (e.g. not from inside a rank), or call "
            "torch.distributed.destroy_process_group() first."
        )
    if "nccl" in backend and torch.cuda.is_available() and torch.cuda.is_initialized():
        raise RuntimeError(
            "run_on_ranks: CUDA is already initialised in this process, and forked workers "
            "cannot use it. Launch NCCL runs before touching CUDA, or with torchrun."
        )

    deadline = time.monotonic() + timeout_s
    for attempt in range(2):
        try:
            return _run_once(
                fn,
                world_size,
                args,
                kwargs,
                deadline,
                timeout_s,
                backend,
                collective_timeout_s,
                retry_port_clash=(attempt == 0),
            )
        except _PortInUse:
            continue
    raise AssertionError("unreachable")  # the second attempt never raises _PortInUse


def _run_once(
    fn,
    world_size,
    args,
    kwargs,
    deadline,
    timeout_s,
    backend,
    collective_timeout_s,
    retry_port_clash,
):
    ctx = multiprocessing.get_context("fork")
    port = find_free_port()
    release = ctx.Event()  # set by the parent once every rank has reported its result
    stack_dir = tempfile.mkdtemp(prefix="partita-launch-")
    procs: list[multiprocessing.process.BaseProcess] = []
    readers: list[multiprocessing.connection.Connection] = []
    try:
        for rank in range(world_size):
            r, w = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_worker,
                name=f"partita-rank{rank}",
                args=(
                    rank,
                    world_size,
                    port,
                    backend,
                    collective_timeout_s,
                    w,
                    os.path.join(stack_dir, f"rank{rank}.stack"),
                    os.getpid(),
                    release,
                    max(0.0, deadline - time.monotonic()),
                    fn,
                    args,
                    kwargs,
                ),
                daemon=False,  # fn may start its own processes (e.g. DataLoader workers)
            )
            p.start()
            w.close()  # the child holds the only write end: EOF <=> the child is gone
            procs.append(p)
            readers.append(r)
        return _collect(procs, readers, release, deadline, timeout_s, stack_dir, retry_port_clash)
    finally:
        _kill_all(procs)
        for r in readers:
            r.close()
        shutil.rmtree(stack_dir, ignore_errors=True)


def _collect(procs, readers, release, deadline, timeout_s, stack_dir, retry_port_clash):
    world_size = len(procs)
    results: dict[int, Any] = {}
    # rank -> (timestamp, summary line, details dict, is a likely root cause)
    failures: dict[int, tuple[float, str, dict, bool]] = {}
    pending = set(range(world_size))

    def receive(rank: int) -> None:
        """Read rank's message (its pipe is readable). Updates results / failures."""
        try:
            msg = readers[rank].recv()
        except (EOFError, OSError):
            _record_death(rank)
            return
        pending.discard(rank)
        if msg[0] == "ok":
            results[rank] = torch.load(io.BytesIO(msg[2]), weights_only=False)
            return
        _, _, phase, stamp, etype, emsg, tb = msg
        if phase == "init" and retry_port_clash and _is_port_clash(emsg):
            raise _PortInUse()
        where = {
            "init": "while initialising the process group",
            "fn": "",
            "result": "while serialising its return value (must be torch.save-able)",
        }[phase]
        summary = f"rank {rank} raised {etype}: {emsg}" + (f" {where}" if where else "")
        failures[rank] = (
            stamp,
            summary,
            dict(exc_type=etype, exc_message=emsg, worker_traceback=tb),
            phase != "fn" or not _looks_like_peer_loss(etype, emsg),
        )

    def _record_death(rank: int) -> None:
        pending.discard(rank)
        p = procs[rank]
        p.join(timeout=_TERM_GRACE_S)
        if p.exitcode is None:  # closed its pipe but still alive: not ours to wait for
            _kill_all([p])
        code = p.exitcode
        if code is not None and code < 0:
            try:
                how = f"was killed by signal {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with exit code {code}"
        summary = f"rank {rank} {how} without reporting a result"
        failures[rank] = (time.time(), summary, dict(exitcode=code), True)

    # When a rank fails, its peers soon fail too ("connection closed by peer"): those are
    # consequences. If the first failure seen looks like one, keep listening a moment for the
    # root cause (an exception or a silent death on another rank) before killing everyone.
    stop_at = deadline
    while pending:
        if any(f[3] for f in failures.values()):
            break
        left = stop_at - time.monotonic()
        if left <= 0:
            if failures:
                break
            _raise_timeout(procs, sorted(pending), sorted(results), timeout_s, stack_dir)
        waitables = {}
        for rank in pending:
            waitables[readers[rank]] = ("msg", rank)
            waitables[procs[rank].sentinel] = ("exit", rank)
        ready = multiprocessing.connection.wait(list(waitables), timeout=left)
        # messages first: a worker that reported and then exited is not a silent death
        for kind, rank in sorted((waitables[o] for o in ready), key=lambda kr: kr[0] != "msg"):
            if rank not in pending:
                continue
            if kind == "msg" or readers[rank].poll(0):
                receive(rank)
            else:
                _record_death(rank)
        if failures and stop_at == deadline:
            stop_at = min(deadline, time.monotonic() + _ROOT_CAUSE_GRACE_S)

    if failures:
        # Stop everyone else: they are probably blocked in a collective on the failed rank.
        unfinished = sorted(r for r in pending if r not in failures)
        _kill_all(procs)
        _raise_failure(failures, unfinished)

    # All ranks reported; let them leave together, cleanly (finally: kills stragglers).
    release.set()
    for p in procs:
        p.join(timeout=max(0.0, min(deadline - time.monotonic(), _TERM_GRACE_S)))
    return [results[r] for r in range(world_size)]


def _looks_like_peer_loss(etype: str, msg: str) -> bool:
    """Is this the error a rank gets when a peer in its collective died or failed?"""
    if etype in ("DistBackendError", "DistNetworkError", "DistStoreError"):
        return True
    m = msg.lower()
    return etype == "RuntimeError" and any(
        k in m for k in ("gloo", "nccl", "c10d", "connection closed", "connection reset", "broken pipe")
    )


def _is_port_clash(msg: str) -> bool:
    m = msg.lower()
    return "address already in use" in m or "eaddrinuse" in m


def _raise_failure(failures: dict, unfinished: list[int]) -> None:
    # likely root causes first, then by time
    order = sorted(failures, key=lambda r: (not failures[r][3], failures[r][0]))
    first = order[0]
    _, summary, details, _ = failures[first]
    lines = [summary]
    if details.get("worker_traceback"):
        lines += ["", f"Traceback from rank {first}:", details["worker_traceback"].rstrip()]
    if len(order) > 1:
        lines += ["", "Other ranks that failed (often as a consequence):"]
        lines += [f"  {(failures[r][1].splitlines() or [''])[0]}" for r in order[1:]]
    if unfinished:
        lines += ["", f"Ranks terminated while still running: {unfinished}"]
    raise RankFailure(
        "\n".join(lines),
        rank=first,
        failures={r: failures[r][1] for r in order},
        **details,
    )


def _raise_timeout(procs, unfinished, finished, timeout_s, stack_dir) -> None:
    for rank in unfinished:
        try:
            os.kill(procs[rank].pid, signal.SIGUSR1)
        except (ProcessLookupError, TypeError):
            pass
    time.sleep(_STACK_DUMP_WAIT_S)
    _kill_all(procs)
    lines = [
        f"run_on_ranks timed out after {timeout_s:g} s: ranks {unfinished} had not finished"
        f" (finished: {finished}); all workers were killed"
    ]
    for rank in unfinished:
        try:
            with open(os.path.join(stack_dir, f"rank{rank}.stack")) as f:
                stack = f.read().strip()
        except OSError:
            stack = ""
        if stack:
            if len(stack) > _STACK_CHARS:
                stack = stack[:_STACK_CHARS] + "\n  ..."  # innermost frames come first
            lines += ["", f"Python stacks of rank {rank} at the timeout:", stack]
    raise RankTimeout(
        "\n".join(lines), unfinished=unfinished, failures={r: "did not finish in time" for r in unfinished}
    )


def _kill_all(procs) -> None:
    """SIGTERM every live worker, SIGKILL those still alive after a grace, reap them all."""
    alive = [p for p in procs if p.pid is not None and p.exitcode is None]
    for p in alive:
        try:
            p.terminate()
        except (ProcessLookupError, OSError):
            pass
    end = time.monotonic() + _TERM_GRACE_S
    for p in alive:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in alive:
        if p.exitcode is None:
            try:
                p.kill()
            except (ProcessLookupError, OSError):
                pass
            p.join(timeout=5)
