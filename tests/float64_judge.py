"""Rounding or a defect: judging a parallel run's failed fp32 comparisons against float64.

The parity checks compare a parallel model with the same model on one device, both in fp32,
within ``torch.testing.assert_close``'s tolerances. Some models fail them with nothing wrong:
their gradients amplify fp32 rounding (MobileNetV2's 52 training-mode batch norms over channels
whose batch variance is down to 1e-10), so two fp32 runs that add in different orders (sharded
reductions, all-reduced halves) differ by more than the tolerance. A looser tolerance would hide
defects in every model; instead, when the fp32 comparison fails, ask how far each fp32 run is
from float64 arithmetic, and whether the parallel one is farther than one device's.

Each run is judged along its own trajectory. Both runs record (``parity_utils.Trajectory``,
``train_like_one_device(losses=...)``) the whole
parameters and gradients at each AdamW step of the protocol, each step's loss, and the
parameters after the last step. Then, for each run (:func:`judge`):

1. at each step ``k``, a float64 copy of the model loaded with the run's parameters at that step
   computes the loss and every gradient on the same inputs (floating tensors cast to float64):
   the run's fp32 loss and gradients there are compared with these;
2. AdamW (the protocol's settings, ``parity_utils.adam_in_lockstep``) is replayed in float64 from
   the run's first parameters with the run's own gradients: the run's last parameters are
   compared with the replay's.

Every error is a float64 2-norm ``e = |run - float64|`` per tensor; the parallel run's error
over one device's plus a floor, ``ratio = e_par / (e_one + FLOOR_ULPS u32 |t| + ABS_FLOOR)``
(``u32 = 2^-24``: no fp32 tensor is nearer ``t`` than its rounding, up to ``u32 |t|``), must be
at most :data:`FACTOR` for every loss, gradient and parameter; the worst ratio is reported.

Why along each run's own trajectory, and not the one-device protocol replayed in float64 and
each run's values compared with it at the end: after an optimizer step, such a model's two fp32
runs are off the float64 trajectory by their first rounding difference as amplified by later
steps (MobileNetV2 after 2 steps: parameters 4e-3 to 1.6e-2 from float64), one random draw of
a direction shared by every tensor, so the end-of-run ratios are one heavy-tailed sample: 4.0
to 4.9 on MobileNetV2's parameters where every first-step gradient's ratio was at most 2.3.
Judged where each run is, every step's rounding is compared with the other run's rounding at
that step, with nothing amplified.

:data:`FACTOR` = 4. The two runs make the same operations in different summation orders, so
their errors against float64 are draws of one size: on the zoo's rows that fail fp32 parity the
largest ratio over every loss, gradient and parameter was 2.28 (MobileNetV2, 476 values, one
over 2), 1.3-1.6 (MobileViT, 755; two runs) and 0.67 (RWKV, 128)
(``benchmarks/results/2026-12-04-family_zoo-reference.md``). A factor of 2 would reject such a
chance fluctuation of a small tensor (a 16-element bias has a noisy norm); much beyond 4 an
error of a few roundings' size would pass. A real defect is far larger: a gradient scaled by 1.01 is off
by 1e-2 of its norm, 10^2-10^4 times these models' fp32 error (``tests/test_float64_judge.py``
rejects it). ``ABS_FLOOR`` is a tenth of the fp32 comparison's own absolute tolerance (1e-5):
a tensor whose whole error norm is under it cannot be what failed that comparison, and a
gradient that is zero in float64 (a bias a batch norm cancels) has no relative scale.

Which failures it judges: the value comparisons of the protocol (the loss, every gradient, each
later step's loss, every parameter after the steps, as ``parity_utils`` labels them); any other
failure (communication, names, output types, a pipelined copy's comparisons) stands.
"""

from __future__ import annotations

import copy
import math

import torch
from parity_utils import ADAM_EPS, LR, Trajectory, call, grad_label, loss_of, param_label, step_loss_label

FACTOR = 4.0
"""The parallel error against float64 may be at most this many times one device's (module docstring)."""
FLOOR_ULPS = 4.0
"""The relative floor in units of fp32's rounding of the float64 tensor, ``2^-24 |t|``."""
ABS_FLOOR = 1e-6
"""The absolute floor on an error norm: a tenth of ``assert_close``'s fp32 ``atol``."""
U32 = 2.0**-24


def to_float64(inputs):
    """``inputs`` (a dict, tuple or tensor) with every floating tensor cast to float64."""
    if isinstance(inputs, torch.Tensor):
        return inputs.double() if inputs.is_floating_point() else inputs
    if isinstance(inputs, dict):
        return {k: to_float64(v) for k, v in inputs.items()}
    if isinstance(inputs, (list, tuple)):
        return type(inputs)(to_float64(v) for v in inputs)
    return inputs


