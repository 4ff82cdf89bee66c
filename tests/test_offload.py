"""Optimizer state offloaded to host memory (and its step), chosen under a device budget.

An offloaded weight keeps its parameter (or its ZeRO-1 shard), that tensor's gradient and the
optimizer state in host memory: ``ParallelModule`` holds it on the CPU, so the user's
``torch.optim`` optimizer creates its state there and steps it there; the device computes with a
copy, refreshed once per step, and its gradient is reduced once per step and copied to the host
(``runtime/optimizer_shards.py``). On this CPU-only machine host and device are one memory:
these tests check the mechanism (which weights are offloaded, where the optimizer's tensors and
state live, that the step the optimizer takes is what the device computes with next), not speed.

* Planning (GPT on (4,), data parallel, ``zero=2``: weights replicated or stored sharded): a
  device budget below the replicated plan's makes the solver offload some weights; the
  estimate counts their bytes on the host and prices the copies over the host link; a host
  budget too small is an error naming ``host_memory_budget``; without one, nothing is offloaded.
* Parity on 4 gloo ranks, one forked run, for GPT, HF LLaMA and ViT each: that plan (weights
  pinned replicated, data parallel on (4,)), and ``zero=1`` on (2, 2) (data x Megatron) under a
  budget 0.9 of the free plan's optimizer state short (the offloaded tensors are ZeRO-1 shards):
  loss, every gradient, parameters after 3 AdamW steps equal the single-device model's; counted
  communication equals the estimate.
"""

import copy

import pytest
import torch
from parity_utils import (
    MODELS,
    Checks,
    build,
    check_step_like_one_device,
    free_weights,
    pins_for,
    prebuilt,
    run_checked,
    train_like_one_device,
)

from runtime.collectives import on_rank0

TIMEOUT_S = 240
STEPS = 3
SHORT = 0.3  # of the free plan's optimizer state: the device budget is that much below its peak


def _budgets(model, inputs, mesh, kind, zero, short=SHORT, name="gpt"):
    """Plan arguments and a device budget ``short`` of the free plan's optimizer state below its
    peak. ``zero=2``: the weights pinned replicated (a pin names where a weight is stored: it may
    be offloaded, not sharded); ``zero=1``: only the activations pinned (ZeRO-1 shards)."""
    import partitioner

    pins = pins_for(name, kind, mesh) if zero == 2 else free_weights(name, kind, mesh)
    kw = dict(mesh_shape=mesh, cluster="h100", recompute="none", pins=pins, zero=zero)
    free = partitioner.plan(model, inputs, **kw).estimate()
    return kw, int(free.memory_bytes - short * free.memory.optimizer_state)


def test_solver_offloads_when_the_device_budget_needs_it(fake_process_group):
    import partitioner
    from passes.plan.plan_intra_op import InfeasibleBudgetError

    fake_process_group(4)
    model, inputs = build("gpt")
    kw, budget = _budgets(model, inputs, (4,), "dp", 2)
    with pytest.raises(InfeasibleBudgetError, match="no plan fits"):
        partitioner.plan(model, inputs, memory_budget=budget, **kw)
    plan = partitioner.plan(model, inputs, memory_budget=budget, host_memory_budget="64MiB", **kw)
    offloaded = [r for r in plan.records if r.get("offload")]
    assert offloaded and plan.estimate().memory_bytes <= budget
    est = plan.estimate()
    host = sum(16 * torch.Size(r["shapes"][0]).numel() for r in offloaded)  # parameter, gradient, Adam
    assert est.memory.offloaded == host
    assert "offloaded bytes on host" in str(est)
    transfers = sum(r["host_transfer_s"] for r in offloaded)
    link = partitioner.get_cluster("h100").host_link
    assert transfers == pytest.approx(sum(2 * (link.latency_s + 4 * torch.Size(r["shapes"][0]).numel() / link.bandwidth)
                                          for r in offloaded))
    steps = sum(r.get("optimizer_step_s", 0.0) for r in plan.records)  # offloaded: at the host's bandwidth
    assert est.step_time_s == pytest.approx(sum(r.get("compute_s", 0.0) for r in plan.records) + transfers
                                            + sum(c["time_s"] for r in plan.records for c in r["comm"]) + steps
                                            + est.flat_latency_s)
    chosen = [line for line in plan.explain(offloaded[0]["fqn"]).splitlines() if line.lstrip().startswith("->")]
    assert chosen[0].endswith("offloaded"), chosen
    with pytest.raises(InfeasibleBudgetError, match="host_memory_budget=1000 bytes is too small"):
        partitioner.plan(model, inputs, memory_budget=budget, host_memory_budget=1000, **kw)


