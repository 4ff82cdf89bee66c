"""The bytes an edge's moves hold beside their result while they run: what a reshard costs in memory.

The memory model counts an edge's *result* (the tensor its consumer gets, a gathered weight) as
a buffer. The runtime's moves (:func:`runtime.collectives.run_steps`) hold more while they run,
and for a weight stored sharded on a dim other than the first that is as much again as the
gathered weight. Per move on an axis of ``n`` devices, for a local tensor ``x`` of ``b`` bytes
(``Shard(d)`` the dim it moves along; a tensor laid out contiguously is "in order"; moving dim
``d`` to the front keeps it in order only when every dim before ``d`` has one element):

* **all-gather** along ``d``: the input moved to the front (copied unless that keeps it in order,
  ``b``) and the gathered buffer (``n b``) while the collective runs; then, unless the buffer is
  in order, the whole tensor copied back into the dims' order (``n b``) beside the buffer, the
  input released first. A 3-D expert weight stored ``Shard(2)`` and gathered holds twice its
  size while it finishes, against once for ``Shard(0)``;
* **reduce-scatter** to ``d``: the input moved to the front (``b`` unless in order) and the
  output (``b / n``; out of order as a view unless in order);
* **all-reduce**: a clone (``b``), after a copy into order if ``x`` is not;
* **all-to-all**: the pieces stacked (``b``), the received ones (``b``) and their join (``b``);
* **local slice** (``Replicate -> Shard``): a view; **keep one rank's share**
  (``Replicate -> Partial``): zeros on the other ranks (``b``, counted).

Each intermediate is alive during the next move and freed once it returns; the source is the
producer's (counted there). A result that is a view of an intermediate is cloned by the edge
(:class:`runtime.reshard.Reshard` hands out a tensor of its own when the value needs a gradient),
beside its base. :func:`edge_scratch` returns the most alive beyond the result; :func:`gather_in_flight`
what a gather started ahead (:mod:`runtime.prefetch`) holds beside its gathered buffer while it
runs (the input moved to the front). :mod:`passes.plan.memory_accounting` adds both to the
transients of the ops they run beside.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from passes.core.placements import is_partial, is_shard, transition_steps

__all__ = ["EdgePeak", "edge_peak", "edge_scratch", "gather_in_flight"]


@dataclass(frozen=True)
class EdgePeak:
    """What an edge's forward moves hold, bytes per device (the module docstring)."""

    peak: float = 0.0
    """The most alive at once while the moves run (intermediates, copies, the result), the source
    not counted."""
    result: float = 0.0
    """The result's bytes (0 when the result is the source or a view of it)."""
    first_gather_input: float = 0.0
    """The input copy the first all-gather holds while it runs (0 when moving its dim to the
    front keeps the tensor in order): what a prefetched gather holds beside its buffer."""


class _Local:
    """The local tensor while the moves run: its sizes, whether it is in order, the bytes of the
    storage it lives in when the moves made it (0: the source's) and whether it is a view."""

    def __init__(self, sizes: list, elem: int):
        self.sizes, self.elem, self.in_order, self.owned, self.view = sizes, elem, True, 0.0, False

    @property
    def nbytes(self) -> float:
        return math.prod(self.sizes) * self.elem

    def front_in_order(self, d: int) -> bool:
        """Whether moving dim ``d`` to the front leaves it in order (no copy)."""
        return self.in_order and math.prod(self.sizes[:d]) == 1


@functools.lru_cache(maxsize=1 << 14)
def edge_peak(src, dst, shape, mesh_shape, elem: int, clones_views: bool = True) -> EdgePeak:
    """The bytes the forward moves from ``src`` to ``dst`` hold for a tensor of global ``shape``
    (``elem`` bytes per element) on ``mesh_shape`` (the module docstring); ``clones_views``: the
    value needs a gradient, so a result that is a view is cloned."""
    if src is None or dst is None or tuple(src) == tuple(dst):
        return EdgePeak()
    x = _Local(_local_sizes(tuple(shape or ()), tuple(src), mesh_shape), elem)
    peak, first_input = 0.0, None
    for axis, p, q in transition_steps(tuple(src), tuple(dst)):
        n = mesh_shape[axis]
        if n == 1:
            continue
        held = x.owned  # the intermediate this move reads, freed once it returns
        most, gather_input = _move(x, p, q, n)
        if gather_input is not None and first_input is None:
            first_input = gather_input
        peak = max(peak, held + most)
    result = x.owned
    if x.owned and x.view and clones_views:  # a view of an intermediate: cloned beside its base
        result = x.nbytes
        peak = max(peak, x.owned + result)
    return EdgePeak(peak=peak, result=result, first_gather_input=first_input or 0.0)


def edge_scratch(src, dst, shape, mesh_shape, elem: int, clones_views: bool = True) -> float:
    """The most an edge's forward moves hold beyond their result (0 for a move-free edge)."""
    found = edge_peak(src, dst, tuple(shape or ()), tuple(mesh_shape), elem, clones_views)
    return max(0.0, found.peak - found.result)


def gather_in_flight(src, dst, shape, mesh_shape, elem: int) -> float:
    """What a gather started ahead holds beside its gathered buffer while it runs."""
    return edge_peak(src, dst, tuple(shape or ()), tuple(mesh_shape), elem).first_gather_input


def _move(x: _Local, p, q, n: int) -> tuple:
    """Apply one move to ``x``: (the most its own tensors hold at once, the input copy of an
    all-gather or None)."""
    b = x.nbytes
    if is_shard(p) and not is_shard(q):  # all-gather along p.dim
        d = p.dim
        copied = 0.0 if x.front_in_order(d) else b
        x.sizes[d] *= n
        whole = x.nbytes
        back = math.prod(x.sizes[:d]) > 1  # the buffer back in the dims' order: a copy
        most = max(copied + whole, 2 * whole) if back else copied + whole
        x.in_order, x.owned, x.view = True, whole, d > 0 and not back
        return most, copied
    if is_shard(p) and is_shard(q):  # all-to-all: stack, receive, join
        x.sizes[p.dim] *= n
        x.sizes[q.dim] //= n
        x.in_order, x.owned, x.view = True, b, False
        return 3 * b, None
    if is_partial(p) and is_shard(q):  # reduce-scatter
        d = q.dim
        copied = 0.0 if x.front_in_order(d) else b
        out = b / n
        x.in_order = math.prod(x.sizes[:d]) == 1
        x.sizes[d] //= n
        x.owned, x.view = out, True
        return copied + out, None
    if is_partial(p):  # all-reduce
        most = b if x.in_order else 2 * b
        x.in_order, x.owned, x.view = True, b, False
        return most, None
    if is_shard(q):  # a local slice: a view of what is there
        x.in_order = x.in_order and math.prod(x.sizes[: q.dim]) == 1
        x.sizes[q.dim] = -(-x.sizes[q.dim] // n)
        x.view = True
        return 0.0, None
    if is_partial(q):  # one rank keeps the value, the others zeros
        x.in_order, x.owned, x.view = True, b, False
        return b, None
    return 0.0, None


def _local_sizes(shape: tuple, spec: tuple, mesh_shape) -> list:
    """A rank's local sizes (the larger piece where a dim does not divide)."""
    sizes = list(shape)
    for p, n in zip(spec, mesh_shape):
        if is_shard(p) and p.dim < len(sizes):
            sizes[p.dim] = -(-sizes[p.dim] // n)
    return sizes
