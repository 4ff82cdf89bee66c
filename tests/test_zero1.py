"""ZeRO-1 weights (used whole, optimizer state sharded), on real gloo ranks against one device.

A ZeRO-1 weight keeps a whole compute copy where it is replicated on the data-parallel axes; the
optimizer steps its shard (the module's parameter); its gradient is reduce-scattered into the
shard once per step and the stepped shard all-gathered into the copy once per step
(``runtime/optimizer_shards.py``).

* Parity, one forked run over six configs: GPT, HF LLaMA (RoPE, grouped-query attention) and ViT
  on (4,) (data parallel) and (2, 2) (data x Megatron, or data x data), ``zero=1``: loss, every
  gradient and the parameters after 3 AdamW steps equal the single-device model's, the
  communication counted in one step equals the plan's estimate, and the measured parameters and
  gradients (compute copies, shards) equal the estimate's, saved tensors within 5%.
* Known answer (GPT on (4,), data parallel): with the budget below what replicated optimizer
  state needs, ``zero="auto"`` makes every weight ZeRO-1 (no weight gathered for use, none tensor
  parallel), and a step of two micro-steps (the first under ``no_sync``) sends exactly one
  reduce-scatter and one all-gather of the parameters (the reduction one flat collective) and no
  gradient all-reduce (the refresh
  cut into buckets of 64 KiB, which changes no byte); gradients and the parameters after the step
  equal the reference's; after loading other weights into the shards, the next forward computes
  with them. ``free_source_weights`` releases the source model's whole weights first (all of
  them: every weight here is a ZeRO-1 shard), and afterwards a new input shape is refused with
  the reason.
"""

import copy

import pytest
import torch
from parity_utils import (
    MODELS,
    Checks,
    build,
    call,
    check_grads_by_alias,
    check_step_like_one_device,
    free_weights,
    loss_of,
    prebuilt,
    run_checked,
    train_like_one_device,
)

from runtime.collectives import CommCounter

TIMEOUT_S = 240
STEPS = 3
TOLERANCE = 0.05

PARITY = [
    ("gpt", (4,), "dp"),
    ("gpt", (2, 2), "dp_tp"),
    ("llama", (4,), "dp"),
    ("llama", (2, 2), "dp_tp"),
    ("vit", (4,), "dp"),
    ("vit", (2, 2), "dp"),
]


def parity_worker(rank, world, cfg):
    import partitioner

    checks = Checks(rank)
    counts = {}
    for name, mesh, kind in PARITY:
        label = f"{name} {mesh}"
        model, inputs = prebuilt(label) or build(name)  # the parent's, captured there
        ref = copy.deepcopy(model)
        pm = partitioner.auto_parallelize(model, inputs, mesh=mesh, cluster="h100", recompute="none", zero=1,
                                          pins=free_weights(name, kind, mesh))
        zero1 = [r["fqn"] for r in pm.plan.records if r.get("stored")]
        checks.true(f"{label}: no ZeRO-1 weight", bool(zero1))
        check_step_like_one_device(pm, ref, inputs, checks, label, grad_checks=_Labelled(checks, label))
        for p in pm.parameters():
            p.grad = None
        measured, est = partitioner.measure_memory(pm, inputs), pm.plan.estimate().memory
        checks.true(f"{label}: saved for backward estimated {est.saved:.0f} B, measured {measured.saved_activations} B",
                    abs(est.saved - measured.saved_activations) <= TOLERANCE * measured.saved_activations)
        checks.true(f"{label}: parameters + gradients estimated {est.parameters:.0f} + {est.gradients:.0f} B, "
                    f"measured {measured.parameters} + {measured.gradients} B",
                    (est.parameters, est.gradients) == (measured.parameters, measured.gradients))
        for p in pm.parameters():  # the gradients of one step again, for the first AdamW step
            p.grad = None
        loss_of(call(pm, inputs)).backward()
        train_like_one_device(pm, ref, inputs, STEPS, _Labelled(checks, label))
        counts[label] = len(zero1)
    return {"rank": rank, "failures": checks.failures, "zero1": counts}


