"""Collective calls counted at run time equal the calls the estimate prices (``Estimate.comm_calls``).

A collective's latency is paid per call, so the estimate counts the calls the runtime makes
(:mod:`passes.plan.collective_calls`): one per unbucketed entry of the plan, one per flat buffer of
bucketed gradients (``runtime/grad_sync.py``) and of compute copies' reductions and refresh
gathers (``runtime/optimizer_shards.py``). Unlike a time, a count can be compared exactly.

GPT (2 layers, width 64) on 4 gloo ranks, plans made here with the fixed ``"cpu"`` cluster, the
memory benchmark's kinds (``benchmarks/memory.py``): data parallel; the solver's plan under a
budget below data parallelism's peak (weights stored sharded and gathered, gathers prefetched);
ZeRO-3 under that budget; full recomputation; both under a tighter budget (the final norm's
weight and bias regathered in backward); ZeRO-1 (compute copies); the head tied to the
embedding (captured as two parameter placeholders, each bucketed). The bucket sizes are made
small (``passes.core.bucket_sizes.BUCKET_BYTES`` and ``REFRESH_BUCKET_BYTES``, read by the
runtime and the count alike) so that the gradients and the copies' gathers take several
buffers. One forked run; per plan, every rank: a step compared with the single-device model
(loss, gradients, counted bytes = estimate), then a second AdamW step whose calls per phase,
kind and axis and bytes per phase equal the estimate's.
"""

import copy

import pytest
from parity_utils import Checks, check_step_like_one_device, free_weights, nested_approx_equal, prebuilt, run_checked

from partitioner import models

DP = {"idx": ["S(0)"], "targets": ["S(0)"], "*": ["R"], "h.*": ["S(0)"], "ln_f": ["S(0)"], "lm_head": ["S(0)"]}
SMALL_BUCKET, SMALL_REFRESH = 40_000, 30_000


def _model(tied=False):
    model, batch = models.gpt_demo(batch=8, seq=16, n_layer=2, n_embd=64, n_head=4, vocab_size=128)
    if tied:
        model.lm_head.weight = model.wte.weight
    return model, batch


def calls_worker(rank, world, cfg):
    import torch

    import partitioner
    from partitioner.sharding_plan import ShardingPlan
    from passes.core import bucket_sizes
    from runtime.collectives import CommCounter

    bucket_sizes.BUCKET_BYTES = SMALL_BUCKET
    bucket_sizes.REFRESH_BUCKET_BYTES = SMALL_REFRESH
    checks = Checks(rank)
    for name, tied, plan_dict in cfg["plans"]:
        model, batch = prebuilt(name) or _model(tied)  # the model the parent planned, its capture kept
        ref = copy.deepcopy(model)
        pm = partitioner.auto_parallelize(model, batch, mesh=(world,), plan=ShardingPlan.from_dict(plan_dict))
        check_step_like_one_device(pm, ref, batch, checks, name)
        est = pm.plan.estimate()
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        opt.step()
        with CommCounter() as counter:
            opt.zero_grad(set_to_none=True)
            pm(*batch).backward()
            opt.step()
        counted = counter.calls_phase_dict()
        checks.true(f"{name}: calls counted {counted}, estimated {est.comm_calls_by_phase}",
                    counted == est.comm_calls_by_phase)
        checks.true(f"{name}: calls {counter.calls_dict()} against {est.comm_calls}",
                    counter.calls_dict() == est.comm_calls)
        if name == "data parallel":  # the small buckets: the gradients take several flat all-reduces
            bwd = est.comm_calls_by_phase["bwd"]
            flat = sum(n for kind in ("all_reduce", "reduce_scatter") for n in bwd.get(kind, {}).values())
            checks.true(f"{name}: {bwd} in backward, not several buckets", flat >= 4)
        counted_bytes = counter.phase_dict()
        for phase in set(est.comm_bytes_by_phase) | set(counted_bytes):
            for diff in nested_approx_equal(counted_bytes.get(phase, {}), est.comm_bytes_by_phase.get(phase, {})):
                checks.true(f"{name} {phase}: {diff}", False)
    return {"failures": checks.failures}


