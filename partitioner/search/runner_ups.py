"""Runner-ups of the configuration search: the candidates the planning limit (or the
one-planning-per-degrees rule) left out whose quick estimate, scaled by the ratio of a planned step
to its quick estimate (their own degrees' where planned, else the median), beats the best step are
planned past the limit (:data:`RUNNER_UPS` at most, each expected to win by more than :data:`GAIN`;
none whose configuration is one planned already); the others below the chosen step say why."""

from __future__ import annotations

import logging
import math
import statistics

from partitioner.search.candidate import LIMIT, SAME_DEGREES, Candidate, degrees_of, fmt_s
from partitioner.search.zero_modes import planner_zero

logger = logging.getLogger(__name__)


RUNNER_UPS = 2
"""Plannings past ``max_plans`` for candidates the limit left out that may beat the chosen plan."""

GAIN = 0.01
"""A runner-up is planned when expected below the best step by more than this fraction: the planned
/ quick ratios it is expected by differ more than that between candidates (Llama 3 70B: 1.09-1.13),
and a pipelined planning there costs 100 CPU seconds (p8 sp2 t4 ZeRO-3, expected 0.5% below the
best step, planned no faster)."""


def ratio_key(c: Candidate) -> tuple:
    """What a planned / quick ratio is kept by: the degrees and how the solver was asked for the
    ZeRO stage (ZeRO-3's gathers per layer price nothing like ZeRO-0's kept weights)."""
    return degrees_of(c.config) + (planner_zero(c.config.zero),)


def ratios_by_degrees(cands: list) -> dict:
    """Per set of degrees and solver ZeRO mode planned (:func:`ratio_key`), the least ratio of a
    plan's estimated step to its quick estimate."""
    ratios: dict = {}
    for c in cands:
        if c.plan is not None and c.quick_s > 0:
            key = ratio_key(c)
            ratios[key] = min(ratios.get(key, math.inf), c.step_time_s / c.quick_s)
    return ratios


def planned_over_quick(cands: list) -> float:
    """The median over the sets of degrees planned of :func:`ratios_by_degrees` (1.0 before
    any): how far the quick estimates ran from the real plans here."""
    ratios = list(ratios_by_degrees(cands).values())
    return statistics.median(ratios) if ratios else 1.0


def expected_ratio(c: Candidate, ratios: dict, median: float) -> tuple:
    """(ratio, what it is) to scale ``c``'s quick estimate by: its own degrees' planned ratio
    where they were planned (another schedule, microbatch count or ZeRO stage of the same
    degrees), else the median of the search."""
    own = ratios.get(ratio_key(c))
    if own is not None:
        return own, "these degrees"
    return median, "median"


def left_out(c: Candidate) -> bool:
    """Left unplanned by the search limit or by the one-planning-per-degrees rule."""
    return c.status == "not planned" and (c.reason.startswith(LIMIT) or c.reason.startswith(SAME_DEGREES))


def planned_as(cands: list) -> set:
    """The configurations planned, as their plans ran (a ZeRO stage asked of the solver is recorded
    as the one its weights use): a candidate of one of them would replan a plan the search has
    (Llama 3 70B: p8 sp4 t2 asked ZeRO-3 ran as ZeRO-2, and its ZeRO-2 twin, planned again past
    the limit, cost 250 s for the same step)."""
    return {c.config for c in cands if c.plan is not None}


def runner_up(cands: list, best, allowed: bool):
    """The candidate left out (:func:`left_out`) whose quick estimate, scaled by
    :func:`expected_ratio`, beats the best step found by most (planned next, past the limit);
    None when none does, or when ``allowed`` is false (no runner-ups left to plan)."""
    if best is None or not allowed:
        return None
    ratios, median = ratios_by_degrees(cands), planned_over_quick(cands)
    done = planned_as(cands)
    scored = [
        (c.quick_s * expected_ratio(c, ratios, median)[0], c) for c in cands if left_out(c) and c.config not in done
    ]
    scored = [(e, c) for e, c in scored if e < best.step_time_s * (1 - GAIN)]
    if not scored:
        return None
    expected, pick = min(scored, key=lambda ec: ec[0])
    ratio, what = expected_ratio(pick, ratios, median)
    pick.reason = ""
    logger.info(
        "search: %s: quick estimate %s x %.2f (planned / quick ratio, %s) = %s beats the best step %s: "
        "planned past the limit",
        pick.config.describe(),
        fmt_s(pick.quick_s),
        ratio,
        what,
        fmt_s(expected),
        fmt_s(best.step_time_s),
    )
    return pick


def explain_runner_ups(cands: list, best) -> None:
    """Say, for each candidate left out (:func:`left_out`) whose quick estimate is below the
    chosen step, why it was not planned: the quick estimate scaled by :func:`expected_ratio`,
    against the step."""
    ratios, median = ratios_by_degrees(cands), planned_over_quick(cands)
    done = planned_as(cands)
    for c in cands:
        if not left_out(c) or c.quick_s >= best.step_time_s:
            continue
        if c.config in done:
            c.reason += (
                ", below the chosen step; its configuration is one planned (a higher ZeRO stage asked ran as it)"
            )
            continue
        ratio, what = expected_ratio(c, ratios, median)
        expected = c.quick_s * ratio
        if expected >= best.step_time_s:
            verdict = f"not below the chosen step {fmt_s(best.step_time_s)}"
        elif expected >= best.step_time_s * (1 - GAIN):
            verdict = f"within {GAIN:.0%} of the chosen step {fmt_s(best.step_time_s)}, not planned for so little"
        else:
            verdict = (
                f"below the chosen step {fmt_s(best.step_time_s)}, but the {RUNNER_UPS} plannings past the limit "
                "went to lower ones"
            )
        c.reason += (
            f", below the chosen step; planned candidates here took {ratio:.2f}x their quick estimates ({what}), "
            f"so expected {fmt_s(expected)}: {verdict}"
        )
