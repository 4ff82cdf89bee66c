"""Parity on real gloo process groups (test tier 3): the first test of every feature.

One forked run per (model, mesh, plan) config (see ``parity_utils.parity_worker``); each rank
checks, fp32 with ``torch.testing.assert_close`` defaults, against a deep copy of the model
run on one device with the same inputs:

* the loss and EVERY gradient (``pm.full_grads()``), after one forward + backward;
* that forward + backward's communication, counted by the runtime (``CommCounter``), equals
  the plan's estimate (``plan.estimate().comm_bytes``: same kinds and axes, same bytes), in
  total and per phase;
* the parameters after 3 AdamW steps (lr 1e-2) taken by each side's own optimizer (the
  parallel one over its local shards); the losses of steps 2 and 3 on the way.

Plans: the solver free (``cluster="h100"``; these tiny models then plan all-replicated), the
solver under a memory budget of 75% of the replicated Adam state (it must shard: it mixes
Megatron, ZeRO-style gathers and all-to-alls), and pinned plans: pure data parallel, pure
Megatron TP, DP x TP on (2, 2), TP with sequence parallelism. Pins are in ``parity_utils``.

Every model (hand-written MLP and GPT, HF GPT-2, BERT, LLaMA, ViT) runs at least one sharded
plan, and every mesh (2,), (4,), (2, 2) is used. Extra checks ride along on some configs:
``local_inputs=True`` with ``pm.shard_batch`` against the default mode, and the per-rank
parameter bytes of Megatron TP. Dropout has its own test.
"""

import pytest
import torch
from parity_utils import (
    MODELS,
    built_in_parent,
    dropout_worker,
    glob_any,
    gpt_with_dropout,
    nested_approx_equal,
    parity_case,
    parity_worker,
    run_checked,
    slow_tier,
)
from support import is_replicated, placement_axes

from runtime.launch import run_on_ranks

TIMEOUT_S = 240


BUDGET = 0.75   # of the replicated fp32 Adam state (16 bytes per parameter)

# Each HF model runs one case here; its other cases (slow_tier) repeat paths the hand-written
# models cover on every mesh, and run in the slow tier (every case's memory runs in
# tests/test_memory_estimate.py, and each family trains on (2, 2) in tests/test_hf_families.py).
CONFIGS = [
    # hand-written MLP
    parity_case("mlp", (2,), "free", budget_fraction=BUDGET),
    parity_case("mlp", (4,), "tp"),
    parity_case("mlp", (2, 2), "dp"),
    # hand-written GPT
    parity_case("gpt", (2,), "dp"),
    parity_case("gpt", (4,), "tp", check_param_bytes=0),
    parity_case("gpt", (2, 2), "dp_tp", check_local_inputs=True),
    parity_case("gpt", (2, 2), "tp_sp"),
    parity_case("gpt", (2, 2), "free"),
    parity_case("gpt", (4,), "free", budget_fraction=BUDGET),
    # HF GPT-2 (Conv1D weights, tied lm_head, fused QKV)
    slow_tier(parity_case("gpt2", (2,), "tp")),
    slow_tier(parity_case("gpt2", (2, 2), "dp_tp")),
    parity_case("gpt2", (4,), "tp_sp"),
    slow_tier(parity_case("gpt2", (4,), "free", budget_fraction=BUDGET)),
    # HF BERT (attention mask input, tied decoder)
    slow_tier(parity_case("bert", (2, 2), "dp_tp")),
    parity_case("bert", (2,), "dp", check_local_inputs=True),
    slow_tier(parity_case("bert", (4,), "free", budget_fraction=BUDGET)),
    # HF LLaMA (RMSNorm, rotary embeddings, grouped-query attention)
    slow_tier(parity_case("llama", (2, 2), "tp_sp")),
    slow_tier(parity_case("llama", (2,), "tp")),
    parity_case("llama", (4,), "free", budget_fraction=BUDGET),
    # HF ViT (patch convolution, classification head)
    slow_tier(parity_case("vit", (4,), "tp")),
    parity_case("vit", (2, 2), "free", budget_fraction=BUDGET),
    slow_tier(parity_case("vit", (2,), "free")),
]


