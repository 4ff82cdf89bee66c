"""Stage plans in the configuration search (partitioner/search/): the middle stage class
is planned first and the first stage then sends what it takes, but never by pinning a value made
inside a repeated layer (its layers share one decision: the pin would place every layer's output,
and under recomputation every layer's checkpoint, as the middle stage's input). Planning only."""

from partitioner import models
from partitioner.local_cluster import get_cluster
from partitioner.options import PlanOptions
from partitioner.parallel_config import ParallelConfig
from partitioner.search import plan_config
from partitioner.search.pipeline_candidate import first_stage_pins
from partitioner.search.planner import Planner
from passes.capture.blocks import find_blocks


def test_the_first_stage_sends_its_own_layers_output_and_recomputation_needs_no_more_memory():
    model, inputs = models.gpt_demo(batch=8, seq=16, n_layer=6)
    options = PlanOptions.build(None, cluster="h100", precision="bf16")
    planner = Planner(
        model, inputs, 8, spec=get_cluster("h100"), budget=None, precision=options.precision_policy, options=options
    )
    _, graphs = planner.class_split(2, (2, 2, 2))
    first, middle = graphs[0], graphs[1]
    middle_plan = planner.plan_graph(middle.captured, "middle", (2,), ("dp",), copies=3, recompute="all")
    returned = first.captured.graph.find_nodes(op="output")[0].args[0]
    sent = dict(zip(first.outputs, returned if isinstance(returned, (list, tuple)) else [returned]))
    taken = {r["name"] for r in middle_plan.records if r["name"] in middle.activation_inputs}
    assert taken & set(sent), "the middle stage takes a value the first stage returns"
    blocks = find_blocks(first.captured.graph)
    pins = first_stage_pins(first, middle, middle_plan, 1)
    made_in_layers = {sent[name].name for name in taken if sent[name] in blocks.block_of}
    assert made_in_layers, "the first stage's last layer makes the value it sends"
    assert not made_in_layers & set(pins)

    config = ParallelConfig(pipeline=3, data=2, microbatches=4, schedule="1f1b", recompute="all")
    plan = plan_config(model, inputs, config, cluster="h100", precision="bf16")
    for stage in plan.stage_plans:
        stats = stage.data["stats"]
        assert stats["least_memory"] <= stats["least_memory_without_recompute"]
