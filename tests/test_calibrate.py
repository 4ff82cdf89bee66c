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
from partitioner.calibrate import COLLECTIVES, TINY_SIZES, collective_design, fit, rank_samples, write_cluster_file
from partitioner.cluster import ClusterSpec, LinkSpec, get_cluster
from partitioner.models import gpt_demo
from passes.cost_model import Collective, collective_time, compute_time
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
        assert main(["calibrate", "--quick", "--ranks", "2", "--out", str(out_path), "--name", "cli"]) == 0
    assert "measuring on 2 gloo ranks" in err.getvalue() and "cluster file written to" in err.getvalue()
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