def _check_plan_shape(cfg, r0):
    """The plan is what the config asks for (pins honoured; the budget forces real sharding)."""
    m, mesh, kind = MODELS[cfg["model"]], cfg["mesh"], cfg["plan"]
    placements = r0["placements"]
    params = [n for n in placements if n not in m["inputs"]]
    if kind == "free" and not cfg.get("budget_fraction"):
        return  # tiny models legitimately plan all-replicated on h100; parity still holds
    assert r0["sharded_params"] or r0["sharded_inputs"], "the plan is all-replicated"
    if kind == "free":
        assert r0["sharded_params"], "a 75% memory budget must make the solver shard some parameter"
        return
    col, row = ("S(1)", "S(0)") if m["transposed"] else ("S(0)", "S(1)")
    if kind == "dp":
        assert all(is_replicated(placements[p]) for p in params), "data parallel: every parameter replicated"
        for name in m["inputs"]:
            assert placement_axes(placements[name]) == ["S(0)"] * len(mesh), (name, placements[name])
        assert set(r0["estimated"]) >= {"all_reduce"}
        assert set(r0["estimated"]["all_reduce"]) == {f"a{i}" for i in range(len(mesh))}, "gradient sync on every axis"
        return
    tp = len(mesh) - 1
    sharded_weights = [p for p in params if glob_any(p, m["column"] + m["row"])]
    assert sharded_weights
    for p in sharded_weights:
        want = col if glob_any(p, m["column"]) else row
        assert placement_axes(placements[p])[tp] == want, (p, placements[p])
        assert all(a == "R" for a in placement_axes(placements[p])[:tp]), (p, placements[p])
    for name in m["inputs"]:
        assert placement_axes(placements[name])[tp] == "R", (name, placements[name])
        if len(mesh) == 2:
            assert placement_axes(placements[name])[0] == "S(0)", (name, placements[name])
    tp_axis = f"a{tp}"
    est = r0["estimated"]
    if kind == "tp_sp":  # sequence parallel: reduce-scatter into the norms, all-gather out of them
        assert tp_axis in est.get("reduce_scatter", {}) and tp_axis in est.get("all_gather", {}), est
    else:                # Megatron: the row-parallel partial sums are all-reduced on the tp axis
        assert tp_axis in est.get("all_reduce", {}) or tp_axis in est.get("reduce_scatter", {}), est


@pytest.mark.parametrize("cfg", CONFIGS)
def test_parity(cfg):
    results = run_checked(parity_worker, cfg, TIMEOUT_S)

    # the loss is replicated: every rank returns the same value
    assert len({r["loss"] for r in results}) == 1, [r["loss"] for r in results]

    # communication counted == the plan's estimate (same kinds, same axes, same bytes), per rank
    for r in results:
        counted, estimated = r["counted"], r["estimated"]
        assert set(counted) == set(estimated), (counted, estimated)
        for kind in estimated:
            assert counted[kind] == pytest.approx(estimated[kind]), (kind, counted, estimated)
        for phase in ("fwd", "bwd"):
            diffs = nested_approx_equal(r["counted_by_phase"].get(phase, {}),
                                        r["estimated_by_phase"].get(phase, {}))
            assert not diffs, f"rank {r['rank']} {phase}: {diffs}"

    _check_plan_shape(cfg, results[0])

    if cfg.get("check_param_bytes") is not None:
        for r in results:
            b = r["param_bytes"]
            print(f"\n{cfg['model']} {cfg['mesh']} rank {r['rank']}: {b['local']} B of parameters, total "
                  f"{b['total']} B / tp {b['tp']} = {b['total'] / b['tp']:.0f} B; ratio {b['ratio']:.3f} "
                  f"(replicated tensors: {b['replicated']} B)")
            assert b["local"] <= b["bound"], b
            # the sharded part alone is split by the tensor-parallel degree
            assert b["local"] - b["replicated"] <= 1.05 * (b["total"] - b["replicated"]) / b["tp"], b


def _gpt_with_dropout_captured_in_eval_mode():
    """``gpt_with_dropout()``, captured (inside ``keep_captures``) in eval mode as the worker's
    ``pm.eval()`` will capture it (``partitioner.specialize``); ``built_in_parent`` then captures it
    in train mode."""
    from partitioner.captures import capture

    model, inputs = gpt_with_dropout()
    model.eval()
    capture(model, inputs)
    model.train()
    return model, inputs


def test_dropout_rng_rule_under_dp_x_tp():
    """gpt_demo(dropout=0.1) on (2, 2) with a DP x TP plan.

    The loss is replicated (identical on every rank) and differs from the dropout-free loss;
    in eval() the parallel model equals the single-device model. Each dropout (RankDropout) and
    attention dropout (RankAttention) draws independent masks exactly along the mesh axes where
    its tensor is sharded: ranks holding the same data draw the same mask, ranks holding
    different data (another batch shard on the data-parallel axis, other heads on the tp axis)
    draw different ones.
    """
    mesh = (2, 2)
    with built_in_parent({"gpt-dropout": (_gpt_with_dropout_captured_in_eval_mode, {})}):  # before forking
        results = run_on_ranks(dropout_worker, 4, mesh, timeout_s=TIMEOUT_S)
    losses = [r["loss"] for r in results]
    assert len(set(losses)) == 1, losses
    ref_eval = results[0]["ref_eval_loss"]
    assert abs(losses[0] - ref_eval) > 1e-4, "dropout did not change the loss"
    for r in results:
        torch.testing.assert_close(torch.tensor(r["eval_loss"]), torch.tensor(ref_eval))
    assert len({round(r["grad_norm"], 6) for r in results}) == 1   # gathered gradients agree

    modules = results[0]["modules"]
    kinds = {m["kind"] for m in modules.values()}
    assert kinds == {"RankDropout", "RankAttention"}, kinds
    dp_axis = 0
    assert any(dp_axis in m["sharded_axes"] for m in modules.values())
    for name, m in modules.items():
        sharded = [a for a, p in enumerate(placement_axes(m["placement"])) if p.startswith("S(")]
        assert m["sharded_axes"] == sharded, (name, m["placement"], m["sharded_axes"])
        for a in results:
            for b in results:
                same_data = all(a["coords"][ax] == b["coords"][ax] for ax in sharded)
                equal = torch.equal(a["modules"][name]["probe"], b["modules"][name]["probe"])
                assert equal == same_data, (name, m["placement"], a["coords"], b["coords"])
