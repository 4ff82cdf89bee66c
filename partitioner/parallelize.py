"""``auto_parallelize``: plan (or replay a plan), lower for this rank, load this rank's shards.

Runs inside a job whose default process group is initialised (torchrun, or
``runtime.launch.run_on_ranks``). The entry function is a short list of steps, each a function
below: build the device mesh; capture (every rank exports and analyses the model); plan (rank 0
searches and broadcasts the plan: the cost model may time the local machine, and ranks must
agree on one plan) or check a given plan; build the module (lower the plan for this rank's mesh
coordinates, then slice its parameters out of the model, a full state dict, or a checkpoint file
opened with ``mmap``, so a model built on ``meta`` never exists whole in one process; see
:mod:`partitioner.weights`). With ``pipeline=`` the stages are built by
:mod:`partitioner.pipeline_parallelize` instead, from the same weight-loading steps.
"""

from __future__ import annotations

import datetime
import json
import logging
import time

import torch
import torch.distributed as dist

from partitioner.api import plan_captured
from partitioner.axis_uses import describe_config
from partitioner.captures import captured, with_routing
from partitioner.local_cluster import for_memory_budget, job_cluster
from partitioner.mesh import MeshSpec
from partitioner.moe_capacity import EXPERT_CAPACITY_PER_BATCH, EXPERT_CAPACITY_SEARCH
from partitioner.options import PlanOptions
from partitioner.precision import Precision
from partitioner.progress import verbose_to_stderr
from partitioner.sharding_plan import ShardingPlan
from partitioner.specialize import Specializer, in_mode
from partitioner.weights import WeightSource, load_local_weights
from passes.analysis.analyze import info
from passes.analysis.shape_check import check_servable
from passes.capture.capture import graph_fingerprint, tied_placeholders
from passes.lower.lower_to_local import lower_to_local
from passes.plan.ilp_solver import TIME_LIMIT_S
from runtime.collectives import MeshComm, on_rank0
from runtime.host_memory import return_freed_blocks
from runtime.parallel_module import ParallelModule

__all__ = ["auto_parallelize", "shard_batch"]

logger = logging.getLogger(__name__)


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
        raise ValueError(
            f"mesh {spec.shape} needs {spec.size} ranks but this job has {world}: choose a mesh whose "
            f"sizes multiply to {world} (or mesh=None to use all ranks on one axis)"
        )
    timeout = timeout or _default_timeout(device_type)
    layout = np.arange(world).reshape(spec.shape)
    rank = dist.get_rank()
    mine = []
    for axis in range(spec.ndim):
        moved = np.moveaxis(layout, axis, -1).reshape(-1, spec.shape[axis])
        for ranks in moved:  # every rank creates every group, in the same order
            group = dist.new_group([int(r) for r in ranks], timeout=timeout)
            if rank in ranks:
                mine.append(group)
    return DeviceMesh.from_group(mine, device_type, mesh=torch.tensor(layout), mesh_dim_names=spec.axis_names)


