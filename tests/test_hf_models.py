"""Planning HuggingFace models (GPT-2 sdpa/eager, BERT, LLaMA, ViT) built from small configs.

Each model is planned once per mesh (``(2, 2)`` and ``(4,)``) and the plans are shared by the
tests below: planning succeeds, no core op (linear, attention, norm, embedding) falls back to
replicate, a budget below the replicated parameter state shards every block's linear weights,
and a large batch under a loose budget gives pure data parallelism.
"""
from __future__ import annotations

import functools
import math
import re

import pytest
from support import fallback_warnings, is_replicated

import partitioner
from partitioner import models
from passes.plan.cost_model import param_state_bytes

MODELS = {
    "gpt2_sdpa": lambda **kw: models.hf_gpt2(attn="sdpa", **kw),
    "gpt2_eager": lambda **kw: models.hf_gpt2(attn="eager", **kw),
    "bert": models.hf_bert,
    "llama": models.hf_llama,
    "vit": models.hf_vit,
}
MESHES = [(2, 2), (4,)]

# The ops each model must contain (so the fallback check below is not vacuous) ...
EXPECTED_OPS = {
    "gpt2_sdpa": {"aten.addmm", "aten.scaled_dot_product_attention", "aten.layer_norm", "aten.embedding"},
    "gpt2_eager": {"aten.addmm", "aten.matmul", "aten.softmax.int", "aten.layer_norm", "aten.embedding"},
    "bert": {"aten.linear", "aten.scaled_dot_product_attention", "aten.layer_norm", "aten.embedding"},
    "llama": {"aten.linear", "aten.scaled_dot_product_attention", "aten.embedding",
              "aten.pow.Tensor_Scalar", "aten.mean.dim", "aten.rsqrt"},
    "vit": {"aten.linear", "aten.conv2d", "aten.scaled_dot_product_attention", "aten.layer_norm"},
}
# ... and the core ops that must never run replicated for want of a rule.
CORE_OPS = {
    "aten.linear", "aten.addmm", "aten.mm", "aten.bmm", "aten.matmul", "aten.conv2d",
    "aten.scaled_dot_product_attention", "aten.softmax.int", "aten._softmax", "aten._safe_softmax",
    "aten.layer_norm", "aten.rms_norm", "aten.pow.Tensor_Scalar", "aten.mean.dim", "aten.rsqrt",
    "aten.mul.Tensor", "aten.add.Tensor", "aten.embedding", "aten.cross_entropy_loss",
}
WEIGHT_OPS = {"aten.linear", "aten.addmm", "aten.mm"}
_FALLBACK_RE = re.compile(r"no sharding rule for op (\S+) ")



def _fallback_ops(caught) -> list:
    return sorted({m.group(1) for w in caught if (m := _FALLBACK_RE.search(str(w.message)))})


@functools.cache
def planned(name: str, mesh: tuple):
    """(model, inputs, plan, ops that fell back) for the default config of ``name``."""
    model, inputs = MODELS[name]()
    with fallback_warnings() as caught:
        plan = partitioner.plan(model, inputs, mesh_shape=mesh, cluster="h100")
    return model, inputs, plan, _fallback_ops(caught)


def _linear_weights(plan) -> list:
    """Records of the 2-D parameters used as the weight of a linear / addmm / mm."""
    by_name = {r["name"]: r for r in plan.records}
    found = {}
    for r in plan.records:
        if r["target"] in WEIGHT_OPS:
            for name in r["inputs"]:
                src = by_name[name]
                if src["kind"] == "param" and len(src["shapes"][0]) == 2:
                    found[name] = src
    return list(found.values())


def _in_repeated_block(fqn: str) -> bool:
    return re.search(r"\.\d+\.", fqn) is not None


CASES = [(name, mesh) for name in MODELS for mesh in MESHES]
CASE_IDS = [f"{name}-{'x'.join(map(str, mesh))}" for name, mesh in CASES]


