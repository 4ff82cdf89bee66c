"""A contraction's forward, backward and weight pass, and a view, priced at the rates the
calibration measures for them.

The calibration times a linear layer's forward, backward and weight pass as a training step runs
them (``partitioner.calibration.measure_backward``) and fits one curve each (``forward_curve``,
``backward_curve``, ``weight_curve``: fractions of the matmul peak by the forward product's FLOPs
per byte), and fx programs of views (``view_overhead_s``). These check, on samples made from a
known machine and on fixed cluster descriptions (no timing), that the fit gives back the figures
that made the samples, that the planner prices a linear's forward, backward and ``W`` and every
view with them, and that they round-trip through a cluster file.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from partitioner.calibration.fit import fit_compute
from partitioner.cluster import ClusterSpec, LinkSpec, cluster_file_dict, load_cluster_file
from partitioner.intra_op import plan_captured
from partitioner.local_cluster import get_cluster
from partitioner.models import gpt_demo
from passes.analysis.analyze import analyze
from passes.capture.capture import capture
from passes.plan.cost_model import compute_time, matmul_fraction, weight_pass_time

OVERHEAD_S = 6e-6  # the per-op fixed cost the fx programs' samples give
CALL_S = 2e-6  # a bare call's cost (the elementwise line's intercept)
FORWARD = {"float32": [[20.0, 0.5], [80.0, 1.0]]}
STEP_FORWARD = {"float32": [[20.0, 0.4], [80.0, 0.8]]}  # the forward as a step runs it: slower than the bare mm
VIEW_S = 5e-6
BACKWARD = {"float32": [[20.0, 0.2], [80.0, 0.7]]}
WEIGHT = {"float32": [[20.0, 0.1], [80.0, 0.6]]}
MACHINE = ClusterSpec(
    name="known",
    peak_flops={"float32": 40e9, "bfloat16": 40e9, "float16": 40e9},
    memory_bandwidth=20e9,
    memory_bytes=1 << 30,
    devices_per_node=2,
    intra_node=LinkSpec(bandwidth=2e9, latency_s=30e-6),
    inter_node=LinkSpec(bandwidth=2e9, latency_s=30e-6),
    matmul_efficiency=1.0,
    op_overhead_s=OVERHEAD_S,
    matmul_curve=FORWARD,
    forward_curve=STEP_FORWARD,
    backward_curve=BACKWARD,
    weight_curve=WEIGHT,
    view_overhead_s=VIEW_S,
)
SHAPES = ((60, 60, 60), (240, 240, 240), (480, 30, 480), (480, 480, 480))  # FLOPs per byte 10, 40, 13.3, 80


def _machine_samples() -> dict:
    """What a machine that is exactly ``MACHINE`` measures: the bare forward products (a bare
    call's cost beyond their work), the fx programs of tiny ops and of views, an elementwise line,
    and each shape's forward, backward and weight pass as the cost model prices them."""
    bare = dataclasses.replace(MACHINE, op_overhead_s=CALL_S, forward_curve={})
    out: dict = {"matmul": [], "contraction_passes": []}
    for m, k, n in SHAPES:
        flops, nbytes = 2 * m * k * n, 4 * (m * k + k * n + m * n)
        out["matmul"].append(
            {"dtype": "float32", "m": m, "k": k, "n": n, "flops": flops, "bytes": nbytes}
            | {"s": compute_time(flops, nbytes, "float32", True, bare)}
        )
        backward = 2 * compute_time(flops, nbytes, "float32", True, MACHINE, product="backward")
        weight = compute_time(flops, nbytes, "float32", True, MACHINE, product="weight") + OVERHEAD_S
        forward = compute_time(flops, nbytes, "float32", True, MACHINE)
        out["contraction_passes"].append(
            {"dtype": "float32", "m": m, "k": k, "n": n, "flops": flops, "bytes": nbytes}
            | {"forward_s": forward, "backward_s": backward, "weight_s": weight}
        )
    out["elementwise"] = [{"bytes": b, "s": CALL_S + b / MACHINE.memory_bandwidth} for b in (1 << 12, 1 << 20)]
    out["chains"] = [{"ops": k, "s": 40e-6 + 2 * k * OVERHEAD_S} for k in (8, 64)]
    out["view_chains"] = [{"ops": k, "s": 30e-6 + 2 * k * VIEW_S} for k in (8, 64)]
    return out


def _fitted(samples: dict) -> ClusterSpec:
    compute = fit_compute(samples)
    assert compute["op_overhead_s"] == pytest.approx(OVERHEAD_S)
    keep = ("matmul_curve", "forward_curve", "backward_curve", "weight_curve", "op_overhead_s", "view_overhead_s")
    keep += ("peak_flops",)
    return dataclasses.replace(MACHINE, **{k: compute[k] for k in keep})


def test_the_fit_prices_every_forward_backward_and_weight_sample_at_its_time():
    samples = _machine_samples()
    spec = _fitted(samples)
    assert spec.peak_flops["float32"] == pytest.approx(40e9)
    assert spec.view_overhead_s == pytest.approx(VIEW_S)
    bare = dataclasses.replace(spec, forward_curve={})
    for s in samples["contraction_passes"]:
        args = (s["flops"], s["bytes"], "float32", True, spec)
        assert compute_time(*args) == pytest.approx(s["forward_s"], rel=1e-9)
        # the forward as a step runs it is slower than the bare mm: priced so
        assert compute_time(*args) > compute_time(s["flops"], s["bytes"], "float32", True, bare)
        backward = 2 * compute_time(*args, product="backward")
        assert backward == pytest.approx(s["backward_s"], rel=1e-9)
        weight = weight_pass_time(True, compute_time(*args, product="weight"), backward, spec)
        assert weight == pytest.approx(s["weight_s"], rel=1e-9)
        # the backward's products run slower than the forward's on this machine: priced so
        assert backward > 2 * compute_time(*args)
    # a calibration without these samples (an older file) prices them as the bare forward product
    del samples["contraction_passes"], samples["view_chains"]
    older = _fitted(samples)
    assert older.forward_curve == {} and older.backward_curve == {} and older.weight_curve == {}
    assert older.view_overhead_s == 0.0
    for product in ("forward", "backward", "weight"):
        assert matmul_fraction(older, "float32", 30.0, product) == matmul_fraction(older, "float32", 30.0)
    with pytest.raises(ValueError, match="unknown contraction product 'dx'"):
        matmul_fraction(older, "float32", 30.0, "dx")


def _linear_records(cap, cluster: ClusterSpec) -> list:
    plan = plan_captured(cap, model_name="gpt", cluster=cluster, recompute="none", zero1=False)
    return [r for r in plan.to_dict()["records"] if r.get("target") == "aten.linear"]


def test_a_linear_backward_and_w_are_priced_at_the_backward_curves():
    """On one device (one strategy per op) with memory that never limits: every linear's
    forward is its product at the forward curve, its backward its two products at the backward
    curve, its ``W`` its weight product at the weight curve and the call; without those curves,
    all at the bare ``mm``'s rate."""
    flat = {"float32": [[1.0, 0.5]]}
    base = dataclasses.replace(
        get_cluster("h100"), op_overhead_s=OVERHEAD_S, memory_bandwidth=1e18, matmul_curve=flat, matmul_efficiency=1.0
    )
    slower = dataclasses.replace(
        base,
        forward_curve={"float32": [[1.0, 0.4]]},
        backward_curve={"float32": [[1.0, 0.25]]},
        weight_curve={"float32": [[1.0, 0.2]]},
    )
    model, inputs = gpt_demo(batch=2, seq=16, n_layer=1)
    cap = capture(model, inputs)
    analyze(cap)
    plain, measured = _linear_records(cap, base), _linear_records(cap, slower)
    assert len(plain) == len(measured) >= 4
    for p, m in zip(plain, measured):
        assert p["name"] == m["name"]
        product = p["forward_s"] - OVERHEAD_S  # the forward product at half the peak
        assert m["forward_s"] == pytest.approx(1.25 * product + OVERHEAD_S)  # at 0.4 of it
        assert p["compute_s"] - p["forward_s"] == pytest.approx(2 * (product + OVERHEAD_S))
        assert m["compute_s"] - m["forward_s"] == pytest.approx(2 * (2 * product + OVERHEAD_S))
        assert p["weight_grad_s"] == pytest.approx(product + 2 * OVERHEAD_S)
        assert m["weight_grad_s"] == pytest.approx(2.5 * product + 2 * OVERHEAD_S)


def test_views_are_priced_at_the_view_overhead_in_forward_and_backward():
    """Every view op of a GPT (reshapes, transposes, the QKV split) costs ``view_overhead_s``
    forward and again backward where a gradient passes it (not the integer targets' view); a
    cluster without it prices them at 0."""
    model, inputs = gpt_demo(batch=2, seq=16, n_layer=1)
    cap = capture(model, inputs)
    analyze(cap)

    def views(cluster):
        plan = plan_captured(cap, model_name="gpt", cluster=cluster, recompute="none", zero1=False)
        kinds = ("aten.view", "aten.transpose.int", "aten.split.Tensor")
        return [r for r in plan.to_dict()["records"] if r.get("target") in kinds]

    priced, free = views(MACHINE), views(dataclasses.replace(MACHINE, view_overhead_s=0.0))
    assert len(priced) == len(free) >= 8
    for r in priced:
        passes = 2 if r["dtype"] == "float32" else 1
        assert r["forward_s"] == pytest.approx(VIEW_S) and r["compute_s"] == pytest.approx(passes * VIEW_S), r["name"]
    assert sum(r["dtype"] == "float32" for r in priced) >= 8
    assert all(r["compute_s"] == 0.0 for r in free)


def test_a_rated_op_is_priced_at_its_rate_alone():
    """A measured rate was timed with the op's memory traffic: no roofline memory term beside it."""
    rated = dataclasses.replace(MACHINE, op_rates={"float32": {"aten.gelu": 1e9}})
    slow_memory = dataclasses.replace(rated, memory_bandwidth=1e3)
    t = compute_time(1e6, 1e9, "float32", False, slow_memory, op="aten.gelu")
    assert t == pytest.approx(1e6 / 1e9 + OVERHEAD_S)
    # an op without a rate still meets the roofline
    assert compute_time(1e6, 1e9, "float32", False, slow_memory, op="aten.tanh") == pytest.approx(1e6 + OVERHEAD_S)


def test_the_measured_curves_round_trip_through_a_cluster_file(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(cluster_file_dict(MACHINE)))
    assert load_cluster_file(path) == MACHINE
    assert load_cluster_file(path).backward_curve == BACKWARD
    assert load_cluster_file(path).forward_curve == STEP_FORWARD
    assert load_cluster_file(path).view_overhead_s == VIEW_S
    # a spec without them writes the JSON it wrote before they existed
    before = dataclasses.replace(MACHINE, forward_curve={}, backward_curve={}, weight_curve={}, view_overhead_s=0.0)
    for name in ("forward_curve", "backward_curve", "weight_curve", "view_overhead_s"):
        assert name not in before.to_dict(), name
    assert ClusterSpec.from_dict(before.to_dict()) == before
