"""What autograd keeps for backward, per op of a captured graph, found by running the op.

Each op node's aten op runs once on fake tensors (no memory) of its inputs' shapes, dtypes and
strides, with ``requires_grad`` where the input needs a gradient, under the graph's autocast
dtype, inside ``torch.autograd.graph.saved_tensors_hooks``. Every tensor the pack hook sees is
classified by its storage, the unit memory is counted in:

* the storage of tensor input ``k`` (a view of it included): the op saves that input;
* the storage of its output ``j``: the op saves its output (softmax, attention);
* any other storage: a buffer of the op's own (a dropout mask, a norm's mean and reciprocal
  standard deviation, attention's log-sum-exp, an autocast copy), counted by its bytes.

The run also says whether an output shares its storage with an input (a view, which costs no
memory of its own). Results are cached by op and signature, so the layers of a repeated block
run once. An op that cannot run on fake tensors falls back to its rule's ``saves_inputs``
(every tensor input saved, nothing else).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable
from typing import cast

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from passes.core.node_info import Saves
from passes.rules import op_view, rule_for, tensor_input_nodes

__all__ = ["Saves", "saves_of"]


_CACHE: dict = {}


def _signature(node: fx.Node, grads: list, autocast) -> tuple | None:
    parts: list = [node.target, autocast]
    for leaf in pytree.tree_leaves((node.args, node.kwargs)):
        if isinstance(leaf, fx.Node):
            val = leaf.meta.get("val")
            if not isinstance(val, torch.Tensor):
                return None
            parts.append((tuple(val.shape), tuple(val.stride()), val.dtype))
        else:
            parts.append(repr(leaf))
    return (*parts, tuple(grads))


def _run(node: fx.Node, grads: list, autocast) -> Saves:
    mode = FakeTensorMode()
    with mode:
        fakes = []
        for leaf, grad in zip(tensor_input_nodes(node), grads):
            val = leaf.meta["val"]
            t = torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device="cpu")
            fakes.append(t.requires_grad_(grad))
        it = iter(fakes)
        args, kwargs = pytree.tree_map(lambda a: next(it) if isinstance(a, fx.Node) else a, (node.args, node.kwargs))
        args, kwargs = pytree.tree_map(
            lambda a: torch.device("cpu") if isinstance(a, torch.device) else a, (args, kwargs)
        )
        saved: list = []

        def pack(t):
            saved.append(t)
            return t

        casting = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
        with casting, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            target = cast(Callable, node.target)
            out = target(*args, **kwargs)
        outs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor)]

        def key(t):
            return t.untyped_storage()._cdata

        in_keys = [key(t) for t in fakes]
        out_keys = [key(t) for t in outs]
        inputs, outputs, extra, seen = set(), set(), 0.0, set()
        for t in saved:
            k = key(t)
            if k in in_keys:
                inputs.add(in_keys.index(k))
            elif k in out_keys:
                outputs.add(out_keys.index(k))
            elif k not in seen:
                seen.add(k)
                extra += t.untyped_storage().nbytes()
        alias = next((in_keys.index(k) for k in out_keys[:1] if k in in_keys), None)
    return Saves(tuple(sorted(inputs)), tuple(sorted(outputs)), extra, alias)


def saves_of(node: fx.Node, grads: list, autocast=None) -> Saves:
    """What ``node`` (an op of a captured graph) saves for backward when its tensor inputs need
    gradients as ``grads`` says (one bool per :func:`passes.rules.tensor_input_nodes` entry);
    ``autocast``: the dtype the graph runs under autocast in (None: none)."""
    inputs = tensor_input_nodes(node)
    if node.target is operator.getitem:
        return Saves(alias=0)
    own = rule_for(node).saves(op_view(node), grads)
    if own is not None:
        return own
    sig = _signature(node, grads, autocast)
    if sig is not None and sig in _CACHE:
        return _CACHE[sig]
    try:
        result = _run(node, grads, autocast)
    except Exception:  # noqa: BLE001 - an op fake tensors cannot run: its rule's coarse answer
        saves_inputs = getattr(rule_for(node), "saves_inputs", False)
        result = Saves(inputs=tuple(range(len(inputs))) if saves_inputs else ())
    if sig is not None:
        _CACHE[sig] = result
    return result
