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

import dataclasses
import fnmatch
import functools
import itertools
import operator
from dataclasses import dataclass

import numpy as np
import torch.fx as fx

from passes.analysis.analyze import info
from passes.capture.blocks import Blocks
from passes.core.placements import R, Shard, dual_spec, is_shard, replicated, spec_fits, zero1_grad_spec
from passes.core.rule_options import RuleOptions
from passes.plan.activation_regather import regathers_activation
from passes.plan.cost_model import (
    allocation_time,
    backward_factor,
    collective_time,
    compute_time,
    dtype_bytes,
    edge_allocates,
    edge_gathers,
    grad_held_back,
    host_copy_time,
    local_bytes,
    own_collectives,
    param_state_bytes,
    param_state_parts,
    reshard,
    saved_bytes,
)
from passes.rules import Strategy, expand_to_mesh, multidim_tp, op_view, rule_for, tensor_input_nodes

__all__ = [
    "zero1_collectives",
    "zero1_grad_spec",
    "NodeChoice",
    "Group",
    "EdgeCost",
    "StrategySpace",
    "build_space",
    "edge_collectives",
    "required_output_spec",
    "STAGE_BOUNDARY",
    "ZERO_MODES",
    "check_zero",
    "zero1_placements",
    "regathers",
    "zero_mode",
]


def _is_parameter(node) -> bool:
    """A parameter, or a view of one (``W.t()`` feeding a matmul)."""
    while node.op == "call_function" and getattr(rule_for(node), "is_view", False):
        inputs = tensor_input_nodes(node)
        if len(inputs) != 1:
            return False
        node = inputs[0]
    return info(node).kind == "param"


@dataclass(frozen=True)
class NodeChoice:
    """One node's placements under one option of its group."""

    strategy: object
    """The Strategy (None for placeholders, getitem and outputs)."""
    out: tuple
    """A spec per output."""
    ins: tuple
    """The spec each tensor input must arrive in (None: metadata only / no data)."""
    compute_s: float = 0.0
    """Forward + backward compute."""
    weight_grad_s: float = 0.0
    """The part of ``compute_s`` that computes parameter gradients (a contraction's weight
    product); what a zero-bubble schedule can defer to its W pass."""
    extra_s: float = 0.0
    """The op's own collectives (``AxisStrategy.extra``), forward and backward."""
    inbound_s: float = 0.0
    """Resharding into this node inside its group (followers only)."""
    memory: float = 0.0
    forward_s: float = 0.0
    """The forward part of ``compute_s``: what recomputing the node (activation checkpointing)
    runs again."""
    forward_comm_s: float = 0.0
    """The forward part of ``extra_s + inbound_s``: the collectives a recomputation repeats."""
    regather: bool = False
    """A parameter stored sharded whose copies gathered for use are freed after forward and
    gathered again for backward (ZeRO-3), instead of being kept for backward (ZeRO-2)."""
    stored: tuple | None = None
    """ZeRO-1: the placement of the shard the optimizer steps (``Shard`` on the data-parallel axes
    where the compute copy ``out[0]`` is replicated); None: the parameter is stored as used."""
    offload: bool = False
    """The tensor the optimizer steps (the parameter, or its ZeRO-1 shard) lives in host memory with
    its gradient and optimizer state; the device keeps a compute copy and its gradient."""
    host_memory: float = 0.0
    """Bytes of host memory the option holds (offloaded optimizer state, parameter and gradient)."""


@dataclass
class Group:
    leader: fx.Node
    members: list
    options: list
    """options[i][node] -> NodeChoice for each member."""
    cost: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    """Seconds per option (all members, times ``count``); priced once the groups are formed."""
    memory: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    """Bytes per option, likewise."""
    host_memory: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    """Host-memory bytes per option (offloaded optimizer state), likewise."""
    count: int = 1

    def choice(self, i: int, node) -> NodeChoice:
        return self.options[i][node]


@dataclass
class EdgeCost:
    """Cost between two groups, factored through placement classes."""

    src: int
    dst: int
    src_class: np.ndarray
    """option of src -> class index."""
    dst_class: np.ndarray
    matrix: np.ndarray
    """[src classes, dst classes] seconds (already multiplied by occurrence counts)."""
    memory: np.ndarray | None = None
    """[src classes, dst classes] bytes of the buffers the edge makes that backward keeps (a
    weight gathered for use and saved by its matmul), likewise multiplied; None: none."""

    def full(self) -> np.ndarray:
        return self.matrix[np.ix_(self.src_class, self.dst_class)]

    def full_memory(self) -> np.ndarray:
        if self.memory is None:
            return np.zeros((len(self.src_class), len(self.dst_class)))
        return self.memory[np.ix_(self.src_class, self.dst_class)]


