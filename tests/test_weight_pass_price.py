"""A zero-bubble ``W`` pass is priced at what the runtime's ``W`` pass runs.

The runtime (``runtime.pipeline.PipelineRunner._weight_pass``) calls ``autograd.backward`` once
per op that meets a parameter (``StageProgram.weight_meeting_points``): a contraction's weight
product, and the weight and bias gradients of every other such op (layer norms, an embedding),
and autograd adds each microbatch's gradients after the first into ``.grad``. Only the weight
products were priced as ``W``: the last stage of a 2-stage GPT ran its ``W`` at 1.35-1.78x its
price. Planned on a fixed cluster description (no timing), these check the prices themselves.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from partitioner.intra_op import plan_captured
from partitioner.local_cluster import get_cluster
from partitioner.models import gpt_demo
from passes.analysis.analyze import analyze, info
from passes.capture.capture import capture
from passes.plan.cost_model import dtype_bytes
from passes.rules import tensor_input_nodes
from passes.schedules import stage_durations

CLUSTER = dataclasses.replace(get_cluster("h100"), name="h100-with-op-cost", op_overhead_s=5e-6)
"""A fixed description with a cost per op (the presets have none), so the W pass's own calls show."""


def _planned(microbatches: int):
    model, inputs = gpt_demo(batch=2, seq=16, n_layer=1)
    cap = capture(model, inputs)
    analyze(cap)
    plan = plan_captured(
        cap,
        model_name="gpt",
        cluster=CLUSTER,
        recompute="none",
        zero1=False,
        microbatches=microbatches,
        holds_gradient_sums=microbatches > 1,
    )
    nodes = {n.name: n for n in cap.graph.nodes}
    return plan, {r["name"]: r for r in plan.to_dict()["records"]}, nodes


def _meets_parameter(node) -> bool:
    """What the runtime calls a meeting point: an op with a parameter input needing a gradient."""
    return any(info(a).kind == "param" and info(a).requires_grad for a in tensor_input_nodes(node))


def test_w_prices_every_op_the_runtime_calls_backward_on_for_weights():
    _, records, nodes = _planned(1)
    ops = {name: r for name, r in records.items() if r["kind"] == "op"}
    priced = {name for name, r in ops.items() if r.get("weight_grad_s")}
    meeting = {name for name in ops if _meets_parameter(nodes[name])}
    assert priced == meeting
    targets = {ops[name]["target"] for name in meeting}
    assert {"aten.linear", "aten.layer_norm", "aten.embedding"} <= targets, targets
    for name in meeting:
        r = ops[name]
        backward = r["compute_s"] - r["forward_s"]
        if r["target"] == "aten.linear":  # its weight product (the forward's FLOPs) and the call
            assert r["weight_grad_s"] == pytest.approx(min(r["forward_s"] + CLUSTER.op_overhead_s, backward))
        else:  # a norm's or an embedding's weight gradients: a pass of its backward
            assert r["weight_grad_s"] == pytest.approx(backward), name


def test_gradients_summed_over_microbatches_are_priced_in_backward_and_w():
    one, one_records, _ = _planned(1)
    four, four_records, nodes = _planned(4)
    params = [name for name, r in four_records.items() if r["kind"] == "param" and nodes[name].users]
    assert params and not any("grad_accumulate_s" in one_records[p] for p in params)
    total = 0.0
    for p in params:
        numel = torch.Size(four_records[p]["shapes"][0]).numel()
        add = 3 * numel * dtype_bytes(torch.float32) / CLUSTER.memory_bandwidth + CLUSTER.op_overhead_s
        assert four_records[p]["grad_accumulate_s"] == pytest.approx(add * 3 / 4)
        total += four_records[p]["grad_accumulate_s"]
    a, b = one.estimate(), four.estimate()
    assert b.weight_grad_s == pytest.approx(a.weight_grad_s + total)
    assert b.compute_s == pytest.approx(a.compute_s + total)
    forward, backward, weight = stage_durations([a, b], [True, True])
    assert forward[1] == pytest.approx(forward[0]) == pytest.approx(a.forward_s)  # accumulating is backward work
    assert backward[1] - backward[0] == pytest.approx(weight[1] - weight[0]) == pytest.approx(total)


def test_the_forward_is_what_the_plan_prices_for_it():
    plan, records, _ = _planned(1)
    est = plan.estimate()
    priced = sum(r.get("forward_s", 0.0) for r in records.values())
    priced += sum(c["time_s"] for r in records.values() for c in r.get("comm", []) if c["phase"] == "fwd")
    assert est.forward_s == pytest.approx(priced) and 0 < est.forward_s < est.step_time_s
    forward, backward, _ = stage_durations([est], [True])
    assert forward[0] == pytest.approx(est.forward_s)
    assert backward[0] == pytest.approx(est.step_time_s - est.optimizer_s - est.grad_sync_s - est.forward_s)
