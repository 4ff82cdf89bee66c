"""Tier 2: planning for large meshes on meta tensors, in one process, without devices."""
import pytest

import partitioner
from partitioner import models


def test_70b_llama_shapes_on_an_8x8_h100_mesh_plan_without_memory():
    # LLaMA-2-70B layer shapes (2 of its 80 layers: the layers share one decision)
    model, inputs = models.llama_meta(n_layer=2, hidden=8192, heads=64, kv_heads=8, intermediate=28672,
                                      vocab=32000, batch=16, seq=4096)
    assert all(p.is_meta for p in model.parameters())
    plan = partitioner.plan(model, inputs, mesh_shape=(8, 8), cluster="h100", memory_budget="80GiB")
    est = plan.estimate()
    assert est.memory_bytes <= 80 * 2**30
    down = plan.placement_of("model.layers.0.mlp.down_proj.weight")
    assert down != "[R, R]"                                   # a 70B layer's weights are sharded


@pytest.mark.parametrize("mesh", [(16, 64), (4, 4, 4)])
def test_world_sizes_up_to_1024(mesh):
    model, inputs = models.gpt_block(batch=64, seq=256, n_embd=1024, n_head=16, n_layer=2, vocab=1024)
    plan = partitioner.plan(model, inputs, mesh_shape=mesh, cluster="h100", memory_budget="80GiB")
    assert plan.mesh_shape == mesh
    for r in plan.records:                                    # every local shape divides evenly
        for shape, local, spec in zip(r["shapes"], r.get("local_shapes", []), r["out"]):
            if shape is not None and local is not None:
                assert all(g % l == 0 for g, l in zip(shape, local))
    assert plan.estimate().step_time_s > 0
