"""``partitioner.dump``: write a plan and its partitioned programs where people can read them.

For a running :class:`runtime.parallel_module.ParallelModule`, each rank writes its own
lowered program (``rank_<r>.py``, the fx GraphModule's Python source with the module repr of
every collective); rank 0 also writes the plan. For a :class:`ShardingPlan` alone it writes
the plan files, and, given the model and example inputs, lowers the plan for any ranks of any
mesh size in this one process (code generation runs no collective, so no process group is
needed). Files:

* ``plan.json`` (the plan, replayable), ``plan.txt`` (summary table and estimate),
  ``report.html`` (the plan explorer, one self-contained page: :mod:`partitioner.report`);
* ``graph.dot`` and, when Graphviz's ``dot`` is installed, ``graph.svg``: the graph with nodes
  coloured by their placement and every edge that communicates drawn red and labelled with
  its collectives; repeated layers drawn once, mask/index rows left out
  (:mod:`partitioner.plan_dot`);
* ``rank_<r>.py`` per rank; for a pipelined plan (the configuration search's), ``stage_<s>/rank_<r>.py``
  per stage and rank that runs it, the model cut into the plan's stages as the search cut it.

For a pipeline runner: per stage its plan files under ``stage_<s>/`` and each rank's programs
there; ``schedule.txt`` (the schedule and its grid); after a ``train_step``, the last step's
timeline measured beside the one the cost model simulates (``timeline.txt``: per stage and
action simulated vs measured with their ratio, and the cluster the simulation was priced with;
``timeline.json`` for chrome://tracing or Perfetto; ``timeline.svg``) and ``report.html``, the
whole pipeline's report (:func:`partitioner.pipeline_plan.runner_plan`) with the measured step
drawn under the simulated one.
"""

from __future__ import annotations

import shutil
import subprocess
import warnings
from pathlib import Path

from partitioner.plan_dot import plan_to_dot
from partitioner.sharding_plan import ShardingPlan

__all__ = ["dump", "plan_to_dot"]


def _write_plan_files(plan: ShardingPlan, out: Path) -> list:
    written = [plan.save(out / "plan.json")]
    (out / "plan.txt").write_text(plan.summary() + "\n")
    written.append(out / "plan.txt")
    written.append(plan.report(out / "report.html"))
    dot = out / "graph.dot"
    dot.write_text(plan_to_dot(plan))
    written.append(dot)
    if shutil.which("dot"):
        svg = out / "graph.svg"
        subprocess.run(["dot", "-Tsvg", str(dot), "-o", str(svg)], check=True, timeout=300)
        written.append(svg)
    else:
        warnings.warn(
            "Graphviz 'dot' is not installed: wrote graph.dot but no graph.svg "
            "(apt-get install graphviz, then `dot -Tsvg graph.dot -o graph.svg`)",
            stacklevel=3,
        )
    return written


def _program_text(program, rank, coords, plan) -> str:
    header = (
        f"# Partita lowered program for rank {rank} (mesh coordinates {tuple(coords)} on mesh "
        f"{plan.mesh_shape} {plan.axis_names})\n# Submodules (collectives and local kernels):\n"
    )
    modules = "".join(f"#   {name}: {module!r}\n" for name, module in program.named_children())
    return header + modules + program.code


def _dump_pipeline(runner, out: Path) -> list:
    """Per stage: its plan files (rank 0) and, per rank, the programs of the stages it runs;
    the schedule as a grid; the last step's timeline beside the simulated one, if a step ran."""
    import torch.distributed as dist

    from partitioner.pipeline_simulation import simulated_timeline
    from runtime import pipeline_trace

    rank = dist.get_rank() if dist.is_initialized() else 0
    written = []
    if rank == 0:
        for s, plan in enumerate(runner.plan["stages"]):
            stage_dir = out / f"stage_{s}"
            stage_dir.mkdir(exist_ok=True)
            written += _write_plan_files(plan, stage_dir)
        (out / "schedule.txt").write_text(
            f"{runner.schedule}\n\n{runner.schedule.grid()}\nlayers per stage: {runner.plan['layers']}\n"
        )
        written.append(out / "schedule.txt")
    for s, stage in runner.stages.items():
        path = out / f"stage_{s}" / f"rank_{rank}.py"
        path.parent.mkdir(exist_ok=True)
        path.write_text(_program_text(stage.program, rank, stage.comm.coords, stage.plan))
        written.append(path)
    if runner.trace:
        measured, simulated = pipeline_trace.measured_timeline(runner), simulated_timeline(runner)
        cluster = pipeline_trace.pricing_cluster(runner)
        timelines = {"measured": measured, f"simulated (cost model, cluster {cluster})": simulated}
        if rank == 0:
            device = next((p.device.type for p in runner.parameters()), "cpu")
            (out / "timeline.txt").write_text(
                pipeline_trace.comparison_text(
                    measured, simulated, cluster=cluster, device=device, schedule=str(runner.schedule.name)
                )
            )
            (out / "timeline.json").write_text(pipeline_trace.chrome_trace(timelines))
            (out / "timeline.svg").write_text(pipeline_trace.timeline_svg(timelines))
            written += [out / "timeline.txt", out / "timeline.json", out / "timeline.svg"]
    if rank == 0:  # the whole pipeline's report, with the measured step when one ran
        from partitioner.pipeline_plan import runner_plan

        trace = out / "timeline.json" if runner.trace else None
        written.append(runner_plan(runner).report(out / "report.html", trace=trace))
    return written


