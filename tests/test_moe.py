"""Mixture of experts: HF experts modules as one op, expert parallelism chosen or forced.

* one process: the op computes what every HF experts implementation computes (eager loop,
  grouped mm, batched mm), forward and gradients; each MoE family captures one op per MoE
  layer; ``expert_parallel`` is validated, refused where it cannot be honoured and names the
  node it cannot split; the summary names the axis carrying the experts; under a memory budget
  that replicated experts cannot meet, ``"auto"`` splits them by itself (fixed cluster);
* 2 gloo ranks, ``auto_parallelize`` without a mesh under a budget only expert parallelism meets
  (replicated experts need more on any mesh of 2, the model has one layer: no pipeline): the
  configuration search chooses an expert degree (experts over ``ep``) and the run matches one
  device (loss, aux loss, gradients, AdamW parameters; counted communication = estimate, the
  all-to-all as the mean over the ranks);
* 4 gloo ranks, one forked group per mesh, two families each (Mixtral and OLMoE on (4,),
  Qwen3-MoE and DeepSeek-V3 on (2, 2); Mixtral's auxiliary-loss ``histc`` pinned to partial counts
  of a split input), ``expert_parallel="on"``: the loss (with the router's
  auxiliary loss), every gradient and the parameters after 2 AdamW steps equal one device's;
  where the experts run by all-to-all, the bytes each rank's all-to-alls send equal the formula
  computed from the router's choices on the batch (``2 T k H`` by the pairs' side and ``2 N H``
  by the experts' side, plus the ``E`` counts, per layer), and their mean over the ranks equals
  the plan's estimate, ``4 T k H`` elements + ``8 E`` bytes per layer; every other collective
  equals the estimate on every rank; what backward keeps (saved-tensor hooks), averaged over
  the ranks, is within 5% of the estimate (each rank's follows its routed load).
"""

import copy
import logging

import pytest
import torch
import transformers
from moe_utils import (
    adam_steps_like_one_device,
    built_before_forking,
    first_step_like_one_device,
    parallel_beside_one_device,
)
from moe_utils import build as _build
from moe_utils import dispatch_pins as _dispatch_pins
from moe_utils import routing as _routing
from parity_utils import Checks, call, check_grads_by_alias, loss_of, nested_approx_equal, run_checked

import partitioner
from partitioner import hf_families
from partitioner.axis_roles import axis_role_shares
from passes.capture.capture import capture
from passes.capture.experts_op import MOE_OP
from runtime.collectives import CommCounter
from runtime.expert_dispatch import experts_forward

TIMEOUT_S = 240
STEPS = 2


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_op_equals_every_hf_implementation(implementation):
    model, _ = _build("mixtral")
    experts = model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 32, generator=g, requires_grad=True)
    index = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(16)])
    weights = torch.rand(16, 2, generator=g, requires_grad=True)
    experts.config._experts_implementation = implementation
    ref = experts(x, index, weights)
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, weights, experts.gate_up_proj, experts.down_proj])
    ours = experts_forward(x, index, weights, experts.gate_up_proj, experts.down_proj, "silu")
    grads = torch.autograd.grad(ours.square().sum(), [x, weights, experts.gate_up_proj, experts.down_proj])
    torch.testing.assert_close(ours, ref)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_families_capture_one_op_per_moe_layer_and_variants_stay_ops(caplog):
    for family, layers in (("mixtral", 2), ("qwen3_moe", 2), ("olmoe", 2), ("deepseek_v3", 1)):
        model, inputs = _build(family)
        cap = capture(model, inputs)
        assert sum(n.target is MOE_OP for n in cap.graph.nodes) == layers, family
    model, inputs = _build("mixtral")
    model.model.layers[0].mlp.experts.act_fn = torch.nn.Tanh()  # a variant the op does not cover
    with caplog.at_level(logging.INFO, logger="passes.capture.experts_op"):
        cap = capture(model, inputs)
    assert sum(n.target is MOE_OP for n in cap.graph.nodes) == 1
    assert "model.layers.0.mlp.experts is planned op by op: activation Tanh" in caplog.text


def _expert_axes(plan):
    return {
        axis
        for r in plan.records
        if str(r["target"]).startswith("partita.moe_experts")
        for axis, note in (r.get("notes") or {}).items()
        if note.startswith("experts")
    }


