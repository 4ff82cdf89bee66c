"""The configuration search's bookkeeping (partitioner/search/): how many configurations
it priced, set aside by their bounds and planned, and runner-ups the planning limit left out whose
quick estimate beats the chosen plan: planned past the limit or explained (planning-only, the
``h100`` preset)."""

from partitioner import models
from partitioner.parallel_config import ParallelConfig
from partitioner.search import search_config
from partitioner.search.candidate import SAME_DEGREES, Candidate
from partitioner.search.loop import FAR_ABOVE, PlanningLoop
from partitioner.search.runner_ups import RUNNER_UPS, explain_runner_ups, planned_over_quick, runner_up


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
    assert planned_over_quick(cands) == 1.75
    assert runner_up(cands, best, allowed=True) is close and close.reason == ""
    assert runner_up(cands, best, allowed=False) is None
    close.status, close.reason = "planned", ""
    assert runner_up(cands, best, allowed=True) is None
    explain_runner_ups(cands, best)
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
    assert 1 <= search["plannings"] <= 1 + RUNNER_UPS
    chosen = plan.estimate().step_time_s
    left = [
        r
        for r in search["rows"]
        if r["status"] == "not planned" and r["reason"].startswith("search limit") and r["quick_estimate_s"] < chosen
    ]
    for row in left:
        assert "x their quick estimates (" in row["reason"] and "so expected" in row["reason"], row
    text = plan.explain()
    assert f"{search['priced']} configurations priced" in text and "set aside by their bounds" in text


def _pipelined(zero, data=4, schedule="zb-h1", quick=10.0, step=None, reason=""):
    config = ParallelConfig(
        4, data, 16 // data, 8, schedule, 2 if schedule == "interleaved" else 1, "all", 64, zero=zero
    )
    c = Candidate(config, 0.0, 0.0, quick, reason=reason)
    if step is not None:
        c.status, c.step_time_s, c.plan = "planned", step, object()
    return c


def test_a_plan_far_above_its_quick_estimate_is_planned_again_with_zero_3_in_its_turn():
    # ZeRO-0 / ZeRO-2 keep gathered weights: a stage solve that cannot fit them uses dp as a
    # tensor axis (activations sent over dp in every layer); ZeRO-3 frees them after each layer
    asked = _pipelined(0)
    other = _pipelined(0, quick=9.0)
    twin, twin_slower, elsewhere = _pipelined(3, quick=12.0), _pipelined(3, quick=13.0), _pipelined(3, data=2)
    loop = PlanningLoop(None, None, 80.0, [asked, other, twin, twin_slower, elsewhere], max_plans=5)
    loop.queue = [other, elsewhere, twin_slower, twin]
    loop.replan_far_above(asked, 2.9 * asked.quick_s)  # under FAR_ABOVE: planned as it is
    assert loop.queue[0] is other and not loop.forced
    loop.best = _pipelined(0, data=2, quick=5.0, step=11.0)  # twin's quick 12 s cannot beat 11 s
    loop.replan_far_above(asked, FAR_ABOVE * asked.quick_s)
    assert loop.queue[0] is other and not loop.forced and "is not below the best step 11.000 s" in asked.reason
    loop.best.step_time_s, asked.reason = 20.0, ""
    loop.replan_far_above(asked, FAR_ABOVE * asked.quick_s)
    # planned past the limit and the one-planning-per-degrees rule, in its turn: a better plan
    # found before it still prunes it by its bounds
    assert id(twin) in loop.forced and id(twin) in loop.twins and loop.limit == 5
    assert loop.queue == [other, elsewhere, twin_slower, twin]
    assert "planned again with ZeRO-3" in asked.reason


def test_a_candidate_of_planned_degrees_is_expected_at_their_own_ratio_and_planned_when_it_beats_the_best():
    # the interleaved schedule of degrees planned with ZB-H1: the one-planning-per-degrees rule left
    # it out; its expected step is its quick estimate times the ratio those degrees were planned at
    # with the same solver ZeRO mode (ZeRO-3 here), else the median
    best = _pipelined(0, data=2, quick=10.0, step=20.0)  # 2.0x
    planned = _pipelined(3, quick=10.0, step=22.0)  # these degrees: 2.2x, and planned again at 1.1x
    again = _pipelined(3, quick=20.0, step=22.0)
    interleaved = _pipelined(3, schedule="interleaved", quick=15.0, reason=f"{SAME_DEGREES} 16 microbatches")
    kept_weights = _pipelined(0, schedule="interleaved", quick=14.0, reason=f"{SAME_DEGREES} 16 microbatches")
    cands = [best, planned, again, interleaved, kept_weights]
    assert planned_over_quick(cands) == (2.0 + 1.1) / 2
    assert runner_up(cands, best, allowed=True) is interleaved  # 15 x 1.1 = 16.5 < 20 (ZeRO-0: 14 x 1.55)
    interleaved.reason = f"{SAME_DEGREES} 16 microbatches"
    best.step_time_s = 16.0
    assert runner_up(cands, best, allowed=True) is None
    explain_runner_ups(cands, best)
    assert "1.10x their quick estimates (these degrees), so expected 16.500 s: not below" in interleaved.reason
    assert (
        "1.35x their quick estimates (median), so expected 18.900 s: not below" in kept_weights.reason
    )  # best now 1.6x


