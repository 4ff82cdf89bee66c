"""Each node's options and their prices: an op leader's strategies over the mesh, a follower's best
response to its inputs, a placeholder's placements with their ZeRO-1, ZeRO-3 and offloaded twins
(steps 1-3 of :mod:`passes.plan.strategy_space`, for one node)."""

from __future__ import annotations

import dataclasses
import itertools
import logging

import torch.fx as fx

from passes.analysis.analyze import info
from passes.core.node_info import grad_flows
from passes.core.placements import R, Shard, is_shard, spec_fits
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
    saved_bytes,
    weight_pass_time,
)
from passes.plan.edge_costs import edge_collectives
from passes.plan.move_scratch import edge_scratch
from passes.plan.space_types import NodeChoice
from passes.plan.zero_storage import regathers, zero1_collectives, zero1_placements, zero_mode
from passes.rules import Strategy, expand_to_mesh, multidim_tp, op_view, rule_for, tensor_input_nodes

logger = logging.getLogger(__name__)


def is_parameter(node) -> bool:
    """A parameter, or a view of one (``W.t()`` feeding a matmul)."""
    while node.op == "call_function" and getattr(rule_for(node), "is_view", False):
        inputs = tensor_input_nodes(node)
        if len(inputs) != 1:
            return False
        node = inputs[0]
    return info(node).kind == "param"


def _options_for_placeholder(shape, mesh_shape) -> list:
    per_axis = [R] + [Shard(d) for d, s in enumerate(shape or ()) if s > 1]
    specs = []
    for combo in itertools.product(per_axis, repeat=len(mesh_shape)):
        if spec_fits(shape or (), combo, mesh_shape):
            specs.append(tuple(combo))
    return specs


def _compute_copy_bytes(param) -> int:
    """Bytes per element of the low-precision compute copy autocast makes of a parameter (and
    keeps for backward) when an op using it computes in a narrower float dtype; 0 otherwise.
    Counted at the stored piece's size (a weight gathered for use copies the gathered size)."""
    elem = dtype_bytes(info(param).dtype)
    user_dtypes = [info(user).dtype for user in param.users if user.op == "call_function"]
    narrower = [dtype_bytes(d) for d in user_dtypes if d is not None and d.is_floating_point and dtype_bytes(d) < elem]
    return min(narrower) if narrower else 0


class SpaceBuilder:
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
        (:mod:`passes.plan.activation_regather`). A parameter's gather also holds, while it runs,
        what its moves copy beside the result (a weight stored on an inner dim copied back into
        order: :mod:`passes.plan.move_scratch`): a transient, held in the row as if kept, so
        that the solver prefers the storage whose gather copies nothing."""
        saves = info(consumer).saves
        if saves is None or k not in saves.inputs or src is None or dst is None:
            return 0.0
        ui = info(u)
        scratch = 0.0
        if ui.kind == "param":
            scratch = edge_scratch(src, dst, ui.shape or (), self.mesh, dtype_bytes(ui.dtype), ui.requires_grad)
        if regather and ui.kind == "op":
            if regathers_activation(consumer, k, u, src, dst, self.mesh):
                return self.activation_copies * local_bytes(ui.shape or (), src, self.mesh, dtype_bytes(ui.dtype))
        elif regather and edge_gathers(src, dst, self.mesh):
            return scratch
        grad = grad if ui.requires_grad else None
        if not edge_allocates(src, dst, grad, self.mesh, requires_grad=ui.requires_grad, from_param=ui.kind == "param"):
            return 0.0
        return scratch + self.activation_copies * local_bytes(ui.shape or (), dst, self.mesh, dtype_bytes(ui.dtype))

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
        work = (i.flops / split * rule.work_scale(op, strategy, self.mesh), mem_bytes, i.dtype, rule.contraction)
        where = (self.cluster, i.rate_key, rule.rate_shape(op, strategy, self.mesh))
        fwd = self.cluster.view_overhead_s if getattr(rule, "is_view", False) else compute_time(*work, *where)
        bwd = weight = 0.0
        if i.requires_grad:  # a contraction's backward products at their own measured rates
            grads_in = sum(1 for a in self.inputs_of(node) if info(a).requires_grad)
            product = compute_time(*work, *where, product="backward") if rule.contraction else fwd
            bwd = backward_factor(rule.contraction, grads_in) * product + alloc_bwd
            if any(is_parameter(a) and info(a).requires_grad for a in self.inputs_of(node)):
                weight_product = compute_time(*work, *where, product="weight") if rule.contraction else fwd
                weight = weight_pass_time(rule.contraction, weight_product, bwd, self.cluster)
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
                    stops = info(u).requires_grad and not grad_flows(u, node)  # node passes none back
                    grad = None if stops else strategy.grad_spec(k)
                    inbound += self.edge_time(g, want, grad, u)
                    act += self.edge_memory(u, g, want, grad, node, k)
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
        collective per axis; in a pipeline stage, a microbatch's share of them, as a held-back
        all-reduce's); its memory: the copy and its gradient whole, the shard with its
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
        once = (self.time_of(rs) + self.time_of(ag)) / self.microbatches
        return dataclasses.replace(kept, stored=stored, memory=memory, extra_s=once)

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
            # keep the simpler ones), and the replicated one (a split may cost more in
            # collectives than it saves). Only 3-D and larger meshes get here by default.
            order = sorted(range(len(choices)), key=lambda k: (choices[k].compute_s, choices[k].memory))
            kept_ks = set(order[: self.max_options]) | multidim_tp.grid_options(node, strategies, self.mesh)
            keep = sorted(kept_ks | {k for k, st in enumerate(strategies) if _replicated(st)})
            self.pruned += len(choices) - len(keep)
            choices = [choices[k] for k in keep]
        return choices


def _replicated(strategy: Strategy) -> bool:
    """Every output and input of ``strategy`` replicated on every mesh axis."""
    return all(spec is None or all(p == R for p in spec) for spec in (*strategy.out, *strategy.ins))
