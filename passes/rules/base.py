"""The shape of a rule: what it sees of a node, what it returns, and the registry.

A rule describes one aten op family (decision 3 in docs/ARCHITECTURE.md). For one mesh axis it lists
the :class:`AxisStrategy` candidates: the placement each tensor input must have and the
placement of each output (``Shard(d)``, ``Replicate()``, ``Partial()``), plus any collective
the op needs inside itself (vocab-parallel softmax statistics, SyncBN). Candidates for an
N-D mesh are the per-axis candidates combined over axes (``expand_to_mesh``), kept only where
every sharded dim divides evenly.

``None`` as an input placement means the op reads only that input's metadata (``new_ones``,
``type_as``): no data moves on that edge.

A rule reads the algorithm modes forced for this plan (``tensor_parallel=``, ``sequence_parallel=``,
``expert_parallel=``) and the mesh from ``op.options`` (:class:`passes.core.rule_options.RuleOptions`),
which the strategy space puts on every view it makes; there is no module state to set.

An op with no rule gets :data:`REPLICATE_FALLBACK`: everything replicated, one warning per op.
"""

from __future__ import annotations

import abc
import itertools
import warnings
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from passes.core.placements import P, Partial, R, Replicate, Shard, spec_fits
from passes.core.rule_options import DEFAULT_RULE_OPTIONS, RuleOptions

__all__ = [
    "OpView",
    "AxisStrategy",
    "Strategy",
    "OpRule",
    "register",
    "rule_for",
    "expand_to_mesh",
    "op_view",
    "tensor_input_nodes",
    "IGNORED_OPS",
    "REPLICATE_FALLBACK",
    "op_name",
    "has_rule",
]


def op_name(target) -> str:
    return str(getattr(target, "_name", None) or getattr(target, "__name__", None) or target).replace("::", ".")


def rate_key(node: fx.Node) -> str:
    """The name a measured op rate is kept under (``ClusterSpec.op_rates``): the op's name, with
    the variant that changes how fast its kernel runs: ``:causal`` for causal attention (the
    kernel skips masked blocks; the rule counts the whole score matrix either way), ``:tanh``
    for a GELU's tanh approximation."""
    name = op_name(node.target)
    if name == "aten.scaled_dot_product_attention":
        causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
        return name + ":causal" if causal else name
    if name == "aten.gelu" and node.kwargs.get("approximate", "none") == "tanh":
        return name + ":tanh"
    return name


def tensor_input_nodes(node: fx.Node) -> list:
    """Every fx.Node occurrence among ``node``'s args and kwargs, in order, duplicates kept.

    Remembered on the node for its current ``args`` / ``kwargs`` objects (fx assigns new ones
    when a node's inputs change), since planning asks it hundreds of thousands of times."""
    args, kwargs = node.args, node.kwargs
    known = getattr(node, "_partita_inputs", None)
    if known is not None and known[0] is args and known[1] is kwargs:
        return list(known[2])
    found = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, fx.Node)]
    node._partita_inputs = (args, kwargs, tuple(found))
    return found


def _shape_of(val):
    if isinstance(val, torch.Tensor):
        return tuple(int(s) for s in val.shape)
    return None


@dataclass(frozen=True)
class OpView:
    """What a rule sees of one node: its inputs' and outputs' global shapes and its args."""

    node: fx.Node
    in_shapes: tuple
    """One global shape per tensor-input occurrence (None for a non-tensor node input)."""
    out_shapes: tuple
    """One global shape per output (a single-output op has one)."""
    in_dtypes: tuple
    out_dtypes: tuple
    options: RuleOptions = DEFAULT_RULE_OPTIONS
    """The modes and mesh this plan is made under (the defaults: the solver chooses freely)."""

    @property
    def args(self):
        return self.node.args

    @property
    def kwargs(self):
        return self.node.kwargs

    def arg(self, index: int, name: str, default=None):
        if len(self.node.args) > index:
            return self.node.args[index]
        return self.node.kwargs.get(name, default)

    @property
    def out_shape(self) -> tuple:
        return self.out_shapes[0]

    @property
    def out_rank(self) -> int:
        return len(self.out_shapes[0])


def _val_list(val):
    if isinstance(val, (list, tuple)):
        return list(val)
    return [val]


def op_view(node: fx.Node, options: RuleOptions = DEFAULT_RULE_OPTIONS) -> OpView:
    ins = tensor_input_nodes(node)
    in_vals = [n.meta.get("val") for n in ins]
    outs = _val_list(node.meta.get("val"))
    return OpView(
        node=node,
        in_shapes=tuple(_shape_of(v) for v in in_vals),
        out_shapes=tuple(_shape_of(v) for v in outs),
        in_dtypes=tuple(getattr(v, "dtype", None) for v in in_vals),
        out_dtypes=tuple(getattr(v, "dtype", None) for v in outs),
        options=options,
    )


