"""``auto_parallelize``: plan (or replay a plan), lower for this rank, load this rank's shards.

Runs inside a job whose default process group is initialised (torchrun, or
``runtime.launch.run_on_ranks``). Every rank captures the model; rank 0 plans and broadcasts
the plan (the cost model may time the local machine, and ranks must agree on one plan);
each rank lowers it for its own mesh coordinates and slices its parameters out of the model,
a full state dict, or a checkpoint file opened with ``mmap`` (so a model built on ``meta``
never exists whole in one process).
"""
from __future__ import annotations


import datetime
import sys
import time

import torch
import torch.distributed as dist

from partitioner.api import plan_captured
from partitioner.mesh import MeshSpec
from partitioner.sharding_plan import ShardingPlan
from passes.analyze import analyze, info
from passes.capture import graph_fingerprint, tied_placeholders
from passes.capture_blocks import capture_model
from passes.lower_to_local import lower_to_local, strided_parameters
from passes.placements import format_spec, parse_spec
from runtime.collectives import MeshComm, on_rank0
from runtime.parallel_module import ParallelModule, shard_tensor

__all__ = ["auto_parallelize", "shard_batch"]


def _default_timeout(device_type):
    """The timeout the job's default process group was created with (mesh groups inherit it)."""
    pg = dist.distributed_c10d._get_default_group()
    try:
        return pg._get_backend(torch.device(device_type)).options._timeout
    except (AttributeError, RuntimeError):
        return datetime.timedelta(seconds=600)


def _device_mesh(mesh, axis_names, device_type, timeout=None):
    """A DeviceMesh whose per-axis process groups time out like the job's default group.

    ``init_device_mesh`` would create its groups with torch's 30-minute default; a hung rank
    must instead fail the others within the job's own timeout.
    """
    import numpy as np
    from torch.distributed.device_mesh import DeviceMesh

    world = dist.get_world_size()
    if isinstance(mesh, DeviceMesh):
        return mesh
    spec = MeshSpec.build(mesh if mesh is not None else (world,), axis_names)
    if spec.size != world:
        raise ValueError(f"mesh {spec.shape} needs {spec.size} ranks but this job has {world}: choose a mesh whose "
                         f"sizes multiply to {world} (or mesh=None to use all ranks on one axis)")
    timeout = timeout or _default_timeout(device_type)
    layout = np.arange(world).reshape(spec.shape)
    rank = dist.get_rank()
    mine = []
    for axis in range(spec.ndim):
        moved = np.moveaxis(layout, axis, -1).reshape(-1, spec.shape[axis])
        for ranks in moved:   # every rank creates every group, in the same order
            group = dist.new_group([int(r) for r in ranks], timeout=timeout)
            if rank in ranks:
                mine.append(group)
    return DeviceMesh.from_group(mine, device_type, mesh=torch.tensor(layout), mesh_dim_names=spec.axis_names)


def _source_tensor(name, model_state, checkpoint_state, exported):
    for source in (checkpoint_state, model_state):
        if source is not None and name in source:
            return source[name]
    if name in exported.constants:
        return exported.constants[name]
    raise KeyError(f"no value for {name}: pass state_dict= or checkpoint= holding it")


