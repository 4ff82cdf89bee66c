"""A whole-model candidate with ``recompute="auto"`` is planned once per uniform recomputation
(partitioner/search/whole_model.py) and takes the fastest: planning-only, the ``h100`` preset, a
budget between the state and what keeping every activation needs."""

from dataclasses import replace

from partitioner import models
from partitioner.parallel_config import ParallelConfig
from partitioner.search import plan_config
from partitioner.search.whole_model import MODES
from passes.plan.plan_intra_op import InfeasibleBudgetError


def test_auto_is_the_fastest_uniform_recomputation_that_fits():
    model, inputs = models.gpt_demo(batch=8, seq=128, n_layer=2, n_embd=64, vocab_size=256)
    config = ParallelConfig(1, 2, 1, 1, None, 1, "none", 8, zero=0)
    kept = plan_config(model, inputs, config, cluster="h100").estimate().memory_bytes
    recomputed = plan_config(model, inputs, replace(config, recompute="all"), cluster="h100").estimate()
    budget = int((kept + recomputed.memory_bytes) / 2)  # keeping every activation does not fit
    steps = {}
    for mode in MODES:
        try:
            steps[mode] = plan_config(
                model, inputs, replace(config, recompute=mode), cluster="h100", memory_budget=budget
            ).estimate()
        except InfeasibleBudgetError:
            continue
    assert "all" in steps and steps
    auto = plan_config(model, inputs, replace(config, recompute="auto"), cluster="h100", memory_budget=budget)
    fastest = min(steps, key=lambda m: steps[m].step_time_s)
    assert auto.estimate().step_time_s == steps[fastest].step_time_s
    assert auto.estimate().memory_bytes <= budget
    assert auto.config.recompute == "auto"
