"""Can a plan made for some input shapes serve others? Every sharded dim must give each rank a piece.

A plan's placements do not depend on sizes, only on which dims are cut over which mesh axes,
so a graph of the same structure captured at another batch or sequence size (the last partial
batch of a DataLoader, a shorter sequence) runs under the same plan. A cut dim need not divide:
it is split the way ``torch.tensor_split`` splits, axis by axis in the order the placement's
moves cut it (outer mesh axis first), so over ``n`` ranks a size ``s`` gives the first
``s % n`` ranks ``s // n + 1`` and the rest ``s // n`` (:func:`split_size`,
:func:`rank_local_shape`). The lowering then bakes each rank's own local sizes into its
program; a mean over such a dim weighs each rank's piece by its share of the elements, and the
losses already all-reduce (sum, count). What cannot be uneven is refused when the program is
lowered, naming the node: a collective that joins or splits pieces along an uneven dim (an
all-gather, reduce-scatter or all-to-all) and a local kernel that assumes equal pieces.

:func:`check_servable` walks the newly captured graph in order and refuses the first place
where a rank would get no element at all (a batch smaller than the data-parallel degree): an
input (named by its argument, the dim, its new size and the mesh axes cutting it) or, for sizes
that only an inner node gets wrong, that node and its module. :func:`check_divisible` is the
stricter check (every cut dim divides) for callers that need equal pieces.
"""

from __future__ import annotations

from passes.analysis.analyze import info
from passes.core.placements import parse_spec, rank_local_shape, split_size

__all__ = [
    "ShapeMismatchError",
    "check_divisible",
    "cut_pieces",
    "check_servable",
    "rank_local_shape",
    "split_size",
    "uneven_dims",
]


class ShapeMismatchError(ValueError):
    """The inputs' shapes cannot be served by the plan: a sharded dim is too small (or, for
    :func:`check_divisible`, does not divide)."""


def cut_pieces(spec, dim: int, mesh_shape) -> tuple[list, int]:
    """The mesh axes (of more than one device) that ``spec`` cuts ``dim`` over, and into how many pieces."""
    axes = [axis for axis, p in enumerate(spec) if getattr(p, "dim", None) == dim and mesh_shape[axis] > 1]
    pieces = 1
    for axis in axes:
        pieces *= mesh_shape[axis]
    return axes, pieces


def uneven_dims(shape, spec, mesh_shape) -> set:
    """The dims of ``shape`` that ``spec`` cuts into pieces of unequal sizes."""
    if shape is None or spec is None:
        return set()
    return {d for d, size in enumerate(shape) if size % cut_pieces(spec, d, mesh_shape)[1]}


def _walk(cap, records: dict, mesh_shape, axis_names, refuse) -> None:
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
                axes, pieces = cut_pieces(spec, dim, mesh_shape)
                if pieces > 1 and refuse(size, pieces):
                    raise ShapeMismatchError(_message(node, dim, size, axes, pieces, mesh_shape, axis_names, refuse))


def _too_small(size: int, pieces: int) -> bool:
    return size < pieces


def _not_divisible(size: int, pieces: int) -> bool:
    return size % pieces != 0


def check_servable(cap, records: dict, mesh_shape, axis_names) -> None:
    """Raise :class:`ShapeMismatchError` at the first node where a rank's piece would be empty."""
    _walk(cap, records, mesh_shape, axis_names, _too_small)


def check_divisible(cap, records: dict, mesh_shape, axis_names) -> None:
    """Raise :class:`ShapeMismatchError` at the first node whose planned shards do not divide."""
    _walk(cap, records, mesh_shape, axis_names, _not_divisible)


def _message(node, dim, size, axes, pieces, mesh_shape, axis_names, refuse) -> str:
    where = ", ".join(f"'{axis_names[a]}' ({mesh_shape[a]} ranks)" for a in axes)
    if refuse is _too_small:
        problem = f"which leaves some ranks no element: use a size of at least {pieces} there"
    else:
        problem = (
            f"which does not divide it: use a size divisible by {pieces} there (for the last batch of a "
            f"DataLoader: drop_last=True, or pad it)"
        )
    what_to_do = f"{problem}, or make the parallel model for this shape (auto_parallelize with inputs of it)"
    i = info(node)
    if i.kind == "input":
        return (
            f"input '{i.name}' has size {size} on dim {dim}, but the plan cuts that dim over mesh axis {where} "
            f"into {pieces} pieces, {what_to_do}"
        )
    module = i.module_path or "the model's top level"
    return (
        f"node {node.name} ({node.target} in {module}) has size {size} on dim {dim} at these input shapes, but "
        f"the plan cuts that dim over mesh axis {where} into {pieces} pieces, {what_to_do}"
    )
