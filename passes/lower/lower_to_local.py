"""Lowering: a captured graph + a ShardingPlan -> one rank's program on local tensors.

The lowered program is plain PyTorch (decision 7 in docs/ARCHITECTURE.md). Walk the captured
graph in order and emit a new fx graph:

* placeholders stay placeholders (parameters, buffers and inputs arrive as this rank's
  local pieces); ignored assertion nodes (``_assert_tensor_metadata``) are dropped;
* every data edge whose placement changes gets a :class:`runtime.reshard.Reshard`
  submodule: forward from the producer's placement to the one the consumer needs, backward
  from the gradient placement the consumer produces to the dual of the producer's placement,
  exactly the moves the plan priced;
* every op is emitted by its rule's ``lower`` hook (:class:`LowerCall`): the same aten op on
  local tensors with shape arguments rewritten to local shapes, or a local kernel from
  :mod:`runtime.local_ops` where the sharded form needs one;
* a ZeRO-1 parameter (record ``stored``) or an offloaded one (``offload``) arrives as its compute
  copy (placed as the record's ``out``); its edges leave the gradient ``Partial`` where the copy
  is replicated, and ``gm.meta["partita.zero1"]`` lists the placements and whether the stepped
  tensor is on the host, for :mod:`runtime.optimizer_shards`;
* the gathers of weights stored sharded start one gather ahead of their use
  (:func:`passes.lower.prefetch_gathers.prefetch_gathers`);
* outputs the plan replicates are resharded to ``Replicate``; device arguments baked in at
  capture time (``meta``) are replaced by this rank's device;
* the nodes emitted for each region the plan recomputes (records marked ``recompute``, named
  by ``region``: a whole layer, or one layer's attention core under selective recomputation; its
  ops and the resharding into them, from its first to its last emitted node) move into a
  :class:`runtime.recompute.CheckpointRegion` (:func:`outline_recomputed`): its inputs are the
  values the range uses from before it, its outputs those used after it.

The result is a plain ``fx.GraphModule``: its ``.code`` is readable Python and it trains with
ordinary autograd. The plan is the only source of placements: records are looked up by node
name, so lowering a plan made for another graph fails at the first node that differs.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from passes.analysis.analyze import info
from passes.analysis.dim_blocks import dim_blocks
from passes.analysis.shape_check import cut_pieces, uneven_dims
from passes.capture.autocast_regions import AUTOCAST_KEY
from passes.core.node_info import grad_flows
from passes.core.placements import (
    dual_spec,
    format_spec,
    is_partial,
    is_shard,
    parse_spec,
    rank_local_shape,
    transition_steps,
    zero1_grad_spec,
)
from passes.core.plan_records import NodeRecord, typed_by_name
from passes.lower.errors import LoweringError
from passes.lower.prefetch_gathers import prefetch_gathers
from passes.lower.strided_layout import edge_strided, strided_chains
from passes.plan.output_placement import required_output_spec
from passes.rules import op_view, rule_for, tensor_input_nodes
from passes.rules.views import view_groups
from runtime.autocast_state import enter_autocast, exit_autocast
from runtime.collectives import MeshComm
from runtime.optimizer_shards import ZERO1_KEY
from runtime.recompute import CheckpointRegion
from runtime.regather import REGATHER_KEY
from runtime.reshard import Reshard

__all__ = ["LowerCall", "lower_to_local", "LoweringError", "outline_recomputed"]


def _specs(values, ndim):
    return [None if v is None else parse_spec(v, ndim) for v in values]


@dataclass
class LowerCall:
    """What a rule's ``lower`` hook gets: the node, its local inputs and its placements."""

    node: fx.Node
    args: tuple
    kwargs: dict
    out_specs: list
    in_specs: list
    local_out_shapes: list
    comm: MeshComm
    builder: _Builder
    notes: dict = field(default_factory=dict)
    """The plan record's per-axis rule notes (axis name -> note, e.g. ``ring``)."""

    @property
    def view(self):
        return op_view(self.node)

    @property
    def out_spec(self):
        return self.out_specs[0]

    @property
    def local_out_shape(self):
        return self.local_out_shapes[0]

    def emit(self, target=None, args=None, kwargs=None) -> fx.Node:
        """Emit a call (by default: this node's op on its local args), named after the node."""
        return self.builder.graph.create_node(
            "call_function",
            target or self.node.target,
            self.args if args is None else tuple(args),
            self.kwargs if kwargs is None else dict(kwargs),
            name=self.node.name,
        )

    def call_module(self, module: torch.nn.Module, args, kwargs=None, *, name=None) -> fx.Node:
        if not getattr(module, "uneven_pieces_ok", False) and self.uneven():
            raise LoweringError(
                f"node {self.node.name} ({self.node.target}) runs the local kernel {type(module).__name__}, "
                f"which needs equal pieces, on a dim these input shapes cut unevenly ({self._uneven_text()}); "
                f"use sizes that divide "
                f"the mesh axes cutting it, or make the parallel model for this shape"
            )
        return self.builder.call_module(module, tuple(args), kwargs or {}, name or self.node.name)

    def reshard(self, value: fx.Node, src, dst, grad=None) -> fx.Node:
        return self.builder.reshard(value, src, dst, grad, self.node.name)

    def uneven(self) -> bool:
        """Does this node read or write a tensor cut into unequal pieces?"""
        return bool(self.builder.uneven.of(self.node)) or any(
            self.builder.uneven.of(u, spec) for u, spec in zip(tensor_input_nodes(self.node), self.in_specs)
        )

    def _uneven_text(self) -> str:
        """Which dims of which tensor are cut unevenly, as an error names them."""
        parts = [f"input {k} dims {sorted(self.uneven_in(k))}" for k in range(len(self.in_specs)) if self.uneven_in(k)]
        if self.builder.uneven.of(self.node):
            parts.append(f"output dims {sorted(self.builder.uneven.of(self.node))}")
        return ", ".join(parts)

    def uneven_in(self, k: int) -> set:
        """The dims of input ``k``, as this op reads it, that are cut into unequal pieces."""
        return self.builder.uneven.of(tensor_input_nodes(self.node)[k], self.in_specs[k])

    def sharded_axes(self, spec, dim):
        return [a for a, p in enumerate(spec) if getattr(p, "dim", None) == dim and self.comm.shape[a] > 1]


