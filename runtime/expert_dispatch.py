"""Mixture-of-experts layers on local tensors: expert parallelism by all-to-all.

One op computes a HuggingFace experts module (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H,
I]``): for every token ``t`` and each of its ``k`` routed experts ``e = top_k_index[t, j]``,
``y = down[e] (act(gate) * up)`` with ``gate, up = gate_up[e] x_t`` split in halves, and the
output ``sum_j top_k_weights[t, j] y``. :class:`ExpertDispatch` runs it for one rank in one of
three modes, chosen by the plan (:mod:`passes.rules.experts`):

* **whole** (experts replicated; tokens whole or split on any axes): every rank computes its
  own tokens with all ``E`` experts;
* **all-to-all** (expert parallelism on mesh axis ``a`` of ``n`` ranks, the tokens split on
  ``a`` too): rank ``c`` holds experts ``[c E/n, (c+1) E/n)`` (``Shard(0)`` of the stacked
  weights). Algorithm, per layer and rank:

  1. the ``T k`` (token, expert) pairs are sorted by expert (stable), so the pairs bound for
     each rank are one contiguous run, in expert order;
  2. the per-expert counts (``E`` int64) are exchanged by one all-to-all: each rank learns how
     many rows every other rank sends it for each of its experts;
  3. **dispatch**: the pairs' token rows (``T k x H``) are sent with one all-to-all of uneven
     splits; each rank receives the rows routed to its experts, grouped by source rank and,
     inside, by expert;
  4. each local expert computes its rows (grouped by expert, one product per expert: the
     rows of an expert that received none make an empty product, so every local weight gets
     a gradient, zero or not);
  5. **combine**: the results go back by the reverse all-to-all, are put back in pair order
     and weighted by ``top_k_weights`` and summed over ``k``: exactly one device's sum.

  Backward runs the two all-to-alls in reverse (autograd of :class:`_AllToAllRows`): the
  output gradient's rows go to the experts' ranks, and the input-row gradients come back.
  Nothing is dropped (every routed pair is computed), so the result is one device's.
  Communication per layer and rank: dispatch + combine forward and backward, ``2 T k H`` rows
  sent by the pairs' side and ``2 N H`` by the experts' side (``N`` the rows this rank's experts
  received): on average over the ranks ``4 T k H`` elements, of which ``(n - 1) / n`` leave the
  rank when routing is uniform, plus the counts (``E`` int64, forward only);
* **local experts** (experts split on axis ``a``, the tokens whole there): rank ``c`` computes
  the pairs routed to its own experts and leaves zeros for the others, so the output is
  ``Partial`` on ``a`` (summed by the plan's reshard after the op), with no all-to-all.

**Hidden split inside the experts** (EP x TP, ``hidden_axis``): on another mesh axis of ``m`` ranks
the tokens' hidden dim and the experts' ``H`` dim are split (``Shard(1)`` of hidden, ``Shard(2)``
of ``gate_up_proj``, ``Shard(1)`` of ``down_proj``), the routing whole. Each rank computes partial
gate/up products, summed by one all-reduce of ``N x 2I`` on that axis before the activation, then
its ``H / m`` slice of each row's output; backward sums the activation's gradient (``N x I``) by
one all-reduce. The dispatch all-to-alls then carry ``H / m`` wide rows.

**Token dropping** (an expert capacity): :func:`drop_over_capacity` marks the pairs beyond their
expert's capacity with the index ``E`` before the op (over the whole call's pairs, so every
rank drops what one device drops); the op skips them in every mode (they sort last, are
neither counted nor sent) and their rows of the result are zero. Without it nothing is dropped.

The ops are ordinary autograd ops (index_select, linear, the activation, cat) around the
all-to-alls, so backward needs no code of its own. What they keep for backward, per rank: the
dispatched rows, the gate/up product, the activation and the product fed to ``down_proj``
(``N (H + 4 I)`` elements), the rows that came back (``T k H``) and four int64 index vectors
(``2 T k + 2 N``): :meth:`passes.rules.experts.ExpertsRule.saves` counts the same.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from runtime.collectives import MeshComm, all_reduce_, record_collective

logger = logging.getLogger(__name__)

__all__ = ["ACTIVATIONS", "ExpertDispatch", "drop_over_capacity", "expert_capacity", "experts_forward"]

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def _exchange(rows: torch.Tensor, send: list, recv: list, comm: MeshComm, axis: int, phase: str) -> torch.Tensor:
    """All-to-all of ``rows`` on ``axis``: ``send[r]`` rows to rank ``r``, ``recv[r]`` from it."""
    rows = rows.contiguous()
    record_collective("all_to_all", comm.axis_names[axis], rows.numel() * rows.element_size(), phase)
    out = rows.new_empty((sum(recv),) + tuple(rows.shape[1:]))
    dist.all_to_all_single(out, rows, output_split_sizes=recv, input_split_sizes=send, group=comm.groups[axis])
    return out


class _AllToAllRows(torch.autograd.Function):
    """Rows sent by uneven splits; backward sends the gradients back by the reverse splits."""

    @staticmethod
    def forward(ctx, rows, send, recv, comm, axis):
        ctx.route = (send, recv, comm, axis)
        return _exchange(rows, send, recv, comm, axis, "fwd")

    @staticmethod
    def backward(ctx, grad):
        send, recv, comm, axis = ctx.route
        return _exchange(grad, recv, send, comm, axis, "bwd"), None, None, None, None


class _SumOverAxis(torch.autograd.Function):
    """Forward: all-reduce (sum) on the hidden-split axis; backward: the gradient as it is."""

    @staticmethod
    def forward(ctx, x, comm, axis):
        return all_reduce_(x.clone(), comm, axis, "fwd")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _SameOnAxis(torch.autograd.Function):
    """Forward: the value as it is (the same on every rank of the axis); backward: all-reduce
    (sum) of the gradient, each rank's hidden slice contributing its part."""

    @staticmethod
    def forward(ctx, x, comm, axis):
        ctx.route = (comm, axis)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        comm, axis = ctx.route
        return all_reduce_(grad.clone(), comm, axis, "bwd"), None, None


