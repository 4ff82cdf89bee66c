"""The capture step (export, analysis, attention fusion), and captures kept for reuse.

:func:`captured` is the capture step of :func:`partitioner.plan` and
:func:`partitioner.auto_parallelize`: ``capture_model`` (torch.export), ``analyze`` and
``fuse_for`` (eager attention fused where ring or Ulysses is forced).

Every rank of a job captures the model it runs (the graph is what it lowers). A process that
captures a model more than once (previewing with ``plan`` and then running it; a parent that
plans and then forks its ranks with ``runtime.launch.run_on_ranks``, each running
``auto_parallelize``) may keep the first capture inside ``with keep_captures():`` and reuse it:

* a capture made inside the block is kept until the outermost block ends; a forked process
  inherits the captures its parent kept (and the block, when it forks inside one);
* a kept capture is reused only for the same model object (by identity, while it is alive) in
  the same mode, with the same parameter and buffer layout (names, shapes, dtypes, devices,
  ``requires_grad``), the same example inputs (the tree, each tensor's shape, dtype, strides,
  device and ``requires_grad``, each other value) and the same capture options (``layers``,
  the autocast dtype, the sequence-parallel mode, the expert capacity). The graph does not depend on weight values
  (export refuses control flow that reads them), so they may change in between.

:func:`capture` runs the step with the options of a ``plan``/``auto_parallelize`` call, so that
a later call with those options on the same model reuses it::

    with keep_captures():
        capture(model, inputs, precision="bf16")              # once, in the parent
        run_on_ranks(worker, 4, model, inputs)                # each rank: auto_parallelize(model, inputs,
                                                              #   mesh=(2, 2), precision="bf16") reuses it

A pipelined call (``pipeline=``) captures one microbatch and cuts it into stages; inside the
block that capture and its stage graphs are kept the same way (:func:`kept`, keyed also by the
number of stages), and :func:`partitioner.pipeline_parallelize.capture_pipeline` makes them in the
parent.

Outside the block nothing is kept: every call captures afresh, as it always did.

MoE routing (:func:`passes.analysis.expert_routing.measure_routing`: a forward pass of the whole
model on the example batch) is what a plan prices expert parallelism by; lowering a plan reads
none of it. So it is measured only where a plan is made: :func:`captured` measures it unless
asked not to (``routing=False``: the ranks that receive rank 0's plan, a plan serving another
input shape), and :func:`with_routing` measures it later on a capture made without it, once.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref

import torch
from torch.utils import _pytree as pytree

from partitioner.options import PlanOptions
from passes.analysis.analyze import analyze
from passes.analysis.expert_routing import measure_routing, routing_of
from passes.capture.capture import describe_captured
from passes.capture.capture_blocks import capture_model
from passes.capture.eager_attention import fuse_for
from passes.plan.split_stages import assign_stages, split_stages

__all__ = ["capture", "captured", "captured_stages", "keep_captures", "kept", "with_routing"]

logger = logging.getLogger(__name__)

_kept: dict | None = None  # key -> (weak reference to the model, capture) while keep_captures() is active


@contextlib.contextmanager
def keep_captures():
    """Keep the captures made inside for reuse by later captures of the same model (see the module)."""
    global _kept
    outermost = _kept is None
    if outermost:
        _kept = {}
    try:
        yield
    finally:
        if outermost:
            _kept = None


def capture(model: torch.nn.Module, example_inputs, **options):
    """The capture a ``plan``/``auto_parallelize`` call with these keyword ``options`` makes of
    ``model`` (in its current mode), kept for that call inside :func:`keep_captures` (a pipelined
    call's: :func:`partitioner.pipeline_parallelize.capture_pipeline`)."""
    opts = PlanOptions.from_call(None, **options)
    return captured(
        model,
        example_inputs,
        layers=opts.layers,
        autocast_dtype=opts.precision_policy.autocast_dtype,
        sequence_parallel=opts.sequence_parallel,
        expert_capacity=opts.expert_capacity,
    )


def captured(
    model,
    example_inputs,
    *,
    layers,
    autocast_dtype,
    sequence_parallel,
    expert_capacity=None,
    routing: bool = True,
    timings: dict | None = None,
):
    """Export, analyse and fuse ``model`` (or reuse the capture kept for the same call, see the
    module), its MoE routing measured if ``routing``. ``timings`` (if given) receives
    ``capture_s`` and ``analysis_s``."""
    sequence_parallel = sequence_parallel or "auto"
    made = []

    def make():
        made.append(True)
        return _capture(
            model, example_inputs, layers, autocast_dtype, sequence_parallel, expert_capacity, routing, timings
        )

    cap = kept(model, example_inputs, ("whole", layers, autocast_dtype, sequence_parallel, expert_capacity), make)
    if not made:
        if routing:  # kept by a call that did not measure it
            with_routing(model, example_inputs, cap)
        if timings is not None:
            timings.update(capture_s=0.0, analysis_s=0.0)
    return cap


def with_routing(model, example_inputs, cap):
    """``cap`` with its MoE layers' routing on ``example_inputs`` measured, unless it already is
    (a capture made by :func:`captured` with ``routing=False``; see the module). Call it with
    ``model`` in the mode ``cap`` was captured in."""
    if not routing_of(cap.graph):
        measure_routing(model, example_inputs, cap)
    return cap


def captured_stages(model, microbatch, stages: int, *, layers, autocast_dtype, sequence_parallel) -> tuple:
    """A pipeline's capture: ``model`` exported on one ``microbatch``, analysed, eager attention
    fused where ring or Ulysses is forced, and cut into ``stages`` at layer boundaries:
    (capture, stage graphs, layer runs). Kept like :func:`captured` (keyed also by ``stages``): the
    pipeline builder and a pipeline serving another microbatch shape
    (:class:`partitioner.pipeline_shapes.StageShapes`) both come here."""
    sequence_parallel = sequence_parallel or "auto"

    def make():
        cap = capture_model(model, microbatch, layers=layers, autocast_dtype=autocast_dtype)
        analyze(cap)
        fuse_for(cap, sequence_parallel)
        stage_of, runs = assign_stages(cap, stages)
        graphs = split_stages(cap, stage_of, runs)
        for g in graphs:
            analyze(g.captured)
        logger.info("pipeline: layers per stage %s", [list(run) for run in runs])
        return cap, graphs, runs

    return kept(model, microbatch, ("stages", stages, layers, autocast_dtype, sequence_parallel), make)


def kept(model, example_inputs, what: tuple, make):
    """``make()``, or inside :func:`keep_captures` what an earlier ``make`` returned for the same
    model object, the same parameter/buffer/input layout and the same ``what`` (the options the
    result depends on)."""
    if _kept is None:
        return make()
    key = (id(model), what, _layout(model, example_inputs))
    hit = _kept.get(key)
    if hit is not None and hit[0]() is model:
        logger.info("capture: reusing the one kept for %s (keep_captures)", type(model).__name__)
        return hit[1]
    value = make()
    _kept[key] = (weakref.ref(model), value)
    return value


def _capture(model, example_inputs, layers, autocast_dtype, sequence_parallel, expert_capacity, routing, timings):
    """Export, analyse, measure routing (if ``routing``) and fuse: one capture, timed into ``timings``."""
    t0 = time.perf_counter()
    logger.info("capturing %s with torch.export ...", type(model).__name__)
    cap = capture_model(
        model, example_inputs, layers=layers, autocast_dtype=autocast_dtype, expert_capacity=expert_capacity
    )
    t1 = time.perf_counter()
    logger.info("capture: %.2f s (%s)", t1 - t0, describe_captured(cap))
    analyze(cap)
    if routing:
        measure_routing(model, example_inputs, cap)
    fuse_for(cap, sequence_parallel)
    t2 = time.perf_counter()
    logger.info("analysis: %.2f s", t2 - t1)
    if timings is not None:
        timings.update(capture_s=t1 - t0, analysis_s=t2 - t1)
    return cap


def _layout(model: torch.nn.Module, example_inputs) -> tuple:
    """What a capture depends on besides the model's code and the options: its parameters' and
    buffers' layout, every module's mode, and the example inputs' structure and metadata."""

    def tensor(t: torch.Tensor) -> tuple:
        return tuple(t.shape), t.dtype, t.device.type, t.requires_grad

    params = tuple((n, *tensor(p)) for n, p in model.named_parameters(remove_duplicate=False))
    buffers = tuple((n, *tensor(b)) for n, b in model.named_buffers(remove_duplicate=False))
    modes = tuple(m.training for m in model.modules())
    leaves, spec = pytree.tree_flatten(example_inputs)
    inputs = tuple((*tensor(x), x.stride()) if isinstance(x, torch.Tensor) else repr(x) for x in leaves)
    return params, buffers, modes, inputs, str(spec)
