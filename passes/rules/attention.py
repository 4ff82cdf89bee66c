"""scaled_dot_product_attention(q[B,H,Sq,D], k[B,Hkv,Skv,D], v, attn_mask, dropout, is_causal).

Per mesh axis the candidates are:

* replicated; batch-sharded (data parallel);
* head-sharded (Megatron attention: q, k and v sharded on heads, which needs both head counts
  divisible, and keeps grouped-query heads aligned because both are cut into the same number
  of contiguous blocks);
* query-sequence sharded with keys and values whole (not offered with ``is_causal``, whose
  mask depends on a query's global position; attention's memory does not fall with ``p``);
* **ring** (note ``ring``, :mod:`runtime.ring_attention`): q, k and v sequence-sharded, the
  key/value blocks passed around the axis; its own collectives are ``send_recv`` transfers of
  the local k/v blocks, ``p - 1`` forward and ``2 (p - 1)`` backward (k/v and their gradients),
  priced with scaling ``ring`` (local bytes times ``p - 1``; their time overlaps the block
  computations, see :func:`passes.plan.cost_model.own_collectives`); under ``is_causal`` the query
  block is moved into the zig-zag layout and back by all-to-alls of the local buffers (forward
  q and the output; backward q, dO, dq and the row sums ``rowsum(dO * O)``), which balances the
  causal work. A mask tensor comes split on its query rows with every key column;
* **Ulysses** (note ``ulysses``, :mod:`runtime.ulysses_attention`): q, k and v
  sequence-sharded, turned head-sharded by all-to-alls inside the op and back: 4 all-to-alls
  of the local buffers forward (q, k, v, output) and 4 backward (dO, dq, dk, dv) plus the row
  sums ``rowsum(dO * O)`` (``1 / D`` of dO); offered when the query and key/value heads divide
  by every mesh axis size; a mask stays whole on that axis.

A mask that broadcasts over a sharded dim stays replicated. Neither algorithm returns a gradient
for the mask, so a mask that needs one (a learned bias) gets neither; nor does cross-attention
(queries and keys of different lengths), which keeps the other candidates. The eager
``softmax(q @ k^T) @ v`` pattern needs no rule of its own: the matmul, softmax and elementwise
rules plan it op by op, and where ring or Ulysses is forced :mod:`passes.capture.eager_attention`
first turns it into this op.

Which of the sequence algorithms are offered is a planning setting
(``op.options.sequence_parallel``, from ``partitioner.plan(..., sequence_parallel=...)``): ``"auto"``
offers all (the solver chooses by cost and memory), ``"ring"`` / ``"ulysses"`` only that one
(and :func:`forced_pins` pins every attention output to it on the ``sp`` axis, else the last,
ring's heads split on ``tp``, data parallel on the others), ``"none"`` neither. Ring or Ulysses
on one axis combines with replicated or batch-sharded attention on the other axes, ring also with
head-sharded attention.
"""

from __future__ import annotations

import logging
import math

import torch

from passes.core.placements import R, Shard
from passes.core.rule_options import SEQUENCE_PARALLEL_MODES
from passes.rules.base import AxisStrategy, OpRule, OpView, register, tensor_input_nodes

aten = torch.ops.aten
RING_TRANSFERS_PER_HOP = 2
"""Transfers per hop of one ring ``send_recv`` entry: the pair it prices (k and v, or their
gradients' accumulators) travels as two tensors, each its own send and receive
(``runtime.ring_attention._Ring.start``); an entry is ``p - 1`` hops, so ``2 (p - 1)`` calls."""

logger = logging.getLogger(__name__)

__all__ = ["AttentionRule", "forced_pins", "SEQUENCE_PARALLEL_MODES", "SEQUENCE_ALGORITHMS"]

SEQUENCE_ALGORITHMS = ("ring", "ulysses")


def _batch_pieces_only(call, axis: int) -> bool:
    """May ring or Ulysses on mesh axis ``axis`` run on these unequal pieces? Yes where only the
    batch (dim 0) of q, k, v, the mask and the output is cut unevenly, and not by ``axis``: the
    ranks that pass blocks along ``axis`` then hold the same samples, and the sequence and head
    dims they exchange are cut evenly."""
    dims = set(call.builder.uneven.of(call.node))
    for k in range(len(call.in_specs)):
        if call.in_specs[k] is not None:
            dims |= call.uneven_in(k)
            if 0 in call.uneven_in(k) and getattr(call.in_specs[k][axis], "dim", None) == 0:
                return False
    return dims <= {0} and getattr(call.out_spec[axis], "dim", None) != 0