def _loaded(model64, params: dict):
    """``model64`` (float64) with every parameter it has under a name in ``params`` set to it."""
    with torch.no_grad():
        for name, p in model64.named_parameters(remove_duplicate=False):
            if name in params:
                p.copy_(params[name])
    model64.zero_grad(set_to_none=True)
    return model64


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t.detach().double()))


def _errors(run: Trajectory, model, inputs) -> dict:
    """label -> (the run's error norm against float64 where the run is, the float64 norm)."""
    model64 = copy.deepcopy(model).double()
    data = to_float64(inputs)
    out = {}
    for k, (params, grads, loss) in enumerate(zip(run.params, run.grads, run.losses)):
        loss64 = loss_of(call(_loaded(model64, params), data))
        loss64.backward()
        out[step_loss_label(k) if k else "loss"] = (_norm(loss.double() - loss64), _norm(loss64.detach()))
        for name, p in model64.named_parameters(remove_duplicate=False):
            if name in grads and p.grad is not None:
                out[f"{grad_label(name)} at step {k}"] = (_norm(grads[name].double() - p.grad), _norm(p.grad))
    # AdamW replayed in float64 on the run's own gradients (a tied weight's: under any name)
    replay = _loaded(model64, run.params[0])
    opt = torch.optim.AdamW(replay.parameters(), lr=LR, eps=ADAM_EPS)
    aliases: dict = {}
    for name, p in replay.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    for grads in run.grads:
        for p in replay.parameters():
            given = next((grads[n] for n in aliases[id(p)] if n in grads), None)
            p.grad = None if given is None else given.double()
        opt.step()
    for name, p in replay.named_parameters(remove_duplicate=False):
        if name in run.final:
            out[param_label(name, len(run.grads))] = (_norm(run.final[name].double() - p.detach()), _norm(p.detach()))
    return out


def error_ratios(model, inputs, parallel: Trajectory, one_device: Trajectory) -> dict:
    """label -> the parallel run's error over one device's plus the floor (module docstring),
    for every loss, gradient and parameter both runs recorded; ``model``: an untouched copy of the
    model both started from."""
    par, one = _errors(parallel, model, inputs), _errors(one_device, model, inputs)
    return {
        label: e_par / (one[label][0] + FLOOR_ULPS * U32 * size + ABS_FLOOR)
        for label, (e_par, size) in par.items()
        if label in one
    }


def _ratio_labels(steps: int, names) -> dict:
    """The protocol's value comparisons: each fp32 comparison's label -> the label of its ratio
    (a gradient is judged at the first step, where the fp32 comparison looked at it)."""
    out = {"loss": "loss", **{step_loss_label(k): step_loss_label(k) for k in range(1, steps)}}
    out.update({grad_label(n): f"{grad_label(n)} at step 0" for n in names})
    out.update({param_label(n, steps): param_label(n, steps) for n in names})
    return out


def _unordered(r: float) -> float:
    """A ratio for ordering, NaN (a NaN value in a run) as the worst."""
    return math.inf if math.isnan(r) else r


def judge(checks, model, inputs, parallel: Trajectory, one_device: Trajectory) -> str:
    """Judge ``checks`` (``parity_utils.Checks``, the fp32 comparison of the two runs) when it
    holds failed value comparisons of the protocol: those failures are replaced by the verdict of
    :func:`error_ratios` (one per value over :data:`FACTOR`), the others stand. Returns how the
    comparison was decided: ``"fp32 parity"``, ``"float64 judge: worst ratio X (label)"``
    (accepted) or ``"float64 judge rejected: ..."``; leaves every ratio in ``checks.ratios``."""
    steps = len(one_device.grads)
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    labels = _ratio_labels(steps, names)
    judged = {w: f for w, f in checks.close_failures.items() if w in labels}
    if not judged:
        return "fp32 parity"
    ratios = error_ratios(model, inputs, parallel, one_device)
    checks.ratios = ratios
    worst = max(ratios, key=lambda w: _unordered(ratios[w]))
    # NaN is no ratio at all: `not r <= FACTOR` rejects it with the ratios over the factor
    rejected = sorted((w for w, r in ratios.items() if not r <= FACTOR), key=lambda w: -_unordered(ratios[w]))
    # a failure is replaced only where the judge has a ratio for it; the others stand as they failed
    replaced = {f for w, f in judged.items() if labels[w] in ratios}
    checks.failures = [f for f in checks.failures if f not in replaced]
    for what in rejected:
        checks.failures.append(
            f"rank {checks.rank}: float64 judge: {what}: parallel error {ratios[what]:.3g} x one device's "
            f"(over {FACTOR:g})"
        )
    failed = f"{len(judged)} fp32 failures judged"
    if rejected:
        return (
            f"float64 judge rejected ({failed}): {len(rejected)} values over {FACTOR:g}x, worst {worst} "
            f"({ratios[worst]:.3g})"
        )
    return f"float64 judge: worst ratio {ratios[worst]:.2f} ({worst}; {failed})"
