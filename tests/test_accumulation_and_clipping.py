"""Gradient accumulation with ``no_sync``, ``partitioner.clip_grad_norm_``, and a user's whole
training loop (a ``torch.optim`` optimizer and LR scheduler) on parallel models.

Parity (tier 3): one forked gloo run per config; every rank checks, fp32 with
``torch.testing.assert_close`` defaults, against a deep copy of the model on one device that
runs the same loop on the same micro-batches.

* Accumulation: ``K`` micro-steps of fresh data, each loss divided by ``K`` on both sides, all
  but the last inside ``pm.no_sync()``. Communication, counted by the runtime
  (``CommCounter``): the micro-steps inside ``no_sync`` sync no gradient; the last one sends
  exactly what one plain step's gradient syncs send (per kind and mesh axis); every micro-step
  sends the other collectives (forward gathers, Megatron's activation all-reduces) of one plain
  step. Then every gradient equals the single-device model's accumulated one, and so do the
  parameters after an AdamW step. Plans: pure data parallel (bucketed all-reduces), a memory
  budget that makes the solver store weights sharded and gather them for use (``zero=2``; their
  gradient syncs are reduce-scatters), and DP x Megatron TP on (2, 2). With data parallel, a micro-step
  of another batch size (another lowered program) inside ``no_sync`` is synced too.
* Clipping (DP x TP, and a 2-stage pipeline of GPT-2 whose tied ``wte`` / ``lm_head`` live on
  both stages): the norms of order 2 and inf equal ``torch.nn.utils.clip_grad_norm_``'s on
  one device, the clipped gradients are equal, and so are the parameters after AdamW steps
  with clipping.
* A user's loop on DP x TP: SGD with momentum, a ``StepLR`` schedule, accumulation over two
  micro-steps and clipping, three steps; the parameters equal the single-device run's.

Configuration errors of ``clip_grad_norm_`` are checked in this process.
"""

import contextlib
import copy
import math

import pytest
import torch
from parity_utils import (
    ADAM_EPS,
    LR,
    MODELS,
    Checks,
    build,
    call,
    check_grads_by_alias,
    loss_of,
    nested_approx_equal,
    parity_case,
    pins_for,
    prebuilt,
    run_checked,
)

from runtime.collectives import CommCounter

TIMEOUT_S = 240
K = 3            # micro-steps per optimizer step
BUDGET = 0.75    # of the replicated fp32 Adam state: the solver must store some weights sharded


def fresh_batch(inputs, seed):
    """A batch of the example's shapes and dtypes with other values (integers in the example's range)."""
    generator = torch.Generator().manual_seed(seed)

    def new(x):
        if not isinstance(x, torch.Tensor):
            return x
        if x.is_floating_point():
            return torch.randn(x.shape, generator=generator, dtype=x.dtype)
        return torch.randint(0, int(x.max()) + 1, x.shape, generator=generator, dtype=x.dtype)

    return {k: new(v) for k, v in inputs.items()} if isinstance(inputs, dict) else tuple(new(x) for x in inputs)


def _without(total: dict, part: dict) -> dict:
    """``{kind: {axis: bytes}}`` less ``part``; what is left of each entry, zeros dropped."""
    out = {}
    for kind, axes in total.items():
        for axis, nbytes in axes.items():
            rest = nbytes - part.get(kind, {}).get(axis, 0.0)
            if rest > 0.5:
                out.setdefault(kind, {})[axis] = rest
    return out


def _parallel(cfg):
    import partitioner

    model, inputs = build(cfg["model"])
    ref = copy.deepcopy(model)
    mesh = tuple(cfg["mesh"])
    budget = None
    if cfg.get("budget_fraction"):
        n_params = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
        budget = int(cfg["budget_fraction"] * 16 * n_params)
    pm = partitioner.auto_parallelize(model, inputs, mesh=mesh, pins=pins_for(cfg["model"], cfg["plan"], mesh),
                                      cluster="h100", memory_budget=budget, zero=cfg.get("zero", "auto"))
    return pm, ref, inputs


def _check_params(pm, ref, checks, what):
    state = pm.full_state_dict()
    for name, p in ref.named_parameters(remove_duplicate=False):
        checks.close(f"parameter {name} after {what}", state[name], p.detach())


