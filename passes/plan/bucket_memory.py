"""The parameter gradients alive in backward, op by op, as :class:`runtime.grad_sync.GradientBuckets` holds them.

**Bucketed gradients.** A parameter used by one op, not a ZeRO-1 or offloaded weight (their
compute copies are reduced by :class:`runtime.optimizer_shards.OptimizerShards`), whose gradient
needs only reductions on the edge into that op (every move on an axis of more than one device
is ``Partial -> Replicate``, an all-reduce, or ``Partial -> Shard``, a reduce-scatter onto a
weight stored sharded): :func:`reduction_signature`, the same test lowering makes
(``passes.lower.lower_to_local._bucketable``) and :mod:`passes.plan.collective_calls` counts
calls with. Its gradient is handed to the bucket of its signature at the consumer's gradient
placement, the bytes the consumer's backward makes (for a weight stored sharded: the whole
weight's, ``n`` times the ``.grad`` it becomes). Any other parameter's gradient is its ``.grad``
(the plan's ``gradients`` for it) from the backward of its first consumer in backward order, and
during each consumer's backward also the gradient as the consumer makes it (a weight stored
sharded: whole), which its edge moves into the ``.grad``.

**The walk** (:func:`gradients_in_backward`), over the ops in reverse program order (backward's):

* a bucketed gradient is held from its consumer's backward until its bucket is launched; a
  ZeRO-3 weight's (``regather``) is launched at once in a bucket of its own, as the runtime does;
* a bucket is launched during the backward of the op whose gradient brings it to
  :data:`passes.core.bucket_sizes.BUCKET_BYTES` or more: its flat buffer is filled while its gradients
  are alive (+ the bucket's bytes), then they are dropped. An all-reduce's buffer becomes the
  ``.grad``; a reduce-scatter's output does (``1/n`` of it), and its input is held by its work
  until the next reduce-scatter bucket is launched (the runtime waits for the one in flight
  first) or backward ends;
* at the end of backward the open buckets are launched in the order of their signatures, then
  every work is waited for: every ``.grad`` is there.

It gives the gradient bytes alive while each op's backward runs (the gradients it makes
included) and the most alive at the end of backward, when nothing saved for backward is left;
:mod:`passes.plan.memory_accounting` writes them as the records' ``gradients_alive`` and
:mod:`partitioner.memory` walks backward with them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch.fx as fx

from passes.analysis.analyze import info
from passes.core import bucket_sizes
from passes.core.node_info import grad_flows
from passes.core.placements import dual_spec, is_partial, is_shard, transition_steps
from passes.plan.cost_model import dtype_bytes, local_bytes
from passes.rules import tensor_input_nodes

__all__ = ["reduction_signature", "gradients_in_backward", "GradientsInBackward"]

logger = logging.getLogger(__name__)


def reduction_signature(grad, src, mesh_shape) -> tuple | None:
    """``((axis, kind), ...)`` of a parameter gradient made placed ``grad`` and sent to the dual
    of its storage ``src`` when every move on an axis of more than one device is a reduction
    (``kind`` ``"all_reduce"`` or ``"reduce_scatter"``), as the runtime's
    :func:`runtime.grad_sync.reduce_moves` keys its buckets; else None."""
    moves = [(a, p, q) for a, p, q in transition_steps(tuple(grad), tuple(dual_spec(src))) if mesh_shape[a] > 1]
    if not moves or not all(is_partial(p) and not is_partial(q) for _, p, q in moves):
        return None
    return tuple((a, "reduce_scatter" if is_shard(q) else "all_reduce") for a, _, q in moves)


@dataclass
class GradientsInBackward:
    """Parameter gradient bytes alive in backward (the module docstring)."""

    during: dict = field(default_factory=dict)
    """Op -> bytes alive while its backward runs."""
    before: dict = field(default_factory=dict)
    """Op -> bytes alive when its backward starts, before it makes any gradient."""
    at_end: float = 0.0
    """The most alive while the open buckets are launched at the end of backward (at least every
    ``.grad``)."""


@dataclass
class _Bucket:
    scatter: bool
    whole: float = 0.0  # bytes of the gradients it holds, as the consumers make them
    grad: float = 0.0  # the bytes of the .grad they become


class _Gradients:
    """The gradients made so far and the runtime's buckets, filled in backward order (bytes only)."""

    def __init__(self, limit: float):
        self.limit = limit
        self.grads = 0.0  # .grad made: other parameters', launched buckets'
        self.open: dict = {}  # signature -> _Bucket
        self.in_flight = 0.0  # a launched reduce-scatter's flat input

    def alive(self) -> float:
        return self.grads + self.in_flight + sum(b.whole for b in self.open.values())

    def add(self, signature: tuple, whole: float, grad: float, *, alone: bool = False) -> float:
        """Add a bucketed gradient (``whole`` bytes as made, ``grad`` its ``.grad``'s; ``alone``:
        launched at once in a bucket of its own); the most alive while this happens (a launch
        included)."""
        scatter = any(k == "reduce_scatter" for _, k in signature)
        if alone:
            return self.launch(signature, _Bucket(scatter, whole, grad))
        bucket = self.open.setdefault(signature, _Bucket(scatter))
        bucket.whole += whole
        bucket.grad += grad
        if bucket.whole < self.limit:
            return self.alive()
        return self.launch(signature)

    def launch(self, signature: tuple, alone: _Bucket | None = None) -> float:
        """Launch the open bucket of ``signature`` (or ``alone``, a gradient's own): the most
        alive while its flat buffer is filled beside its gradients."""
        bucket = self.open.pop(signature) if alone is None else alone
        if bucket.scatter:
            self.in_flight = 0.0  # the one in flight is waited for first
        most = self.alive() + 2 * bucket.whole
        self.grads += bucket.grad
        if bucket.scatter:
            self.in_flight = bucket.whole
        return most


