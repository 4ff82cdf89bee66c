"""Moves of a dim cut into unequal pieces: a batch the data axes do not divide.

A plan made for one batch size serves others (``partitioner/specialize.py``). Where the new batch
does not divide the mesh axes cutting it, activations hold unequal pieces (``tensor_split``'s: the
first ranks one sample more), and an edge that joins or splits such a dim cannot use the equal-piece
collectives of :mod:`runtime.collectives`. Lowering marks those dims on the edge
(:class:`runtime.reshard.Reshard`'s ``uneven``); each move along one of them runs here:

* **join** (``S(d) -> R``, and the join half of ``S(d) -> S(e)``): the ranks of the mesh axis first
  exchange their piece's size along ``d`` (one all-gather of one integer each: the pieces of a
  flattened batch x sequence dim follow whole samples, which no shape arithmetic on the flat
  dim recovers), then each pads its piece to the largest, all-gathers, and cuts the padding off;
* **split** (``R -> S(d)``, ``P -> S(d)``, the split half of ``S(d) -> S(e)``): where the edge's
  other direction already joined this dim, the pieces go back in the sizes it found (so a gradient
  is cut exactly as its activation was joined); otherwise like ``torch.tensor_split``. A partial
  value is padded piece by piece and reduce-scattered;
* an exchange ``S(d) -> S(e)`` is a join of ``d`` then a local split of ``e`` (it sends ``n`` times
  what an all-to-all would: a batch that does not divide is the rare last batch, not the step the
  plan priced).

``sizes`` (a dict the edge keeps per call, ``(axis, dim) -> [size of each rank's piece]``) carries
what a join learned to the split of the other direction. What these moves send is counted like any
collective; the plan's estimate is for the shapes it was made for, so no estimate covers them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from passes.core.placements import is_partial, is_shard, split_size
from runtime.collectives import MeshComm, _reduce_scatter_single, record_collective, reduce_op_of

__all__ = ["touches_uneven", "move_uneven", "gather_uneven"]


def touches_uneven(p, q, dims) -> bool:
    """Does the move ``p -> q`` join or split one of ``dims``?"""
    return (is_shard(p) and p.dim in dims) or (is_shard(q) and q.dim in dims)


def move_uneven(
    x: torch.Tensor, axis: int, p, q, comm: MeshComm, phase: str, sizes: dict, units: dict | None = None
) -> torch.Tensor:
    """One per-axis move ``p -> q`` of ``x`` where the dim it joins or splits is cut unevenly.
    ``units``: per dim, the elements of one sample along it (a split keeps them together)."""
    units = units or {}
    if is_shard(p):  # join (an exchange: join, then split locally)
        x = gather_uneven(x, axis, p.dim, comm, phase, sizes)
        if not is_shard(q):
            return x
        return _keep_piece(x, axis, q.dim, comm, _split_sizes(x.shape[q.dim], axis, q.dim, comm, sizes, units))
    pieces = _split_sizes(x.shape[q.dim], axis, q.dim, comm, sizes, units)
    if is_partial(p):  # reduce-scatter of unequal pieces
        return _reduce_scatter_pieces(x, axis, p, q.dim, comm, phase, pieces)
    return _keep_piece(x, axis, q.dim, comm, pieces)


def gather_uneven(x: torch.Tensor, axis: int, dim: int, comm: MeshComm, phase: str, sizes=None) -> torch.Tensor:
    """Join every rank's piece along ``dim`` over mesh ``axis``, whatever their sizes (found by
    exchanging them; kept in ``sizes`` for a split back)."""
    found = _exchanged_sizes(x, axis, dim, comm, phase, {} if sizes is None else sizes)
    return gather_pieces(x, axis, dim, comm, phase, found)


def gather_pieces(x: torch.Tensor, axis: int, dim: int, comm: MeshComm, phase: str, pieces: list) -> torch.Tensor:
    """All-gather along ``dim`` over mesh ``axis`` pieces of the given sizes (this rank's is
    ``x``): each padded to the largest, gathered, the padding cut off, joined in rank order."""
    n = comm.shape[axis]
    largest = max(pieces)
    padded = torch.nn.functional.pad(x.movedim(dim, -1), (0, largest - x.shape[dim])).movedim(-1, dim)
    padded = padded.contiguous()
    gathered = [torch.empty_like(padded) for _ in range(n)]
    record_collective("all_gather", comm.axis_names[axis], padded.numel() * padded.element_size() * n, phase)
    dist.all_gather(gathered, padded, group=comm.groups[axis])
    return torch.cat([g.narrow(dim, 0, size) for g, size in zip(gathered, pieces)], dim=dim)


def _exchanged_sizes(x, axis: int, dim: int, comm: MeshComm, phase: str, sizes: dict) -> list:
    """Every rank's piece size along ``dim`` on mesh ``axis`` (kept in ``sizes`` for the split back)."""
    mine = torch.tensor([x.shape[dim]], dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(comm.shape[axis])]
    record_collective("all_gather", comm.axis_names[axis], mine.element_size() * len(every), phase)
    dist.all_gather(every, mine, group=comm.groups[axis])
    found = [int(t.item()) for t in every]
    sizes[axis, dim] = found
    return found


def _split_sizes(whole: int, axis: int, dim: int, comm: MeshComm, sizes: dict, units: dict) -> list:
    """How ``whole`` elements of ``dim`` are cut over mesh ``axis``: as the other direction
    joined them, or like ``torch.tensor_split`` of its samples (``units[dim]`` elements each: a
    flattened batch x sequence dim is cut between samples, as the batch itself was)."""
    known = sizes.get((axis, dim))
    if known is not None and sum(known) == whole:
        return list(known)
    n, unit = comm.shape[axis], units.get(dim, 1)
    if whole % unit:
        unit = 1
    return [split_size(whole // unit, n, j) * unit for j in range(n)]


def _keep_piece(x, axis: int, dim: int, comm: MeshComm, pieces: list) -> torch.Tensor:
    coord = comm.coords[axis]
    return x.narrow(dim, sum(pieces[:coord]), pieces[coord])


def _reduce_scatter_pieces(x, axis: int, p, dim: int, comm: MeshComm, phase: str, pieces: list) -> torch.Tensor:
    """Sum ``x`` over mesh ``axis``, each rank keeping its (unequal) piece along ``dim``."""
    largest, coord = max(pieces), comm.coords[axis]
    starts = [sum(pieces[:j]) for j in range(len(pieces))]
    padded = [
        torch.nn.functional.pad(x.narrow(dim, s, k).movedim(dim, -1), (0, largest - k)).movedim(-1, dim)
        for s, k in zip(starts, pieces)
    ]
    stacked = torch.cat(padded, dim=dim).movedim(dim, 0).contiguous()
    out = stacked.new_empty((largest,) + tuple(stacked.shape[1:]))
    record_collective("reduce_scatter", comm.axis_names[axis], stacked.numel() * stacked.element_size(), phase)
    _reduce_scatter_single(out, stacked, op=reduce_op_of(p), group=comm.groups[axis])
    return out.narrow(0, 0, pieces[coord]).movedim(0, dim)
