"""The optimizer's step in the estimate (``passes.plan.cost_model.optimizer_step_time``), known numbers.

AdamW on fp32 reads the parameter, its gradient and two moments and writes the parameter and the
moments: 28 B per element it steps, memory-bound at the device's bandwidth (H100: 3.35 TB/s), or
at the host's share (``host_memory_bandwidth``: 614 GB/s / 8) for state offloaded there. GPT
(133,888 parameters) on (4,), cluster ``h100``, one process:

* data parallel, every weight replicated: 28 x 133,888 B / 3.35e12 B/s;
* every weight ZeRO-1: each rank steps a quarter of every weight: a quarter of that;
* offloaded weights step at the host's bandwidth, the rest at the device's;
* the estimate's step is compute + communication + optimizer step, and the summary and
  ``explain`` show it.
"""

import pytest
from parity_utils import build, free_weights, pins_for

H100_HBM = 3.35e12
H100_HOST = 614e9 / 8


def _plan(**kw):
    import partitioner

    model, inputs = build("gpt")
    return partitioner.plan(model, inputs, mesh_shape=(4,), cluster="h100", recompute="none", **kw)


def test_adamw_step_is_priced_from_bytes_at_memory_bandwidth(fake_process_group):
    fake_process_group(4)
    model, _ = build("gpt")
    n = sum(p.numel() for p in model.parameters())
    assert n == 133_888
    replicated = _plan(pins=pins_for("gpt", "dp", (4,)))
    est = replicated.estimate()
    assert all(r.get("stored") is None and r["out"][0] == "[R]" for r in replicated.records if r["kind"] == "param")
    assert est.optimizer_s == pytest.approx(28 * n / H100_HBM, rel=1e-12)
    assert est.step_time_s == pytest.approx(est.compute_s + est.comm_s + est.optimizer_s, rel=1e-12)
    assert "optimizer step 1.1 us" in str(est) and "optimizer step" in replicated.summary()
    fc = 64 * 256  # h.0.mlp.c_fc.weight: 16,384 elements
    assert f"optimizer step {fc * 28 / H100_HBM * 1e6:.1f} us" in replicated.explain("h.0.mlp.c_fc.weight")

    zero1 = _plan(pins=free_weights("gpt", "dp", (4,)), zero=1)
    assert all(r.get("stored") for r in zero1.records if r["kind"] == "param")
    assert zero1.estimate().optimizer_s == pytest.approx(28 * n / 4 / H100_HBM, rel=1e-12)


def test_offloaded_state_steps_at_the_host_bandwidth(fake_process_group):
    import math

    fake_process_group(4)
    pins = pins_for("gpt", "dp", (4,))  # weights replicated: only offloading can save their state
    free = _plan(pins=pins).estimate()
    plan = _plan(pins=pins, memory_budget=int(free.memory_bytes - 0.3 * free.memory.optimizer_state),
                 host_memory_budget="64MiB")
    params = [r for r in plan.records if r["kind"] == "param" and r.get("optimizer_step_s")]
    offloaded = [r for r in params if r.get("offload")]
    assert offloaded and len(offloaded) < len(params)

    def stepped(r):  # elements of the tensor the optimizer steps on this rank
        spec = (r.get("stored") or r["out"][0]).strip("[]").split(", ")
        return math.prod(r["shapes"][0]) // (4 if spec[0].startswith("S") else 1)

    expected = sum(28 * stepped(r) / (H100_HOST if r.get("offload") else H100_HBM) for r in params)
    assert plan.estimate().optimizer_s == pytest.approx(expected, rel=1e-12)
    assert "at host memory bandwidth" in plan.explain(offloaded[0]["fqn"])
