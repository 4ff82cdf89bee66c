"""Activation checkpointing: recomputed repeated blocks, forced or chosen by the solver.

Multi-process (4 gloo ranks, meshes (4,) and (2, 2)): with ``recompute="all"`` every layer of
GPT, HF LLaMA and HF ViT runs in a checkpointed region; loss, every gradient and the parameters after
3 AdamW steps equal one device; the collectives counted in forward + backward (the recompute
reruns the layer's forward collectives) equal the plan's estimate; the bytes saved for
backward (``saved_tensors_hooks``, unique storages) drop against the same plan without
recomputation. With dropout, the recompute draws the forward's masks: gradients equal the
run without recomputation.

One process (fixed cluster ``h100``, models on ``meta``): the solver recomputes only when the
budget needs it, the estimate prices the recompute, the infeasible-budget error names the
least memory with recomputation, the plan summary and ``explain`` say which blocks recompute.
"""

import copy

import pytest
import torch
from parity_utils import (
    MODELS,
    Checks,
    adam_in_lockstep,
    build,
    call,
    loss_of,
    nested_approx_equal,
    parity_case,
    pins_for,
    prebuilt,
    run_checked,
    slow_tier,
)

import partitioner
from partitioner import models

TIMEOUT_S = 300


def _saved_bytes(run) -> int:
    """Bytes of the unique storages autograd saves for backward while ``run()`` executes
    (tensors packed by a checkpointed region's own hooks are not saved: they are recomputed)."""
    storages = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sum(storages.values())


def recompute_worker(rank, world, cfg):
    from runtime.collectives import CommCounter
    from runtime.recompute import CheckpointRegion

    checks = Checks(rank)
    mesh = tuple(cfg["mesh"])
    pins = pins_for(cfg["model"], cfg["plan"], mesh)
    model, inputs = build(cfg["model"])
    ref = copy.deepcopy(model)
    twin = (prebuilt(f"{cfg['model']}/twin") or (copy.deepcopy(model),))[0]  # a second build, captured in the parent
    pm = partitioner.auto_parallelize(model, inputs, mesh=mesh, pins=pins, cluster="h100", recompute="all")
    plain = partitioner.auto_parallelize(twin, inputs, mesh=mesh, plan=_without_recompute(pm.plan))
    result = {"rank": rank, "failures": checks.failures}
    regions = [m for m in pm.program.modules() if isinstance(m, CheckpointRegion)]
    layers = sum(b["count"] for b in pm.plan.data["blocks"])
    checks.true(f"{len(regions)} checkpointed regions for {layers} layers", len(regions) == layers > 0)
    checks.true("the plan without recomputation has no region",
                not any(isinstance(m, CheckpointRegion) for m in plain.program.modules()))

    _, result["saved_plain"] = _saved_bytes(lambda: loss_of(call(plain, inputs)))
    with CommCounter() as counter:
        loss, result["saved_recompute"] = _saved_bytes(lambda: loss_of(call(pm, inputs)))
        loss.backward()
    for diff in nested_approx_equal(counter.as_dict(), pm.plan.estimate().comm_bytes):
        checks.true(f"counted vs estimated communication: {diff}", False)
    plain_layers = [r for r in _without_recompute(pm.plan).records if r["kind"] == "op" and "block" in r]
    result["layer_saved"] = sum(r["memory"] for r in plain_layers)
    result["recomputed_collectives"] = sum(1 for r in pm.plan.records for c in r["comm"] if c.get("recompute"))

    ref_loss = loss_of(call(ref, inputs))
    ref_loss.backward()
    checks.close("loss", loss.detach(), ref_loss.detach())
    grads = pm.full_grads()
    for name, p in ref.named_parameters(remove_duplicate=False):
        if name in grads:
            checks.close(f"grad of {name}", grads[name], p.grad if p.grad is not None else torch.zeros_like(grads[name]))
    adam_in_lockstep(pm.parameters(), ref, inputs, 3, lambda: _step(pm, inputs), checks)
    state = pm.full_state_dict()
    for name, p in ref.named_parameters(remove_duplicate=False):
        checks.close(f"parameter {name} after 3 AdamW steps", state[name], p.detach())
    return result


def _step(pm, inputs):
    loss = loss_of(call(pm, inputs))
    loss.backward()
    return loss


@pytest.mark.parametrize("cfg", [slow_tier(parity_case("gpt", (4,), "tp")), parity_case("gpt", (2, 2), "dp_tp"),
                                 parity_case("llama", (4,), "tp"), slow_tier(parity_case("llama", (2, 2), "dp_tp")),
                                 slow_tier(parity_case("vit", (2, 2), "dp_tp"))])