def _check_clipping(model, ref, checks, what):
    """Norms of order inf and 2 against torch's on ``ref``; clip both at half the 2-norm."""
    import partitioner

    norm = partitioner.clip_grad_norm_(model, 1e9, norm_type=math.inf)   # too large to clip: the norm alone
    checks.close(f"{what}: inf-norm", norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9, norm_type=math.inf))
    max_norm = 0.5 * torch.nn.utils.get_total_norm([p.grad for p in ref.parameters() if p.grad is not None]).item()
    norm = partitioner.clip_grad_norm_(model, max_norm)
    checks.close(f"{what}: 2-norm", norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm))
    checks.true(f"{what}: the 2-norm {norm} is not above max_norm {max_norm}: nothing was clipped", norm > max_norm)


def accumulation_worker(rank, world, cfg):

    checks = Checks(rank)
    pm, ref, inputs = _parallel(cfg)
    micro = [fresh_batch(inputs, seed) for seed in range(K)]
    result = {"rank": rank, "failures": checks.failures}

    # what one plain step (no accumulation) sends: its gradient syncs and everything else
    with CommCounter() as plain:
        loss_of(call(pm, micro[0])).backward()
    pm.zero_grad(set_to_none=True)
    one_sync = plain.grad_sync_dict()
    one_rest = _without(plain.as_dict(), one_sync)
    result["grad_sync"], result["other"] = one_sync, one_rest

    for i, batch in enumerate(micro):
        last = i == K - 1
        with CommCounter() as counter, contextlib.nullcontext() if last else pm.no_sync():
            loss = loss_of(call(pm, batch)) / K
            loss.backward()
        ref_loss = loss_of(call(ref, batch)) / K
        ref_loss.backward()
        checks.close(f"loss of micro-step {i}", loss.detach(), ref_loss.detach())
        synced = counter.grad_sync_dict()
        if last:
            diffs = nested_approx_equal(synced, one_sync)
            checks.true(f"the synced micro-step's gradient syncs differ from one plain step's: {diffs}", not diffs)
        else:
            checks.true(f"micro-step {i} inside no_sync synced gradients: {synced}", not synced)
        diffs = nested_approx_equal(_without(counter.as_dict(), synced), one_rest)
        checks.true(f"micro-step {i}: the other collectives differ from one plain step's: {diffs}", not diffs)
    check_grads_by_alias(pm.full_grads(), ref, checks)

    if cfg.get("clip"):
        _check_clipping(pm, ref, checks, "accumulated gradients")
        check_grads_by_alias(pm.full_grads(), ref, checks)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=ADAM_EPS)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=ADAM_EPS)
    opt.step()
    ref_opt.step()
    _check_params(pm, ref, checks, "an AdamW step" + (" with clipping" if cfg.get("clip") else ""))
    if cfg.get("loop"):
        _users_loop(pm, ref, inputs, checks, result)
    if cfg.get("other_shape"):
        _accumulate_over_shapes(pm, ref, inputs, checks)
    return result