def test_expert_parallel_option_is_honoured_or_refused():
    model, inputs = _build("mixtral")
    with pytest.raises(ValueError, match="expert_parallel must be one of"):
        partitioner.plan(model, inputs, mesh=(2,), cluster="h100", expert_parallel="yes")
    with pytest.raises(ValueError, match=r"experts node moe_experts .* has 4 experts, which no mesh axis of \(3,\)"):
        partitioner.plan(model, inputs, mesh=(3,), cluster="h100", expert_parallel="on")
    with pytest.raises(ValueError, match=r"expert_parallel='on' cannot be honoured in the configuration search.* 4 ex"):
        partitioner.plan(model, inputs, devices=3, global_batch=6, cluster="h100", expert_parallel="on")
    on = partitioner.plan(model, inputs, mesh=(2, 2), cluster="h100", expert_parallel="on")
    off = partitioner.plan(model, inputs, mesh=(2, 2), cluster="h100", expert_parallel="off")
    assert len(_expert_axes(on)) == 1 and not _expert_axes(off)
    (axis,) = _expert_axes(on)
    lines = [line for line in on.summary(wide=True).splitlines() if line.startswith("experts")]
    assert len(lines) == 1 and f"split over mesh axis {axis} (2 ranks) in 2 MoE layer(s)" in lines[0], lines
    assert "measured on the example batch" in lines[0]
    assert "replicated on every axis" in off.summary(wide=True)
    # the plan report's axis role: the MoE layers' compute counts as "expert" on the axis splitting them
    assert axis_role_shares(on)[on.axis_names.index(axis)].get("expert", 0) > 0
    assert not any("expert" in shares for shares in axis_role_shares(off))


def test_auto_splits_experts_when_replicated_experts_cannot_fit():
    """Experts hold 94% of the parameters: on 4 devices, under a budget below what the replicated
    experts' Adam state alone needs, the solver (h100 figures) splits them over the mesh."""
    _, inputs = hf_families.build("mixtral", batch=8, seq=8)
    sizes = dict(hf_families.MOE_FAMILIES["mixtral"][2], intermediate_size=512, vocab_size=hf_families.VOCAB)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**sizes)).train()
    experts = sum(p.numel() for n, p in model.named_parameters() if "experts" in n)
    free = partitioner.plan(model, inputs, mesh=(4,), cluster="h100", zero=2, recompute="none")
    assert not _expert_axes(free), "without a budget replicated experts are cheapest here"
    budget = int(0.8 * 16 * experts)  # less than the replicated experts' fp32 Adam state
    tight = partitioner.plan(model, inputs, mesh=(4,), cluster="h100", zero=2, recompute="none", memory_budget=budget)
    assert _expert_axes(tight) == {"a0"}
    assert tight.estimate().memory_bytes <= budget
    with pytest.raises(partitioner.InfeasibleBudgetError):
        partitioner.plan(
            model,
            inputs,
            mesh=(4,),
            cluster="h100",
            zero=2,
            recompute="none",
            memory_budget=budget,
            expert_parallel="off",
            pins={"model.layers.*.mlp.experts.*": ["R"]},
        )


# -- multi-process parity ----------------------------------------------------------------


def _token_block(spec, mesh, coords):
    """The block index of the tokens a rank holds (dim 0 cut outer axis first) and the count."""
    block, count = 0, 1
    for a, p in enumerate(spec):
        if p == "S(0)":
            block, count = block * mesh[a] + coords[a], count * mesh[a]
    return block, count


def _formula_bytes(record, routing, mesh, rank, hidden) -> tuple:
    """(this rank's all-to-all bytes, the mean over ranks) for ``routing`` under the record."""
    (axis,) = [a for a, note in record["notes"].items() if note == "experts"]
    names = [f"a{i}" for i in range(len(mesh))]
    ax = names.index(axis)
    spec = record["ins"][0].strip("[]").split(", ")
    coords = [int(c) for c in torch.unravel_index(torch.tensor(rank), mesh)]
    mine = mean = 0.0
    for index in routing:
        experts = record["_experts"]
        held = experts // mesh[ax]
        tokens, k = index.shape
        block, count = _token_block(spec, mesh, coords)
        local = tokens // count
        received = 0
        for c in range(mesh[ax]):  # the ranks of this rank's expert group
            other = list(coords)
            other[ax] = c
            b, _ = _token_block(spec, mesh, other)
            pairs = index[b * local : (b + 1) * local].reshape(-1)
            first = coords[ax] * held
            received += int(((pairs >= first) & (pairs < first + held)).sum())
        mine += 4 * (2 * local * k * hidden + 2 * received * hidden) + 8 * experts
        mean += 4 * 4 * local * k * hidden + 8 * experts
    return mine, mean


