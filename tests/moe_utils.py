"""What the mixture-of-experts tests share: the tiny HF MoE families, the pins that dispatch
tokens by all-to-all, the router's choices on a batch, and one training step of a parallel model."""

import torch
from parity_utils import call, loss_of

from partitioner import hf_families

BATCH, SEQ = 4, 8


def build(family):
    return hf_families.build(family, batch=BATCH, seq=SEQ)


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
