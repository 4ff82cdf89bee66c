"""Schedule generators: GPipe, 1F1B, interleaved 1F1B and zero-bubble ZB-H1 (compute actions only).

:func:`gpipe`, :func:`one_f_one_b`, :func:`interleaved_1f1b` (``v`` looped stages per rank,
``m`` a multiple of ``p``) and :func:`zb_h1` (zero bubble, backward split into ``I`` and ``W``)
return compute-only schedules; :func:`passes.schedules.lowering.add_communication` lowers them.
Combinations that cannot be scheduled raise ``ValueError`` naming the numbers; everything
returned passes the checker.
"""

from __future__ import annotations

import logging

from passes.schedules.actions import Action
from passes.schedules.schedule import Schedule, looped_stage_to_rank, v_shape_stage_to_rank

logger = logging.getLogger(__name__)


def _check_counts(name: str, p: int, m: int):
    if not (isinstance(p, int) and isinstance(m, int)) or p < 1 or m < 1:
        raise ValueError(f"{name} needs at least one rank and one microbatch, got p={p!r}, m={m!r}")


def _from_orders(name, p, m, stage_to_rank, orders) -> Schedule:
    return Schedule(
        name,
        p,
        len(stage_to_rank),
        m,
        stage_to_rank,
        {r: [Action(k, s, mb) for k, s, mb in order] for r, order in orders.items()},
    )


def gpipe(p: int, m: int, *, v: int = 1, layout: str = "loop") -> Schedule:
    """All forwards, then all backwards (GPipe). Any ``m >= 1``, also ``m < p``.

    With ``v > 1`` each rank holds ``v`` stages (``layout="loop"`` or ``"v"``): a rank runs its
    stages' forwards in stage order, then their backwards in reverse stage order.
    """
    _check_counts("gpipe", p, m)
    if v < 1 or layout not in ("loop", "v"):
        raise ValueError(f"gpipe needs v >= 1 and layout 'loop' or 'v', got v={v}, layout={layout!r}")
    stage_to_rank = (looped_stage_to_rank if layout == "loop" else v_shape_stage_to_rank)(p, v)
    orders = {r: [] for r in range(p)}
    for r in range(p):
        stages = [s for s, owner in enumerate(stage_to_rank) if owner == r]
        orders[r] += [("F", s, mb) for s in stages for mb in range(m)]
        orders[r] += [("B", s, mb) for s in reversed(stages) for mb in range(m)]
    return _from_orders("gpipe" if v == 1 else f"gpipe_{layout}{v}", p, m, stage_to_rank, orders)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B: rank r runs ``p-1-r`` warm-up forwards, then alternates one forward and one backward,
    then drains the backwards. At most ``p-r`` microbatches are in flight on rank r.
    ``m < p`` is allowed (the warm-up is cut to ``m``; the schedule degrades towards GPipe)."""
    _check_counts("one_f_one_b", p, m)
    orders = {}
    for r in range(p):
        warmup = min(p - 1 - r, m)
        order = [("F", r, mb) for mb in range(warmup)]
        for i in range(m - warmup):
            order += [("F", r, warmup + i), ("B", r, i)]
        order += [("B", r, mb) for mb in range(m - warmup, m)]
        orders[r] = order
    return _from_orders("1f1b", p, m, looped_stage_to_rank(p), orders)


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): ``v >= 2`` stages per rank, looped (stage s on rank s % p).

    Rank r walks "virtual microbatches" k = 0 .. m*v-1: forward k runs microbatch
    ``(k // (p*v)) * p + k % p`` on its chunk ``(k // p) % v``; backwards walk the chunks in
    reverse. Microbatches move through the chunks in groups of p, so ``m`` must be a multiple
    of ``p`` (which also rules out ``m < p``). Warm-up is ``2(p-1-r) + (v-1)p`` forwards.
    """
    _check_counts("interleaved_1f1b", p, m)
    if not isinstance(v, int) or v < 2:
        raise ValueError(
            f"interleaved_1f1b needs v >= 2 stages per rank, got v={v!r} (for one stage per rank use one_f_one_b)"
        )
    if m % p:
        lower, upper = (m // p) * p, (m // p + 1) * p
        hint = f"m={lower} or m={upper}" if lower else f"m={upper}"
        raise ValueError(
            f"interleaved_1f1b needs the number of microbatches to be a multiple of the "
            f"number of ranks: m={m} microbatches on p={p} ranks (fewer microbatches "
            f"than ranks is not supported either); use {hint}"
        )
    total = m * v

    def virtual(k, backward):
        chunk = (k // p) % v
        if backward:
            chunk = v - 1 - chunk
        return chunk, (k // (p * v)) * p + k % p

    orders = {}
    for r in range(p):
        warmup = min(2 * (p - 1 - r) + (v - 1) * p, total)
        order = []
        for k in range(warmup):
            chunk, mb = virtual(k, False)
            order.append(("F", chunk * p + r, mb))
        for i in range(total - warmup):
            chunk, mb = virtual(warmup + i, False)
            order.append(("F", chunk * p + r, mb))
            chunk, mb = virtual(i, True)
            order.append(("B", chunk * p + r, mb))
        for k in range(total - warmup, total):
            chunk, mb = virtual(k, True)
            order.append(("B", chunk * p + r, mb))
        orders[r] = order
    return _from_orders("interleaved_1f1b", p, m, looped_stage_to_rank(p, v), orders)


def zb_h1(p: int, m: int) -> Schedule:
    """Zero-bubble ZB-H1 (Qi et al., 2023): the backward split into ``I`` (input gradient, on the
    critical path up the pipeline) and ``W`` (weight gradient, which nothing waits for).

    Rank r runs 1F1B's ``p-1-r`` warm-up forwards, then ``F, I`` pairs, but defers each ``W`` by
    r microbatches (``W(i-r)`` follows ``I(i)``); the ``r`` deferred ``W`` fill the cool-down,
    where 1F1B idles. Every rank then holds at most ``p`` microbatches' activations (counted from
    ``F`` to ``W``): the peak of 1F1B (its rank 0), on every rank. With ``F = I = W`` the idle
    time per rank is ``(p-1) F`` against 1F1B's ``3 (p-1) F``. Any ``m >= 1``.
    """
    _check_counts("zb_h1", p, m)
    orders = {}
    for r in range(p):
        warmup = min(p - 1 - r, m)
        order = [("F", r, mb) for mb in range(warmup)]
        backwards = []
        for i in range(m):
            backwards.append([("I", r, i)] + ([("W", r, i - r)] if i >= r else []))
        for i in range(m - warmup):
            order += [("F", r, warmup + i)] + backwards[i]
        for i in range(m - warmup, m):
            order += backwards[i]
        order += [("W", r, mb) for mb in range(max(m - r, 0), m)]
        orders[r] = order
    return _from_orders("zb_h1", p, m, looped_stage_to_rank(p), orders)