class _GroupedLinear(torch.autograd.Function):
    """``rows`` grouped by expert (``counts`` rows each, in expert order) times their expert's
    ``weight [E, out, in]``: one product per expert. The weight is saved once, whole (a ZeRO-3
    copy is then gathered again once in backward, not once per expert view: runtime/regather.py).
    Under autocast the products run in the autocast dtype; backward casts to match."""

    @staticmethod
    def forward(ctx, rows, weight, counts):
        ctx.counts = counts
        ctx.save_for_backward(rows, weight)
        return torch.cat([F.linear(x, w) for x, w in zip(rows.split(counts), weight.unbind(0))])

    @staticmethod
    def backward(ctx, grad):
        rows, weight = ctx.saved_tensors
        pieces = list(zip(grad.split(ctx.counts), rows.split(ctx.counts), weight.unbind(0)))
        grad_rows = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_rows = torch.cat([g @ w.to(g.dtype) for g, _, w in pieces]).to(rows.dtype)
        if ctx.needs_input_grad[1]:  # written in place: no second weight-sized buffer
            grad_weight = torch.empty_like(weight)
            for e, (g, x, _) in enumerate(pieces):
                grad_weight[e] = g.t() @ x.to(g.dtype)
        return grad_rows, grad_weight, None


def _expert_products(rows, expert_ids, gate_up, down, activation: str, tp=None) -> torch.Tensor:
    """``rows [N, H]``, each for local expert ``expert_ids[i]``, through their experts: ``[N, H]``
    in the same order. One product per local expert (an empty one where it got no rows).

    ``tp = (comm, axis)``: the hidden dim is split on that mesh axis (rows ``[N, H/n]``, the
    weights' ``H`` slices): the gate/up products are partial sums, summed by one all-reduce of
    ``N x 2I`` before the activation; each rank then makes its ``H`` slice of the output, and
    backward sums the activation's gradient (``N x I``) by one all-reduce."""
    act = ACTIVATIONS[activation]
    order = torch.argsort(expert_ids, stable=True)
    grouped = rows.index_select(0, order)
    counts = torch.bincount(expert_ids, minlength=gate_up.shape[0]).tolist()
    products = _GroupedLinear.apply(grouped, gate_up, counts)
    if tp is not None and grouped.shape[0] > 0:  # every rank of the axis holds the same rows
        products = _SumOverAxis.apply(products, *tp)
    gate, up = products.chunk(2, dim=-1)
    activated = act(gate) * up
    if tp is not None and grouped.shape[0] > 0:
        activated = _SameOnAxis.apply(activated, *tp)
    outs = _GroupedLinear.apply(activated, down, counts)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return outs.index_select(0, inverse)


def _exchange_counts(counts: torch.Tensor, comm: MeshComm, axis: int) -> torch.Tensor:
    """Each rank's per-expert counts for the experts of every rank -> ``[n, E/n]``: row ``s``
    the rows rank ``s`` sends for each of this rank's experts."""
    n = comm.shape[axis]
    received = torch.empty_like(counts)
    record_collective("all_to_all", comm.axis_names[axis], counts.numel() * counts.element_size(), "fwd")
    dist.all_to_all_single(received, counts.contiguous(), group=comm.groups[axis])
    return received.view(n, -1)


def expert_capacity(tokens: int, k: int, experts: int, capacity_factor: float) -> int:
    """Rows one expert computes at most in one call over ``tokens`` tokens routed to ``k`` of
    ``experts`` experts each: ``ceil(capacity_factor * tokens * k / experts)`` (at least 1)."""
    return max(1, math.ceil(capacity_factor * tokens * k / experts))


