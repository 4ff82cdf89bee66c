"""What the configuration search knows of the model and its inputs (step 1 of
:mod:`partitioner.search`): the batch and sequence of the example inputs, the inputs at another
batch size, and :class:`ModelFacts` read off one analysed capture at the global batch (parameter
elements and shapes, forward FLOPs, the repeated layers: their count, per layer what backward
keeps and the bytes handed to the next layer)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from partitioner import expert_degrees
from passes.analysis.analyze import info
from passes.capture.blocks import find_blocks

logger = logging.getLogger(__name__)


def check_devices(devices) -> int:
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be a positive int (the number of devices to plan for), got {devices!r}")
    return devices


def divisors(n: int) -> list:
    return [k for k in range(1, n + 1) if n % k == 0]


def batch_of(example_inputs) -> int:
    values = example_inputs.values() if isinstance(example_inputs, dict) else example_inputs
    for x in values:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return int(x.shape[0])
    raise ValueError("the example inputs have no tensor with a batch dimension: pass global_batch= and batched inputs")


def seq_of(example_inputs, batch: int) -> int:
    """The sequence length: dim 1 of the first batched input with two dims or more (0 if none)."""
    values = example_inputs.values() if isinstance(example_inputs, dict) else example_inputs
    for x in values:
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[0] == batch:
            return int(x.shape[1])
    return 0


def at_batch(example_inputs, batch: int, size: int):
    """The example inputs with every tensor whose first dim is ``batch`` cut or repeated to ``size``."""

    def resize(x):
        if not (isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch) or size == batch:
            return x
        if size < batch:
            return x[:size]
        reps = -(-size // batch)
        return x.repeat((reps,) + (1,) * (x.dim() - 1))[:size]

    if isinstance(example_inputs, dict):
        return {k: resize(v) for k, v in example_inputs.items()}
    return tuple(resize(v) for v in example_inputs)


def kept_bytes(node) -> float:
    """Bytes backward keeps because of ``node``: its storage when some op saves it, plus the
    op's own saved buffers (a norm's statistics, attention's weights or log-sum-exp)."""
    own = info(node).saves
    return (bytes_of(node) if info(node).saved else 0.0) + (own.extra_bytes if own is not None else 0.0)


def bytes_of(node) -> float:
    shape, dtype = info(node).shape, info(node).dtype
    if shape is None or dtype is None:
        return 0.0
    return float(math.prod(shape)) * torch.empty((), dtype=dtype).element_size()


@dataclass
class ModelFacts:
    """What the bounds need, per sample of the batch (from one analysed capture)."""

    params: int
    fwd_flops_per_sample: float
    layers: int
    layer_saved_per_sample: float
    """Bytes backward keeps for one layer."""
    boundary_per_sample: float
    """Bytes of the value one layer hands the next (what a checkpoint keeps, what a stage sends)."""
    other_saved_per_sample: float
    layer_params: int
    param_shapes: dict = field(default_factory=dict)
    """Parameter shape -> how many parameters have it (tied weights once)."""
    layer_flops_per_sample: float = 0.0
    pre_flops_per_sample: float = 0.0
    """Forward FLOPs before the first layer (embeddings) and after the last (head, loss)."""
    post_flops_per_sample: float = 0.0
    experts: expert_degrees.ExpertFacts = field(default_factory=expert_degrees.ExpertFacts)
    """The mixture-of-experts layers (:mod:`partitioner.expert_degrees`)."""

    @classmethod
    def of(cls, model, cap, batch: int) -> ModelFacts:
        unique = {id(p): p for p in model.parameters()}.values()
        params = sum(p.numel() for p in unique)
        shapes: dict = {}
        for p in unique:
            shapes[tuple(p.shape)] = shapes.get(tuple(p.shape), 0) + 1
        ops = [n for n in cap.graph.nodes if n.op == "call_function" and info(n).kind == "op"]
        flops = sum(info(n).flops for n in ops)
        saved_all = sum(kept_bytes(n) for n in ops)
        blocks = find_blocks(cap.graph)
        layers = layer_saved = boundary = layer_flops = pre = 0.0
        layer_params = 0
        if blocks.groups:
            group = max(blocks.groups, key=lambda g: len(g.indices))
            layers = len(group.indices)
            first = group.members[0]
            layer_saved = sum(kept_bytes(n) for n in first if n.op == "call_function" and info(n).kind == "op")
            order = {n: i for i, n in enumerate(cap.graph.nodes)}
            last_op = max((n for n in first if n.op == "call_function"), key=order.__getitem__)
            boundary = bytes_of(last_op)
            layer_params = sum(
                math.prod(info(n).shape or ()) for n in first if n.op == "placeholder" and info(n).kind == "param"
            )
            layer_flops = sum(info(n).flops for n in first if n.op == "call_function")
            start = min(order[n] for n in first if n.op == "call_function")
            in_group = {n for members in group.members for n in members}
            pre = sum(info(n).flops for n in ops if order[n] < start and n not in in_group)
        return cls(
            params=params,
            fwd_flops_per_sample=flops / batch,
            layers=int(layers),
            layer_saved_per_sample=layer_saved / batch,
            boundary_per_sample=boundary / batch,
            other_saved_per_sample=max(0.0, saved_all - layers * layer_saved) / batch,
            layer_params=int(layer_params),
            param_shapes=shapes,
            layer_flops_per_sample=layer_flops / batch,
            pre_flops_per_sample=pre / batch,
            post_flops_per_sample=max(0.0, flops - pre - layers * layer_flops) / batch,
            experts=expert_degrees.ExpertFacts.of(cap, batch),
        )
