"""A lower bound on the walked peak of every plan of a strategy space: refusing a budget before any solve.

The ILP's memory row is not a bound on the peak :mod:`passes.plan.memory_peak` walks (the row
keeps every gradient and every gathered copy a consumer saves; the walk frees ZeRO-3 copies
after forward and adds transients), so a budget no plan fits used to be refused only after the
solves that look for one. :func:`peak_floor` bounds the walked peak from below, from each
decision's options alone (no edge between decisions is fixed, so the minima separate):

* **state**: every placeholder at its least-memory option: a parameter's stored bytes and
  optimizer state (ZeRO-1 shard and compute copy, or offloaded state, as
  :func:`passes.plan.memory_accounting.placeholder_memory` counts them), the batch pieces and buffers;
* **backward's end**: the walk's last step holds every parameter gradient a consumer sends back
  (``gradients_in_backward``'s ``at_end``; a pipeline stage's bound holds all of them): the floor
  of that moment is the least of each parameter's state with its gradient;
* **forward's end**: what the ops keep for backward (:class:`_KeptFloor`). A saved value is kept
  as its own storage or as a buffer an edge makes (into the saving op, or into a view on the way,
  as the walk's ``base`` follows them): at least the least of those; one value saved several
  times counts once, at its largest save's floor, from its last save on. Ops a repeated block may
  recompute are left out unless ``recompute="none"`` (their saves are rebuilt, not kept);
* **an op's moment**, with what the ops before it keep. In forward, while op ``c`` runs: its output
  (a single-output op that is not a view) and each weight it reads, either its stored copy or the
  buffer its edge gathers beside that copy: per option of ``c``, per weight, the least of (the
  weight's state + the edge's buffer) over the weight's options, less the weight's least state
  (already in the state's floor); the least over ``c``'s options. In backward: its output's
  gradient, its activation inputs' gradients, and the gradients of the parameters read after it
  (made before its backward runs).

The floor is the state's floor plus the largest of the other terms. Each term is one the walk
counts at that moment (``memory_accounting``'s forward transient holds the op's output and its
edges' buffers, kept or not; its backward transient the gradients; the walk's step adds what is
kept up to the op and the parameter gradients alive), so no plan's walked peak is below it: a
budget under the floor is refused without solving, and no budget a plan fits is. What it leaves
out (activation edges' buffers, saved buffers of an op's own, scratch, prefetches, regathers)
only adds to a real peak. Repeated blocks share their representative's options and shapes: each
op kind is bounded once.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass

import torch.fx as fx

from passes.analysis.analyze import info
from passes.core.node_info import grad_flows
from passes.plan.cost_model import dtype_bytes, local_bytes
from passes.plan.memory_accounting import edge_buffer_bytes, placeholder_memory
from passes.plan.space_types import StrategySpace
from passes.rules import tensor_input_nodes

__all__ = ["PeakFloor", "peak_floor"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeakFloor:
    """Bytes per device no plan of the space goes below at its peak, and its parts."""

    state: float
    """Parameters and optimizer state, each at its least (offloaded state apart)."""
    inputs: float
    """The batch pieces and the model's buffers, each at its least."""
    gradients: float
    """What backward's end adds to ``state``: the parameter gradients (each parameter's least
    state with its gradient, less its least state)."""
    kept: float
    """What forward's end adds to ``state``: what the ops keep for backward."""
    op_bytes: float = 0.0
    """What the largest op's moment adds to ``state``: in forward its output and the weights it
    reads, in backward its gradients and those made before; what the ops before it keep."""
    op_name: str = ""
    op_module: str = ""
    op_phase: str = "forward"

    @property
    def total(self) -> float:
        return self.state + self.inputs + max(self.gradients, self.op_bytes, self.kept)

    def explain(self) -> str:
        """What the floor is made of, its largest part named."""
        largest = max(self.gradients, self.op_bytes, self.kept)
        if largest == self.gradients:
            at = f"the parameter gradients at the end of backward ({self.gradients:.0f} bytes)"
        elif largest == self.kept:
            at = f"the activations kept for backward at the end of forward ({self.kept:.0f} bytes)"
        else:
            what = (
                "its output and the weights it reads"
                if self.op_phase == "forward"
                else "its gradients and the parameter gradients made before"
            )
            at = (
                f"op {self.op_name}{f' (module {self.op_module})' if self.op_module else ''} in {self.op_phase}: "
                f"{what}, with what the ops before it keep ({self.op_bytes:.0f} bytes)"
            )
        return (
            f"parameters and optimizer state sharded as far as the mesh allows ({self.state:.0f} bytes), the batch "
            f"and buffers ({self.inputs:.0f} bytes), and {at}"
        )


