"""A model whose kernels take fixed, known times: the pipeline executor measured without CPU noise.

On a shared CPU a layer's time drifts by 10-30% from one second to the next, and a pipeline
turns every such drift into waiting on the other ranks, so the idle fraction of a real model
measures the machine as much as the executor. Here each layer is one custom op,
``partita_bench::timed_scale(x, w)`` = ``x * w``, that holds its thread for a fixed wall-clock
time: ``forward_ms`` in forward, and in backward ``input_ms`` for the input gradient and
``weight_ms`` for the weight gradient (each only when autograd asks for it, so a zero-bubble
schedule's I and W passes take exactly their share). The wait sleeps and then spins for the
last millisecond, so it ends on time and leaves the CPU to the communication threads
meanwhile, as a GPU kernel would. What the executor itself costs (the interpreter, autograd,
posting and waiting on messages) still runs on the CPU and shows in the timeline.

The op is registered with Partita's rule registry the way a user would declare a custom
kernel: shards like an elementwise product, and its FLOPs are proportional to its forward
time (backward twice that: an input and a weight product), so the pipeline planner balances
stages by the kernels' real times.

``TimedLayers(n_layer, width, forward_ms, input_ms, weight_ms)``: an input scale (a
parameter, like an embedding: every layer's input then needs a gradient, so all layers cost
the same in backward), ``n_layer`` such layers in an ``nn.ModuleList`` (so the pipeline
planner cuts between them) and a mean-square loss.
"""
from __future__ import annotations

import time

import torch
from torch import nn

from passes.rules.base import register
from passes.rules.elementwise import Elementwise

__all__ = ["TimedLayers", "hold"]

_SPIN_S = 1e-3


def hold(seconds: float) -> None:
    """Return ``seconds`` after the call: sleep most of it, spin the rest."""
    end = time.perf_counter() + seconds
    if seconds > _SPIN_S:
        time.sleep(seconds - _SPIN_S)
    while time.perf_counter() < end:
        pass


@torch.library.custom_op("partita_bench::timed_scale", mutates_args=())
def timed_scale(x: torch.Tensor, w: torch.Tensor, forward_ms: float, input_ms: float,
                weight_ms: float) -> torch.Tensor:
    hold(forward_ms / 1e3)
    return x * w


@timed_scale.register_fake
def _(x, w, forward_ms, input_ms, weight_ms):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    x, w, _, ctx.input_ms, ctx.weight_ms = inputs
    ctx.save_for_backward(x, w)


def _wanted(ctx, index: int) -> bool:
    """Whether this backward pass needs input ``index``'s gradient. A custom op's
    ``needs_input_grad`` is fixed at forward time; built-in ops also skip the gradients that a
    ``backward(inputs=...)`` does not ask for, and this asks the engine the same question."""
    node = ctx.next_functions[index][0]
    if not ctx.needs_input_grad[index] or node is None:
        return False
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:   # autograd.grad() on a leaf cannot be asked: it wants what it was given
        return True


def _backward(ctx, grad):
    x, w = ctx.saved_tensors
    gx = gw = None
    if _wanted(ctx, 0):
        hold(ctx.input_ms / 1e3)
        gx = grad * w
    if _wanted(ctx, 1):
        hold(ctx.weight_ms / 1e3)
        gw = (grad * x).sum(dim=0)
    return gx, gw, None, None, None


timed_scale.register_autograd(_backward, setup_context=_setup)


class _TimedScaleRule(Elementwise):
    """``x * w`` with a declared cost: ``forward_ms`` worth of FLOPs (1 GFLOP per ms, nominal)."""

    contraction = True   # backward = input product + weight product, each as long as forward

    def __init__(self):
        super().__init__(partial="one", saves_inputs=True)

    def flops(self, op) -> float:
        return float(op.node.args[2]) * 1e9


register(torch.ops.partita_bench.timed_scale.default)(_TimedScaleRule())


class TimedLayer(nn.Module):
    def __init__(self, width, forward_ms, input_ms, weight_ms):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.ms = (float(forward_ms), float(input_ms), float(weight_ms))

    def forward(self, x):
        return timed_scale(x, self.weight, *self.ms)


class TimedLayers(nn.Module):
    def __init__(self, n_layer=8, width=64, forward_ms=5.0, input_ms=5.0, weight_ms=5.0):
        super().__init__()
        self.input_scale = nn.Parameter(torch.ones(width))
        self.layers = nn.ModuleList(TimedLayer(width, forward_ms, input_ms, weight_ms) for _ in range(n_layer))

    def forward(self, x, target):
        x = x * self.input_scale
        for layer in self.layers:
            x = layer(x)
        return ((x - target) ** 2).mean()
