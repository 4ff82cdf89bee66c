"""The configuration search prices every schedule of the degrees it plans (partitioner/search/
schedule_twins.py): a planned pipeline's schedule twins whose stages are cut differently
(interleaved against ZB-H1 / 1F1B) are priced from the stages just planned, planned when that
beats the best step, else explained; 1F1B and ZB-H1 reuse one set of stage plans, and a reused
set prices a configuration exactly as a fresh planning does (planning-only, the ``h100``
preset)."""

import pytest

from partitioner import models
from partitioner.options import PlanOptions
from partitioner.parallel_config import ParallelConfig
from partitioner.search import search_config
from partitioner.search.api import search_options
from partitioner.search.candidate import Candidate
from partitioner.search.facts import ModelFacts
from partitioner.search.planner import Planner
from partitioner.search.schedule_twins import PRICED, expected_step, schedule_twins


def _planner(model, inputs, batch):
    from partitioner.local_cluster import get_cluster

    opts = search_options(PlanOptions.build(None, cluster="h100"))
    spec = get_cluster("h100")
    planner = Planner(
        model, inputs, batch, spec=spec, budget=spec.memory_bytes, precision=opts.precision_policy, options=opts
    )
    planner.facts = ModelFacts.of(model, planner.capture(batch), batch)
    return planner


@pytest.fixture(scope="module")
def gpt():
    return models.gpt_demo(batch=16, seq=16, n_layer=8)


def test_the_search_prices_every_schedule_of_the_pipelines_it_plans():
    model, inputs = models.gpt_demo(batch=32, seq=32, n_layer=8)
    plan = search_config(model, inputs, devices=16, cluster="h100", max_plans=2)
    rows = plan.data["search"]["rows"]
    planned = [r for r in rows if r["status"] in ("chosen", "planned") and r["config"]["pipeline"] > 1]
    assert planned, "the search planned a pipeline here"
    key = ("pipeline", "data", "tensor", "sequence", "microbatches", "recompute", "zero")
    for row in planned:
        twins = [
            r
            for r in rows
            if r is not row
            and all(r["config"][k] == row["config"][k] for k in key)
            and r["config"]["virtual_stages"] != row["config"]["virtual_stages"]
        ]
        for twin in twins:  # planned, set aside by a bound, or priced from these stages
            assert twin["status"] in ("chosen", "planned", "pruned") or twin["reason"].startswith(PRICED), twin
    search = plan.data["search"]
    assert search["from_stages"] >= sum(r["reason"].startswith(PRICED) for r in rows)
    assert search["from_stages"] > 0  # the interleaved twins of the planned p2 d8 (2 microbatches)
    assert f"{search['from_stages']} priced from planned stages" in plan.explain()


def test_a_reused_stage_set_prices_exactly_and_a_twin_is_expected_from_the_planned_stages(gpt):
    model, inputs = gpt
    planner = _planner(model, inputs, 16)
    zb = ParallelConfig(2, 4, 1, 4, "zb-h1", 1, "none", 16, zero=0)
    one_f = ParallelConfig(2, 4, 1, 4, "1f1b", 1, "none", 16, zero=0)
    inter = ParallelConfig(2, 4, 1, 4, "interleaved", 2, "none", 16, zero=0)
    made = planner.plan(zb)
    cand = Candidate(zb, 0.0, 0.0, 1.0, status="planned", plan=made)
    cands = [cand, Candidate(one_f, 0.0, 0.0, 1.0), Candidate(inter, 0.0, 0.0, 1.0)]
    assert [c.config for c in schedule_twins(cands, cand)] == [inter]  # 1F1B shares zb-h1's stages
    plannings = planner.plannings
    reused = planner.plan(one_f).estimate()
    assert planner.plannings == plannings  # 1F1B replays ZB-H1's stage plans
    fresh = _planner(model, inputs, 16).plan(one_f).estimate()
    assert reused.step_time_s == fresh.step_time_s and reused.memory_bytes == fresh.memory_bytes
    assert reused.comm_bytes == fresh.comm_bytes
    # rescaled to its own cut, a planned pipeline is expected at exactly its simulated step
    assert expected_step(planner, cand, zb) == pytest.approx(made.estimate().step_time_s, rel=1e-12)
    assert expected_step(planner, cand, one_f) == pytest.approx(reused.step_time_s, rel=1e-12)
    # the interleaved twin: its eight layers in four stages of two, the first and last keeping
    # the embedding's and the head's own seconds, two microbatch passes of half a stage per rank
    expected = expected_step(planner, cand, inter)
    assert 0 < expected < 2 * made.estimate().step_time_s
    planner.plan(inter)
    assert planner.plannings == plannings + 1  # planned for real, its cut is a stage set of its own