def test_recomputed_layers_match_one_device(cfg):
    factory = MODELS[cfg["model"]]["factory"]  # the model and its twin, built and captured before forking
    results = run_checked(recompute_worker, cfg, TIMEOUT_S,
                          prebuild=[(cfg["model"], factory), (f"{cfg['model']}/twin", factory)])
    for r in results:
        # the layers' saved activations are gone (a region's inputs are held by the checkpoint, not
        # saved): the drop is at least what the plan without recomputation says the layers' ops keep
        # (less a margin for what code after the layers also keeps, e.g. the last layer's output)
        drop = r["saved_plain"] - r["saved_recompute"]
        assert drop >= 0.8 * r["layer_saved"] > 0, r
    # Megatron layers all-reduce on the tensor-parallel axis: the recompute repeats those
    assert results[0]["recomputed_collectives"] > 0


def _without_recompute(plan):
    """The same placements, every layer's activations kept (records unmarked)."""
    from partitioner.sharding_plan import ShardingPlan

    records = [{k: v for k, v in r.items() if k != "recompute"} for r in plan.records]
    return ShardingPlan.from_dict(dict(copy.deepcopy(plan.data), records=records))


def _gpt_with_dropout():
    return models.gpt_demo(batch=8, seq=16, n_layer=2, dropout=0.1)


def dropout_recompute_worker(rank, world, cfg):
    checks = Checks(rank)
    mesh = tuple(cfg["mesh"])
    out = {}
    # the model and its twin (the same seeded weights), built and captured in the parent
    (model, inputs), (twin, _) = (prebuilt(key) or _gpt_with_dropout() for key in ("gpt", "gpt/twin"))
    pm = partitioner.auto_parallelize(model, inputs, mesh=mesh, pins=pins_for("gpt", "dp_tp", mesh),
                                      cluster="h100", recompute="all")
    plain = partitioner.auto_parallelize(twin, inputs, mesh=mesh, plan=_without_recompute(pm.plan))
    for mode, module in (("all", pm), ("none", plain)):
        losses = []
        for _ in range(2):  # two steps: the second draws other masks, in both runs alike
            loss = module(*inputs)
            loss.backward()
            losses.append(loss.detach())
        out[mode] = (losses, module.full_grads())
    (plain_losses, plain_grads), (losses, grads) = out["none"], out["all"]
    checks.true("dropout changes the loss between steps", not torch.equal(plain_losses[0], plain_losses[1]))
    for step, (a, b) in enumerate(zip(losses, plain_losses)):
        checks.close(f"loss at step {step}", a, b)
    for name, g in plain_grads.items():
        checks.close(f"grad of {name} (two steps accumulated)", grads[name], g)
    return {"rank": rank, "failures": checks.failures}


def test_recompute_draws_the_forward_dropout_masks():
    run_checked(dropout_recompute_worker, dict(mesh=(2, 2)), TIMEOUT_S,
                prebuild=[("gpt", _gpt_with_dropout), ("gpt/twin", _gpt_with_dropout)])


# ----------------------------------------------------------------------- the solver's choice


def _gpt(layers=4):
    return models.gpt_block(batch=8, seq=512, n_embd=256, n_head=8, n_layer=layers, vocab=512)


def _plan(model, inputs, **kw):
    return partitioner.plan(model, inputs, mesh_shape=(4,), cluster="h100", **kw)


def _solver_memory(plan) -> float:
    """The memory the solver held under the budget: the sum of the records' ``memory``."""
    return sum(r.get("memory", 0.0) for r in plan.records)