def auto_parallelize(model: torch.nn.Module, example_inputs, *, mesh=None, mesh_axis_names=None, plan=None,
                     cluster=None, memory_budget=None, pins=None, objective="time", local_inputs=False,
                     state_dict=None, checkpoint=None, device=None, pipeline=None, layers="auto", verbose=False):
    """Run ``model`` data / tensor / sequence parallel on the job's ranks, as a plan decides.

    Args:
        model: the user's model (on ``cpu``/``cuda``, or ``meta`` with ``state_dict``/``checkpoint``).
        example_inputs: a tuple of positional args or a dict of kwargs, as for :func:`partitioner.plan`.
        mesh: a shape like ``(2, 2)``, a ``DeviceMesh``, or None (all ranks on one axis).
        plan: a ShardingPlan to replay instead of searching (its fingerprint must match).
        cluster: cost model preset; default ``"cpu"`` (measured) on CPUs, ``"h100"`` on GPUs.
        local_inputs: each rank passes only its own piece of the batch (as with DDP).
        layers: ``"auto"`` / ``"full"`` / ``"blocks"``: how deep models are captured (see
            :func:`partitioner.plan`).
        pipeline: ``{"degree": 2, "schedule": "1f1b", "microbatches": 8}`` (or a PipelineConfig):
            the first mesh axis becomes pipeline stages; returns a runner whose
            ``train_step(batch)`` runs forward and backward over all microbatches.
        state_dict / checkpoint: full weights to slice (a dict, or a ``torch.save`` file opened
            with ``mmap``); default: the model's own weights.

    Example (inside ``torchrun --nproc-per-node 4``)::

        model = partitioner.auto_parallelize(model, example_inputs, mesh=(2, 2))
        loss = model(**batch).loss; loss.backward(); optimizer.step()
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("auto_parallelize needs an initialised process group: launch with torchrun (or "
                           "runtime.launch.run_on_ranks) and call torch.distributed.init_process_group first")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    device = torch.device(device)
    log = (lambda msg: print(f"[partita rank {dist.get_rank()}] {msg}", file=sys.stderr, flush=True)) if verbose else (lambda m: None)
    device_mesh = _device_mesh(mesh, mesh_axis_names, device.type)
    comm = MeshComm(device_mesh)
    if pipeline is not None:
        from partitioner.pipeline_parallelize import PipelineConfig, build_pipeline
        if plan is not None:
            raise ValueError("replaying a saved plan is not supported with pipeline=; plan again")
        model_state = None if _on_meta(model) else {**dict(model.named_parameters(remove_duplicate=False)),
                                                     **dict(model.named_buffers(remove_duplicate=False))}
        checkpoint_state = state_dict
        if checkpoint is not None:
            checkpoint_state = torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=True)
        return build_pipeline(model, example_inputs, device_mesh=device_mesh, config=PipelineConfig.build(pipeline),
                              cluster=cluster or ("cpu" if device.type == "cpu" else "h100"), pins=pins,
                              memory_budget=memory_budget, objective=objective, model_state=model_state or {},
                              checkpoint_state=checkpoint_state, device=device, log=log)
    t0 = time.perf_counter()
    cap = capture_model(model, example_inputs, layers=layers)
    analyze(cap)
    fingerprint = graph_fingerprint(cap)
    if plan is None:
        def make_plan():
            return plan_captured(cap, model_name=type(model).__name__, mesh_shape=comm.shape,
                                 mesh_axis_names=comm.axis_names,
                                 cluster=cluster or ("cpu" if device.type == "cpu" else "h100"),
                                 memory_budget=memory_budget, pins=pins, objective=objective, log=log).to_json()
        import json
        plan = ShardingPlan.from_dict(json.loads(on_rank0(make_plan, "planning")))
    else:
        plan.check_fingerprint(fingerprint, f"{type(model).__name__} on these inputs")
        if tuple(plan.mesh_shape) != tuple(comm.shape):
            raise ValueError(f"the plan is for mesh {plan.mesh_shape}, this job's mesh is {comm.shape}")
    log(f"planned in {time.perf_counter() - t0:.2f} s")
    records = {r["name"]: r for r in plan.records}
    program = lower_to_local(cap.graph, records, comm, device=device, bucket_grads=True)
    specs = {}
    for node in cap.graph.nodes:
        if node.op == "placeholder":
            spec = parse_spec(records[node.name]["out"][0], comm.ndim)
            specs[cap.params.get(node.name) or cap.buffers.get(node.name) or node.name] = spec
    strided = strided_parameters(cap.graph, records, comm)
    model_state = None if _on_meta(model) else {**dict(model.named_parameters(remove_duplicate=False)),
                                                **dict(model.named_buffers(remove_duplicate=False))}
    checkpoint_state = state_dict
    if checkpoint is not None:
        checkpoint_state = torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=True)
    local_params, local_buffers, global_shapes = {}, {}, {}
    with torch.no_grad():
        for name, fqn in cap.params.items():
            full = _source_tensor(fqn, model_state, checkpoint_state, cap.exported)
            local_params[fqn] = shard_tensor(full.detach(), specs[fqn], comm, strided.get(fqn)).to(device).clone()
            global_shapes[fqn] = tuple(full.shape)
        for name, fqn in cap.buffers.items():
            full = _source_tensor(fqn, model_state, checkpoint_state, cap.exported)
            local_buffers[fqn] = shard_tensor(full.detach(), specs[fqn], comm, strided.get(fqn)).to(device).clone()
            global_shapes[fqn] = tuple(full.shape)
    for names in tied_placeholders(cap):   # tied weights: one local tensor (one Parameter) for all names
        fqns = [cap.params.get(n) or cap.buffers.get(n) for n in names]
        state = local_params if fqns[0] in local_params else local_buffers
        for fqn in fqns[1:]:
            if specs[fqn] != specs[fqns[0]] or strided.get(fqn) != strided.get(fqns[0]):
                raise ValueError(f"{fqn} and {fqns[0]} are one tied tensor but the plan places them differently "
                                 f"({format_spec(specs[fqn])} vs {format_spec(specs[fqns[0]])}); pin both alike")
            if fqn in state:
                state[fqn] = state[fqns[0]]
    input_specs = {n.name: specs[n.name] for n in cap.graph.nodes if n.op == "placeholder" and info(n).kind == "input"}
    module = ParallelModule(program=program, plan=plan, comm=comm, captured=cap, local_params=local_params,
                            local_buffers=local_buffers, specs={**specs, **input_specs}, strided=strided,
                            local_inputs=local_inputs, global_shapes=global_shapes)
    module.train(model.training)
    log(f"ready: {module.local_parameter_bytes() / 2**20:.1f} MiB of parameters on this rank")
    return module


def _on_meta(model):
    tensors = list(model.parameters()) + list(model.buffers())
    return bool(tensors) and all(t.is_meta for t in tensors)


def shard_batch(batch, model: ParallelModule):
    """Cut a global batch the way ``model``'s plan wants its inputs (for ``local_inputs=True``)."""
    return model.shard_batch(batch)



