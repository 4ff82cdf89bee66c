"""The search space of the intra-op solver: decision groups, their options and their costs.

Built from an analysed graph, a mesh and a cluster:

1. **Leaders and followers.** Each node that decides its own placement is a *leader*: a
   placeholder (parameter, buffer, input), an op whose rule is not a follower (contractions,
   norms, embedding, loss, factories), an op with data inputs from several groups, and every
   pinned node. A node whose data inputs all come from one group in the same block instance,
   and whose rule allows it, *follows*: for each option of the group it takes its best
   response (per mesh axis, the rule's candidate that matches the incoming placements, else
   the one cheapest to reshard into), so it adds no variable (decision 5).
2. **Options.** A leader's options are its rule's candidates combined over mesh axes (and
   placeholders: every ``Shard(d)``/``Replicate`` combination that divides evenly), filtered by
   pins. A follower's choice is recorded per option of its group.
3. **Costs** in seconds: per group and option, the compute of every member (forward and
   backward) plus the resharding inside the group; per pair of groups, a matrix over
   (producer output placement, consumer input placement) classes with the forward reshard and
   its backward mirror (:mod:`passes.plan.cost_model`). Memory per option: parameter state and
   saved activations.
4. **Repeated blocks** are built once: only representatives (:mod:`passes.capture.blocks`) get groups;
   every real node and edge adds its representative's cost, weighted by how often it occurs.
"""

from __future__ import annotations

import logging
import operator

import numpy as np
import torch.fx as fx

from passes.analysis.analyze import info
from passes.capture.blocks import Blocks
from passes.core.rule_options import RuleOptions
from passes.plan.edge_costs import build_edges
from passes.plan.node_options import SpaceBuilder
from passes.plan.space_types import Group, NodeChoice, StrategySpace
from passes.plan.zero_storage import check_zero
from passes.rules import rule_for, tensor_input_nodes

__all__ = ["build_space"]

logger = logging.getLogger(__name__)


def _is_getitem(node):
    return node.op == "call_function" and node.target is operator.getitem


def build_space(
    graph: fx.Graph,
    blocks: Blocks,
    mesh_shape,
    cluster,
    *,
    pins=None,
    optimizer="adam",
    max_options="auto",
    activation_copies: int = 1,
    grad_reduce_bytes: int | None = None,
    zero="auto",
    zero1: bool = True,
    offload: bool = False,
    microbatches: int = 1,
    rule_options: RuleOptions | None = None,
    regather_activations: bool = False,
) -> StrategySpace:
    """``max_options``: cap on an op leader's options (lowest compute kept); ``"auto"`` caps at
    24 on meshes of 3 or more axes, where an op can have over 200 combinations, and not
    below that; ``None`` never caps (the solve is then exact over the whole space).
    ``activation_copies``: how many microbatches' saved activations are alive at once (a
    pipeline stage under its schedule; 1 otherwise), multiplying the activation memory.
    ``grad_reduce_bytes``: bytes per element of parameter gradient syncs (a reduce dtype).
    ``microbatches``: the microbatches of a step this graph runs (a pipeline stage): the parameter
    gradient syncs it holds back run once per step, so one microbatch is priced ``1 /
    microbatches`` of them (:func:`passes.plan.cost_model.grad_held_back`: the all-reduces; a
    reduce-scatter onto a weight stored sharded runs in every microbatch, priced whole).
    ``zero``: how a parameter stored sharded and gathered for use treats its gathered copies:
    ``"auto"`` (the solver chooses per parameter: kept for backward, ZeRO-2, or freed after
    forward and gathered again, ZeRO-3; or the compute copy whole and the optimizer state
    sharded, ZeRO-1), ``1``, ``2`` or ``3`` (only that). ``zero1``: offer ZeRO-1 at all (False
    for pipeline stages, whose runtime keeps no compute copies). ``offload``: offer each
    parameter option an offloaded twin (optimizer state and step in host memory).
    ``rule_options``: the algorithm modes the rules honour (:class:`passes.core.rule_options.RuleOptions`,
    for this mesh); None: none forced, the solver chooses.
    ``regather_activations``: activations gathered for an op that keeps them are kept as their
    shard and gathered again in backward (:mod:`passes.plan.activation_regather`)."""
    check_zero(zero)
    if max_options == "auto":
        max_options = 24 if len(mesh_shape) >= 3 else None
    if activation_copies < 1:
        raise ValueError(f"activation_copies must be >= 1, got {activation_copies}")
    b = SpaceBuilder(
        graph,
        blocks,
        mesh_shape,
        cluster,
        pins or {},
        optimizer,
        max_options,
        activation_copies,
        grad_reduce_bytes,
        zero,
        zero1,
        offload,
        microbatches,
        rule_options,
        regather_activations,
    )
    groups, group_of = _form_groups(graph, blocks, b)
    _price_groups(groups, blocks)
    edges = build_edges(graph, b, groups, group_of)
    return StrategySpace(
        grad_reduce_bytes=grad_reduce_bytes,
        groups=groups,
        edges=edges,
        group_of=group_of,
        blocks=blocks,
        mesh_shape=tuple(mesh_shape),
        cluster=cluster,
        pruned=b.pruned,
        optimizer=optimizer,
        regather_activations=regather_activations,
        microbatches=microbatches,
    )