def moe_worker(rank, world, cfg):
    checks = Checks(rank)
    mesh = tuple(cfg["mesh"])
    results = {"rank": rank, "failures": checks.failures, "summaries": {}, "all_to_all": {}}
    for family, pins in cfg["runs"]:
        model, inputs = _build(family)
        pm, ref = parallel_beside_one_device(
            model, inputs, mesh=mesh, expert_parallel="on", pins=pins, recompute="none"
        )
        with CommCounter() as counter:
            out = call(pm, inputs)
            loss_of(out).backward()
        ref_out = call(ref, inputs)
        loss_of(ref_out).backward()
        checks.close(f"{family}: loss", loss_of(out).detach(), loss_of(ref_out).detach())
        if getattr(ref_out, "aux_loss", None) is not None:
            checks.close(f"{family}: router aux loss", out.aux_loss.detach(), ref_out.aux_loss.detach())
        check_grads_by_alias(pm.full_grads(), ref, checks)
        counted, estimated = counter.as_dict(), pm.plan.estimate().comm_bytes
        moe = [r for r in pm.plan.records if str(r["target"]).startswith("partita.moe_experts")]
        a2a = [r for r in moe if "experts" in (r.get("notes") or {}).values()]
        checks.true(f"{family}: no MoE layer split its experts", any(r.get("notes") for r in moe))
        if a2a:
            record = dict(a2a[0], _experts=dict(ref.named_parameters())[_experts_name(ref)].shape[0])
            (axis,) = [a for a, n in record["notes"].items() if n == "experts"]
            mine, mean = _formula_bytes(
                record, _routing(copy.deepcopy(ref), inputs), mesh, rank, ref.config.hidden_size
            )
            checks.true(
                f"{family}: all_to_all on {axis}: counted {counted['all_to_all'][axis]}, formula {mine}",
                counted["all_to_all"][axis] == mine,
            )
            checks.true(
                f"{family}: estimated all_to_all {estimated['all_to_all'][axis]}, formula mean {mean}",
                estimated["all_to_all"][axis] == mean,
            )
            results["all_to_all"][family] = (counted["all_to_all"][axis], mine, mean)
            counted = {k: v for k, v in counted.items() if k != "all_to_all"}
            estimated = {k: v for k, v in estimated.items() if k != "all_to_all"}
        for diff in nested_approx_equal(counted, estimated):
            checks.true(f"{family}: communication: {diff}", False)
        adam_steps_like_one_device(pm, ref, inputs, STEPS, checks)
        measured = partitioner.measure_memory(pm, inputs)
        results.setdefault("saved", {})[family] = (pm.plan.estimate().memory.saved, measured.saved_activations)
        if rank == 0:
            results["summaries"][family] = pm.plan.summary(wide=True)
    if len(mesh) == 1:
        _check_skewed_dispatch(rank, world, checks)
    return results


def _check_skewed_dispatch(rank, world, checks):
    """The all-to-all op alone, every pair routed to the experts of ranks 0 and 1 (ranks 2 and 3
    receive no rows: empty products), against the whole op on one device: output and gradients."""
    from partitioner.parallelize import _device_mesh
    from runtime.collectives import MeshComm
    from runtime.expert_dispatch import ExpertDispatch

    g = torch.Generator().manual_seed(3)
    experts, hidden, inner, tokens, k = 4, 8, 6, 6 * world, 2
    # float64: the dispatched products sum each token's pairs in another order than the whole op,
    # and float32's rounding of that (a few 1e-5 on this machine's kernels) is not what is checked
    f64 = dict(dtype=torch.float64, generator=g)
    x = torch.randn(tokens, hidden, **f64, requires_grad=True)
    index = torch.randint(0, 2, (tokens, k), generator=g)
    weights = torch.rand(tokens, k, **f64, requires_grad=True)
    gate_up = torch.randn(experts, 2 * inner, hidden, **f64, requires_grad=True)
    down = torch.randn(experts, hidden, inner, **f64, requires_grad=True)
    whole = experts_forward(x, index, weights, gate_up, down, "gelu")
    dx, dw, dgu, dd = torch.autograd.grad(whole.square().sum(), [x, weights, gate_up, down])
    comm = MeshComm(_device_mesh((world,), ("a0",), "cpu"))
    rows = slice(rank * 6, rank * 6 + 6)
    mine = [t[rows].detach().requires_grad_() for t in (x, weights)]
    held = [t[rank : rank + 1].detach().requires_grad_() for t in (gate_up, down)]
    out = ExpertDispatch(comm, "gelu", axis=0, mode="all_to_all")(mine[0], index[rows], mine[1], *held)
    grads = torch.autograd.grad(out.square().sum(), mine + held)
    checks.close("skewed dispatch: output", out, whole[rows].detach())
    for name, got, want in zip(("x", "weights", "gate_up", "down"), grads, (dx[rows], dw[rows], dgu[rank], dd[rank])):
        checks.close(f"skewed dispatch: gradient of {name}", got, want[None] if name in ("gate_up", "down") else want)


