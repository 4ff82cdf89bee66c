"""What each mesh axis of a plan is used for: data, tensor, sequence or pipeline parallelism.

The intra-op solver places every tensor on every axis freely, so an axis's role is read off the
plan, not from its name: per axis, the plan's matmuls (``linear``/``addmm``/``mm``/``matmul``)
are classified by their output placement there, weighted by their compute time: *data* (the
batch dim is split), *tensor* (the output's last dim is split, or partial sums are reduced),
*sequence* (another dim split, or ring/Ulysses attention runs on the axis) or *replicated*; a
mixture-of-experts layer (``partita.moe_experts``) whose experts split on an axis counts its
compute time there as *expert* (expert parallelism), elsewhere by its tokens' placement. A
pipelined plan's first axis is its *pipeline* axis; its other axes are read off the stage plans.
Plain data, no torch import.
"""

from __future__ import annotations

from collections import defaultdict

__all__ = ["axis_role_shares", "axis_roles", "ROLES"]

ROLES = ("data", "tensor", "sequence", "pipeline", "expert", "replicated")
_MATMULS = ("aten.linear", "aten.addmm", "aten.mm", "aten.matmul")
_SEQUENCE_ALGORITHMS = ("ring", "ulysses")
_EXPERT_NOTES = ("experts", "experts_local")
_EXPERTS_OP = "partita.moe_experts"


def _matmul_role(placement: str, rank: int) -> str:
    if placement == "R":
        return "replicated"
    if placement == "P" or placement.startswith(f"S({rank - 1})"):
        return "tensor"
    if placement.startswith("S(0)"):
        return "data"
    return "sequence"


def _intra_op_shares(plan) -> list:
    shares = [defaultdict(float) for _ in plan.axis_names]
    for r in plan.node_records:
        for axis_name, note in (r.notes or {}).items():  # ring / Ulysses attention on an axis
            if note in _SEQUENCE_ALGORITHMS and axis_name in plan.axis_names:
                shares[plan.axis_names.index(axis_name)]["sequence"] += r.compute_s or 1e-12
        if r.target.startswith(_EXPERTS_OP) and r.out:
            _expert_shares(r, plan.axis_names, shares)
            continue
        if not r.target.startswith(_MATMULS) or not r.out or not r.shapes:
            continue
        rank = len(r.shapes[0] or ())
        weight = r.compute_s or 1e-12
        for axis, p in enumerate(r.out[0].strip("[]").split(", ")):
            shares[axis][_matmul_role(p, rank)] += weight
    out = []
    for roles in shares:
        total = sum(roles.values())
        out.append({role: share / total for role, share in roles.items()} if total else {})
    return out


def _expert_shares(r, axis_names, shares) -> None:
    """An MoE layer's compute: *expert* on the axis splitting its experts, else by its tokens."""
    weight = r.compute_s or 1e-12
    notes = r.notes or {}
    for axis, p in enumerate(r.out[0].strip("[]").split(", ")):
        split = notes.get(axis_names[axis]) in _EXPERT_NOTES
        shares[axis]["expert" if split else "data" if p.startswith("S(0)") else "replicated"] += weight


def axis_role_shares(plan) -> list:
    """Per mesh axis, ``{role: share of the matmuls' compute time}`` (see the module docstring);
    ``{"pipeline": 1.0}`` for a pipelined plan's first axis, ``{}`` for an axis with no matmul."""
    stages = plan.stage_plans
    if not stages:
        return _intra_op_shares(plan)
    merged = defaultdict(lambda: defaultdict(float))
    for stage in stages:
        for name, shares in zip(stage.axis_names, _intra_op_shares(stage)):
            for role, share in shares.items():
                merged[name][role] += share / len(stages)
    return [{"pipeline": 1.0}] + [dict(merged.get(name, {})) for name in plan.axis_names[1:]]


def axis_roles(plan) -> str:
    """``"a0 tensor 97%, a1 data"``: per mesh axis, its role, or the roles sharing it (>= 5% each)."""
    parts = []
    for name, roles in zip(plan.axis_names, axis_role_shares(plan), strict=True):
        ranked = sorted(roles.items(), key=lambda kv: -kv[1])
        text = " + ".join(f"{role} {share:.0%}" for role, share in ranked if share >= 0.05)
        parts.append(f"{name} {ranked[0][0] if ranked and ranked[0][1] > 0.95 else text or '-'}")
    return ", ".join(parts)