@verbose_to_stderr
def auto_parallelize(
    model: torch.nn.Module,
    example_inputs,
    *,
    mesh=None,
    mesh_axis_names=None,
    plan=None,
    pipeline=None,
    options: PlanOptions | None = None,
    cluster=None,
    memory_budget=None,
    host_memory_budget=None,
    pins=None,
    objective="time",
    optimizer="adam",
    share_blocks=True,
    time_limit=TIME_LIMIT_S,
    layers="auto",
    precision=None,
    recompute="auto",
    sequence_parallel="auto",
    zero="auto",
    tensor_parallel="auto",
    expert_parallel="auto",
    expert_capacity=None,
    local_inputs=False,
    state_dict=None,
    checkpoint=None,
    device=None,
    verbose=False,
):
    """Run ``model`` data / tensor / sequence parallel on the job's ranks, as a plan decides.

    The planning options (``options`` to ``tensor_parallel``) are :func:`partitioner.plan`'s,
    by the same names and with the same defaults (:class:`partitioner.PlanOptions`), so
    ``partitioner.plan`` on this machine previews what runs. Each is honoured in every mode
    (a mesh, the configuration search, a pipeline) or refused there with a ``ValueError``
    naming it.

    Args:
        model: the user's model (on ``cpu``/``cuda``, or ``meta`` with ``state_dict``/``checkpoint``).
        example_inputs: a tuple of positional args or a dict of kwargs, as for :func:`partitioner.plan`.
        mesh: a shape like ``(2, 2)``, a ``DeviceMesh``, or None: the whole configuration for the
            job's world size is searched (pipeline x data x tensor degrees, microbatches,
            schedule; :mod:`partitioner.search`) and run. ``mesh=(world_size,)`` gives
            all ranks one axis.
        plan: a ShardingPlan to replay instead of planning (its fingerprint must match); the
            planning options it was made with come with it (one given that differs is refused).
        pipeline: ``{"degree": 2, "schedule": "1f1b", "microbatches": 8}`` (or a PipelineConfig):
            the first mesh axis becomes pipeline stages; returns a runner whose
            ``train_step(batch)`` runs forward and backward over all microbatches. Stages keep
            their activations (``recompute="auto"`` chooses among keeping them; ``"all"`` and
            ``"selective"`` are refused), store weights whole, ZeRO-1 (optimizer state sharded
            over the stage's data-parallel axes) or ZeRO-2/3 and take the global batch
            (``local_inputs=True`` is refused).
        cluster: cost model; default: the devices this job runs on (``"cpu"``, measured, on
            CPUs; the GPU's preset on GPUs).
        local_inputs: each rank passes only its own piece of the batch (as with DDP).
        state_dict / checkpoint: full weights to slice (a dict, or a ``torch.save`` file opened
            with ``mmap``); default: the model's own weights.
        precision: ``"fp32"`` (default), ``"bf16"``, ``"fp16"`` or a MixedPrecisionPolicy: fp32
            master weights and optimizer state, ops under ``torch.autocast`` (see
            :mod:`partitioner.precision`); a replayed plan brings its own.
        host_memory_budget: host-memory bytes per device for offloaded optimizer state (see
            :func:`partitioner.plan`): offloaded parameters live on the CPU with their gradients,
            so the optimizer keeps their state and runs their step there
            (``ParallelModule.offloaded()`` names them).
        verbose: show progress on stderr for this call; the same records go to the
            ``partitioner`` logger at INFO in any case (see :mod:`partitioner.progress`).
        The other options: see :func:`partitioner.plan`.

    Example (inside ``torchrun --nproc-per-node 4``)::

        model = partitioner.auto_parallelize(model, example_inputs, mesh=(2, 2))
        loss = model(**batch).loss; loss.backward(); optimizer.step()
    """
    _require_process_group()
    device = _job_device(device)
    opts = PlanOptions.from_call(options, **PlanOptions.pick(locals()))
    if plan is not None:
        _check_replay_options(opts, plan)
    opts = _job_options(opts, plan, device)
    if mesh is None and plan is None and pipeline is None:
        mesh, mesh_axis_names, plan, pipeline, opts = _searched_configuration(model, example_inputs, opts)
    source = WeightSource(model, state_dict, checkpoint)
    if pipeline is not None:
        runner = _pipelined(
            model,
            example_inputs,
            pipeline,
            mesh=mesh,
            mesh_axis_names=mesh_axis_names,
            plan=plan,
            options=opts,
            source=source,
            device=device,
            local_inputs=local_inputs,
        )
        return _loaded(runner, source, model)
    return _on_mesh(model, example_inputs, mesh, mesh_axis_names, plan, opts, source, device, local_inputs)


def _job_options(opts: PlanOptions, plan, device: torch.device) -> PlanOptions:
    """``opts`` with the cluster this job prices with (measured by its ranks for ``"cpu"``, for
    the fresh mappings a CPU job under a memory budget gets) and the precision it runs in (a
    replayed plan's own)."""
    if device.type == "cpu" and opts.memory_budget is not None:
        return_freed_blocks()  # a budget on the CPU: freed tensors leave the process (runtime/host_memory.py)
    cluster = job_cluster(opts.cluster_for(device))  # "cpu": measured by this job's ranks unless cached
    if device.type == "cpu" and opts.memory_budget is not None:
        cluster = for_memory_budget(cluster, opts.memory_budget)  # priced with the fresh mappings it now gets
    return opts.replace(cluster=cluster, precision=_resolve_precision(opts.precision, plan))


