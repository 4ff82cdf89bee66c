"""One estimate per plan: the step time logged when a plan is made is the one its summary and
``estimate()`` report, and MFU is taken against the peak of the dtype the FLOPs are priced in
(so it can never exceed 100%)."""

from __future__ import annotations

import logging
import re

import pytest

import partitioner
from partitioner import models


@pytest.mark.parametrize("dtype_name, precision", [("bfloat16", None), ("float32", "bf16"), ("float32", None)])
def test_mfu_is_against_the_peak_the_flops_are_priced_at(dtype_name, precision):
    """A model built in bf16 under the default fp32 policy runs its matmuls in bf16: its MFU is
    against the bf16 peak (it read 143% against fp32's for LLaMA-7B shapes on 8x8 H100s)."""
    import torch
    model, inputs = models.llama_meta(n_layer=2, hidden=1024, heads=8, kv_heads=8, intermediate=2816, vocab=4096,
                                      batch=8, seq=512, dtype=getattr(torch, dtype_name))
    plan = partitioner.plan(model, inputs, mesh=(2, 4), cluster="h100", precision=precision)
    est = plan.estimate()
    priced = "bfloat16" if dtype_name == "bfloat16" or precision == "bf16" else "float32"
    assert plan.data["flops_dtype"] == priced
    peak = partitioner.get_cluster("h100").flops_for(priced)
    assert est.mfu == pytest.approx(est.tflops_per_device * 1e12 / peak)
    assert 0.0 < est.mfu <= 1.0, est.mfu


def test_the_logged_step_is_the_summary_and_the_estimate(caplog):
    model, inputs = models.gpt_demo(batch=8, seq=32, n_layer=2)
    with caplog.at_level(logging.INFO, logger="partitioner"):
        plan = partitioner.plan(model, inputs, mesh=(2, 2), cluster="h100")
    step_ms = plan.estimate().step_time_s * 1e3
    logged = [float(m.group(1)) for r in caplog.records
              for m in [re.search(r"estimated step ([0-9.]+) ms", r.getMessage())] if m]
    assert logged == [pytest.approx(step_ms, abs=5e-4)], logged
    from partitioner.units import fmt_time as _fmt_time
    assert f"estimate: step {_fmt_time(plan.estimate().step_time_s)} " in plan.summary()
