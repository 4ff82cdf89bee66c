"""``partitioner.plan``: capture -> analyse -> intra-op plan -> :class:`ShardingPlan`.

This module orchestrates the passes and turns user-facing arguments (mesh, cluster, budget,
pins) into what the passes take. It never starts processes and needs no devices: models on
the ``meta`` device plan for any mesh size.
"""

from __future__ import annotations

import logging
import time

import torch

from partitioner.captures import captured
from partitioner.intra_op import plan_captured, resolve_pins
from partitioner.local_cluster import get_cluster
from partitioner.mesh import MeshSpec
from partitioner.options import PlanOptions
from partitioner.progress import verbose_to_stderr
from partitioner.sharding_plan import ShardingPlan
from passes.plan.ilp_solver import TIME_LIMIT_S

__all__ = ["plan", "plan_captured", "resolve_pins", "mesh_argument"]


logger = logging.getLogger(__name__)


@verbose_to_stderr
def plan(
    model: torch.nn.Module,
    example_inputs,
    *,
    mesh=None,
    mesh_shape=None,
    mesh_axis_names=None,
    devices: int | None = None,
    global_batch: int | None = None,
    options: PlanOptions | None = None,
    cluster=None,
    memory_budget=None,
    host_memory_budget=None,
    pins: dict | None = None,
    objective: str = "time",
    optimizer: str | None = "adam",
    share_blocks: bool = True,
    time_limit: float = TIME_LIMIT_S,
    layers: str = "auto",
    precision=None,
    recompute: str = "auto",
    sequence_parallel: str = "auto",
    zero="auto",
    tensor_parallel: str = "auto",
    expert_parallel: str = "auto",
    expert_capacity: float | None = None,
    verbose: bool = False,
) -> ShardingPlan:
    """Choose data / tensor / sequence splits for every node of ``model`` on a device mesh.

    The planning options (``cluster`` to ``tensor_parallel``) are those of
    :func:`partitioner.auto_parallelize`, by the same names and with the same defaults, so a
    plan made here is the plan a job on the same devices runs (:class:`partitioner.PlanOptions`
    documents each; ``options=`` takes them as one object, a keyword given here winning).

    Args:
        model: any ``nn.Module``; it may live on the ``meta`` device (nothing is allocated).
        example_inputs: a tuple of positional arguments or a dict of keyword arguments
            (HuggingFace style: ``input_ids``, ``attention_mask``, ``labels``, ``pixel_values``).
        mesh: devices per mesh axis, e.g. ``(8, 8)`` or ``"8x8"`` (default ``(1,)``);
            ``mesh_shape=`` is the same argument under its older name.
        mesh_axis_names: names for the axes (default ``a0, a1, ...``).
        devices: plan for this many devices with no mesh given: the whole configuration
            (pipeline x data x tensor degrees, microbatches, schedule, recomputation) is searched
            (:mod:`partitioner.search`); ``plan.config`` holds it, ``plan.explain()`` the
            runner-ups. With ``mesh`` too, the two must agree (the mesh is then used).
        global_batch: samples per step for the search (default: the example inputs' batch).
        verbose: show progress (capture, analysis, solve) on stderr for this call; the same
            records go to the ``partitioner`` logger at INFO in any case (see
            :mod:`partitioner.progress`).
        cluster ... expert_capacity: the planning options, each documented on its field of
            :class:`partitioner.PlanOptions` (cost model, memory and host-memory budgets, pins,
            objective, optimizer state, repeated blocks, solver time limit, capture depth,
            precision, recomputation, sequence / tensor / expert parallel algorithms, ZeRO, MoE
            token dropping).

    Example::

        plan = partitioner.plan(model, {"input_ids": ids, "labels": ids}, mesh=(8, 8),
                                cluster="h100", memory_budget="80GiB")
        print(plan.summary()); plan.save("plan.json")
        plan.estimate().comm_bytes["all_reduce"]     # bytes per mesh axis
        print(plan.explain("model.layers.0.mlp.down_proj"))
    """
    opts = PlanOptions.from_call(options, **PlanOptions.pick(locals()))
    mesh_shape = mesh_argument(mesh, mesh_shape)
    ranks = devices if devices is not None else (MeshSpec.build(mesh_shape).size if mesh_shape is not None else None)
    opts = opts.replace(cluster=get_cluster(opts.cluster_for(), ranks=ranks))  # "cpu": measured for these ranks
    if devices is not None or global_batch is not None:
        searched = _plan_for_devices(
            model, example_inputs, mesh_shape=mesh_shape, devices=devices, global_batch=global_batch, options=opts
        )
        if searched is not None:
            return searched
    mesh_shape = (1,) if mesh_shape is None else mesh_shape
    timings: dict = {"start": time.perf_counter()}
    precision = opts.precision_policy
    cap = captured(
        model,
        example_inputs,
        layers=opts.layers,
        autocast_dtype=precision.autocast_dtype,
        sequence_parallel=opts.sequence_parallel,
        expert_capacity=opts.expert_capacity,
        timings=timings,
    )
    return plan_captured(
        cap,
        model_name=type(model).__name__,
        mesh_shape=mesh_shape,
        mesh_axis_names=mesh_axis_names,
        options=opts.replace(precision=precision),
        timings=timings,
    )


def mesh_argument(mesh, mesh_shape):
    """``mesh=`` (or its older name ``mesh_shape=``): give one."""
    if mesh is not None and mesh_shape is not None:
        raise ValueError("give the mesh once: mesh= (mesh_shape= is its older name)")
    return mesh if mesh is not None else mesh_shape


# -- the whole configuration for N devices (partitioner/search/) --------------------------------


def _plan_for_devices(model, example_inputs, *, mesh_shape, devices, global_batch, options) -> ShardingPlan | None:
    """``plan(devices=N)``: the configuration search; None when a mesh given with it decides."""
    from partitioner.moe_capacity import EXPERT_CAPACITY_SEARCH
    from partitioner.search import check_devices, search_config

    if devices is None:
        raise ValueError("global_batch= is for the configuration search: give devices=N with it")
    check_devices(devices)
    if mesh_shape is not None:
        mesh = MeshSpec.build(mesh_shape)
        if mesh.size != devices:
            raise ValueError(
                f"devices={devices} and mesh={mesh.shape} ({mesh.size} devices) disagree: give one of them "
                f"(devices= alone searches the configuration)"
            )
        return None
    options.refuse("in the configuration search (devices= without mesh=)", {"expert_capacity": EXPERT_CAPACITY_SEARCH})
    return search_config(model, example_inputs, devices=devices, global_batch=global_batch, options=options)