def _is_causal(op: OpView) -> bool:
    return bool(op.arg(5, "is_causal", False))


def _cross_attention(op: OpView) -> bool:
    q, k = op.in_shapes[0], op.in_shapes[1]
    return len(q) == 4 and k is not None and len(k) == 4 and q[2] != k[2]


def _common_problem(op: OpView) -> str | None:
    """Why neither ring nor Ulysses can run this op, whatever the mesh (None: both may)."""
    q, k = op.in_shapes[0], op.in_shapes[1]
    if len(q) != 4 or k is None or len(k) != 4:
        return f"q has shape {q}, not [batch, heads, sequence, head_dim]"
    if q[2] != k[2]:
        return f"queries ({q[2]}) and keys ({k[2]}) differ in length (cross-attention)"
    if op.arg(4, "dropout_p", 0.0):
        return "it has attention dropout"
    from passes.core.node_info import META_KEY

    ins = tensor_input_nodes(op.node)
    meta = ins[3].meta.get(META_KEY) if len(ins) > 3 else None
    if meta is not None and meta.requires_grad:
        return f"its mask {meta.name} needs a gradient (a learned bias), which neither algorithm returns"
    return None


def _ring_problem(op: OpView, sizes) -> str | None:
    """Why ring attention cannot run this op on axes of ``sizes`` (None: it can)."""
    q, k = op.in_shapes[0], op.in_shapes[1]
    problem = _common_problem(op)
    if problem:
        return problem
    if q[1] % k[1]:
        return f"query heads ({q[1]}) do not divide by key/value heads ({k[1]})"
    for n in sizes:
        if q[2] % (2 * n if _is_causal(op) else n):
            need = f"2 x {n} (causal: two chunks per rank)" if _is_causal(op) else str(n)
            return f"its sequence length {q[2]} does not divide by {need}"
    return None


def _ulysses_problem(op: OpView, sizes) -> str | None:
    q, k = op.in_shapes[0], op.in_shapes[1]
    problem = _common_problem(op)
    if problem:
        return problem
    for n in sizes:
        if q[1] % n or k[1] % n or q[2] % n:
            return f"its query heads ({q[1]}), key/value heads ({k[1]}) and sequence ({q[2]}) do not all divide by {n}"
    return None


def forced_pins(graph, mode: str, mesh_shape, axis_names=None) -> dict:
    """For ``mode`` ``"ring"`` / ``"ulysses"``: pin every attention node's output sequence-sharded
    on the sequence axis (the axis named ``sp`` in ``axis_names``, else the last mesh axis; the
    rule then serves it only with that algorithm), for ring head-sharded on an axis named ``tp``
    where both head counts divide by it (context parallelism beside Megatron's heads), and batch-sharded on
    the others (replicated where the batch does not divide). Raises naming the node when the
    algorithm cannot run it. Cross-attention (keys of another length than the queries) is not
    pinned: the solver plans it with the rule's other candidates (replicated, batch or head
    split), priced like any op, and the log names it."""
    from passes.rules.base import op_view

    if mode not in SEQUENCE_ALGORITHMS:
        return {}
    mesh = tuple(mesh_shape)
    names = tuple(axis_names) if axis_names is not None else ()
    seq_axis = names.index("sp") if "sp" in names else len(mesh) - 1
    pins = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not aten.scaled_dot_product_attention.default:
            continue
        op = op_view(node)
        if _cross_attention(op):
            logger.info(
                "sequence_parallel=%r: %s is cross-attention (queries %s, keys %s): planned without %s",
                mode,
                node.name,
                op.in_shapes[0][2],
                op.in_shapes[1][2],
                mode,
            )
            continue
        pins[node] = _forced_spec(op, node, mode, mesh, names, seq_axis)
    return pins


