"""Mixed precision: ``precision="bf16"`` / ``"fp16"`` against the single-device model under
``torch.autocast`` in the same dtype.

Tolerances (bf16 has an 8-bit significand: one rounding is a relative error of at most
u = 2^-8 ~ 3.9e-3; fp16: u = 2^-11):

* The parallel run computes the same ops under the same autocast; what differs is where sums
  are cut: a row-parallel matmul's two halves are each rounded to bf16 and then added, where one
  device rounds the whole sum once. Each such cut adds at most ~1 u to a value's relative error.
* Loss: a mean over every token, where such errors average out: rtol 4u (1.6e-2 would be
  generous; the measured difference is ~1e-5 relative), atol 0.
* Gradients: compared norm-wise per parameter (elementwise comparison is meaningless for entries
  near zero): ||g - g_ref|| / ||g_ref|| <= max(4u, the reference's own low-precision noise
  ||g_ref - g_fp32|| / ||g_fp32||). 4u covers the cut sums (measured up to ~5e-3 in bf16);
  the noise term, doubled (two independent roundings of that size), covers gradients that are
  sums over every token whose terms cancel (LayerNorm weights), where any rounding, the single
  device's included, is amplified by the sum's condition number (measured ~4e-3 relative in
  fp16 and bf16 alike, for the parallel run and the reference's own noise).
* Parameters (fp32 masters) after 3 AdamW steps (lr 1e-2, eps 1e-3): one update moves an entry
  by at most lr, and a gradient error of e moves it by at most lr * e / eps-scaled; atol 2e-3.

The 50-step drift test measures, per step, |parallel bf16 - reference bf16| and the
reference's own bf16 noise |reference bf16 - reference fp32| (AdamW, the loss falling from 5.7
to 0.13). The two are samples of one process, bf16 rounding in a different order, and come out
alike (measured: drift mean 2.9e-4, max 1.1e-3; noise mean 2.5e-4, max 1.0e-3): the test
requires the drift within twice the noise, mean and max (two independent roundings of one
size differ by up to twice it), and the final losses within the final noise's scale.
"""
import copy

import pytest
import torch
from parity_utils import ADAM_EPS, LR, Checks, built_in_parent, nested_approx_equal, pins_for, prebuilt, run_checked

import partitioner
from partitioner import models
from partitioner.precision import Precision
from runtime.collectives import CommCounter

TIMEOUT_S = 240
U = {"bf16": 2.0**-8, "fp16": 2.0**-11}
DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _normwise(checks, what, actual, expected, tol):
    scale = expected.norm().item()
    err = (actual - expected).norm().item()
    checks.true(f"{what}: relative error {err / max(scale, 1e-30):.2e} > {tol:.2e}", err <= tol * max(scale, 1e-12))


def _gpt():
    return models.gpt_demo(batch=8, seq=16, n_layer=2)


def precision_worker(rank, world, cfg):
    prec = cfg["precision"]
    u = U[prec]
    checks = Checks(rank)
    model, inputs = prebuilt("gpt") or _gpt()  # the parent's, captured there for this precision
    ref, ref32 = copy.deepcopy(model), copy.deepcopy(model)
    ref32(*inputs).backward()
    pm = partitioner.auto_parallelize(
        model, inputs, mesh=(2, 2), pins=pins_for("gpt", "dp_tp", (2, 2)), cluster="h100", precision=prec
    )
    checks.true("master parameters are fp32", all(p.dtype == torch.float32 for p in pm.parameters()))
    with CommCounter() as counter:
        loss = pm(*inputs)
        loss.backward()
    for diff in nested_approx_equal(counter.as_dict(), pm.plan.estimate().comm_bytes):
        checks.true(f"communication: {diff}", False)

    def ref_loss():
        with torch.autocast("cpu", dtype=DTYPE[prec]):
            return ref(*inputs)

    expected = ref_loss()
    expected.backward()
    checks.close("loss", loss.detach(), expected.detach(), rtol=4 * u, atol=0.0)
    grads = pm.full_grads()
    fp32_grads = dict(ref32.named_parameters())
    for name, p in ref.named_parameters():
        checks.true(f"gradient of {name} is fp32", grads[name].dtype == torch.float32)
        g32 = fp32_grads[name].grad
        noise = ((p.grad - g32).norm() / g32.norm().clamp_min(1e-30)).item()
        _normwise(checks, f"grad of {name} (reference noise {noise:.1e})", grads[name], p.grad, max(4 * u, 2 * noise))
    masters_after_adamw(pm, ref, lambda: pm(*inputs), ref_loss, checks)
    return {"rank": rank, "failures": checks.failures, "bytes": counter.as_dict()}


