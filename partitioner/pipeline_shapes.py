"""A pipeline's stage plans serving other microbatch shapes: the last partial batch, a shorter sequence.

A pipeline's stages are captured, planned and lowered on one microbatch of the example inputs.
The runner (:class:`runtime.pipeline.PipelineRunner`) cuts any batch into its schedule's
microbatches like ``torch.tensor_split`` (the first ``B % m`` one sample more, each microbatch's
loss weighted by its share of the samples); a microbatch of other shapes than the captured one
asks :class:`StageShapes` for programs, once per shape:

1. capture the model on that microbatch and cut it into stages as the pipeline was cut
   (:func:`partitioner.captures.captured_stages`: inside ``keep_captures`` a parent may have made it);
2. check that every stage has the structure it was planned with (ops, wiring, weights:
   :func:`passes.capture.capture.graph_fingerprint` without shapes) and the same names, and that each
   rank still gets a piece of every sharded dim (:func:`passes.analysis.shape_check.check_servable`; a
   dim that does not divide is cut unevenly, as lowering handles for one-stage plans). Every
   rank checks every stage, so a refusal is raised on all ranks alike, before any message;
3. lower this rank's stages with their plans' records at the new shapes, and give the receive
   buffers each rank's own piece of every activation (:func:`passes.core.placements.rank_local_shape`:
   the rank before, at the same stage-mesh coordinates, sends that piece).

A shape whose capture has another structure (a microbatch of one sample: export specialises
size-1 dims) is refused naming the stage, with what to do. The weights are the stages' own, so
training across shapes steps one set of parameters.
"""

from __future__ import annotations

import logging

from partitioner.captures import captured_stages
from passes.analysis.analyze import info
from passes.analysis.shape_check import check_servable
from passes.capture.capture import graph_fingerprint
from passes.core.placements import parse_spec, rank_local_shape
from passes.lower.lower_to_local import lower_to_local
from runtime.reshard import Reshard

__all__ = ["StageShapes", "receive_buffers"]

logger = logging.getLogger(__name__)


def receive_buffers(graphs, plans, sub) -> dict:
    """Activation -> (this rank's piece's shape, dtype): what its receive buffer holds."""
    carried = {}
    for g, plan in zip(graphs, plans):
        for node in g.captured.graph.nodes:
            if node.op == "placeholder" and node.name in g.activation_inputs:
                spec = parse_spec(plan.node_by_name[node.name].out[0], len(sub.shape))
                shape = rank_local_shape(info(node).shape, spec, sub.shape, sub.coords)
                carried[node.name] = (tuple(shape), info(node).dtype)
    return carried


class StageShapes:
    """``(microbatch) -> ({stage: program}, receive buffers)`` for this rank's stages at the
    microbatch's shapes (the runner's ``specialize`` hook)."""

    def __init__(self, model, *, graphs, plans, owned, sub, device, layers, precision, sequence_parallel):
        self.model, self.graphs, self.plans, self.owned = model, graphs, plans, list(owned)
        self.sub, self.device, self.layers = sub, device, layers
        self.precision, self.sequence_parallel = precision, sequence_parallel
        self.structure = [graph_fingerprint(g.captured, shapes=False) for g in graphs]

    def __call__(self, microbatch) -> tuple:
        autocast_dtype = self.precision.autocast_dtype if self.precision is not None else None
        cap, graphs, _ = captured_stages(
            self.model,
            microbatch,
            len(self.graphs),
            layers=self.layers,
            autocast_dtype=autocast_dtype,
            sequence_parallel=self.sequence_parallel,
        )
        shapes = {info(n).name: tuple(info(n).shape) for n in cap.graph.nodes if info(n).kind == "input"}
        self._check_structure(graphs, shapes)
        records = [{r["name"]: r for r in plan.records} for plan in self.plans]
        for g, stage_records in zip(graphs, records):  # every stage on every rank: all refuse alike
            check_servable(g.captured, stage_records, self.sub.shape, self.sub.axis_names)
        programs = {}
        for s in self.owned:
            program = lower_to_local(graphs[s].captured.graph, records[s], self.sub, device=self.device)
            for edge in program.modules():
                if isinstance(edge, Reshard) and edge.param_edge is not None and self.precision is not None:
                    edge.reduce_dtype = self.precision.grad_reduce_dtype
            programs[s] = program
        logger.info("pipeline: serving microbatches of %s with the stage plans", shapes)
        return programs, receive_buffers(graphs, self.plans, self.sub)

    def _check_structure(self, graphs, shapes) -> None:
        if len(graphs) != len(self.graphs):
            raise ValueError(
                f"microbatches of {shapes} cut into {len(graphs)} pipeline stages, not the {len(self.graphs)} "
                f"this pipeline was planned with; pass batches whose microbatches keep the model's layers"
            )
        for s, (new, old) in enumerate(zip(graphs, self.graphs)):
            same_names = (new.inputs, new.outputs, new.receives, new.sends) == (
                old.inputs,
                old.outputs,
                old.receives,
                old.sends,
            )
            if not same_names or graph_fingerprint(new.captured, shapes=False) != self.structure[s]:
                raise ValueError(
                    f"pipeline stage {s} captured on microbatches of {shapes} is another program than the one "
                    f"planned (export specialises some sizes, e.g. a microbatch of one sample); pass batches "
                    f"whose microbatches have at least 2 samples (for a DataLoader's last batch: drop_last=True), "
                    f"or build the pipeline for this shape"
                )
