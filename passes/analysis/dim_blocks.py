"""Which dims hold whole blocks of an outer dim: a flattened batch x sequence dim is B blocks of S.

A dim cut over mesh axes is cut like ``torch.tensor_split`` (``passes/core/placements.py:
rank_local_shape``). That holds for a dim as it was made; a dim that a view made by flattening
``[B, S, H] -> [B * S, H]`` is cut where the ranks' pieces of ``B`` end: each rank's piece of the
flat dim is its whole samples, ``S`` elements each. Whether such a dim's pieces are equal is a
question about ``B``, not about ``B * S`` (144 = 6 x 24 divides by 4; 6 samples do not).

:func:`dim_blocks` walks a captured graph once and gives every value, per dim, its *blocks*
``(count, size)``: the dim holds ``count`` blocks of ``size`` elements that every cut keeps whole
(``size`` 1 for a dim as made), or ``None`` where the walk cannot tell (then a caller treats the
dim's pieces as unknown). The walk:

* a placeholder, and an op other than a reshape all of whose inputs hold dims of blocks of 1,
  makes dims of blocks of 1;
* a reshape follows its runs of dims with equal products (:func:`passes.rules.views.view_groups`):
  the outermost output dim of a run whose size is a multiple of the count of the run's
  outermost input dim keeps that count (its blocks ``size / count`` elements: ``[6, 24, 64] ->
  [144, 64]`` makes ``(6, 24)``, and back ``(6, 1)``); one coarser than blocks of several
  elements is unknown (a row would hold parts of two blocks); another output dim is made anew;
* any other op passes a dim's blocks to the output dim its rule's strategies map it to
  (``Shard(d)`` in, ``Shard(e)`` out, equal sizes): transposes, elementwise ops, matmuls'
  batch and row dims, reductions' kept dims; where inputs hold it in nested blocks (``(2, 2)`` and
  ``(4, 1)``), the finest (where all are cut evenly, their pieces are the same; where one is not,
  its own input is marked uneven as the op reads it), where they do not nest, unknown; an output
  dim no strategy maps an input dim to is made anew (blocks of 1); an op with no rule (it runs
  replicated, and how a later cut of its output meets its input's blocks is not known) makes
  every dim unknown.

A dim is cut evenly over ``n`` pieces iff its block count divides by ``n``.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from passes.core.placements import Shard
from passes.rules import IGNORED_OPS, has_rule, op_view, rule_for, tensor_input_nodes
from passes.rules.views import view_groups

__all__ = ["dim_blocks", "Blocks", "RESHAPES"]

aten = torch.ops.aten

RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unflatten.int)

Blocks = tuple[int, int]
"""``(count, size)``: ``count`` blocks of ``size`` elements, cut only between blocks."""


def dim_blocks(graph: fx.Graph) -> dict:
    """Node -> per output, per dim: ``(count, size)`` or ``None`` (unknown); shapes from ``meta``."""
    blocks: dict = {}
    for node in graph.nodes:
        shapes = op_view(node).out_shapes if node.op == "call_function" else _shapes_of(node)
        made = [None if s is None else [(int(n), 1) for n in s] for s in shapes]
        inputs = tensor_input_nodes(node) if node.op == "call_function" else []
        if node.target in RESHAPES or any(not _made_here(_first(blocks.get(u))) for u in inputs):
            made = _passed_on(node, blocks, made)
        blocks[node] = made
    return blocks


def _shapes_of(node: fx.Node) -> list:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return [tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else None for v in vals]


def _first(outs):
    return outs[0] if outs else None


def _made_here(dims) -> bool:
    """Does every dim of a value hold blocks of one element (or is the value no tensor)?"""
    return dims is None or all(b is not None and b[1] == 1 for b in dims)


def _passed_on(node: fx.Node, blocks: dict, made: list) -> list:
    """``node``'s outputs' blocks (``made``: as if made here) with its inputs' passed on."""
    if node.target is operator.getitem:
        outs, index = blocks.get(node.args[0]) or [], int(node.args[1])  # type: ignore[arg-type]
        return [outs[index]] if index < len(outs) else made
    if node.target in IGNORED_OPS:
        return made
    if not has_rule(node):  # it runs replicated; how a later cut meets its input's blocks is unknown
        return [None if dims is None else [None] * len(dims) for dims in made]
    ins = [_first(blocks.get(u)) for u in tensor_input_nodes(node)]
    view = op_view(node)
    if node.target in RESHAPES and ins[0] is not None and made[0] is not None:
        return [_reshaped(ins[0], view.in_shapes[0], view.out_shapes[0])] + made[1:]
    found: dict = {}
    for strategy in rule_for(node).axis_strategies(view):
        for j, out in enumerate(strategy.out):
            if not isinstance(out, Shard) or j >= len(made) or made[j] is None:
                continue
            for k, p in enumerate(strategy.ins[: len(ins)]):
                if isinstance(p, Shard) and ins[k] is not None and view.in_shapes[k][p.dim] == made[j][out.dim][0]:
                    found.setdefault((j, out.dim), set()).add(ins[k][p.dim])
    for (j, e), seen in found.items():
        made[j][e] = _finest(seen)
    return made


def _finest(seen: set) -> Blocks | None:
    """One dim's blocks as its inputs hold it: the most, where they split the others' blocks
    (``(2, 2)`` and ``(4, 1)``: grouped-query attention's key/value heads repeated beside the
    query heads; where both are cut evenly their pieces are the same); None where they do not
    nest (or one is unknown)."""
    if None in seen:
        return None
    fine = max(seen)
    if all(fine[0] % count == 0 and size % fine[1] == 0 for count, size in seen):
        return fine
    return None


def _reshaped(ins: list, in_shape, out_shape) -> list:
    """The blocks of a reshape's output dims from its input's, run by run."""
    out: list[Blocks | None] = [(int(n), 1) for n in out_shape]
    for in_dims, out_dims in view_groups(in_shape, out_shape):
        outer_in = next((d for d in in_dims if in_shape[d] > 1), None)
        outer_out = next((d for d in out_dims if out_shape[d] > 1), None)
        if outer_in is None or outer_out is None:
            continue
        held = ins[outer_in]
        if held is None:  # pieces of unknown arrangement stay unknown
            out[outer_out] = None
        elif out_shape[outer_out] % held[0] == 0:  # whole blocks, each split finer (or kept)
            out[outer_out] = (held[0], out_shape[outer_out] // held[0])
        elif held[1] > 1:  # blocks of several elements straddling the output's rows
            out[outer_out] = None
    return out