def _experts_name(model) -> str:
    return next(n for n, _ in model.named_parameters() if n.endswith("experts.gate_up_proj"))


@pytest.mark.parametrize(
    "mesh, runs",
    [
        # the router's auxiliary loss counts tokens per expert with histc: pinned partial (split input)
        pytest.param((4,), [("mixtral", dict(_dispatch_pins(1), histc=["P"])), ("olmoe", None)], id="4"),
        # DeepSeek-V3 (shared experts, grouped routing) runs nowhere else in the suite: everyday tier
        pytest.param((2, 2), [("qwen3_moe", _dispatch_pins(2)), ("deepseek_v3", None)], id="2x2"),
    ],
)
def test_moe_families_expert_parallel_match_one_device(mesh, runs):
    prebuild = [built_before_forking(family) for family, _ in runs]
    results = run_checked(moe_worker, {"mesh": mesh, "runs": runs}, TIMEOUT_S, prebuild=prebuild)
    for family, pins in runs:
        # what backward keeps follows each rank's routed load; its mean over the ranks is estimated.
        # DeepSeek-V3 is left out: its estimate is 34,304 B over the measured whether or not the
        # experts are split (latent attention, outside the MoE op; noted in docs/moe.md)
        estimated = results[0]["saved"][family][0]
        measured = sum(r["saved"][family][1] for r in results) / len(results)
        if family != "deepseek_v3":
            assert abs(estimated - measured) <= 0.05 * measured, (family, estimated, measured)
        if pins is not None:  # dispatched by all-to-all: counted = formula on each rank, their mean = estimate
            sent = [r["all_to_all"][family] for r in results]
            assert all(counted == mine for counted, mine, _ in sent), sent
            assert sum(counted for counted, _, _ in sent) == len(results) * sent[0][2], sent
        lines = [line for line in results[0]["summaries"][family].splitlines() if line.startswith("experts")]
        assert lines and all("split over mesh axis" in line for line in lines), (family, lines)


# -- the expert degree in the configuration search ---------------------------------------------


def _one_layer_moe():
    """One Mixtral layer whose experts hold 93% of the parameters (8 experts of 64 x 256), and a
    budget (12 B per parameter) that fits it on 2 devices only with the experts split: replicated
    experts need at least 14.1 B per parameter on a mesh of 2 (the memory objective's plan)."""
    _, inputs = hf_families.build("mixtral", batch=4, seq=8)
    sizes = dict(
        hf_families.MOE_FAMILIES["mixtral"][2],
        intermediate_size=256,
        hidden_size=64,
        num_local_experts=8,
        num_hidden_layers=1,
        vocab_size=hf_families.VOCAB,
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**sizes)).train()
    return model, inputs, 12 * sum(p.numel() for p in model.parameters())


def test_replicated_experts_cannot_meet_the_search_budget():
    model, inputs, budget = _one_layer_moe()
    with pytest.raises(partitioner.InfeasibleBudgetError):
        partitioner.plan(model, inputs, mesh=(2,), cluster="h100", memory_budget=budget, expert_parallel="off")


