"""Fitting a solved plan's peak memory into the budget: the ILP's row limit searched from both sides.

The ILP's memory row holds state, inputs and what backward keeps; the plan's peak adds a
transient no linear row holds (an op's output and edge buffers in forward, gradients and ZeRO-3
weights gathered again in backward: :mod:`passes.plan.memory_peak`). So the solve is repeated with
the row's limit ``L`` below the budget ``B`` until the plan's walked peak fits. The algorithm
(:func:`fit_peak`):

0. **Ties.** The plans within :data:`TIE` of the one over the budget cost the same up to a
   flat call's latency, and some keep less (a ZeRO-1 weight instead of a replicated one): the
   one whose row is least among them (the ILP with a time row, ``least_as_fast``) is tried
   first, and taken if its peak fits. The row limit's bisection alone steps over such a plan:
   the solver breaks a tie without looking at the walked peak (a pipeline stage under its
   all-ZeRO-1 plan's exact peak got a plan 22% slower after 4 bisections; it now gets that
   plan, in 1 re-solve). The relaxing step below tries the ties of each plan over the budget
   it meets, too. A tie changes what a plan keeps (a ZeRO-1 shard for a replicated weight), not
   its transients: it is tried only where the kept bytes it can give up (the over plan's kept
   part less ``least_kept``, the least any plan of the space keeps) cover the excess over the
   budget. Each tie is a memory-objective ILP under a time row, the costliest solve here (Llama
   3 70B's whole model at data 8 x tensor 8: 59 CPU seconds, for a plan whose 67 GB transient
   (the loss over 8 samples of a 128k vocabulary) no tie could fit under 80 GB).
1. **Tighten.** ``L = B - m``, ``m`` the largest transient seen, while the plan's peak is over
   (at most 4 rounds); where ``L`` leaves no plan, ``m`` is halved (twice). A plan over the budget
   whose transient is within ``m`` keeps more than the row holds (the walk counts what the row
   leaves out): ``m`` then grows to its peak less its row's value (``result.row``, else ``L``),
   so the next limit is below that plan's row by its excess, as the same limit would give the same
   plan again (Llama 3 70B's stage classes solved one limit four times, then took the plan that
   keeps the least). Each limit whose plan
   is over is the new ``over``: a limit known too loose, with that plan's objective, a lower bound
   of every plan's at tighter limits.
2. **Relax.** The first plan that fits may be far below ``B``: ``m`` is one plan's transient, and
   the plan chosen under ``B - m`` often has a smaller one. Bisect between the fitting limit and
   ``over``: a plan whose peak fits raises the fitting limit (kept when faster than the best so
   far), one over (its ties tried first) lowers ``over`` (and its objective the bound). Stop when
   the best fitting plan is within :data:`SAME` of the bound (nothing between can be faster by
   more), the two limits are within 0.5% of ``B``, or after :data:`MAX_RELAX_SOLVES` solves. So
   the plan taken is the cheapest fitting one found, never slower than the tightening alone gives.
3. **Last resort.** When no limit gives a plan that fits, the plan that keeps the least (the
   memory objective, no row; the row bounds the walked peak from above) if its peak fits, else
   :class:`InfeasibleBudgetError`.

Each solve here is a re-solve of a nearby problem (the callers give it a small node limit); the
number spent is logged, since the configuration search plans many candidates.
"""

from __future__ import annotations

import logging

__all__ = ["fit_peak", "MAX_RELAX_SOLVES"]

logger = logging.getLogger(__name__)

MAX_RELAX_SOLVES = 4
"""Solves spent relaxing the limit of a plan that fits toward the budget (step 2, ties included)."""
CLOSE = 0.005
"""Limits within this fraction of the budget of each other are not bisected further."""
SAME = 0.005
"""A fitting plan within this relative margin of the bound is kept: a bisection would win at most
that. On Llama 3 8B's whole model on 64 devices each relax solve costs about 20 CPU seconds, and
the search's first planning there spent 3 of its 4 for a bound 0.3% below its plan."""
TIE = 1e-3
"""Plans within this relative margin of a plan over the budget are its ties: the one of them that
keeps the least (the ILP's row) is tried next (a ZeRO-1 weight costs what a replicated one does,
within its flat calls' latency, and keeps less)."""