def gradients_in_backward(graph: fx.Graph, choices: dict, mesh_shape, out_spec, grad_bytes) -> GradientsInBackward:
    """The parameter gradient bytes alive in the backward of a plan without a pipeline
    (``choices``: node -> NodeChoice; ``out_spec(node)``: its placement; ``grad_bytes(param)``:
    the plan's ``gradients`` for it)."""
    found = GradientsInBackward()
    state = _Gradients(bucket_sizes.BUCKET_BYTES)
    made: set = set()
    pending = 0.0  # the launches after the op before: while the next op's backward starts
    ops = [n for n in graph.nodes if n.op == "call_function" and info(n).kind == "op"]
    for c in reversed(ops):
        mine = choices.get(c)
        if mine is None or mine.strategy is None:
            continue
        before, made_here, launches = state.alive(), 0.0, []
        for k, u in enumerate(tensor_input_nodes(c)):
            if info(u).kind != "param" or not grad_flows(u, c):
                continue
            gradient = _bucketed_gradient(u, c, k, mine, choices, mesh_shape, out_spec)
            if gradient is not None:
                made_here += gradient[1]
                launches.append((gradient, grad_bytes(u), bool(choices[u].regather)))
            else:  # as the consumer makes it (moved on its edge into the .grad), then its .grad
                made_here += _made_bytes(u, c, k, mine, mesh_shape)
                if u not in made:
                    state.grads += grad_bytes(u)
            made.add(u)
        # its backward makes the gradients; the buckets take them after it, its saved tensors
        # freed: a launch then is counted while the next op's backward starts
        found.during[c] = max(pending, before + made_here)
        found.before[c] = before
        pending, waiting = 0.0, sum(whole for (_, whole), _, _ in launches)
        for (signature, whole), grad, alone in launches:  # ZeRO-3: reduce-scattered at once, alone
            waiting -= whole
            pending = max(pending, state.add(signature, whole, grad, alone=alone) + waiting)
    for signature in sorted(state.open):
        pending = max(pending, state.launch(signature))
    found.at_end = max(pending, state.alive())
    logger.debug(
        "parameter gradients in backward: %.0f B alive at most, %.0f B at its end",
        max(found.during.values(), default=0.0),
        found.at_end,
    )
    return found


def _made_bytes(u, c, k, mine, mesh_shape) -> float:
    """Bytes of parameter ``u``'s gradient as ``c``'s backward makes it (its gradient placement)."""
    grad = mine.strategy.grad_spec(k) if k < len(mine.ins) and mine.ins[k] is not None else None
    if grad is None:
        return 0.0
    return local_bytes(info(u).shape or (), grad, mesh_shape, dtype_bytes(info(u).dtype))


def _bucketed_gradient(u, c, k, mine, choices, mesh_shape, out_spec) -> tuple | None:
    """(signature, bytes as ``c`` makes it) of parameter ``u``'s gradient along its edge into
    input ``k`` of ``c`` when it joins a bucket, else None."""
    ui, placed = info(u), choices.get(u)
    if len(u.users) != 1 or placed is None or placed.stored is not None or placed.offload:
        return None
    if k >= len(mine.ins) or mine.ins[k] is None:
        return None
    grad, src = mine.strategy.grad_spec(k), out_spec(u)
    if grad is None or src is None:
        return None
    signature = reduction_signature(grad, src, mesh_shape)
    if signature is None:
        return None
    return signature, local_bytes(ui.shape or (), grad, mesh_shape, dtype_bytes(ui.dtype))