@dataclass
class StrategySpace:
    groups: list
    edges: list
    group_of: dict
    """representative node -> group index."""
    blocks: Blocks
    mesh_shape: tuple
    cluster: object
    pruned: int = 0
    """Options dropped by the ``max_options`` cap (0: the space is complete)."""
    grad_reduce_bytes: int | None = None
    """Bytes per element parameter gradients are reduced in (None: the parameter's own dtype)."""
    optimizer: str | None = None
    """The optimizer the plan is made for (``"adam"``, ``"sgd"``, None)."""
    regather_activations: bool = False
    """Activations gathered for an op that keeps them are kept as their shard and gathered again
    in backward (:mod:`passes.plan.activation_regather`)."""


def _options_for_placeholder(shape, mesh_shape) -> list:
    per_axis = [R] + [Shard(d) for d, s in enumerate(shape or ()) if s > 1]
    specs = []
    for combo in itertools.product(per_axis, repeat=len(mesh_shape)):
        if spec_fits(shape or (), combo, mesh_shape):
            specs.append(tuple(combo))
    return specs


@functools.lru_cache(maxsize=1 << 16)
def edge_collectives(
    src_spec,
    dst_spec,
    grad_spec,
    shape,
    elem,
    mesh_shape,
    requires_grad,
    from_param=False,
    grad_reduce_bytes=None,
    grad_dst=None,
):
    """(forward collectives, backward collectives) for a tensor moving along one edge.

    Backward collectives on an edge leaving a parameter are its gradient synchronisation,
    marked ``bucketed``, sent in ``grad_reduce_bytes`` per element when given (a reduce dtype).
    ``grad_dst``: where the gradient must arrive (default: the dual of ``src_spec``; a ZeRO-1
    weight's edges leave it ``Partial`` on the axes its optimizer shard is cut on).
    """
    fwd = reshard(src_spec, dst_spec, shape, mesh_shape, elem)
    grad_elem = grad_reduce_bytes if from_param and grad_reduce_bytes else elem
    bwd = (
        reshard(grad_spec, grad_dst or dual_spec(src_spec), shape, mesh_shape, grad_elem)
        if requires_grad and grad_spec is not None
        else []
    )
    if from_param:
        bwd = [dataclasses.replace(c, bucketed=True) for c in bwd]
    return tuple(fwd), tuple(bwd)


def _compute_copy_bytes(param) -> int:
    """Bytes per element of the low-precision compute copy autocast makes of a parameter (and
    keeps for backward) when an op using it computes in a narrower float dtype; 0 otherwise.
    Counted at the stored piece's size (a weight gathered for use copies the gathered size)."""
    elem = dtype_bytes(info(param).dtype)
    user_dtypes = [info(user).dtype for user in param.users if user.op == "call_function"]
    narrower = [dtype_bytes(d) for d in user_dtypes if d is not None and d.is_floating_point and dtype_bytes(d) < elem]
    return min(narrower) if narrower else 0