def _accumulate_over_shapes(pm, ref, inputs, checks):
    """A micro-step of half the batch (another lowered program) inside ``no_sync``, then a
    synced one of the whole batch: the held gradients of the first program's edges, which
    the synced backward does not pass through, are synced at its end."""
    pm.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    half = fresh_batch(inputs, 50)
    half = {k: v[: len(v) // 2] for k, v in half.items()} if isinstance(half, dict) else tuple(x[: len(x) // 2] for x in half)
    for i, batch in enumerate((half, fresh_batch(inputs, 51))):
        with pm.no_sync() if i == 0 else contextlib.nullcontext():
            (loss_of(call(pm, batch)) / 2).backward()
        (loss_of(call(ref, batch)) / 2).backward()
    checks.true("the half batch did not run another program", len(pm.variants) > 1)
    check_grads_by_alias(pm.full_grads(), ref, checks)


def _users_loop(pm, ref, inputs, checks, result, steps=3, micro_steps=2, max_norm=0.5):
    """The loop a user writes: SGD with momentum, StepLR, accumulation and clipping."""
    import partitioner

    sides = []
    for model, clip in ((pm, partitioner.clip_grad_norm_), (ref, torch.nn.utils.clip_grad_norm_)):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sides.append((model, clip, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)))
    norms = []
    for step in range(steps):
        losses, step_norms = [], []
        for model, clip, opt, scheduler in sides:
            opt.zero_grad()
            for i in range(micro_steps):
                batch = fresh_batch(inputs, 100 + step * micro_steps + i)
                last = i == micro_steps - 1
                no_sync = model.no_sync if model is pm and not last else contextlib.nullcontext
                with no_sync():
                    loss = loss_of(call(model, batch)) / micro_steps
                    loss.backward()
                losses.append(loss.detach())
            step_norms.append(clip(model.parameters() if model is ref else model, max_norm))
            opt.step()
            scheduler.step()
        for i in range(micro_steps):
            checks.close(f"user's loop: loss of step {step} micro-step {i}", losses[i], losses[micro_steps + i])
        checks.close(f"user's loop: gradient norm at step {step}", step_norms[0], step_norms[1])
        norms.append(step_norms[1].item())
    checks.true(f"user's loop: no step was clipped (norms {norms}, max_norm {max_norm})", max(norms) > max_norm)
    checks.true("user's loop: the learning rate was not scheduled",
                sides[0][2].param_groups[0]["lr"] == pytest.approx(0.05 * 0.5 ** steps))
    _check_params(pm, ref, checks, f"{steps} steps of the user's loop")
    result["loop_norms"] = norms


ACCUMULATION = [
    # kinds: the collectives one step's gradient syncs must use, {kind: mesh axes}
    parity_case("gpt", (2,), "dp", kinds={"all_reduce": {"a0"}}, other_shape=True),
    # ZeRO-2 (ZeRO-1 weights gather once per step, not per micro-step: tests/test_zero1.py)
    parity_case("gpt", (4,), "free", kinds={"reduce_scatter": {"a0"}}, budget_fraction=BUDGET, zero=2),
    parity_case("gpt", (2, 2), "dp_tp", kinds={"all_reduce": {"a0"}}, clip=True, loop=True),
]


@pytest.mark.parametrize("cfg", ACCUMULATION)
def test_accumulation_syncs_once_per_step(cfg):
    # the worker builds through _parallel: its model built and captured before forking, named here
    results = run_checked(accumulation_worker, cfg, TIMEOUT_S, prebuild=(cfg["model"], MODELS[cfg["model"]]["factory"]))
    r0 = results[0]
    for kind, axes in cfg["kinds"].items():   # the plan is of the kind the config is for
        assert axes <= set(r0["grad_sync"].get(kind, {})), r0["grad_sync"]
    if cfg["plan"] == "dp_tp":                # Megatron's activation all-reduces ran in every micro-step
        assert "a1" in r0["other"].get("all_reduce", {}), r0["other"]


# ------------------------------------------------------------------------------------ pipeline


CLIP_PIPELINE = {"degree": 2, "schedule": "1f1b", "microbatches": 4}


def _gpt2():
    from partitioner import models

    return models.hf_gpt2(batch=8, seq=16, n_layer=2, attn="eager")


def pipeline_clip_worker(rank, world, cfg):
    import partitioner

    checks = Checks(rank)
    model, inputs = prebuilt("gpt2") or _gpt2()  # the parent's, its stages captured there
    ref = copy.deepcopy(model)
    runner = partitioner.auto_parallelize(model, inputs, mesh=(2,), cluster="h100", pipeline=CLIP_PIPELINE)
    checks.true("GPT-2's tied wte / lm_head is not shared by the two stages", bool(runner.tied))
    opt = torch.optim.AdamW(runner.parameters(), lr=LR, eps=ADAM_EPS)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=ADAM_EPS)
    key_of = {}
    for step in range(cfg["steps"]):
        batch = inputs if step == 0 else fresh_batch(inputs, step)
        loss = runner.train_step(batch)
        ref_loss = loss_of(call(ref, batch))
        ref_loss.backward()
        checks.close(f"loss at step {step}", loss, ref_loss.detach())
        _check_clipping(runner, ref, checks, f"pipeline step {step}")
        key_of = check_grads_by_alias(runner.full_grads(), ref, checks, one_name=True)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    state = runner.full_state_dict()
    for name, p in ref.named_parameters():
        if name in key_of:
            checks.close(f"parameter {name} after {cfg['steps']} AdamW steps with clipping", state[key_of[name]],
                         p.detach())
    return {"rank": rank, "failures": checks.failures}


def test_pipeline_clipping_equals_single_device():
    run_checked(pipeline_clip_worker, {"mesh": (2,), "steps": 2}, TIMEOUT_S,
                prebuild=("gpt2", _gpt2, {"pipeline": CLIP_PIPELINE}))


# ---------------------------------------------------------------------------- configuration errors


def test_clip_grad_norm_refuses_what_it_cannot_clip():
    import partitioner

    with pytest.raises(TypeError, match=r"clip_grad_norm_\(model=\.\.\.\).*Linear.*torch.nn.utils.clip_grad_norm_"):
        partitioner.clip_grad_norm_(torch.nn.Linear(2, 2), 1.0)
    with pytest.raises(ValueError, match="norm_type must be a positive number or inf; got -1"):
        partitioner.clip_grad_norm_(torch.nn.Linear(2, 2), 1.0, norm_type=-1)