@pytest.mark.parametrize("name,mesh", CASES, ids=CASE_IDS)
def test_plan_succeeds(name, mesh):
    model, inputs, plan, _ = planned(name, mesh)
    assert plan.mesh_shape == mesh
    ops = [r for r in plan.records if r["kind"] == "op"]
    assert ops, "the plan has no op records"
    for r in ops:
        assert len(r["out"]) == len(r["shapes"]), r["name"]
        for spec in r["out"]:
            assert spec is not None and spec.count(",") == len(mesh) - 1, (r["name"], spec)
    targets = {r["target"] for r in ops}
    missing = EXPECTED_OPS[name] - targets
    assert not missing, f"{name} no longer exports {missing}; update EXPECTED_OPS"
    params = {r["fqn"] for r in plan.records if r["kind"] == "param"}
    assert {n for n, _ in model.named_parameters()} <= params
    est = plan.estimate()
    assert 0 < est.step_time_s < 1.0 and est.memory_bytes > 0


@pytest.mark.parametrize("name,mesh", CASES, ids=CASE_IDS)
def test_core_ops_have_rules(name, mesh):
    *_, fell_back = planned(name, mesh)
    core = sorted(set(fell_back) & CORE_OPS)
    assert not core, f"{name} on {mesh}: core ops fell back to replicate: {core}"


@pytest.mark.parametrize("name,mesh", CASES, ids=CASE_IDS)
def test_no_op_falls_back(name, mesh):
    *_, fell_back = planned(name, mesh)
    assert fell_back == [], f"{name} on {mesh}: ops without a sharding rule: {fell_back}"


@pytest.mark.parametrize("name", list(MODELS))
def test_tight_budget_shards_block_weights(name):
    mesh = (4,)
    model, inputs, loose, _ = planned(name, mesh)
    n_devices = math.prod(mesh)
    replicated_state = sum(param_state_bytes(p.numel(), p.element_size(), "adam") for p in model.parameters())
    block_weights = [r for r in _linear_weights(loose) if _in_repeated_block(r["fqn"])]
    assert len(block_weights) >= 4, [r["fqn"] for r in block_weights]
    # Replicating any one block weight costs at least this much more than sharding it
    # fully; the budget leaves half of that above the least peak a plan needs.
    smallest = min(r["shapes"][0][0] * r["shapes"][0][1] for r in block_weights)
    # the least peak: the plan that keeps the least (its edge buffers and transients included)
    least = partitioner.plan(model, inputs, mesh_shape=mesh, cluster="h100", objective="memory").estimate().memory_bytes
    budget = int(least + 0.5 * param_state_bytes(smallest, 4, "adam") * (1 - 1 / n_devices))
    assert budget < replicated_state, "the budget must forbid replicated parameters"

    tight = partitioner.plan(model, inputs, mesh_shape=mesh, cluster="h100", memory_budget=budget,
                             objective="time")
    assert tight.estimate().memory_bytes <= budget
    replicated = [r["fqn"] for r in _linear_weights(tight)
                  if _in_repeated_block(r["fqn"]) and is_replicated(r["out"][0])]
    assert not replicated, f"block weights left replicated under a {budget} B budget: {replicated}"


@pytest.mark.parametrize("name", ["gpt2_sdpa", "llama"])
def test_large_batch_loose_budget_is_data_parallel(name):
    model, inputs = MODELS[name](batch=1024, seq=64)
    model = model.to("meta")  # planning needs no memory
    plan = partitioner.plan(model, inputs, mesh_shape=(4,), cluster="h100", memory_budget="80GiB")
    by_fqn = {r["fqn"]: r for r in plan.records if r["kind"] in ("input", "param")}
    assert by_fqn["input_ids"]["out"] == ["[S(0)]"]
    assert by_fqn["labels"]["out"] == ["[S(0)]"]
    sharded = [f for f, r in by_fqn.items() if r["kind"] == "param" and not is_replicated(r["out"][0])]
    assert not sharded, f"pure data parallel keeps every parameter replicated; sharded: {sharded}"