def _forced_spec(op: OpView, node, mode: str, mesh: tuple, names: tuple, seq_axis: int) -> tuple:
    """:func:`forced_pins`'s placement of one attention output (raises when ``mode`` cannot run it)."""
    q, k = op.in_shapes[0], op.in_shapes[1]
    heads_on = [a for a, n in enumerate(mesh) if a < len(names) and names[a] == "tp" and n > 1 and mode == "ring"]
    heads_on = [a for a in heads_on if q[1] % mesh[a] == 0 and k[1] % mesh[a] == 0]
    problem = (_ring_problem if mode == "ring" else _ulysses_problem)(
        op, [mesh[seq_axis]] if mesh[seq_axis] > 1 else []
    )
    if problem:
        other = "ulysses" if mode == "ring" else "ring"
        other = "'auto'" if _common_problem(op) else f"{other!r} or 'auto'"
        raise ValueError(
            f"sequence_parallel={mode!r}: attention node {node.name} "
            f"({node.meta.get('partita.info').module_path if node.meta.get('partita.info') else 'top level'}) "
            f"cannot run as {mode} on mesh axis {seq_axis} ({mesh[seq_axis]} ranks): {problem}; "
            f"try sequence_parallel={other}, or another mesh"
        )
    return tuple(
        Shard(2) if a == seq_axis else Shard(1) if a in heads_on else Shard(0) if q[0] % n == 0 and n > 1 else R
        for a, n in enumerate(mesh)
    )


def _row_sums(op: OpView, rows: int) -> float:
    """The row sums ``rowsum(dO * O)`` an algorithm moves, in elements of the op's dtype (the
    unit of ``AxisStrategy.extra``): they are softmax statistics, kept in fp32 at least (under
    autocast the op computes in bf16 / fp16 and they weigh 2 of its elements each)."""
    dtype = op.out_dtypes[0] if op.out_dtypes and op.out_dtypes[0] is not None else torch.float32
    stats = torch.promote_types(dtype, torch.float32)
    return float(rows) * stats.itemsize / dtype.itemsize