class _UnevenPieces:
    """Which dims of which values are cut into unequal pieces at these shapes.

    A dim holding blocks that the plan cut whole (:mod:`passes.analysis.dim_blocks`: a flattened
    batch x sequence dim whose samples the plan's own batch divided among its pieces) is cut
    between blocks at any size, like ``torch.tensor_split`` of its block count; any other dim like
    ``tensor_split`` of its elements. Its pieces are unequal where that count does not divide by
    their number, as it is produced or as an op reads it (a batch kept whole, cut later): the
    144 rows of batch 6, seq 24 over 4 ranks are, attention scores ``[6, 4, 24, 24]`` cut on their
    two sequence dims are not. The mesh axes cutting such a dim are the *uneven axes*; a dim whose
    blocks the walk could not follow, in a value computed from the inputs, counts as uneven
    wherever one of them cuts it."""

    def __init__(self, graph: fx.Graph, records: dict[str, NodeRecord], comm: MeshComm):
        self.mesh = comm.shape
        self.blocks = dim_blocks(graph)
        self.planned = {  # an input's sizes at the shapes the plan was made for
            node.name: records[node.name].shapes[0]
            for node in graph.nodes
            if node.op == "placeholder" and node.name in records and records[node.name].shapes
        }
        self.from_inputs: set = set()
        self.axes: set = set()
        for node in graph.nodes:
            if node.op == "placeholder":
                if info(node).kind == "input":
                    self.from_inputs.add(node)
                    self._cut_unevenly(node, records[node.name].out[0], comm.ndim)
            elif any(u in self.from_inputs for u in tensor_input_nodes(node)):
                self.from_inputs.add(node)
                rec = records.get(node.name)
                if rec is None:
                    continue
                self._cut_unevenly(node, (rec.out or [None])[0], comm.ndim)
                for u, text in zip(tensor_input_nodes(node), rec.ins or ()):
                    if u in self.from_inputs:  # where the op reads it (a batch replicated, cut later)
                        self._cut_unevenly(u, text, comm.ndim)
        self.specs: dict = {}

    def _cut_unevenly(self, node: fx.Node, text, ndim: int) -> None:
        """Add the mesh axes that cut a dim of ``node``'s output placed ``text`` unevenly."""
        if text is None:
            return
        spec = parse_spec(text, ndim)
        for d in self._unequal(node, spec):
            self.axes.update(a for a, p in enumerate(spec) if getattr(p, "dim", None) == d)

    def _whole_blocks(self, node: fx.Node, spec) -> dict:
        """Dim -> its blocks, for the dims of ``node`` that ``spec`` cuts between blocks (the plan's
        own count of their source divides their pieces)."""
        held = (self.blocks.get(node) or [None])[0] or []
        out = {}
        for d, b in enumerate(held):
            if b is None or b[1] == 1 or b[2] is None:
                continue
            name, dim = b[2]
            planned = self.planned.get(name)
            pieces = cut_pieces(spec, d, self.mesh)[1]
            if planned is not None and dim < len(planned) and pieces > 1 and planned[dim] % pieces == 0:
                out[d] = b
        return out

    def _unequal(self, node: fx.Node, spec) -> set:
        """The dims ``spec`` cuts into unequal pieces (unknown ones aside)."""
        shape = info(node).out_shapes[0] if info(node).out_shapes else None
        if shape is None:
            return set()
        counts = list(shape)
        for d, b in self._whole_blocks(node, spec).items():
            counts[d] = b[0]
        return uneven_dims(counts, spec, self.mesh)

    def sample_sizes(self, node: fx.Node, dims, specs) -> dict:
        """Per dim of ``dims``, the elements of one block along it where one of ``specs`` (the
        edge's placements) cuts it between blocks (a split keeps them together, as the cut that
        made the pieces did: ``S`` for a flattened batch x sequence dim); 1 elsewhere."""
        out = {d: 1 for d in dims}
        for spec in specs:
            if spec is not None:
                for d, b in self._whole_blocks(node, spec).items():
                    if d in out:
                        out[d] = b[1]
        return out

    def of(self, node: fx.Node, spec=None) -> set:
        """The uneven dims of ``node``'s (first) output, placed ``spec`` (default: as produced)."""
        spec = spec if spec is not None else self.specs.get(node)
        if spec is None or not info(node).out_shapes or info(node).out_shapes[0] is None:
            return set()
        dims = self._unequal(node, spec)
        if node in self.from_inputs:
            held = (self.blocks.get(node) or [None])[0]
            unknown = {d for d, b in enumerate(held or ()) if b is None} if held is not None else None
            dims |= {
                p.dim
                for a, p in enumerate(spec)
                if a in self.axes and getattr(p, "dim", None) is not None and (unknown is None or p.dim in unknown)
            }
        return dims