class _Builder:
    def __init__(
        self,
        graph,
        blocks,
        mesh_shape,
        cluster,
        pins,
        optimizer,
        max_options=None,
        activation_copies=1,
        grad_reduce_bytes=None,
        zero="auto",
        zero1=True,
        offload=False,
        microbatches=1,
        rule_options=None,
        regather_activations=False,
    ):
        self.graph = graph
        self.regather_activations = regather_activations
        self.zero = zero
        self.zero1 = zero1
        self.offload = offload
        self.microbatches = microbatches
        self.grad_reduce_bytes = grad_reduce_bytes
        self.activation_copies = activation_copies
        self.max_options = max_options
        self.pruned = 0
        self.blocks = blocks
        self.mesh = tuple(mesh_shape)
        self.rule_options = rule_options if rule_options is not None else RuleOptions(mesh_shape=self.mesh)
        assert self.rule_options.mesh_shape == self.mesh, (self.rule_options, self.mesh)
        self.cluster = cluster
        self.pins = pins  # node -> spec (output placement)
        self.optimizer = optimizer
        self._axis_cache = {}
        self._edge_cache = {}
        self._inputs = {}
        self._views = {}

    def inputs_of(self, node):
        if node not in self._inputs:
            self._inputs[node] = tensor_input_nodes(node)
        return self._inputs[node]

    def view_of(self, node):
        if node not in self._views:
            self._views[node] = op_view(node, self.rule_options)
        return self._views[node]

    # -- costs of one node ------------------------------------------------------------
    def edge_memory(self, u, src, dst, grad, consumer, k, regather=False) -> float:
        """Bytes of the buffer the edge ``u -> consumer`` (input ``k``) makes, when ``consumer``
        keeps that input for backward (see :func:`passes.plan.cost_model.edge_allocates`); none for a
        ZeRO-3 parameter's gathered copy (freed after forward, gathered again for backward); for
        an activation gathered again in backward, the shard it keeps instead
        (:mod:`passes.plan.activation_regather`)."""
        saves = info(consumer).saves
        if saves is None or k not in saves.inputs or src is None or dst is None:
            return 0.0
        ui = info(u)
        if regather and ui.kind == "op":
            if regathers_activation(consumer, k, u, src, dst, self.mesh):
                return self.activation_copies * local_bytes(ui.shape or (), src, self.mesh, dtype_bytes(ui.dtype))
        elif regather and edge_gathers(src, dst, self.mesh):
            return 0.0
        grad = grad if ui.requires_grad else None
        if not edge_allocates(src, dst, grad, self.mesh, requires_grad=ui.requires_grad, from_param=ui.kind == "param"):
            return 0.0
        return self.activation_copies * local_bytes(ui.shape or (), dst, self.mesh, dtype_bytes(ui.dtype))

    def regather_time(self, u, src, dst, consumer, k) -> float:
        """Seconds of gathering a ZeRO-3 parameter (or an activation kept as its shard) again in
        backward for ``consumer``, which keeps input ``k`` (the forward's gather, once more)."""
        if info(u).kind == "op":
            if not regathers_activation(consumer, k, u, src, dst, self.mesh):
                return 0.0
        elif not regathers(consumer, k, src, dst, self.mesh):
            return 0.0
        return self.edge_time(src, dst, None, u)

    def time_of(self, collectives) -> float:
        return sum(collective_time(c, self.mesh, self.cluster) for c in collectives)

    def edge_time(self, src_spec, dst_spec, grad_spec, producer: fx.Node, out_index=0, grad_dst=None) -> float:
        i = info(producer)
        shape = i.out_shapes[out_index] if i.out_shapes else ()
        key = (src_spec, dst_spec, grad_spec, shape, i.dtype, i.requires_grad, i.kind == "param", grad_dst)
        t = self._edge_cache.get(key)
        if t is None:
            fwd, bwd = edge_collectives(
                src_spec,
                dst_spec,
                grad_spec,
                shape,
                dtype_bytes(i.dtype),
                self.mesh,
                i.requires_grad,
                from_param=i.kind == "param",
                grad_reduce_bytes=self.grad_reduce_bytes,
                grad_dst=grad_dst,
            )
            # a pipeline stage's all-reduced gradient sync runs once per step: a microbatch's
            # share of it (a reduce-scatter onto a weight stored sharded runs every microbatch)
            held = i.kind == "param" and self.microbatches > 1 and grad_held_back(src_spec, grad_spec, self.mesh)
            share = 1.0 / self.microbatches if held else 1.0
            t = self._edge_cache[key] = self.time_of(fwd) + share * self.time_of(bwd)
        return t

    def op_cost(self, node, strategy: Strategy):
        """(compute seconds fwd+bwd, own collectives' seconds, activation bytes, seconds of the
        backward that make parameter gradients, (forward compute, forward collectives' seconds))
        for an op node under a strategy."""
        rule = rule_for(node)
        i = info(node)
        op = self.view_of(node)
        split = strategy.compute_split(self.mesh)
        mem_bytes = alloc_fwd = alloc_bwd = 0.0
        if not getattr(rule, "is_view", False):
            inputs = self.inputs_of(node)
            for k, (shape, dt, spec) in enumerate(zip(op.in_shapes, op.in_dtypes, strategy.ins)):
                if shape is not None and spec is not None:
                    nbytes = local_bytes(shape, spec, self.mesh, dtype_bytes(dt))
                    mem_bytes += nbytes
                    if k < len(inputs) and info(inputs[k]).requires_grad:  # backward allocates its gradient
                        alloc_bwd += allocation_time(nbytes, self.cluster)
            for shape, spec in zip(op.out_shapes, strategy.out):
                if shape is not None:
                    nbytes = local_bytes(shape, spec, self.mesh, dtype_bytes(i.dtype))
                    mem_bytes += nbytes
                    alloc_fwd += allocation_time(nbytes, self.cluster)
        fwd = compute_time(
            i.flops / split * rule.work_scale(op, strategy, self.mesh),
            mem_bytes,
            i.dtype,
            rule.contraction,
            self.cluster,
            i.rate_key,
            rule.rate_shape(op, strategy, self.mesh),
        )
        bwd = weight = 0.0
        if i.requires_grad:
            grads_in = sum(1 for a in self.inputs_of(node) if info(a).requires_grad)
            bwd = backward_factor(rule.contraction, grads_in) * fwd + alloc_bwd
            if rule.contraction and any(_is_parameter(a) and info(a).requires_grad for a in self.inputs_of(node)):
                weight = fwd
        fwd += alloc_fwd
        extra_fwd = extra_bwd = 0.0
        own = own_collectives(strategy.axes, dtype_bytes(i.dtype), self.mesh, self.cluster, split, fwd, bwd)
        for _, phase, t in own:
            if phase == "fwd":
                extra_fwd += t
            else:
                extra_bwd += t
        placed = list(zip(op.in_shapes, strategy.ins))
        share = rule.buffer_share(op, placed, self.mesh)
        act = self.activation_copies * saved_bytes(i, strategy.out, self.mesh, placed, share)
        extra = extra_fwd + (extra_bwd if i.requires_grad else 0.0)
        return fwd + bwd, extra, act, weight, (fwd, extra_fwd)

    # -- followers --------------------------------------------------------------------
    def axis_candidates(self, node):
        if node not in self._axis_cache:
            self._axis_cache[node] = rule_for(node).axis_strategies(self.view_of(node))
        return self._axis_cache[node]

    def follow(self, node, given: list) -> NodeChoice:
        """Best response of ``node`` to its inputs arriving with specs ``given``."""
        candidates = self.axis_candidates(node)
        chosen = []
        for ax in range(len(self.mesh)):
            want = tuple(None if g is None else g[ax] for g in given)
            exact = next(
                (c for c in candidates if all(w is None or p is None or w == p for w, p in zip(want, c.ins))), None
            )
            if exact is None:
                best, best_t = None, None
                for c in candidates:
                    t = 0.0
                    for k, (g, p) in enumerate(zip(given, c.ins)):
                        if g is None or p is None:
                            continue
                        target = g[:ax] + (p,) + g[ax + 1 :]
                        prod = self.inputs_of(node)[k]
                        t += self.edge_time(g, target, None, prod)
                    if best_t is None or t < best_t:
                        best, best_t = c, t
                exact = best
            chosen.append(exact)
        strategy = Strategy.from_axes(chosen)
        op = self.view_of(node)
        fits = all(s is None or spec_fits(s, sp, self.mesh) for s, sp in zip(op.out_shapes, strategy.out)) and all(
            sp is None or s is None or spec_fits(s, sp, self.mesh) for s, sp in zip(op.in_shapes, strategy.ins)
        )
        if not fits:
            strategy = Strategy.from_axes([candidates[0]] * len(self.mesh))
        return self.choice_for(node, strategy, given)

    def choice_for(self, node, strategy: Strategy, given=None) -> NodeChoice:
        compute, extra, act, weight, (forward, forward_comm) = self.op_cost(node, strategy)
        inbound = 0.0
        if given is not None:  # resharding inside the group, on the way into this node
            for k, (g, want) in enumerate(zip(given, strategy.ins)):
                if g is not None and want is not None:
                    u = self.inputs_of(node)[k]
                    inbound += self.edge_time(g, want, strategy.grad_spec(k), u)
                    act += self.edge_memory(u, g, want, strategy.grad_spec(k), node, k)
                    forward_comm += self.edge_time(g, want, None, self.inputs_of(node)[k])
        return NodeChoice(
            strategy=strategy,
            out=strategy.out,
            ins=strategy.ins,
            compute_s=compute,
            weight_grad_s=weight,
            extra_s=extra,
            inbound_s=inbound,
            memory=act,
            forward_s=forward,
            forward_comm_s=forward_comm,
        )

    # -- leaders ----------------------------------------------------------------------
    def _may_regather(self, node, spec) -> bool:
        """A ZeRO-3 twin for a parameter stored sharded on some axis, unless autocast computes
        from a low-precision copy of it (the copy, not the gathered weight, is what backward
        keeps)."""
        sharded = any(is_shard(p) and n > 1 for p, n in zip(spec, self.mesh))
        return sharded and not _compute_copy_bytes(node)

    def _zero1_option(self, node, kept: NodeChoice) -> NodeChoice | None:
        """The ZeRO-1 twin of a parameter option (None where none applies): the compute copy
        stays as placed, the optimizer's shard is cut on the axes where it is replicated
        (:func:`zero1_placements`). Its price: the gradient reduce-scattered into the shard and
        the shard all-gathered into the copy, once per step each (both bucketed: one flat
        collective per axis); its memory: the copy and its gradient whole, the shard with its
        gradient and optimizer state (fewer bytes than replicated when the optimizer has state)."""
        i = info(node)
        if not self.zero1 or self.optimizer != "adam" or not i.requires_grad:
            return None
        spec = kept.out[0]
        stored = zero1_placements(spec, i.shape, self.mesh)
        if stored is None:
            return None
        elem = dtype_bytes(i.dtype)
        rs, ag = zero1_collectives(spec, stored, i.shape, elem, self.mesh, self.grad_reduce_bytes)
        whole = local_bytes(i.shape, spec, self.mesh, elem)
        memory = kept.memory - param_state_bytes(whole / elem, elem, self.optimizer)
        memory += 2 * whole + param_state_bytes(local_bytes(i.shape, stored, self.mesh, 1), elem, self.optimizer)
        return dataclasses.replace(kept, stored=stored, memory=memory, extra_s=self.time_of(rs) + self.time_of(ag))

    def _offload_option(self, node, c: NodeChoice) -> NodeChoice:
        """The offloaded twin of a parameter option: the tensor the optimizer steps (the parameter,
        or its ZeRO-1 shard) with its gradient and optimizer state in host memory, the device
        keeping a compute copy and its gradient. Its price: once per step, the gradient copied to
        the host and the stepped tensor back (over ``cluster.host()``), after the reduction a
        compute copy needs (:func:`zero1_collectives`)."""
        i = info(node)
        elem = dtype_bytes(i.dtype)
        spec, stored = c.out[0], c.stored or c.out[0]
        host = sum(param_state_parts(local_bytes(i.shape, stored, self.mesh, 1), elem, self.optimizer))
        whole = local_bytes(i.shape, spec, self.mesh, elem)
        device = c.memory - host + (0.0 if c.stored is not None else 2 * whole)
        extra = c.extra_s
        if c.stored is None:  # the gradient's reduction moves from the edges to the step's end
            rs, _ = zero1_collectives(spec, spec, i.shape, elem, self.mesh, self.grad_reduce_bytes)
            extra += self.time_of(rs)
        extra += host_copy_time(local_bytes(i.shape, stored, self.mesh, elem), self.cluster)
        return dataclasses.replace(c, offload=True, memory=device, host_memory=host, extra_s=extra)

    def leader_options(self, node) -> list:
        i = info(node)
        pin = self.pins.get(node)
        if node.op == "placeholder":
            specs = _options_for_placeholder(i.shape, self.mesh)
            if pin is not None:
                specs = [s for s in specs if s == pin] or [pin]
            elif i.kind == "param":  # 3D's weights: stored W/p, cut innermost over the rows axis
                aliases = [n for n, r in self.blocks.rep.items() if r is node and n.op == "placeholder"]
                specs = multidim_tp.storage_options(node, specs, self.rule_options, aliases)
            choices = []
            for spec in specs:
                elem = dtype_bytes(i.dtype)
                if i.kind == "param":
                    numel = local_bytes(i.shape, spec, self.mesh, 1)
                    mem = param_state_bytes(numel, elem, self.optimizer)
                    mem += numel * _compute_copy_bytes(node)
                else:
                    mem = local_bytes(i.shape, spec, self.mesh, elem)
                kept = NodeChoice(strategy=None, out=(spec,), ins=(), memory=mem)
                mode = zero_mode(self.zero, i.name) if i.kind == "param" else 2
                # a pin names where the weight is stored: a pinned weight has no ZeRO-1 twin
                zero1 = self._zero1_option(node, kept) if mode in ("auto", 1) and pin is None else None
                if mode not in (1, 2) and self._may_regather(node, spec):
                    if mode != 3:
                        choices.append(kept)
                    choices.append(dataclasses.replace(kept, regather=True))
                elif zero1 is None or mode != 1:
                    choices.append(kept)
                if zero1 is not None:
                    choices.append(zero1)
            if self.offload and i.kind == "param" and i.requires_grad and self.optimizer is not None:
                choices += [self._offload_option(node, c) for c in choices if not c.regather]
            return choices
        op = self.view_of(node)
        strategies = expand_to_mesh(self.axis_candidates(node), op, self.mesh)
        if pin is not None:
            strategies = [s for s in strategies if s.out[0] == pin]
            if not strategies:
                raise ValueError(
                    f"pinned placement {pin} is not reachable for node {node.name} "
                    f"({i.module_path or 'top level'}, op {node.target}) with shape {i.shape}"
                )
        strategies = [s for s in strategies if multidim_tp.allowed(node, s, self.rule_options)]
        if not strategies:
            raise ValueError(
                f"tensor_parallel={self.rule_options.tensor_parallel!r}: no strategy of node {node.name} "
                f"({i.module_path or 'top level'}, op {node.target}) with shape {i.shape} fits the grid"
            )
        choices = [self.choice_for(node, s) for s in strategies]
        if self.max_options and len(choices) > self.max_options:
            # Keep the options that split the most work (stable: rules list R first, so ties
            # keep the simpler ones). Only 3-D and larger meshes get here by default.
            order = sorted(range(len(choices)), key=lambda k: (choices[k].compute_s, choices[k].memory))
            keep = sorted(set(order[: self.max_options]) | multidim_tp.grid_options(node, strategies, self.mesh))
            self.pruned += len(choices) - len(keep)
            choices = [choices[k] for k in keep]
        return choices


