"""Known answers of the intra-op solver (issue bars (a)-(e) and the Megatron formula).

All models are built on the ``meta`` device: planning needs no memory and no devices.
"""
import itertools

import numpy as np
import pytest
import torch

import partitioner
from partitioner import models
from passes.plan.ilp_solver import solve_ilp

COLUMN = ("h.*.attn.c_attn.weight", "h.*.mlp.c_fc.weight")
ROW = ("h.*.attn.c_proj.weight", "h.*.mlp.c_proj.weight")


def _block_records(plan, index=0):
    return [r for r in plan.records if r.get("block_index") == index]


def _param_state_bytes(model):
    return 16 * sum(p.numel() for p in model.parameters())  # fp32 Adam


def _forward_collectives(records, kind):
    return [c for r in records for c in r["comm"] if c["kind"] == kind and c["phase"] == "fwd"]


def test_a_tight_budget_gives_megatron_column_then_row():
    b, s, h = 2, 64, 1024
    model, inputs = models.gpt_block(batch=b, seq=s, n_embd=h, n_head=16, n_layer=2, vocab=512)
    budget = _param_state_bytes(model) // 4          # replicated weights cannot fit
    plan = partitioner.plan(model, inputs, mesh_shape=(8,), cluster="h100", memory_budget=budget)
    for name in ("h.0.attn.c_attn.weight", "h.0.mlp.c_fc.weight", "h.1.mlp.c_fc.weight"):
        assert plan.placement_of(name) == "[S(0)]", name      # column parallel
    for name in ("h.0.attn.c_proj.weight", "h.0.mlp.c_proj.weight"):
        assert plan.placement_of(name) == "[S(1)]", name      # row parallel
    block = _block_records(plan)
    ars = _forward_collectives(plan.records, "all_reduce")
    assert len(ars) == 2 * 2                                  # per layer: one after attention, one after the MLP
    assert all(c["bytes"] == b * s * h * 4 for c in ars)
    assert not _forward_collectives(block, "all_gather") and not _forward_collectives(block, "reduce_scatter")
    assert plan.estimate().memory_bytes <= budget


def test_b_loose_budget_large_batch_gives_data_parallel():
    model, inputs = models.gpt_block(batch=64, seq=128, n_embd=256, n_head=8, n_layer=2, vocab=512)
    plan = partitioner.plan(model, inputs, mesh_shape=(8,), cluster="h100", memory_budget="80GiB")
    assert plan.placement_of("idx") == "[S(0)]"
    params = [r for r in plan.records if r["kind"] == "param"]
    assert params and all(r["out"] == ["[R]"] for r in params)
    # the only communication is the gradient all-reduce: exactly the parameter bytes
    est = plan.estimate()
    grad_bytes = 4 * sum(p.numel() for p in model.parameters())
    assert set(est.comm_bytes) == {"all_reduce"}
    assert est.comm_bytes_by_phase["bwd"]["all_reduce"]["a0"] == pytest.approx(grad_bytes, rel=1e-9)
    # + the loss: (sum, count) of the batch-sharded cross entropy, all-reduced together
    assert est.comm_bytes["all_reduce"]["a0"] == pytest.approx(grad_bytes + 8, rel=1e-9)


def _axes(placement):
    return placement.strip("[]").split(", ")


