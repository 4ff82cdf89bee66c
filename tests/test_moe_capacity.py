"""Mixture of experts with an expert capacity (``expert_capacity=``): token dropping.

* one process: the keep mask drops, per expert, the pairs beyond ``ceil(f T k / E)`` in GShard's
  order (first choices first, tokens in order), a known answer; the op with dropped pairs equals
  the op with those pairs' weights zeroed (output and the gradients of the tokens and experts);
  the option is validated, refused in the configuration search and on an experts module the op
  does not cover (naming it); the plan prices the compute and the all-to-all at the pairs kept
  and the summary says how many were kept;
* 4 gloo ranks, Mixtral with ``expert_parallel="on"``, tokens and experts split on the one axis
  (all-to-all) and ``expert_capacity=1.0`` (about 11% of the pairs dropped on this batch): the
  loss, the router's auxiliary loss, every gradient and the parameters after 2 AdamW steps equal
  one device's under :func:`partitioner.token_dropping` with the same factor; the bytes each
  rank's all-to-alls send equal the formula over the pairs kept, their mean the plan's estimate,
  and every other collective its estimate. In the same ranks, experts stored ZeRO-3 (gathered for
  use, freed after forward) are gathered again once per weight in backward, as priced.
"""

import copy
import json
import math

import pytest
import torch
from moe_utils import (
    adam_steps_like_one_device,
    built_before_forking,
    first_step_like_one_device,
    parallel_beside_one_device,
)
from moe_utils import build as _build
from moe_utils import dispatch_pins as _dispatch_pins
from moe_utils import routing as _routing
from parity_utils import Checks, nested_approx_equal, run_checked

import partitioner
from runtime.expert_dispatch import drop_over_capacity, experts_forward

TIMEOUT_S = 240
STEPS = 2
FACTOR = 1.0


def test_keep_mask_drops_beyond_capacity_first_choices_first():
    # 5 tokens, top-2 of 3 experts: capacity ceil(0.5 * 5 * 2 / 3) = 2 pairs per expert
    index = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0], [2, 1]])
    # first choices in token order: expert 0 keeps tokens 0, 1 (token 2's dropped), expert 1
    # token 3, expert 2 token 4; then second choices: expert 1 keeps token 0 (its 2nd) and drops
    # tokens 2 and 4, expert 2 keeps token 1 (its 2nd), expert 0 (full) drops token 3
    want = torch.tensor([[0, 1], [0, 2], [3, 3], [1, 3], [2, 3]])
    assert torch.equal(drop_over_capacity(index, 3, 0.5), want)
    assert torch.equal(drop_over_capacity(index, 3, 10.0), index)  # room for all: nothing dropped


def test_dropped_pairs_contribute_nothing():
    g = torch.Generator().manual_seed(2)
    experts, hidden, inner, tokens, k = 4, 8, 6, 12, 2
    # float64: the two calls sum an expert's rows in different groupings, and float32's rounding
    # of that (a few 1e-5 on some machines' kernels) is not what is checked
    f64 = dict(dtype=torch.float64, generator=g)
    x = torch.randn(tokens, hidden, **f64, requires_grad=True)
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, **f64)
    gate_up = torch.randn(experts, 2 * inner, hidden, **f64, requires_grad=True)
    down = torch.randn(experts, hidden, inner, **f64, requires_grad=True)
    dropped = drop_over_capacity(index, experts, 0.5)
    assert 0 < int((dropped == experts).sum()) < tokens * k
    ours = experts_forward(x, dropped, weights, gate_up, down, "silu")
    kept = weights * (dropped != experts)
    want = experts_forward(x, index, kept, gate_up, down, "silu")
    torch.testing.assert_close(ours, want)
    grads = torch.autograd.grad(ours.square().sum(), [x, gate_up, down])
    for a, b in zip(grads, torch.autograd.grad(want.square().sum(), [x, gate_up, down])):
        torch.testing.assert_close(a, b)


def test_expert_capacity_is_validated_priced_and_refused_where_it_cannot_be_honoured():
    model, inputs = _build("mixtral")
    for bad in (0, -1.0, True, "1.25"):
        with pytest.raises(ValueError, match="expert_capacity must be a positive number"):
            partitioner.plan(model, inputs, mesh=(2,), cluster="h100", expert_capacity=bad)
    with pytest.raises(ValueError, match=r"expert_capacity=1.0 is not available in the configuration search"):
        partitioner.plan(model, inputs, devices=2, cluster="h100", expert_capacity=1.0)
    variant = copy.deepcopy(model)
    variant.model.layers[0].mlp.experts.act_fn = torch.nn.Tanh()
    with pytest.raises(ValueError, match=r"experts module model.layers.0.mlp.experts is not one the experts op covers"):
        partitioner.plan(variant, inputs, mesh=(2,), cluster="h100", expert_capacity=1.0)
    pins = _dispatch_pins(1)
    plans = {
        f: partitioner.plan(
            model, inputs, mesh=(4,), cluster="h100", expert_parallel="on", pins=pins, expert_capacity=f
        )
        for f in (None, 0.75)
    }
    routed = [loads for loads in plans[None].data["routing"].values()]
    capacity = [math.ceil(0.75 * sum(loads) / len(loads)) for loads in routed]  # ceil(f T k / E)
    kept = sum(min(load, c) for loads, c in zip(routed, capacity) for load in loads)
    hidden = model.config.hidden_size
    a2a = {f: p.estimate().comm_bytes["all_to_all"]["a0"] for f, p in plans.items()}
    counts = len(routed) * 8 * 4  # E int64 counts per layer
    assert a2a[None] == 4 * sum(map(sum, routed)) * hidden * 4 / 4 + counts
    assert a2a[0.75] == 4 * kept * hidden * 4 / 4 + counts  # 4 all-to-alls of the kept rows, fp32, over 4 ranks
    saved = partitioner.ShardingPlan.from_dict(json.loads(plans[0.75].to_json()))
    assert saved.data["expert_capacity"] == 0.75  # a replay captures with the plan's own capacity
    line = next(x for x in plans[0.75].summary(wide=True).splitlines() if "capacity factor" in x)
    assert f"{kept} of {sum(map(sum, routed))} routed pairs kept" in line, line