ZERO_MODES = ("auto", 1, 2, 3)


def zero1_placements(spec, shape, mesh_shape):
    """The placement of a ZeRO-1 weight's optimizer shard, for a compute copy placed ``spec``:
    ``Shard(d)`` on every mesh axis (of more than one device) where ``spec`` replicates, ``d`` the
    first dim no axis of ``spec`` cuts whose size those axes divide; None when there is no such
    axis or dim."""
    axes = [a for a, (p, n) in enumerate(zip(spec, mesh_shape)) if not is_shard(p) and n > 1]
    if not axes or not shape:
        return None
    cut = {p.dim for p in spec if is_shard(p)}
    ways = 1
    for a in axes:
        ways *= mesh_shape[a]
    d = next((d for d, s in enumerate(shape) if d not in cut and s % ways == 0), None)
    if d is None:
        return None
    return tuple(Shard(d) if a in axes else p for a, p in enumerate(spec))


@functools.lru_cache(maxsize=1 << 12)
def zero1_collectives(spec, stored, shape, elem, mesh_shape, grad_reduce_bytes=None):
    """(reductions, all-gathers) a weight with a compute copy placed ``spec`` runs once per step
    for the tensor the optimizer steps, placed ``stored``: its gradient, summed over the step's
    backward passes in the copy's layout, reduced into that tensor's gradient (reduce-scattered
    into a ZeRO-1 shard; all-reduced where ``stored`` is ``spec``), in ``grad_reduce_bytes`` per
    element when given, and the stepped tensor all-gathered into the copy (ZeRO-1). Bucketed:
    the runtime sends one flat buffer per axis."""
    grad_elem = grad_reduce_bytes or elem
    rs = reshard(zero1_grad_spec(spec, mesh_shape), stored, shape, mesh_shape, grad_elem)
    ag = reshard(stored, spec, shape, mesh_shape, elem)
    return (
        tuple(dataclasses.replace(c, bucketed=True) for c in rs),
        tuple(dataclasses.replace(c, bucketed=True) for c in ag),
    )


