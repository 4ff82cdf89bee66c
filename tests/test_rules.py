"""Unit tests of the rule registry: known strategies for each op family, the replicate
fallback, and gradient placements. Single process, no process group."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support import fallback_warnings

import partitioner
from passes.core.placements import P, Partial, R, Shard
from passes.rules import AxisStrategy, expand_to_mesh, has_rule, op_view, rule_for
from passes.rules.views import view_dim_map

aten = torch.ops.aten


# -- helpers ------------------------------------------------------------------------------
class Fn(nn.Module):
    """Wrap a function of tensors as a module (parameters passed in ``params``)."""

    def __init__(self, fn, **params):
        super().__init__()
        self.fn = fn
        for name, p in params.items():
            setattr(self, name, p)

    def forward(self, *xs):
        return self.fn(self, *xs)


def nodes_of(module, inputs, target) -> list:
    gm = torch.export.export(module, inputs, strict=False).graph_module
    found = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]
    assert found, f"{target} not in {[str(n.target) for n in gm.graph.nodes]}"
    return found


def strategies_of(node) -> list:
    return rule_for(node).axis_strategies(op_view(node))


def pairs(strategies) -> list:
    return [(s.ins, s.out) for s in strategies]



# -- views --------------------------------------------------------------------------------
def test_view_dim_map_split_heads():
    # [b, s, h] -> [b, s, nh, hd]: h lands on nh (the outer dim of its group)
    assert view_dim_map((2, 4, 64), (2, 4, 8, 8)) == {0: 0, 1: 1, 2: 2}


def test_view_dim_map_merge_batch_and_seq():
    # [b, s, h] -> [b*s, h]: only b survives in the merged dim; s has no image
    assert view_dim_map((2, 4, 64), (8, 64)) == {0: 0, 2: 1}


def test_view_dim_map_merge_heads():
    # [nh, hd] -> [h]: nh survives, hd does not
    assert view_dim_map((8, 16), (128,)) == {0: 0}


def test_view_dim_map_skips_size_one_dims():
    # [1, s, h] -> [s, h]: the size-1 batch dim carries nothing
    assert view_dim_map((1, 4, 8), (4, 8)) == {1: 0, 2: 1}


def test_reshape_rule_follows_dim_map():
    m = Fn(lambda self, x: x.reshape(2, 4, 8, 8))
    (node,) = nodes_of(m, (torch.randn(2, 4, 64),), aten.reshape.default)
    got = pairs(strategies_of(node))
    assert ((Shard(2),), (Shard(2),)) in got
    assert ((Shard(0),), (Shard(0),)) in got
    assert ((P,), (P,)) in got


# -- contractions --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def linear_node():
    lin = nn.Linear(16, 32)
    (node,) = nodes_of(lin, (torch.randn(2, 4, 16),), aten.linear.default)
    return node


def test_linear_strategies(linear_node):
    got = pairs(strategies_of(linear_node))
    # inputs are (x[2,4,16], weight[32,16], bias[32]); output [2,4,32]
    assert ((R, R, R), (R,)) in got
    assert ((Shard(0), R, R), (Shard(0),)) in got, "data parallel"
    assert ((R, Shard(0), Shard(0)), (Shard(2),)) in got, "column parallel"
    assert ((Shard(2), Shard(1), P), (P,)) in got, "row parallel"
    assert ((P, R, P), (P,)) in got, "partial input passes through"


def test_linear_flops(linear_node):
    assert rule_for(linear_node).flops(op_view(linear_node)) == 2 * 2 * 4 * 32 * 16


def test_linear_expands_to_2d_mesh(linear_node):
    strategies = expand_to_mesh(strategies_of(linear_node), op_view(linear_node), (2, 2))
    specs = {(s.ins[0], s.ins[1], s.out[0]) for s in strategies}
    # data parallel on axis 0 x column parallel on axis 1
    assert ((Shard(0), R), (R, Shard(0)), (Shard(0), Shard(2))) in specs
    # every combination divides evenly: x[2,4,16] cannot be split 4 ways on dim 0
    assert ((Shard(0), Shard(0)), (R, R), (Shard(0), Shard(0))) not in specs


def test_expand_to_mesh_drops_uneven_splits(linear_node):
    strategies = expand_to_mesh(strategies_of(linear_node), op_view(linear_node), (3,))
    # no dim of x[2,4,16] / w[32,16] / out[2,4,32] divides by 3: only unsplit options remain
    assert strategies
    assert all(not isinstance(p, Shard) for s in strategies for spec in s.ins + s.out if spec for p in spec)


def test_conv2d_batch_and_output_channels():
    conv = nn.Conv2d(3, 8, 3, padding=1)
    (node,) = nodes_of(conv, (torch.randn(4, 3, 8, 8),), aten.conv2d.default)
    got = pairs(strategies_of(node))
    assert ((Shard(0), R, R), (Shard(0),)) in got, "batch"
    assert ((R, Shard(0), Shard(0)), (Shard(1),)) in got, "output channels"
    assert ((Shard(1), Shard(1), P), (P,)) in got, "input channels"


# -- elementwise ----------------------------------------------------------------------------
def test_elementwise_broadcasting():
    m = Fn(lambda self, a, b: a + b)
    (node,) = nodes_of(m, (torch.randn(4, 1, 8), torch.randn(8)), aten.add.Tensor)
    got = dict((s.out, s.ins) for s in strategies_of(node))
    assert got[(Shard(2),)] == (Shard(2), Shard(0)), "b is aligned with the last dim"
    assert got[(Shard(0),)] == (Shard(0), R), "b broadcasts over dim 0"
    assert (Shard(1),) not in got, "a size-1 dim is never sharded"
    assert got[(P,)] == (P, P), "a sum of partials is partial"


def test_mul_partial_in_one_operand_only():
    m = Fn(lambda self, a, b: a * b)
    (node,) = nodes_of(m, (torch.randn(4, 8), torch.randn(4, 8)), aten.mul.Tensor)
    got = pairs(strategies_of(node))
    assert ((P, R), (P,)) in got and ((R, P), (P,)) in got
    assert ((P, P), (P,)) not in got


def test_diff_splits_its_prepend_like_its_input():
    """diff(x, prepend=p, dim=-1) splits the batch dim of x and of p together (HF's packed-sequence
    check diffs position ids with a prepended column)."""
    m = Fn(lambda self, x, p: torch.diff(x, prepend=p, dim=-1))
    (node,) = nodes_of(m, (torch.randn(4, 16), torch.randn(4, 1)), aten.diff.default)
    got = dict((s.out, s.ins) for s in strategies_of(node))
    assert got[(Shard(0),)] == (Shard(0), Shard(0)), got
    assert got[(R,)] == (R, R), got
    assert (Shard(1),) not in got, "the differenced dim stays whole"


# -- normalisation and softmax ------------------------------------------------------------
def test_softmax_over_sharded_dim_has_collectives():
    m = Fn(lambda self, x: F.softmax(x, dim=-1))
    (node,) = nodes_of(m, (torch.randn(4, 8),), aten.softmax.int)
    by_in = {s.ins[0]: s for s in strategies_of(node)}
    reduced = by_in[Shard(1)]
    assert reduced.out == (Shard(1),)
    assert [k for k, _, _, _ in reduced.extra] == ["all_reduce"] * 3
    assert {phase for _, phase, _, _ in reduced.extra} == {"fwd", "bwd"}
    assert all(n == 4 for _, _, n, _ in reduced.extra), "one value per row"
    assert by_in[Shard(0)].extra == (), "sharding a row dim needs no collective"


def test_layer_norm_keeps_normalized_dims_whole():
    ln = nn.LayerNorm(8)
    (node,) = nodes_of(ln, (torch.randn(2, 4, 8),), aten.layer_norm.default)
    outs = {s.out for s in strategies_of(node)}
    assert outs == {(R,), (Shard(0),), (Shard(1),), (Shard(2),)}
    # the normalised dim split (2D / 3D tensor parallel layouts): weight and bias split alike,
    # row statistics all-reduced (two forward, the pair of gradient sums backward)
    (hidden,) = [s for s in strategies_of(node) if s.out == (Shard(2),)]
    assert hidden.ins == (Shard(2), Shard(0), Shard(0))
    assert [(k, phase, n) for k, phase, n, _ in hidden.extra] == [
        ("all_reduce", "fwd", 8),
        ("all_reduce", "fwd", 8),
        ("all_reduce", "bwd", 16),
    ]


def test_batch_norm_sync_and_channel_sharding():
    bn = nn.BatchNorm2d(8)
    (node,) = nodes_of(bn, (torch.randn(4, 8, 5, 5),), aten.batch_norm.default)
    by_in = {s.ins[0]: s for s in strategies_of(node)}
    batch = by_in[Shard(0)]
    assert batch.out == (Shard(0),) and all(p == R for p in batch.ins[1:])
    # SyncBatchNorm: every rank's (mean, variance) gathered forward, the gradient sums all-reduced backward
    assert {(k, phase) for k, phase, _, _ in batch.extra} == {("all_gather", "fwd"), ("all_reduce", "bwd")}
    channel = by_in[Shard(1)]
    assert channel.out == (Shard(1),) and all(p == Shard(0) for p in channel.ins[1:])
    assert channel.extra == ()


# -- attention, embedding -------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_offers_head_sharding(causal):
    m = Fn(lambda self, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    qkv = tuple(torch.randn(2, 4, 8, 16) for _ in range(3))
    (node,) = nodes_of(m, qkv, aten.scaled_dot_product_attention.default)
    got = pairs(strategies_of(node))
    assert ((Shard(1),) * 3, (Shard(1),)) in got, "heads"
    assert ((Shard(0),) * 3, (Shard(0),)) in got, "batch"
    seq_parallel = ((Shard(2), R, R), (Shard(2),))
    assert (seq_parallel in got) is (not causal), "query-sequence split only without a causal mask"


def test_embedding_vocab_parallel():
    emb = nn.Embedding(32, 16)
    (node,) = nodes_of(emb, (torch.randint(0, 32, (2, 8)),), aten.embedding.default)
    got = pairs(strategies_of(node))
    assert ((Shard(0), R), (P,)) in got, "vocab parallel"
    assert ((Shard(1), R), (Shard(2),)) in got, "hidden sharded"
    assert ((R, Shard(0)), (Shard(0),)) in got, "data parallel"


# -- the replicate fallback ------------------------------------------------------------------
class TwoCumprods(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return torch.cumprod(h, 1).sum() + torch.cumprod(h * 2, 1).sum()


def test_unknown_op_warns_once_and_runs_replicated():
    x = torch.randn(4, 8)
    nodes = nodes_of(TwoCumprods(), (x,), aten.cumprod.default)
    assert len(nodes) == 2
    assert not has_rule(nodes[0]), "aten.cumprod gained a rule: pick another op without one"
    with fallback_warnings() as caught:
        results = [strategies_of(n) for n in nodes]
    messages = [str(w.message) for w in caught if "no sharding rule" in str(w.message)]
    assert len(messages) == 1 and "aten.cumprod" in messages[0], messages
    for strategies in results:
        assert pairs(strategies) == [((R,), (R,))]


def test_planning_with_unknown_op_succeeds():
    x = torch.randn(4, 8)
    with fallback_warnings() as caught:
        plan = partitioner.plan(TwoCumprods(), (x,), mesh_shape=(2,), cluster="h100")
    messages = [str(w.message) for w in caught if "no sharding rule" in str(w.message)]
    assert len(messages) == 1 and "aten.cumprod" in messages[0], messages
    records = [r for r in plan.records if r["target"] == "aten.cumprod"]
    assert len(records) == 2
    for r in records:
        assert r["out"] == ["[R]"] and r["ins"] == ["[R]"], r


# -- gradient placements ---------------------------------------------------------------------
def test_grad_placement_semantics():
    s = AxisStrategy(out=(Shard(0),), ins=(R, Shard(0), P, None))
    assert s.grad_placement(0) == P, "replicated input to a sharded op: partial gradient"
    assert s.grad_placement(1) == Shard(0), "sharded input: sharded gradient"
    assert s.grad_placement(2) == R, "partial input: replicated gradient"
    assert s.grad_placement(3) is None, "metadata-only input: no gradient"
    everywhere = AxisStrategy(out=(R,), ins=(R, R))
    assert everywhere.grad_placement(0) == R, "replicated work: replicated gradient"
    assert isinstance(s.grad_placement(0), Partial)


def test_grad_placement_of_linear(linear_node):
    by_out = {}
    for s in strategies_of(linear_node):
        by_out.setdefault(s.out, []).append(s)
    (column,) = by_out[(Shard(2),)]
    assert column.grad_placement(0) == P, "Megatron: all-reduce of the input gradient"
    assert column.grad_placement(1) == Shard(0)
    (dp,) = by_out[(Shard(0),)]
    assert dp.grad_placement(1) == P, "data parallel: weight gradients are summed"
    row = next(s for s in by_out[(P,)] if s.ins[0] == Shard(2))
    assert row.grad_placement(0) == Shard(2) and row.grad_placement(1) == Shard(1)
