"""Bucketed, overlapped gradient synchronisation for replicated parameters (as DDP does it).

The plan decides which parameters need it: a parameter replicated on a mesh axis whose
consumer does different work per rank there receives a partial gradient that must be
all-reduced on that axis; a weight stored sharded and gathered for use (ZeRO-2 / ZeRO-3)
receives one that must be reduce-scattered. When that is all its gradient needs (one consuming
edge whose backward is only ``Partial -> Replicate`` or ``Partial -> Shard`` moves), lowering marks its
:class:`Reshard` as *bucketed*: its backward hands the partial gradient to
:class:`GradientBuckets` instead of reducing it alone.

Buckets (one per reduction signature: the mesh axes and the kind of move on each) fill in the
order backward produces gradients (the same on every rank); the gradient of a ZeRO-3 weight (its
edge regathers) is reduce-scattered at once, alone, as FSDP does: a bucket would hold it at the
whole weight's size, ``n`` times its ``.grad``, until sent, and on a model smaller than a bucket
that is every weight's whole gradient at the end of backward, the gradient memory ZeRO-3 is
chosen to save; a full bucket is reduced with one
flat collective per axis (:func:`flat_reduce`: gradients concatenated; for a reduce-scatter,
each gradient's shard dim moved to the front and cut in the ranks' blocks, so rank ``r``'s
blocks of every gradient lie together; each gradient is copied into the buffer and dropped)
asynchronously while backward goes on (a reduce-scatter's input, the bucket's unreduced
gradients, is held by its work until waited for: a reduce-scatter bucket waits for the one in
flight before it is launched, so at most one is held; :mod:`passes.plan.bucket_memory` prices
what the buckets hold); at the end of
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
import functools
import math

import torch
import torch.distributed as dist

from passes.core import bucket_sizes
from passes.core.placements import is_partial, is_shard
from runtime.collectives import (
    MeshComm,
    _reduce_scatter_single,
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
    the bytes of its flat buffer: the sum of the per-gradient collectives'. ``grads`` is emptied:
    each gradient is copied straight into its place in the flat buffer and dropped, so a caller
    that keeps no other reference holds the gradients once, in the buffer. Returns (the last
    collective's work, or None, and ``finish()`` giving the reduced pieces)."""
    pieces = grads
    work = None
    for j, (axis, kind) in enumerate(key):
        dims, strided = [mine[j][0] for mine in parts], [mine[j][1] for mine in parts]
        pieces = [p() if callable(p) else p for p in pieces]  # the collective before this one is done
        grads.clear()
        last = async_last and j == len(key) - 1
        n, name, group = comm.shape[axis], comm.axis_names[axis], comm.groups[axis]
        dtype = functools.reduce(torch.promote_types, [p.dtype for p in pieces])
        flat = pieces[0].new_empty((sum(p.numel() for p in pieces),), dtype=dtype)
        if kind == "all_reduce":
            layout = [(p.shape, None) for p in pieces]
            _fill(flat.view(1, -1), pieces, [p.reshape(1, -1) for p in pieces])
            with grad_sync_scope():
                record_collective("all_reduce", name, flat.numel() * flat.element_size(), "bwd")
            work = dist.all_reduce(flat, group=group, async_op=last)
            pieces = _split(flat, layout)
            continue
        # rank r's block of every gradient in a row: the gradient's shard dim moved to the front
        # and cut in the ranks' blocks (viewed so, never copied but into the buffer)
        blocks = [_rank_blocks(p, d, f, n) for p, d, f in zip(pieces, dims, strided)]
        layout = [((b.shape[1] * b.shape[2],) + tuple(b.shape[3:]), d) for b, d in zip(blocks, dims)]
        _fill(flat.view(n, -1), pieces, blocks)
        del blocks
        out = flat.new_empty((flat.numel() // n,))
        with grad_sync_scope():
            record_collective("reduce_scatter", name, flat.numel() * flat.element_size(), "bwd")
        work = _reduce_scatter_single(out, flat, group=group, async_op=last)
        del flat  # an asynchronous work keeps it until it is waited for
        pieces = _split(out, layout)
    return work, lambda: [p() if callable(p) else p for p in pieces]


def _rank_blocks(p: torch.Tensor, dim: int, strided, n: int) -> torch.Tensor:
    """A view of gradient ``p`` as ``(n, ...)``: block ``r`` is what rank ``r`` keeps of the
    reduce-scatter to ``Shard(dim)`` (``strided``: cut in that many equal pieces, each in ``n``
    blocks; block ``r`` takes its block of every piece)."""
    moved = p.movedim(dim, 0)
    if strided:
        m = moved.shape[0] // (strided * n)
        return moved.unflatten(0, (strided, n, m)).transpose(0, 1)
    return moved.unflatten(0, (n, 1, moved.shape[0] // n))


def _fill(rows: torch.Tensor, pieces: list, blocks: list) -> None:
    """Copy each gradient (``blocks[i]``, a ``(rows, ...)`` view of ``pieces[i]``) into its
    columns of ``rows`` (the flat buffer seen as one row per rank), dropping it after."""
    offset = 0
    for i, block in enumerate(blocks):
        width = block[0].numel()
        rows[:, offset : offset + width].view(block.shape).copy_(block)
        offset += width
        pieces[i] = blocks[i] = None


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
        if edge.regather:  # ZeRO-3: its unreduced gradient, the whole weight's, is not held in a bucket
            self._launch(key, [(param, grad, mine)])
            return
        bucket = self._open.setdefault(key, [])
        bucket.append((param, grad, mine))
        if sum(g.numel() * g.element_size() for _, g, _ in bucket) >= self.bucket_bytes:
            self._launch(key, self._open.pop(key))

    def _launch(self, key, entries) -> None:
        """Start ``entries``' flat reduction (``entries`` is emptied: the flat buffer holds the
        gradients now). A reduce-scatter's flat input is all the bucket's unreduced gradients, held
        by its work until waited for: the reduce-scatters still in flight are waited for first, so
        at most one such input is alive (``passes.plan.bucket_memory`` counts it so)."""
        if any(kind == "reduce_scatter" for _, kind in key):
            self._wait_scatters()
        grads = [g if self.reduce_dtype is None else g.to(self.reduce_dtype) for _, g, _ in entries]
        parts = [mine for *_, mine in entries]
        # keep their dtype only, so that the gradients are freed once copied into the buffer
        held = [(param, g.dtype) for param, g, _ in entries]
        entries.clear()
        # the last (usually only) collective overlaps with the rest of backward
        work, finish = flat_reduce(grads, key, parts, self.comm, async_last=True)
        self._launched.append((held, work, finish, key))

    def _wait_scatters(self) -> None:
        """Wait for the launched buckets that end in a reduce-scatter and drop their works (each
        holds its flat input, the bucket's unreduced gradients, until then)."""
        for i, (held, work, finish, key) in enumerate(self._launched):
            if work is not None and key[-1][1] == "reduce_scatter":
                work.wait()
                self._launched[i] = (held, None, finish, key)

    def _finish(self) -> None:
        for key in sorted(self._open):
            self._launch(key, self._open.pop(key))
        with torch.no_grad():
            while self._launched:
                entries, work, finish, _ = self._launched.pop(0)
                if work is not None:
                    work.wait()
                del work  # a reduce-scatter's flat input is freed with it
                for (param, dtype), piece in zip(entries, finish()):
                    piece = piece.to(dtype)  # (cut along a later dim: strided like a reduce-scatter's)
                    if param.grad is None:
                        # a view of the reduced buffer (one copy of the gradients, not two)
                        param.grad = piece
                    else:
                        param.grad.add_(piece)
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