@dataclass(frozen=True)
class AxisStrategy:
    """One candidate on one mesh axis."""

    out: tuple
    """Placement of each output."""
    ins: tuple
    """Placement each tensor input must arrive in (None: metadata only)."""
    extra: tuple = ()
    """Collectives inside the op: ``(kind, phase, elements, scaling)``; phase ``fwd``/``bwd``;
    ``scaling="work"``: the buffer shrinks with the op's work split on the other axes (row
    statistics), so its payload is ``elements * itemsize * n_axis / split``; ``"none"``: the
    payload is ``elements * itemsize`` (a count); the others: ``passes.plan.cost_model.extra_payload``."""
    note: str = ""
    """Lowering hint, e.g. ``"strided"`` for a split of a sharded dim."""

    @property
    def splits_work(self) -> bool:
        return any(isinstance(p, Shard) for p in self.out + self.ins)

    def grad_placement(self, index: int):
        """The placement of the gradient this op sends back to input ``index``.

        A sharded input gets a sharded gradient; a partial input a replicated one (the
        gradient of a sum is broadcast); a replicated input whose consumer does different
        work per rank on this axis gets a partial gradient (each rank's share must be summed).
        """
        p = self.ins[index]
        if p is None or isinstance(p, Shard):
            return p
        if isinstance(p, Partial):
            return R
        others = self.out + self.ins[:index] + self.ins[index + 1 :]
        return P if any(q is not None and not isinstance(q, Replicate) for q in others) else R


@dataclass(frozen=True)
class Strategy:
    """A candidate on the whole mesh: one AxisStrategy per axis."""

    axes: tuple
    out: tuple = field(compare=False)
    """Per output: a spec (one placement per mesh axis)."""
    ins: tuple = field(compare=False)
    """Per tensor input: a spec, or None (metadata only)."""

    @classmethod
    def from_axes(cls, axes) -> Strategy:
        axes = tuple(axes)
        n_out, n_in = len(axes[0].out), len(axes[0].ins)
        out = tuple(tuple(a.out[i] for a in axes) for i in range(n_out))
        ins = tuple(None if axes[0].ins[i] is None else tuple(a.ins[i] for a in axes) for i in range(n_in))
        return cls(axes=axes, out=out, ins=ins)

    def grad_spec(self, index: int):
        if self.ins[index] is None:
            return None
        return tuple(a.grad_placement(index) for a in self.axes)

    def compute_split(self, mesh_shape) -> int:
        split = 1
        for a, n in zip(self.axes, mesh_shape):
            if a.splits_work:
                split *= n
        return split