def test_c_two_axis_mesh_gives_data_parallel_times_megatron():
    model, inputs = models.gpt_block(batch=16, seq=512, n_embd=2048, n_head=16, n_layer=2, vocab=512)
    plan = partitioner.plan(model, inputs, mesh_shape=(2, 4), cluster="h100", memory_budget="80GiB")
    c_fc = _axes(plan.placement_of("h.0.mlp.c_fc.weight"))
    tp_axes = [a for a, p in enumerate(c_fc) if p == "S(0)"]
    assert len(tp_axes) == 1, c_fc
    tp, dp = tp_axes[0], 1 - tp_axes[0]
    for name in ("h.0.attn.c_attn.weight", "h.0.mlp.c_fc.weight"):          # column parallel on tp
        assert _axes(plan.placement_of(name))[tp] == "S(0)" and _axes(plan.placement_of(name))[dp] == "R"
    for name in ("h.0.attn.c_proj.weight", "h.0.mlp.c_proj.weight"):        # row parallel on tp
        assert _axes(plan.placement_of(name))[tp] == "S(1)" and _axes(plan.placement_of(name))[dp] == "R"
    attention = _axes(plan.record("scaled_dot_product_attention")["out"][0])
    assert attention[dp] == "S(0)" and attention[tp] == "S(1)"                # batch x heads
    grads = plan.estimate().comm_bytes_by_phase["bwd"]["all_reduce"]
    assert grads[plan.axis_names[dp]] > 0                                    # data-parallel gradient sync


def test_d_activation_budget_gives_sequence_parallel_norm_and_dropout():
    model, inputs = models.gpt_block(batch=1, seq=2048, n_embd=2048, n_head=16, n_layer=2, vocab=512)
    megatron = {"idx": ["R"], "targets": ["R"], **{k: ["S(0)"] for k in COLUMN}, **{k: ["S(1)"] for k in ROW}}
    replicated_regions = {"h.*.ln_1": ["R"], "h.*.ln_2": ["R"], "h.*.attn.resid_dropout": ["R"],
                          "h.*.mlp.dropout": ["R"]}
    def least(pins):  # the peak of the plan that keeps the least (the budget bounds the peak)
        plan = partitioner.plan(model, inputs, mesh_shape=(8,), cluster="h100", pins=pins, objective="memory",
                                recompute="none")
        return plan.estimate().memory_bytes
    without_sp, with_sp = least({**megatron, **replicated_regions}), least(megatron)
    assert with_sp < without_sp
    budget = (with_sp + without_sp) / 2                       # fits only with sharded norm/dropout regions
    # (or by recomputing the layers: that is test_activation_checkpointing's; here it is off)
    with pytest.raises(partitioner.InfeasibleBudgetError):
        partitioner.plan(model, inputs, mesh_shape=(8,), cluster="h100", memory_budget=budget,
                         pins={**megatron, **replicated_regions}, recompute="none")
    plan = partitioner.plan(model, inputs, mesh_shape=(8,), cluster="h100", memory_budget=budget, pins=megatron,
                            recompute="none")
    block = _block_records(plan)
    norms = [r for r in block if r["target"] == "aten.layer_norm"]
    dropouts = [r for r in block if r["target"] == "aten.dropout"]
    assert len(norms) == 2 and len(dropouts) == 2
    for r in norms + dropouts:
        assert r["out"] == ["[S(1)]"], (r["name"], r["out"])  # sharded on the sequence dim
    # Megatron-SP: reduce-scatter after each row-parallel matmul, all-gather before each
    # column-parallel one, and the weights stay where they are stored (no weight gathering)
    assert len(_forward_collectives(block, "reduce_scatter")) == 2
    for r in block:
        if r["target"] == "aten.linear":
            weight = next(p for p in block if p["name"] == r["inputs"][1])
            assert r["ins"][1] == weight["out"][0], (r["name"], r["ins"][1], weight["out"][0])


