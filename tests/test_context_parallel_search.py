"""Context parallelism in the configuration search (partitioner/search/enumerate.py): a sequence
axis ``sp`` combined with the tensor and pipeline axes for long sequences, planning only (the
``h100`` preset, a GPT on ``meta``). The 4-rank parity of a searched ``sp x tp`` plan is in
``tests/test_config_search.py`` (the long sequence on one sample)."""

import partitioner
from partitioner import models
from partitioner.parallel_config import ParallelConfig
from partitioner.search import enumerate_configs
from partitioner.search.enumerate import CONTEXT_COMBINED_MAX

MIB = 2**20


def test_sequence_degrees_combine_with_pipeline_and_tensor_axes_for_long_sequences_only():
    # 64 tokens per sample of the global batch or more: s x t and p x s x t, ring beside tp
    combined = [c for c in enumerate_configs(8, 2, 4, 8, seq_len=4096) if c.sequence > 1 and c.data * c.sequence < 8]
    assert {(c.pipeline, c.sequence, c.tensor) for c in combined} >= {(1, 2, 4), (1, 4, 2), (2, 2, 2), (2, 4, 1)}
    assert all(c.sequence_parallel == "ring" for c in combined if c.tensor > 1)
    assert {c.sequence_parallel for c in combined if c.tensor == 1} == {"ring", "ulysses"}
    assert max(c.sequence for c in combined) <= CONTEXT_COMBINED_MAX
    # a short sequence on fewer samples than devices gets the pure data x sequence split only
    short = [c for c in enumerate_configs(8, 4, 4, 8, seq_len=128) if c.sequence > 1]
    assert short and all(c.pipeline == c.tensor == 1 for c in short)


def _search(batch, budget_mib):
    model, inputs = models.gpt_block(batch=batch, seq=4096, n_embd=512, n_head=16, n_layer=4, vocab=512)
    return partitioner.plan(model, inputs, devices=8, cluster="h100", memory_budget=int(budget_mib * MIB))


def test_one_long_sample_is_split_over_sequence_and_heads():
    # batch 1 on 8 devices: no data, pipeline or tensor-only configuration exists; the search splits
    # the 4,096 tokens 4 ways (ring on sp) and the heads 2 ways (tp), faster than the 8-way split
    plan = _search(1, 4000)
    config = plan.config
    assert (config.pipeline, config.data, config.sequence, config.tensor) == (1, 1, 4, 2)
    assert config.sequence_parallel == "ring" and plan.axis_names == ("sp", "tp")
    attention = [r for r in plan.records if "scaled_dot_product_attention" in r["name"]]
    assert attention and all(r["notes"] == {"sp": "ring"} and r["out"][0] == "[S(2), S(1)]" for r in attention)
    planned = [r for r in plan.data["search"]["rows"] if r["status"] == "planned"]
    eight = [r for r in planned if ParallelConfig.from_dict(r["config"]).sequence == 8]
    assert eight and all(r["step_time_s"] > plan.estimate().step_time_s for r in eight)


def test_the_search_splits_the_sequence_beside_pipeline_and_tensor_axes_where_memory_binds():
    # 4 samples of 4,096 tokens on 8 devices: with room, data x tensor; under a budget that the
    # activations of that plan overflow, the sequence is split too (ring on sp), beside a pipeline
    # or a tensor axis
    loose = _search(4, 4000)
    assert loose.config.sequence == 1
    tight_budget = 300
    assert loose.estimate().memory_bytes > tight_budget * MIB
    tight = _search(4, tight_budget)
    config = tight.config
    assert config.sequence > 1 and config.pipeline * config.tensor > 1, config.describe()
    assert tight.estimate().memory_bytes <= tight_budget * MIB
    plans = tight.stage_plans or [tight]
    attention = [r for p in plans for r in p.records if "scaled_dot_product_attention" in r["name"]]
    assert attention and all(r["notes"] == {"sp": config.sequence_parallel} for r in attention)