def drop_over_capacity(top_k_index: torch.Tensor, experts: int, capacity_factor: float) -> torch.Tensor:
    """``top_k_index [T, k]`` with the pairs beyond their expert's capacity
    (:func:`expert_capacity`) replaced by ``experts`` (dropped: computed by no expert).

    Priority is GShard's: every token's first choice before any second choice, and inside one
    choice the tokens in order; so pair ``(t, j)`` is the ``p``-th pair of its expert in the
    order ``(j, t)`` and kept when ``p < capacity``. Plain tensor ops over the whole call's
    pairs: traced into the graph before the experts op, so a split run keeps exactly the pairs
    one device keeps (the planner gathers the small index where the tokens are split)."""
    tokens, k = top_k_index.shape
    capacity = expert_capacity(tokens, k, experts, capacity_factor)
    by_choice = top_k_index.t().reshape(-1)  # [k T]: first choices, then second choices, ...
    hits = by_choice.unsqueeze(1) == torch.arange(experts, device=top_k_index.device)
    place = (hits.cumsum(0) * hits).sum(1) - 1  # the pair's place among its expert's pairs
    kept = (place < capacity).reshape(k, tokens).t()
    return torch.where(kept, top_k_index, experts)


def experts_forward(
    hidden,
    top_k_index,
    top_k_weights,
    gate_up,
    down,
    activation: str,
    *,
    comm=None,
    axis=None,
    mode="whole",
    hidden_axis=None,
):
    """The experts op for one rank (module docstring): ``mode`` ``"whole"``, ``"all_to_all"``
    (on mesh ``axis``) or ``"local"`` (this rank's experts of those split on ``axis``). A pair
    whose index is the expert count (:func:`drop_over_capacity`) is dropped: no expert computes
    it and its row of the result is zero. ``hidden_axis``: the mesh axis the hidden dim is split
    on inside the experts (:func:`_expert_products`; the rows are ``H / n`` wide there)."""
    tp = (comm, hidden_axis) if hidden_axis is not None else None
    tokens, k = top_k_index.shape
    pairs = top_k_index.reshape(-1)
    order = torch.argsort(pairs, stable=True)
    sorted_experts = pairs.index_select(0, order)
    token_of = torch.div(order, k, rounding_mode="floor")
    held = gate_up.shape[0]
    experts = held * (comm.shape[axis] if mode != "whole" else 1)
    kept = int((sorted_experts < experts).sum())  # the dropped pairs sort last
    if kept < pairs.numel():
        sorted_experts, token_of = sorted_experts[:kept], token_of[:kept]
    if mode == "all_to_all":
        n = comm.shape[axis]
        counts = torch.bincount(sorted_experts, minlength=held * n)
        from_each = _exchange_counts(counts, comm, axis)
        send = counts.view(n, held).sum(1).tolist()
        recv = from_each.sum(1).tolist()
        rows = _AllToAllRows.apply(hidden.index_select(0, token_of), send, recv, comm, axis)
        local_ids = torch.arange(held, device=pairs.device).repeat(n).repeat_interleave(from_each.reshape(-1))
        done = _expert_products(rows, local_ids, gate_up, down, activation, tp)
        results = _AllToAllRows.apply(done, recv, send, comm, axis)
    elif mode == "local":
        first = comm.coords[axis] * held
        lo = int((sorted_experts < first).sum())
        hi = int((sorted_experts < first + held).sum())
        rows = hidden.index_select(0, token_of[lo:hi])
        done = _expert_products(rows, sorted_experts[lo:hi] - first, gate_up, down, activation, tp)
        width = (hidden.shape[1],)
        results = torch.cat([done.new_zeros((lo,) + width), done, done.new_zeros((kept - hi,) + width)])
    else:
        rows = hidden.index_select(0, token_of)
        results = _expert_products(rows, sorted_experts, gate_up, down, activation, tp)
    if kept < pairs.numel():
        results = torch.cat([results, results.new_zeros((pairs.numel() - kept, hidden.shape[1]))])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    per_pair = results.index_select(0, inverse).view(tokens, k, -1)
    return (per_pair * top_k_weights.unsqueeze(-1)).sum(1).to(hidden.dtype)


class ExpertDispatch(torch.nn.Module):
    """The experts op of one rank, in the mode its plan record chose (module docstring)."""

    def __init__(
        self,
        comm: MeshComm,
        activation: str,
        *,
        axis: int | None = None,
        mode: str = "whole",
        hidden_axis: int | None = None,
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"experts activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
        if mode not in ("whole", "all_to_all", "local"):
            raise ValueError(f"experts mode {mode!r}")
        self.comm, self.activation, self.axis, self.mode = comm, activation, axis, mode
        self.hidden_axis = hidden_axis

    def forward(self, hidden, top_k_index, top_k_weights, gate_up, down, activation=None):
        return experts_forward(
            hidden,
            top_k_index,
            top_k_weights,
            gate_up,
            down,
            self.activation,
            comm=self.comm,
            axis=self.axis,
            mode=self.mode,
            hidden_axis=self.hidden_axis,
        )

    def extra_repr(self) -> str:
        where = f" on mesh axis {self.comm.axis_names[self.axis]}" if self.axis is not None else ""
        if self.hidden_axis is not None:
            where += f", hidden split on mesh axis {self.comm.axis_names[self.hidden_axis]}"
        return f"{self.mode}{where}, {self.activation}"
