"""MoE routing is measured where a plan is made, once, and nowhere else.

Measuring a model's routing (``passes.analysis.expert_routing.measure_routing``) runs the whole
model forward on the example batch. A plan prices expert parallelism by it; lowering a plan and
serving it at another input shape read none of it (``partitioner/captures.py``). One process
(rank 0 of 1 on torch's fake backend), the tiny HF Mixtral:

* ``auto_parallelize`` measures the routing once, for its plan (which records it);
* the parallel model serves another batch size without running the model forward again (the
  ``Specializer`` captures the new shape without measuring), with the loss one device computes;
* a capture made without routing gets it, once, when a plan is made from it.
"""

import copy
import warnings

import torch
from parity_utils import call, loss_of

import partitioner
from partitioner import hf_families
from partitioner.captures import captured, keep_captures, with_routing
from passes.analysis.expert_routing import routing_of


def _counting_forwards(model) -> list:
    """A list that grows by one per forward of ``model`` on real tensors (not export's tracing)."""
    seen: list = []

    def hook(_module, args):
        if type(args[0]) is torch.Tensor:
            seen.append(args[0].shape)

    for module in model.modules():
        if hasattr(module, "gate_up_proj"):  # each MoE layer's experts
            module.register_forward_pre_hook(hook)
            break
    return seen


def test_routing_is_measured_for_the_plan_and_not_to_serve_another_batch(fake_process_group):
    fake_process_group(1)
    model, inputs = hf_families.build("mixtral", batch=4, seq=8)
    ref = copy.deepcopy(model)
    forwards = _counting_forwards(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = partitioner.auto_parallelize(model, inputs, mesh=(1,), cluster="h100")
    assert len(forwards) == 1, forwards  # the plan's routing, measured once
    assert pm.plan.data.get("routing"), "the plan records no routing"
    _, other = hf_families.build("mixtral", batch=2, seq=8)
    loss = loss_of(call(pm, other))
    assert len(forwards) == 1, forwards  # batch 2 captured and served, the model not run
    torch.testing.assert_close(loss, loss_of(call(ref, other)))


def test_a_capture_made_without_routing_gets_it_once_when_planned():
    model, inputs = hf_families.build("mixtral", batch=4, seq=8)
    forwards = _counting_forwards(model)
    options = dict(layers="auto", autocast_dtype=None, sequence_parallel="auto")
    with keep_captures():
        cap = captured(model, inputs, routing=False, **options)
        assert not routing_of(cap.graph) and not forwards
        assert captured(model, inputs, **options) is cap  # reused, measured now
        measured = routing_of(cap.graph)
        assert measured and len(forwards) == 1
        assert with_routing(model, inputs, cap) is cap and len(forwards) == 1  # not again
        plan = partitioner.plan(model, inputs, mesh=(2,), cluster="h100")
    assert len(forwards) == 1 and plan.data["routing"] == measured