def masters_after_adamw(pm, ref, parallel_loss, ref_loss, checks, steps=3):
    """``steps`` AdamW steps of ``pm`` and ``ref`` in lockstep (the first from the gradients they
    hold), then every fp32 master against the reference's parameter."""
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=ADAM_EPS)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=ADAM_EPS)
    for step in range(steps):
        if step:
            opt.zero_grad()
            ref_opt.zero_grad()
            parallel_loss().backward()
            ref_loss().backward()
        opt.step()
        ref_opt.step()
    state = pm.full_state_dict()
    for name, p in ref.named_parameters():
        checks.close(f"fp32 master {name} after {steps} AdamW steps", state[name], p.detach(), atol=2e-3, rtol=0.0)


@pytest.mark.parametrize("prec", ["bf16", "fp16"])
def test_mixed_precision_parity_on_2x2(prec):
    results = run_checked(precision_worker, {"mesh": (2, 2), "precision": prec}, TIMEOUT_S,
                          prebuild=("gpt", _gpt, {"precision": prec}))
    assert results[0]["bytes"], "a DP x TP plan communicates"


def _drift_data() -> list:
    """Two fixed batches, alternated: a task the model can learn in 50 steps."""
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(2):
        ids = torch.randint(0, 256, (8, 16), generator=g)
        data.append((ids, torch.roll(ids, -1, dims=1)))
    return data


def drift_worker(rank, world, cfg):
    model, _ = prebuilt("gpt") or _gpt()  # the parent's, captured there (bf16) on the first batch
    ref32, ref16 = copy.deepcopy(model), copy.deepcopy(model)
    data = _drift_data()
    batches = [data[step % 2] for step in range(cfg["steps"])]
    pm = partitioner.auto_parallelize(
        model, batches[0], mesh=(2, 2), pins=pins_for("gpt", "dp_tp", (2, 2)), cluster="h100", precision="bf16"
    )
    runs = {"parallel": (pm, False), "ref_bf16": (ref16, True), "ref_fp32": (ref32, None)}
    losses = {k: [] for k in runs}
    for name, (module, autocast) in runs.items():
        opt = torch.optim.AdamW(module.parameters(), lr=3e-3)
        for batch in batches:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(autocast)):
                loss = module(*batch)
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    return losses


def test_bf16_run_drifts_no_more_than_the_references_own_bf16_noise():
    from runtime.launch import run_on_ranks

    with built_in_parent({"gpt": (lambda: (_gpt()[0], _drift_data()[0]), {"precision": "bf16"})}):
        losses = run_on_ranks(drift_worker, 4, {"steps": 50}, timeout_s=TIMEOUT_S)[0]
    par, ref16, ref32 = (torch.tensor(losses[k]) for k in ("parallel", "ref_bf16", "ref_fp32"))
    drift = (par - ref16).abs()
    noise = (ref16 - ref32).abs()
    assert ref16[-1] < ref16[0] - 0.5, "the reference must learn over 50 steps for the comparison to mean anything"
    assert drift.max() <= 2 * noise.max(), f"max drift {drift.max():.4g} vs the reference's bf16 noise {noise.max():.4g}"
    assert drift.mean() <= 2 * noise.mean(), f"mean drift {drift.mean():.4g} vs bf16 noise {noise.mean():.4g}"