def regathers(consumer, k, src, dst, mesh_shape) -> bool:
    """Whether backward gathers input ``k`` of ``consumer`` again when it comes from a ZeRO-3
    parameter placed ``src``: the edge gathers and the consumer keeps that input for backward
    (outside a recomputed layer, which the caller decides)."""
    saves = info(consumer).saves
    if saves is None or k not in saves.inputs or src is None or dst is None:
        return False
    if not rule_for(consumer).keeps_saved_input(consumer, k, dst):
        return False
    return edge_gathers(src, dst, mesh_shape)


def check_zero(zero):
    """``zero``: one of :data:`ZERO_MODES`, or a dict of parameter-name patterns (``fnmatch``,
    as pins) to modes, the first match deciding (parameters no pattern matches: ``"auto"``)."""
    modes = zero.values() if isinstance(zero, dict) else [zero]
    bad = [m for m in modes if m not in ZERO_MODES]
    if bad or (isinstance(zero, dict) and not all(isinstance(k, str) for k in zero)):
        raise ValueError(
            f"zero must be one of {ZERO_MODES} or a dict of parameter name patterns to them (1: a weight "
            f"replicated on a data-parallel axis keeps its compute copy whole and its optimizer state sharded; "
            f"for a parameter stored sharded and gathered for use: 2 keeps the gathered copy for backward, 3 "
            f"frees it after forward and gathers it again in backward; 'auto' lets the solver choose), got {zero!r}"
        )
    return zero


