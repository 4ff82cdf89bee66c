"""The float64 judge (``tests/float64_judge.py``) on a small batch-norm-heavy CNN, and the honest
comparison of "no gradient" with "no gradient".

The CNN: stride-2 convolutions down to 1x1, then 1x1 convolutions there, each followed by a
training-mode batch norm (eps 1e-3) and ReLU6; at 1x1 each batch norm's statistics are over the
8 samples alone (4 per rank), so, as in MobileNetV2, its gradients amplify fp32 rounding: one
device's fp32 gradients are up to 3x ``assert_close``'s tolerance from float64, and the parallel
run's as far, in another direction. Trained data parallel on 2 gloo ranks (synchronised batch
norms) against one device through 2 AdamW steps: the judge must find the parallel run no
farther from float64 than one device (every ratio within its factor), and must reject the same
run with one parameter's gradient scaled by 1.01 on every rank (a defect 1% in size).
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from float64_judge import FACTOR, error_ratios, judge
from parity_utils import (
    ADAM_EPS,
    LR,
    Checks,
    Trajectory,
    call,
    check_grads_by_alias,
    loss_of,
    run_checked,
    train_like_one_device,
)

STEPS = 2
DEFECT = "blocks.9.0.weight"  # a 1x1 convolution's weight, deep in the stack
PINS = {"x": ["S(0)"], "y": ["S(0)"], "blocks.*.0": ["S(0)"], "blocks.*.1": ["S(0)"], "blocks.*.2": ["S(0)"]}


class ConvBatchNorm(nn.Sequential):
    def __init__(self, cin, cout, kernel, stride):
        super().__init__(nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False), nn.BatchNorm2d(cout, eps=1e-3),
                         nn.ReLU6())


class BatchNormStack(nn.Module):
    """``down`` stride-2 3x3 convolutions to 1x1, then ``deep`` 1x1 ones, each with a batch norm
    (an ``nn.Sequential``: the capture's repeated-layer cut applies to ``nn.ModuleList``)."""

    def __init__(self, channels=8, down=4, deep=8, classes=10):
        super().__init__()
        blocks = [ConvBatchNorm(channels if i else 3, channels, 3, 2) for i in range(down)]
        blocks += [ConvBatchNorm(channels, channels, 1, 1) for _ in range(deep)]
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, classes)

    def forward(self, x, y):
        return F.cross_entropy(self.head(self.blocks(x).flatten(1)), y)


def batch_norm_stack():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    return BatchNormStack(), (torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g))


def _judged_run(rank, defect: bool) -> dict:
    import partitioner

    checks = Checks(rank)
    model, inputs = batch_norm_stack()
    ref, initial = copy.deepcopy(model), copy.deepcopy(model)
    pm = partitioner.auto_parallelize(model, inputs, mesh=(2,), cluster="h100", pins=PINS)
    local = dict(pm.named_parameters())

    def parallel_step():
        loss = loss_of(call(pm, inputs))
        loss.backward()
        if defect:  # after the gradient synchronisation: every rank's copy 1% off
            local[DEFECT].grad.mul_(1.01)
        return loss

    loss = parallel_step()
    ref_loss = loss_of(call(ref, inputs))
    ref_loss.backward()
    checks.close("loss", loss.detach(), ref_loss.detach())
    check_grads_by_alias(pm.full_grads(), ref, checks)
    runs = train_like_one_device(pm, ref, inputs, STEPS, checks, losses=(loss, ref_loss), parallel_step=parallel_step)
    ratios = error_ratios(initial, inputs, *runs)  # the judge's measure, whether or not fp32 failed
    fp32_failures = sorted(checks.close_failures)
    verdict = judge(checks, initial, inputs, *runs)
    return {"ratios": ratios, "fp32_failures": fp32_failures, "verdict": verdict, "failures": list(checks.failures)}


def judge_worker(rank, world, cfg):
    return {"rank": rank, "failures": [], "clean": _judged_run(rank, False), "defect": _judged_run(rank, True)}


