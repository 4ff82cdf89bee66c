"""Eager attention as one ``scaled_dot_product_attention`` op, so ring and Ulysses can run it.

HF models with ``attn_implementation="eager"`` (and hand-written ones) compute attention as
ops: ``matmul(q, k^T)``, a scale (``mul`` / ``div`` by a number), an additive mask (``add``),
``softmax`` over the keys, casts, ``dropout``, ``matmul(., v)``. The core is recognised as the
selective recomputation recognises it (:func:`passes.plan.recompute.eager_attention_contractions`:
a softmax between a contraction of two activations and another); this pass then reads the exact
chain between the two contractions and, when it is the math of
``scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=s)``, replaces the chain by that
op. The fused op then has every plan the attention rule offers (head split, batch split, ring,
Ulysses) and lowers to the same runtime modules.

A chain is fused only when the fused op computes exactly what it computed:

* backwards from the softmax: casts that keep the dtype, at most one ``add`` of a mask tensor
  (after every scale, as ``scaled_dot_product_attention`` adds it), ``mul`` / ``div`` by Python
  numbers (their product is the scale); then ``matmul(q, transpose(k, -2, -1))``;
* forwards from the softmax (over the last dim): casts that keep the dtype, ``dropout`` with
  ``p = 0`` or in eval mode; then ``matmul(probabilities, v)``;
* q, k, v 4-D ``[batch, heads, sequence, head_dim]`` with equal batch, heads and head dims, every
  value in the chain in one floating dtype (a softmax computed in another precision is left
  as it is), the mask of that dtype, broadcastable to the scores and needing no gradient (a
  learned bias would get none from the fused op); every value inside the chain read only by
  the chain (attention probabilities returned to the user stay eager).

Anything else stays as eager ops, planned op by op by the matmul, softmax and elementwise rules
(head, batch and query splits): a priced plan, never a wrong one. The pass runs where
``sequence_parallel`` forces ring or Ulysses (:func:`fuse_for`), on every rank's capture (the
plan's fingerprint is the fused graph's), before planning or replaying.
"""

from __future__ import annotations

import contextlib
import logging
import numbers
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from passes.analysis.analyze import analyze, info
from passes.plan.recompute import eager_attention_contractions, is_softmax
from passes.rules import tensor_input_nodes

aten = torch.ops.aten
logger = logging.getLogger(__name__)

__all__ = ["fuse_eager_attention", "fuse_for"]

_CASTS = (aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout)
_MUL = (aten.mul.Tensor, aten.mul.Scalar)
_DIV = (aten.div.Tensor, aten.div.Scalar)


class _NotFusable(Exception):
    pass


def _users(node) -> list:
    """The users that compute (shape / dtype assertions left out)."""
    return [u for u in node.users if info(u).kind != "ignored"]


def _only_user(node, nxt) -> None:
    if _users(node) != [nxt]:
        raise _NotFusable(f"{node.name} is also read outside the attention core")


def _val(node):
    return node.meta.get("val")


def _cast_keeps(node, dtype) -> bool:
    return node.target in _CASTS and getattr(_val(node), "dtype", None) == dtype


def _other(node, chain_input):
    """The argument of a binary op that is not ``chain_input``."""
    a, b = node.args[0], node.args[1]
    return b if a is chain_input else a


