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
  :data:`~partitioner.calibration.timing.COLD_BYTES` with their outputs (more than a core's own
  cache holds), the outputs kept until the sets come round again;

and from the output gradient

* ``backward_s``: ``autograd.backward(y, dy)``: both products, the bias sum, every ``.grad``
  stored fresh (as a step's first microbatch stores it; the sum into ``.grad`` of later
  microbatches is priced on its own, :func:`passes.plan.cost_model.grad_accumulate_time`);
* ``weight_s``: ``autograd.backward(y, dy, inputs=[W, b])``: the weight and bias gradients only,
  what the pipeline's ``W`` pass calls per op that meets a parameter
  (:meth:`runtime.pipeline.StageProgram.weight_meeting_points`).

The graph is kept between calls (``retain_graph``), so a loop times the backward alone, no
forward. :func:`partitioner.calibration.fit.pass_curves` turns the samples into the curves the cost
model prices a contraction's forward, backward and weight products with
(``ClusterSpec.forward_curve``, ``ClusterSpec.backward_curve``, ``ClusterSpec.weight_curve``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from partitioner.calibration.timing import cold_calls, timed

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
            x, w, b = (torch.randn(*shape).to(dtype).requires_grad_() for shape in ((m, k), (n, k), (n,)))
            y = F.linear(x, w, b)
            dy = torch.randn(m, n).to(dtype)

            def backward(inputs, x=x, w=w, b=b, y=y, dy=dy):
                x.grad = w.grad = b.grad = None
                torch.autograd.backward(y, dy, inputs=inputs, retain_graph=True)

            flops, nbytes = 2 * m * k * n, (m * k + k * n + m * n) * x.element_size()
            forward_s = timed(_cold_forward(m, k, n, dtype, nbytes), sizes["seconds"], sizes["trials"], sync)
            backward_s = timed(functools.partial(backward, None), sizes["seconds"], sizes["trials"], sync)
            weight_s = timed(functools.partial(backward, [w, b]), sizes["seconds"], sizes["trials"], sync)
            out.append(
                {"dtype": dtype_name, "m": m, "k": k, "n": n, "flops": flops, "bytes": nbytes}
                | {"forward_s": forward_s, "backward_s": backward_s, "weight_s": weight_s}
            )
            say(
                f"linear {dtype_name} {m}x{k} @ {k}x{n}: forward {forward_s * 1e6:.1f} us, "
                f"backward {backward_s * 1e6:.1f} us, weight pass {weight_s * 1e6:.1f} us"
            )
    return out


def _cold_forward(m: int, k: int, n: int, dtype, nbytes: int) -> Callable[[], None]:
    """``F.linear`` recording for autograd, as :func:`~partitioner.calibration.timing.cold_calls`
    runs it (the module docstring)."""
    import torch
    import torch.nn.functional as F

    def operands():
        return tuple(torch.randn(*shape).to(dtype).requires_grad_() for shape in ((m, k), (n, k), (n,)))

    return cold_calls(operands, F.linear, nbytes)