def peak_floor(
    graph: fx.Graph, space: StrategySpace, *, tied=(), recompute: str = "auto", activation_copies: int = 1
) -> PeakFloor:
    """The floor of every plan of ``space`` over ``graph`` (the module docstring); ``tied``: lists
    of placeholder names that are one tensor (its state counts once, on the first name);
    ``recompute``: the plan's recomputation mode (what a repeated block's ops keep counts only
    under ``"none"``); ``activation_copies``: microbatches whose saved tensors are alive at once."""
    options = _Options(space)
    again = {name for names in tied for name in names[1:]}
    state = _StateFloor(graph, options, again)
    recomputable = set(space.blocks.block_of) if recompute != "none" else set()
    kept = _kept_floor(graph, options, recomputable, activation_copies)
    order = {n: k for k, n in enumerate(graph.nodes)}
    grads_left = state.gradients  # gradients made before an op's backward: of parameters read after it
    best, where, before = 0.0, (None, "forward"), 0.0
    seen: dict = {}
    for c in graph.nodes:
        rep = space.blocks.represent(c)
        if rep not in seen:
            seen[rep] = (_op_moment(c, options, state.least, again), _backward_moment(c, options))
        forward, backward = seen[rep]
        before += kept.pop_before(c)
        grads_left -= state.read_last_at.get(order[c], 0.0)
        backward = before + backward + grads_left if backward is not None else 0.0
        for nbytes, phase in ((before + forward, "forward"), (backward, "backward")):
            if nbytes > best:
                best, where = nbytes, (c, phase)
    node, phase = where
    floor = PeakFloor(
        state.state,
        state.inputs,
        state.gradients,
        before + kept.pop_before(None),
        best,
        node.name if node is not None else "",
        (info(node).module_path or "") if node is not None else "",
        phase,
    )
    logger.debug("peak floor %.0f bytes: %s", floor.total, floor.explain())
    return floor


class _StateFloor:
    """Each placeholder at its least: parameters and optimizer state, batch and buffers, and what
    a parameter's gradient adds (the least of state with gradient, less the least state)."""

    def __init__(self, graph: fx.Graph, options: _Options, again: set):
        mesh, optimizer = options.space.mesh_shape, options.space.optimizer
        order = {n: k for k, n in enumerate(graph.nodes)}
        self.state = self.inputs = self.gradients = 0.0
        self.least: dict = {}  # parameter -> its least parameters + optimizer state
        self.read_last_at: dict = {}  # graph index of a parameter's last reader passing it a gradient -> its floor
        for n in graph.nodes:
            if n.op != "placeholder" or n.name in again or not options.of(n):
                continue
            parts = [placeholder_memory(n, o, mesh, optimizer) for o in options.of(n)]
            if info(n).kind != "param":
                self.inputs += min(p["input_bytes"] for p in parts)
                continue
            held = [p["parameters"] + p["optimizer_state"] for p in parts]
            self.least[n] = min(held)
            self.state += self.least[n]
            readers = [
                order[c] for c in n.users if c.op == "call_function" and info(c).kind == "op" and grad_flows(n, c)
            ]
            if readers:
                grad = min(h + p["gradients"] for h, p in zip(held, parts)) - self.least[n]
                self.gradients += grad
                self.read_last_at[max(readers)] = self.read_last_at.get(max(readers), 0.0) + grad


