"""Which dims hold whole blocks of an outer dim: a flattened batch x sequence dim is B blocks of S.

A dim cut over mesh axes is cut like ``torch.tensor_split`` (``passes/core/placements.py:
rank_local_shape``). That holds for a dim as it was made; a dim that a view made by flattening
``[B, S, H] -> [B * S, H]`` is cut where the ranks' pieces of ``B`` end: each rank's piece of the
flat dim is its whole samples, ``S`` elements each. Whether such a dim's pieces are equal is a
question about ``B``, not about ``B * S`` (144 = 6 x 24 divides by 4; 6 samples do not).

:func:`dim_blocks` walks a captured graph once and gives every value, per dim, its *blocks*
``(count, size, source)``: the dim holds ``count`` blocks of ``size`` elements, ``count`` being the
size of ``source``, an input placeholder's dim (``("input_ids", 0)``: the batch), or None for a dim no input's
dim sizes (a weight's heads); the whole value is None where the walk cannot tell. The walk:

* an input makes each dim one block per element, its own source; another placeholder, and an op
  other than a reshape all of whose inputs hold dims of blocks of 1, make dims of blocks of 1
  with no source;
* a reshape follows its runs of dims with equal products (:func:`passes.rules.views.view_groups`):
  the outermost output dim of a run whose size is a multiple of the count of the run's
  outermost input dim, where that dim has a source, keeps its count and source (its blocks ``size
  / count`` elements: ``[6, 24, 64] -> [144, 64]`` makes ``(6, 24, batch)``, and back ``(6, 1,
  batch)``); one coarser than blocks of several elements is unknown (a row would hold parts of
  two blocks); another output dim is made anew (grouped-query attention's ``[B, kv, rep, S, D] ->
  [B, kv * rep, S, D]`` makes 4 heads of one: no input sizes ``kv``);
* any other op passes a dim's blocks to the output dim its rule's strategies map it to
  (``Shard(d)`` in, ``Shard(e)`` out, equal sizes): transposes, elementwise ops, matmuls'
  batch and row dims, reductions' kept dims; where inputs hold it in nested blocks, the finest
  (where all are cut evenly, their pieces are the same; where one is not, its own input is marked
  uneven as the op reads it), where they do not nest, unknown; an output dim no strategy maps an
  input dim to is made anew; an op with no rule (it runs replicated) passes, dim by dim, the blocks
  of the first input of its output's rank where the sizes agree, and makes every other dim unknown.

Where a plan cut whole blocks (its own count of the source divides the dim's pieces: lowering
checks it, :class:`passes.lower.lower_to_local._UnevenPieces`), the dim's pieces are whole blocks
at any size, and its pieces are equal iff its block count divides by their number; a dim the
plan cut across blocks (a flattened batch of 2 over 4 ranks) is cut by elements.

"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from passes.analysis.analyze import info
from passes.core.placements import Shard
from passes.rules import IGNORED_OPS, has_rule, op_view, rule_for, tensor_input_nodes
from passes.rules.views import view_groups

__all__ = ["dim_blocks", "Blocks", "RESHAPES"]

aten = torch.ops.aten

RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unflatten.int)

Blocks = tuple
"""``(count, size, source)``: ``count`` blocks of ``size`` elements, cut only between blocks;
``source``: the input placeholder's ``(node name, dim)`` whose size ``count`` is, or None."""


def dim_blocks(graph: fx.Graph) -> dict:
    """Node -> per output, per dim: ``(count, size, source)`` or ``None`` (unknown); shapes from
    ``meta``."""
    blocks: dict = {}
    for node in graph.nodes:
        shapes = op_view(node).out_shapes if node.op == "call_function" else _shapes_of(node)
        made: list = [None if s is None else [(int(n), 1, None) for n in s] for s in shapes]
        if node.op == "placeholder" and info(node).kind == "input" and made and made[0] is not None:
            made[0] = [(n, 1, (node.name, d)) for d, (n, _, _) in enumerate(made[0])]
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
    """Does every dim of a value hold blocks of one element with no source (or is the value no tensor)?"""
    return dims is None or all(b is not None and b[1] == 1 and b[2] is None for b in dims)


def _passed_on(node: fx.Node, blocks: dict, made: list) -> list:
    """``node``'s outputs' blocks (``made``: as if made here) with its inputs' passed on."""
    if node.target is operator.getitem:
        outs, index = blocks.get(node.args[0]) or [], int(node.args[1])  # type: ignore[arg-type]
        return [outs[index]] if index < len(outs) else made
    if node.target in IGNORED_OPS:
        return made
    ins = [_first(blocks.get(u)) for u in tensor_input_nodes(node)]
    view = op_view(node)
    if not has_rule(node):
        # it runs replicated: an output dim of the size of the same dim of an input of its rank
        # holds that dim's blocks (an in-place update, CTRL's embedding scale; Mamba-2's conv1d keeps
        # [B, C] of [B, C, S]), so a later cut keeps them as its neighbours' cuts do; others unknown
        like = next(
            (b for b, shape in zip(ins, view.in_shapes) if b is not None and len(b) == len(made[0] or ())), None
        )
        if like is None or made[0] is None:
            return [None if dims is None else [None] * len(dims) for dims in made]
        kept = [b if b is not None and b[0] * b[1] == n else None for b, (n, _, _) in zip(like, made[0])]
        return [kept] + [None if dims is None else [None] * len(dims) for dims in made[1:]]
    if node.target in RESHAPES and ins[0] is not None and made[0] is not None:
        return [_reshaped(ins[0], view.in_shapes[0], view.out_shapes[0])] + made[1:]
    found: dict = {}
    for strategy in rule_for(node).axis_strategies(view):
        for j, out in enumerate(strategy.out):
            if not isinstance(out, Shard) or j >= len(made) or made[j] is None:
                continue
            for k, p in enumerate(strategy.ins[: len(ins)]):
                if (
                    isinstance(p, Shard)
                    and ins[k] is not None
                    and view.in_shapes[k][p.dim] == made[j][out.dim][0] * made[j][out.dim][1]
                ):
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
    fine = max(seen, key=lambda b: (b[0], b[2] is not None))
    if all(fine[0] % count == 0 and size % fine[1] == 0 for count, size, _ in seen):
        return fine
    return None


def _reshaped(ins: list, in_shape, out_shape) -> list:
    """The blocks of a reshape's output dims from its input's, run by run."""
    out: list[Blocks | None] = [(int(n), 1, None) for n in out_shape]
    for in_dims, out_dims in view_groups(in_shape, out_shape):
        outer_in = next((d for d in in_dims if in_shape[d] > 1), None)
        outer_out = next((d for d in out_dims if out_shape[d] > 1), None)
        if outer_in is None or outer_out is None:
            continue
        held = ins[outer_in]
        if held is None:  # pieces of unknown arrangement stay unknown
            out[outer_out] = None
        elif held[2] is not None and out_shape[outer_out] % held[0] == 0:  # whole blocks, split finer (or kept)
            out[outer_out] = (held[0], out_shape[outer_out] // held[0], held[2])
        elif held[1] > 1:  # blocks of several elements straddling the output's rows
            out[outer_out] = None
    return out
