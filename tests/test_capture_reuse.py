"""``partitioner.captures.keep_captures``: a capture is reused only for the same call.

Single process, the hand-written MLP (a capture of a fraction of a second): inside the block the
same model object, inputs and capture options get the capture made first (``plan`` after
``capture``, and the plan equals one made without reuse); another model object (even an
identical one), other input shapes, another mode or another precision capture afresh; outside
the block nothing is kept.
"""
import torch

import partitioner
from partitioner import models
from partitioner.captures import capture, keep_captures


def test_the_same_call_reuses_the_capture_and_plans_the_same():
    model, inputs = models.mlp_demo(batch=8)
    fresh = partitioner.plan(model, inputs, mesh=(2,), cluster="h100")
    with keep_captures():
        first = capture(model, inputs)
        assert capture(model, inputs) is first
        with keep_captures():  # nested: the outer block's captures stay
            assert capture(model, inputs) is first
        assert capture(model, inputs) is first
        reused = partitioner.plan(model, inputs, mesh=(2,), cluster="h100")
    assert reused.records == fresh.records and reused.fingerprint == fresh.fingerprint
    with keep_captures():  # a new block keeps nothing from the last one
        assert capture(model, inputs) is not first


def test_any_difference_captures_afresh():
    model, inputs = models.mlp_demo(batch=8)
    with keep_captures():
        first = capture(model, inputs)
        twin, twin_inputs = models.mlp_demo(batch=8)
        assert capture(twin, twin_inputs) is not first                   # another object
        assert capture(model, tuple(t[:4] for t in inputs)) is not first  # other input shapes
        model.eval()
        assert capture(model, inputs) is not first                       # another mode
        model.train()
        assert capture(model, inputs, precision="bf16") is not first     # another autocast dtype
        assert capture(model, inputs, layers="full") is not first        # other capture options
        with torch.no_grad():
            model.layers[0].weight.mul_(2.0)                             # values do not matter
        assert capture(model, inputs) is first
    assert capture(model, inputs) is not capture(model, inputs)          # outside: never kept


def test_a_pipelined_call_keeps_its_stage_capture_per_stage_count_and_microbatch():
    """``capture_pipeline`` captures what ``auto_parallelize(pipeline=...)`` does (one microbatch,
    cut into stages) and, inside the block, keeps it for the same stage count and microbatch."""
    from partitioner.pipeline_parallelize import capture_pipeline

    model, inputs = models.gpt_demo(batch=8, seq=8, n_layer=2)
    with keep_captures():
        first = capture_pipeline(model, inputs, {"degree": 2, "microbatches": 2})
        cap, graphs, runs = first
        assert len(graphs) == 2 and [len(r) for r in runs] == [1, 1]
        first_input = next(n for n in cap.graph.nodes if n.op == "placeholder" and n.name in cap.user_inputs)
        assert first_input.meta["val"].shape[0] == 4  # one of 2 microbatches
        assert capture_pipeline(model, inputs, {"degree": 2, "microbatches": 2}) is first
        assert capture_pipeline(model, inputs, {"degree": 2, "microbatches": 4}) is not first  # other microbatch
        assert capture_pipeline(model, inputs, {"degree": 1, "microbatches": 2}) is not first  # other stages
        assert capture(model, inputs) is not first[0]  # the whole batch: a capture of its own
    assert capture_pipeline(model, inputs, {"degree": 2, "microbatches": 2}) is not first