class _Labelled:
    """``Checks`` whose messages name the config."""

    def __init__(self, checks, label):
        self.checks, self.label = checks, label

    def close(self, what, *args, **kw):
        return self.checks.close(f"{self.label}: {what}", *args, **kw)

    def true(self, what, cond):
        return self.checks.true(f"{self.label}: {what}", cond)


def test_zero1_matches_one_device():
    # each config's model built and captured once, before the ranks fork
    prebuild = [(f"{name} {mesh}", MODELS[name]["factory"]) for name, mesh, _ in PARITY]
    results = run_checked(parity_worker, {"mesh": [4]}, TIMEOUT_S, prebuild=prebuild)
    assert all(n > 0 for n in results[0]["zero1"].values()), results[0]["zero1"]


def known_answer_worker(rank, world, cfg):
    import partitioner
    from passes.core import bucket_sizes

    checks = Checks(rank)
    mesh = (4,)
    model, inputs = build("gpt")
    ref = copy.deepcopy(model)
    pins = free_weights("gpt", "dp", mesh)
    # the refresh gathers in buckets of at most this many bytes: many here, the bytes unchanged
    bucket_sizes.REFRESH_BUCKET_BYTES = 64 * 1024
    pm = partitioner.auto_parallelize(model, inputs, mesh=mesh, cluster="h100", recompute="none", pins=pins,
                                      zero=1)
    # the whole weights the source model holds are released; the parallel model trains on
    source = [p for p in model.parameters()]
    freed = pm.free_source_weights()
    checks.true(f"released {freed} B, not the source model's {sum(p.numel() * 4 for p in source)} B",
                freed == sum(p.numel() * p.element_size() for p in source)
                and all(p.untyped_storage().nbytes() == 0 for p in source))
    params = [r for r in pm.plan.records if r["kind"] == "param"]
    checks.true("not every weight is ZeRO-1: " + ", ".join(r["fqn"] for r in params if not r.get("stored")),
                all(r.get("stored") for r in params))
    nbytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=1e-3)
    ref_optimizer = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-3)
    for _ in range(2):  # the second step is counted: its forward gathers what the first stepped
        optimizer.zero_grad(set_to_none=True)
        ref_optimizer.zero_grad(set_to_none=True)
        with CommCounter() as counter:
            with pm.no_sync():
                loss_of(call(pm, inputs)).backward()
            loss_of(call(pm, inputs)).backward()
        for _micro in range(2):
            loss_of(call(ref, inputs)).backward()
        check_grads_by_alias(pm.full_grads(), ref, checks)
        optimizer.step()
        ref_optimizer.step()
    counted = counter.as_dict()
    checks.true(f"reduce-scatters {counted.get('reduce_scatter')} != the parameters' {nbytes} B",
                counted.get("reduce_scatter") == {"a0": float(nbytes)})
    checks.true(f"all-gathers {counted.get('all_gather')} != the parameters' {nbytes} B",
                counted.get("all_gather") == {"a0": float(nbytes)})
    checks.true(f"gradient syncs other than one reduce-scatter: {counter.grad_sync_dict()}",
                counter.grad_sync_dict() == {"reduce_scatter": {"a0": float(nbytes)}})
    calls = {k: dict(v) for k, v in counter.grad_sync_calls.items()}
    checks.true(f"the reduce-scatters are not one flat collective: {calls}", calls == {"reduce_scatter": {"a0": 1}})
    est = pm.plan.estimate().comm_bytes
    checks.true(f"estimate {est} is not one reduce-scatter and one all-gather of the parameters",
                est.get("reduce_scatter") == {"a0": float(nbytes)} and est.get("all_gather") == {"a0": float(nbytes)})
    state = pm.full_state_dict()
    for name, p in ref.named_parameters(remove_duplicate=False):
        checks.close(f"parameter {name} after 2 accumulated steps", state[name], p.detach())
    # loading weights into the shards (a checkpoint) refreshes the compute copies before the next forward
    start, _ = build("gpt")
    pm.load_full_state_dict(start.state_dict())
    checks.close("loss after loading the starting weights", loss_of(call(pm, inputs)).detach(),
                 loss_of(call(start, inputs)).detach())
    try:  # other input shapes would need the source model: refused, saying why
        pm(inputs[0][:4], inputs[1][:4])
        checks.true("a new input shape ran after free_source_weights", False)
    except ValueError as e:
        checks.true(f"the refusal does not name free_source_weights: {e}", "free_source_weights" in str(e))
    return {"rank": rank, "failures": checks.failures}


