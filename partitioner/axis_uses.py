"""What each mesh axis of a plan actually does, read off the plan's records.

A configuration search names its axes by intent (``dp`` for the batch, ``tp`` for tensor groups,
``sp`` for the sequence), but the intra-op solver places every tensor on every axis freely: it may
replicate everything on an axis it was given (a small model whose collectives cost more than the
compute they would save), or split the batch on ``tp`` too. The configuration's label must say
what runs, so it is built from these uses, per stage axis:

* ``data``: a model input is split on its first dim there, or a weight contraction splits its
  rows there (role ``M``, :func:`passes.rules.multidim_tp.classify`) with its output split on dim 0;
* ``sequence``: the same on a later dim (the tokens), or attention runs ring / Ulysses there;
* ``tensor``: a weight contraction splits its weight there (roles ``N`` / ``K``), or a weight is
  used where it lies split there (an MoE layer's stacked experts excepted);
* ``experts``: an MoE layer splits its experts there (expert parallelism, :mod:`passes.rules.experts`);
* ``ZeRO``: a weight stored split there is gathered for use there (ZeRO-2/3), or its optimizer
  shard is cut there (ZeRO-1);
* ``split``: none of the above, but some value is split or partial there;
* ``replicated``: nothing is split on the axis: its devices repeat each other's work.

A pipelined plan's uses are the union over its stage plans (they share the stage mesh).
"""

from __future__ import annotations

import logging

from passes.core.placements import is_partial, is_shard, parse_spec

logger = logging.getLogger(__name__)

__all__ = ["axis_uses", "describe_config", "USE_ORDER"]

USE_ORDER = ("data", "sequence", "tensor", "experts", "ZeRO", "split")
"""The order uses are joined in (``data+tensor``)."""


def axis_uses(plan) -> tuple:
    """One label per axis of ``plan``'s (stage) mesh, e.g. ``("data", "replicated")``."""
    if plan.data.get("pipeline"):
        per_stage = [_uses_of(p.node_records, p.mesh_shape, p.axis_names) for p in plan.stage_plans]
        found = [set().union(*sets) for sets in zip(*per_stage)]
        return tuple(_label(f) for f in found)
    return tuple(_label(f) for f in _uses_of(plan.node_records, plan.mesh_shape, plan.axis_names))


def describe_config(plan) -> str:
    """``plan.config.describe()`` with each axis named by what it does in ``plan``."""
    return plan.config.describe(axis_uses(plan))


def _label(found: set) -> str:
    return "+".join(u for u in USE_ORDER if u in found) or "replicated"


def _uses_of(records, mesh_shape, axis_names) -> list:
    """Per axis, the set of uses :func:`axis_uses` names (empty: replicated)."""
    ndim = len(mesh_shape)
    found: list = [set() for _ in mesh_shape]
    names = list(axis_names)
    gathered = _gathered_weight_axes(records, names)
    experts = _expert_weights(records)
    for r in records:
        if r.tp_roles:
            _contraction_uses(r, ndim, found)
        for axis, note in (r.notes or {}).items():
            if note in ("ring", "ulysses"):
                found[_axis_index(axis, names)].add("sequence")
            elif note in ("experts", "experts_local"):
                found[_axis_index(axis, names)].add("experts")
        specs = [parse_spec(s, ndim) for s in [*(r.out or ()), *(r.ins or ())] if s]
        for axis in range(ndim):
            if any(is_shard(s[axis]) or is_partial(s[axis]) for s in specs):
                found[axis].add("split")
        if r.kind == "input" and r.out:
            for axis, p in enumerate(parse_spec(r.out[0], ndim)):
                if is_shard(p):
                    found[axis].add("data" if p.dim == 0 else "sequence")
        elif r.kind == "param" and r.out and r.name not in experts:
            _param_uses(r, parse_spec(r.out[0], ndim), gathered.get(r.name, set()), found)
    for axis, n in enumerate(mesh_shape):
        if n == 1:
            found[axis] = set()
        elif len(found[axis]) > 1:
            found[axis].discard("split")  # a named use says more
    return found


def _contraction_uses(r, ndim, found) -> None:
    """Roles ``N`` / ``K`` split the weight (tensor); ``M`` splits the rows: the batch when the
    output is split on its first dim there, else the tokens of a sequence."""
    out = parse_spec(r.out[0], ndim) if r.out else None
    for axis, role in enumerate(r.tp_roles.split(",")):
        if role in ("N", "K"):
            found[axis].add("tensor")
        elif role == "M" and out is not None and is_shard(out[axis]):
            found[axis].add("data" if out[axis].dim == 0 else "sequence")


def _param_uses(r, used, gathered_axes, found) -> None:
    stored = parse_spec(r.stored, len(used)) if r.stored else None
    for axis, p in enumerate(used):
        if stored is not None and is_shard(stored[axis]) and not is_shard(p):
            found[axis].add("ZeRO")  # ZeRO-1: the optimizer's shard
        elif is_shard(p):
            found[axis].add("ZeRO" if axis in gathered_axes else "tensor")


def _expert_weights(records) -> set:
    """Names of the stacked expert weights (inputs 3 and 4 of each MoE layer's op)."""
    return {name for r in records if str(r.target).startswith("partita.moe_experts") for name in (r.inputs or ())[3:5]}


def _gathered_weight_axes(records, names) -> dict:
    """Weight record name -> the axes its consumers all-gather it on in forward (ZeRO-2/3, 3D's
    W/p storage)."""
    kinds = {r.name: r.kind for r in records}
    out: dict = {}
    for r in records:
        inputs = r.inputs or ()
        for c in r.comm:
            k = c.input
            if c.kind == "all_gather" and c.phase == "fwd" and k is not None and k < len(inputs):
                if kinds.get(inputs[k]) == "param":
                    out.setdefault(inputs[k], set()).add(_axis_index(c.axis, names))
    return out


def _axis_index(axis, names: list) -> int:
    """The position of a record's mesh axis: its name in the plan, or ``a<i>``."""
    if axis in names:
        return names.index(axis)
    text = str(axis)
    if text.startswith("a") and text[1:].isdigit() and int(text[1:]) < len(names):
        return int(text[1:])
    raise ValueError(f"cannot read mesh axis {axis!r} of a plan record (the plan's axes are {names})")
