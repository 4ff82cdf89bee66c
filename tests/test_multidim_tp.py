"""2D, 2.5D and 3D tensor parallelism (``tensor_parallel=``, :mod:`passes.rules.multidim_tp`).

Two forked runs (the 4-rank and the 8-rank configs together, see ``_run``), each config checked
to the parity standard (``parity_utils.parity_worker``: loss, every gradient, parameters after 3
AdamW steps against one device; communication counted at run time equal to the plan's estimate,
in total and per phase):

* 2D on (2, 2): the hand-written GPT, HF LLaMA (2 layers), HF ViT and HF GPT-2 (Conv1D weights,
  ``addmm``, stored ``[K, N]``);
* 2.5D on (2, 2, 2) and 3D on (2, 2, 2): GPT and LLaMA; 3D's linear weights stored W/p on every
  rank (bytes counted on each rank equal to the plan's estimate and to the whole weight / 8).

Every linear layer of those plans must run its algorithm's grid (classified from the plan's
records), and one linear layer alone (its input a parameter, so dX is reduce-scattered too) must
communicate exactly :func:`passes.rules.multidim_tp.linear_comm_bytes` per algorithm, counted at run
time (plus the loss's 4-byte all-reduce per axis). The rest runs no ranks: meshes of the wrong
shape and batches the grid cannot split are refused with the shape needed.
"""

import math

import pytest
import torch
from parity_utils import MODELS, Checks, build, built_in_parent, nested_approx_equal, parity_worker

from passes.rules.multidim_tp import check_mesh, linear_comm_bytes
from runtime.launch import run_on_ranks

TIMEOUT_S = 240
M, K, N = 8, 16, 32