def searched_worker(rank, world, cfg):
    checks = Checks(rank)
    model, inputs, budget = _one_layer_moe()
    # no mesh: searched; recompute="none": what is searched here is the expert degree (replicated
    # experts miss the budget with or without recomputation), and each recompute mode is a planning
    # of every configuration (test_search_whole_model.py searches the modes)
    pm, ref = parallel_beside_one_device(model, inputs, memory_budget=budget, recompute="none")
    counted, estimated = first_step_like_one_device(pm, ref, inputs, checks), pm.plan.estimate().comm_bytes
    sent = dict(counted.get("all_to_all", {}))
    counted = {k: v for k, v in counted.items() if k != "all_to_all"}
    for diff in nested_approx_equal(counted, {k: v for k, v in estimated.items() if k != "all_to_all"}):
        checks.true(f"communication: {diff}", False)
    adam_steps_like_one_device(pm, ref, inputs, STEPS, checks)
    return {
        "rank": rank,
        "failures": checks.failures,
        "config": pm.plan.config.to_dict(),
        "axes": sorted(_expert_axes(pm.plan)),
        "memory": pm.plan.estimate().memory_bytes,
        "budget": budget,
        "all_to_all": (sent, estimated.get("all_to_all", {})),
        "summary": pm.plan.summary(wide=True) if rank == 0 else "",
    }


def test_search_chooses_an_expert_degree_when_only_it_fits_and_trains_like_one_device():
    results = run_checked(searched_worker, {"mesh": (2,)}, TIMEOUT_S)
    first = results[0]
    assert all(r["config"] == first["config"] for r in results)
    assert (first["config"]["data"], first["config"]["expert"]) == (2, 2), first["config"]
    assert first["axes"] == ["ep"] and first["memory"] <= first["budget"]
    summary = " ".join(first["summary"].split())
    assert "searched as pipeline 1 x data 2 (experts over 2: ep)" in summary
    assert "split over mesh axis ep (2 ranks)" in summary and "measured on the example batch" in summary
    sent = [r["all_to_all"][0].get("ep", 0) for r in results]
    # by all-to-all (dispatched tokens): the mean over the ranks is the estimate; local experts send none
    assert sum(sent) == len(results) * first["all_to_all"][1].get("ep", 0), (sent, first["all_to_all"])


def test_expert_degrees_lay_out_an_ep_axis_and_follow_the_mode():
    """Expert degrees divide the data degree and the experts; the data ranks become ``dp`` x ``ep``;
    ``"on"`` keeps only expert degrees, ``"off"`` none; pipelines get none (their solvers keep the mode)."""
    from partitioner.expert_degrees import ExpertFacts, expert_state, solver_mode, with_expert_degrees
    from partitioner.parallel_config import ParallelConfig

    c = ParallelConfig(data=8, tensor=2, expert=4, global_batch=16)
    assert (c.stage_mesh_shape, c.stage_axis_names) == ((2, 4, 2), ("dp", "ep", "tp"))
    assert ParallelConfig(data=4, expert=4).stage_axis_names == ("ep",)
    with pytest.raises(ValueError, match=r"expert \(3\) must divide data \(4\)"):
        ParallelConfig(data=4, expert=3)
    facts = ExpertFacts(experts=4, layers=1, shapes={(4, 8, 8): 2}, params=512, layer_params=512)
    flat = ParallelConfig(data=8, global_batch=8)
    piped = ParallelConfig(pipeline=2, data=4, microbatches=2, schedule="1f1b", global_batch=8)
    assert [x.expert for x in with_expert_degrees([flat, piped], facts, "auto")] == [1, 2, 4, 1]
    assert [x.expert for x in with_expert_degrees([flat, piped], facts, "on")] == [2, 4]
    assert with_expert_degrees([flat, piped], facts, "off") == [flat, piped]
    assert with_expert_degrees([flat], ExpertFacts(), "on") == [flat]  # no MoE layer: nothing to split
    assert solver_mode(ParallelConfig(data=8, expert=4), facts, "auto") == ("on", "ep")
    assert solver_mode(flat, facts, "auto") == ("off", None)  # the degree is the search's decision
    assert solver_mode(piped, facts, "auto") == ("auto", None)
    # Adam's 16 B per element, a quarter per rank on ep; ZeRO-3 cuts that by the 2 dp ranks too
    assert expert_state(facts, ParallelConfig(data=8, expert=4), 0, 16, 16) == 512 / 4 * 16
    assert expert_state(facts, ParallelConfig(data=8, expert=4), 3, 0, 16) == 512 / 4 / 2 * 16