def zero_mode(zero, name: str):
    """The mode ``zero`` (see :func:`check_zero`) gives the parameter named ``name``."""
    if not isinstance(zero, dict):
        return zero
    return next((mode for pattern, mode in zero.items() if fnmatch.fnmatchcase(name, pattern)), "auto")


STAGE_BOUNDARY = "partita_stage_boundary"
"""Key set (True) in the output node's meta of a pipeline stage whose outputs feed later stages."""


def required_output_spec(graph: fx.Graph, index: int, placed):
    """The placement output ``index`` (among the output node's tensor inputs) must leave the
    program in, given the placement ``placed`` its producer has; ``None``: it leaves as placed.

    Every rank must see the same loss, so scalar outputs are always replicated. When the model
    returns a scalar (a training loss), its other outputs (logits, hidden states) are left where
    the plan puts them, as Megatron leaves vocab-parallel logits: gathering them every step would
    cost more than the rest of the step. A model with no scalar output has all its outputs
    replicated, except a pipeline stage (:data:`STAGE_BOUNDARY`): its outputs go to the next
    stage as placed, partial sums reduced first (:func:`passes.core.placements.dual_spec`), so a rank
    sends its own piece to the rank at the same sub-mesh coordinates of the next stage.
    """
    out = next(n for n in graph.nodes if n.op == "output")
    values = tensor_input_nodes(out)
    if info(values[index]).shape == ():
        return replicated(len(placed))
    if out.meta.get(STAGE_BOUNDARY):
        return dual_spec(placed)
    if any(info(n).shape == () for n in values):
        return None
    return replicated(len(placed))


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
    b = _Builder(
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
    edges = _build_edges(graph, b, groups, group_of)
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
    )


