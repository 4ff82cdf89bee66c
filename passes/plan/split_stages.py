"""Inter-op planning: cut a captured graph into pipeline stages at layer boundaries.

Stages come from a dynamic program, not the ILP (decision 6 in docs/ARCHITECTURE.md). The
units are the repeated blocks found by :mod:`passes.capture.blocks` (transformer layers); everything
before the first block joins the first stage and everything after the last block joins the
last stage. A dynamic program over contiguous runs of layers minimises the slowest stage
(each layer priced by the cost model's compute time), which for a uniform transformer gives
cuts that differ by at most one layer. The graph is then split with
``torch.fx.passes.split_module`` using a ``node -> stage`` callback (never by hand).

:class:`StageGraph` describes one stage: its fx GraphModule, which placeholders are
parameters, buffers, user inputs or activations from earlier stages, and which values it
hands on. Values that skip stages (attention masks, position ids, residuals) are carried
through the stages in between, so every stage exchanges data only with its neighbours.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import cast

import torch.fx as fx
from torch.fx.passes.split_module import split_module

from passes.analysis.analyze import info
from passes.capture.blocks import find_blocks
from passes.capture.capture import CapturedGraph
from passes.plan.output_placement import STAGE_BOUNDARY

__all__ = ["StageGraph", "assign_stages", "balance_layers", "split_stages"]


@dataclass
class StageGraph:
    index: int
    captured: CapturedGraph
    """The stage's program as a capture (params/buffers/inputs named), ready to plan."""
    inputs: list = field(default_factory=list)
    """Placeholder names in call order."""
    activation_inputs: list = field(default_factory=list)
    """Placeholders that carry values from earlier stages."""
    outputs: list = field(default_factory=list)
    """Value names this stage's program returns, in order."""
    receives: list = field(default_factory=list)
    """Values arriving from the previous stage (its ``sends``)."""
    sends: list = field(default_factory=list)
    """Values handed to the next stage: produced here or carried through."""
    layers: tuple = ()

    @property
    def takes_activations(self) -> bool:
        """Whether the stage's program uses floating-point values of earlier stages (analysed
        graph). If not (the first stage; one that only passes values on), a zero-bubble I pass
        has nothing to compute, and the stage's whole backward is its W."""

        def floating(n: fx.Node) -> bool:
            dtype = info(n).dtype
            return dtype is not None and dtype.is_floating_point

        return any(
            n.op == "placeholder" and n.name in self.activation_inputs and floating(n)
            for n in self.captured.graph.nodes
        )