def _match(softmax, inside) -> dict:
    """The chain around ``softmax`` as ``scaled_dot_product_attention``'s arguments, or raise
    :class:`_NotFusable` with the reason."""
    before, after = eager_attention_contractions(softmax, inside)
    if len(before) != 1 or len(after) != 1:
        raise _NotFusable("it is not one contraction before and one after the softmax")
    scores, out = before[0], after[0]
    if scores.target is not aten.matmul.default or out.target is not aten.matmul.default:
        raise _NotFusable("its contractions are not matmuls")
    dtype = getattr(_val(out), "dtype", None)
    if dtype is None or not dtype.is_floating_point:
        raise _NotFusable("its output is not floating point")
    dim = softmax.args[1] if len(softmax.args) > 1 else softmax.kwargs.get("dim")
    ndim = len(info(softmax).shape)
    if dim not in (-1, ndim - 1) or ndim != 4:
        raise _NotFusable(f"the softmax is over dim {dim} of a {ndim}-d tensor, not the keys of 4-d scores")
    if getattr(_val(softmax), "dtype", None) != dtype:
        raise _NotFusable("the softmax runs in another dtype than q, k and v")
    chain, mask, scale, scaled = [softmax], None, 1.0, False
    node = softmax.args[0]
    while node is not scores:  # backwards: casts, the mask, the scale
        if not isinstance(node, fx.Node):
            raise _NotFusable("its scores are not computed in the graph")
        _only_user(node, chain[-1])
        prev: Any = node.args[0] if isinstance(node.args[0], fx.Node) else None
        if _cast_keeps(node, dtype):
            pass
        elif node.target is aten.add.Tensor and len(node.args) == 2 and not node.kwargs and mask is None and not scaled:
            prev = node.args[0] if node.args[0] in inside and _reaches(node.args[0], scores) else node.args[1]
            mask = _other(node, prev)
            if not isinstance(mask, fx.Node):
                raise _NotFusable(f"{node.name} adds a number, not a mask")
        elif node.target in _MUL + _DIV and len(node.args) == 2:
            prev = node.args[0] if isinstance(node.args[0], fx.Node) else node.args[1]
            factor = _other(node, prev)
            if not isinstance(factor, numbers.Real) or (node.target in _DIV and prev is not node.args[0]):
                raise _NotFusable(f"{node.name} scales by {factor!r}, not by a number")
            scale = scale / float(factor) if node.target in _DIV else scale * float(factor)
            scaled = True
        else:
            raise _NotFusable(f"{node.name} ({node.target}) is not a scale, a mask or a cast")
        chain.append(node)
        node = prev
    _only_user(scores, chain[-1])
    forward, node = [], softmax
    while node is not out:  # forwards: casts, dropout that drops nothing
        users = _users(node)
        if len(users) != 1:
            raise _NotFusable(f"{node.name} is also read outside the attention core")
        node = users[0]
        if node is out:
            break
        if node.target is aten.dropout.default:
            p, train = node.args[1], node.args[2]
            if p and train:
                raise _NotFusable(f"it has attention dropout ({node.name}, p={p})")
        elif not _cast_keeps(node, dtype):
            raise _NotFusable(f"{node.name} ({node.target}) is not a cast or dropout")
        forward.append(node)
    if out.args[0] is not (forward[-1] if forward else softmax):
        raise _NotFusable("the probabilities are the second operand of the last matmul")
    q, k_t, v = scores.args[0], scores.args[1], out.args[1]
    if k_t.target is not aten.transpose.int or {d % 4 for d in k_t.args[1:3]} != {2, 3}:
        raise _NotFusable(f"the keys enter the scores as {k_t.name}, not as a transpose of the last two dims")
    k = k_t.args[0]
    qs, ks, vs = (tuple(info(n).shape) for n in (q, k, v))
    if not (len(qs) == len(ks) == len(vs) == 4 and qs[:2] == ks[:2] == vs[:2] and qs[3] == ks[3] == vs[3]):
        raise _NotFusable(f"q {qs}, k {ks}, v {vs} are not [batch, heads, sequence, head_dim] alike")
    if ks[2] != vs[2] or any(info(n).dtype != dtype for n in (q, k, v)):
        raise _NotFusable("k and v differ in length, or q, k, v in dtype")
    if mask is not None:
        ms = tuple(info(mask).shape)
        target = (qs[0], qs[1], qs[2], ks[2])
        if len(ms) > 4 or any(m not in (1, t) for m, t in zip(ms[::-1], target[::-1])):
            raise _NotFusable(f"the mask {mask.name} {ms} does not broadcast to the scores {target}")
        if info(mask).dtype != dtype:
            raise _NotFusable(f"the mask {mask.name} is {info(mask).dtype}, not {dtype}")
        if info(mask).requires_grad:
            raise _NotFusable(f"the mask {mask.name} is a learned bias (it needs a gradient)")
    nodes = [scores, *chain[1:], softmax, *forward, out]
    return dict(q=q, k=k, v=v, k_t=k_t, mask=mask, scale=scale, out=out, nodes=nodes)


