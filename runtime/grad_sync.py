"""Bucketed, overlapped gradient synchronisation for replicated parameters (as DDP does it).

The plan decides which parameters need it: a parameter replicated on a mesh axis whose
consumer does different work per rank there receives a partial gradient that must be
all-reduced on that axis. When that is all its gradient needs (one consuming edge, only
``Partial -> Replicate`` moves), lowering marks the edge's :class:`Reshard` as *deferred*: its
backward hands the partial gradient to :class:`GradientBuckets` instead of reducing it alone.

Buckets fill in the order backward produces gradients (the same on every rank); a full bucket
is flattened and all-reduced asynchronously while backward goes on; at the end of backward
(an autograd engine callback) the last buckets are reduced, every one is waited for, and the
reduced gradients are added to ``.grad`` (a ``.grad`` that was None becomes a view of the
reduced buffer: the gradients are held once, in the buffers, not also as separate tensors), so
gradient accumulation across calls behaves as without buckets. The bytes sent are those the
plan priced (the same payload per axis, in fewer, larger collectives).

Accumulation without communication (``ParallelModule.no_sync``, as DDP and FSDP have it):
:class:`DeferredSyncs` holds, per parameter edge whose backward communicates (a bucketed
all-reduce, or any other move such as the reduce-scatter of a weight stored sharded and
gathered for use), the sum of the unreduced gradients that arrived while deferring, in the
consumer's layout (for a gathered weight: full size), and gives the edge nothing to add to
``.grad``. The first synced backward through the edge adds the held sum to its incoming
gradient before the edge's moves: every move is linear, so one collective per step sends the
sum of all micro-steps. Held sums whose edge the synced backward does not reach (a micro-step
that ran another lowered program, for other input shapes) are moved and added to ``.grad`` at
the end of that backward, in the order they were first held (the same on every rank).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from runtime.collectives import MeshComm, grad_sync_scope, record_collective

__all__ = ["GradientBuckets", "DeferredSyncs"]


class GradientBuckets:
    def __init__(self, comm: MeshComm, bucket_bytes: int = 25 * 2**20):
        self.comm = comm
        self.bucket_bytes = bucket_bytes
        self._open: dict = {}  # axes -> list of (param, grad)
        self._launched: list = []  # (axes, entries, flat, work or None)
        self._armed = False
        self.reduce_dtype: torch.dtype | None = None  # gradients reduced in this dtype (None: their own)

    def add(self, param: torch.Tensor, grad: torch.Tensor, axes: tuple) -> None:
        if not self._armed:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._armed = True
        bucket = self._open.setdefault(axes, [])
        bucket.append((param, grad))
        if sum(g.numel() * g.element_size() for _, g in bucket) >= self.bucket_bytes:
            self._launch(axes, self._open.pop(axes))

    def _launch(self, axes, entries) -> None:
        flat = torch.cat([g.reshape(-1) for _, g in entries])
        if self.reduce_dtype is not None:  # reduced in the plan's reduce dtype, added back in the grads'
            flat = flat.to(self.reduce_dtype)
        # the flat buffer holds the gradients now: keep their layout only, so they are freed
        entries = [(param, g.shape, g.dtype) for param, g in entries]
        work = None
        for i, axis in enumerate(axes):
            with grad_sync_scope():
                record_collective("all_reduce", self.comm.axis_names[axis], flat.numel() * flat.element_size(), "bwd")
            last = i == len(axes) - 1
            if last:  # the last (usually only) axis overlaps with the rest of backward
                work = dist.all_reduce(flat, group=self.comm.groups[axis], async_op=True)
            else:
                dist.all_reduce(flat, group=self.comm.groups[axis])
        self._launched.append((entries, flat, work))

    def _finish(self) -> None:
        for axes in sorted(self._open):
            self._launch(axes, self._open[axes])
        self._open.clear()
        with torch.no_grad():
            for entries, flat, work in self._launched:
                if work is not None:
                    work.wait()
                offset = 0
                for param, shape, dtype in entries:
                    numel = shape.numel()
                    piece = flat[offset : offset + numel].view(shape).to(dtype)
                    offset += numel
                    if param.grad is None:
                        # a view of the reduced buffer (one copy of the gradients, not two)
                        param.grad = piece
                    else:
                        param.grad.add_(piece)
        self._launched.clear()
        self._armed = False


class DeferredSyncs:
    """Per-edge sums of the parameter gradients held back while ``deferring`` (see above)."""

    def __init__(self):
        self.deferring = False
        self._held: dict = {}  # Reshard edge -> the unreduced gradient sum, in arrival order
        self._armed = False

    @contextlib.contextmanager
    def deferred(self):
        """Hold back every deferrable gradient sync inside (nests; restores on exit)."""
        previous, self.deferring = self.deferring, True
        try:
            yield
        finally:
            self.deferring = previous

    @property
    def pending(self) -> bool:
        """True while some gradient is held back (a synced backward has not run since)."""
        return bool(self._held)

    def take(self, edge, grad: torch.Tensor) -> torch.Tensor | None:
        """The gradient ``edge`` should move now: None while deferring (``grad`` is held), else
        ``grad`` plus what was held for the edge."""
        if self.deferring:
            held = self._held.get(edge)
            if held is None:
                self._held[edge] = grad.detach().clone()
            else:
                held.add_(grad)
            return None
        held = self._held.pop(edge, None)
        if self._held and not self._armed:
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)
            self._armed = True
        return grad if held is None else held.add_(grad)

    def flush(self) -> None:
        """Move every held sum now, outside backward, into its parameter's ``.grad`` (one
        collective per edge, in the order first held): for a caller whose synced step is several
        backward calls (a pipeline's weight pass), which ``take`` would flush after the first."""
        self._flush()

    def _flush(self) -> None:
        """End of a synced backward: move the sums of edges it did not reach into ``.grad``."""
        held, self._held, self._armed = self._held, {}, False
        with torch.no_grad():
            for edge, grad in held.items():
                moved = edge.backward_moves(grad)
                param = edge.sync_param
                param.grad = moved if param.grad is None else param.grad.add_(moved)
