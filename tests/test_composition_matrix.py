"""The composition matrix: precision x parallel algorithm x weight storage, on three HF families.

Factors (``recompute="auto"`` throughout: the solver's choice, as users get it):

* precision: ``fp32``; ``bf16`` (``precision="bf16"``: captured and run under ``torch.autocast``);
* algorithm, on mesh (2, 2), axis 0 data parallel: ``dp`` (data parallel on both axes),
  ``tpsp`` (Megatron 1-D tensor parallel with sequence-parallel norms on axis 1), ``ring`` and
  ``ulysses`` (``sequence_parallel=`` forced on axis 1), ``2d`` (``tensor_parallel="2d"``),
  ``pp`` (2 pipeline stages x 2-way data parallel, 1F1B, 2 microbatches);
* weight storage (``zero=``): ``auto`` (no memory budget: the solver's choice), ``1``, ``2``, ``3``;
* model: HF LLaMA (RoPE in fp32 outside autocast, grouped-query heads), GPT-2 (learned
  positions, tied embeddings), Qwen2 (RoPE, q/k/v biases), from small configs.

Not the cross product (144 runs): a covering design in which every pair of values of any two
factors appears in at least one case. Algorithm ``a`` and storage ``z`` (indices) are crossed in
full (24 cases); the model is ``(a + z) mod 3`` and the precision ``(a + z) mod 2``, which
covers model x algorithm (for one ``a``, ``z`` runs over 4 consecutive residues mod 3), model x
storage and precision x either, and model x precision (``(a + z) mod 6`` takes all 6 values).
No combination is refused (ZeRO-1 inside pipeline stages runs too). Models have one layer, two
where pipelined.

The grids that need 8 ranks, 2.5D and 3D (``tensor_parallel=``) on (2, 2, 2), are a second
design on three held-out decoder families (Qwen2, Mistral, Phi with its partial rotary
embedding and parallel blocks), at batch 2: the grids' row axes (4 devices) cut the tokens,
batch x sequence, so the sequence is split too. Grid and precision are crossed (4 cases); the
ZeRO modes and the models each appear. The 2D cases of the first design run at batch 2 as well.

Each case, on 4 forked gloo ranks (8 for the grids; all cases of a group in one rank group, so
processes start once; the models of the cases are built and captured in the parent before it
forks, a pipeline's cut into its stages, inside ``partitioner.captures.keep_captures``, so the
ranks' ``auto_parallelize`` reuses that capture instead of exporting the model on every rank):
parity against a deep copy on one device (fp32: ``assert_close`` defaults on the loss and every
gradient; bf16: against the copy under ``torch.autocast`` in bf16, the tolerances of
``tests/test_mixed_precision.py``: loss rtol 4u, each gradient norm-wise within
``max(4u, 2 x the reference's own bf16 noise)``, u = 2^-8), and the communication counted at run
time = the plan's estimate per kind, axis and phase (a pipeline: the stage plan's estimate per
microbatch, gradient syncs and ZeRO-1's reduce-scatter and all-gather once per step).
"""

from __future__ import annotations

import copy

import pytest
import torch
from parity_utils import Checks, call, check_grads_by_alias, loss_of, nested_approx_equal

from partitioner import hf_families
from partitioner.captures import capture, keep_captures
from partitioner.pipeline_parallelize import capture_pipeline
from passes.core.placements import Shard, parse_spec
from runtime.collectives import CommCounter
from runtime.launch import run_on_ranks

TIMEOUT_S = 300
U_BF16 = 2.0**-8
MICROBATCHES = 2

MODELS = ("llama", "gpt2", "qwen2")
PRECISIONS = ("fp32", "bf16")
ALGORITHMS = ("dp", "tpsp", "ring", "ulysses", "2d", "pp")
STORAGE = ("auto", 1, 2, 3)

# the modules whose outputs are the activations between blocks (pinned for dp / tpsp)
NORMS = {
    "llama": ("model.layers.*.input_layernorm", "model.layers.*.post_attention_layernorm", "model.norm"),
    "qwen2": ("model.layers.*.input_layernorm", "model.layers.*.post_attention_layernorm", "model.norm"),
    "gpt2": ("transformer.h.*.ln_1", "transformer.h.*.ln_2", "transformer.ln_f"),
}
INPUTS = ("input_ids", "labels")


GRIDS = ("2.5d", "3d")
HELD_OUT = ("qwen2", "mistral", "phi")
GRID_BATCH = 2  # the row axes (4 devices) cannot cut the batch alone: the sequence is split too

# combinations refused by design, with the error's words: the case checks the refusal instead (none now)
REFUSED: dict = {}


def _case(model, prec, algo, zero, batch: int = 4) -> dict:
    refused = (algo, zero) in REFUSED
    tag = "refused" if refused else "parity"
    return dict(
        model=model,
        precision=prec,
        algo=algo,
        zero=zero,
        batch=batch,
        refused=refused,
        id=f"{model}-{prec}-{algo}-zero{zero}-batch{batch}-{tag}",
    )