CONFIGS = [
    (name, config) for name in ("gpt", "llama", "vit") for config in (((4,), "dp", 2, SHORT), ((2, 2), "dp_tp", 1, 0.9))
]
"""(model, (mesh, pins kind, ZeRO stage, budget shortfall))."""


def offload_worker(rank, world, cfg):
    checks = Checks(rank)
    found = {}
    # replicated weights offloaded on (4,); ZeRO-1 shards offloaded on (2, 2) (with ZeRO-2 and -3
    # at hand, a shorter budget: on (4,) sharding the weights is cheaper than offloading them)
    for name, (mesh, kind, zero, short) in CONFIGS:
        found.update(_offloaded_parity(name, mesh, kind, zero, short, checks))
    return {"rank": rank, "failures": checks.failures, "offloaded": found}


def _offloaded_parity(name, mesh, kind, zero, short, checks):
    """One config: offloaded weights are the plan's and live on the host; loss, every gradient,
    counted communication and the parameters after 3 AdamW steps as on one device."""
    import partitioner

    label = f"{name} {mesh} zero={zero}"
    model, inputs = prebuilt(label) or build(name)  # the parent's, captured there
    ref = copy.deepcopy(model)
    # the free plan that sets the budget is the same on every rank: rank 0 makes it
    kw, budget = on_rank0(lambda: _budgets(model, inputs, mesh, kind, zero, short, name), "the offload budget")
    pm = partitioner.auto_parallelize(model, inputs, mesh=mesh, cluster="h100", recompute="none", zero=zero,
                                      pins=kw["pins"], memory_budget=budget, host_memory_budget="64MiB")
    host = pm.offloaded()
    records = {r["fqn"]: r for r in pm.plan.records if r["kind"] == "param"}
    checks.true(f"{label}: offloaded {host} are not the plan's",
                bool(host) and set(host) == {f for f, r in records.items() if r.get("offload")})
    check_step_like_one_device(pm, ref, inputs, checks, label)
    # the compute copies are not what the optimizer steps; the offloaded tensors are
    copies = {id(c) for c in pm.compute_copies()}
    params = dict(pm.named_parameters())
    checks.true(f"{label}: a compute copy is a parameter", not copies & {id(p) for p in params.values()})
    # the optimizer's tensors for offloaded weights are in host memory (pinned when there is a GPU)
    checks.true(f"{label}: an offloaded parameter is not in host memory",
                all(params[f].device.type == "cpu" and params[f].is_pinned() == torch.cuda.is_available()
                    for f in host))
    train_like_one_device(pm, ref, inputs, STEPS, checks, label)
    return {label: len(host)}


def test_offloaded_training_matches_one_device():
    # each config's model built and captured before the ranks fork
    prebuild = [(f"{name} {mesh} zero={zero}", MODELS[name]["factory"]) for name, (mesh, _, zero, _) in CONFIGS]
    results = run_checked(offload_worker, {"mesh": [4]}, TIMEOUT_S, prebuild=prebuild)
    assert all(n > 0 for n in results[0]["offloaded"].values()), results[0]["offloaded"]