def test_budget_below_replicated_state_picks_zero1(fake_process_group):
    """The budget: the estimated peak of the same data-parallel plan with every weight ZeRO-1,
    below the replicated plan's by most of the optimizer state."""
    import partitioner
    from partitioner.plan_table import weight_storage

    fake_process_group(4)
    model, inputs = build("gpt")
    pins = free_weights("gpt", "dp", (4,))
    kw = dict(mesh_shape=(4,), cluster="h100", recompute="none", pins=pins)
    replicated = partitioner.plan(model, inputs, **kw).estimate()
    assert replicated.comm_bytes.keys() == {"all_reduce"}
    zero1 = partitioner.plan(model, inputs, zero=1, **kw).estimate()
    budget = int(zero1.memory_bytes)
    # ZeRO-1 keeps the parameters and gradients whole: it saves 3/4 of Adam's state, less the shard
    # and its gradient (1/4 of the parameters' bytes each); the peaks (walked through backward, the
    # gradient buckets' buffers with them) differ by at least that much
    state = replicated.memory.optimizer_state
    saved = 3 / 4 * state - 2 / 4 * replicated.memory.parameters
    assert zero1.memory.state == replicated.memory.state - saved
    assert budget <= replicated.memory_bytes - saved
    # one byte short of the replicated plan: some weights are ZeRO-1, none stored otherwise
    short = partitioner.plan(model, inputs, memory_budget=int(replicated.memory_bytes) - 1, **kw)
    assert set(weight_storage(short).values()) == {"replicated", "zero1"}
    # at the all-ZeRO-1 plan's peak, zero="auto" may mix storages (the ILP's memory row bounds the
    # walked peak from above, so the budgeted solve sees less room than the peak leaves); zero=1
    # stores every weight ZeRO-1
    mixed = partitioner.plan(model, inputs, memory_budget=budget, **kw)
    assert "zero1" in set(weight_storage(mixed).values()) and mixed.estimate().memory_bytes <= budget
    auto = partitioner.plan(model, inputs, zero=1, **kw)
    assert set(weight_storage(auto).values()) == {"zero1"}
    est = auto.estimate()  # no gathers in forward; the optimizer steps a quarter of every weight
    # the same bytes (reduce-scatter + all-gather = all-reduce), in two flat calls where the
    # replicated plan's gradient bucket is one: one more call's latency terms
    # (passes/plan/collective_calls.py), nothing else
    others = replicated.comm_calls["all_reduce"]["a0"] - 1  # the loss's, not the gradients'
    assert est.comm_calls == {"all_reduce": {"a0": others}, "reduce_scatter": {"a0": 1}, "all_gather": {"a0": 1}}
    # 2 x (overhead + 3 ring steps) against overhead + 6 ring steps on 4 ranks: one more overhead
    overhead = partitioner.get_cluster("h100").collective_overhead_s
    assert est.flat_latency_s - replicated.flat_latency_s == pytest.approx(overhead, rel=1e-9)
    assert est.compute_s + est.comm_s - est.flat_latency_s == pytest.approx(
        replicated.compute_s + replicated.comm_s - replicated.flat_latency_s, rel=1e-3
    )
    assert est.optimizer_s == pytest.approx(replicated.optimizer_s / 4, rel=1e-9)
    assert "ZeRO-1 (used whole, optimizer state sharded" in auto.summary()
    chosen = [line for line in auto.explain("lm_head.weight").splitlines() if line.lstrip().startswith("->")]
    assert len(chosen) == 1 and chosen[0].endswith("ZeRO-1 [S(0)]"), chosen
    import torch.distributed as dist

    dist.destroy_process_group()
    run_checked(known_answer_worker, {"mesh": [4]}, TIMEOUT_S, prebuild=("gpt", MODELS["gpt"]["factory"]))