def scaler_worker(rank, world, cfg):
    checks = Checks(rank)
    model, inputs = models.gpt_demo(batch=8, seq=16, n_layer=2)
    ref = copy.deepcopy(model)
    pm = partitioner.auto_parallelize(
        model, inputs, mesh=(2,), pins=pins_for("gpt", "tp", (2,)), cluster="h100", precision="fp16"
    )
    scaler, ref_scaler = partitioner.grad_scaler(init_scale=2.0**10), torch.amp.GradScaler("cpu", init_scale=2.0**10)
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    # 1. a normal step: the same as the single-device GradScaler step
    scaler.scale(pm(*inputs)).backward()
    scaler.step(opt)
    scaler.update()
    with torch.autocast("cpu", dtype=torch.float16):
        ref_loss = ref(*inputs)
    ref_scaler.scale(ref_loss).backward()
    ref_scaler.step(ref_opt)
    ref_scaler.update()
    state = pm.full_state_dict()
    for name, p in ref.named_parameters():
        checks.close(f"{name} after a scaled fp16 step", state[name], p.detach(), atol=1e-3, rtol=0.0)
    checks.true("scale unchanged after a finite step", scaler.get_scale() == ref_scaler.get_scale())
    # 2. an overflow on one rank's shard only: every rank skips the step and halves the scale
    opt.zero_grad()
    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    scaler.scale(pm(*inputs)).backward()
    if rank == 1:
        next(p for p in pm.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    for name, p in pm.named_parameters():
        checks.true(f"{name} changed although a rank overflowed", torch.equal(p.detach(), before[name]))
    return {"rank": rank, "failures": checks.failures, "scale": scaler.get_scale()}


def test_fp16_loss_scaling_checks_overflow_on_every_rank():
    results = run_checked(scaler_worker, {"mesh": (2,)}, TIMEOUT_S)
    assert results[0]["scale"] == results[1]["scale"] == 2.0**9


# -- one process: the plan prices what runs ---------------------------------------------------


def test_bf16_plan_prices_half_the_activation_bytes_and_counts_compute_copies():
    model, inputs = models.gpt_demo(batch=8, seq=16, n_layer=2)
    pins = pins_for("gpt", "tp", (2,))
    fp32 = partitioner.plan(model, inputs, mesh_shape=(2,), cluster="h100", pins=pins)
    bf16 = partitioner.plan(model, inputs, mesh_shape=(2,), cluster="h100", pins=pins, precision="bf16")
    assert bf16.precision == Precision(torch.bfloat16) and "precision bf16" in bf16.summary()
    a, b = fp32.estimate(), bf16.estimate()
    # forward all-reduces of b*s*h values: the vocab-parallel embedding's partial sums (fp32:
    # autocast leaves embeddings alone) and the 4 row-parallel matmul outputs (bf16 under autocast)
    bsh = 8 * 16 * 64
    fwd = lambda e: e.comm_bytes_by_phase["fwd"]["all_reduce"]["a0"]  # noqa: E731
    assert fwd(a) == pytest.approx(5 * bsh * 4)
    assert fwd(b) == pytest.approx(bsh * 4 + 4 * bsh * 2)
    assert b.compute_s < a.compute_s
    # the fp32 master state (16 B/parameter with Adam) is kept; each weight a matmul uses in bf16
    # adds its 2-byte compute copy
    param = {r["name"]: r for r in bf16.records if r["kind"] == "param"}
    weight = next(n for n, r in param.items() if r["fqn"] == "h.0.mlp.c_fc.weight")
    numel = 256 * 64 // 2
    assert param[weight]["memory"] == pytest.approx(numel * (16 + 2))
    assert {r["name"]: r for r in fp32.records}[weight]["memory"] == pytest.approx(numel * 16)


def test_a_model_on_meta_plans_in_bf16_like_a_real_one():
    model, inputs = models.gpt_demo(batch=8, seq=16, n_layer=2)
    real = partitioner.plan(model, inputs, mesh_shape=(2,), cluster="h100", precision="bf16")
    meta = partitioner.plan(model.to("meta"), inputs, mesh_shape=(2,), cluster="h100", precision="bf16")
    assert meta.fingerprint == real.fingerprint
    assert meta.estimate().step_time_s == pytest.approx(real.estimate().step_time_s)


def test_precision_arguments():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    assert Precision.build("bf16") == Precision(torch.bfloat16, torch.float32)
    assert Precision.build(None) == Precision.build("fp32") == Precision()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert Precision.build(policy) == Precision(torch.bfloat16, torch.float32)
    assert Precision.build(MixedPrecisionPolicy(param_dtype=torch.bfloat16)).reduce == torch.bfloat16
    assert Precision.from_dict(Precision.build("fp16").to_dict()) == Precision(torch.float16)
    with pytest.raises(ValueError, match="precision must be one of 'fp32', 'bf16', 'fp16'"):
        Precision.build("int8")


def test_replaying_a_plan_in_another_precision_is_refused(fake_process_group):
    fake_process_group(2)
    model, inputs = models.gpt_demo(batch=4, seq=8, n_layer=1)
    plan = partitioner.plan(model, inputs, mesh_shape=(2,), cluster="h100", precision="bf16")
    with pytest.raises(ValueError, match="made for precision bf16, not fp16"):
        partitioner.auto_parallelize(model, inputs, mesh=(2,), plan=plan, precision="fp16")
    pm = partitioner.auto_parallelize(model, inputs, mesh=(2,), plan=plan)
    assert pm.plan.precision.compute == torch.bfloat16


def pipeline_precision_worker(rank, world, cfg):
    checks = Checks(rank)
    model, inputs = models.gpt_demo(batch=8, seq=16, n_layer=2)
    ref = copy.deepcopy(model)
    runner = partitioner.auto_parallelize(
        model, inputs, mesh=(2,), cluster="h100", precision="bf16",
        pipeline={"degree": 2, "schedule": "1f1b", "microbatches": 2},
    )
    loss = runner.train_step(inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = ref(*inputs)
    expected.backward()
    checks.close("pipeline loss", loss, expected.detach(), rtol=4 * U["bf16"], atol=0.0)
    grads = runner.full_grads()
    for name, p in ref.named_parameters():
        if name in grads:
            _normwise(checks, f"pipeline grad of {name}", grads[name], p.grad, 4 * U["bf16"])
    checks.true("the stages run under autocast", all(s.autocast_dtype == torch.bfloat16 for s in runner.stages.values()))
    return {"rank": rank, "failures": checks.failures}


def test_bf16_pipeline_parity():
    run_checked(pipeline_precision_worker, {"mesh": (2,)}, TIMEOUT_S)


def reduce_dtype_worker(rank, world, cfg):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    checks = Checks(rank)
    model, inputs = models.gpt_demo(batch=8, seq=16, n_layer=2)
    ref = copy.deepcopy(model)
    counted = {}
    for reduce in (torch.float32, torch.bfloat16):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
        pm = partitioner.auto_parallelize(
            copy.deepcopy(model), inputs, mesh=(2,), pins=pins_for("gpt", "dp", (2,)), cluster="h100", precision=policy
        )
        with CommCounter() as counter:
            pm(*inputs).backward()
        counted[str(reduce)] = counter.grad_sync_dict()
        for diff in nested_approx_equal(counter.as_dict(), pm.plan.estimate().comm_bytes):
            checks.true(f"reduce {reduce}: communication {diff}", False)
        grads = pm.full_grads()
        checks.true("gradients stay fp32", all(g.dtype == torch.float32 for g in grads.values()))
        if reduce == torch.bfloat16:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                expected = ref(*inputs)
            expected.backward()
            for name, p in ref.named_parameters():   # one more bf16 rounding of each gradient: 2u more
                _normwise(checks, f"grad of {name} reduced in bf16", grads[name], p.grad, 6 * U["bf16"])
    return {"rank": rank, "failures": checks.failures, "counted": counted}


def test_gradients_reduce_in_the_policys_dtype():
    results = run_checked(reduce_dtype_worker, {"mesh": (2,)}, TIMEOUT_S)
    fp32, bf16 = results[0]["counted"]["torch.float32"], results[0]["counted"]["torch.bfloat16"]
    assert fp32["all_reduce"]["a0"] > 0
    assert bf16["all_reduce"]["a0"] == fp32["all_reduce"]["a0"] / 2


class FullPrecisionRegion(torch.nn.Module):
    """A region run with autocast off, as Nemotron's ``LayerNorm1P`` is: its matmul adds numbers
    bf16 cannot hold apart (1000 + h: bf16's spacing there is 4), so computed in bf16 the region
    would lose ``h`` altogether, far beyond any rounding tolerance."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.head = torch.nn.Parameter(torch.randn(8, 4))

    def forward(self, x, target):
        h = torch.tanh(self.proj(x))
        with torch.autocast("cpu", enabled=False):
            y = (h.float() + 1000.0) @ self.head - 1000.0 * self.head.sum(0)
        return torch.nn.functional.mse_loss(y, target)


def _region_model():
    torch.manual_seed(0)
    return FullPrecisionRegion(), {"x": torch.randn(8, 6, 8), "target": torch.randn(8, 6, 4)}


def test_an_autocast_region_is_captured_as_plain_marked_nodes():
    from passes.capture.autocast_regions import AUTOCAST_KEY
    from passes.capture.capture import capture

    model, inputs = _region_model()
    cap = capture(model, inputs, autocast_dtype=torch.bfloat16)
    ops = [n for n in cap.graph.nodes if n.op == "call_function"]
    assert not [n for n in ops if "wrap_with_autocast" in str(n.target)]
    assert not [n for n in cap.graph.nodes if n.op == "get_attr"]
    # (device type, dtype, enabled, cache): the region's matmul runs with autocast off, the linear before it on
    off = {str(n.target) for n in ops if n.meta.get(AUTOCAST_KEY, (None, None, True))[:3:2] == ("cpu", False)}
    assert "aten.matmul.default" in off and "aten.linear.default" not in off, off


def region_worker(rank, world, cfg):
    checks = Checks(rank)
    model, inputs = _region_model()
    ref = copy.deepcopy(model)
    pm = partitioner.auto_parallelize(model, inputs, mesh=(2,), cluster="h100", precision="bf16")
    with CommCounter() as counter:
        loss = pm(**inputs)
        loss.backward()
    for diff in nested_approx_equal(counter.as_dict(), pm.plan.estimate().comm_bytes):
        checks.true(f"communication: {diff}", False)

    def ref_loss():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return ref(**inputs)

    expected = ref_loss()
    expected.backward()
    checks.close("loss", loss.detach(), expected.detach(), rtol=4 * U["bf16"], atol=0.0)
    grads = pm.full_grads()
    for name, p in ref.named_parameters():
        _normwise(checks, f"grad of {name}", grads[name], p.grad, 4 * U["bf16"])
    masters_after_adamw(pm, ref, lambda: pm(**inputs), ref_loss, checks)
    return {"rank": rank, "failures": checks.failures}


def test_a_region_the_model_runs_with_autocast_off_runs_so_in_parallel():
    run_checked(region_worker, {"mesh": (2,)}, TIMEOUT_S)
