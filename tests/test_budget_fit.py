"""Fitting a plan's walked peak into the budget (passes/plan/budget_fit.py): the ILP's row limit is
tightened by the transients seen, then relaxed toward the budget, keeping the cheapest plan that
fits. A known answer on a made-up ILP, and GPT on (4,) under half the replicated state, where
tightening alone over-shards."""

import pytest
from parity_utils import build

from passes.plan import budget_fit
from passes.plan.plan_intra_op import InfeasibleBudgetError


class _Result:
    def __init__(self, limit):
        self.choice = limit if limit > 0 else None  # no plan fits an empty row
        self.objective = 1000.0 / limit if limit > 0 else None  # a looser row: a faster plan


def _made_up(transient_of):
    """A made-up ILP: the plan under row limit ``L`` uses the whole row, its peak adds
    ``transient_of(L)``; counts its solves."""
    solves = []

    def solve(limit):
        solves.append(limit)
        return _Result(limit)

    def peak_of(limit):
        return limit + transient_of(limit), transient_of(limit)

    return solve, peak_of, solves


def test_the_limit_is_relaxed_toward_the_budget_after_a_transient_too_large():
    # the first plan (limit 100) peaks at 140: tightening by its transient (40) gives a plan at 60,
    # whose own transient is only 10 (peak 70): far below the budget; the bisections find 80 (peak
    # 90 fits, faster), 90 is over (transient 40), 85 fits (peak 95), 87.5 is over: the solve limit
    solve, peak_of, solves = _made_up(lambda limit: 40.0 if limit > 85 else 10.0)
    got = budget_fit.fit_peak(_Result(100.0), 100.0, solve, peak_of, lambda: None, InfeasibleBudgetError)
    assert solves == [60.0, 80.0, 90.0, 85.0, 87.5]
    assert got.choice == 85.0 and peak_of(got.choice)[0] <= 100.0
    # a plan as fast as the bound is not relaxed further: nothing between can be faster
    solve, peak_of, solves = _made_up(lambda limit: 40.0)
    got = budget_fit.fit_peak(_Result(100.0), 100.0, solve, peak_of, lambda: None, InfeasibleBudgetError)
    assert got.choice == 60.0 and solves[0] == 60.0 and len(solves) <= 1 + budget_fit.MAX_RELAX_SOLVES


def test_a_tie_that_keeps_less_is_taken_in_one_re_solve():
    # the plan under the budget's row (limit 100) peaks at 140; a plan 0.05% slower keeps less and
    # fits: the tie step finds it (the least row among plans as fast within TIE), no bisection
    solve, peak_of, solves = _made_up(lambda limit: 40.0)
    asked = []

    def least_as_fast(limit, seconds):
        asked.append((limit, seconds))
        tie = _Result(50.0)
        tie.objective = 10.0 * 1.0005  # within TIE of the plan over (10.0)
        return tie

    got = budget_fit.fit_peak(
        _Result(100.0), 100.0, solve, peak_of, lambda: None, InfeasibleBudgetError, least_as_fast=least_as_fast
    )
    assert got.choice == 50.0 and solves == [] and asked == [(100.0, pytest.approx(10.0 * (1 + budget_fit.TIE)))]


def test_no_tie_is_solved_where_the_kept_bytes_it_can_give_up_do_not_cover_the_excess():
    # peak 140 at limit 100 (transient 40): over the budget by 40; every plan keeps at least 80, so a
    # tie (which changes what is kept, not the transient) gives up at most 20: not solved; with a
    # least of 50 it could give up 50, and it is solved
    for least_kept, solved in ((80.0, 0), (50.0, 1)):
        solve, peak_of, _ = _made_up(lambda limit: 40.0)
        asked = []

        def least_as_fast(limit, seconds):
            asked.append(limit)
            return _Result(0.0)  # no tie found

        budget_fit.fit_peak(
            _Result(100.0),
            100.0,
            solve,
            peak_of,
            lambda: None,
            InfeasibleBudgetError,
            least_as_fast=least_as_fast,
            least_kept=least_kept,
        )
        assert asked[:1] == [100.0] * solved and (solved or not asked)


def test_no_limit_fits_the_least_plan_or_a_clear_error():
    solve, peak_of, _ = _made_up(lambda limit: 1000.0)
    with pytest.raises(InfeasibleBudgetError, match="no plan found whose peak fits"):
        budget_fit.fit_peak(_Result(100.0), 100.0, solve, peak_of, lambda: _Result(50.0), InfeasibleBudgetError)


def test_gpt_under_half_the_state_takes_the_faster_plan_that_fits(fake_process_group, monkeypatch):
    """GPT on (4,), h100 figures, budget half the replicated fp32 Adam state: tightening alone
    stops at a plan whose peak fits; relaxing finds a faster one that fits too."""
    import partitioner

    fake_process_group(4)
    model, inputs = build("gpt")
    n_params = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    budget = int(0.5 * 16 * n_params)

    def planned():
        return partitioner.plan(model, inputs, mesh_shape=(4,), cluster="h100", recompute="none", memory_budget=budget)

    monkeypatch.setattr(budget_fit, "MAX_RELAX_SOLVES", 0)
    tightened = planned()
    monkeypatch.undo()
    relaxed = planned()
    for plan in (tightened, relaxed):
        assert plan.estimate().memory_bytes <= budget
    faster = tightened.data["stats"]["objective_s"] / relaxed.data["stats"]["objective_s"]
    assert faster > 1.05, faster


def test_a_plan_keeping_more_than_its_row_tightens_by_its_excess_not_the_same_limit_again():
    # the walk keeps 20 more than the row (limit) holds, with a transient of 10: tightening by the
    # transient alone would solve limit 90 again and again (the same plan, peak 120); the excess
    # over the budget lowers it to 70, whose plan (peak 100) fits
    solves = []

    def solve(limit):
        solves.append(limit)
        return _Result(limit)

    def peak_of(limit):
        return limit + 20.0 + 10.0, 10.0

    got = budget_fit.fit_peak(_Result(100.0), 100.0, solve, peak_of, lambda: None, InfeasibleBudgetError)
    assert solves[:2] == [90.0, 70.0] and len(set(solves)) == len(solves)
    assert peak_of(got.choice)[0] <= 100.0