def test_the_solver_recomputes_only_under_a_budget_that_needs_it():
    model, inputs = _gpt()
    loose = _plan(model, inputs, memory_budget="80GiB")
    assert [b["recompute"] for b in loose.data["blocks"]] == [False]
    assert not any(r.get("recompute") for r in loose.records)
    least_kept = loose.data["stats"]["least_memory_without_recompute"]
    tight = _plan(model, inputs, memory_budget=int(least_kept * 0.9))   # no plan fits without recompute
    assert [b["recompute"] for b in tight.data["blocks"]] == [True]
    assert _solver_memory(tight) <= least_kept * 0.9
    assert tight.estimate().memory_bytes <= least_kept * 0.9                # the estimated peak fits too
    # every op of every layer is recomputed, nothing outside the layers
    ops = [r for r in tight.records if r["kind"] == "op"]
    assert all(bool(r.get("recompute")) == ("block" in r) for r in ops)
    # the step-time estimate includes one more forward of the layers (compute and collectives)
    est = tight.estimate()
    redo = sum(r.get("recompute_s", 0.0) for r in tight.records)
    redo += sum(c["time_s"] for r in tight.records for c in r["comm"] if c.get("recompute"))
    assert redo > 0
    # the estimate credits prefetched gathers' overlap and adds the optimizer step, after solving
    stats = tight.data["stats"]
    # and the latency of the calls that send flat buffers (passes/plan/collective_calls.py)
    solved = stats["objective_s"] - stats["prefetch_overlap_s"] - stats["bucket_overlap_s"] + stats["optimizer_step_s"]
    solved += est.flat_latency_s
    assert est.step_time_s == pytest.approx(solved, rel=1e-9)
    forced = _plan(model, inputs, recompute="all", memory_budget="80GiB")
    plain = _plan(model, inputs, recompute="none", memory_budget="80GiB")
    assert forced.estimate().step_time_s > plain.estimate().step_time_s == loose.estimate().step_time_s
    # the same placements, recomputed: exactly the forward of the layers' ops added
    if [r["out"] for r in forced.records] == [r["out"] for r in plain.records]:
        added = sum(r.get("recompute_s", 0.0) for r in forced.records)
        added += sum(c["time_s"] for r in forced.records for c in r["comm"] if c.get("recompute"))
        assert forced.estimate().step_time_s == pytest.approx(plain.estimate().step_time_s + added, rel=1e-9)
    assert _solver_memory(forced) < _solver_memory(plain)
    assert forced.estimate().memory.saved_activations < plain.estimate().memory.saved_activations / 4


def test_an_impossible_budget_names_the_least_memory_with_recompute():
    model, inputs = _gpt()
    least = _solver_memory(_plan(model, inputs, recompute="all", objective="memory"))
    with pytest.raises(partitioner.InfeasibleBudgetError,
                       match=r"least memory any plan needs is [0-9.]+ GiB \(\d+ bytes\) with the repeated blocks "
                             r"recomputed.*what is needed next"):
        _plan(model, inputs, memory_budget=int(least * 0.9))
    with pytest.raises(partitioner.InfeasibleBudgetError, match=r"recompute='none'.*recompute='auto'"):
        _plan(model, inputs, memory_budget=int(least * 1.01), recompute="none")


def test_bad_recompute_mode_is_refused():
    model, inputs = _gpt(layers=2)
    with pytest.raises(ValueError, match=r"recompute must be one of \('auto', 'selective', 'all', 'none'\).*'some'"):
        _plan(model, inputs, recompute="some")


def test_summary_and_explain_say_which_blocks_are_recomputed():
    model, inputs = _gpt(layers=2)
    plan = _plan(model, inputs, recompute="all")
    assert "recomputed in backward (activation checkpointing, recompute='all'): h.[0-1]" in plan.summary()
    assert "recomputed in backward" in plan.explain("h.0.mlp")
    plain = _plan(model, inputs, recompute="none")
    assert "recomputed" not in plain.summary()


def test_cli_plan_recompute_all(tmp_path, capsys):
    from partitioner.__main__ import main

    path = tmp_path / "plan.json"
    code = main(["plan", "partitioner.models:gpt_demo", "--mesh", "4", "--cluster", "h100", "--recompute", "all",
                 "--quiet", "--json", str(path)])
    assert code == 0
    plan = partitioner.ShardingPlan.load(path)
    assert plan.data["recompute"] == "all" and all(b["recompute"] for b in plan.data["blocks"])
    assert "recomputed in backward (activation checkpointing, recompute='all'): h.[0-1]" in capsys.readouterr().out


def test_forced_recompute_with_a_pipeline_and_a_bad_mode_are_refused(fake_process_group):
    fake_process_group(4)
    model, inputs = models.gpt_demo(batch=8, seq=16, n_layer=2)
    with pytest.raises(ValueError, match=r"recompute='all' is not available with pipeline="):
        partitioner.auto_parallelize(model, inputs, mesh=(2, 2), cluster="h100", recompute="all",
                                     pipeline={"degree": 2, "schedule": "1f1b", "microbatches": 2})
    with pytest.raises(ValueError, match=r"recompute must be one of .*'yes'"):
        partitioner.auto_parallelize(model, inputs, mesh=(4,), cluster="h100", recompute="yes")
