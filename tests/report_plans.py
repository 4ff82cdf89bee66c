"""Plans the report tests share (made once per process): a held-out HuggingFace model and a
searched pipeline, all planned on meta-free small models with the fixed ``h100`` cluster."""

import functools


@functools.cache
def held_out_plans():
    """Qwen2 (RoPE, q/k/v biases; not a model Partita embeds), 2 layers, on a 2x2 mesh: the
    solver's plan and one with Megatron tensor parallelism and ZeRO-3 forced, to compare."""
    import partitioner
    from partitioner import hf_families

    model, inputs = hf_families.build("qwen2", batch=4, seq=8, n_layer=2)
    auto = partitioner.plan(model, inputs, mesh=(2, 2), cluster="h100")
    forced = partitioner.plan(model, inputs, mesh=(2, 2), cluster="h100", tensor_parallel="1d", zero=3)
    return auto, forced


SEARCHED_GPT = (4, 64, 4, 16, 32)  # meta_gpt's layers, width, heads, batch, sequence


@functools.cache
def searched_pipeline():
    """The demo GPT (4 layers, batch 16) searched for 8 H100s: a 2-stage pipeline wins (at batch 8
    the search now prefers data 2 x tensor 4)."""
    import partitioner
    from partitioner.demo_clusters import meta_gpt

    model, inputs = meta_gpt(*SEARCHED_GPT)
    plan = partitioner.plan(model, inputs, devices=8, cluster="h100")
    assert plan.stage_plans, f"the search no longer picks a pipeline here ({plan.config}); pick a model where it does"
    return plan