def test_the_judge_accepts_batch_norm_rounding_and_rejects_a_gradient_one_percent_off():
    clean, defect = (run_checked(judge_worker, {"mesh": (2,)}, 300)[0][k] for k in ("clean", "defect"))
    worst = max(clean["ratios"], key=clean["ratios"].get)
    assert clean["ratios"][worst] <= FACTOR, (worst, clean["ratios"][worst], clean["fp32_failures"])
    assert not clean["failures"], clean["failures"]
    assert "rejected" not in clean["verdict"], clean["verdict"]
    # every loss, gradient (at both steps) and parameter judged
    params = len(list(BatchNormStack().parameters()))
    assert len(clean["ratios"]) == STEPS + STEPS * params + params, sorted(clean["ratios"])

    assert f"grad of {DEFECT}" in defect["fp32_failures"], defect["fp32_failures"]
    assert defect["verdict"].startswith("float64 judge rejected ("), defect["verdict"]
    scaled = defect["ratios"][f"grad of {DEFECT} at step 0"]
    assert scaled > 10 * FACTOR, scaled
    assert any(f"float64 judge: grad of {DEFECT} at step 0" in f for f in defect["failures"]), defect["failures"]


class _Unreached(nn.Module):
    """``spare`` is read by nothing; ``frozen`` is read but trains nothing."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.spare = nn.Parameter(torch.ones(3))
        self.frozen = nn.Parameter(torch.ones(4), requires_grad=False)

    def forward(self, x):
        return (self.layer(x) * self.frozen).sum()


def test_no_gradient_compares_only_with_no_gradient():
    """XLNet's ``mask_emb``: a parameter no gradient reaches is None on one device; the parallel
    model's gradients must leave it out too (``full_grads`` does), and one present on one side
    only is a failure either way."""
    ref = _Unreached()
    ref(torch.ones(2, 4)).backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}

    honest = Checks(0)
    check_grads_by_alias(grads, ref, honest)
    assert not honest.failures, honest.failures

    invented = Checks(0)  # a zero gradient where one device has none
    check_grads_by_alias({**grads, "spare": torch.zeros(3)}, ref, invented)
    assert any("spare has no gradient on one device" in f for f in invented.failures), invented.failures

    missing = Checks(0)  # no gradient where one device has one
    check_grads_by_alias({"layer.weight": grads["layer.weight"]}, ref, missing)
    assert any("0 gradients for layer.bias" in f for f in missing.failures), missing.failures


def _one_step(model, x, *, grad_fault=None) -> Trajectory:
    """One AdamW step of ``model`` on ``x`` recorded as a run; ``grad_fault(name, grad)``: what
    the recorded gradient becomes (a defect injected into a "parallel" run)."""
    run = Trajectory()
    loss = loss_of(call(model, (x,)))
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    if grad_fault is not None:
        grads = {n: grad_fault(n, g) for n, g in grads.items()}
    run.point(dict(model.named_parameters()), grads, loss)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    opt.step()
    run.final = {n: p.detach().clone() for n, p in model.named_parameters()}
    return run


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).square().mean()


def _nan_in(name):
    return lambda n, g: torch.full_like(g, float("nan")) if n == name else g


def test_a_nan_is_rejected_and_a_failure_without_a_ratio_stands():
    torch.manual_seed(0)
    model, x = _Tiny(), torch.randn(8, 4)
    one = _one_step(copy.deepcopy(model), x)
    nan = _one_step(copy.deepcopy(model), x, grad_fault=_nan_in("a.bias"))
    checks = Checks(0)
    checks.close("grad of a.bias", nan.grads[0]["a.bias"], one.grads[0]["a.bias"])
    verdict = judge(checks, model, (x,), nan, one)
    assert verdict.startswith("float64 judge rejected ("), verdict
    assert any("float64 judge: grad of a.bias at step 0" in f for f in checks.failures), checks.failures

    # a failed gradient whose name the judge holds no ratio for (the run left it out) is not judged away
    missing = _one_step(copy.deepcopy(model), x)
    del missing.grads[0]["b.weight"]
    checks = Checks(0)
    checks.close("grad of b.weight", torch.zeros(1, 4), one.grads[0]["b.weight"])
    judge(checks, model, (x,), missing, one)
    assert any(f.startswith("rank 0: grad of b.weight:") for f in checks.failures), checks.failures
