"""The ILP solver's shortcuts. Relaxation first (``passes/plan/ilp_solver.py``): the LP relaxation
settles a solve when its optimum is integral (or it is infeasible), and then gives the optimum branch
and bound gives; a fractional relaxation (a budget that binds) falls through to branch and bound.
One solve per distinct problem, one walk per plan (``passes/plan/plan_intra_op.py``'s ``_Solves`` and
``_peak_of``, keyed by ``ilp_solver.problem_key``): the budget fitting asks some problems again (a
tightening whose next limit it has solved, the least plans with and without ZeRO-1 on offer where
no weight has a ZeRO-1 option); each is solved and walked once, and a problem that differs in any
number is solved anew."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from partitioner import models
from partitioner.local_cluster import get_cluster
from passes.analysis.analyze import analyze
from passes.capture.blocks import find_blocks
from passes.capture.capture import capture
from passes.plan import ilp_solver
from passes.plan import plan_intra_op as intra
from passes.plan.ilp_solver import problem_key, solve_ilp
from passes.plan.recompute import RecomputeChoice
from passes.plan.strategy_space import build_space


@pytest.fixture(scope="module")
def gpt():
    """A 1-layer GPT's capture and strategy space on 4 devices, h100 figures."""
    torch.manual_seed(0)
    model, inputs = models.gpt_demo(batch=4, seq=32, n_layer=1)
    cap = capture(model, inputs)
    analyze(cap)
    return cap, build_space(cap.graph, find_blocks(cap.graph), (4,), get_cluster("h100"))


def _problem(space) -> tuple:
    """(costs, memories, edges) of ``space``'s ILP."""
    return (
        [g.cost for g in space.groups],
        [g.memory for g in space.groups],
        [(e.src, e.dst, e.src_class, e.dst_class, e.matrix, e.memory) for e in space.edges],
    )


@pytest.fixture(scope="module")
def gpt_space(gpt):
    """The GPT's ILP: (costs, memories, edges)."""
    return _problem(gpt[1])


def _settled(monkeypatch) -> list:
    """Records, per solve, whether the relaxation settled it."""
    seen: list = []
    real = ilp_solver._relaxation_if_integral

    def recorded(*args):
        res = real(*args)
        seen.append(res is not None)
        return res

    monkeypatch.setattr(ilp_solver, "_relaxation_if_integral", recorded)
    return seen


@pytest.mark.parametrize("objective", ["time", "memory"])
def test_an_unbudgeted_solve_is_settled_by_the_relaxation_at_the_optimum(gpt_space, monkeypatch, objective):
    costs, memories, edges = gpt_space
    seen = _settled(monkeypatch)
    first = solve_ilp(costs, memories, edges, objective=objective)
    assert seen == [True], "the relaxation of an unbudgeted GPT plan is integral"
    searched = solve_ilp(costs, memories, edges, objective=objective, relaxation_first=False)
    assert seen == [True], "relaxation_first=False runs branch and bound only"
    assert first.optimal and searched.optimal and first.gap == 0.0
    kept = [sum(m[i] for m, i in zip(memories, r.choice)) for r in (first, searched)]
    if objective == "time":
        assert first.objective == pytest.approx(searched.objective, rel=1e-7)
    else:  # the least memory; time only breaks ties
        assert kept[0] == pytest.approx(kept[1], rel=1e-7)


def test_a_binding_budget_falls_through_to_branch_and_bound_at_the_same_optimum(gpt_space, monkeypatch):
    costs, memories, edges = gpt_space
    free = solve_ilp(costs, memories, edges)
    least = solve_ilp(costs, memories, edges, objective="memory")

    def row(r):
        edge_bytes = sum(e[5][e[2][r.choice[e[0]]], e[3][r.choice[e[1]]]] for e in edges if e[5] is not None)
        return sum(m[i] for m, i in zip(memories, r.choice)) + edge_bytes

    budget = (row(free) + row(least)) / 2  # between the fastest plan's row and the least one's: it binds
    assert row(least) < budget < row(free)
    seen = _settled(monkeypatch)
    tight = solve_ilp(costs, memories, edges, budget=budget)
    assert seen == [False], "the relaxation under a binding budget is fractional here"
    searched = solve_ilp(costs, memories, edges, budget=budget, relaxation_first=False)
    assert tight.objective == pytest.approx(searched.objective, rel=1e-6)
    assert row(tight) <= budget * (1 + 1e-9) and tight.objective > free.objective


