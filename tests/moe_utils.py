"""What the mixture-of-experts tests share: the tiny HF MoE families, the pins that dispatch
tokens by all-to-all, the router's choices on a batch, a parallel model beside its one-device
reference, and one training step of it."""

import copy
import warnings

import torch
from parity_utils import adam_in_lockstep, call, check_grads_by_alias, loss_of, prebuilt

import partitioner
from partitioner import hf_families
from runtime.collectives import CommCounter

BATCH, SEQ = 4, 8


def build(family, key=None):
    """The tiny ``family`` model and inputs; in a rank forked by ``parity_utils.run_checked`` with
    ``prebuild=`` :func:`built_before_forking` ``(family, key)``, the first call returns the
    parent's, whose capture the rank's ``auto_parallelize`` then reuses."""
    return prebuilt(key or family) or hf_families.build(family, batch=BATCH, seq=SEQ)


def built_before_forking(family, key=None, **options) -> tuple:
    """``run_checked``'s ``prebuild`` entry for :func:`build` ``(family, key)``: built and captured
    in the parent with the capture ``options`` of the ranks' call (``expert_capacity``)."""
    return key or family, lambda: hf_families.build(family, batch=BATCH, seq=SEQ), options


def parallel_beside_one_device(model, inputs, **options) -> tuple:
    """(``model`` parallelised by ``auto_parallelize(model, inputs, **options)``, a copy of it
    taken before, the one-device reference); the cluster is ``"h100"`` unless given, and the
    warnings of ops replicated for want of a rule are silenced."""
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = partitioner.auto_parallelize(model, inputs, **{"cluster": "h100", **options})
    return pm, ref


def routing(ref, inputs) -> list:
    """The router's top-k index of every MoE layer on ``inputs`` (one device), in layer order."""
    seen = []
    hooks = [
        m.register_forward_pre_hook(lambda _m, args: seen.append(args[1].clone()))
        for m in ref.modules()
        if hasattr(m, "gate_up_proj")
    ]
    with torch.no_grad():
        call(ref, inputs)
    for h in hooks:
        h.remove()
    return seen


def step_of(pm, inputs):
    def step():
        loss = loss_of(call(pm, inputs))
        loss.backward()
        return loss

    return step


def dispatch_pins(ndim):
    shard = ["S(0)"] * ndim
    return {"input_ids": shard, "labels": shard, "model.layers.*.mlp.experts": shard}


def first_step_like_one_device(pm, ref, inputs, checks) -> dict:
    """One forward + backward of the parallel ``pm`` (its collectives counted) and of ``ref`` on
    one device; the loss, the router's auxiliary loss and every gradient compared. Returns the
    counted bytes (``CommCounter.as_dict()``)."""
    with CommCounter() as counter:
        out = call(pm, inputs)
        loss_of(out).backward()
    ref_out = call(ref, inputs)
    loss_of(ref_out).backward()
    checks.close("loss", loss_of(out).detach(), loss_of(ref_out).detach())
    checks.close("router aux loss", out.aux_loss.detach(), ref_out.aux_loss.detach())
    check_grads_by_alias(pm.full_grads(), ref, checks)
    return counter.as_dict()


def adam_steps_like_one_device(pm, ref, inputs, steps, checks) -> None:
    """``steps`` AdamW steps of ``pm`` and ``ref`` side by side (the first on the gradients both
    hold), then every parameter compared."""
    adam_in_lockstep(pm.parameters(), ref, inputs, steps, step_of(pm, inputs), checks)
    state = pm.full_state_dict()
    for name, p in ref.named_parameters():
        checks.close(f"parameter {name} after {steps} AdamW steps", state[name], p.detach())