class _Builder:
    def __init__(self, comm: MeshComm, device):
        self.comm = comm
        self.uneven: _UnevenPieces
        self.device = device
        self.graph = fx.Graph()
        self.root = torch.nn.Module()
        self._names = set()
        self.edges_from: dict = {}  # producer node name -> [(submodule name, Reshard)]

    def call_module(self, module, args, kwargs, base):
        name = base
        k = 0
        while name in self._names:
            k += 1
            name = f"{base}_{k}"
        self._names.add(name)
        self.root.add_module(name, module)
        return self.graph.call_module(name, args, kwargs)

    def reshard(self, value, src, dst, grad, base, strided=None, src_strided=None, producer=None, grad_dst=None):
        module = Reshard(self.comm, src, dst, grad, strided, src_strided, grad_dst)
        if module.is_noop:
            return value
        made = self.call_module(module, (value,), {}, f"reshard_{base}")
        if producer is not None:
            self.edges_from.setdefault(producer, []).append((made.target, module))
        return made


_SIZED_VIEWS = (
    torch.ops.aten.view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.expand.default,
    torch.ops.aten.unflatten.int,
)


def _sizes_follow(node: fx.Node, dims: set) -> bool:
    """Can a view with unknown local sizes on ``dims`` of its output take them from its input?
    An expand keeps each such dim's size where its input has the dim whole (not broadcast); a
    reshape computes each from its run of dims (:func:`runtime.uneven_views.reshape_by_groups`),
    one unknown per run."""
    in_shape, out_shape = info(tensor_input_nodes(node)[0]).out_shapes[0], info(node).out_shapes[0]
    if node.target is torch.ops.aten.expand.default:
        lead = len(out_shape) - len(in_shape)
        return all(d >= lead and in_shape[d - lead] == out_shape[d] for d in dims)
    if node.target is torch.ops.aten.unflatten.int:
        return False
    return all(len(dims.intersection(outs)) <= 1 for _, outs in view_groups(in_shape, out_shape))


