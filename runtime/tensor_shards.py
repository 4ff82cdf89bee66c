"""A whole tensor and one rank's piece of it, under a placement per mesh axis.

:func:`shard_runs` says which elements of the whole a rank keeps: per dim, the runs of positions,
found by walking the moves that cut a replicated tensor into ``spec`` (outer axis first; an
``InnerShard`` axis last) and, on each cutting axis, keeping this rank's block of what the earlier
axes kept (``torch.tensor_split``'s blocks where a dim does not divide; in the strided layout of a
fused projection split after its matmul, the same block of each fused piece). :func:`shard_tensor`
cuts a whole tensor so and :func:`read_runs` reads those runs from anything indexable (a
checkpoint file's slices), so a cut piece and a read piece are one definition.
:func:`gather_tensor` is the way back, a collective: the moves to ``Replicate`` in reverse (where
pieces are unequal, their sizes exchanged, each padded to the largest and the padding cut off).

:class:`runtime.parallel_module.ParallelModule`, the pipeline runner and the global view of
their state for checkpoints (:mod:`runtime.sharded_state`) all move state with these; the module
sits below all of them.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from passes.core.placements import replicated, shard_degree, split_size, split_start, transition_steps
from runtime.collectives import MeshComm, run_steps
from runtime.uneven_moves import gather_uneven

__all__ = ["shard_runs", "read_runs", "shard_tensor", "gather_tensor"]

logger = logging.getLogger(__name__)


def shard_runs(shape, spec, comm: MeshComm, strided=None) -> list:
    """Which elements of a whole tensor of ``shape`` this rank keeps under ``spec``: per dim, the
    ``(start, stop)`` runs, in the order the piece holds them (one run per dim, except on a dim
    cut in the strided layout: one run per fused piece). ``strided``: axis -> pieces per shard.

    Each mesh axis that cuts a dim (in the order the moves from ``Replicate`` cut them) picks,
    among the positions the earlier axes kept, either one block (a dim that does not divide: the
    first ranks one element more, as ``torch.tensor_split``) or, in the strided layout, the same
    block of each of the ``f`` fused pieces."""
    strided = strided or {}
    runs = [[(0, int(n))] for n in shape]
    for axis, _p, q in transition_steps(replicated(comm.ndim), tuple(spec)):
        n, c = comm.shape[axis], comm.coords[axis]
        if n == 1 or getattr(q, "dim", None) is None:
            continue
        d = q.dim
        kept = sum(stop - start for start, stop in runs[d])
        if axis in strided:
            f = strided[axis]
            block, size = kept // f, kept // (f * n)
            picks = [(j * block + c * size, size) for j in range(f)]
        else:
            picks = [(split_start(kept, n, c), split_size(kept, n, c))]
        runs[d] = _pick(runs[d], picks)
    return runs


def _pick(runs: list, picks: list) -> list:
    """The runs of whole-tensor positions at offsets ``picks`` ((offset, length) into the
    concatenation of ``runs``)."""
    out = []
    for offset, length in picks:
        for start, stop in runs:
            if length == 0:
                break
            if offset >= stop - start:
                offset -= stop - start
                continue
            take = min(length, stop - start - offset)
            out.append((start + offset, start + offset + take))
            offset, length = 0, length - take
    return out


def read_runs(read, runs: list) -> torch.Tensor:
    """The piece ``runs`` (:func:`shard_runs`) names, from ``read(index)``: ``index`` is a tuple of
    one ``slice`` per dim, a block of the whole tensor. Blocks of a dim with several runs are
    joined along it."""
    several = next((d for d, r in enumerate(runs) if len(r) > 1), None)
    if several is None:
        return read(tuple(slice(start, stop) for ((start, stop),) in runs))
    parts = [read_runs(read, [*runs[:several], [run], *runs[several + 1 :]]) for run in runs[several]]
    return torch.cat(parts, dim=several)


def shard_tensor(full: torch.Tensor, spec, comm: MeshComm, strided=None) -> torch.Tensor:
    """This rank's piece of ``full`` under ``spec`` (``strided``: axis -> pieces per shard)."""
    runs = shard_runs(full.shape, spec, comm, strided)
    return read_runs(lambda index: full[index], runs).contiguous()


def gather_tensor(local: torch.Tensor, spec, comm: MeshComm, strided=None, whole_shape=None) -> torch.Tensor:
    """The full tensor from every rank's piece (a collective: every rank must call it).
    ``whole_shape``: the full shape, needed when a cut dim does not divide (unequal pieces)."""
    strided = strided or {}
    spec = tuple(spec)
    if (
        whole_shape is not None
        and not strided
        and any(size % shard_degree(spec, comm.shape, d) for d, size in enumerate(whole_shape))
    ):
        return _gather_unequal(local, spec, comm)
    if not strided:
        return run_steps(local, transition_steps(spec, replicated(comm.ndim)), comm, "state")
    cur = local
    for axis, p, _q in transition_steps(spec, replicated(comm.ndim)):
        n = comm.shape[axis]
        if n == 1 or getattr(p, "dim", None) is None:
            continue
        d = p.dim
        pieces = [torch.empty_like(cur) for _ in range(n)]
        dist.all_gather(pieces, cur.contiguous(), group=comm.groups[axis])
        if axis in strided:
            f = strided[axis]
            pieces = [t.unflatten(d, (f, t.shape[d] // f)) for t in pieces]
            cur = torch.cat(pieces, dim=d + 1).flatten(d, d + 1)
        else:
            cur = torch.cat(pieces, dim=d)
    return cur


def _gather_unequal(local: torch.Tensor, spec, comm: MeshComm) -> torch.Tensor:
    """:func:`gather_tensor` for unequal pieces: inner axis first, each axis's pieces joined
    whatever their sizes (:func:`runtime.uneven_moves.gather_uneven`), partial values summed."""
    cur = local
    for axis, p, q in transition_steps(spec, replicated(comm.ndim)):
        if comm.shape[axis] > 1 and getattr(p, "dim", None) is not None:
            cur = gather_uneven(cur, axis, p.dim, comm, "state")
        else:
            cur = run_steps(cur, ((axis, p, q),), comm, "state")
    return cur