def covering_cases() -> list:
    cases = []
    for a, algo in enumerate(ALGORITHMS):
        for z, zero in enumerate(STORAGE):
            batch = GRID_BATCH if algo == "2d" else 4
            cases.append(_case(MODELS[(a + z) % 3], PRECISIONS[(a + z) % 2], algo, zero, batch))
    return cases


def grid_cases() -> list:
    """2.5D and 3D on (2, 2, 2): grid x precision crossed, model and ZeRO mode running along."""
    cases = []
    for g, grid in enumerate(GRIDS):
        for p, prec in enumerate(PRECISIONS):
            i = 2 * g + p
            cases.append(_case(HELD_OUT[i % len(HELD_OUT)], prec, grid, STORAGE[i], GRID_BATCH))
    return cases


def _options(case) -> dict:
    model, algo = case["model"], case["algo"]
    opts: dict = dict(mesh=(2, 2), cluster="h100", zero=case["zero"], precision=case["precision"])
    if algo == "dp":
        opts["pins"] = {name: ["S(0)", "S(0)"] for name in INPUTS + NORMS[model]}
    elif algo == "tpsp":
        pins = {name: ["S(0)", "R"] for name in INPUTS}
        pins.update({name: ["S(0)", "S(1)"] for name in NORMS[model]})
        opts.update(pins=pins, tensor_parallel="1d")
    elif algo in ("ring", "ulysses"):
        opts["sequence_parallel"] = algo
    elif algo in ("2d",) + GRIDS:
        opts["tensor_parallel"] = algo
        if algo in GRIDS:
            opts["mesh"] = (2, 2, 2)
    else:
        opts["pipeline"] = {"degree": 2, "schedule": "1f1b", "microbatches": MICROBATCHES}
    opts.update(case.get("options", {}))
    return opts


def _reference(ref, inputs, precision):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss = loss_of(call(ref, inputs))
    loss.backward()
    return loss.detach()


def _check_bf16_grads(grads, ref, ref32, checks, label):
    """Norm-wise, as tests/test_mixed_precision.py: within max(4u, 2 x the reference's noise)."""
    aliases: dict = {}
    for name, p in ref.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    fp32 = dict(ref32.named_parameters())
    for name, p in ref.named_parameters():
        present = [a for a in aliases[id(p)] if a in grads]
        checks.true(f"{label}: no gradient for {name}", bool(present))
        g32 = fp32[name].grad
        noise = ((p.grad - g32).norm() / g32.norm().clamp_min(1e-30)).item()
        tol = max(4 * U_BF16, 2 * noise)
        for alias in present:
            checks.true(
                f"{label}: gradient of {alias} is {grads[alias].dtype}, not fp32", grads[alias].dtype == torch.float32
            )
            err = (grads[alias] - p.grad).norm().item()
            scale = max(p.grad.norm().item(), 1e-12)
            checks.true(f"{label}: grad of {alias}: relative error {err / scale:.2e} > {tol:.2e}", err <= tol * scale)


def _build(case):
    """The case's model and inputs: one layer where the plan has no stages (the smallest capture
    and solve); two to pipeline."""
    return hf_families.build(case["model"], n_layer=2 if case["algo"] == "pp" else 1, batch=case.get("batch", 4))


def _captured_here(cases) -> list:
    """Per case, (model, inputs) built and captured in this process as its ``auto_parallelize``
    call will capture them (call inside ``keep_captures``, then fork; a pipeline: its stages),
    or None: a refused case never captures."""
    built = []
    for case in cases:
        if case["refused"]:
            built.append(None)
            continue
        model, inputs = _build(case)
        options = {k: v for k, v in _options(case).items() if k != "mesh"}
        (capture_pipeline if "pipeline" in options else capture)(model, inputs, **options)
        built.append((model, inputs))
    return built


def _run_case(case, checks, built=None) -> dict:
    import partitioner
    from partitioner.plan_estimate import stage_step_comm

    label = case["id"]
    model, inputs = built if built is not None else _build(case)
    ref, ref32 = copy.deepcopy(model), copy.deepcopy(model)
    opts = _options(case)
    if case["refused"]:
        with pytest.raises(ValueError, match=REFUSED[case["algo"], case["zero"]]):
            partitioner.auto_parallelize(model, inputs, **opts)
        return {"id": label, "refused": True}
    parallel = partitioner.auto_parallelize(model, inputs, **opts)
    with CommCounter() as counter:
        if case["algo"] == "pp":
            loss = parallel.train_step(inputs).detach()
        else:
            loss = loss_of(call(parallel, inputs))
            loss.backward()
            loss = loss.detach()
    expected = _reference(ref, inputs, case["precision"])
    grads = parallel.full_grads()
    if case["precision"] == "fp32":
        checks.close(f"{label}: loss", loss, expected)
        check_grads_by_alias(grads, ref, checks)
    else:
        _reference(ref32, inputs, "fp32")
        checks.close(f"{label}: loss", loss, expected, rtol=4 * U_BF16, atol=0.0)
        _check_bf16_grads(grads, ref, ref32, checks, label)
    counted = counter.phase_dict()
    if case["algo"] == "pp":
        (stage,) = parallel.stages.values()
        step_bytes, _ = stage_step_comm(stage.plan, MICROBATCHES)
        wants = {ph: step_bytes.get(ph, {}) for ph in ("fwd", "bwd")}
        plan = stage.plan
    else:
        plan = parallel.plan
        wants = {ph: plan.estimate().comm_bytes_by_phase.get(ph, {}) for ph in ("fwd", "bwd")}
    for ph, want in wants.items():
        for diff in nested_approx_equal(counted.get(ph, {}), want):
            checks.failures.append(f"{label}: {ph} communication counted != estimated: {diff}")
    notes = sorted({str(v) for r in plan.records for v in (r.get("notes") or {}).values()})
    contractions = [r for r in plan.records if r.get("tp_roles")]
    return {
        "id": label,
        "notes": notes,
        "grids": sorted({r["tensor_parallel"] for r in contractions}),
        # the tokens' dims (all but the hidden one) each contraction's output is split on
        "row_dims": sorted({d for r in contractions for d in _split_dims(r["out"][0]) if d != len(r["shapes"][0]) - 1}),
        "sent": sum(b for k in counted.values() for a in k.values() for b in a.values()),
    }


