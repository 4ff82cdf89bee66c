"""ZeRO-2 and ZeRO-3 weights (stored sharded, gathered for use), on real gloo ranks against one device.

A weight stored sharded on the data-parallel axis is all-gathered for the op that uses it and its
gradient reduce-scattered (optimizer state and gradients sharded). ZeRO-2 keeps the gathered copy
for backward; ZeRO-3 (``regather``) frees it after forward and gathers it again in backward
(``runtime/regather.py``). For each config, one forked run, every rank:

* plans under a budget of half the replicated fp32 Adam state (the weights must be sharded) with
  ``zero=3`` (every sharded weight regathers), and with ``zero=2`` with the weights pinned where
  that plan stores them (ZeRO-2 does not fit the budget); the activations are pinned data
  parallel (on (2, 2): data x data for GPT, data x Megatron for LLaMA and ViT; LLaMA on (4,)
  solves fast without pins), which keeps the budgeted solve short;
* for both: loss and every gradient equal the single-device model's, the communication counted
  at run time equals the plan's estimate, measured saved tensors (``measure_memory``) equal the
  estimate within 5%, and the parameters after 3 AdamW steps equal the reference's;
* ZeRO-3: the estimated peak fits the budget; backward's counted all-gathers are the planned
  ones and hold every regathered weight edge's bytes; it saves fewer tensors than ZeRO-2.

Meshes (4,) and (2, 2) on GPT and ViT here, on HF LLaMA (RoPE, grouped-query attention) in
``tests/test_zero_llama.py`` (the same worker). The solver's own choice between the two is
checked in one process.
"""

import pytest
from parity_utils import build
from zero_utils import BUDGET, run_zero

CONFIGS = [  # HF LLaMA's (its captures take longest): tests/test_zero_llama.py
    {"model": "gpt", "mesh": [4], "kind": "dp"},
    {"model": "gpt", "mesh": [2, 2], "kind": "dp"},
    {"model": "vit", "mesh": [4], "kind": "dp"},
    {"model": "vit", "mesh": [2, 2], "kind": "dp_tp"},
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c['model']}-{'x'.join(map(str, c['mesh']))}")
def test_zero3_matches_one_device_and_saves_less_than_zero2(cfg):
    results = run_zero(cfg)
    assert results[0]["regathered"] > 0


def test_solver_regathers_only_when_the_budget_needs_it(fake_process_group):
    """On (4,), GPT: a free budget shards nothing; under 0.47 of the replicated state (weights
    must be sharded) ``zero="auto"`` regathers some weights, its estimated peak fits, and its step
    is faster than the plan ``zero=2`` finds under the same budget (regathering buys time there:
    auto may choose ZeRO-2 or ZeRO-3 per weight, so it is never slower). Half the replicated
    state is no longer the test's budget: with the gradient buckets priced and backward walked op
    by op (``passes/plan/bucket_memory.py``), a ZeRO-2 plan fits it."""
    import partitioner

    fake_process_group(4)
    model, inputs = build("gpt")
    n_params = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    free = partitioner.plan(model, inputs, mesh_shape=(4,), cluster="h100", recompute="none")
    assert not any(r.get("regather") for r in free.records)
    budget = int(0.47 * 16 * n_params)
    auto = partitioner.plan(model, inputs, mesh_shape=(4,), cluster="h100", recompute="none", memory_budget=budget)
    regathered = [r["fqn"] for r in auto.records if r.get("regather")]
    assert regathered
    assert auto.estimate().memory_bytes <= budget
    # the summary counts the weights by storage; explain shows each option's time and memory
    assert "ZeRO-3 (stored sharded, gathered for use, freed after forward" in auto.summary()
    chosen = [line for line in auto.explain(regathered[0]).splitlines() if line.lstrip().startswith("->")]
    assert len(chosen) == 1 and chosen[0].endswith("ZeRO-3"), chosen
    zero2 = partitioner.plan(model, inputs, mesh_shape=(4,), cluster="h100", recompute="none", memory_budget=budget,
                             zero=2)
    assert not any(r.get("regather") for r in zero2.records)
    assert auto.data["stats"]["objective_s"] <= zero2.data["stats"]["objective_s"] * (1 + 1e-9)


def test_zero_argument_is_checked(fake_process_group):
    import partitioner

    fake_process_group(4)
    model, inputs = build("gpt")
    with pytest.raises(ValueError, match="zero must be one of"):
        partitioner.plan(model, inputs, mesh_shape=(4,), cluster="h100", zero=4)
    with pytest.raises(ValueError, match="zero must be one of"):
        partitioner.plan(model, inputs, mesh_shape=(4,), cluster="h100", zero={"h.*": "three"})


def test_zero_per_weight_patterns(fake_process_group):
    """``zero={"h.*.mlp.*": 3, "*": 2}`` under 0.5 of the replicated state (under 0.55 the budget
    fitting now finds a plan that gathers none for use): the MLP weights that are gathered for use
    regather, no other weight does."""
    import partitioner
    from partitioner.plan_table import weight_storage

    fake_process_group(4)
    model, inputs = build("gpt")
    n_params = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    plan = partitioner.plan(model, inputs, mesh_shape=(4,), cluster="h100", recompute="none",
                            memory_budget=int(0.5 * 16 * n_params), zero={"h.*.mlp.*": 3, "*": 2})
    storage = weight_storage(plan)
    fqn = {r["name"]: r["fqn"] for r in plan.records if r["kind"] == "param"}
    zero3 = sorted(fqn[n] for n, kind in storage.items() if kind == "zero3")
    assert zero3 and all(".mlp." in name for name in zero3), zero3
    assert all(kind != "zero3" for n, kind in storage.items() if ".mlp." not in fqn[n])


def test_command_line_zero_option(tmp_path, capsys):
    """``partitioner plan --zero 3`` under half the replicated state: the saved plan regathers."""
    from partitioner import ShardingPlan
    from partitioner.__main__ import main

    model, _ = build("gpt")
    n_params = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    path = tmp_path / "plan.json"
    code = main(["plan", "partitioner.models:gpt_demo", "--kwargs", '{"batch": 8, "seq": 16, "n_layer": 2}',
                 "--mesh", "4", "--budget", str(int(BUDGET * 16 * n_params)), "--recompute", "none",
                 "--zero", "3", "--json", str(path), "--quiet"])
    assert code == 0, capsys.readouterr().err
    plan = ShardingPlan.load(str(path))
    assert plan.data["zero"] == 3
    assert any(r.get("regather") for r in plan.records)