def _joins_or_splits(steps, dims: set) -> bool:
    """Do ``steps`` all-gather, reduce-scatter or all-to-all along one of ``dims``?"""
    for _axis, p, q in steps:
        if is_shard(p) and p.dim in dims:  # an all-gather or all-to-all joins pieces of that dim
            return True
        if is_shard(q) and q.dim in dims and (is_partial(p) or is_shard(p)):
            return True
    return False


def _uneven_edge_dims(node, producer, src, dst, grad, strided, src_strided, uneven: _UnevenPieces) -> frozenset:
    """The dims cut into unequal pieces that this edge's collectives join or split (its moves of
    them run in :mod:`runtime.uneven_moves`); refused where such a dim is also strided (a fused
    projection's layout, which those moves do not keep)."""
    dims = uneven.of(producer, src) | uneven.of(producer, dst)
    if grad is not None:
        dims |= uneven.of(producer, grad)
    if not dims:
        return frozenset()
    forward = _joins_or_splits(transition_steps(tuple(src), tuple(dst)), dims)
    backward = grad is not None and _joins_or_splits(transition_steps(tuple(grad), dual_spec(tuple(src))), dims)
    if not (forward or backward):
        return frozenset()
    layouts = [(spec, axes) for spec, axes in ((dst, strided), (src, src_strided)) if axes]
    if any(getattr(spec[a], "dim", None) in dims for spec, axes in layouts for a in axes):
        raise LoweringError(
            f"node {node.name} ({node.target}) reads {producer.name} moved from {format_spec(src)} to "
            f"{format_spec(dst)} in a strided (fused) layout along a dim these input shapes cut into unequal "
            f"pieces; use sizes that divide the mesh axes cutting it, or make the parallel model for this shape"
        )
    return frozenset(dims)


def _replace_devices(obj, device):
    return pytree.tree_map(lambda v: device if isinstance(v, torch.device) else v, obj)


def _fill_nodes(obj, values: list):
    """``obj`` with its fx nodes replaced, in pytree order, by ``values``."""
    it = iter(values)
    return pytree.tree_map(lambda a: next(it) if isinstance(a, fx.Node) else a, obj)


def lower_to_local(
    graph: fx.Graph,
    records: Mapping[str, NodeRecord | dict],
    comm: MeshComm,
    *,
    device=None,
    bucket_grads: bool = False,
) -> fx.GraphModule:
    """Lower ``graph`` (captured and analysed) for this rank. ``records``: the plan's records by
    node name, typed (:class:`passes.core.plan_records.NodeRecord`) or as the JSON holds them.

    ``bucket_grads``: list, in ``gm.meta["partita.bucketable_grads"]``, the parameter edges whose
    gradient sync can be bucketed (the caller attaches the buckets; pipelines, which accumulate
    gradients over microbatches inside one step, keep the per-edge sync)."""
    lowering = _Lowering(graph, typed_by_name(records), comm, torch.device(device or "cpu"))
    for node in graph.nodes:
        lowering.emit(node)
    return lowering.finish(bucket_grads)


