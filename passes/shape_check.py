"""Can a plan made for some input shapes serve others? Check that every sharded dim divides.

A plan's placements do not depend on sizes, only on which dims are cut over which mesh axes,
so a graph of the same structure captured at another batch or sequence size (the last partial
batch of a DataLoader, a shorter sequence) runs under the same plan, provided each dim a
placement shards still divides by the number of pieces it is cut into. This pass walks the
newly captured graph in order and reports the first place where it does not: an input (named
by its argument, the dim, its new size and the mesh axes cutting it) or, for sizes that only
an inner node gets wrong, that node and its module.
"""

from __future__ import annotations

from passes.analyze import info
from passes.placements import parse_spec

__all__ = ["ShapeMismatchError", "check_divisible"]


class ShapeMismatchError(ValueError):
    """The inputs' shapes cannot be served by the plan: a sharded dim no longer divides."""


def _cut_axes(spec, dim: int, mesh_shape) -> list:
    return [axis for axis, p in enumerate(spec) if getattr(p, "dim", None) == dim and mesh_shape[axis] > 1]


def check_divisible(cap, records: dict, mesh_shape, axis_names) -> None:
    """Raise :class:`ShapeMismatchError` at the first node whose planned shards do not divide."""
    ndim = len(mesh_shape)
    for node in cap.graph.nodes:
        record = records.get(node.name)
        if record is None or not record.get("out"):
            continue
        for shape, text in zip(info(node).out_shapes, record["out"]):
            if shape is None or text is None:
                continue
            spec = parse_spec(text, ndim)
            for dim, size in enumerate(shape):
                axes = _cut_axes(spec, dim, mesh_shape)
                pieces = 1
                for axis in axes:
                    pieces *= mesh_shape[axis]
                if pieces > 1 and size % pieces:
                    raise ShapeMismatchError(_message(node, dim, size, axes, pieces, mesh_shape, axis_names))


def _message(node, dim, size, axes, pieces, mesh_shape, axis_names) -> str:
    where = ", ".join(f"'{axis_names[a]}' ({mesh_shape[a]} ranks)" for a in axes)
    what_to_do = (
        f"use a size divisible by {pieces} there (for the last batch of a DataLoader: drop_last=True, "
        f"or pad it), or make the parallel model for this shape (auto_parallelize with inputs of it)"
    )
    i = info(node)
    if i.kind == "input":
        return (
            f"input '{i.name}' has size {size} on dim {dim}, but the plan cuts that dim over mesh axis {where} "
            f"into {pieces} pieces, which does not divide it: {what_to_do}"
        )
    module = i.module_path or "the model's top level"
    return (
        f"node {node.name} ({node.target} in {module}) has size {size} on dim {dim} at these input shapes, but "
        f"the plan cuts that dim over mesh axis {where} into {pieces} pieces, which does not divide it: "
        f"{what_to_do}"
    )