def _on_mesh(model, example_inputs, mesh, mesh_axis_names, plan, opts: PlanOptions, source, device, local_inputs):
    """The :class:`ParallelModule` of ``model`` on one mesh: captured, planned (or ``plan``
    replayed), lowered, its weights loaded, and a specializer for other modes and shapes."""
    comm = MeshComm(_device_mesh(mesh, mesh_axis_names, device.type))
    t0 = time.perf_counter()
    # a saved plan is replayed on a capture in the mode it was made in; the module's own mode
    # (below) then picks the program it runs (see partitioner/specialize.py)
    training = plan.data.get("training", model.training) if plan is not None else model.training
    if plan is not None:
        opts = opts.replace(
            sequence_parallel=plan.data.get("sequence_parallel", "auto"),
            expert_capacity=plan.data.get("expert_capacity"),
        )
    with in_mode(model, training):
        cap = _capture(model, example_inputs, opts)

    def routed():  # rank 0's planning prices MoE layers by their routing on the example batch
        with in_mode(model, training):
            return with_routing(model, example_inputs, cap)

    plan = _plan_or_replay(routed, cap, type(model).__name__, comm, plan, opts)
    logger.info("planned in %.2f s", time.perf_counter() - t0)
    module = _loaded(_build_module(cap, plan, comm, source, device, local_inputs), source, model)
    module.attach_specializer(
        Specializer(
            model,
            plan=plan,
            comm=comm,
            device=device,
            layers=opts.layers,
            param_specs=module.stored_placements(),
            strided=module.strided_layouts(),
            plan_kwargs=dict(options=opts.replace(pins=None)),
        )
    )
    module.reduce_gradients_in(opts.precision_policy.grad_reduce_dtype)
    module.train(model.training)
    logger.info("ready: %.1f MiB of parameters on this rank", module.local_parameter_bytes() / 2**20)
    return module


# the options a replayed plan records under the same name (the others are not its choices)
_REPLAYED = (
    "objective",
    "optimizer",
    "recompute",
    "sequence_parallel",
    "zero",
    "tensor_parallel",
    "expert_parallel",
    "expert_capacity",
    "share_blocks",
)


def _check_replay_options(opts: PlanOptions, plan: ShardingPlan) -> None:
    """A replayed plan brings the choices it was made with: a planning option given that
    differs from the plan's is refused (it would not be honoured), naming both. A pipelined plan
    is not replayed (the pipeline builder plans its stages): refused, saying how to build it."""
    if plan.stage_plans:
        pipe = plan.data["pipeline"]
        build = {k: pipe[k] for k in ("degree", "schedule", "microbatches")}
        raise ValueError(
            f"plan= is a pipelined plan ({pipe['degree']} stages on mesh {plan.mesh_shape}), which "
            f"auto_parallelize does not replay: leave plan= out and build it with mesh={plan.mesh_shape}, "
            f"pipeline={build} (its stages are planned again), or without mesh= to search again"
        )
    for name, value in opts.changed().items():
        if name in ("cluster", "layers", "precision", "memory_budget"):
            continue  # the cluster and budget re-plan other modes; layers captures; precision is checked
        if name in _REPLAYED and plan.data.get(name, value) == value:
            continue
        if name == "host_memory_budget" and plan.data.get(name) == value:
            continue
        made = plan.data.get(name, "its own") if name in (*_REPLAYED, "host_memory_budget") else "its own"
        raise ValueError(
            f"{name}={value!r} is not available with plan=: the plan was made with {name}={made!r} and is "
            f"replayed as it is; plan again with {name}={value!r}, or leave {name}= out"
        )


# -- the steps ---------------------------------------------------------------------------------


def _require_process_group():
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "auto_parallelize needs an initialised process group: launch with torchrun (or "
            "runtime.launch.run_on_ranks) and call torch.distributed.init_process_group first"
        )


