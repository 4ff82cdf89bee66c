"""``Reshard``: the edge of a lowered program that moves a tensor between two placements.

:class:`Reshard` (an ``nn.Module``, so the lowered program prints it readably) moves a
tensor from its producer's placement to the placement its consumer needs; its backward
moves the gradient from the placement the consumer produces to the dual of the producer's
placement, exactly the moves the cost model priced. Every collective reports its kind, mesh
axis, payload bytes and phase to the active :class:`runtime.collectives.CommCounter` objects,
so tests can check that the runtime sends what the plan says; those that sync a parameter's
gradient (the backward of an edge whose input is a parameter, and the gradient buckets) are
also counted apart, as gradient syncs.

A parameter edge's backward can be deferred (``ParallelModule.no_sync``, through the
``deferred`` object set on the edge, :class:`runtime.grad_sync.DeferredSyncs`): the incoming
gradient is kept, unreduced, instead of being moved, and added to the next synced one before
its moves, which are linear, so one collective sends the sum.

The moves themselves are :mod:`runtime.collectives`; the gradient buckets and deferred syncs
(:mod:`runtime.grad_sync`), the forward gathers started ahead (:mod:`runtime.prefetch`) and the
ZeRO-3 regathers (:mod:`runtime.regather`) are the edge's collaborators, each below it.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from passes.core.placements import dual_spec, format_spec, gradient_shrinks, is_partial, is_shard, transition_steps
from runtime.collectives import MeshComm, PendingMoves, gather_first, grad_sync_scope, run_steps, start_steps
from runtime.grad_sync import reduce_moves
from runtime.prefetch import take_prefetched
from runtime.regather import remember
from runtime.uneven_moves import move_uneven, touches_uneven

if TYPE_CHECKING:
    from runtime.grad_sync import DeferredSyncs, GradientBuckets

__all__ = ["Reshard"]


class _ReshardFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, module):
        ctx.module = module
        ctx.sizes = {}  # unequal pieces' sizes a forward join found, for the backward's split
        out = module._forward_moves(x, sizes=ctx.sizes)
        # A slice of the input (Replicate -> Shard) or the input itself would leave autograd a
        # view made inside a custom Function, which the model may not modify in place (Falcon's
        # ``mlp_output += attention_output``): hand out a tensor of its own. A parameter that
        # does not move is passed through (no weight is modified in place; a copy would double
        # the weights' memory for the step).
        if out is x and module.param_edge is not None:
            return out
        out = out.clone() if out is x or out._is_view() else out
        if module.regather:  # ZeRO-3: backward gathers the copy again (runtime/regather.py)
            remember(out, module, x)
        return out

    @staticmethod
    def backward(ctx, grad):
        module = ctx.module
        if module.deferred is not None:  # a parameter's gradient sync, held back under no_sync
            grad = module.deferred.take(module, grad)
            if grad is None:
                return None, None
        if module.sync is not None:  # a parameter's gradient sync, bucketed (runtime/grad_sync.py)
            module.sync.add(module.sync_param, grad, module)
            return None, None
        if module.backward_steps is None:
            return None, None
        return module.backward_moves(grad, ctx.sizes), None


class Reshard(torch.nn.Module):
    """Move a tensor from ``src`` to ``dst``; its gradient from ``grad`` to the dual of ``src``.

    ``strided`` (``{axis: pieces}``): on those axes a ``Shard`` on the consumer's side (``dst``
    forward, ``grad`` backward) is strided: each rank holds its block of every one of ``pieces``
    equal pieces, as a later split of the sharded dim needs (fused QKV). ``src_strided``: the
    same for the producer's side (a parameter loaded in that layout)."""

    def __init__(self, comm: MeshComm, src, dst, grad=None, strided=None, src_strided=None, grad_dst=None):
        super().__init__()
        self.comm = comm
        self.src, self.dst, self.grad = tuple(src), tuple(dst), (tuple(grad) if grad is not None else None)
        self.strided, self.src_strided = dict(strided or {}), dict(src_strided or {})
        # where the gradient arrives: the dual of ``src``, or (a ZeRO-1 weight's edge) ``grad_dst``
        self.grad_dst = tuple(grad_dst) if grad_dst is not None else dual_spec(self.src)
        self.forward_steps = transition_steps(self.src, self.dst)
        self.backward_steps = transition_steps(self.grad, self.grad_dst) if self.grad is not None else None
        # set when this edge's backward joins gradient buckets (ParallelModule._add_variant)
        self.sync: GradientBuckets | None = None
        self.sync_param: torch.Tensor | None = None
        self.param_edge: str | None = None  # set by lowering: the parameter placeholder this edge reads
        self.reduce_dtype: torch.dtype | None = None  # a parameter edge's gradient sync dtype (precision)
        # set when ``no_sync`` may hold back this edge's backward (ParallelModule._add_variant)
        self.deferred: DeferredSyncs | None = None
        self.regather = False  # set by lowering: a ZeRO-3 parameter's edge (runtime/regather.py)
        self.weight_name: str | None = None  # set by lowering: the parameter's FQN (errors, logs)
        self.pending = None  # a prefetched forward gather: (input, its version, PendingMoves)
        # set by lowering: dims of this edge's tensor cut into unequal pieces at the shapes it was
        # lowered for, which its moves join or split (runtime/uneven_moves.py)
        self.uneven: frozenset = frozenset()
        self.uneven_units: dict = {}  # per such dim, the elements of one sample (cuts keep samples whole)

    @property
    def forward_communicates(self) -> bool:
        """True when the forward moves send anything (a gather, not only local slices)."""
        moves = [m for m in self.forward_steps or () if self.comm.shape[m[0]] > 1]
        return any(is_shard(p) or is_partial(p) for _, p, _ in moves)

    @property
    def backward_communicates(self) -> bool:
        """True when the backward moves send anything (not only local slices and zeros)."""
        moves = [m for m in self.backward_steps or () if self.comm.shape[m[0]] > 1]
        return any(is_shard(p) or is_partial(p) for _, p, _ in moves)

    @property
    def backward_shrinks(self) -> bool:
        """True when the backward leaves each device a smaller piece than it gets (a
        reduce-scatter onto a weight stored sharded): a pipeline stage moves such a gradient in
        every microbatch instead of holding it whole (:mod:`runtime.pipeline`)."""
        return gradient_shrinks(self.grad, self.grad_dst, self.comm.shape)

    def _special(self, phase: str, sizes: dict | None):
        """The moves of dims cut into unequal pieces, for :func:`runtime.collectives.run_steps`."""
        if not self.uneven:
            return None
        found = {} if sizes is None else sizes

        def move(x, axis, p, q):
            if not touches_uneven(p, q, self.uneven):
                return None
            return move_uneven(x, axis, p, q, self.comm, phase, found, self.uneven_units)

        return move

    def backward_moves(self, grad: torch.Tensor, sizes: dict | None = None) -> torch.Tensor:
        """The gradient moved from the consumer's placement to the dual of the producer's (a
        parameter's edge: counted as a gradient sync). ``sizes``: the unequal pieces the
        forward joined (:mod:`runtime.uneven_moves`)."""
        sync = grad_sync_scope() if self.param_edge is not None else contextlib.nullcontext()
        dtype = self.reduce_dtype if self.param_edge is not None and self.reduce_dtype is not None else grad.dtype
        with sync:
            moved = run_steps(
                grad.to(dtype),
                self.backward_steps,
                self.comm,
                "bwd",
                self._strided_of(self.grad, self.strided),
                self._strided_of(self.grad_dst, self.src_strided),
                self._special("bwd", sizes),
            )
        moved = moved.to(grad.dtype)
        # a parameter's gradient cut out of a whole one (Replicate -> Shard) is a view: the
        # parameter's .grad would keep the whole gradient's storage alive; keep the piece only
        return moved.clone() if self.param_edge is not None and moved._base is not None else moved

    @property
    def sync_moves(self):
        """The backward's reduction for gradient buckets (:func:`runtime.grad_sync.reduce_moves`):
        None unless every move that sends is ``Partial -> Replicate`` or ``Partial -> Shard``."""
        return reduce_moves(self.backward_steps, self.comm, self._strided_of(self.grad_dst, self.src_strided))

    @staticmethod
    def _strided_of(spec, strided):
        return {a: f for a, f in strided.items() if spec is not None and is_shard(spec[a])}

    @property
    def prefetchable(self) -> bool:
        """True when the forward's first move that sends data is an all-gather (a weight stored
        sharded): it can start before the program reaches this edge (:mod:`runtime.prefetch`)."""
        return gather_first(self.forward_steps, self.comm)

    def start_forward(self, x, phase: str) -> PendingMoves:
        """The forward moves of ``x`` with the first all-gather left running (see :attr:`prefetchable`)."""
        return start_steps(
            x,
            self.forward_steps,
            self.comm,
            phase,
            self._strided_of(self.src, self.src_strided),
            self._strided_of(self.dst, self.strided),
            what=self.weight_name or self.param_edge or "a tensor",
        )

    def _forward_moves(self, x, phase="fwd", sizes=None):
        if phase == "fwd" and self.pending is not None:  # started ahead (runtime/prefetch.py)
            out = take_prefetched(self, x)
            if out is not None:
                return out
        return run_steps(
            x,
            self.forward_steps,
            self.comm,
            phase,
            self._strided_of(self.src, self.src_strided),
            self._strided_of(self.dst, self.strided),
            self._special(phase, sizes),
        )

    def regather_moves(self, x):
        """The forward moves again, in backward: a ZeRO-3 parameter's copy gathered once more."""
        return self._forward_moves(x, phase="bwd")

    @property
    def is_noop(self) -> bool:
        moves = lambda steps: [s for s in steps or () if self.comm.shape[s[0]] > 1]  # noqa: E731
        return not moves(self.forward_steps) and not moves(self.backward_steps)

    def forward(self, x):
        if not torch.is_grad_enabled() or not x.requires_grad:
            return self._forward_moves(x)
        return _ReshardFn.apply(x, self)

    def extra_repr(self) -> str:
        text = f"{format_spec(self.src)} -> {format_spec(self.dst)}"
        if self.grad is not None:
            text += f"; grad {format_spec(self.grad)} -> {format_spec(self.grad_dst)}"
        if self.strided:
            text += f"; strided shards {self.strided}"
        if self.sync is not None:
            text += "; gradient all-reduce bucketed"
        if self.regather:
            text += "; freed after forward, gathered again in backward (ZeRO-3)"
        if self.uneven:
            text += f"; unequal pieces on dims {sorted(self.uneven)}"
        return text