class OpRule(abc.ABC):
    """Base class: subclasses override ``axis_strategies`` and, for contractions, ``flops``."""

    linear: bool = False
    """The output is linear in the (single) data input, so Partial passes through."""
    saves_inputs: bool = False
    """Backward needs this op's inputs (they stay alive as activations)."""
    follower: bool = True
    """May merge into its producer's decision when all its data inputs come from one group."""
    contraction: bool = False
    """Compute-bound (FLOPs run at matmul speed) and costs 2x forward in backward."""
    differentiable: bool = True
    """Its output passes gradients back to its inputs (False: ``zeros_like`` and the other
    factories, whose inputs lend only a shape: no gradient leaves them, none is priced)."""
    metadata_inputs: tuple = ()
    """Positions (among ``tensor_input_nodes``) of inputs the op reads only the metadata of
    (``type_as``'s ``other``: its dtype): whether they need a gradient does not make the output
    need one, as autograd records it (Funnel's attention mask cast ``type_as`` the hidden states
    needs none, and no gradient move on its edges is priced)."""
    unpacks_in_turn: bool = False
    """Its backward is several autograd nodes, each unpacking one saved weight and freeing it
    before the next (the experts op's products): ZeRO-3 copies gathered again one at a time."""

    @abc.abstractmethod
    def axis_strategies(self, op: OpView) -> list:
        """The candidates on one mesh axis."""

    def keeps_saved_input(self, node: fx.Node, k: int, spec) -> bool:
        """Whether the op as lowered keeps tensor input ``k``, placed ``spec``, for backward, given
        that the aten op saves it (``NodeInfo.saves``): a ZeRO-3 weight kept so is gathered again
        in backward. True unless the rule lowers to a kernel of its own that does not keep it."""
        return True

    def lower(self, call):
        """Emit this op for one rank (``passes.lower.lower_to_local.LowerCall``); default: the same
        op on local tensors. Rules whose sharded form differs override this."""
        return call.emit()

    def combination_ok(self, axes, op: OpView) -> bool:
        """Whether per-axis candidates ``axes`` may be combined on one mesh for ``op`` (default: any)."""
        return True

    def rate_shape(self, op: OpView, strategy: Strategy | None = None, mesh_shape=()) -> tuple | None:
        """Where a measured rate of this op kept over a grid of shapes (``ClusterSpec.op_rates``)
        is read when it runs under ``strategy`` on ``mesh_shape`` (None: a strategy-free read);
        None (the default): the rule's rate is one number."""
        return None

    def work_scale(self, op: OpView, strategy: Strategy, mesh_shape) -> float:
        """How much more than its even share of the FLOPs the busiest rank computes under
        ``strategy`` (1.0: an even split; a mixture-of-experts layer's routed imbalance)."""
        return 1.0

    def own_axes_of_instance(self, node: fx.Node, leader: fx.Node, axes: tuple) -> tuple:
        """The per-axis candidates ``axes`` (chosen for ``leader``, the node of the first instance
        of a repeated block) as ``node``, another instance of it, runs them: its collectives
        inside the op may move other amounts (default: the same)."""
        return axes

    def saves(self, op: OpView, grads):
        """What the op keeps for backward (a ``passes.analysis.saved_tensors.Saves``), for an op whose
        lowering runs other code than the op itself; None (the default): found by running the op."""
        return None

    def buffer_share(self, op: OpView, placed: list, mesh_shape) -> float | None:
        """The fraction of its own saved buffers (``Saves.extra_bytes``, at the graph's shapes) a
        device keeps, its inputs placed as ``placed`` (``(shape, placement)`` pairs); None (the
        default): the share of its largest input (:func:`passes.plan.cost_model.largest_share`)."""
        return None

    def flops(self, op: OpView) -> float:
        shape = op.out_shapes[0] or ()
        n = 1
        for s in shape:
            n *= s
        return float(n)

    # helpers shared by rules -------------------------------------------------
    @staticmethod
    def replicate_all(op: OpView) -> AxisStrategy:
        return AxisStrategy(out=(R,) * len(op.out_shapes), ins=tuple(None if s is None else R for s in op.in_shapes))


class _ReplicateFallback(OpRule):
    follower = False
    saves_inputs = True

    def __init__(self):
        self.warned = set()

    def axis_strategies(self, op: OpView) -> list:
        name = op_name(op.node.target)
        if name not in self.warned:
            self.warned.add(name)
            warnings.warn(
                f"partita: no sharding rule for op {name} (node {op.node.name}); "
                f"it runs replicated. Register a rule in passes/rules to shard it.",
                stacklevel=2,
            )
        return [self.replicate_all(op)]


REPLICATE_FALLBACK = _ReplicateFallback()
_REGISTRY: dict = {}

IGNORED_OPS = {
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
}


def register(*targets):
    """Class decorator-ish: ``register(aten.add.Tensor, ...)(RuleInstance)``."""

    def bind(rule: OpRule) -> OpRule:
        for t in targets:
            _REGISTRY[t] = rule
        return rule

    return bind


def rule_for(node: fx.Node) -> OpRule:
    target = node.target
    rule = _REGISTRY.get(target)
    if rule is None and hasattr(target, "overloadpacket"):
        rule = _REGISTRY.get(target.overloadpacket)
    return rule if rule is not None else REPLICATE_FALLBACK


def has_rule(node: fx.Node) -> bool:
    return rule_for(node) is not REPLICATE_FALLBACK


def expand_to_mesh(axis_candidates: list, op: OpView, mesh_shape) -> list:
    """All per-axis combinations whose specs divide every tensor evenly (deduplicated)."""
    out, seen = [], set()
    rule = rule_for(op.node)
    for combo in itertools.product(axis_candidates, repeat=len(mesh_shape)):
        strat = Strategy.from_axes(combo)
        if strat.axes in seen or not rule.combination_ok(strat.axes, op):
            continue
        ok = all(shape is None or spec_fits(shape, spec, mesh_shape) for shape, spec in zip(op.out_shapes, strat.out))
        ok = ok and all(
            spec is None or shape is None or spec_fits(shape, spec, mesh_shape)
            for shape, spec in zip(op.in_shapes, strat.ins)
        )
        if ok:
            seen.add(strat.axes)
            out.append(strat)
    return out
