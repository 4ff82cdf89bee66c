"""The rank worker of the ZeRO-2 / ZeRO-3 parity tests (``tests/test_zero.py`` on GPT and ViT,
``tests/test_zero_llama.py`` on HF LLaMA); the checks it makes are listed in
``tests/test_zero.py``'s docstring.
"""

import copy

from parity_utils import (
    MODELS,
    Checks,
    build,
    check_step_like_one_device,
    free_weights,
    prebuilt,
    run_checked,
    train_like_one_device,
)
from support import placement_axes

TIMEOUT_S = 240
STEPS = 3
BUDGET = 0.5
TOLERANCE = 0.05


def run_zero(cfg):
    """:func:`zero_worker` on ``cfg``'s mesh, the two models it parallelizes (ZeRO-3, ZeRO-2) built
    and captured here before the ranks fork."""
    factory = MODELS[cfg["model"]]["factory"]
    return run_checked(zero_worker, cfg, TIMEOUT_S, prebuild=[(cfg["model"], factory), (f"{cfg['model']}/2", factory)])


def zero_worker(rank, world, cfg):
    import partitioner

    checks = Checks(rank)
    mesh = tuple(cfg["mesh"])
    model, inputs = build(cfg["model"])
    ref = copy.deepcopy(model)
    n_params = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    budget = int(BUDGET * 16 * n_params)
    activations = free_weights(cfg["model"], cfg["kind"], mesh) or {}
    plans, saved, counters = {}, {}, {}
    for stage in (3, 2):
        # ZeRO-2 does not fit the budget: it stores the weights where ZeRO-3 did, without one
        pins = dict(activations)
        if stage == 2:
            pins.update({r["fqn"]: placement_axes(r["out"][0])
                         for r in plans[3].plan.records if r["kind"] == "param"})
        reference = copy.deepcopy(ref)
        # the model built (ZeRO-3; unchanged: ref is its copy) and the parent's second one, each captured there
        source = model if stage == 3 else (prebuilt(f"{cfg['model']}/2") or (copy.deepcopy(ref),))[0]
        pm = partitioner.auto_parallelize(source, inputs, mesh=mesh, cluster="h100", recompute="none",
                                          zero=stage, memory_budget=budget if stage == 3 else None, pins=pins)
        label = f"{cfg['model']} {mesh} ZeRO-{stage}"
        measured = partitioner.measure_memory(pm, inputs)
        est = pm.plan.estimate().memory
        checks.true(f"{label}: saved for backward estimated {est.saved:.0f} B, measured "
                    f"{measured.saved_activations} B", abs(est.saved - measured.saved_activations)
                    <= TOLERANCE * measured.saved_activations)
        if stage == 3:
            checks.true(f"{label}: estimated peak {pm.plan.estimate().memory_bytes:.0f} B over the budget {budget}",
                        pm.plan.estimate().memory_bytes <= budget)
        for p in pm.parameters():
            p.grad = None
        counters[stage] = check_step_like_one_device(pm, reference, inputs, checks, label)
        train_like_one_device(pm, reference, inputs, STEPS, checks, label)
        plans[stage], saved[stage] = pm, measured.saved_activations
    pm = plans[3]
    regathered = [r for r in pm.plan.records if r.get("regather")]
    checks.true("ZeRO-3 plan has no regathered weight", bool(regathered))
    checks.true(f"ZeRO-3 saves {saved[3]} B, not fewer than ZeRO-2's {saved[2]} B", saved[3] < saved[2])
    # the regathers: backward all-gathers exactly as many bytes again as the records mark
    extra = sum(c["bytes"] for r in pm.plan.records for c in r["comm"] if c.get("regather"))
    counted_bwd = sum(counters[3].phase_dict().get("bwd", {}).get("all_gather", {}).values())
    planned_bwd = sum(c["bytes"] for r in pm.plan.records for c in r["comm"]
                      if c["phase"] == "bwd" and c["kind"] == "all_gather")
    checks.true(f"regathered bytes {extra:.0f} not all in backward's all-gathers {counted_bwd:.0f}",
                extra > 0 and counted_bwd == planned_bwd and extra <= counted_bwd)
    return {"rank": rank, "failures": checks.failures, "regathered": len(regathered)}
