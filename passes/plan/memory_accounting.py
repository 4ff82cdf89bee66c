"""Exact memory of a solved plan, per node: what each rank's lowered program keeps, by storage.

Given every node's chosen placements, this follows what the runtime allocates and autograd
keeps (:mod:`passes.analysis.saved_tensors` says what each op saves) and counts each storage once:

* **A value's storage.** An op that is not a view allocates its output; a view (``split``,
  ``transpose``, ``getitem`` of a view, ...) shares its input's storage. Placeholders are state
  (parameters, buffers) or the batch, never activations.
* **An edge's storage.** The edge ``u -> c`` (input ``k`` of ``c``) runs a
  :class:`runtime.reshard.Reshard` when its placements move. It allocates a new tensor
  (``u``'s shape at ``c``'s input placement) when a move sends data (all-gather, all-to-all,
  all-reduce, reduce-scatter), and when the value needs a gradient (the runtime hands out a
  copy, not a view made inside autograd), except a parameter whose forward does not move (passed
  through). Otherwise the consumer sees ``u``'s storage (a local slice of a value without
  gradient is a view).
* **Saved.** An op saving input ``k`` keeps the edge's storage; saving output ``j`` keeps its
  output's storage; its own buffers (masks, statistics) are counted at its share of the
  graph's size (its local output over its global output). A storage kept by several ops, or
  through several views, counts once. Storages made by edges are *gathered buffers* (e.g. a
  weight stored sharded and gathered for use, kept by the matmul for backward); the rest are
  *saved activations*. Each counts ``activation_copies`` times (microbatches alive at once).
* **Transients.** Forward: what a node allocates that nothing keeps (its output and its
  edges' buffers), alive while it runs. Backward: the gradients of its output and of its
  inputs that need one, alive while its backward runs.
* **What moves hold while they run** (:mod:`passes.plan.move_scratch`): an op's forward transient
  is the larger of its output with its edges' buffers and, per edge in input order, the buffers
  of the edges before it, its result and what its moves hold beyond it (a weight stored on an
  inner dim is copied back into order beside its gathered buffer).
* **ZeRO-3 parameters** (``regather``): the copy an edge gathers for a consumer that keeps it
  is freed after forward (a forward transient) and gathered again while the consumer's
  backward runs (a backward transient), outside recomputed layers; the consumer's backward
  unpacks them (with their moves' scratch) before it makes any gradient, a moment the walk
  counts too; an op whose rule ``unpacks_in_turn`` holds one of them at a time.
* **Activations gathered again** (``regather_activations``, :mod:`passes.plan.activation_regather`):
  the copy an edge gathers for a consumer that keeps it is a forward transient; the producer's
  shard is kept instead (a saved activation, once per storage); the copy is gathered again
  while the consumer's backward runs (a backward transient), outside recomputed layers.
* **ZeRO-1 parameters** (``stored``): the compute copy and its gradient at the placement the
  ops use, plus the optimizer's shard with its gradient and state. In a pipeline stage the copy's
  gradient is the step's sum over microbatches (nothing held beside it), alive from the first
  microbatch's backward on; the shard's gradient is made after the last.
* **Offloaded parameters** (``offload``): the compute copy and its gradient on the device; the
  tensor the optimizer steps, its gradient and its state in host memory (``offloaded``).
* **Prefetched gathers** (:mod:`passes.lower.prefetch_gathers`): a weight's gather started ahead of
  its use (its buffer and the input copy it reads) is a transient of every op it runs beside
  (forward, and ZeRO-3 regathers in backward).
* **Parameter gradients in backward** (:mod:`passes.plan.bucket_memory`, a plan without a
  pipeline): the ``.grad`` made so far, the gradients held in the runtime's buckets until their
  bucket is sent, and the buckets' flat buffers: ``gradients_alive`` on each op, while its
  backward runs (the parameter gradients it makes are counted there, not in its
  ``transient_bwd``), and on the first parameter the most at the end of backward.
* **Recomputed layers** (activation checkpointing): what their ops keep is rebuilt while the
  layer's backward reruns it (a backward transient, on the layer's first node); the checkpoint
  keeps the values entering the layer.

:func:`memory_fields` returns, per node name, the fields :mod:`passes.plan.memory_peak` turns into
the plan's breakdown and peaks.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from passes.analysis.analyze import info
from passes.core.node_info import grad_flows
from passes.lower.prefetch_gathers import first_gather, prefetch_transients
from passes.plan.activation_regather import regathers_activation
from passes.plan.bucket_memory import gradients_in_backward
from passes.plan.cost_model import (
    dtype_bytes,
    edge_allocates,
    grad_held_back,
    largest_share,
    local_bytes,
    param_state_parts,
)
from passes.plan.move_scratch import edge_scratch, gather_in_flight
from passes.plan.zero_storage import regathers as strategy_regathers
from passes.rules import op_view, rule_for, tensor_input_nodes

__all__ = ["memory_fields", "placeholder_memory", "edge_buffer_bytes"]


def memory_fields(
    graph: fx.Graph,
    choices: dict,
    mesh_shape,
    *,
    optimizer,
    activation_copies: int = 1,
    tied=(),
    recomputed=None,
    holds_gradient_sums: bool = False,
    regather_activations: bool = False,
) -> dict:
    """Node name -> memory fields (bytes per device) for a solved plan; ``choices``: node ->
    NodeChoice (the solver's decision for every node that has one); ``tied``: lists of placeholder
    names that are one tensor (tied weights: its state counts once, on the first name);
    ``recomputed``: node -> its layer, for the nodes of layers recomputed in backward (what they
    keep is rebuilt while their layer's backward runs: a backward transient; the checkpoint keeps
    the layer's inputs); ``holds_gradient_sums``: a pipeline stage, whose parameter edges that
    all-reduce gradients hold the sum over a step's microbatches (``held_gradients`` on the
    consumer: the gradient in the layout the consumer makes it, ``runtime.grad_sync.DeferredSyncs``;
    edges that reduce-scatter onto a weight stored sharded move it in every microbatch and hold
    nothing more: :func:`passes.plan.cost_model.grad_held_back`), and whose parameters with an edge not
    held back have their ``.grad`` from the first microbatch's backward on, while later
    microbatches run forward (``gradients_in_forward`` on the parameter).
    ``regather_activations``: the plan keeps activations gathered for a consumer that keeps them
    as their shard (:mod:`passes.plan.activation_regather`)."""
    recomputed = recomputed or {}
    walk = _StorageWalk(choices, tuple(mesh_shape), regather_activations)
    walk.keep_saved(graph, recomputed)
    fields: dict = {}
    walk.count_kept(fields, activation_copies)
    again = {name for names in tied for name in names[1:]}
    walk.state_and_transients(graph, fields, again=again, optimizer=optimizer, walk_grads=not holds_gradient_sums)
    if holds_gradient_sums:
        walk.held_gradients(graph, fields, tied)
    _prefetched(graph, choices, walk.mesh, recomputed, fields)
    for node in recomputed:  # the breakdown keeps the bound beside the walk (passes.plan.memory_peak)
        fields.setdefault(node.name, {})["recompute"] = True
    for layer, storages in walk.layer_kept.items():  # alive while the layer's backward reruns it
        rebuilt = sum(nbytes for key, (nbytes, _) in storages.items() if key not in walk.kept)
        f = fields.setdefault(walk.first_of[layer].name, {})
        f["transient_bwd"] = f.get("transient_bwd", 0.0) + rebuilt
    return {name: f for name, f in fields.items() if f}


def placeholder_memory(n: fx.Node, choice, mesh_shape, optimizer) -> dict:
    """The memory fields of placeholder ``n`` placed by ``choice`` (its NodeChoice): a parameter's
    state (stored, compute copy, gradient, optimizer state; offloaded parts apart), else its batch
    or buffer bytes."""
    i, spec = info(n), choice.out[0]
    if i.kind != "param":
        return {"input_bytes": local_bytes(i.shape, spec, mesh_shape, dtype_bytes(i.dtype))}
    stored = choice.stored  # ZeRO-1: the optimizer steps a shard placed so
    numel = local_bytes(i.shape, spec if stored is None else stored, mesh_shape, 1)
    p, g, s = param_state_parts(numel, dtype_bytes(i.dtype), optimizer)
    whole = local_bytes(i.shape, spec, mesh_shape, dtype_bytes(i.dtype))
    if choice.offload:  # on the device: the compute copy and its gradient only
        return {"parameters": whole, "gradients": whole, "optimizer_state": 0.0, "offloaded": p + g + s}
    if stored is not None:  # and the compute copy, with its gradient, is whole
        p, g = p + whole, g + whole
    return {"parameters": p, "gradients": g, "optimizer_state": s}


def edge_buffer_bytes(u: fx.Node, src, dst, grad, mesh_shape) -> float | None:
    """Bytes of the buffer the edge moving ``u`` from ``src`` to ``dst`` (its gradient back from
    ``grad``, None when none flows) allocates, or None when it allocates none (the module docstring)."""
    ui = info(u)
    if not edge_allocates(src, dst, grad, mesh_shape, requires_grad=ui.requires_grad, from_param=ui.kind == "param"):
        return None
    return local_bytes(ui.shape or (), dst, mesh_shape, dtype_bytes(ui.dtype))


class _StorageWalk:
    """The storages a solved plan's nodes and edges make, and which of them are kept for
    backward (the module docstring's rules), for :func:`memory_fields`."""

    def __init__(self, choices: dict, mesh: tuple, regather_activations: bool = False):
        self.choices, self.mesh = choices, mesh
        self.regather_activations = regather_activations
        self.kept: dict = {}  # storage key -> (bytes, owner node)
        self.edge_buffers: dict = {}  # consumer -> bytes of its edges' buffers
        self.regathered: dict = {}  # consumer -> bytes of ZeRO-3 copies its backward holds gathered again at once
        self.regather_scratch: dict = {}  # consumer -> the most its regathers hold beyond their copies
        self.edges_running: dict = {}  # consumer -> the most alive while its edges run (their buffers, scratch)
        self.layer_kept: dict = {}  # recomputed layer -> {storage key: bytes}, rebuilt in its backward
        self.first_of: dict = {}  # recomputed layer -> its first node

    def out_spec(self, n, j=0):
        c = self.choices.get(n)
        return c.out[j] if c is not None and j < len(c.out) else None

    def value_bytes(self, n, j=0):
        i = info(n)
        spec = self.out_spec(n, j)
        if spec is None or j >= len(i.out_shapes) or i.out_shapes[j] is None:
            return 0.0
        return local_bytes(i.out_shapes[j], spec, self.mesh, dtype_bytes(i.dtype))

    def edge(self, c, k):
        """(key, bytes) of the buffer the edge into input ``k`` of ``c`` allocates, or None."""
        u, mine = tensor_input_nodes(c)[k], self.choices.get(c)
        src = self.out_spec(u)
        if src is None or mine is None or mine.strategy is None or k >= len(mine.ins) or mine.ins[k] is None:
            return None
        grad = mine.strategy.grad_spec(k) if grad_flows(u, c) else None
        nbytes = edge_buffer_bytes(u, src, mine.ins[k], grad, self.mesh)
        return None if nbytes is None else (("edge", c, k), nbytes)

    def scratch(self, c, k) -> float:
        """What the moves of the edge into input ``k`` of ``c`` hold beyond their result
        (:mod:`passes.plan.move_scratch`)."""
        u = tensor_input_nodes(c)[k]
        mine, src = self.choices.get(c), self.out_spec(u)
        if mine is None or src is None or k >= len(mine.ins) or mine.ins[k] is None:
            return 0.0
        ui = info(u)
        return edge_scratch(src, mine.ins[k], ui.shape or (), self.mesh, dtype_bytes(ui.dtype), ui.requires_grad)

    def base(self, n, j=0):
        """The storage value ``n`` (output ``j``) lives in: (key, bytes, owner) or None (state, batch)."""
        while True:
            i = info(n)
            if n.op == "placeholder":
                return None
            saves = i.saves
            if saves is not None and saves.alias is not None:
                if n.target is operator.getitem:
                    parent = n.args[0]
                    if info(parent).saves is not None and info(parent).saves.alias is not None:
                        n, j = parent, 0
                        continue
                    return ("value", parent, n.args[1]), self.value_bytes(parent, n.args[1]), parent
                e = self.edge(n, saves.alias)
                if e is not None:
                    return e[0], e[1], n
                n, j = tensor_input_nodes(n)[saves.alias], 0
                continue
            return ("value", n, j), self.value_bytes(n, j), n

    def regathers(self, c, k, layer) -> bool:
        u = tensor_input_nodes(c)[k]
        placed = self.choices.get(u)
        if layer is not None or placed is None:
            return False
        if self.regather_activations and info(u).kind == "op":
            return regathers_activation(c, k, u, self.out_spec(u), self.choices[c].ins[k], self.mesh)
        return placed.regather and strategy_regathers(c, k, self.out_spec(u), self.choices[c].ins[k], self.mesh)

    def keep(self, found, into=None):
        into = self.kept if into is None else into
        if found is not None:
            key, nbytes, owner = found
            into.setdefault(key, (nbytes, owner))

    def keep_saved(self, graph: fx.Graph, recomputed: dict) -> None:
        """Walk the ops: what each keeps for backward (its saved inputs' and outputs' storages,
        its own buffers; in a recomputed layer, kept by the layer), its edges' buffers, and the
        ZeRO-3 parameters gathered again for its backward."""
        choices, mesh = self.choices, self.mesh
        for c in graph.nodes:
            i = info(c)
            if c.op != "call_function" or i.kind != "op" or i.saves is None or choices.get(c) is None:
                continue
            ins = tensor_input_nodes(c)
            layer = recomputed.get(c)
            into = self.kept if layer is None else self.layer_kept.setdefault(layer, {})
            if layer is not None:
                self.first_of.setdefault(layer, c)
                for u in ins:  # the checkpoint keeps what enters the layer
                    if recomputed.get(u) != layer:
                        self.keep(self.base(u))
            for k in i.saves.inputs:
                e = self.edge(c, k)
                if e is not None and self.regathers(c, k, layer):
                    # gathered again as backward unpacks them: at once, or one at a time
                    together = not rule_for(c).unpacks_in_turn
                    self.regathered[c] = (
                        self.regathered.get(c, 0.0) + e[1] if together else max(self.regathered.get(c, 0.0), e[1])
                    )
                    self.regather_scratch[c] = max(self.regather_scratch.get(c, 0.0), self.scratch(c, k))
                    if info(ins[k]).kind == "op":  # an activation: its shard is kept instead
                        self.keep(self.base(ins[k]), into)
                elif e is not None:
                    self.keep((e[0], e[1], c), into)
                else:
                    self.keep(self.base(ins[k]), into)
            for j in i.saves.outputs:
                self.keep(self.base(c, j), into)
            if i.saves.extra_bytes:
                mine = choices[c]
                placed = [(info(u).shape, spec) for u, spec in zip(ins, mine.ins)] or [(i.shape, self.out_spec(c))]
                share = rule_for(c).buffer_share(op_view(c), placed, mesh)
                fraction = share if share is not None else largest_share(placed, mesh)
                into[("extra", c)] = (i.saves.extra_bytes * fraction, c)
            for k in range(len(ins)):
                e = self.edge(c, k)
                unkept = e[1] if e is not None and e[0] not in self.kept else 0.0
                self.edge_buffers[c] = self.edge_buffers.get(c, 0.0) + unkept
                # while edge k runs: the unkept buffers of the edges before it, its result, its scratch
                during = self.edge_buffers[c] + self.scratch(c, k)
                self.edges_running[c] = max(self.edges_running.get(c, 0.0), during)

    def count_kept(self, fields: dict, activation_copies: int) -> None:
        """Each kept storage on its owner: gathered buffers (made by edges) or saved activations."""
        for key, (nbytes, owner) in self.kept.items():
            f = fields.setdefault(owner.name, {})
            name = "gathered_buffers" if key[0] == "edge" else "saved_activations"
            f[name] = f.get(name, 0.0) + nbytes * activation_copies

    def state_and_transients(self, graph: fx.Graph, fields: dict, *, again: set, optimizer, walk_grads: bool) -> None:
        """Each placeholder's state or batch bytes (``again``: tied names counted on their first),
        and each op's forward and backward transients; ``walk_grads`` (a plan without a
        pipeline): the parameter gradients alive in backward
        (:func:`passes.plan.bucket_memory.gradients_in_backward`), op by op."""
        choices, mesh = self.choices, self.mesh
        kept_values = {key[1] for key in self.kept if key[0] == "value"}
        self.placeholders(graph, fields, again, optimizer)
        grads = None
        if walk_grads:
            grads = gradients_in_backward(
                graph, choices, mesh, self.out_spec, lambda u: fields.get(u.name, {}).get("gradients", 0.0)
            )
            first = next((n for n in graph.nodes if info(n).kind == "param"), None)
            if first is not None:
                fields.setdefault(first.name, {})["gradients_alive"] = grads.at_end
        for n in graph.nodes:
            i = info(n)
            f = fields.setdefault(n.name, {})
            spec = self.out_spec(n)
            if n.op != "call_function" or i.kind != "op" or spec is None:
                continue
            aliased = i.saves is not None and i.saves.alias is not None
            own = 0.0 if aliased or n in kept_values else self.value_bytes(n)
            f["transient_fwd"] = max(own + self.edge_buffers.get(n, 0.0), self.edges_running.get(n, 0.0))
            if i.requires_grad:
                f["transient_bwd"] = self.backward_transient(n, grads)
            if grads is not None and n in grads.during:
                f["gradients_alive"] = grads.during[n]

    def backward_transient(self, n, grads) -> float:
        """What ``n``'s backward holds beside what is kept: its output's gradient, its inputs'
        (a parameter's: in ``gradients_alive`` where walked, else here too) and its ZeRO-3 copies
        gathered again. Those are gathered when its backward starts, before it makes any
        gradient: that moment (their moves' scratch beside them, the gradients alive before
        ``n``'s, ``grads.before``) is folded in so that the walk's sum with ``gradients_alive``
        (``grads.during``) is the larger of the two."""
        ins = [u for u in tensor_input_nodes(n) if info(u).requires_grad]
        grads_in = sum(self.value_bytes(u) for u in ins if grads is None or info(u).kind != "param")
        regathered = self.regathered.get(n, 0.0)
        held = self.value_bytes(n) + grads_in + regathered
        scratch = self.regather_scratch.get(n, 0.0)
        if not scratch:
            return held
        unpacking = self.value_bytes(n) + regathered + scratch
        if grads is not None and n in grads.during:
            unpacking -= grads.during[n] - grads.before.get(n, 0.0)
        return max(held, unpacking)

    def placeholders(self, graph: fx.Graph, fields: dict, again: set, optimizer) -> None:
        """Each placeholder's state (a parameter: stored, compute copy, gradient, optimizer
        state; ``again``: a tied name, counted on its first) or batch bytes."""
        choices, mesh = self.choices, self.mesh
        for n in graph.nodes:
            if n.op != "placeholder" or self.out_spec(n) is None or n.name in again:
                continue
            fields.setdefault(n.name, {}).update(placeholder_memory(n, choices[n], mesh, optimizer))

    def held_gradients(self, graph: fx.Graph, fields: dict, tied) -> None:
        """A pipeline stage: the gradient sums its parameter edges hold back over a step's
        microbatches (on the consumer), and the parameters whose ``.grad`` exists from the first
        microbatch's backward on (``gradients_in_forward``)."""
        mesh = self.mesh
        first = {name: names[0] for names in tied for name in names}
        early = set()  # parameters (first tied name) with an edge not held back: .grad made per microbatch
        copies = {}  # compute copies (ZeRO-1): the step's gradient sum, in the copy from the first backward on
        for n in graph.nodes:
            mine = self.choices.get(n)
            if mine is None or mine.strategy is None:
                continue
            for k, u in enumerate(tensor_input_nodes(n)):
                ui = info(u)
                if ui.kind != "param" or not grad_flows(u, n) or k >= len(mine.ins) or mine.ins[k] is None:
                    continue
                grad = mine.strategy.grad_spec(k)
                placed = self.choices.get(u)
                if placed is not None and (placed.stored is not None or placed.offload):
                    copies[first.get(u.name, u.name)] = self.value_bytes(u)
                elif grad_held_back(self.out_spec(u), grad, mesh):
                    f = fields.setdefault(n.name, {})
                    f["held_gradients"] = f.get("held_gradients", 0.0) + local_bytes(
                        ui.shape or (), grad, mesh, dtype_bytes(ui.dtype)
                    )
                else:
                    early.add(first.get(u.name, u.name))
        for name in early:
            f = fields.get(name, {})
            if f.get("gradients"):
                f["gradients_in_forward"] = f["gradients"]
        for name, nbytes in copies.items():  # the shard's .grad is made after the step's last backward
            fields.setdefault(name, {})["gradients_in_forward"] = nbytes


def _prefetched(graph: fx.Graph, choices: dict, mesh, recomputed: dict, fields: dict) -> None:
    """Add the weight gathers started ahead of their use (:mod:`passes.lower.prefetch_gathers`) to the
    transients of the ops they run beside: forward gathers, ZeRO-3 regathers in backward and
    recomputed layers' rerun gathers (their gathered buffer, alive from the start to the use)."""
    ops = [n for n in graph.nodes if n.op == "call_function" and info(n).kind == "op"]
    entries = []  # per op: (its recomputed region or None, [(bytes gathered ahead, regathered)])
    for c in ops:
        mine, found = choices.get(c), []
        layer = recomputed.get(c)
        entries.append((layer, found))
        if mine is None or mine.strategy is None:
            continue
        saves = info(c).saves
        saved = saves.inputs if saves is not None else ()
        for k, u in enumerate(tensor_input_nodes(c)):
            placed, ui = choices.get(u), info(u)
            if ui.kind != "param" or placed is None or placed.stored is not None or placed.offload:
                continue
            if k >= len(mine.ins) or mine.ins[k] is None:
                continue
            first = first_gather(placed.out[0], mine.ins[k], ui.shape or (), mesh, dtype_bytes(ui.dtype))
            if first is not None:
                # the gathered buffer, and the input it reads while in flight (passes.plan.move_scratch)
                nbytes = first.payload_bytes + gather_in_flight(
                    placed.out[0], mine.ins[k], ui.shape or (), mesh, dtype_bytes(ui.dtype)
                )
                found.append((nbytes, bool(placed.regather and k in saved and layer is None)))
    for name, placed_bytes in prefetch_transients(entries).items():
        for i, nbytes in placed_bytes:
            f = fields.setdefault(ops[i].name, {})
            f[name] = f.get(name, 0.0) + nbytes
