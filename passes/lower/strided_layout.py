"""The strided layout a split of a sharded dim needs, and which values and weights take it.

A ``split`` / ``chunk`` of a dim sharded on a mesh axis (rule note ``strided``,
:mod:`passes.rules.views`) hands each rank its block of every piece, so the value it splits must
hold, on that axis, block ``r`` of each of the ``pieces`` equal pieces on rank ``r`` (the
strided layout), not one contiguous block. Which values are laid out so is found by walking
back from the split (:func:`strided_chains`):

* a member's inputs that it reads sharded on a strided axis, placed as their producer left them
  there (no move), carry the layout: they are members too, and the walk goes on from them;
* the walk stops where the shard begins: a matmul whose weight makes the dim (Megatron's fused
  QKV), an embedding whose table does (RoFormer's sinusoidal positions), or any op whose sharded
  input arrives by an edge that cuts it (a replicated value);
* a parameter a member reads sharded is loaded in the strided layout where it is stored cut
  along that dim (:func:`strided_parameters`), else its edge cuts it strided; an edge into a
  member from a value that is not one cuts and gathers in the strided layout
  (:func:`edge_strided`), and a value held in contiguous blocks cannot enter (refused, naming it).

Several splits of one value (RoFormer's layers each split the one position table) share its
members. A member read by an op outside them (a sum with the whole table, a graph
output) is gathered or moved from its strided blocks (the edge's ``src_strided``); one that op
would read sharded as it is would take strided blocks for contiguous ones, so that plan is
refused, naming both nodes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch.fx as fx

from passes.analysis.analyze import info
from passes.core.placements import is_shard, parse_spec
from passes.core.plan_records import NodeRecord, typed_by_name
from passes.lower.errors import LoweringError
from passes.rules import tensor_input_nodes
from runtime.collectives import MeshComm

__all__ = ["StridedLayout", "edge_strided", "strided_chains", "strided_parameters", "strided_where_read"]


def _specs(values, ndim):
    return [None if v is None else parse_spec(v, ndim) for v in values]


def _split_axes(node: fx.Node, record: NodeRecord | None, comm: MeshComm) -> list:
    notes = (record.notes if record is not None else None) or {}
    axes = [comm.axis_names.index(a) for a, note in notes.items() if note == "strided"]
    return [a for a in axes if comm.shape[a] > 1]


def _carriers(node: fx.Node, records: dict[str, NodeRecord], comm: MeshComm, axes: list) -> list:
    """``node``'s inputs computed by ops that hand it, unmoved, a value sharded on ``axes``."""
    reads = _specs(records[node.name].ins, comm.ndim)
    found = []
    for u, read in zip(tensor_input_nodes(node), reads):
        if u.op != "call_function" or read is None or u.name not in records:
            continue
        made = _specs(records[u.name].out, comm.ndim)[0]
        if made is not None and any(is_shard(read[a]) and made[a] == read[a] for a in axes):
            found.append(u)
    return found


def _chain(split: fx.Node, records: dict[str, NodeRecord], comm: MeshComm, axes: list) -> list:
    """The split and every value that carries its sharded dim to it (see the module docstring)."""
    chain, todo = [split], [split]
    while todo:
        for u in _carriers(todo.pop(), records, comm, axes):
            if u not in chain:
                chain.append(u)
                todo.append(u)
    return chain


@dataclass(frozen=True)
class StridedLayout:
    """Which values lowering lays out strided (:func:`strided_chains`)."""

    reads: dict = field(default_factory=dict)
    """node -> {axis: pieces}: the node reads its sharded inputs in the strided layout on those axes"""
    splits: frozenset = frozenset()
    """the splits: they read strided, their pieces are contiguous shards"""

    def held(self, node: fx.Node) -> dict:
        """{axis: pieces} on which ``node``'s own sharded value is strided."""
        return {} if node in self.splits else self.reads.get(node, {})


