"""The configuration search's bookkeeping (partitioner/config_search.py): how many configurations
it priced, set aside by their bounds and planned, and runner-ups the planning limit left out whose
quick estimate beats the chosen plan: planned past the limit or explained (planning-only, the
``h100`` preset)."""

from partitioner import models
from partitioner.config_search import (
    _RUNNER_UPS,
    Candidate,
    _explain_runner_ups,
    _planned_over_quick,
    _runner_up,
    search_config,
)
from partitioner.parallel_config import ParallelConfig


def _cand(data, quick, step=None, reason="search limit (5 plannings)"):
    c = Candidate(ParallelConfig(1, data, 8 // data, 1, None, 1, "auto", 8), 0.0, 0.0, quick, reason=reason)
    if step is not None:
        c.status, c.step_time_s, c.plan = "planned", step, object()
    return c


def test_runner_ups_are_ranked_by_their_quick_estimate_scaled_by_the_median_planned_ratio():
    best = _cand(1, 1.0, step=1.5)  # planned at 1.5x its quick estimate
    other = _cand(2, 2.0, step=4.0)  # 2.0x: the median ratio is 1.75
    near = _cand(4, 1.2)  # 1.2 * 1.75 = 2.1 >= 1.5: not worth planning
    close = _cand(8, 0.8)  # 0.8 * 1.75 = 1.4 < 1.5: planned next
    cands = [best, other, near, close]
    assert _planned_over_quick(cands) == 1.75
    assert _runner_up(cands, best, allowed=True) is close and close.reason == ""
    assert _runner_up(cands, best, allowed=False) is None
    close.status, close.reason = "planned", ""
    assert _runner_up(cands, best, allowed=True) is None
    _explain_runner_ups(cands, best)
    assert "1.75x their quick estimates (median), so expected 2.100 s: not below the chosen step 1.500 s" in near.reason


def test_the_search_reports_its_counts_and_plans_or_explains_better_quick_estimates():
    model, inputs = models.gpt_demo(batch=32, seq=32, n_layer=4)
    plan = search_config(model, inputs, devices=8, cluster="h100", max_plans=1)
    search = plan.data["search"]
    assert search["priced"] == sum(search["counts"].values())
    bounded = search["counts"].get("pruned", 0) + sum(
        1 for r in search["rows"] if r["reason"].startswith("needs at least")
    )
    assert search["bounded"] >= bounded - 3  # the table keeps the 3 least of those over their bound
    assert 1 <= search["plannings"] <= 1 + _RUNNER_UPS
    chosen = plan.estimate().step_time_s
    left = [
        r
        for r in search["rows"]
        if r["status"] == "not planned" and r["reason"].startswith("search limit") and r["quick_estimate_s"] < chosen
    ]
    for row in left:
        assert "x their quick estimates (median), so expected" in row["reason"], row
    text = plan.explain()
    assert f"{search['priced']} configurations priced" in text and "set aside by their bounds" in text