def _plans():
    import partitioner

    def plan(budget=None, tied=False, **kw):
        model, batch = _model(tied)
        planned = partitioner.plan(model, batch, mesh_shape=(4,), cluster="cpu", memory_budget=budget, **kw)
        planned_on[id(planned)] = (model, batch)
        return planned

    planned_on = {}

    dp = plan(pins=DP, recompute="none", zero="auto")
    free = plan()
    below = int(0.85 * min(dp.estimate().memory_bytes, free.estimate().memory_bytes))
    below_dp = plan(below)
    plans = [
        ("data parallel", False, dp),
        ("below data parallelism's peak", False, below_dp),
        ("ZeRO-3", False, plan(below, zero=3, recompute="none")),
        ("full recomputation", False, plan(pins=DP, recompute="all")),
        # the final norm stored sharded (regathered outside the recomputed layers); the budget leaves room
        # for the next layer's weights that a recomputed layer's gathers start ahead (prefetch_gathers)
        ("ZeRO-3 and full recomputation", False, plan(int(0.8 * dp.estimate().memory_bytes), zero=3, recompute="all",
                                                      pins={"ln_f.weight": ["S(0)"], "ln_f.bias": ["S(0)"]})),
        ("ZeRO-1", False, plan(pins=free_weights("gpt", "dp", (4,)), recompute="none", zero=1)),
        ("tied weight, data parallel", True, plan(tied=True, pins=DP, recompute="none", zero="auto")),
    ]
    return [(name, tied, p, planned_on[id(p)]) for name, tied, p in plans]


def test_counted_calls_equal_estimated_calls():
    from partitioner.captures import keep_captures

    with keep_captures():  # each plan's capture kept, for its ranks to reuse with the model planned on
        plans = _plans()
        _check_plans({name: p for name, _, p, _ in plans})
        prebuild = [(name, lambda built=built: built) for name, _, _, built in plans]
        cfg = {"mesh": [4], "plans": [(n, t, p.to_dict()) for n, t, p, _ in plans]}
        run_checked(calls_worker, cfg, 120, prebuild=prebuild)


def _check_plans(by_name: dict) -> None:
    # what the plans must exercise: flat buffers, per-edge tied reductions, prefetched gathers, reruns
    assert any(c.get("bucketed") for r in by_name["data parallel"].records for c in r["comm"])
    assert any(r.get("stored") for r in by_name["ZeRO-1"].records)
    assert any(c.get("regather") for r in by_name["ZeRO-3"].records for c in r["comm"])
    assert any(c.get("recompute") for r in by_name["full recomputation"].records for c in r["comm"])
    # a norm's weight and bias regathered outside the recomputed layers: one op saving two copies
    # (backward unpacks them in forward's order: neither is started ahead twice)
    norm = [r for r in by_name["ZeRO-3 and full recomputation"].records if r["target"] == "aten.layer_norm"]
    assert any(sum(1 for c in r["comm"] if c.get("regather")) == 2 for r in norm)


def test_flat_buffers_pay_their_latency_once():
    """Known answer, one process: each kind of bucketed gradient reduction is one flat call (the
    default bucket holds this whole model), whose latency terms the estimate adds once, beside
    one call per unbucketed entry."""
    import partitioner
    from passes.plan.cost_model import _STEPS

    cluster = partitioner.get_cluster("cpu")

    def fixed(kind):
        return cluster.collective_overhead_s + _STEPS[kind](4) * cluster.link_for_axis((4,), 0).latency_s

    model, batch = _model()
    plan = partitioner.plan(model, batch, mesh_shape=(4,), cluster="cpu", pins=DP, recompute="none")
    entries = [c for r in plan.records for c in r["comm"]]
    bucketed = {c["kind"] for c in entries if c.get("bucketed")}
    assert len([c for c in entries if c.get("bucketed")]) > 2 * len(bucketed)  # many gradients, few buffers
    est = plan.estimate()
    for phase, kinds in est.comm_calls_by_phase.items():
        for kind, calls in kinds.items():
            alone = sum(1 for c in entries if c["kind"] == kind and c["phase"] == phase and not c.get("bucketed"))
            flat = any(c.get("bucketed") and c["kind"] == kind and c["phase"] == phase for c in entries)
            assert calls == {"a0": alone + flat}, (phase, kind)
    assert est.flat_latency_s == pytest.approx(sum(map(fixed, bucketed)), rel=1e-12)