class _Options:
    """Node -> the NodeChoices its decision offers (its representative's, in a repeated block)."""

    def __init__(self, space: StrategySpace):
        self.space = space
        self.buffers: dict = {}  # (weight, its placement, read as, gradient) -> edge buffer bytes
        self._state: dict = {}

    def placed_state(self, u: fx.Node) -> dict:
        """Weight ``u``'s placements -> the least parameters + optimizer state placed so."""
        if u not in self._state:
            space, found = self.space, {}
            for o in self.of(u):
                parts = placeholder_memory(u, o, space.mesh_shape, space.optimizer)
                held = parts["parameters"] + parts["optimizer_state"]
                found[o.out[0]] = min(found.get(o.out[0], held), held)
            self._state[u] = found
        return self._state[u]

    def of(self, n: fx.Node) -> list:
        rep = self.space.blocks.represent(n)
        gi = self.space.group_of.get(rep)
        if gi is None:
            return []
        return [o[rep] for o in self.space.groups[gi].options if rep in o]


def _op_moment(c: fx.Node, options: _Options, least_state: dict, again: set) -> float:
    """What op ``c``'s forward holds beside the state's floor, at the least over its options: its
    output (a single-output op that is not a view) and, per weight it reads, the weight's state and
    the buffer its edge gathers, less the weight's least state."""
    i, mesh = info(c), options.space.mesh_shape
    mine = options.of(c) if c.op == "call_function" and i.kind == "op" else []
    if not mine:
        return 0.0
    own_counts = len(i.out_shapes) == 1 and i.out_shapes[0] is not None
    own_counts = own_counts and not (i.saves is not None and i.saves.alias is not None)
    weights: dict = {}  # parameter -> the input index of its first edge into c
    for k, u in enumerate(tensor_input_nodes(c)):
        if info(u).kind == "param" and (u in least_state or u.name in again):
            weights.setdefault(u, k)
    best, reads = float("inf"), {}
    for o in mine:
        spec = o.out[0] if o.out else None
        if spec is None or o.strategy is None:  # no placement: the walk gives it no transient
            return 0.0
        held = local_bytes(i.out_shapes[0], spec, mesh, dtype_bytes(i.dtype)) if own_counts else 0.0
        for u, k in weights.items():
            dst = o.ins[k] if k < len(o.ins) else None
            grad = o.strategy.grad_spec(k) if grad_flows(u, c) else None
            if (u, dst, grad) not in reads:
                reads[u, dst, grad] = _weight_read(u, dst, grad, options, u in least_state) - least_state.get(u, 0.0)
            held += reads[u, dst, grad]
        best = min(best, held)
    return best


def _backward_moment(c: fx.Node, options: _Options) -> float | None:
    """What op ``c``'s backward holds at least, beside what is kept and the parameter gradients:
    its output's gradient and its activation inputs' (None: it has no backward step)."""
    i = info(c)
    mine = options.of(c) if c.op == "call_function" and i.kind == "op" and i.requires_grad else []
    if not mine or any(o.strategy is None for o in mine):
        return None
    held = _value_floor((c, 0), options)
    for u in dict.fromkeys(tensor_input_nodes(c)):
        if info(u).requires_grad and info(u).kind != "param":
            held += _value_floor((u, 0), options)
    return held


def _weight_read(u: fx.Node, dst, grad, options: _Options, has_state: bool) -> float:
    """The least over weight ``u``'s options of its parameters and optimizer state (the same option
    sets both; a tied weight's second name holds none) and the buffer its edge to ``dst`` (gradient
    back from ``grad``) gathers."""
    mesh, best = options.space.mesh_shape, float("inf")
    for src, held in options.placed_state(u).items():
        held = held if has_state else 0.0
        if dst is not None:
            if (u, src, dst, grad) not in options.buffers:  # a few placements, many options
                options.buffers[u, src, dst, grad] = edge_buffer_bytes(u, src, dst, grad, mesh) or 0.0
            held += options.buffers[u, src, dst, grad]
        best = min(best, held)
    return best if best != float("inf") else 0.0