def _form_groups(graph: fx.Graph, blocks: Blocks, b: SpaceBuilder) -> tuple:
    """The decision groups, in graph order: a follower (a getitem, or an op whose rule may
    follow, all of whose data inputs come from one group of the same block instance, unpinned)
    joins that group, each option extended by how it follows; any other node leads a group of
    its own, with its rule's options. Returns (groups, representative node -> group index)."""
    rep = blocks.represent
    group_of: dict = {}
    groups: list = []

    def same_instance(a, c):
        return blocks.block_of.get(a, (None, None)) == blocks.block_of.get(c, (None, None))

    for node in graph.nodes:
        if rep(node) is not node:
            continue
        i = info(node)
        if i.kind in ("ignored", "output"):
            continue
        data_inputs = [a for a in tensor_input_nodes(node) if info(a).kind not in ("ignored",)]
        rule = rule_for(node) if node.op == "call_function" else None
        source_groups = {group_of.get(rep(a)) for a in data_inputs}
        leader_here = None
        if node.op == "call_function" and node not in b.pins and data_inputs and len(source_groups) == 1:
            gi = source_groups.pop()
            if (
                gi is not None
                and (_is_getitem(node) or (rule is not None and rule.follower))
                and all(same_instance(a, node) for a in data_inputs)
                and same_instance(groups[gi].leader, node)
            ):
                leader_here = gi
        if leader_here is not None:
            g = groups[leader_here]
            for opt in g.options:  # an input is keyed by its representative (a tied weight's other name)
                if _is_getitem(node):
                    src = opt[rep(node.args[0])]
                    opt[node] = NodeChoice(strategy=None, out=(src.out[node.args[1]],), ins=(None,))
                else:
                    opt[node] = b.follow(node, [opt[rep(a)].out[0] for a in tensor_input_nodes(node)])
            g.members.append(node)
            group_of[node] = leader_here
            continue
        options = b.leader_options(node)
        groups.append(Group(leader=node, members=[node], options=[{node: c} for c in options]))
        group_of[node] = len(groups) - 1

    return groups, group_of


def _price_groups(groups: list, blocks: Blocks) -> None:
    """Each group's seconds, bytes and host bytes per option: its members' sums, times the
    number of repeated blocks it decides for."""
    for g in groups:
        g.count = blocks.count.get(g.leader, 1)
        g.cost = (
            np.array(
                [sum(opt[m].compute_s + opt[m].extra_s + opt[m].inbound_s for m in g.members) for opt in g.options]
            )
            * g.count
        )
        g.memory = np.array([sum(opt[m].memory for m in g.members) for opt in g.options]) * g.count
        g.host_memory = np.array([sum(opt[m].host_memory for m in g.members) for opt in g.options]) * g.count
