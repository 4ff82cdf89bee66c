"""How a parameter is stored: the ZeRO modes, a ZeRO-1 weight's optimizer shard and its once-per-step
collectives, and when a ZeRO-3 weight is gathered again in backward."""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import logging

from passes.analysis.analyze import info
from passes.core.placements import Shard, is_shard, zero1_grad_spec
from passes.plan.cost_model import (
    edge_gathers,
    reshard,
)
from passes.rules import rule_for

logger = logging.getLogger(__name__)


ZERO_MODES = ("auto", 1, 2, 3)


def zero1_placements(spec, shape, mesh_shape):
    """The placement of a ZeRO-1 weight's optimizer shard, for a compute copy placed ``spec``:
    ``Shard(d)`` on every mesh axis (of more than one device) where ``spec`` replicates, ``d`` the
    first dim no axis of ``spec`` cuts whose size those axes divide; None when there is no such
    axis or dim."""
    axes = [a for a, (p, n) in enumerate(zip(spec, mesh_shape)) if not is_shard(p) and n > 1]
    if not axes or not shape:
        return None
    cut = {p.dim for p in spec if is_shard(p)}
    ways = 1
    for a in axes:
        ways *= mesh_shape[a]
    d = next((d for d, s in enumerate(shape) if d not in cut and s % ways == 0), None)
    if d is None:
        return None
    return tuple(Shard(d) if a in axes else p for a, p in enumerate(spec))


@functools.lru_cache(maxsize=1 << 12)
def zero1_collectives(spec, stored, shape, elem, mesh_shape, grad_reduce_bytes=None):
    """(reductions, all-gathers) a weight with a compute copy placed ``spec`` runs once per step
    for the tensor the optimizer steps, placed ``stored``: its gradient, summed over the step's
    backward passes in the copy's layout, reduced into that tensor's gradient (reduce-scattered
    into a ZeRO-1 shard; all-reduced where ``stored`` is ``spec``), in ``grad_reduce_bytes`` per
    element when given, and the stepped tensor all-gathered into the copy (ZeRO-1). Bucketed:
    the runtime sends one flat buffer per axis."""
    grad_elem = grad_reduce_bytes or elem
    rs = reshard(zero1_grad_spec(spec, mesh_shape), stored, shape, mesh_shape, grad_elem)
    ag = reshard(stored, spec, shape, mesh_shape, elem)
    return (
        tuple(dataclasses.replace(c, bucketed=True) for c in rs),
        tuple(dataclasses.replace(c, bucketed=True) for c in ag),
    )


def regathers(consumer, k, src, dst, mesh_shape) -> bool:
    """Whether backward gathers input ``k`` of ``consumer`` again when it comes from a ZeRO-3
    parameter placed ``src``: the edge gathers and the consumer keeps that input for backward
    (outside a recomputed layer, which the caller decides)."""
    saves = info(consumer).saves
    if saves is None or k not in saves.inputs or src is None or dst is None:
        return False
    if not rule_for(consumer).keeps_saved_input(consumer, k, dst):
        return False
    return edge_gathers(src, dst, mesh_shape)


def check_zero(zero):
    """``zero``: one of :data:`ZERO_MODES`, or a dict of parameter-name patterns (``fnmatch``,
    as pins) to modes, the first match deciding (parameters no pattern matches: ``"auto"``)."""
    modes = zero.values() if isinstance(zero, dict) else [zero]
    bad = [m for m in modes if m not in ZERO_MODES]
    if bad or (isinstance(zero, dict) and not all(isinstance(k, str) for k in zero)):
        raise ValueError(
            f"zero must be one of {ZERO_MODES} or a dict of parameter name patterns to them (1: a weight "
            f"replicated on a data-parallel axis keeps its compute copy whole and its optimizer state sharded; "
            f"for a parameter stored sharded and gathered for use: 2 keeps the gathered copy for backward, 3 "
            f"frees it after forward and gathers it again in backward; 'auto' lets the solver choose), got {zero!r}"
        )
    return zero


def zero_mode(zero, name: str):
    """The mode ``zero`` (see :func:`check_zero`) gives the parameter named ``name``."""
    if not isinstance(zero, dict):
        return zero
    return next((mode for pattern, mode in zero.items() if fnmatch.fnmatchcase(name, pattern)), "auto")
