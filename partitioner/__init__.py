"""Partita: an automatic parallelizer for PyTorch.

Capture a model as a graph, choose data / tensor / sequence splits for every node with a
cost model and an ILP, and show the plan::

    import partitioner
    plan = partitioner.plan(model, example_inputs, mesh_shape=(8, 8), cluster="h100",
                            memory_budget="80GiB")
    print(plan.summary())
    plan.save("plan.json"); partitioner.ShardingPlan.load("plan.json")
    est = plan.estimate()        # step_time_s, memory_bytes (peak), memory (breakdown), comm_bytes
    print(plan.explain("model.layers.0.mlp.down_proj"))
    print(plan.diff(other_plan))

Reading, showing and comparing saved plans needs no torch import; the names that capture
or plan (``plan``, ``CaptureError``, ...) load torch on first use.
"""

from importlib import import_module

from partitioner.cluster import PRESETS, ClusterSpec, LinkSpec
from partitioner.local_cluster import cpu_cluster, get_cluster
from partitioner.mesh import MeshSpec
from partitioner.sharding_plan import Estimate, PlanDiff, PlanMismatchError, ShardingPlan

_LAZY = {
    "plan": "partitioner.api",
    "resolve_pins": "partitioner.api",
    "plan_captured": "partitioner.api",
    "PlanOptions": "partitioner.options",
    "auto_parallelize": "partitioner.parallelize",
    "shard_batch": "partitioner.parallelize",
    "dump": "partitioner.dump",
    "CaptureError": "passes.capture.capture",
    "InfeasibleBudgetError": "passes.plan.plan_intra_op",
    "ShapeMismatchError": "passes.analysis.shape_check",
    "hf_families": None,
    "data": None,
    "save_checkpoint": "partitioner.checkpoint",
    "load_checkpoint": "partitioner.checkpoint",
    "latest_checkpoint": "partitioner.checkpoint",
    "shard_optimizer_state": "runtime.sharded_state",
    "Precision": "partitioner.precision",
    "grad_scaler": "partitioner.precision",
    "clip_grad_norm_": "partitioner.clip",
    "measure_memory": "runtime.memory_probe",
    "MemoryMeasurement": "runtime.memory_probe",
    "MemoryBreakdown": "partitioner.memory",
    "token_dropping": "partitioner.moe_capacity",
}

__all__ = [
    "Precision",
    "grad_scaler",
    "clip_grad_norm_",
    "measure_memory",
    "MemoryMeasurement",
    "MemoryBreakdown",
    "token_dropping",
    "plan",
    "PlanOptions",
    "plan_captured",
    "resolve_pins",
    "auto_parallelize",
    "shard_batch",
    "dump",
    "ShardingPlan",
    "Estimate",
    "PlanDiff",
    "PlanMismatchError",
    "ClusterSpec",
    "LinkSpec",
    "MeshSpec",
    "PRESETS",
    "get_cluster",
    "cpu_cluster",
    "CaptureError",
    "InfeasibleBudgetError",
    "ShapeMismatchError",
    "hf_families",
    "data",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "shard_optimizer_state",
]


def __getattr__(name):
    if name in _LAZY:
        module = _LAZY[name]
        value = import_module(f"partitioner.{name}") if module is None else getattr(import_module(module), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'partitioner' has no attribute {name!r}")