def fit_peak(result, budget: float, solve, peak_of, least_peak, error, *, least_as_fast=None, least_kept=0.0):
    """``result`` (an ILP result over budget ``budget``'s row) re-solved until its walked peak
    fits (the module docstring). ``solve(limit)``: the ILP under that row limit; ``peak_of(choice)``:
    (peak, transient); ``least_peak()``: the plan that keeps the least; ``error``: the exception
    class to raise when nothing fits; ``least_as_fast(limit, seconds)``: the plan that keeps the
    least under ``limit`` among those of at most ``seconds`` (None: ties are not tried);
    ``least_kept``: bytes every plan keeps at least (the least of the ILP's row)."""
    peak, transient = peak_of(result.choice)
    if peak <= budget:
        return result
    ties = _Ties(least_as_fast, peak_of, budget, least_kept)
    tie = ties.that_fits(result, budget, peak, transient)
    if tie is not None:
        logger.info(
            "peak fitted by a tie of the plan over it (1 re-solve): %.4fx its time", tie.objective / result.objective
        )
        return tie
    over, bound = budget, result.objective
    fit, limit, margin, solves = None, budget, 0.0, 0
    for _ in range(4):  # 1. tighten
        margin = max(margin, transient)
        retry, limit, tries = _solve_below(solve, budget, margin)
        solves += tries
        if retry is None:
            break
        peak, transient = peak_of(retry.choice)
        result = retry
        if peak <= budget:
            fit = retry
            break
        over, bound, margin = limit, retry.objective, budget - limit
        if transient <= margin:  # the walk keeps more than the row holds: the same limit gives the same plan
            margin = peak - getattr(retry, "row", limit)
    if fit is None:
        least = least_peak()
        if least.choice is not None and peak_of(least.choice)[0] <= budget:
            logger.info("peak over the budget after %d re-solves: the plan that keeps the least fits", solves)
            return least
        raise error(
            f"no plan found whose peak fits {budget / 2**30:.4f} GiB per device ({budget:.0f} bytes): the best needs "
            f"{peak:.0f} bytes at its peak, {transient:.0f} of them transient (an op's output and gradients). Raise "
            f"the budget, use a larger mesh, or a lighter optimizer (optimizer='sgd')."
        )
    best, relaxed = _relax(fit, limit, over, bound, budget, solve, peak_of, ties)
    logger.info(
        "peak fitted in %d re-solves (row limit %.0f of %.0f bytes), %d more relaxing it%s; ties: %d solved, %d fit",
        solves,
        limit,
        budget,
        relaxed,
        f": {fit.objective / best.objective:.3f}x faster" if best is not fit else "",
        ties.solves,
        ties.fits,
    )
    return best


def _solve_below(solve, budget: float, margin: float) -> tuple:
    """(the ILP under ``budget - margin``, halving ``margin`` twice where that leaves no plan, or
    None; the limit; solves spent)."""
    for tries in range(1, 4):
        retry = solve(budget - margin)
        if retry.choice is not None:
            return retry, budget - margin, tries
        margin /= 2
    return None, budget, 3


def _relax(fit, fit_limit: float, over: float, bound: float, budget: float, solve, peak_of, ties) -> tuple:
    """Step 2: bisect the row limit between ``fit_limit`` (its plan ``fit`` fits) and ``over``
    (too loose; ``bound``: the objective there); (the best fitting plan, solves spent)."""
    best, spent = fit, 0
    while spent < MAX_RELAX_SOLVES and best.objective > bound * (1 + SAME) and over - fit_limit > CLOSE * budget:
        mid = (fit_limit + over) / 2
        tried = solve(mid)
        spent += 1
        if tried.choice is not None and tried.objective < best.objective:
            peak, transient = peak_of(tried.choice)
            if peak > budget:
                before = ties.solves
                tried = ties.that_fits(tried, mid, peak, transient) or tried
                spent += ties.solves - before
        if tried.choice is not None and peak_of(tried.choice)[0] <= budget:
            fit_limit = mid
            best = tried if tried.objective < best.objective else best
        else:
            over = mid
            bound = tried.objective if tried.choice is not None else bound
    return best, spent


class _Ties:
    """Step 0's ties (the plan that keeps the least among those within :data:`TIE` of a plan over
    the budget), tried only where what a tie can give up covers the excess; counts its solves."""

    def __init__(self, least_as_fast, peak_of, budget: float, least_kept: float):
        self.least_as_fast, self.peak_of, self.budget, self.least_kept = least_as_fast, peak_of, budget, least_kept
        self.solves = self.fits = 0

    def that_fits(self, over, limit: float, peak: float, transient: float):
        """The tie of ``over`` (peak ``peak``, of which ``transient`` transient) under row limit
        ``limit`` if its peak fits, else None (also when no tie can: nothing solved)."""
        if self.least_as_fast is None or (peak - transient) - self.least_kept < peak - self.budget:
            return None
        self.solves += 1
        tie = self.least_as_fast(limit, over.objective * (1 + TIE))
        if tie.choice is None or self.peak_of(tie.choice)[0] > self.budget:
            return None
        self.fits += 1
        return tie