class AttentionRule(OpRule):
    contraction = True
    saves_inputs = True
    follower = False

    def axis_strategies(self, op: OpView) -> list:
        q = op.in_shapes[0]
        n_in = len(op.in_shapes)
        mask = op.in_shapes[3] if n_in > 3 else None
        is_causal = _is_causal(op)
        mode = op.options.sequence_parallel

        def mask_p(dim):
            if mask is None:
                return None
            d = dim - (len(q) - len(mask))
            return Shard(d) if d >= 0 and mask[d] > 1 else R

        def make(qp, kvp, out, mask_dim, note="", extra=()):
            ins = [qp, kvp, kvp] + ([mask_p(mask_dim) if mask_dim is not None else R] if mask is not None else [])
            ins += [None] * (n_in - len(ins))
            return AxisStrategy(out=(out,) + (R,) * (len(op.out_shapes) - 1), ins=tuple(ins), extra=extra, note=note)

        strategies = [make(R, R, R, None)]
        if q[0] > 1:
            strategies.append(make(Shard(0), Shard(0), Shard(0), 0))
        if q[1] > 1:
            strategies.append(make(Shard(1), Shard(1), Shard(1), 1))
        if q[2] > 1 and not is_causal and mode in ("auto", "none"):
            strategies.append(make(Shard(2), R, Shard(2), 2))
        if len(q) != 4 or q[2] <= 1:
            return strategies
        sizes = op.options.axis_sizes()
        nq, nk = math.prod(q), math.prod(op.in_shapes[1])
        if mode in ("auto", "ring") and _ring_problem(op, sizes) is None:
            kv = float(2 * nk)
            extra = [
                ("send_recv", "fwd", kv, "ring"),
                ("send_recv", "bwd", kv, "ring"),
                ("send_recv", "bwd", kv, "ring"),
            ]
            if is_causal:  # the zig-zag exchanges: q and the output; backward q, dO, dq and the row sums
                extra += [("all_to_all", ph, float(nq), "local") for ph in ("fwd", "fwd", "bwd", "bwd", "bwd")]
                extra.append(("all_to_all", "bwd", _row_sums(op, nq // q[3]), "local"))
            strategies.append(make(Shard(2), Shard(2), Shard(2), 2, note="ring", extra=tuple(extra)))
        if mode in ("auto", "ulysses") and _ulysses_problem(op, sizes) is None:
            sizes4 = (nq, nk, nk, nq)
            a2a = tuple(("all_to_all", ph, float(n), "local") for ph in ("fwd", "bwd") for n in sizes4)
            a2a += (("all_to_all", "bwd", _row_sums(op, nq // q[3]), "local"),)  # the row sums rowsum(dO * O)
            u_ins: list = [Shard(2), Shard(2), Shard(2)] + ([R] if mask is not None else [])
            u_ins += [None] * (n_in - len(u_ins))
            out = (Shard(2),) + (R,) * (len(op.out_shapes) - 1)
            strategies.append(AxisStrategy(out=out, ins=tuple(u_ins), extra=a2a, note="ulysses"))
        return strategies

    def combination_ok(self, axes, op) -> bool:
        """Ring or Ulysses on one axis: the others replicated or batch-sharded; beside ring also
        head-sharded (context parallelism with tensor parallelism: each rank runs the ring on its
        heads; Ulysses turns the sequence split into a head split, which would nest in another)."""
        algo = [a for a in axes if a.note in SEQUENCE_ALGORITHMS]
        if not algo:
            return True
        beside = (R, Shard(0), Shard(1)) if algo[0].note == "ring" else (R, Shard(0))
        others = [a for a in axes if a.note not in SEQUENCE_ALGORITHMS]
        return len(algo) == 1 and all(a.out[0] in beside for a in others)

    def lower(self, call):
        """Ring or Ulysses (by the record's note) as their modules; with attention dropout, a
        :class:`runtime.local_ops.RankAttention` (masks by the ranks' data, not one shared random
        stream; none in ``eval()``); otherwise the same op."""
        notes = getattr(call, "notes", None) or {}
        # an axis of one device splits nothing: there the op itself runs (its fused kernel), as priced
        algo = {
            name: note
            for name, note in notes.items()
            if note in SEQUENCE_ALGORITHMS and call.comm.shape[call.comm.axis_names.index(name)] > 1
        }
        view = call.view
        if algo:
            (axis_name, note), *rest = algo.items()
            axis = call.comm.axis_names.index(axis_name)
            scale = view.kwargs.get("scale")
            causal = _is_causal(view)
            if note == "ring":
                from runtime.ring_attention import RingAttention

                module = RingAttention(call.comm, axis, causal=causal, scale=scale)
            else:
                from runtime.ulysses_attention import UlyssesAttention

                module = UlyssesAttention(call.comm, axis, call.in_specs[0], causal=causal, scale=scale)
            module.uneven_pieces_ok = _batch_pieces_only(call, axis)
            return call.call_module(module, call.args, call.kwargs)
        p = view.arg(4, "dropout_p", 0.0)
        if not p:
            return call.emit()
        from runtime.local_ops import RankAttention

        sharded = [
            a for a, pl in enumerate(call.out_spec) if getattr(pl, "dim", None) is not None and call.comm.shape[a] > 1
        ]
        index = list(call.node.graph.nodes).index(call.node)
        return call.call_module(RankAttention(call.comm, p, sharded, index), call.args, call.kwargs)

    def rate_shape(self, op: OpView, strategy=None, mesh_shape=()) -> tuple | None:
        """``(sequence length, head dimension)`` of the query: the fused kernel's speed varies
        several-fold with both. Ring attention computes blocks of each rank's share of the
        sequence, so it reads the rate at that length (an approximation: its blocks are explicit
        products and a log-sum-exp, :mod:`runtime.ring_attention`, not the fused kernel). The grid
        is measured with keys as long as the queries, so a cross-attention or a query-sharded
        split with longer keys reads its query length's rate, an approximation too."""
        q = op.in_shapes[0]
        if not q or len(q) < 2:
            return None
        axes = strategy.axes if strategy is not None else ()
        ring = math.prod(n for a, n in zip(axes, mesh_shape) if a.note == "ring")
        return (max(1, q[-2] // ring), q[-1])

    def flops(self, op: OpView) -> float:
        b, h, sq, d = op.in_shapes[0]
        skv = op.in_shapes[1][2]
        return 4.0 * b * h * sq * skv * d


register(aten.scaled_dot_product_attention.default)(AttentionRule())
