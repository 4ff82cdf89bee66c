"""The ILP solver's relaxation-first step (``passes/plan/ilp_solver.py``): the LP relaxation settles
a solve when its optimum is integral (or it is infeasible), and then gives the optimum branch and
bound gives; a fractional relaxation (a budget that binds) falls through to branch and bound."""

from __future__ import annotations

import pytest
import torch

from partitioner import models
from partitioner.local_cluster import get_cluster
from passes.analysis.analyze import analyze
from passes.capture.blocks import find_blocks
from passes.capture.capture import capture
from passes.plan import ilp_solver
from passes.plan.ilp_solver import solve_ilp
from passes.plan.strategy_space import build_space


@pytest.fixture(scope="module")
def gpt_space():
    """A 1-layer GPT's strategy space on 4 devices: (costs, memories, edges)."""
    torch.manual_seed(0)
    model, inputs = models.gpt_demo(batch=4, seq=32, n_layer=1)
    cap = capture(model, inputs)
    analyze(cap)
    space = build_space(cap.graph, find_blocks(cap.graph), (4,), get_cluster("h100"))
    costs = [g.cost for g in space.groups]
    memories = [g.memory for g in space.groups]
    edges = [(e.src, e.dst, e.src_class, e.dst_class, e.matrix, e.memory) for e in space.edges]
    return costs, memories, edges


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
    row = lambda r: sum(m[i] for m, i in zip(memories, r.choice)) + sum(  # noqa: E731
        e[5][e[2][r.choice[e[0]]], e[3][r.choice[e[1]]]] for e in edges if e[5] is not None
    )
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