def _job_device(device) -> torch.device:
    """The given device; by default this rank's GPU under NCCL, else the CPU."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    return torch.device(device)


_PIPELINE_MODE = "with pipeline="


def _pipelined(model, example_inputs, pipeline, *, mesh, mesh_axis_names, plan, options, source, device, local_inputs):
    """``pipeline=``: the first mesh axis becomes stages (:mod:`partitioner.pipeline_parallelize`)."""
    from partitioner.pipeline_parallelize import PipelineConfig, build_pipeline

    if plan is not None:
        raise ValueError("replaying a saved plan is not supported with pipeline=; plan again")
    if local_inputs:
        raise ValueError(
            f"local_inputs=True is not available {_PIPELINE_MODE}: a pipeline runner's train_step takes the "
            "global batch (every rank passes the same one); leave local_inputs out"
        )
    options.refuse(
        _PIPELINE_MODE,
        {
            "host_memory_budget": "pipeline stages keep their optimizer state on the device; leave it out "
            "or run without pipeline=",
            "expert_capacity": EXPERT_CAPACITY_PER_BATCH,
        },
    )
    if options.recompute in ("all", "selective"):
        raise ValueError(
            f"recompute={options.recompute!r} is not available {_PIPELINE_MODE} yet: pipeline stages keep their "
            "layers' activations (their schedule bounds how many microbatches are alive); use recompute='auto' "
            "or 'none' with a pipeline"
        )
    if options.expert_parallel == "on":
        raise ValueError(
            f"expert_parallel='on' is not available {_PIPELINE_MODE} yet: stage meshes are planned stage by "
            "stage; use 'auto' (the stages may still split experts) or run without pipeline="
        )
    if options.tensor_parallel not in ("auto", "1d"):
        raise ValueError(
            f"tensor_parallel={options.tensor_parallel!r} is not available {_PIPELINE_MODE} yet: the 2D/2.5D/3D "
            "grids run on meshes without a pipeline axis; use 'auto' or '1d'"
        )
    config = PipelineConfig.build(pipeline)
    return build_pipeline(
        model,
        example_inputs,
        device_mesh=_device_mesh(mesh, mesh_axis_names, device.type),
        config=config,
        options=options,
        source=source,
        device=device,
    )


def _searched_configuration(model, example_inputs, options: PlanOptions):
    """``mesh=None``: rank 0 searches the configuration for the world size and broadcasts the
    plan; returns (mesh, axis names, plan to replay or None, pipeline config or None, the
    options to build it with). A pipelined choice is built by the pipeline builder (which plans
    its stages again, on rank 0, with the ZeRO stage the search chose); pipelined candidates
    that recompute are left out (the runtime's stages keep activations)."""
    from partitioner.search import planner_zero, search_config

    options.refuse("in the configuration search (no mesh)", {"expert_capacity": EXPERT_CAPACITY_SEARCH})

    def search():
        return search_config(
            model, example_inputs, devices=dist.get_world_size(), options=options, pipeline_recompute=False
        ).to_json()

    chosen = ShardingPlan.from_dict(json.loads(on_rank0(search, "searching the configuration")))
    config = chosen.config
    logger.info("configuration: %s", describe_config(chosen))
    if config.pipeline > 1:
        pipeline = {
            "degree": config.pipeline,
            "schedule": config.schedule,
            "microbatches": config.microbatches,
            "virtual_stages": config.virtual_stages,
        }
        if options.zero == "auto":
            options = options.replace(zero=planner_zero(config.zero))
        if config.sequence > 1 and options.sequence_parallel == "auto":  # the searched attention on sp
            options = options.replace(sequence_parallel=config.sequence_parallel)
        return config.mesh_shape, config.axis_names, None, pipeline, options
    return config.mesh_shape, config.axis_names, chosen, None, options


def _resolve_precision(precision, plan) -> Precision:
    """The precision asked for; a replayed plan's own when none is asked (a different one is refused)."""
    if plan is None:
        return Precision.build(precision)
    if precision is not None and Precision.build(precision) != plan.precision:
        raise ValueError(
            f"the plan was made for precision {plan.precision}, not {Precision.build(precision)}: plan again "
            f"for {Precision.build(precision)}, or leave precision= out to replay it as it is"
        )
    return plan.precision


def _capture(model, example_inputs, opts: PlanOptions):
    """Capture: every rank exports the model (the graph is needed to lower) and analyses it;
    eager attention becomes one op where ring or Ulysses is forced (``passes.capture.eager_attention``).
    A capture kept by ``partitioner.captures.keep_captures`` (e.g. made by the parent that
    forked this rank) is reused. MoE routing is not measured here: only rank 0 plans, and it
    measures it then (:func:`partitioner.captures.with_routing`)."""
    return captured(
        model,
        example_inputs,
        layers=opts.layers,
        autocast_dtype=opts.precision_policy.autocast_dtype,
        sequence_parallel=opts.sequence_parallel,
        expert_capacity=opts.expert_capacity,
        routing=False,
    )


def _plan_or_replay(routed, cap, model_name, comm, plan, options: PlanOptions) -> ShardingPlan:
    """Plan: rank 0 searches and broadcasts (the cost model may time this machine, and ranks
    must agree on one plan), on ``routed()`` (``cap`` with its MoE routing measured); a given plan
    is checked against the graph and the mesh instead."""
    if plan is None:

        def make_plan():
            routed()
            return plan_captured(
                cap, model_name=model_name, mesh_shape=comm.shape, mesh_axis_names=comm.axis_names, options=options
            ).to_json()

        return ShardingPlan.from_dict(json.loads(on_rank0(make_plan, "planning")))
    if tuple(plan.mesh_shape) != tuple(comm.shape):
        raise ValueError(f"the plan is for mesh {plan.mesh_shape}, this job's mesh is {comm.shape}")
    if graph_fingerprint(cap) != plan.fingerprint and plan.data.get("structure") == graph_fingerprint(
        cap, shapes=False
    ):
        # the same program at other input sizes: the plan serves it where each rank gets a piece
        check_servable(cap, {r["name"]: r for r in plan.records}, comm.shape, comm.axis_names)
        return plan
    plan.check_fingerprint(graph_fingerprint(cap), f"{model_name} on these inputs")
    return plan


def _loaded(parallel, source: WeightSource, model):
    """Close the weight source, record what ``save_pretrained`` needs of the model
    (:func:`partitioner.pretrained.pretrained_layout`) and the checkpoint bytes this rank read
    (``checkpoint_bytes_read``: None unless a safetensors checkpoint was read), and log them."""
    from partitioner.pretrained import pretrained_layout

    source.close()
    parallel.attach_pretrained(pretrained_layout(model))
    object.__setattr__(parallel, "checkpoint_bytes_read", source.bytes_read)
    if source.bytes_read is not None:
        distinct = {id(t): t for t, _ in parallel.state_layouts().values()}  # a tied weight once
        held = sum(t.numel() * t.element_size() for t in distinct.values())
        logger.info(
            "read %.2f MiB of the safetensors checkpoint on this rank (it holds %.2f MiB of parameters and buffers)",
            source.bytes_read / 2**20,
            held / 2**20,
        )
    return parallel


def _build_module(cap, plan, comm, source, device, local_inputs) -> ParallelModule:
    """Lower the plan for this rank, load its weights, and wrap both as a ParallelModule."""
    records = plan.node_by_name
    program = lower_to_local(cap.graph, records, comm, device=device, bucket_grads=True)
    weights, by_placeholder, strided = load_local_weights(
        cap, records, comm, source, device, exported=cap.exported, tied=tied_placeholders(cap)
    )
    # the module keys parameters and buffers by FQN, inputs by placeholder name
    specs = {(cap.params.get(name) or cap.buffers.get(name) or name): spec for name, spec in by_placeholder.items()}
    input_specs = {
        n.name: by_placeholder[n.name] for n in cap.graph.nodes if n.op == "placeholder" and info(n).kind == "input"
    }
    return ParallelModule(
        program=program,
        plan=plan,
        comm=comm,
        captured=cap,
        local_params=dict(weights.params.values()),
        local_buffers=dict(weights.buffers.values()),
        specs={**specs, **input_specs},
        strided=strided,
        local_inputs=local_inputs,
        global_shapes=weights.global_shapes,
    )


def shard_batch(batch, model: ParallelModule):
    """Cut a global batch the way ``model``'s plan wants its inputs (for ``local_inputs=True``)."""
    return model.shard_batch(batch)