def test_a_candidate_whose_quick_estimate_is_past_the_best_step_at_the_least_planned_ratio_is_pruned():
    from types import SimpleNamespace

    best = _pipelined(0, data=2, quick=10.0, step=12.0)  # 1.2x
    quicker = _pipelined(3, data=2, quick=10.0, step=9.0)  # planned faster than its quick estimate: 0.9x
    far, near = _pipelined(0, quick=14.0), _pipelined(3, quick=13.0)
    loop = PlanningLoop(SimpleNamespace(stage_sets={}, plannings=0), None, 80.0, [best, quicker, far, near], 5)
    loop.best = best
    assert loop.skipped(far) and far.status == "pruned"  # 14 x 0.9 = 12.6 > 12
    assert "x 0.90 (the least planned / quick ratio of pipeline plans here) exceeds the best step 12.000 s" in (
        far.reason
    )
    assert not loop.skipped(near)  # 13 x 0.9 = 11.7: it may still win


def test_the_least_ratio_of_a_kind_prunes_only_after_two_of_its_plans_and_zero_1_goes_before_zero_0():
    from types import SimpleNamespace

    from partitioner.search.loop import LEAST_RATIO_PLANS

    pressed = _pipelined(0, data=2, quick=10.0, step=15.0)  # 1.5x: one plan says little
    whole = _cand(2, 1.0, step=1.1)  # a whole-model plan's ratio is not a pipeline's
    far = _pipelined(0, data=8, quick=1.0, step=FAR_ABOVE)  # far above: planned again, left out
    later = _pipelined(1, quick=11.0)
    loop = PlanningLoop(SimpleNamespace(stage_sets={}, plannings=0), None, 80.0, [pressed, whole, far, later], 5)
    assert LEAST_RATIO_PLANS == 2 and loop.least_ratio(later.config) == 1.0
    assert loop.least_ratio(whole.config) == 1.0  # its own kind: whole-model plans, at most 1
    second = _pipelined(3, quick=10.0, step=13.0)  # 1.3x
    loop.cands.append(second)
    assert loop.least_ratio(later.config) == 1.3
    loop.best = second
    assert loop.skipped(later) and later.status == "pruned"  # 11 x 1.3 = 14.3 > 13
    # ZeRO-0 and ZeRO-1 twins rank at the lesser quick estimate: ZeRO-1, the smaller bound, first
    bounds = SimpleNamespace(state_per_device=lambda c: 0.0)
    zero0 = Candidate(ParallelConfig(4, 4, 1, 8, "zb-h1", 1, "all", 64, zero=0), 50.0, 1.0, 10.0)
    zero1 = Candidate(ParallelConfig(4, 4, 1, 8, "zb-h1", 1, "all", 64, zero=1), 30.0, 1.0, 10.001)
    other = Candidate(ParallelConfig(4, 4, 1, 16, "zb-h1", 1, "all", 64, zero=0), 20.0, 1.0, 10.0005)
    loop = PlanningLoop(None, bounds, 80.0, [zero0, zero1, other], 5)
    loop.pair_zero_twins(loop.cands)
    assert sorted([zero0, other, zero1], key=loop.order) == [zero1, zero0, other]


def test_a_runner_up_expected_within_the_gain_or_already_planned_is_explained_not_planned():
    from dataclasses import replace

    from partitioner.search.runner_ups import GAIN

    best = _cand(1, 1.0, step=1.5)  # 1.5x: the median ratio
    marginal = _cand(2, 1.0 - GAIN / 3)  # expected 1.5 * (1 - GAIN / 3): within GAIN of the best step
    asked = _cand(4, 0.5, step=0.75)  # planned (1.5x): asked ZeRO-3, ran as ZeRO-2 (its config records it)
    asked.config = replace(asked.config, zero=2)
    same = _cand(8, 0.5)  # expected 0.75 < 1.5, but the configuration asked ran as
    same.config = asked.config
    cands = [best, marginal, asked, same]
    assert runner_up(cands, best, allowed=True) is None
    explain_runner_ups(cands, best)
    assert f"within {GAIN:.0%} of the chosen step 1.500 s" in marginal.reason
    assert "its configuration is one planned" in same.reason