class _Lowering:
    """One rank's program being emitted, node by node, with what the nodes emitted so far left:
    each node's local value (``env``) and its placements (``out_specs``)."""

    def __init__(self, graph: fx.Graph, records: dict[str, NodeRecord], comm: MeshComm, device: torch.device):
        self.graph, self.records, self.comm, self.device = graph, records, comm, device
        self.b = _Builder(comm, device)
        self.b.uneven = _UnevenPieces(graph, records, comm)
        self.env: dict = {}
        self.out_specs: dict = {}
        self.output_specs: list = []  # the placement of each value the program returns
        self.output_shapes: list = []  # and its whole shape (to gather pieces that may be unequal)
        self.chains = strided_chains(graph, records, comm)
        self.zero1: dict = {}  # ZeRO-1 / offloaded parameter -> (compute copy's placement, the stepped one's, on host)
        self.grad_dst: dict = {}  # ZeRO-1 parameter -> where its edges leave the gradient
        self.layers: dict = {}  # recomputed layer -> [node before its first emitted node, its last emitted node]
        self.open_layer: str | None = None
        self.regathered = False  # some activation edge gathers again in backward

    def record(self, node):
        rec = self.records.get(node.name)
        if rec is None:
            raise LoweringError(
                f"the plan has no entry for node {node.name} ({node.target}); it was made for "
                f"another graph: plan again for this model"
            )
        return rec

    def emit(self, node) -> None:
        if self.open_layer is not None:  # the previous node was in a recomputed layer: it ends here so far
            self.layers[self.open_layer][1] = _last(self.b.graph)
            self.open_layer = None
        if node.op == "placeholder":
            self.placeholder(node)
        elif info(node).kind == "ignored":
            return
        elif node.op == "output":
            self.output(node)
        else:
            self.op(node)

    def placeholder(self, node) -> None:
        env, ndim = self.env, self.comm.ndim
        env[node] = self.b.graph.placeholder(node.name)
        env[node].meta.update(node.meta)
        rec = self.record(node)
        self.out_specs[node] = _specs(rec.out, ndim)
        if rec.stored or rec.offload:  # ZeRO-1 or offloaded: it reads a compute copy
            stored = parse_spec(rec.stored, ndim) if rec.stored else self.out_specs[node][0]
            self.zero1[node.name] = (self.out_specs[node][0], stored, bool(rec.offload))
            self.grad_dst[node] = zero1_grad_spec(self.out_specs[node][0], self.comm.shape)

    def output(self, node) -> None:
        counter = iter(range(10**9))
        b, env, out_specs = self.b, self.env, self.out_specs

        def out_value(n, counter=counter):
            v, src = env[n], out_specs[n][0]
            wanted = required_output_spec(self.graph, next(counter), src)
            # a value laid out strided for a later split is gathered from its strided blocks
            _, held = edge_strided(node, n, src, wanted or src, self.chains, self.comm)
            if wanted is not None:
                # the caller's gradient arrives in the placement returned (a loss: replicated)
                v = b.reshard(v, src, wanted, wanted, "output", src_strided=held)
            self.output_specs.append(wanted or out_specs[n][0])
            self.output_shapes.append(info(n).out_shapes[0])
            return v

        b.graph.output(pytree.tree_map(lambda a: out_value(a) if isinstance(a, fx.Node) else a, node.args[0]))

    def op(self, node) -> None:
        rec = self.record(node)
        if rec.recompute:  # a whole layer, or an attention core (selective recomputation)
            self.open_layer = rec.region or f"{rec.block}[{rec.block_index}]"
            self.layers.setdefault(self.open_layer, [_last(self.b.graph), None])
        state = node.meta.get(AUTOCAST_KEY)  # a node the model runs under another autocast state
        context = self.b.graph.call_function(enter_autocast, tuple(state)) if state is not None else None
        self.op_body(node, rec)
        if context is not None:
            self.b.graph.call_function(exit_autocast, (context,))

    def op_body(self, node, rec: NodeRecord) -> None:
        b, env, ndim = self.b, self.env, self.comm.ndim
        ins = _specs(rec.ins, ndim)
        grads = _specs(rec.grads if rec.grads is not None else [None] * len(ins), ndim)
        outs = _specs(rec.out, ndim)
        inputs = tensor_input_nodes(node)
        if node.target is operator.getitem:
            env[node] = b.graph.call_function(operator.getitem, (env[node.args[0]], node.args[1]))
            self.out_specs[node] = [self.out_specs[node.args[0]][node.args[1]]]
            return
        if len(ins) != len(inputs):
            raise LoweringError(f"plan entry for {node.name} lists {len(ins)} inputs, the graph has {len(inputs)}")
        local_inputs = [self.input_value(node, k, u, ins[k], grads[k]) for k, u in enumerate(inputs)]
        args, kwargs = _fill_nodes((node.args, node.kwargs), local_inputs)
        args, kwargs = _replace_devices(args, self.device), _replace_devices(kwargs, self.device)
        if outs and outs[0] is not None:
            b.uneven.specs[node] = outs[0]
        local_shapes = self.local_shapes(node, outs)
        call = LowerCall(node, tuple(args), dict(kwargs), outs, ins, local_shapes, self.comm, b, rec.notes or {})
        result = rule_for(node).lower(call)
        if isinstance(result, fx.Node):  # not over an input the op passed through (dropout at p=0)
            result.meta.setdefault("partita.source", node.name)
        env[node] = result
        self.out_specs[node] = outs

    def input_value(self, node, k: int, u, dst, grad):
        """Input ``k`` (node ``u``) of ``node`` as the op reads it: resharded from where ``u``
        left it to ``dst`` (its gradient back from ``grad``)."""
        src = self.out_specs[u][0]
        value = self.env[u]
        if dst is None or src is None:
            return value
        grad = grad if grad_flows(u, node) else None
        strided, src_strided = edge_strided(node, u, src, dst, self.chains, self.comm)
        uneven = _uneven_edge_dims(node, u, src, dst, grad, strided, src_strided, self.b.uneven)
        made = self.b.reshard(
            value,
            src,
            dst,
            grad,
            f"{node.name}_in{k}",
            strided,
            src_strided,
            producer=u.name,
            grad_dst=self.grad_dst.get(u),
        )
        if made is not value and uneven:
            edge = self.b.root.get_submodule(str(made.target))
            assert isinstance(edge, Reshard), edge
            edge.uneven = uneven
            edge.uneven_units = self.b.uneven.sample_sizes(u, uneven, (src, dst, grad))
        if made is not value and k in (self.record(node).regather_inputs or ()):
            # an activation kept as its shard, gathered again in backward (passes/plan/activation_regather.py)
            edge = self.b.root.get_submodule(str(made.target))
            assert isinstance(edge, Reshard), edge
            edge.regather = self.regathered = True
        return made

    def local_shapes(self, node, outs) -> list:
        """Each output's shape on this rank; a dim cut into unequal pieces is -1 (the local size
        follows from the rank's input)."""
        comm = self.comm
        uneven_out = self.b.uneven.of(node)
        local_shapes = [
            None
            if s is None or sp is None
            else [-1 if d in uneven_out else n for d, n in enumerate(rank_local_shape(s, sp, comm.shape, comm.coords))]
            for s, sp in zip(info(node).out_shapes, outs)
        ]
        if len(uneven_out) > 1 and node.target in _SIZED_VIEWS and not _sizes_follow(node, uneven_out):
            raise LoweringError(
                f"node {node.name} ({node.target}) reshapes a tensor cut into unequal pieces on dims "
                f"{sorted(uneven_out)}, which no local size determines; use sizes that divide the mesh axes "
                f"cutting them"
            )
        return local_shapes

    def finish(self, bucket_grads: bool) -> fx.GraphModule:
        """The rank's GraphModule: parameter edges marked, recomputed layers outlined, weight
        gathers prefetched, and what the runtime needs in ``gm.meta``."""
        b, graph = self.b, self.graph
        gm = fx.GraphModule(b.root, b.graph, class_name="PartitaRankProgram")
        gm.graph.lint()
        for node in graph.find_nodes(op="placeholder"):
            if info(node).kind == "param":  # these edges' backward syncs the parameter's gradient
                for _, edge in b.edges_from.get(node.name, ()):
                    edge.param_edge = node.name
                    edge.weight_name = info(node).name
                    # ZeRO-3: gathered copies freed after forward, gathered again in backward
                    edge.regather = bool(self.record(node).regather) and edge.forward_communicates
                    gm.meta[REGATHER_KEY] = gm.meta.get(REGATHER_KEY, False) or edge.regather
        gm.meta[REGATHER_KEY] = gm.meta.get(REGATHER_KEY, False) or self.regathered
        bucketable = _bucketable(graph, b) if bucket_grads else {}
        spans = {layer: (before.next, end) for layer, (before, end) in self.layers.items() if end is not before}
        moved = outline_recomputed(gm, spans)
        prefetch_gathers(gm)  # weight gathers started one ahead of their use
        gm.meta["partita.output_specs"] = self.output_specs  # placement of each returned value, in order
        gm.meta["partita.output_shapes"] = self.output_shapes
        gm.meta[ZERO1_KEY] = self.zero1
        gm.meta["partita.bucketable_grads"] = {moved.get(name, name): param for name, param in bucketable.items()}
        return gm


