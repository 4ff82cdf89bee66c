"""``partitioner calibrate``: the fit, the cluster file, and planning with it.

No assertion reads a timing: the fit is checked on samples made from a known model (it must
give that model back) and, on a real (tiny) measurement, for being the least-squares optimum
of the model over its own samples, priced through the cost model the planner uses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math

import numpy as np
import pytest

import partitioner
from partitioner.__main__ import main
from partitioner.calibration.calibrate import write_cluster_file
from partitioner.calibration.fit import collective_design, fit
from partitioner.calibration.measure import rank_samples
from partitioner.calibration.sizes import COLLECTIVES, TINY_SIZES
from partitioner.cluster import ClusterSpec, LinkSpec
from partitioner.local_cluster import get_cluster
from partitioner.models import gpt_demo
from passes.plan.cost_model import Collective, collective_time, compute_time, measured_rate
from runtime.launch import run_on_ranks

KNOWN = ClusterSpec(
    name="known",
    peak_flops={"float32": 40e9, "bfloat16": 12e9, "float16": 40e9},
    memory_bandwidth=20e9,
    memory_bytes=1 << 30,
    devices_per_node=4,
    intra_node=LinkSpec(bandwidth=2e9, latency_s=30e-6),
    inter_node=LinkSpec(bandwidth=2e9, latency_s=30e-6),
    collective_overhead_s=150e-6,
    matmul_efficiency=1.0,
    op_overhead_s=6e-6,
    collective_efficiency={"all_gather": 0.5, "reduce_scatter": 0.8, "all_to_all": 0.25, "send_recv": 1.5},
)


CALL_S = 2e-6  # a bare op call's cost (what matmul and elementwise loops pay beyond their work)


def samples_of(spec: ClusterSpec) -> dict:
    """What a machine that is exactly ``spec`` would measure."""
    out: dict = {"matmul": [], "elementwise": [], "chains": [], "collectives": []}
    bare = dataclasses.replace(spec, op_overhead_s=CALL_S)
    for dtype in ("float32", "bfloat16"):
        for n in (64, 128, 256):
            flops = 2 * n**3
            out["matmul"].append(
                {"dtype": dtype, "n": n, "flops": flops, "s": compute_time(flops, 0, dtype, True, bare)}
            )
    for numel in (1 << 10, 1 << 16, 1 << 20):
        nbytes = 12 * numel
        out["elementwise"].append({"bytes": nbytes, "s": compute_time(0, nbytes, None, False, bare)})
    for ops in (8, 32, 128):  # forward and backward of each op: two overheads (tiny tensors: no work)
        out["chains"].append({"ops": ops, "s": 40e-6 + 2 * ops * spec.op_overhead_s})
    for n in (2, 4):
        for kind in COLLECTIVES:
            for payload in (1 << 10, 1 << 16, 1 << 22):
                t = collective_time(Collective(kind, 0, payload), (n,), spec)
                out["collectives"].append({"kind": kind, "n": n, "payload": payload, "s": t})
    return out


def test_fit_gives_back_the_model_that_made_the_samples():
    got = fit(samples_of(KNOWN), ranks=4, name="known", memory_bytes=KNOWN.memory_bytes)
    for name in ("memory_bandwidth", "collective_overhead_s", "op_overhead_s"):
        assert math.isclose(getattr(got, name), getattr(KNOWN, name), rel_tol=1e-6), name
    assert math.isclose(got.intra_node.bandwidth, KNOWN.intra_node.bandwidth, rel_tol=1e-6)
    assert math.isclose(got.intra_node.latency_s, KNOWN.intra_node.latency_s, rel_tol=1e-6)
    for dtype in ("float32", "bfloat16"):
        assert math.isclose(got.peak_flops[dtype], KNOWN.peak_flops[dtype], rel_tol=1e-6), dtype
    assert got.peak_flops["float16"] == got.peak_flops["float32"]  # not measured: the float32 figure
    assert got.collective_efficiency.keys() == KNOWN.collective_efficiency.keys()
    for kind, eff in KNOWN.collective_efficiency.items():
        assert math.isclose(got.collective_efficiency[kind], eff, rel_tol=1e-6), kind


def test_fit_keeps_fixed_costs_nonnegative():
    # times that shrink with size (noise on a busy machine) must not give negative overheads or slopes
    samples = samples_of(KNOWN)
    for s in samples["elementwise"]:
        s["s"] = 1e-5 / math.log2(s["bytes"])
    for s in samples["chains"]:
        s["s"] = 1e-4 / s["ops"]
    for s in samples["collectives"]:
        s["s"] = 1e-3 / math.log2(s["payload"])
    got = fit(samples, ranks=4)
    assert got.op_overhead_s >= 0 and got.memory_bandwidth > 0
    assert got.collective_overhead_s >= 0 and got.intra_node.latency_s >= 0 and got.intra_node.bandwidth > 0
    assert all(v > 0 for v in got.collective_efficiency.values())


def _orthogonal(design: np.ndarray, residual: np.ndarray) -> None:
    """Weighted least squares optimum: the (relative) residual is orthogonal to every fitted column."""
    for j in range(design.shape[1]):
        col = design[:, j] / np.linalg.norm(design[:, j])
        assert abs(col @ residual) < 1e-9 * max(1.0, float(np.linalg.norm(residual))), (j, col @ residual)


def test_calibrate_writes_a_cluster_file_that_loads_and_plans(tmp_path):
    samples = run_on_ranks(rank_samples, 2, TINY_SIZES, timeout_s=60)[0]
    assert {s["kind"] for s in samples["collectives"]} == set(COLLECTIVES)
    spec = fit(samples, ranks=2, name="here")
    rates = spec.op_rates.get("float32", {})  # tiny sizes: an op that is all overhead rates nothing
    assert set(rates) <= {s["op"] for s in samples["ops"]}
    for op in rates:  # attention's rates are a grid over its shapes
        rate = measured_rate(spec, "float32", op)
        assert 0 < rate < 100 * spec.peak_flops["float32"], op
    assert set(spec.optimizer_steps) == {"adam", "sgd"}
    assert all(s["tensor_s"] >= 0 and s["bandwidth"] > 0 for s in spec.optimizer_steps.values())
    path = tmp_path / "cluster.json"
    write_cluster_file(path, spec, samples, 2)
    assert get_cluster(path) == spec and get_cluster(str(path)) == spec
    assert json.loads(path.read_text())["samples"] == samples

    # the written model, priced by the cost model, is the least-squares optimum over its samples
    coll = samples["collectives"]
    t = np.array([s["s"] for s in coll])
    pred = np.array([collective_time(Collective(s["kind"], 0, s["payload"]), (s["n"],), spec) for s in coll])
    design = np.array([collective_design(s["kind"], s["n"], s["payload"]) for s in coll])
    coef = [spec.collective_overhead_s, spec.intra_node.latency_s] + [1.0] * len(COLLECTIVES)
    kept = [j for j, c in enumerate(coef) if c > 0]
    _orthogonal(design[:, kept] / t[:, None], (t - pred) / t)

    # cluster=<path> plans, and the plan records the measured cluster
    model, inputs = gpt_demo(batch=2, seq=8, n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    plan = partitioner.plan(model, inputs, mesh_shape=(2,), cluster=str(path))
    assert ClusterSpec.from_dict(plan.data["cluster"]) == spec
    assert plan.estimate().step_time_s > 0

    # the command line: progress on stderr, the spec on stdout, the file readable by --cluster
    out_path = tmp_path / "cli.json"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        args = ["calibrate", "--quick", "--repeats", "2", "--ranks", "2", "--out", str(out_path), "--name", "cli"]
        assert main(args) == 0
    assert "measuring on 2 gloo ranks" in err.getvalue() and "cluster file written to" in err.getvalue()
    assert "pass 2 of 2" in err.getvalue()  # two passes, each figure their median
    assert ClusterSpec.from_dict(json.loads(out.getvalue())) == get_cluster(out_path)
    assert get_cluster(out_path).name == "cli"


def test_bad_cluster_files_are_named(tmp_path):
    missing = tmp_path / "none.json"
    with pytest.raises(ValueError, match="cannot read cluster file"):
        get_cluster(str(missing))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"cluster": {"name": "x", "speed": 3}}))
    with pytest.raises(ValueError, match="holds no cluster description.*partitioner calibrate"):
        get_cluster(bad)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["calibrate", "--ranks", "1", "--out", str(tmp_path / "c.json")]) == 2
    assert "--ranks must be >= 2" in err.getvalue()


CURVE = {"float32": [[8.0, 0.4], [32.0, 0.8], [96.0, 1.0]], "bfloat16": [[4.0, 0.25], [48.0, 0.5]]}
SHAPES = {"float32": ((64, 64, 64), (512, 16, 512), (256, 256, 256)), "bfloat16": ((64, 16, 64), (256, 256, 256))}


def test_matmul_curve_fit_gives_back_its_samples():
    """Narrow and square products timed on a machine whose rate follows a known curve: the fit's
    peak is the best rate measured, and the cost model with the fitted curve prices every sample
    at its measured time."""
    bare = dataclasses.replace(KNOWN, matmul_curve=CURVE, op_overhead_s=CALL_S)
    samples = samples_of(KNOWN)
    samples["matmul"] = []
    for dtype, shapes in SHAPES.items():
        elem = 4 if dtype == "float32" else 2
        for m, k, n in shapes:
            flops, nbytes = 2 * m * k * n, (m * k + k * n + m * n) * elem
            t = compute_time(flops, nbytes, dtype, True, bare)
            samples["matmul"].append({"dtype": dtype, "m": m, "k": k, "n": n, "flops": flops, "bytes": nbytes, "s": t})
    got = fit(samples, ranks=4)
    priced_by = dataclasses.replace(got, op_overhead_s=CALL_S)
    for s in samples["matmul"]:
        assert math.isclose(compute_time(s["flops"], s["bytes"], s["dtype"], True, priced_by), s["s"], rel_tol=1e-9)
    for dtype in SHAPES:
        best = max(s["flops"] / (s["s"] - CALL_S) for s in samples["matmul"] if s["dtype"] == dtype)
        assert math.isclose(got.peak_flops[dtype], best, rel_tol=1e-9)
        assert max(y for _, y in got.matmul_curve[dtype]) == 1.0 and len(got.matmul_curve[dtype]) == len(SHAPES[dtype])


def test_cost_model_reads_the_matmul_curve():
    spec = dataclasses.replace(KNOWN, op_overhead_s=0.0, memory_bandwidth=1e15, matmul_curve=CURVE)
    flops = 4e9  # float32 peak 40 GFLOP/s: 0.1 s at the full rate
    assert math.isclose(compute_time(flops, flops / 96, "float32", True, spec), 0.1)
    assert math.isclose(compute_time(flops, flops / 500, "float32", True, spec), 0.1)  # flat beyond the ends
    assert math.isclose(compute_time(flops, flops / 8, "float32", True, spec), 0.1 / 0.4)
    assert math.isclose(compute_time(flops, flops / 2, "float32", True, spec), 0.1 / 0.4)
    assert math.isclose(compute_time(flops, flops / 16, "float32", True, spec), 0.1 / 0.6)  # halfway in log 8..32
    assert math.isclose(compute_time(flops, flops / 16, "float16", True, spec), 0.1 / 0.6)  # float16: float32's curve
    # bfloat16 its own curve (peak 12 GFLOP/s); elementwise ops ignore the curve
    assert math.isclose(compute_time(flops, flops / 48, "bfloat16", True, spec), flops / 12e9 / 0.5)
    assert math.isclose(compute_time(flops, flops / 8, "float32", False, spec), 0.1)
    # without a curve (the presets): matmul_efficiency for every shape
    h100 = get_cluster("h100")
    assert h100.matmul_curve == {}
    assert math.isclose(compute_time(1e12, 1e9, "bfloat16", True, h100), 1e12 / (989e12 * 0.7))


def test_fresh_allocations_are_fitted_and_priced_under_a_budget():
    from partitioner.local_cluster import for_memory_budget
    from passes.plan.cost_model import allocation_time
    from runtime.host_memory import MMAP_THRESHOLD

    per_byte = 0.9e-9
    samples = samples_of(KNOWN)
    samples["fresh"] = [
        {"bytes": b, "kept_s": 1e-6 + b / 20e9, "s": 1e-6 + b / 20e9 + b * per_byte}
        for b in (1 << 18, 1 << 21, 1 << 23)
    ]
    got = fit(samples, ranks=4)
    assert math.isclose(got.fresh_page_s_per_byte, per_byte, rel_tol=1e-9) and not got.fresh_allocations
    assert fit(samples_of(KNOWN), ranks=4).fresh_page_s_per_byte == 0.0  # not measured: not priced

    assert allocation_time(1 << 20, got) == 0.0  # glibc's threshold left alone: nothing to price
    under = for_memory_budget(got, "1GiB")
    assert under.fresh_allocations and for_memory_budget(got, None) is got
    assert for_memory_budget("h100", "1GiB") == get_cluster("h100")  # nothing measured: unchanged
    assert math.isclose(allocation_time(1 << 20, under), (1 << 20) * per_byte)
    assert allocation_time(MMAP_THRESHOLD - 4, under) == 0.0  # from the heap

    # the planner adds them per op: lm_head's output (8 x 64 x 256 fp32, 512 KiB) in forward, the
    # gradient of its input (ln_f's output, 128 KiB) in backward; its weight (64 KiB) is under the threshold
    model, inputs = gpt_demo(batch=8, seq=64, n_layer=1, n_embd=64, n_head=2, vocab_size=256)
    base = partitioner.plan(model, inputs, mesh_shape=(1,), cluster=got)
    fresh = partitioner.plan(model, inputs, mesh_shape=(1,), cluster=under)
    name = next(r["name"] for r in base.records if r.get("module") == "lm_head" and r["kind"] == "op")
    extra = fresh.record(name)["compute_s"] - base.record(name)["compute_s"]
    assert math.isclose(extra, (8 * 64 * 256 * 4 + 8 * 64 * 64 * 4) * per_byte, rel_tol=1e-9)
    assert fresh.estimate().step_time_s > base.estimate().step_time_s


def test_prefetch_overlap_is_fitted():
    """``prefetch_overlap``: the part of the shorter of a gather and the compute beside it that
    running them together hid, within 0-1; 1.0 (the presets' full credit) when not measured."""
    samples = samples_of(KNOWN)
    assert fit(samples, ranks=4).prefetch_overlap == 1.0
    samples["overlap"] = {"payload": 1 << 21, "compute_s": 4e-3, "gather_s": 6e-3, "both_s": 8e-3}
    assert math.isclose(fit(samples, ranks=4).prefetch_overlap, 0.5)  # 2 ms of the 4 hidden
    samples["overlap"]["both_s"] = 12e-3  # together slower than one after the other: nothing hidden
    assert fit(samples, ranks=4).prefetch_overlap == 0.0
    samples["overlap"]["both_s"] = 5e-3  # as if the compute were free: capped at all of it
    assert fit(samples, ranks=4).prefetch_overlap == 1.0


def test_arrival_wait_is_fitted_and_priced_per_call():
    """``arrival_wait``: per run time of matmuls before a tiny all-reduce, the time inside it beyond
    its time after the shortest run (>= 0, non-decreasing); the cost
    model reads it piecewise linearly, flat beyond the ends; the estimate adds it once per
    collective call (a constant curve: that much per call)."""
    from passes.plan.cost_model import arrival_wait

    samples = samples_of(KNOWN)
    assert fit(samples, ranks=4).arrival_wait == []
    samples["arrival"] = [  # the all-reduce took 3, 6, 5 and 9 ms after these runs
        {"compute_s": b, "s": s} for b, s in ((2e-3, 3e-3), (1e-2, 6e-3), (3e-2, 5e-3), (1e-1, 9e-3))
    ]
    got = fit(samples, ranks=4)
    assert got.arrival_wait == [
        [2e-3, 0.0],
        [1e-2, pytest.approx(3e-3)],
        [3e-2, pytest.approx(3e-3)],
        [1e-1, pytest.approx(6e-3)],
    ]
    assert arrival_wait(1e-3, got) == 0.0 and arrival_wait(1.0, got) == pytest.approx(6e-3)
    assert arrival_wait(6e-3, got) == pytest.approx(1.5e-3)
    assert arrival_wait(1.0, get_cluster("h100")) == 0.0

    model, inputs = gpt_demo(batch=8, seq=16, n_layer=2, n_embd=64, n_head=4, vocab_size=128)
    wait = 2.5e-3
    flat = dataclasses.replace(got, arrival_wait=[[0.0, wait], [1.0, wait]])
    for cluster in (flat, dataclasses.replace(got, arrival_wait=[])):
        pins = {"idx": ["S(0)"], "targets": ["S(0)"], "h.*": ["S(0)"], "ln_f": ["S(0)"], "lm_head": ["S(0)"]}
        est = partitioner.plan(model, inputs, mesh_shape=(4,), cluster=cluster, recompute="all", pins=pins).estimate()
        calls = sum(n for kinds in est.comm_calls.values() for n in kinds.values())
        assert calls >= 3
        assert est.arrival_wait_s == pytest.approx(wait * calls if cluster.arrival_wait else 0.0, rel=1e-12)
        assert est.step_time_s == pytest.approx(est.compute_s + est.comm_s + est.optimizer_s, rel=1e-12)


def test_op_rates_fit_gives_back_their_samples():
    """Ops timed forward + backward on a machine whose rates are known: the fit gives the rates
    back (attention's as a grid over its shapes), and the cost model prices every sample (each
    pass: its FLOPs at the rate plus the op's fixed cost) at its measured time."""
    rates = {"float32": {"aten.gelu": 2e9}, "bfloat16": {"aten.gelu": 1e9}}
    grid = {(64, 16): 20e9, (64, 64): 30e9, (256, 16): 40e9, (256, 64): 80e9}  # (sequence, head dim)
    samples = samples_of(KNOWN)
    samples["ops"] = []
    for dtype, ops in rates.items():
        for op, rate in ops.items():
            for flops in (1e6, 5e7):
                t = 2 * (flops / rate + KNOWN.op_overhead_s)
                samples["ops"].append({"op": op, "dtype": dtype, "flops": flops, "passes": 2, "s": t})
    attention = "aten.scaled_dot_product_attention"
    for (q, d), rate in grid.items():
        flops = 4 * 8 * q * q * d
        t = 3 * (flops / rate + KNOWN.op_overhead_s)
        samples["ops"].append(
            {"op": attention, "dtype": "float32", "flops": flops, "passes": 3, "s": t, "shape": [q, d]}
        )
    got = fit(samples, ranks=4)
    assert got.op_rates.keys() == rates.keys()
    for dtype, ops in rates.items():
        for op, rate in ops.items():
            assert math.isclose(got.op_rates[dtype][op], rate, rel_tol=1e-6), (dtype, op)
    assert got.op_rates["float32"][attention]["axes"] == [[64, 256], [16, 64]]
    for s in samples["ops"]:
        contraction = s["passes"] == 3
        priced = s["passes"] * compute_time(s["flops"], 0.0, s["dtype"], contraction, got, s["op"], s.get("shape"))
        assert math.isclose(priced, s["s"], rel_tol=1e-6)
    # between the points: piecewise linear in the log of each axis; beyond them: the edge
    assert math.isclose(measured_rate(got, "float32", attention, (128, 32)), 42.5e9, rel_tol=1e-6)
    assert math.isclose(measured_rate(got, "float32", attention, (128, 16)), 30e9, rel_tol=1e-6)
    assert math.isclose(measured_rate(got, "float32", attention, (4096, 8)), 40e9, rel_tol=1e-6)
    assert math.isclose(measured_rate(got, "float32", attention, (4096, 1e6)), 80e9, rel_tol=1e-6)
    assert math.isclose(measured_rate(got, "float32", attention), 42.5e9, rel_tol=1e-6)  # no shape: the mean
    assert measured_rate(got, "bfloat16", attention, (128, 32)) is None
    with pytest.raises(ValueError, match=r"grid over 2 shape axes; it was asked at \(128,\)"):
        measured_rate(got, "float32", attention, (128,))
    # the grid survives a cluster file
    assert ClusterSpec.from_dict(json.loads(json.dumps(got.to_dict()))) == got


def test_a_grid_point_left_unmeasured_takes_its_nearest_neighbour():
    """A point whose samples were all fixed cost rates nothing; the grid keeps it with the rate of
    the measured point nearest in log coordinates, not a mean over far-away shapes."""
    from partitioner.calibration.fit import op_rates

    def sample(q, d, rate, overhead_only=False):
        flops = 4 * q * q * d
        t = 3 * (0.0 if overhead_only else flops / rate) + 3 * 1e-6
        return {
            "op": "aten.scaled_dot_product_attention",
            "dtype": "float32",
            "flops": flops,
            "passes": 3,
            "s": t,
            "shape": [q, d],
        }

    samples = [
        sample(64, 16, 20e9, overhead_only=True),
        sample(64, 128, 30e9),
        sample(1024, 16, 40e9),
        sample(1024, 128, 90e9),
    ]
    grid = op_rates(samples, 1e-6)["float32"]["aten.scaled_dot_product_attention"]
    assert grid["axes"] == [[64, 1024], [16, 128]]
    (a, b), (c, d) = grid["rates"]
    assert (b, c, d) == pytest.approx((30e9, 40e9, 90e9))
    assert a == pytest.approx(30e9)  # (64, 16): 3 log-steps from (64, 128), 4 from (1024, 16)


def test_a_malformed_rate_grid_is_refused_on_load():
    """A hand-written cluster file whose grid cannot be read fails when it loads, naming the op."""
    spec = dataclasses.replace(
        KNOWN,
        op_rates={
            "float32": {"aten.scaled_dot_product_attention": {"axes": [[64, 256], [16]], "rates": [[1e9], [2e9, 3e9]]}}
        },
    )
    with pytest.raises(
        ValueError, match=r"op_rates\['float32'\]\['aten.scaled_dot_product_attention'\]: not a rate grid"
    ):
        ClusterSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    spec = dataclasses.replace(KNOWN, op_rates={"float32": {"x": {"axes": [[256, 64]], "rates": [1e9, 2e9]}}})
    with pytest.raises(ValueError, match=r"not positive and increasing"):
        ClusterSpec.from_dict(spec.to_dict())


def test_the_planner_prices_a_rated_op_at_its_rate():
    """A measured rate replaces the roofline for that op (by name and dtype) and no other."""
    model, inputs = gpt_demo(batch=2, seq=8, n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    slow = dataclasses.replace(KNOWN, op_rates={"float32": {"aten.gelu": 1e6}, "bfloat16": {"aten.layer_norm": 1e3}})
    rated = partitioner.plan(model, inputs, mesh_shape=(1,), cluster=slow).records
    plain = partitioner.plan(model, inputs, mesh_shape=(1,), cluster=KNOWN).records
    gelu = [r for r in rated if r["target"] == "aten.gelu"]
    assert len(gelu) == 1
    numel = math.prod(gelu[0]["shapes"][0])  # the rule's FLOPs: one per output element
    assert math.isclose(gelu[0]["compute_s"], 2 * (numel / 1e6 + KNOWN.op_overhead_s), rel_tol=1e-9)
    for a, b in zip(rated, plain):
        if a["target"] != "aten.gelu":  # float32 layer norms: the bfloat16 rate does not apply
            assert a["compute_s"] == b["compute_s"], a["name"]


def test_the_planner_reads_an_attention_rate_at_the_attention_shape():
    """A rate kept over (sequence length, head dimension) prices each attention at its own
    shape: two models whose attention differs only in head dimension get the grid's two rates."""
    attention = "aten.scaled_dot_product_attention:causal"
    grid = {"axes": [[8, 64], [8, 32]], "rates": [[1e6, 4e6], [1e6, 4e6]]}
    cluster = dataclasses.replace(KNOWN, op_rates={"float32": {attention: grid}})
    for n_head, rate in ((4, 1e6), (1, 4e6)):  # n_embd 32: head dimension 8, then 32
        model, inputs = gpt_demo(batch=2, seq=8, n_layer=1, n_embd=32, n_head=n_head, vocab_size=64)
        record = next(
            r
            for r in partitioner.plan(model, inputs, mesh_shape=(1,), cluster=cluster).records
            if r["target"] == "aten.scaled_dot_product_attention"
        )
        flops = 4 * 2 * n_head * 8 * 8 * (32 // n_head)
        assert math.isclose(record["compute_s"], 3 * (flops / rate + KNOWN.op_overhead_s), rel_tol=1e-9)


def test_op_samples_count_what_the_rules_count():
    """The measured ops carry the FLOPs their rules count and the passes the cost model charges."""
    from partitioner.calibration.measure_compute import op_samples

    samples = op_samples(TINY_SIZES)
    by_op = {s["op"]: s for s in samples}
    assert {"aten.gelu", "aten.layer_norm", "aten.scaled_dot_product_attention", "aten.softmax.int"} <= set(by_op)
    assert all(s["dtype"] == "float32" and s["s"] > 0 and s["flops"] > 0 for s in samples)
    n, d = TINY_SIZES["op_tokens"], TINY_SIZES["op_width"]
    assert by_op["aten.gelu"]["flops"] == n * d and by_op["aten.gelu"]["passes"] == 2
    grid = TINY_SIZES["attention"]
    attention = [s for s in samples if s["op"] == "aten.scaled_dot_product_attention"]
    assert sorted(tuple(s["shape"]) for s in attention) == sorted((q, d) for q in grid["seq"] for d in grid["head_dim"])
    for s in attention:
        q, d = s["shape"]
        b = max(1, grid["rows"] // (grid["heads"] * q))
        assert s["flops"] == 4 * b * grid["heads"] * q * q * d and s["passes"] == 3  # dq and dk, dv: two products


def test_repeated_passes_merge_to_their_medians():
    """A pass spoilt by a slow spell of the machine does not move the calibration: every time is
    the median over the passes, sizes and names stay as measured, mismatched passes are refused."""
    from partitioner.calibration.measure import median_samples

    def one_pass(scale):
        return {
            "matmul": [{"dtype": "float32", "m": 64, "flops": 524288, "s": 1e-4 * scale}],
            "collectives": [{"kind": "all_reduce", "n": 2, "payload": 1024, "s": 2e-4 * scale}],
            "overlap": {"payload": 2048, "both_s": 3e-3 * scale},
            "shape": (4, 8),
            "fresh": True,
        }

    merged = median_samples([one_pass(1.0), one_pass(1.6), one_pass(1.1)])
    assert merged["matmul"] == [{"dtype": "float32", "m": 64, "flops": 524288, "s": 1e-4 * 1.1}]
    assert merged["collectives"][0]["s"] == 2e-4 * 1.1 and merged["collectives"][0]["payload"] == 1024
    assert merged["overlap"] == {"payload": 2048, "both_s": 3e-3 * 1.1}
    assert merged["shape"] == (4, 8) and merged["fresh"] is True  # not numbers: the first pass's
    short = one_pass(1.0)
    short["matmul"] = []
    with pytest.raises(ValueError, match="different sample lists"):
        median_samples([one_pass(1.0), short])


def test_optimizer_steps_are_fitted_and_priced_per_tensor():
    """Optimizer steps timed on a machine with a known fixed cost per tensor and rate: the fit
    gives both back, and a plan prices each parameter's step with them (a fixed cost per tensor
    plus its bytes at the measured rate) where the roofline priced the bytes only."""
    from partitioner.calibration.fit import optimizer_steps
    from passes.plan.cost_model import optimizer_step_bytes, optimizer_step_time

    known = {"adam": {"tensor_s": 40e-6, "bandwidth": 10e9}, "sgd": {"tensor_s": 3e-6, "bandwidth": 40e9}}
    samples = []
    for name, k in known.items():
        for tensors, numel in ((64, 64), (16, 1 << 16), (4, 1 << 20)):
            t = tensors * (k["tensor_s"] + optimizer_step_bytes(numel, 4, name) / k["bandwidth"])
            samples.append({"optimizer": name, "tensors": tensors, "numel": numel, "s": t})
    got = optimizer_steps(samples)
    for name, k in known.items():
        assert math.isclose(got[name]["tensor_s"], k["tensor_s"], rel_tol=1e-6), name
        assert math.isclose(got[name]["bandwidth"], k["bandwidth"], rel_tol=1e-6), name
    spec = dataclasses.replace(KNOWN, optimizer_steps=got)
    for s in samples:
        priced = s["tensors"] * optimizer_step_time(s["numel"], 4, s["optimizer"], spec, offloaded=False)
        assert math.isclose(priced, s["s"], rel_tol=1e-6)
    # noise that makes the two-term line's byte slope negative: the better one-term line instead
    flat = [dict(s, s=s["tensors"] * 50e-6) for s in samples if s["optimizer"] == "adam"]
    flat[-1]["s"] *= 0.9
    one = optimizer_steps(flat)["adam"]
    assert one["bandwidth"] == math.inf and 40e-6 < one["tensor_s"] < 50e-6
    # without a measured step (the presets): the bytes at memory bandwidth, as before
    assert optimizer_step_time(1e6, 4, "adam", KNOWN, offloaded=False) == 28e6 / KNOWN.memory_bandwidth

    model, inputs = gpt_demo(batch=2, seq=8, n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    records = partitioner.plan(model, inputs, mesh_shape=(1,), cluster=spec, optimizer="adam").records
    params = [r for r in records if r["kind"] == "param"]
    assert params and all("optimizer_step_s" in r for r in params)
    for r in params:
        numel = math.prod(r["shapes"][0])
        expected = 40e-6 + optimizer_step_bytes(numel, 4, "adam") / 10e9
        assert math.isclose(r["optimizer_step_s"], expected, rel_tol=1e-6), r["name"]


def test_rate_keys_name_the_kernel_variants():
    """Causal attention and the tanh GELU run other kernels than their plain forms: their rates
    are kept under their own names, which calibration and the planner both take from the node."""
    import torch
    import torch.fx as fx

    from passes.rules import rate_key

    aten = torch.ops.aten
    sdpa = aten.scaled_dot_product_attention.default
    graph = fx.Graph()
    q, k, v = (graph.placeholder(n) for n in "qkv")
    cases = [
        (graph.call_function(sdpa, (q, k, v)), "aten.scaled_dot_product_attention"),
        (graph.call_function(sdpa, (q, k, v), {"is_causal": True}), "aten.scaled_dot_product_attention:causal"),
        (graph.call_function(sdpa, (q, k, v, None, 0.0, True)), "aten.scaled_dot_product_attention:causal"),
        (graph.call_function(aten.gelu.default, (q,)), "aten.gelu"),
        (graph.call_function(aten.gelu.default, (q,), {"approximate": "tanh"}), "aten.gelu:tanh"),
        (graph.call_function(aten.softmax.int, (q, -1)), "aten.softmax.int"),
    ]
    for node, key in cases:
        assert rate_key(node) == key
