"""A contraction's backward and weight pass, timed through autograd (step 2 of
:mod:`partitioner.calibration`).

The forward's matmul samples time ``torch.mm`` of two contiguous operands. A training step's
backward of a linear layer ``y = x @ W^T + b`` runs other work: the input gradient ``dy @ W``, the
weight gradient ``dy^T @ x`` (a transposed operand and a reduction over every token into a small
output, which a BLAS runs at another rate than the forward's product of the same FLOPs per
byte), the bias gradient's sum over the tokens, the gradients stored into ``.grad``, and
autograd's own work around each. Priced as the forward's product at the forward's rate, the
backward of the demo GPT's linears ran up to 2.2x their price on the 2-core CPU and the
zero-bubble weight pass up to 3.3x, the narrow and small shapes the furthest off.

So every matmul shape ``m x k x n`` is also timed as the runtime runs it: ``F.linear(x, W, b)``
with ``x`` (``m x k``), ``W`` (``n x k``) and ``b`` requiring grad, and from the output gradient

* ``backward_s``: ``autograd.backward(y, dy)``: both products, the bias sum, every ``.grad``
  stored fresh (as a step's first microbatch stores it; the sum into ``.grad`` of later
  microbatches is priced on its own, :func:`passes.plan.cost_model.grad_accumulate_time`);
* ``weight_s``: ``autograd.backward(y, dy, inputs=[W, b])``: the weight and bias gradients only,
  what the pipeline's ``W`` pass calls per op that meets a parameter
  (:meth:`runtime.pipeline.StageProgram.weight_meeting_points`).

The graph is kept between calls (``retain_graph``), so a loop times the backward alone, no
forward. :func:`partitioner.calibration.fit.pass_curves` turns the samples into the curves the cost
model prices a contraction's backward and weight products with (``ClusterSpec.backward_curve``,
``ClusterSpec.weight_curve``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from partitioner.calibration.timing import timed

logger = logging.getLogger(__name__)


def matmul_shapes(sizes: dict) -> list:
    """The ``(m, k, n)`` products the calibration times: ``n x n x n`` squares and the narrow shapes."""
    return [(n, n, n) for n in sizes["matmul"]] + [tuple(s) for s in sizes.get("matmul_shapes", ())]


def contraction_pass_samples(sizes: dict, sync=None, say: Callable[[str], None] | None = None) -> list:
    """Per dtype and matmul shape, a linear layer's backward and weight pass (see the module
    docstring): ``{"dtype", "m", "k", "n", "flops", "bytes", "backward_s", "weight_s"}``, ``flops``
    and ``bytes`` those of the forward's product, as the matmul samples count them (``sync``: see
    :func:`partitioner.calibration.timing.timed`)."""
    import torch
    import torch.nn.functional as F

    say = say or (lambda message: None)
    out = []
    for dtype_name in sizes["dtypes"]:
        dtype = getattr(torch, dtype_name)
        for m, k, n in matmul_shapes(sizes):
            x, w, b = (torch.randn(*shape).to(dtype).requires_grad_() for shape in ((m, k), (n, k), (n,)))
            y = F.linear(x, w, b)
            dy = torch.randn(m, n).to(dtype)

            def backward(inputs, x=x, w=w, b=b, y=y, dy=dy):
                x.grad = w.grad = b.grad = None
                torch.autograd.backward(y, dy, inputs=inputs, retain_graph=True)

            backward_s = timed(functools.partial(backward, None), sizes["seconds"], sizes["trials"], sync)
            weight_s = timed(functools.partial(backward, [w, b]), sizes["seconds"], sizes["trials"], sync)
            flops, nbytes = 2 * m * k * n, (m * k + k * n + m * n) * x.element_size()
            out.append(
                {"dtype": dtype_name, "m": m, "k": k, "n": n, "flops": flops, "bytes": nbytes}
                | {"backward_s": backward_s, "weight_s": weight_s}
            )
            say(
                f"linear {dtype_name} {m}x{k} @ {k}x{n}: backward {backward_s * 1e6:.1f} us, "
                f"weight pass {weight_s * 1e6:.1f} us"
            )
    return out
