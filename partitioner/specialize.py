"""One parallel model, many call signatures: other batch and sequence sizes, and eval mode.

A lowered program bakes in the shapes and the training mode it was captured with. The first
time a :class:`runtime.parallel_module.ParallelModule` is called with another (mode, input
shapes) pair, it asks a :class:`Specializer` for a program that serves it, and keeps it:

1. capture the user's model in that mode on inputs of those shapes (its mode is put back after;
   :func:`partitioner.captures.captured`, so inside ``keep_captures`` a parent may have made it),
   without measuring MoE routing (a forward pass of the whole model): step 2 reads none;
2. if the graph has the plan's structure (the same ops and wiring: another batch or sequence
   size), the plan's own records serve it, once :func:`passes.analysis.shape_check.check_servable` has
   found every rank a piece of each sharded dim (a dim that no longer divides is cut unevenly,
   the first ranks one element more; one smaller than its pieces raises a
   :class:`~passes.analysis.shape_check.ShapeMismatchError` naming the input, the dim and the mesh axis);
3. otherwise (eval mode drops or changes nodes: dropout, batch-norm statistics) rank 0 plans the
   new graph with every parameter and buffer pinned to the placement it is stored in, so the
   weights the optimizer holds serve every program, and every node the two graphs share (same
   name, op and shapes) pinned to its placement in the plan, so only what changed is decided
   anew; the layouts of fused projections must agree too, or the call is refused (rank 0
   measures the routing on the call's inputs first: the new plan prices expert parallelism by it);
4. lower the records for this rank.

Every rank makes the same calls in the same order (SPMD), so the re-plan's broadcast lines up.
"""

from __future__ import annotations

import contextlib
import json
import logging

import torch

from partitioner.captures import captured, with_routing
from passes.analysis.analyze import info
from passes.analysis.shape_check import check_servable
from passes.capture.capture import graph_fingerprint
from passes.core.placements import format_spec, parse_spec
from passes.lower.lower_to_local import lower_to_local
from passes.lower.strided_layout import strided_parameters
from passes.rules import op_name
from runtime.collectives import on_rank0
from runtime.parallel_module import Variant

__all__ = ["Specializer", "in_mode"]

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def in_mode(model: torch.nn.Module, training: bool):
    """``model`` in train (``True``) or eval mode for the block; its own modes are put back."""
    modes = {m: m.training for m in model.modules()}
    model.train(training)
    try:
        yield model
    finally:
        for module, mode in modes.items():
            module.training = mode


class Specializer:
    """Capture, check or re-plan, and lower the model for a new (mode, input shapes)."""

    def __init__(self, model, *, plan, comm, device, layers, param_specs: dict, strided: dict, plan_kwargs: dict):
        self.model, self.plan, self.comm, self.device, self.layers = model, plan, comm, device, layers
        self.param_specs = param_specs  # FQN -> placement the weight is stored in
        self.strided = strided  # FQN -> {axis: pieces}
        self.plan_kwargs = plan_kwargs  # cluster, memory_budget, objective for a re-plan
        self.structure = plan.data.get("structure")

    def __call__(self, training: bool, args, kwargs) -> Variant:
        if args and kwargs:
            raise TypeError(
                "a call with both positional and keyword arguments cannot be captured again; pass the "
                "inputs the way the example inputs were passed"
            )
        inputs = dict(kwargs) if kwargs else tuple(args)
        with in_mode(self.model, training):
            cap = captured(
                self.model,
                inputs,
                layers=self.layers,
                autocast_dtype=self.plan.precision.autocast_dtype,
                sequence_parallel=self.plan.data.get("sequence_parallel"),
                expert_capacity=self.plan.data.get("expert_capacity"),
                routing=False,
            )
        shapes = {info(n).name: info(n).shape for n in cap.graph.nodes if info(n).kind == "input"}
        mode = "train" if training else "eval"
        if self.structure is not None and graph_fingerprint(cap, shapes=False) == self.structure:
            records = {r["name"]: r for r in self.plan.records}
            check_servable(cap, records, self.comm.shape, self.comm.axis_names)
            logger.info("serving %s mode, inputs %s, with the plan made for %s", mode, shapes, self.plan.data["inputs"])
        else:
            records = self._replan(cap, training, inputs)
        program = lower_to_local(cap.graph, records, self.comm, device=self.device, bucket_grads=True)
        specs = {name: parse_spec(records[name]["out"][0], self.comm.ndim) for name in cap.user_inputs}
        return Variant(program, cap, specs)

    def _replan(self, cap, training: bool, inputs) -> dict:
        """Plan ``cap`` (captured in ``training`` mode on ``inputs``) on rank 0 with the weights
        pinned where they are stored."""
        from partitioner.api import plan_captured
        from partitioner.sharding_plan import ShardingPlan

        mode = "train" if training else "eval"
        old = self.plan.node_by_name
        shared = {}
        for node in cap.graph.nodes:
            record = old.get(node.name)
            if (
                record
                and record.decision == "leader"
                and len(record.out) == 1
                and record.out[0]
                and record.target == (op_name(node.target) if node.op == "call_function" else node.op)
                and [list(s) if s is not None else None for s in info(node).out_shapes] == record.shapes
            ):
                shared[node.name] = record.out[0]
        pins = {}
        for table in (cap.params, cap.buffers):
            for placeholder, fqn in table.items():
                if fqn not in self.param_specs:
                    raise ValueError(
                        f"the model in {mode} mode uses {fqn}, which the parallel model does not hold; "
                        f"make the parallel model in {mode} mode"
                    )
                pins[placeholder] = format_spec(self.param_specs[fqn])
        logger.info("planning the %s-mode program with the weights where they are stored", mode)

        def make_plan():
            with in_mode(self.model, training):
                with_routing(self.model, inputs, cap)

            def solve(fixed):
                return plan_captured(
                    cap,
                    model_name=self.plan.data.get("model", "model") + f" ({mode})",
                    mesh_shape=self.comm.shape,
                    mesh_axis_names=self.comm.axis_names,
                    pins=fixed,
                    **self.plan_kwargs,
                ).to_json()

            try:
                return solve({**shared, **pins})
            except ValueError as e:  # a shared node's placement is unreachable in the new graph
                logger.info("the %s-mode graph cannot keep every shared placement (%s); keeping the weights'", mode, e)
                return solve(pins)

        plan = ShardingPlan.from_dict(json.loads(on_rank0(make_plan, f"planning the {mode}-mode program")))
        records = {r["name"]: r for r in plan.records}
        strided = strided_parameters(cap.graph, records, self.comm)
        for fqn in cap.params.values():
            if strided.get(fqn) != self.strided.get(fqn):
                raise ValueError(
                    f"in {mode} mode {fqn} would need another layout ({strided.get(fqn)} instead of "
                    f"{self.strided.get(fqn)}); make the parallel model in {mode} mode"
                )
        return records
