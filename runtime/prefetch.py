"""Prefetched weight gathers: a sharded weight's all-gather started ahead of its use.

The all-gather of a weight stored sharded (ZeRO-2 / ZeRO-3 / FSDP) does not depend on the
activations, so it can run while earlier ops compute. Two places start one ahead:

* **Forward** (:class:`PrefetchGather`, placed in the lowered program by
  :func:`passes.lower.prefetch_gathers.prefetch_gathers`): the edge's first all-gather is started
  asynchronously (``async_op=True``) and the edge keeps the pending work (``Reshard.pending``);
  when the program reaches the edge, :func:`take_prefetched` waits for it (within
  :func:`wait_timeout`'s limit) and runs the edge's remaining moves.
* **Backward** (:mod:`runtime.regather`): when a ZeRO-3 copy is gathered again, the regather
  expected next (the copy saved just before it in forward) is started the same way.

The bytes are those of the same collectives, counted when they are issued. A wait that fails or
does not complete within the process group's collective timeout (the job's, as for every other
collective; :func:`wait_timeout` sets another limit) raises ``RuntimeError`` naming the weight. :func:`prefetch_log`
records, in order, each ``("issue" | "wait", weight, phase, result)`` event, so a test can see
that a gather was issued before the ops in front of its use ran.
"""

from __future__ import annotations

import contextlib

import torch

from runtime.collectives import PendingMoves

__all__ = ["PrefetchGather", "take_prefetched", "issue", "finish", "wait_timeout", "prefetch_log"]

_TIMEOUT_S: list = [None]  # a limit on waiting for a prefetched gather (None: the process group's timeout)
_LOGS: list = []  # active event logs (prefetch_log)


@contextlib.contextmanager
def wait_timeout(seconds: float):
    """Inside, waiting for a prefetched gather fails after ``seconds`` (outside: after the
    process group's own collective timeout, the job's, as every other collective)."""
    if not seconds > 0:
        raise ValueError(f"wait_timeout: seconds must be > 0, got {seconds!r}")
    previous, _TIMEOUT_S[0] = _TIMEOUT_S[0], float(seconds)
    try:
        yield
    finally:
        _TIMEOUT_S[0] = previous


@contextlib.contextmanager
def prefetch_log():
    """Record the prefetch events inside: a list of ``(event, weight, phase, tensor or None)``,
    ``event`` ``"issue"`` (the gather started) or ``"wait"`` (it completed; the tensor gathered)."""
    log: list = []
    _LOGS.append(log)
    try:
        yield log
    finally:
        _LOGS.remove(log)


def _note(event: str, edge, phase: str, tensor=None) -> None:
    for log in _LOGS:
        log.append((event, edge.weight_name or edge.param_edge, phase, tensor))


def issue(edge, x: torch.Tensor, phase: str) -> PendingMoves:
    """Start ``edge``'s forward moves of ``x`` with the first all-gather in flight."""
    with torch.no_grad():
        pending = edge.start_forward(x.detach(), phase)
    _note("issue", edge, phase)
    return pending


def finish(edge, pending: PendingMoves) -> torch.Tensor:
    """Wait (within the limit) for a gather :func:`issue` started; the edge's moved tensor."""
    with torch.no_grad():
        out = pending.wait(_TIMEOUT_S[0])
    _note("wait", edge, pending.phase, out)
    return out


def take_prefetched(edge, x: torch.Tensor) -> torch.Tensor | None:
    """The edge's forward result for ``x`` from its prefetched gather; None when the gather was
    started for another tensor (or another version of it): it is still waited for (every rank
    issued it), and the caller gathers again. A recomputed layer's rerun gets its weight shards
    back from autograd's saved inputs, as other tensor objects viewing the same memory: those
    are the same tensor."""
    source, version, pending = edge.pending
    edge.pending = None
    out = finish(edge, pending)
    return out if _same_tensor(source, x) and version == x._version else None


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:
        return True
    return (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


class PrefetchGather(torch.nn.Module):
    """In a lowered program: start the forward gather of one weight's edge ahead of its use. The
    edge is kept unregistered (it is the program's own submodule already)."""

    _is_impure = True  # no output: dead-code elimination must keep it

    def __init__(self, edge):
        super().__init__()
        self._edge = [edge]

    @property
    def edge(self):
        return self._edge[0]

    def forward(self, x: torch.Tensor) -> None:
        edge = self.edge
        if edge.pending is not None:  # an earlier run stopped before using it: finish it first
            take_prefetched(edge, x)
        edge.pending = (x, x._version, issue(edge, x, "fwd"))

    def extra_repr(self) -> str:
        return f"start the all-gather of {self.edge.weight_name or self.edge.param_edge} ahead of its use"