def _kept_index(ref, inputs, factor):
    """Each MoE layer's top-k index after dropping, one device under the same dropping."""
    with partitioner.token_dropping(ref, factor):
        return [drop_over_capacity(index, ref.config.num_local_experts, factor) for index in _routing(ref, inputs)]


def _kept_bytes(kept, rank, world, hidden, experts) -> tuple:
    """(this rank's all-to-all bytes, the mean over the ranks) with tokens and experts split on
    one axis of ``world``: it sends its kept pairs' rows and receives its experts' (twice each)."""
    mine = mean = 0.0
    held = experts // world
    for index in kept:
        local = index.shape[0] // world
        pairs = index[rank * local : (rank + 1) * local]
        sent = int((pairs != experts).sum())
        received = int(((index >= rank * held) & (index < (rank + 1) * held)).sum())
        mine += 4 * (2 * sent * hidden + 2 * received * hidden) + 8 * experts
        mean += 4 * 4 * int((index != experts).sum()) * hidden / world + 8 * experts
    return mine, mean


def capacity_worker(rank, world, cfg):
    checks = Checks(rank)
    model, inputs = _build("mixtral")
    pm, ref = parallel_beside_one_device(
        model,
        inputs,
        mesh=(world,),
        expert_parallel="on",
        expert_capacity=FACTOR,
        pins=dict(_dispatch_pins(1), histc=["P"]),
        recompute="none",
    )
    experts, hidden = ref.config.num_local_experts, ref.config.hidden_size
    kept = _kept_index(copy.deepcopy(ref), inputs, FACTOR)
    with partitioner.token_dropping(ref, FACTOR):
        counted = first_step_like_one_device(pm, ref, inputs, checks)
        adam_steps_like_one_device(pm, ref, inputs, STEPS, checks)
    estimated = pm.plan.estimate().comm_bytes
    mine, mean = _kept_bytes(kept, rank, world, hidden, experts)
    checks.true(
        f"all_to_all: counted {counted['all_to_all']['a0']}, formula {mine}", counted["all_to_all"]["a0"] == mine
    )
    checks.true(
        f"estimated {estimated['all_to_all']['a0']}, formula mean {mean}", estimated["all_to_all"]["a0"] == mean
    )
    rest = {k: v for k, v in counted.items() if k != "all_to_all"}
    for diff in nested_approx_equal(rest, {k: v for k, v in estimated.items() if k != "all_to_all"}):
        checks.true(f"communication: {diff}", False)
    _check_zero3_experts(world, checks)
    dropped = sum(int((index == experts).sum()) for index in kept)
    return {"rank": rank, "failures": checks.failures, "dropped": dropped, "summary": pm.plan.summary(wide=True)}


def _check_zero3_experts(world, checks):
    """Experts replicated for compute, stored ZeRO-3 (sharded, gathered for use, freed after
    forward): backward gathers each expert weight again once, as the plan prices, not once per
    expert (the op saves each stacked weight whole); loss and gradients as one device's."""
    model, inputs = _build("mixtral", key="mixtral/zero3")
    stored = {"model.layers.*.mlp.experts.gate_up_proj": ["S(0)"], "model.layers.*.mlp.experts.down_proj": ["S(0)"]}
    pm, ref = parallel_beside_one_device(
        model, inputs, mesh=(world,), expert_parallel="off", zero=3, pins=stored, recompute="none"
    )
    counted = first_step_like_one_device(pm, ref, inputs, checks)
    for diff in nested_approx_equal(counted, pm.plan.estimate().comm_bytes):
        checks.true(f"ZeRO-3 experts: communication: {diff}", False)


def test_expert_capacity_on_4_ranks_matches_one_device_with_the_same_dropping():
    prebuild = [
        built_before_forking("mixtral", expert_capacity=FACTOR),  # the two models the worker plans
        built_before_forking("mixtral", "mixtral/zero3"),
    ]
    results = run_checked(capacity_worker, {"mesh": (4,)}, TIMEOUT_S, prebuild=prebuild)
    assert results[0]["dropped"] > 0, "the batch must overflow some expert for the test to mean anything"
    summary = results[0]["summary"]
    assert "split over mesh axis a0 (4 ranks) in 2 MoE layer(s), tokens dispatched" in summary
    assert "tokens over capacity factor 1 dropped" in summary