def test_megatron_formula_for_comm_bytes():
    b, s, h, layers = 4, 256, 512, 3
    model, inputs = models.gpt_block(batch=b, seq=s, n_embd=h, n_head=8, n_layer=layers, vocab=512)
    pins = {"idx": ["R"], "targets": ["R"], "wte.weight": ["R"], "wpe.weight": ["R"], "lm_head.weight": ["R"],
            **{k: ["S(0)"] for k in COLUMN}, **{k: ["S(1)"] for k in ROW},
            "h.*.ln_1": ["R"], "h.*.ln_2": ["R"], "h.*.attn.resid_dropout": ["R"], "h.*.mlp.dropout": ["R"]}
    plan = partitioner.plan(model, inputs, mesh_shape=(4,), cluster="h100", pins=pins)
    est = plan.estimate()
    per_layer = b * s * h * 4
    assert est.comm_bytes == {"all_reduce": {"a0": 4 * layers * per_layer}}
    assert est.comm_bytes_by_phase["fwd"] == {"all_reduce": {"a0": 2 * layers * per_layer}}
    assert est.comm_bytes_by_phase["bwd"] == {"all_reduce": {"a0": 2 * layers * per_layer}}


def _brute_force(costs, memories, edges, budget):
    best = None
    for choice in itertools.product(*[range(len(c)) for c in costs]):
        if budget is not None and sum(m[i] for m, i in zip(memories, choice)) > budget:
            continue
        total = sum(c[i] for c, i in zip(costs, choice))
        for g, h, cg, ch, mat in edges:
            total += mat[cg[choice[g]], ch[choice[h]]]
        best = total if best is None else min(best, total)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_e_ilp_equals_brute_force_on_random_graphs(seed):
    rng = np.random.default_rng(seed)
    n_groups = int(rng.integers(3, 6))
    costs = [rng.uniform(0, 10, size=int(rng.integers(1, 5))) for _ in range(n_groups)]
    memories = [rng.uniform(0, 5, size=len(c)) for c in costs]
    edges = []
    for g in range(n_groups):
        for h in range(g + 1, n_groups):
            if rng.random() < 0.6:
                n_cls_g, n_cls_h = int(rng.integers(1, len(costs[g]) + 1)), int(rng.integers(1, len(costs[h]) + 1))
                cg = rng.integers(0, n_cls_g, size=len(costs[g]))
                ch = rng.integers(0, n_cls_h, size=len(costs[h]))
                edges.append((g, h, cg, ch, rng.uniform(0, 10, size=(n_cls_g, n_cls_h))))
    budget = None if seed % 2 else float(sum(np.median(m) for m in memories))
    expected = _brute_force(costs, memories, edges, budget)
    result = solve_ilp(costs, memories, edges, budget=budget)
    if expected is None:
        assert result.choice is None
    else:
        assert result.objective == pytest.approx(expected, rel=1e-6, abs=1e-9)


def test_e_ilp_equals_brute_force_on_a_real_graph():
    from partitioner.local_cluster import get_cluster
    from passes.analysis.analyze import analyze
    from passes.capture.blocks import find_blocks
    from passes.capture.capture import capture
    from passes.plan.strategy_space import build_space

    torch.manual_seed(0)
    model = models.MLP(d_in=8, d_hidden=16, d_out=4, depth=1)
    cap = capture(model, (torch.randn(4, 8), torch.randint(0, 4, (4,))))
    analyze(cap)
    space = build_space(cap.graph, find_blocks(cap.graph), (2,), get_cluster("h100"), zero1=False)  # enumerable
    costs = [g.cost for g in space.groups]
    memories = [g.memory for g in space.groups]
    edges = [(e.src, e.dst, e.src_class, e.dst_class, e.matrix) for e in space.edges]
    assert np.prod([len(c) for c in costs]) <= 200_000, "keep the enumeration small"
    expected = _brute_force(costs, memories, edges, None)
    assert solve_ilp(costs, memories, edges).objective == pytest.approx(expected, rel=1e-6)


def test_infeasible_budget_names_the_least_memory():
    model, inputs = models.gpt_block(batch=8, seq=128, n_embd=512, n_head=8, n_layer=2, vocab=512)
    with pytest.raises(partitioner.InfeasibleBudgetError, match=r"least memory any plan needs is [0-9.]+ GiB"):
        partitioner.plan(model, inputs, mesh_shape=(4,), cluster="h100", memory_budget="1MiB")