def _split_dims(spec: str) -> list:
    return [p.dim for p in parse_spec(spec, spec.count(",") + 1) if isinstance(p, Shard)]


def matrix_worker(rank, world, cases, built):
    checks = Checks(rank)
    results = []
    for case, models in zip(cases, built):
        try:
            results.append(_run_case(case, checks, models))
        except Exception as exc:  # one broken case must not hide the others
            checks.failures.append(f"{case['id']}: {type(exc).__name__}: {exc}")
    return {"rank": rank, "failures": checks.failures, "results": results}


CASES = covering_cases()
GRID_CASES = grid_cases()


def test_the_design_covers_every_pair_of_factor_values():
    """Among the cases that run (a refused combination is checked as refused, once)."""
    factors = {"model": MODELS, "precision": PRECISIONS, "algo": ALGORITHMS, "zero": STORAGE}
    names = list(factors)
    running = [c for c in CASES if not c["refused"]]
    assert {(c["algo"], c["zero"]) for c in CASES if c["refused"]} == set(REFUSED)
    for i, f in enumerate(names):
        for g in names[i + 1 :]:
            seen = {(c[f], c[g]) for c in running}
            missing = {(x, y) for x in factors[f] for y in factors[g]} - seen
            if (f, g) == ("algo", "zero"):
                missing -= set(REFUSED)
            assert not missing, (f, g, sorted(map(str, missing)))


def _run_cases(cases, world) -> dict:
    """Every case on ``world`` forked ranks, no failure on any rank; case id -> rank 0's result."""
    with keep_captures():
        built = _captured_here(cases)
        results = run_on_ranks(matrix_worker, world, cases, built, timeout_s=TIMEOUT_S, collective_timeout_s=150)
    failures = [f for r in results for f in r["failures"]]
    assert not failures, f"{len(failures)} failures, first ones:\n" + "\n".join(failures[:16])
    by_id = {res["id"]: res for res in results[0]["results"]}
    assert set(by_id) == {c["id"] for c in cases}
    return by_id


@pytest.mark.parametrize("group", range(2), ids=lambda g: f"algorithms-{'-'.join(ALGORITHMS[3 * g : 3 * g + 3])}")
def test_composition_matrix(group):
    """Half of :data:`CASES` per group (by algorithm); every case id names its model, precision,
    algorithm and ZeRO mode."""
    cases = [c for c in CASES if c["algo"] in ALGORITHMS[3 * group : 3 * group + 3]]
    by_id = _run_cases(cases, 4)
    for case in cases:
        res = by_id[case["id"]]
        if case["refused"] or case["algo"] == "pp":  # a tiny stage may run replicated: nothing to send
            continue
        assert res["sent"] > 0, f"{case['id']}: a plan on 4 ranks communicates"
        if case["algo"] in ("ring", "ulysses"):
            assert case["algo"] in res["notes"], (case["id"], res["notes"])


def test_the_grid_design_crosses_grid_and_precision_and_runs_every_model_and_zero_mode():
    assert {(c["algo"], c["precision"]) for c in GRID_CASES} == {(g, p) for g in GRIDS for p in PRECISIONS}
    assert {c["model"] for c in GRID_CASES} == set(HELD_OUT) and {c["zero"] for c in GRID_CASES} == set(STORAGE)
    assert not any(c["refused"] for c in GRID_CASES)


@pytest.mark.slow  # 8 ranks; 2D and the grids' rules run in the everyday tier (test_multidim_tp, the matrix)
def test_2_5d_and_3d_on_held_out_families_at_batch_2():
    """:data:`GRID_CASES` on 8 ranks: parity, counted communication = estimate, every weight
    contraction running the forced grid, and the tokens split on the sequence as well as the batch."""
    by_id = _run_cases(GRID_CASES, 8)
    for case in GRID_CASES:
        res = by_id[case["id"]]
        assert res["grids"] == [case["algo"]], (case["id"], res["grids"])
        assert res["row_dims"] == [0, 1], (case["id"], res["row_dims"])
        assert res["sent"] > 0, case["id"]