def dump(model_or_plan, directory, *, model=None, example_inputs=None, ranks=None) -> list:
    """Write the plan and the per-rank programs under ``directory``; returns the files written.

    ``model_or_plan``: a ParallelModule (inside a job: each rank writes its own program), or a
    ShardingPlan (with ``model`` and ``example_inputs`` to also lower it for ``ranks``, default
    every rank of a mesh of up to 8 devices, else the first and the last).
    """
    from runtime.parallel_module import ParallelModule
    from runtime.pipeline import PipelineRunner

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(model_or_plan, PipelineRunner):
        return _dump_pipeline(model_or_plan, out)
    if isinstance(model_or_plan, ParallelModule):
        pm = model_or_plan
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        written = _write_plan_files(pm.plan, out) if rank == 0 else []
        path = out / f"rank_{rank}.py"
        path.write_text(_program_text(pm.program, rank, pm.comm.coords, pm.plan))
        return written + [path]
    if not isinstance(model_or_plan, ShardingPlan):
        raise TypeError(f"dump takes a ParallelModule or a ShardingPlan, got {type(model_or_plan).__name__}")
    plan = model_or_plan
    written = _write_plan_files(plan, out)
    if model is None:
        return written
    if example_inputs is None:
        raise ValueError("dump(plan, dir, model=...) also needs example_inputs= to capture the model")
    from passes.analysis.analyze import analyze
    from passes.capture.capture import graph_fingerprint
    from passes.capture.capture_blocks import capture_model
    from passes.capture.eager_attention import fuse_for
    from passes.lower.lower_to_local import lower_to_local
    from runtime.collectives import MeshComm

    cap = capture_model(model, example_inputs)
    analyze(cap)
    fuse_for(cap, plan.data.get("sequence_parallel") or "auto")
    plan.check_fingerprint(graph_fingerprint(cap), f"{type(model).__name__} on these inputs")
    ranks = _ranks_to_lower(plan, ranks)
    if plan.stage_plans:
        return written + _dump_stage_programs(plan, model, example_inputs, out, ranks)
    records = plan.node_by_name
    for rank in ranks:
        comm = MeshComm.for_codegen(plan.mesh_shape, plan.axis_names, rank)
        program = lower_to_local(cap.graph, records, comm)
        path = out / f"rank_{rank}.py"
        path.write_text(_program_text(program, rank, comm.coords, plan))
        written.append(path)
    return written


def _ranks_to_lower(plan: ShardingPlan, ranks) -> list:
    """``ranks`` checked against the plan's mesh; by default every rank of a mesh of up to 8
    devices, else the first and the last."""
    size = 1
    for n in plan.mesh_shape:
        size *= n
    ranks = list(ranks) if ranks is not None else (list(range(size)) if size <= 8 else [0, size - 1])
    for rank in ranks:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not on mesh {plan.mesh_shape} ({size} ranks)")
    return ranks


def _dump_stage_programs(plan: ShardingPlan, model, example_inputs, out: Path, ranks: list) -> list:
    """A pipelined plan's programs: the model cut into the plan's stages as the configuration
    search cut it (:func:`partitioner.simulate_ranks.plan_graphs`), and each stage's plan lowered
    for each of ``ranks`` (global ranks: ``pp`` coordinate first) that runs the stage, as
    ``stage_<s>/rank_<r>.py``."""
    import passes.schedules as ps
    from partitioner.simulate_ranks import plan_graphs
    from passes.capture.capture import graph_fingerprint
    from passes.lower.lower_to_local import lower_to_local
    from runtime.collectives import MeshComm

    if plan.config is None:
        raise ValueError(
            "dump lowers a pipelined plan's stages as the configuration search cut them; this plan was "
            "made by a pipeline runner: dump the runner (partitioner.dump(runner, directory)) instead"
        )
    pipe = plan.data["pipeline"]
    graphs = plan_graphs(plan, model, example_inputs)
    stages = plan.stage_plans
    sub = 1
    for n in stages[0].mesh_shape:
        sub *= n
    schedule = ps.SCHEDULES[pipe["schedule"]].make(pipe["degree"], pipe["microbatches"], pipe["virtual_stages"])
    written = []
    for s, (stage, k) in enumerate(zip(stages, pipe["stage_map"])):
        stage.check_fingerprint(graph_fingerprint(graphs[k]), f"stage {s} of {type(model).__name__}")
        for rank in ranks:
            pp, sub_rank = divmod(rank, sub)
            if schedule.stage_to_rank[s] != pp:
                continue
            comm = MeshComm.for_codegen(stage.mesh_shape, stage.axis_names, sub_rank)
            program = lower_to_local(graphs[k].graph, stage.node_by_name, comm)
            path = out / f"stage_{s}" / f"rank_{rank}.py"
            path.parent.mkdir(exist_ok=True)
            path.write_text(_program_text(program, rank, comm.coords, stage))
            written.append(path)
    return written