def _form_groups(graph: fx.Graph, blocks: Blocks, b: _Builder) -> tuple:
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
            for opt in g.options:
                if _is_getitem(node):
                    src = opt[node.args[0]]
                    opt[node] = NodeChoice(strategy=None, out=(src.out[node.args[1]],), ins=(None,))
                else:
                    given = []
                    for a in tensor_input_nodes(node):
                        c = opt[a]
                        given.append(c.out[0])
                    opt[node] = b.follow(node, given)
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


def _grad_dst(choice: NodeChoice, mesh_shape):
    """Where gradients along the edges leaving a node so placed arrive (None: the dual of its
    placement); a ZeRO-1 weight's stay ``Partial`` on its shard's axes (:func:`zero1_grad_spec`)."""
    held = choice.stored is not None or choice.offload
    return zero1_grad_spec(choice.out[0], mesh_shape) if held else None


def _classes(values):
    index, classes = {}, []
    for v in values:
        if v not in index:
            index[v] = len(index)
        classes.append(index[v])
    return list(index), np.array(classes, dtype=np.int64)


def _build_edges(graph, b: _Builder, groups, group_of) -> list:
    rep = b.blocks.represent
    pending: dict = {}  # (rep_u, rep_v, k) -> occurrences
    for node in graph.nodes:
        i = info(node)
        if i.kind in ("ignored",) or node.op == "placeholder":
            continue
        rv = rep(node)
        if node.op != "output" and group_of.get(rv) is not None and groups[group_of[rv]].leader is not rv:
            continue  # follower: its input edges are inside its group
        inputs = tensor_input_nodes(node)
        for k, u in enumerate(inputs):
            if info(u).kind == "ignored" or group_of.get(rep(u)) is None:
                continue
            key = (rep(u), rv, k)
            pending[key] = pending.get(key, 0) + 1

    by_pair: dict = {}
    for (u, v, k), occurrences in pending.items():
        gu = group_of[u]
        again_u = b.regather_activations and info(u).kind == "op"  # else: a ZeRO-3 parameter option's
        src_specs = [
            (opt[u].out[0], opt[u].regather or again_u, _grad_dst(opt[u], b.mesh)) for opt in groups[gu].options
        ]
        if v.op == "output":
            wanted = [required_output_spec(b.graph, k, s) for s, _, _ in src_specs]
            if all(w is None for w in wanted):
                continue
            costs = np.array(
                [0.0 if w is None else b.edge_time(s, w, None, u) for (s, _, _), w in zip(src_specs, wanted)]
            )
            groups[gu].cost = groups[gu].cost + costs * occurrences
            continue
        gv = group_of[v]
        dst = [
            (opt[v].ins[k], opt[v].strategy.grad_spec(k) if opt[v].strategy is not None else None)
            for opt in groups[gv].options
        ]
        if all(d[0] is None for d in dst):
            continue
        src_vals, src_cls = _classes(src_specs)
        dst_vals, dst_cls = _classes(dst)
        m = (
            np.array(
                [
                    [
                        0.0
                        if d is None
                        else b.edge_time(s, d, gspec, u, grad_dst=gdst)
                        + (b.regather_time(u, s, d, v, k) if again else 0.0)
                        for (d, gspec) in dst_vals
                    ]
                    for s, again, gdst in src_vals
                ]
            )
            * occurrences
        )
        mem = (
            np.array(
                [[b.edge_memory(u, s, d, gspec, v, k, again) for (d, gspec) in dst_vals] for s, again, _ in src_vals]
            )
            * occurrences
        )
        if gu == gv:
            groups[gu].cost = groups[gu].cost + np.diag(m[np.ix_(src_cls, dst_cls)])
            groups[gu].memory = groups[gu].memory + np.diag(mem[np.ix_(src_cls, dst_cls)])
            continue
        pair = (gu, gv)
        if pair in by_pair:
            prev = by_pair[pair]
            combined = prev.full() + m[np.ix_(src_cls, dst_cls)]
            by_pair[pair] = _factor(gu, gv, combined, prev.full_memory() + mem[np.ix_(src_cls, dst_cls)])
        else:
            by_pair[pair] = EdgeCost(gu, gv, src_cls, dst_cls, m, mem if np.any(mem) else None)
    edges = []
    for e in by_pair.values():
        if not np.any(e.matrix) and e.memory is None:
            continue
        full, full_mem = e.full(), e.full_memory()
        # A cost that depends on one side only is a node cost, not an edge.
        if (full == full[:, :1]).all() and (full_mem == full_mem[:, :1]).all():
            groups[e.src].cost = groups[e.src].cost + full[:, 0]
            groups[e.src].memory = groups[e.src].memory + full_mem[:, 0]
        elif (full == full[:1, :]).all() and (full_mem == full_mem[:1, :]).all():
            groups[e.dst].cost = groups[e.dst].cost + full[0, :]
            groups[e.dst].memory = groups[e.dst].memory + full_mem[0, :]
        else:
            edges.append(e)
    return edges


def _factor(src, dst, full, full_memory=None) -> EdgeCost:
    """An edge from its option x option matrices (seconds; bytes kept), through classes."""
    both = full if full_memory is None else np.concatenate([full, full_memory], axis=1)
    both_t = full.T if full_memory is None else np.concatenate([full.T, full_memory.T], axis=1)
    rows, row_cls = _classes([tuple(r) for r in both])
    cols, col_cls = _classes([tuple(c) for c in both_t])
    pick = np.ix_(
        [list(row_cls).index(i) for i in range(len(rows))], [list(col_cls).index(j) for j in range(len(cols))]
    )
    memory = full_memory[pick] if full_memory is not None and np.any(full_memory) else None
    return EdgeCost(src, dst, row_cls, col_cls, full[pick], memory)
