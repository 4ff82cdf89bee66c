"""Bucketed, overlapped gradient synchronisation for replicated parameters (as DDP does it).

The plan decides which parameters need it: a parameter replicated on a mesh axis whose
consumer does different work per rank there receives a partial gradient that must be
all-reduced on that axis; a weight stored sharded and gathered for use (ZeRO-2 / ZeRO-3)
receives one that must be reduce-scattered. When that is all its gradient needs (one consuming
edge whose backward is only ``Partial -> Replicate`` or ``Partial -> Shard`` moves), lowering marks its
:class:`Reshard` as *bucketed*: its backward hands the partial gradient to
:class:`GradientBuckets` instead of reducing it alone.

Buckets (one per reduction signature: the mesh axes and the kind of move on each) fill in the
order backward produces gradients (the same on every rank); a full bucket is reduced with one
flat collective per axis (:func:`flat_reduce`: gradients concatenated; for a reduce-scatter,
each gradient's shard dim moved to the front and cut in the ranks' blocks, so rank ``r``'s
blocks of every gradient lie together) asynchronously while backward goes on; at the end of
backward (an autograd engine callback) the last buckets are reduced, every one is waited for,
and the reduced gradients are added to ``.grad`` (a ``.grad`` that was None becomes a view of
the reduced buffer: the gradients are held once, in the buffers, not also as separate tensors),
so gradient accumulation across calls behaves as without buckets. The bytes sent are those the
plan priced (the same payload per axis, in fewer, larger collectives: the estimate prices
gradient syncs as bucketed).

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
import math

import torch
import torch.distributed as dist

from passes.core import bucket_sizes
from passes.core.placements import is_partial, is_shard
from runtime.collectives import (
    MeshComm,
    _reduce_scatter_single,
    _strided_order,
    grad_sync_scope,
    record_collective,
)

__all__ = ["GradientBuckets", "DeferredSyncs", "flat_reduce", "reduce_moves"]


def flat_reduce(grads: list, key: tuple, parts: list, comm: MeshComm, *, async_last: bool = False):
    """Reduce several gradients with one flat collective per move of their common reduction
    (:func:`reduce_moves`): ``key`` lists ``(axis, kind)``, ``kind`` ``"all_reduce"`` (``Partial
    -> Replicate``) or ``"reduce_scatter"``; ``parts[i][j]`` is gradient ``i``'s ``(dim, strided
    pieces)`` for move ``j`` (a reduce-scatter to ``Shard(dim)``, cut in the strided layout of that
    many pieces where given). Each collective is counted (phase ``bwd``, as a gradient sync) with
    the bytes of its flat buffer: the sum of the per-gradient collectives'. Returns (the last
    collective's work, or None, and ``finish()`` giving the reduced pieces)."""
    pieces = list(grads)
    work = None
    for j, (axis, kind) in enumerate(key):
        dims, strided = [mine[j][0] for mine in parts], [mine[j][1] for mine in parts]
        pieces = [p() if callable(p) else p for p in pieces]  # the collective before this one is done
        last = async_last and j == len(key) - 1
        n, name, group = comm.shape[axis], comm.axis_names[axis], comm.groups[axis]
        if kind == "all_reduce":
            shapes = [p.shape for p in pieces]
            flat = torch.cat([p.reshape(-1) for p in pieces])
            with grad_sync_scope():
                record_collective("all_reduce", name, flat.numel() * flat.element_size(), "bwd")
            work = dist.all_reduce(flat, group=group, async_op=last)
            pieces = _split(flat, [(s, None) for s in shapes])
            continue
        rows, layout = [], []
        for p, d, f in zip(pieces, dims, strided):
            x = _strided_order(p, d, f, n) if f else p
            moved = x.movedim(d, 0)
            layout.append(((moved.shape[0] // n,) + tuple(moved.shape[1:]), d))
            rows.append(moved.reshape(n, -1))
        flat = torch.cat(rows, dim=1).contiguous().view(-1)  # rank r's block of every gradient, in a row
        out = flat.new_empty((flat.numel() // n,))
        with grad_sync_scope():
            record_collective("reduce_scatter", name, flat.numel() * flat.element_size(), "bwd")
        work = _reduce_scatter_single(out, flat, group=group, async_op=last)
        pieces = _split(out, layout)
    return work, lambda: [p() if callable(p) else p for p in pieces]


def _split(flat: torch.Tensor, layout: list) -> list:
    """Pieces of ``flat`` in order: ``(shape, dim)`` each, ``dim`` where the shape was moved to
    the front (None: as it is). Lazy (callables): an asynchronous collective is still writing."""
    out, offset = [], 0
    for shape, d in layout:
        size = math.prod(shape)
        piece = flat[offset : offset + size]
        out.append(
            lambda piece=piece, shape=shape, d=d: piece.view(shape) if d is None else piece.view(shape).movedim(0, d)
        )
        offset += size
    return out


def reduce_moves(steps, comm: MeshComm, strided: dict) -> tuple | None:
    """The signature of a gradient's reduction for :func:`flat_reduce` (``((axis, kind), ...)``)
    and its per-gradient part (``((dim, strided pieces), ...)``), when every move of ``steps`` that
    involves more than one device is ``Partial -> Replicate`` or ``Partial -> Shard``; else None."""
    key, mine = [], []
    for axis, p, q in steps or ():
        if comm.shape[axis] <= 1:
            continue
        if not is_partial(p) or is_partial(q):
            return None
        if is_shard(q):
            key.append((axis, "reduce_scatter"))
            mine.append((q.dim, strided.get(axis)))
        else:
            key.append((axis, "all_reduce"))
            mine.append((None, None))
    return (tuple(key), tuple(mine)) if key else None


class GradientBuckets:
    def __init__(self, comm: MeshComm, bucket_bytes: int | None = None):
        self.comm = comm
        self.bucket_bytes = bucket_sizes.BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        self._open: dict = {}  # reduction signature -> list of (param, grad, per-gradient moves)
        self._launched: list = []  # (entries, work or None, finish)
        self._armed = False
        self.reduce_dtype: torch.dtype | None = None  # gradients reduced in this dtype (None: their own)

    def add(self, param: torch.Tensor, grad: torch.Tensor, edge) -> None:
        """Queue ``grad``, the gradient ``edge`` (a parameter's Reshard) moves, for its reduction."""
        if not self._armed:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._armed = True
        key, mine = edge.sync_moves
        bucket = self._open.setdefault(key, [])
        bucket.append((param, grad, mine))
        if sum(g.numel() * g.element_size() for _, g, _ in bucket) >= self.bucket_bytes:
            self._launch(key, self._open.pop(key))

    def _launch(self, key, entries) -> None:
        grads = [g if self.reduce_dtype is None else g.to(self.reduce_dtype) for _, g, _ in entries]
        parts = [mine for *_, mine in entries]
        # the flat buffers hold the gradients now: keep their dtype only, so they are freed
        entries = [(param, g.dtype) for param, g, _ in entries]
        # the last (usually only) collective overlaps with the rest of backward
        work, finish = flat_reduce(grads, key, parts, self.comm, async_last=True)
        del grads
        self._launched.append((entries, work, finish))

    def _finish(self) -> None:
        for key in sorted(self._open):
            self._launch(key, self._open[key])
        self._open.clear()
        with torch.no_grad():
            for entries, work, finish in self._launched:
                if work is not None:
                    work.wait()
                for (param, dtype), piece in zip(entries, finish()):
                    piece = piece.to(dtype)  # (cut along a later dim: strided like a reduce-scatter's)
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