class _KeptFloor:
    """The least bytes kept for backward, per storage group, released to the forward walk in order.

    A saved value (an op's output, not a view; or an item of one) is kept as its own storage, or
    as the buffer an edge makes for a consumer that saves it: at least the least of the two over
    their options. A group (one value and every save of it) holds at least its largest save's
    floor, owned by a record no later than its last save: counted from then on (from the record
    after, when the value is the op's own output saved by itself)."""

    def __init__(self):
        self.at: dict = {}  # record -> bytes of the groups counted from it on
        self.end = 0.0

    def pop_before(self, c) -> float:
        return self.at.pop(c, 0.0) if c is not None else self.end


def _kept_floor(graph: fx.Graph, options: _Options, recomputable: set, copies: int) -> _KeptFloor:
    """The groups of saved values (the class docstring), outside ops that may be recomputed."""
    order = {n: k for k, n in enumerate(graph.nodes)}
    groups: dict = {}  # (producer, output index) -> [floor, last saving record]
    for c in graph.nodes:
        i = info(c)
        if c.op != "call_function" or i.kind != "op" or i.saves is None or c in recomputable or not options.of(c):
            continue
        ins = tensor_input_nodes(c)
        for k in i.saves.inputs:
            found = _storage(ins[k], 0, options) if k < len(ins) else None
            if found is not None:
                at_edge = min(_at_input(ins[k], k, o, options.space.mesh_shape) for o in options.of(c))
                _save(groups, found[0], min(at_edge, found[1]), c)
        for j in i.saves.outputs:
            found = _storage(c, j, options)
            if found is not None:
                _save(groups, found[0], found[1], c)
    floor, nodes = _KeptFloor(), list(graph.nodes)
    for (producer, _), (nbytes, last) in groups.items():
        at = order[last] + (1 if last is producer else 0)
        if at < len(nodes):
            floor.at[nodes[at]] = floor.at.get(nodes[at], 0.0) + nbytes * copies
        else:
            floor.end += nbytes * copies
    return floor


def _save(groups: dict, key: tuple, nbytes: float, c: fx.Node) -> None:
    held, _ = groups.get(key, (0.0, c))
    groups[key] = (max(held, nbytes), c)


def _storage(u: fx.Node, j: int, options: _Options) -> tuple | None:
    """(key, floor) of the storage value ``u`` (output ``j``) lives in, as the walk's ``base``
    follows views: the op that made it (key: (producer, output index)), or a buffer an edge into
    a view on the way made (at least the least of those and the op's value); None: state or batch."""
    floors = []
    while True:
        i = info(u)
        if u.op == "placeholder" or i.kind != "op":
            return None
        if i.saves is None or i.saves.alias is None:
            return (u, j), min([_value_floor((u, j), options), *floors])
        if u.target is operator.getitem:
            parent = u.args[0]
            if not isinstance(parent, fx.Node) or not isinstance(u.args[1], int):
                return None
            above = info(parent).saves
            if above is not None and above.alias is not None:
                u, j = parent, 0
                continue
            return (parent, u.args[1]), min([_value_floor((parent, u.args[1]), options), *floors])
        alias = i.saves.alias
        inputs = tensor_input_nodes(u)
        if alias >= len(inputs):
            return None
        mesh = options.space.mesh_shape
        floors.append(min((_at_input(inputs[alias], alias, o, mesh) for o in options.of(u)), default=0.0))
        u, j = inputs[alias], 0


def _value_floor(key: tuple, options: _Options) -> float:
    producer, j = key
    i, mesh = info(producer), options.space.mesh_shape
    if j >= len(i.out_shapes) or i.out_shapes[j] is None:
        return 0.0
    placed = [o.out[j] for o in options.of(producer) if j < len(o.out) and o.out[j] is not None]
    return min((local_bytes(i.out_shapes[j], spec, mesh, dtype_bytes(i.dtype)) for spec in placed), default=0.0)


def _at_input(u: fx.Node, k: int, mine, mesh) -> float:
    """Bytes of ``u`` placed as option ``mine`` reads it (what an edge buffer there holds)."""
    spec = mine.ins[k] if k < len(mine.ins) else None
    ui = info(u)
    return local_bytes(ui.shape or (), spec, mesh, dtype_bytes(ui.dtype)) if spec is not None else 0.0