def strided_chains(graph: fx.Graph, records: dict[str, NodeRecord], comm: MeshComm) -> StridedLayout:
    """Every split of a sharded dim and the values that carry that dim to it."""
    reads: dict = {}
    splits = []
    for node in graph.nodes:
        axes = _split_axes(node, records.get(node.name), comm)
        if not axes:
            continue
        splits.append(node)
        pieces = len(info(node).out_shapes)
        for n in _chain(node, records, comm, axes):
            layout = reads.setdefault(n, {})
            clash = [a for a in axes if layout.get(a, pieces) != pieces]
            if clash:
                raise LoweringError(
                    f"{n.name} would be laid out strided in {layout[clash[0]]} and in {pieces} pieces (for the "
                    f"split {node.name}) on mesh axis {comm.axis_names[clash[0]]}; pin {n.name} to Replicate there"
                )
            layout.update({a: pieces for a in axes})
    return StridedLayout(reads, frozenset(splits))


def strided_parameters(graph: fx.Graph, records: Mapping[str, NodeRecord | dict], comm: MeshComm) -> dict:
    """Parameters to load in the strided layout (those the members of :func:`strided_chains`
    read sharded where they are stored cut the same way): FQN -> {axis: pieces}. ``records``:
    the plan's records by node name, typed or as the JSON holds them."""
    typed = typed_by_name(records)
    out: dict = {}
    for node, axes in strided_chains(graph, typed, comm).reads.items():
        reads = _specs(typed[node.name].ins, comm.ndim)
        for param, read in zip(tensor_input_nodes(node), reads):
            if read is not None and info(param).kind == "param":
                rec = typed[param.name]
                held = parse_spec(rec.stored or rec.out[0], comm.ndim)
                out.setdefault(info(param).name, {}).update(strided_where_read(held, read, axes))
    return out


def strided_where_read(held, read, axes: dict) -> dict:
    """The axes of ``axes`` (axis -> pieces) on which a parameter placed ``held`` is stored in
    the strided layout: those where it shards the dim its consumer reads strided (``read``). On
    an axis where it shards another dim (a ZeRO-3 weight cut for storage along its other dim)
    its blocks are contiguous: the edge gathers them and cuts the strided shard."""
    return {
        a: f
        for a, f in axes.items()
        if getattr(read[a], "dim", None) is not None and getattr(held[a], "dim", None) == read[a].dim
    }


def edge_strided(node: fx.Node, u: fx.Node, src, dst, layout: StridedLayout, comm: MeshComm):
    """The strided layouts ``(strided, src_strided)`` of the edge ``u -> node`` (for
    :class:`runtime.reshard.Reshard`): the consumer's side where ``node`` reads strided, the
    producer's where ``u`` holds a strided value or is a parameter loaded strided."""
    on = {a: f for a, f in layout.reads.get(node, {}).items() if getattr(dst[a], "dim", None) is not None}
    held = {a: f for a, f in layout.held(u).items() if getattr(src[a], "dim", None) is not None}
    if held and on:  # inside a chain: both ends strided, nothing may move
        moved = [a for a in on if src[a] != dst[a]]
        if moved:
            raise LoweringError(
                f"the edge {u.name} -> {node.name} reshards a strided shard on mesh axes "
                f"{[comm.axis_names[a] for a in moved]}; this plan cannot be lowered"
            )
        return None, None
    if held:  # read by an op outside the chain: gathered (or moved) from the strided blocks
        kept = [a for a in held if src[a] == dst[a]]
        if kept:
            raise LoweringError(
                f"{u.name} holds a strided shard (for a later split) and {node.name} reads it sharded as it is on "
                f"mesh axes {[comm.axis_names[a] for a in kept]}, in contiguous blocks; this plan cannot be "
                f"lowered (pin {u.name} to Replicate on those axes)"
            )
        return None, held
    if not on:
        return None, None
    if info(u).kind == "param":  # loaded strided where it is sharded
        return on, strided_where_read(src, dst, on)
    contiguous = [a for a in on if getattr(src[a], "dim", None) is not None]
    if contiguous:
        raise LoweringError(
            f"{u.name} arrives at {node.name} sharded on mesh axes "
            f"{[comm.axis_names[a] for a in contiguous]} in contiguous blocks, but {node.name} needs "
            f"the strided layout of a later split; this plan cannot be lowered"
        )
    return on, None
