"""A contraction's forward, backward and weight pass, timed as a training step runs them (step 2
of :mod:`partitioner.calibration`).

The forward's matmul samples time ``torch.mm`` of two contiguous operands, the same operands in
every call (they stay in the core's cache) and the result dropped at once. A training step's
forward of a linear layer runs ``F.linear(x, W, b)`` with inputs that require grad: the product,
the bias added into it, autograd's node recording what backward needs; its weight and input
come from memory (the step has streamed other layers' weights and activations through the cache
since), and its output is kept (autograd and the next op read it), so each call writes fresh
memory. Priced as the bare ``mm``, the forward of the demo GPT's linears ran 1.05-1.8x their
price on the 2-core CPU (a whole forward action 1.3x). A training step's
backward of a linear layer ``y = x @ W^T + b`` runs other work: the input gradient ``dy @ W``, the
weight gradient ``dy^T @ x`` (a transposed operand and a reduction over every token into a small
output, which a BLAS runs at another rate than the forward's product of the same FLOPs per
byte), the bias gradient's sum over the tokens, the gradients stored into ``.grad``, and
autograd's own work around each. Priced as the forward's product at the forward's rate, the
backward of the demo GPT's linears ran up to 2.2x their price on the 2-core CPU and the
zero-bubble weight pass up to 3.3x, the narrow and small shapes the furthest off.

So every matmul shape ``m x k x n`` is also timed as the runtime runs it: ``F.linear(x, W, b)``
with ``x`` (``m x k``), ``W`` (``n x k``) and ``b`` requiring grad:

* ``forward_s``: the forward, each call on the next of as many distinct ``(x, W, b)`` as fill
  :data:`~partitioner.calibration.timing.COLD_BYTES` (more than a core's own cache holds), its
  output kept until the sets come round again (:func:`~partitioner.calibration.timing.cold_calls`);

and from the output gradient, on one set's graph, kept between calls (``retain_graph``: a loop
times the backward alone, no forward):

* ``backward_s``: ``autograd.backward(y, dy)``: both products, the bias sum, every ``.grad``
  stored fresh (as a step's first microbatch stores it; the sum into ``.grad`` of later
  microbatches is priced on its own, :func:`passes.plan.cost_model.grad_accumulate_time`);
* ``weight_s``: ``autograd.backward(y, dy, inputs=[W, b])``: the weight and bias gradients only,
  what the pipeline's ``W`` pass calls per op that meets a parameter
  (:meth:`runtime.pipeline.StageProgram.weight_meeting_points`).

The backward's samples stay on one set: cycled over sets as the forward is, the weight pass read
1.05-2x slower and the whole backward about the same (under other jobs' load), which priced a
split stage's ``I`` (its backward less ``W``) at half its former price, and the 4-stage GPT d256
pipeline's ``I`` then ran 2.1x its price where it had run 0.94-0.99x.

:func:`partitioner.calibration.fit.pass_curves` turns the samples into the curves the cost model
prices a contraction's forward, backward and weight products with (``ClusterSpec.forward_curve``,
``ClusterSpec.backward_curve``, ``ClusterSpec.weight_curve``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from partitioner.calibration.timing import cold_calls, cold_sets, timed

logger = logging.getLogger(__name__)


def matmul_shapes(sizes: dict) -> list:
    """The ``(m, k, n)`` products the calibration times: ``n x n x n`` squares and the narrow shapes."""
    return [(n, n, n) for n in sizes["matmul"]] + [tuple(s) for s in sizes.get("matmul_shapes", ())]


def contraction_pass_samples(sizes: dict, sync=None, say: Callable[[str], None] | None = None) -> list:
    """Per dtype and matmul shape, a linear layer's forward, backward and weight pass (see the module
    docstring): ``{"dtype", "m", "k", "n", "flops", "bytes", "forward_s", "backward_s", "weight_s"}``, ``flops``
    and ``bytes`` those of the forward's product, as the matmul samples count them (``sync``: see
    :func:`partitioner.calibration.timing.timed`)."""
    import torch
    import torch.nn.functional as F

    say = say or (lambda message: None)
    out = []
    for dtype_name in sizes["dtypes"]:
        dtype = getattr(torch, dtype_name)
        for m, k, n in matmul_shapes(sizes):
            flops, nbytes = 2 * m * k * n, (m * k + k * n + m * n) * torch.finfo(dtype).bits // 8

            def linear_graph(m=m, k=k, n=n, dtype=dtype):
                x, w, b = (torch.randn(*shape).to(dtype).requires_grad_() for shape in ((m, k), (n, k), (n,)))
                return x, w, b, F.linear(x, w, b), torch.randn(m, n).to(dtype)

            graphs = cold_sets(linear_graph, nbytes)
            loops = {  # the backward's on one graph, in the core's cache (see the module docstring)
                "forward_s": cold_calls([g[:3] for g in graphs], F.linear),
                "backward_s": functools.partial(_backward, *graphs[0], weights_only=False),
                "weight_s": functools.partial(_backward, *graphs[0], weights_only=True),
            }
            times = {key: timed(loop, sizes["seconds"], sizes["trials"], sync) for key, loop in loops.items()}
            out.append({"dtype": dtype_name, "m": m, "k": k, "n": n, "flops": flops, "bytes": nbytes} | times)
            say(
                f"linear {dtype_name} {m}x{k} @ {k}x{n}: forward {times['forward_s'] * 1e6:.1f} us, "
                f"backward {times['backward_s'] * 1e6:.1f} us, weight pass {times['weight_s'] * 1e6:.1f} us"
            )
    return out


def _backward(x, w, b, y, dy, *, weights_only: bool) -> tuple:
    """The backward of ``y = F.linear(x, w, b)`` from ``dy`` (the weight and bias gradients only
    with ``weights_only``: the ``W`` pass), its graph kept for the next call; returns the
    gradients, taken off the tensors (the next call stores fresh ones)."""
    import torch

    torch.autograd.backward(y, dy, inputs=[w, b] if weights_only else None, retain_graph=True)
    grads = (x.grad, w.grad, b.grad)
    x.grad = w.grad = b.grad = None
    return grads