class OneLinear(torch.nn.Module):
    """``sum((x W^T - t)^2)`` with ``x`` a parameter: one linear layer whose input needs a gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.x = torch.nn.Parameter(torch.randn(M, K))
        self.lin = torch.nn.Linear(K, N, bias=False)

    def forward(self, t):
        return ((self.lin(self.x) - t) ** 2).sum()


# the algorithm's layouts: x arrives as the previous layer leaves it, t as this one's output
LINEAR_PINS = {
    "2d": {"x": ["S(0)", "S(1)"], "t": ["S(0)", "S(1)"]},
    "2.5d": {"x": ["S(0)", "S(0)", "S(1)"], "t": ["S(0)", "S(0)", "S(1)"]},
    "3d": {
        "x": ["S(0)", "S(0)", "S(1)"],
        "t": ["S(0)", "S(1)", "S(0)"],
        "lin.weight": ["Si(1)", "S(0)", "S(1)"],  # W/p: cut once more over a0, innermost
        # Y reduce-scattered onto its rows, as the next layer takes it (at these tiny sizes
        # latency rules, and an all-reduce with a gather of t would be cheaper)
        "sub": ["S(0)", "S(1)", "S(0)"],
    },
}


def _linear_worker(rank, mode, mesh):
    import partitioner

    checks = Checks(rank)
    model = OneLinear()
    t = torch.randn(M, N, generator=torch.Generator().manual_seed(1))
    pm = partitioner.auto_parallelize(
        model, (t,), mesh=mesh, pins=LINEAR_PINS[mode], cluster="h100", tensor_parallel=mode
    )
    from runtime.collectives import CommCounter

    with CommCounter() as counter:
        pm(t).backward()
    ref = OneLinear()
    ref_loss = ((ref.lin(ref.x) - t) ** 2).sum()
    ref_loss.backward()
    grads = pm.full_grads()
    checks.close("grad of x", grads["x"], ref.x.grad)
    checks.close("grad of lin.weight", grads["lin.weight"], ref.lin.weight.grad)
    return dict(
        failures=checks.failures,
        counted=counter.phase_dict(),
        estimated=pm.plan.estimate().comm_bytes_by_phase,
        roles=_roles(pm.plan.records),
    )


def _roles(records) -> dict:
    return {r["name"]: r["tensor_parallel"] for r in records if r.get("tensor_parallel")}


def _weight_storage(records, param_bytes) -> dict:
    """Per weight a weight contraction reads: (its placement, bytes on this rank, the plan's
    estimate of them, its whole bytes)."""
    by_name = {r["name"]: r for r in records}
    out = {}
    for r in records:
        if r.get("tp_weight") and by_name[r["tp_weight"]].get("kind") == "param":
            w = by_name[r["tp_weight"]]
            local, whole = param_bytes[w["fqn"]]
            out[w["fqn"]] = (w["out"][0], local, w.get("parameters"), whole)  # a tied copy: none
    return out


def _worker(rank, world, jobs):
    out = []
    for kind, job in jobs:
        if kind == "model":
            result = parity_worker(rank, world, job)
            records = result.pop("records")
            result["roles"] = _roles(records)
            result["weights"] = _weight_storage(records, result.pop("param_bytes"))
            out.append(result)
        else:
            out.append(_linear_worker(rank, *job))
    return out


def _run(jobs, world):
    # each model built and captured here before the ranks fork (a model in two jobs: the first's)
    models = {job["model"] for kind, job in jobs if kind == "model"}
    with built_in_parent({name: (MODELS[name]["factory"], {}) for name in models}):
        return run_on_ranks(_worker, world, jobs, timeout_s=TIMEOUT_S, collective_timeout_s=150)


def _expected_linear(mode, mesh) -> dict:
    expected = linear_comm_bytes(mode, M, K, N, mesh)
    named = {
        p: {k: {f"a{a}": b for a, b in axes.items()} for k, axes in kinds.items()} for p, kinds in expected.items()
    }
    loss = named["fwd"].setdefault("all_reduce", {})
    for axis, n in enumerate(mesh):
        if n > 1:  # the loss (a scalar, partial on every axis) all-reduced
            loss[f"a{axis}"] = loss.get(f"a{axis}", 0) + 4
    return named


def _check_runs(jobs, results):
    for i, (kind, job) in enumerate(jobs):
        per_rank = [r[i] for r in results]
        failures = [f for r in per_rank for f in r["failures"]]
        label = f"{kind} {job}"
        assert not failures, f"{label}: {len(failures)} mismatches, first:\n" + "\n".join(failures[:8])
        r0 = per_rank[0]
        if kind == "model":
            for phase in ("fwd", "bwd"):
                diff = nested_approx_equal(
                    r0["counted_by_phase"].get(phase, {}), r0["estimated_by_phase"].get(phase, {})
                )
                assert not diff, f"{label}: counted != estimated in {phase}: {diff}"
            assert not nested_approx_equal(r0["counted"], r0["estimated"]), label
        else:
            mode, mesh = job
            expected = _expected_linear(mode, mesh)
            for phase in ("fwd", "bwd"):
                counted, estimated = r0["counted"].get(phase, {}), r0["estimated"].get(phase, {})
                assert not nested_approx_equal(counted, estimated), f"{label} {phase}: {counted} != {estimated}"
                assert not nested_approx_equal(counted, expected[phase]), (
                    f"{label} {phase}: counted {counted}, the formula gives {expected[phase]}"
                )


def _model_job(model, mode, mesh):
    return ("model", dict(model=model, mesh=mesh, plan="free", tensor_parallel=mode, return_records=True))


def test_2d_parity_and_linear_formula_on_4_ranks():
    jobs = [
        _model_job("gpt", "2d", (2, 2)),
        _model_job("llama", "2d", (2, 2)),
        _model_job("vit", "2d", (2, 2)),
        _model_job("gpt2", "2d", (2, 2)),
        ("linear", ("2d", (2, 2))),
    ]
    results = _run(jobs, 4)
    _check_runs(jobs, results)
    for (kind, job), r in zip(jobs, results[0]):
        if kind == "model":
            assert r["roles"] and set(r["roles"].values()) == {"2d"}, (job["model"], r["roles"])
    assert set(results[0][4]["roles"].values()) == {"2d"}


@pytest.mark.slow
def test_2_5d_and_3d_parity_and_linear_formulas_on_8_ranks():
    jobs = [
        _model_job("gpt", "2.5d", (2, 2, 2)),
        _model_job("llama", "2.5d", (2, 2, 2)),
        _model_job("gpt", "3d", (2, 2, 2)),
        _model_job("llama", "3d", (2, 2, 2)),
        ("linear", ("2.5d", (2, 2, 2))),
        ("linear", ("3d", (2, 2, 2))),
    ]
    results = _run(jobs, 8)
    _check_runs(jobs, results)
    for (kind, job), r in zip(jobs, results[0]):
        mode = job["tensor_parallel"] if kind == "model" else job[0]
        assert r["roles"] and set(r["roles"].values()) == {mode}, (job, r["roles"])
    # 3D stores every linear weight W/p on each rank (cut innermost over a0, Si), as estimated;
    # the user's optimizer (AdamW over model.parameters(), stepped in lockstep above) steps those
    for i in (2, 3):
        for rank, per_rank in enumerate(results):
            weights = per_rank[i]["weights"]
            assert weights, jobs[i]
            for fqn, (spec, local, estimated, whole) in weights.items():
                assert spec.startswith("[Si(") and local == estimated == whole / 8, (jobs[i], rank, fqn, spec)


def test_formulas_shrink_as_the_algorithms_promise():
    """Per device and linear: 2D moves (q-1)/q^2-ish of 1D's activations; the formulas are the
    published ones in payload terms (see docs/ARCHITECTURE.md)."""
    m, k, n = 4096, 1024, 4096
    two = linear_comm_bytes("2d", m, k, n, (8, 8), elem=1)
    assert two["fwd"]["all_gather"] == {1: m * k / 8, 0: k * n / 8}
    three = linear_comm_bytes("3d", m, k, n, (4, 4, 4), elem=1)
    # 3D: X and its W/p weight gathered, Y reduce-scattered; backward the mirror image
    assert three["fwd"] == {"all_gather": {1: m * k / 16, 0: k * n / 16}, "reduce_scatter": {2: m * n / 16}}
    assert three["bwd"] == {"reduce_scatter": {1: m * k / 16, 0: k * n / 16}, "all_gather": {2: m * n / 16}}
    deep = linear_comm_bytes("2.5d", m, k, n, (4, 4, 4), elem=1)
    assert deep["bwd"]["all_reduce"] == {0: k * n / 16}
    with pytest.raises(ValueError, match="1d"):
        linear_comm_bytes("1d", m, k, n, (8,))


def test_3d_weight_storage_is_cut_innermost_and_gathers_in_one_collective():
    """``[Si(1), S(0), S(1)]``: device (i, j, h) holds piece i of the block W[j, h] (n over a1, k
    over a2, k cut again over a0 inside a2's cut), so gathering along a0 is one all-gather and
    the gradient one reduce-scatter; cut outer axis first (``S(1)`` on a0) it takes three moves."""
    from passes.core.placements import InnerShard, P, R, Shard, parse_spec, transition_steps
    from runtime.collectives import MeshComm
    from runtime.tensor_shards import shard_tensor

    stored, used = parse_spec("[Si(1), S(0), S(1)]", 3), (R, Shard(0), Shard(1))
    assert transition_steps(stored, used) == ((0, InnerShard(1), R),)
    assert transition_steps((P, Shard(0), Shard(1)), stored) == ((0, P, InnerShard(1)),)
    assert len(transition_steps((Shard(1), Shard(0), Shard(1)), used)) == 3
    full = torch.arange(4 * 8).reshape(4, 8)  # W[n=4, k=8]
    for rank in range(8):
        comm = MeshComm.for_codegen((2, 2, 2), ("a0", "a1", "a2"), rank)
        i, j, h = comm.coords
        cols = h * 4 + i * 2
        assert torch.equal(shard_tensor(full, stored, comm), full[j * 2 : j * 2 + 2, cols : cols + 2]), rank


def test_3d_stores_a_tied_weight_w_over_p_under_every_name():
    """HF GPT-2 ties ``lm_head`` to the embedding ``wte``: one tensor, decided under its first
    name (the embedding's), stored W/p because its other name is a linear weight; Conv1D's
    ``[K, N]`` weights are cut innermost along their dim 0 (parity on 8 ranks: the 3D runs above,
    same machinery)."""
    import partitioner

    model, inputs = build("gpt2")
    plan = partitioner.plan(model, inputs, mesh_shape=(2, 2, 2), cluster="h100", tensor_parallel="3d")
    stored = {r["fqn"]: r["out"][0] for r in plan.records if r.get("kind") == "param"}
    assert stored["transformer.wte.weight"] == stored["lm_head.weight"] == "[Si(1), S(1), S(0)]", stored
    assert stored["transformer.h.0.attn.c_attn.weight"].startswith("[Si(0)"), stored
    from partitioner.plan_table import weight_storage

    cube = {n for n, kind in weight_storage(plan).items() if kind == "cube"}
    assert {r["name"] for r in plan.records if r.get("kind") == "param" and r["out"][0].startswith("[Si(")} == cube
    assert "3D tensor parallel (stored W/p over the cube" in plan.summary() and "ZeRO-2" not in plan.summary()


@pytest.mark.parametrize(
    "mode, mesh, needed",
    [
        ("2d", (2, 4), "q x q"),
        ("2d", (4,), "q x q"),
        ("2.5d", (2, 2, 4), "d x q x q"),
        ("3d", (2, 2, 4), "c x c x c"),
        ("3d", (4, 4), "c x c x c"),
        ("1d", (4, 1), "last mesh axis"),
    ],
)
def test_wrong_mesh_shapes_are_refused(mode, mesh, needed):
    with pytest.raises(ValueError, match=needed):
        check_mesh(mode, mesh)


def test_plan_refuses_a_wrong_mesh_and_an_unsplittable_batch():
    import partitioner
    from partitioner import models

    model, inputs = models.gpt_demo(batch=2, seq=8, n_layer=1, n_embd=32)
    with pytest.raises(ValueError, match=r"tensor_parallel='3d' needs a c x c x c .* mesh_shape=\(2, 4\)"):
        partitioner.plan(model, inputs, mesh_shape=(2, 4), tensor_parallel="3d")
    # the row axes cut the tokens (batch x sequence): 1 x 6 cannot be cut 2 x 2 ways
    model, inputs = models.gpt_demo(batch=1, seq=6, n_layer=1, n_embd=32)
    with pytest.raises(
        ValueError, match=r"node linear .* tokens 1 x 6 \(batch first\), which the grid's row axes \(2, 2\)"
    ):
        partitioner.plan(model, inputs, mesh_shape=(2, 2, 2), tensor_parallel="2.5d")
    with pytest.raises(ValueError, match="tensor_parallel must be one of"):
        partitioner.plan(model, inputs, mesh_shape=(2, 2), tensor_parallel="4d")


def test_summary_names_the_grid_and_each_linear_layers_blocks():
    import partitioner
    from partitioner import models

    model, inputs = models.gpt_demo(batch=8, seq=16, n_layer=1)
    plan = partitioner.plan(model, inputs, mesh_shape=(2, 2), tensor_parallel="2d")
    text = plan.summary()
    assert "grid (tensor_parallel='2d'): a0 rows, a1 columns; weight contractions: 2d on 5" in text
    # c_attn: X's row block gathered along the columns, W's column block gathered along the rows
    assert "linear (h.0.attn.c_attn): 2d, a0=M a1=N; X 4x16x64, W 96x64, Y 4x16x96" in text
    assert math.isfinite(plan.estimate().step_time_s)


def test_solver_picks_3d_where_cheaper_on_a_multi_node_cluster():
    """64 H100s (8 per node) as 4 x 4 x 4: the two outer axes cross nodes. For a wide layer and a
    small batch the solver, free, runs every linear layer as 3D (benchmarks/multidim_tp.py)."""
    import partitioner
    from partitioner import models

    model, inputs = models.gpt_block(batch=16, seq=2048, n_embd=16384, n_head=128, n_layer=1, vocab=32768)
    plan = partitioner.plan(model, inputs, mesh_shape=(4, 4, 4), cluster="h100", memory_budget="80GiB")
    labels = [r["tensor_parallel"] for r in plan.records if r.get("tensor_parallel")]
    assert labels == ["3d"] * 5, labels
    assert "grid (tensor_parallel='auto'); weight contractions: 3d on 5" in plan.summary()


def test_cli_forces_an_algorithm_and_names_the_mesh_it_needs():
    import contextlib
    import io

    from partitioner.__main__ import main

    def run(*extra):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(
                ["plan", "partitioner.models:gpt_demo", "--kwargs", '{"n_layer": 1, "seq": 16}', "--quiet", *extra]
            )
        return code, out.getvalue(), err.getvalue()

    code, out, _ = run("--mesh", "2x2", "--tensor-parallel", "2d")
    assert code == 0 and "grid (tensor_parallel='2d'): a0 rows, a1 columns; weight contractions: 2d on 5" in out
    code, _, err = run("--mesh", "2x2", "--tensor-parallel", "3d")
    assert code == 2 and "tensor_parallel='3d' needs a c x c x c" in err and "mesh_shape=(2, 2)" in err