def test_an_infeasible_budget_is_refused_by_the_relaxation(gpt_space, monkeypatch):
    costs, memories, edges = gpt_space
    seen = _settled(monkeypatch)
    budget = 0.5 * ilp_solver.min_memory(memories)  # under what every plan keeps
    refused = solve_ilp(costs, memories, edges, budget=budget)
    assert seen == [True] and refused.choice is None and refused.status == 2
    assert solve_ilp(costs, memories, edges, budget=budget, relaxation_first=False).choice is None


def test_the_key_names_every_number_of_the_problem(gpt):
    _, space = gpt
    costs, memories, edges = _problem(space)
    key = problem_key(costs, memories, edges, budget=1e9, objective="time")
    copied = ([c.copy() for c in costs], [m.copy() for m in memories], [tuple(edges[0])] + edges[1:])
    assert problem_key(*copied, budget=1e9, objective="time") == key
    nudged = [c.copy() for c in costs]
    nudged[-1][0] = np.nextafter(nudged[-1][0], np.inf)
    assert problem_key(nudged, memories, edges, budget=1e9, objective="time") != key
    assert problem_key(costs, memories, edges, budget=1e9 + 1, objective="time") != key
    assert problem_key(costs, memories, edges, budget=1e9, objective="memory") != key
    assert problem_key(costs, memories, edges, budget=1e9, objective="time", forbidden=[(0, 0)]) != key


def test_a_problem_asked_again_is_solved_once_with_the_same_plan(gpt):
    _, space = gpt
    solve = intra._Solves(space, objective="time", zero=0, time_limit=60.0, host_budget=None)
    redo = RecomputeChoice()
    least = solve(None, redo, "memory")
    limit = least.row * 1.5  # a budget that binds: branch and bound, not the relaxation alone
    first = solve(limit, redo, nodes=250)
    again = solve(limit, redo, nodes=250)
    assert again is first and (solve.asked, len(solve.known)) == (3, 2)
    fresh = solve_ilp(*_problem(space), budget=limit, objective="time", node_limit=250, links=redo.rows())
    assert fresh.choice == first.choice and fresh.objective == first.objective
    assert solve.shards  # ZeRO-1 options to leave out: another problem
    solve(limit, redo, nodes=250, zero1=False)
    solve(limit * 0.99, redo, nodes=250)  # another limit: another problem
    assert (solve.asked, len(solve.known)) == (5, 4)
    forced = intra._Solves(space, objective="time", zero=1, time_limit=60.0, host_budget=None)
    assert forced(limit, redo, nodes=250, zero1=False) is forced(limit, redo, nodes=250)  # ZeRO-1 forced: none left out
    assert (forced.asked, len(forced.known)) == (2, 1)


def test_a_plan_met_again_is_walked_once(gpt, monkeypatch):
    cap, space = gpt
    walks = []
    real = intra.memory_fields

    def counted(*args, **kwargs):
        walks.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(intra, "memory_fields", counted)
    redo = RecomputeChoice()
    peak_of = intra._peak_of(space, cap, space.optimizer, 1, lambda: redo)
    solve = intra._Solves(space, objective="time", zero=0, time_limit=60.0, host_budget=None)
    fastest, least = solve(None, redo), solve(None, redo, "memory")
    assert fastest.choice != least.choice
    seen = [peak_of(fastest.choice), peak_of(least.choice), peak_of(list(fastest.choice)), peak_of(least.choice)]
    assert len(walks) == 2 and seen[0] == seen[2] and seen[1] == seen[3]
    assert seen[1][0] < seen[0][0]  # the least plan walks to a lower peak: two plans, two walks