def _last(graph: fx.Graph) -> fx.Node:
    return next(iter(reversed(graph.nodes)))


def outline_recomputed(gm: fx.GraphModule, spans: dict) -> dict:
    """Move each span (layer name -> (first, last) node of ``gm.graph``) into a
    :class:`CheckpointRegion` submodule called in its place. Returns the new qualified names of
    the submodules that moved (``reshard_x`` -> ``recompute_3.body.reshard_x``)."""
    moved: dict = {}
    for k, (layer, (first, last)) in enumerate(spans.items()):
        nodes, n = [], first
        while True:
            nodes.append(n)
            if n is last:
                break
            n = n.next
        moved.update(_outline(gm, f"recompute_{k}", layer, nodes))
    if spans:
        gm.delete_all_unused_submodules()
        gm.graph.lint()
        gm.recompile()
    return moved


def _outline(gm: fx.GraphModule, name: str, layer: str, nodes: list) -> dict:
    """Replace the consecutive ``nodes`` by a call of a :class:`CheckpointRegion` running them."""
    graph = gm.graph
    inside = set(nodes)
    inputs: list = []
    for n in nodes:
        inputs += [a for a in n.all_input_nodes if a not in inside and a not in inputs]
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    body_graph = fx.Graph()
    env = {a: body_graph.placeholder(a.name) for a in inputs}
    for n in nodes:
        env[n] = body_graph.node_copy(n, lambda a: env[a])
    body_graph.output(tuple(env[o] for o in outputs))
    gm.add_submodule(name, CheckpointRegion(fx.GraphModule(gm, body_graph, class_name="RecomputedLayer"), layer))
    with graph.inserting_before(nodes[0]):
        call = graph.call_module(name, tuple(inputs))
        for j, o in enumerate(outputs):
            value = graph.call_function(operator.getitem, (call, j))
            o.replace_all_uses_with(value, delete_user_cb=lambda user: user not in inside)
    for n in reversed(nodes):
        graph.erase_node(n)
    return {n.target: f"{name}.body.{n.target}" for n in nodes if n.op == "call_module"}


def _bucketable(graph, b) -> dict:
    """Reshard submodule -> parameter placeholder, for parameters whose whole gradient sync is one
    edge's reductions (all-reduces, reduce-scatters): those join DDP-style buckets
    (runtime/grad_sync.py). A parameter used by several ops (a tied weight) keeps per-edge syncs:
    its other uses may give it a ``.grad`` before the bucket is reduced, and its piece of the
    reduced buffer, only added there, would stay alive with the buffer (the other parameters'
    ``.grad`` are views of it)."""
    out = {}
    for node in graph.nodes:
        if node.op != "placeholder" or info(node).kind != "param" or len(node.users) != 1:
            continue
        moving = [
            (name, m)
            for name, m in b.edges_from.get(node.name, ())
            if any(b.comm.shape[s[0]] > 1 for s in m.backward_steps or ())
        ]
        if len(moving) == 1 and moving[0][1].sync_moves is not None:
            out[moving[0][0]] = node.name
    return out