def _reaches(node, target) -> bool:
    """Whether ``target`` is ``node`` or among its inputs' ancestors (a few steps, inside a chain)."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n is target:
            return True
        if n in seen or not isinstance(n, fx.Node) or n.op != "call_function":
            continue
        seen.add(n)
        todo += tensor_input_nodes(n)
    return False


def _replace(graph: fx.Graph, m: dict) -> fx.Node:
    args = (m["q"], m["k"], m["v"]) + ((m["mask"],) if m["mask"] is not None else ())
    with graph.inserting_before(m["out"]):
        fused = graph.call_function(aten.scaled_dot_product_attention.default, args, {"scale": m["scale"]})
    fused.meta = dict(m["out"].meta)
    fused.meta["val"] = _fake_output(args, m["scale"])
    m["out"].replace_all_uses_with(fused)
    for node in sorted(m["nodes"], key=lambda n: -_position(graph, n)):
        for user in list(node.users):  # shape / dtype assertions on a removed value
            graph.erase_node(user)
        graph.erase_node(node)
    if not _users(m["k_t"]):
        for user in list(m["k_t"].users):
            graph.erase_node(user)
        graph.erase_node(m["k_t"])
    return fused


def _fake_output(args, scale):
    """The fused op's output on the capture's fake tensors: its own layout (the kernel's, which
    the ops after it see: a transpose of it may be contiguous where the matmul's was not)."""
    vals = [a.meta["val"] for a in args]
    mode = torch._guards.detect_fake_mode(vals)
    with mode if mode is not None else contextlib.nullcontext():
        return aten.scaled_dot_product_attention.default(*vals, scale=scale)


def _layout(val):
    return [(tuple(t.shape), t.stride()) for t in pytree.tree_leaves(val) if isinstance(t, torch.Tensor)]


def _propagate_layouts(graph: fx.Graph, changed: set) -> None:
    """Run again, on fake tensors, every op after a fused one whose input's layout changed, so
    the analysis sees the strides the program will have (whether a ``contiguous`` copies)."""
    mode = torch._guards.detect_fake_mode([n.meta["val"] for n in changed])
    if mode is None:
        return
    for node in graph.nodes:
        if node.op != "call_function" or node in changed or node.meta.get("val") is None:
            continue
        if not any(a in changed for a in node.all_input_nodes):
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
        with mode:
            val = node.target(*args, **kwargs)
        if _layout(val) != _layout(node.meta["val"]):
            node.meta["val"] = val
            changed.add(node)


def _position(graph, node) -> int:
    return next(i for i, n in enumerate(graph.nodes) if n is node)


def fuse_eager_attention(cap) -> list:
    """Replace every fusable eager attention core of ``cap`` by one
    ``scaled_dot_product_attention`` node (``cap`` analysed; analysed again after); returns the
    fused nodes' names. A core that cannot be fused is logged with the reason and left."""
    graph = cap.graph
    inside = {n for n in graph.nodes if n.op == "call_function"}
    fused = []
    for softmax in [n for n in graph.nodes if is_softmax(n)]:
        if softmax not in inside:
            continue
        try:
            match = _match(softmax, inside)
        except _NotFusable as why:
            before, after = eager_attention_contractions(softmax, inside)
            if before and after:
                logger.info(
                    "eager attention at %s (%s) stays as ops (no ring / Ulysses there): %s",
                    softmax.name,
                    info(softmax).module_path or "top level",
                    why,
                )
            continue
        inside -= set(match["nodes"])
        fused.append(_replace(graph, match).name)
    if fused:
        _propagate_layouts(graph, {n for n in graph.nodes if n.name in fused})
        graph.lint()
        cap.graph_module.recompile()
        analyze(cap)
        logger.info("eager attention fused into scaled_dot_product_attention: %s", ", ".join(fused))
    return fused


def fuse_for(cap, sequence_parallel: str) -> list:
    """:func:`fuse_eager_attention` where ``sequence_parallel`` forces ring or Ulysses; else
    nothing (under ``"auto"`` and ``"none"`` eager attention is planned op by op)."""
    from passes.rules.attention import SEQUENCE_ALGORITHMS

    return fuse_eager_attention(cap) if sequence_parallel in SEQUENCE_ALGORITHMS else []