def balance_layers(costs: list, stages: int) -> list:
    """Split ``costs`` (one per layer, in order) into ``stages`` contiguous runs minimising the
    largest run (dynamic programming, O(stages * layers^2)). Returns run lengths."""
    n = len(costs)
    if stages > n:
        raise ValueError(f"{stages} pipeline stages need at least {stages} layers; the model has {n}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n + 1):
            for i in range(s - 1, j):
                value = max(best[s - 1][i], prefix[j] - prefix[i])
                if value < best[s][j] - 1e-15:
                    best[s][j], cut[s][j] = value, i
    lengths, j = [], n
    for s in range(stages, 0, -1):
        i = cut[s][j]
        lengths.append(j - i)
        j = i
    return lengths[::-1]


def assign_stages(cap: CapturedGraph, stages: int, node_cost=None) -> tuple:
    """``node -> stage`` for every op, and the layer indices of each stage."""
    blocks = find_blocks(cap.graph)
    if not blocks.groups:
        raise ValueError(
            "pipeline parallelism cuts at repeated layers (an nn.ModuleList of identical blocks); this model has none"
        )
    group = max(blocks.groups, key=lambda g: len(g.indices))
    node_cost = node_cost or (lambda n: info(n).flops)
    ops = [n for n in cap.graph.nodes if n.op == "call_function"]
    position = {n: i for i, n in enumerate(cap.graph.nodes)}
    in_group = {n for members in group.members for n in members}
    first = min(position[n] for n in in_group if n.op == "call_function")
    last = max(position[n] for n in in_group if n.op == "call_function")
    layer_costs = [sum(node_cost(n) for n in members if n.op == "call_function") for members in group.members]
    # the ops before the first layer ride with it, those after the last layer with it
    layer_costs[0] += sum(node_cost(n) for n in ops if position[n] < first)
    layer_costs[-1] += sum(node_cost(n) for n in ops if position[n] > last and n not in in_group)
    return stages_of_layers(cap, balance_layers(layer_costs, stages), blocks)


def stages_of_layers(cap: CapturedGraph, lengths: list, blocks=None) -> tuple:
    """``node -> stage`` for every op and each stage's layer indices, for stages that hold runs
    of ``lengths`` repeated layers, in order (the ops before the first layer go with the first
    stage, those after the last layer with the last)."""
    blocks = blocks or find_blocks(cap.graph)
    group = max(blocks.groups, key=lambda g: len(g.indices))
    position = {n: i for i, n in enumerate(cap.graph.nodes)}
    in_group = {n for members in group.members for n in members}
    last = max(position[n] for n in in_group if n.op == "call_function")
    layer_stage: list = []
    for s, length in enumerate(lengths):
        layer_stage += [s] * length
    stage_of, current = {}, 0
    for node in cap.graph.nodes:
        if node.op != "call_function":
            continue
        owner = blocks.block_of.get(node)
        if owner is not None and owner[0] is group:
            current = layer_stage[owner[1]]
        elif position[node] > last:
            current = len(lengths) - 1
        stage_of[node] = current
    runs, k = [], 0
    for length in lengths:
        runs.append(tuple(group.indices[k : k + length]))
        k += length
    return stage_of, runs


def split_stages(cap: CapturedGraph, stage_of: dict, runs) -> list:
    """Split with ``split_module`` and describe each stage's inputs, outputs and carried values."""
    top = split_module(cap.graph_module, cap.graph_module, lambda n: stage_of[n], keep_original_order=True)
    calls = [n for n in top.graph.nodes if n.op == "call_module"]
    stage_graphs = []
    for k, call in enumerate(calls):
        sub = getattr(top, call.target)
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        params = {p.name: cap.params[p.name] for p in placeholders if p.name in cap.params}
        buffers = {p.name: cap.buffers[p.name] for p in placeholders if p.name in cap.buffers}
        others = [p.name for p in placeholders if p.name not in params and p.name not in buffers]
        staged = CapturedGraph(
            graph_module=sub,
            exported=None,
            params=params,
            buffers=buffers,
            user_inputs=others,
            input_names={n: cap.input_names.get(n, n) for n in others},
            training=cap.training,
            autocast_dtype=cap.autocast_dtype,
        )
        activation = [n for n in others if n not in cap.user_inputs]
        if k < len(calls) - 1:  # its outputs go to later stages as placed (partial sums reduced)
            sub.graph.find_nodes(op="output")[0].meta[STAGE_BOUNDARY] = True
        stage_graphs.append(
            StageGraph(
                index=k,
                captured=staged,
                inputs=[p.name for p in placeholders],
                activation_inputs=activation,
                layers=runs[k] if k < len(runs) else (),
            )
        )
    # outputs of each stage, named by the consumers' placeholder names
    for k, call in enumerate(calls):
        returned = getattr(top, call.target).graph.find_nodes(op="output")[0].args[0]
        stage_graphs[k].outputs = [None] * (len(returned) if isinstance(returned, (list, tuple)) else 1)
    for call in calls:
        sub = getattr(top, call.target)
        names = [n.name for n in sub.graph.nodes if n.op == "placeholder"]
        for arg, name in zip(call.args, names):
            src, index = arg, 0
            if isinstance(arg, fx.Node) and arg.op == "call_function" and arg.target is operator.getitem:
                src, index = arg.args[0], cast(int, arg.args[1])  # getitem's position
            if isinstance(src, fx.Node) and src.op == "call_module":
                k = calls.index(src)
                stage_graphs[k].outputs[index] = name
    final = top.graph.find_nodes(op="output")[0].args[0]
    last = len(calls) - 1
    for i, value in enumerate(final if isinstance(final, (list, tuple)) else [final]):
        src, index = value, 0
        if isinstance(value, fx.Node) and value.op == "call_function" and value.target is operator.getitem:
            src, index = value.args[0], cast(int, value.args[1])
        if not (isinstance(src, fx.Node) and calls.index(src) == last):
            raise ValueError("every model output must be computed by the last pipeline stage")
        if stage_graphs[last].outputs[index] is None:
            stage_graphs[last].outputs[index] = f"__output{i}"
    # carried values: produced before stage s, used at or after stage s
    for s, stage in enumerate(stage_graphs):
        needed_later = {n for t in stage_graphs[s + 1 :] for n in t.activation_inputs}
        available = [n for n in (stage.receives + stage.outputs) if n in needed_later]
        stage.sends = list(dict.fromkeys(available))
        if s + 1 < len(stage_graphs):
            stage_graphs[s + 1].receives = stage.sends
    return stage_graphs
