"""Long sequences: ring attention and Ulysses (``sequence_parallel=``), on real gloo ranks.

Parity (tier 3): for each config a model is parallelised with the algorithm forced on the
last mesh axis (data parallel on the other) and checked against a deep copy run on one
device, fp32 with ``torch.testing.assert_close`` defaults: the loss, every gradient, the
parameters after 3 AdamW steps; the communication counted at run time equals the plan's
estimate per kind, axis and phase, and equals the formulas (per attention layer and step); what
backward keeps, measured with saved-tensor hooks, equals the memory estimate within 1%:

* ring: ``send_recv`` of the local k/v blocks, ``p - 1`` transfers forward and ``2 (p - 1)``
  backward (k/v again and their gradients); under ``is_causal`` also the zig-zag exchanges
  (all-to-alls of the local buffers): q and the output forward, q, dO, dq and the row sums
  ``rowsum(dO * O)`` (a ``1 / head_dim`` of q) backward;
* Ulysses: 4 all-to-alls of the local buffers forward (q, k, v, output) and 4 backward (dO,
  dq, dk, dv) plus the row sums ``rowsum(dO * O)``.

Models: the hand-written GPT (``is_causal``: zig-zag balanced ring), HF LLaMA (RoPE, grouped
query heads 4 / 2, an explicit mask tensor) and HF GPT-2 (learned positions, mask tensor), on
meshes (4,), (2,) (two 2-rank jobs side by side in one 4-rank run) and (2, 2).

Inside pipeline stages: 2 stages x the algorithm on the stage's 2 ranks (mesh (2, 2)), GPT and
LLaMA, 1F1B and GPipe: the same parity, counted communication = the stage plans' estimates over
the step (per microbatch; parameter gradients reduced once) = the formulas for one layer and
microbatch.

The ring op itself (one process group, no model): exact against ``scaled_dot_product_attention``
forward and backward for causal (zig-zag and contiguous), boolean and additive masks and
grouped-query k/v; the zig-zag layout gives every rank the same FLOPs (the contiguous one
does not); the bytes it saves for backward per rank halve from 2 to 4 ranks (saved-tensor hooks).
The Ulysses op likewise (causal, a boolean mask; its saved bytes halve too).

Single process: the solver chooses ring or Ulysses for a long sequence on a memory budget and
the summary names it; bad input gets errors naming the node and what to do.
"""

from __future__ import annotations

import copy

import pytest
import torch
from long_sequence_utils import (
    FACTORIES,
    SHAPES,
    TIMEOUT_S,
    check_sequence_results,
    expected_comm,
    run_sequence_cases,
    sequence_case,
    sub_mesh,
)
from parity_utils import Checks, built_in_parent, nested_approx_equal, pipeline_like_one_device, prebuilt

from partitioner import models
from runtime.launch import run_on_ranks


def test_parity_on_two_and_four_ranks():
    """One 4-rank run. (4,): GPT ring (zig-zag causal), LLaMA ring, GPT-2 Ulysses; (2, 2): GPT
    ring and LLaMA Ulysses on axis 1, data parallel on axis 0; then (2,) as two 2-rank jobs side
    by side: GPT Ulysses and LLaMA ring on ranks 0-1, GPT-2 ring and LLaMA Ulysses on ranks 2-3."""
    cfgs = [
        sequence_case("gpt", "ring", (4,)),
        sequence_case("llama", "ring", (4,)),
        sequence_case("gpt2", "ulysses", (4,)),
        sequence_case("gpt", "ring", (2, 2)),
        sequence_case("llama", "ulysses", (2, 2)),
        sequence_case("gpt", "ulysses", (2,), ranks=(0, 1)),
        sequence_case("llama", "ring", (2,), ranks=(0, 1)),
        sequence_case("gpt2", "ring", (2,), ranks=(2, 3)),
        sequence_case("llama", "ulysses", (2,), ranks=(2, 3)),
    ]
    results = run_sequence_cases(cfgs)
    check_sequence_results(results, cfgs)


# ------------------------------------------------------------------- inside pipeline stages

PIPELINE_MICROBATCHES = 2


def _pipeline(cfg) -> dict:
    return {"degree": 2, "schedule": cfg["schedule"], "microbatches": PIPELINE_MICROBATCHES}


def _pipeline_parity(cfg, rank, checks):
    """2 pipeline stages (axis 0) x the algorithm forced on the stage mesh's axis (axis 1)."""
    import partitioner
    from runtime.collectives import CommCounter

    model, inputs = prebuilt(cfg["id"]) or FACTORIES[cfg["model"]]()  # the parent's, its stages captured there
    ref = copy.deepcopy(model)
    m = PIPELINE_MICROBATCHES
    pipeline = _pipeline(cfg)
    runner = partitioner.auto_parallelize(
        model, inputs, mesh=(2, 2), pipeline=pipeline, cluster="h100", sequence_parallel=cfg["mode"]
    )
    with CommCounter() as counter:
        loss = runner.train_step(inputs)
    # counted = the stage plan's estimate over the step: per microbatch, parameter gradients once
    # (partitioner.plan_estimate.per_step_comm), per phase
    from partitioner.plan_estimate import per_step_comm

    (stage,) = runner.stages.values()
    est = stage.plan.estimate()
    counted = counter.phase_dict()
    for phase in ("fwd", "bwd"):
        want = per_step_comm(est.comm_bytes_by_phase.get(phase, {}), est.grad_sync_bytes if phase == "bwd" else {}, m)
        for diff in nested_approx_equal(counted.get(phase, {}), want):
            checks.failures.append(f"{cfg['id']} {phase} counted != estimated: {diff}")
    algos = [r.get("notes") for r in stage.plan.records if "scaled_dot_product_attention" in r["name"]]
    pipeline_like_one_device(runner, ref, inputs, loss, checks, steps=3, label=cfg["id"])
    axis = stage.comm.axis_names[-1]
    attention = {
        ph: {k: counted.get(ph, {}).get(k, {}).get(axis, 0.0) for k in ("send_recv", "all_to_all")}
        for ph in ("fwd", "bwd")
    }
    return {"id": cfg["id"], "algos": algos, "counted": attention, "axis": axis}


def pipeline_worker(rank, world, cfgs):
    checks = Checks(rank)
    out = [_pipeline_parity(cfg, rank, checks) for cfg in cfgs]
    return {"rank": rank, "failures": checks.failures, "results": out}


def test_ring_and_ulysses_inside_pipeline_stages():
    """One 4-rank run: 2 pipeline stages (one layer each) x ring or Ulysses forced on the
    stage's 2 ranks, GPT (causal, zig-zag) and HF LLaMA (RoPE, GQA), 1F1B and GPipe, 2
    microbatches. Parity of loss, every gradient and the
    parameters after 3 AdamW steps; communication counted = the stage plans' estimates over the
    step (per microbatch, gradient syncs once) = the formulas for one layer of a microbatch."""
    cfgs = [
        dict(model=m, mode=mode, schedule=sched, id=f"pp2x{mode}2-{m}-{sched}")
        for m, mode, sched in (
            ("gpt", "ring", "1f1b"),
            ("llama", "ring", "gpipe"),
            ("gpt", "ulysses", "gpipe"),
            ("llama", "ulysses", "1f1b"),
        )
    ]
    # each case's model built here and its stages captured as its ranks' call will, before they fork
    factories = {
        c["id"]: (FACTORIES[c["model"]], {"pipeline": _pipeline(c), "sequence_parallel": c["mode"]}) for c in cfgs
    }
    with built_in_parent(factories):
        results = run_on_ranks(pipeline_worker, 4, cfgs, timeout_s=TIMEOUT_S, collective_timeout_s=150)
    failures = [f for r in results for f in r["failures"]]
    assert not failures, f"{len(failures)} mismatches, first ones:\n" + "\n".join(failures[:12])
    by_id = {c["id"]: c for c in cfgs}
    for r in results:
        for res in r["results"]:
            cfg = by_id[res["id"]]
            assert res["algos"] == [{res["axis"]: cfg["mode"]}], res["algos"]
            batch = SHAPES[cfg["model"]][1][0] // PIPELINE_MICROBATCHES
            want = expected_comm(cfg["model"], cfg["mode"], (2,), layers=1, batch=batch)
            for phase, kinds in want.items():
                for kind, nbytes in kinds.items():
                    got = res["counted"][phase][kind] / PIPELINE_MICROBATCHES
                    if kind == "send_recv" or cfg["model"] == "gpt":
                        assert got == pytest.approx(nbytes), (res["id"], phase, kind, got, nbytes)
                    else:  # outside the attention op the plan may use all-to-alls of its own
                        assert got >= nbytes, (res["id"], phase, kind, got, nbytes)


# ------------------------------------------------------------------------------ the ring op


def _ring_comm(rank, world, size):
    """A MeshComm with one axis over this rank's block of ``size`` ranks."""
    from runtime.collectives import MeshComm

    return MeshComm(sub_mesh(size, rank, world))


def _cases():
    g = torch.Generator().manual_seed(0)
    b, h, s, d = 2, 4, 16, 8
    q = torch.randn(b, h, s, d, generator=g)
    k = torch.randn(b, h, s, d, generator=g)
    v = torch.randn(b, h, s, d, generator=g)
    kv2 = (torch.randn(b, 2, s, d, generator=g), torch.randn(b, 2, s, d, generator=g))
    keep = torch.rand(b, 1, s, s, generator=g) > 0.3
    keep |= torch.eye(s, dtype=torch.bool)  # every query sees at least itself
    additive = torch.randn(b, h, s, s, generator=g)
    return [
        ("causal zig-zag", (q, k, v), dict(causal=True), None),
        ("causal contiguous", (q, k, v), dict(causal=True, balanced=False), None),
        ("causal grouped-query", (q,) + kv2, dict(causal=True), None),
        ("causal zig-zag, 3 query rows per product", (q, k, v), dict(causal=True, rows=3), None),
        ("boolean mask", (q, k, v), dict(causal=False), keep),
        ("additive mask, grouped-query", (q,) + kv2, dict(causal=False), additive),
        ("Ulysses causal", (q, k, v), dict(causal=True, ulysses=True), None),
        ("Ulysses boolean mask", (q, k, v), dict(causal=False, ulysses=True), keep),
    ]


def _counting_pack(storages: dict):
    """A saved-tensor pack hook noting each storage's bytes once (by address)."""

    def pack(t):
        storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    return pack


def ring_op_worker(rank, world):
    from passes.core.placements import Shard
    from runtime.ring_attention import RingAttention
    from runtime.ulysses_attention import UlyssesAttention

    checks = Checks(rank)
    out = {"flops": {}, "saved": {}}
    for size in (4, 2):
        comm = _ring_comm(rank, world, size)
        c = comm.coords[0]
        for name, (q, k, v), kw, mask in _cases():
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            gqa = k.shape[1] != q.shape[1]
            expected = torch.nn.functional.scaled_dot_product_attention(
                *leaves, attn_mask=mask, is_causal=kw["causal"], enable_gqa=gqa
            )
            d_out = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
            expected.backward(d_out)
            n = q.shape[2] // size
            rows = slice(c * n, (c + 1) * n)
            local = [t[:, :, rows].detach().clone().requires_grad_() for t in (q, k, v)]
            if kw.get("ulysses"):  # Ulysses takes the mask whole
                op, local_mask = UlyssesAttention(comm, 0, (Shard(2),), causal=kw["causal"]), mask
            else:  # the mask's rows as a sequence-split producer hands them over (a storage of their own)
                op, local_mask = RingAttention(comm, 0, **kw), None if mask is None else mask[:, :, rows].clone()
            storages: dict = {}  # storage address -> bytes: each saved storage once
            with torch.autograd.graph.saved_tensors_hooks(_counting_pack(storages), lambda t: t):
                got = op(*local, local_mask)
            got.backward(d_out[:, :, rows])
            checks.close(f"{size} ranks, {name}: output", got, expected[:, :, rows])
            for label, a, full in zip("qkv", local, leaves):
                checks.close(f"{size} ranks, {name}: d{label}", a.grad, full.grad[:, :, rows])
            out["flops"][(size, name)] = getattr(op, "flops_forward", None)
            out["saved"][(size, name)] = sum(storages.values())
    out["failures"] = checks.failures
    return out


def test_ring_op_exact_balanced_and_memory_falls():
    results = run_on_ranks(ring_op_worker, 4, timeout_s=TIMEOUT_S)
    failures = [f for r in results for f in r["failures"]]
    assert not failures, "\n".join(failures[:12])
    for size in (2, 4):
        flops = [r["flops"][(size, "causal zig-zag")] for r in results]
        assert len(set(flops)) == 1, f"zig-zag: unequal work per rank on {size} ranks: {flops}"
        contiguous = [r["flops"][(size, "causal contiguous")] for r in results[:size]]
        assert contiguous == sorted(contiguous) and contiguous[0] < contiguous[-1], contiguous
        # causal attention computes (2p + 1) / 4p of the full square: about half
        full = [r["flops"][(size, "boolean mask")] for r in results]
        assert flops[0] == pytest.approx(full[0] * (2 * size + 1) / (4 * size))
    for name in ("causal contiguous", "boolean mask", "additive mask, grouped-query", "Ulysses causal"):
        two, four = results[0]["saved"][(2, name)], results[0]["saved"][(4, name)]
        assert two > 0 and four * 2 == pytest.approx(two), (name, two, four)


LOW = {"bf16": (torch.bfloat16, 2.0**-8), "fp16": (torch.float16, 2.0**-11)}


def _relative(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def autocast_op_worker(rank, world):
    """The ops under ``torch.autocast`` with fp32 q / k (as HF's rotary embeddings, computed with
    autocast off, hand them over) and a low-precision v, against ``scaled_dot_product_attention``
    under the same autocast on the whole sequence: the output in the autocast dtype, each
    gradient in its input's dtype, values norm-wise within max(4u, 2 x the reference's own
    low-precision noise) (u: the dtype's unit roundoff; tests/test_mixed_precision.py)."""
    from passes.core.placements import Shard
    from runtime.ring_attention import RingAttention
    from runtime.ulysses_attention import UlyssesAttention

    checks = Checks(rank)
    cases = [c for c in _cases() if c[0] in ("causal zig-zag", "additive mask, grouped-query", "Ulysses causal")]
    for size in (4, 2):
        comm = _ring_comm(rank, world, size)
        c = comm.coords[0]
        for prec, (dtype, u) in LOW.items():
            for name, (q, k, v), kw, mask in cases:
                inputs = (q, k, v.to(dtype))
                gqa = k.shape[1] != q.shape[1]
                d_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
                ref = {}
                for autocast in (True, False):  # the reference and its fp32 twin (for its noise)
                    leaves = [
                        t.clone().float().requires_grad_() if not autocast else t.clone().requires_grad_()
                        for t in inputs
                    ]
                    with torch.autocast("cpu", dtype=dtype, enabled=autocast):
                        out = torch.nn.functional.scaled_dot_product_attention(
                            *leaves, attn_mask=mask, is_causal=kw["causal"], enable_gqa=gqa
                        )
                    out.backward(d_out.to(out.dtype))
                    ref[autocast] = (out.detach(), *(t.grad for t in leaves))
                n = q.shape[2] // size
                rows = slice(c * n, (c + 1) * n)
                local = [t[:, :, rows].detach().clone().requires_grad_() for t in inputs]
                if kw.get("ulysses"):
                    op, local_mask = UlyssesAttention(comm, 0, (Shard(2),), causal=kw["causal"]), mask
                else:
                    op, local_mask = RingAttention(comm, 0, **kw), None if mask is None else mask[:, :, rows].clone()
                with torch.autocast("cpu", dtype=dtype):
                    got = op(*local, local_mask)
                got.backward(d_out[:, :, rows])
                label = f"{size} ranks, {prec}, {name}"
                checks.true(f"{label}: output is {got.dtype}, not {dtype}", got.dtype == dtype)
                for what, a, want, want32 in zip(
                    ("output", "dq", "dk", "dv"), (got, *(t.grad for t in local)), ref[True], ref[False]
                ):
                    if what != "output":
                        i = "qkv".index(what[1])
                        checks.true(f"{label}: {what} is {a.dtype}, not {inputs[i].dtype}", a.dtype == inputs[i].dtype)
                    tol = max(4 * u, 2 * _relative(want[:, :, rows], want32[:, :, rows]))
                    err = _relative(a, want[:, :, rows])
                    checks.true(f"{label}: {what} relative error {err:.2e} > {tol:.2e}", err <= tol)
    return {"failures": checks.failures}


def test_ring_and_ulysses_ops_under_autocast_match_the_fused_op():
    results = run_on_ranks(autocast_op_worker, 4, timeout_s=TIMEOUT_S)
    failures = [f for r in results for f in r["failures"]]
    assert not failures, "\n".join(failures[:12])


# ---------------------------------------------------------------------------- single process


def test_solver_chooses_a_sequence_algorithm_for_long_sequences():
    """A long sequence (8192) with 2 heads on (4,): heads cannot split 4 ways (no Megatron
    attention, no Ulysses), the query-sequence split keeps k/v whole; the solver picks ring
    (estimated 3x faster than the best plan without it) and the summary names it. With 8 heads
    forcing either algorithm gives that one on every layer."""
    import partitioner

    model, inputs = models.gpt_block(batch=1, seq=8192, n_embd=256, n_head=2, n_layer=2, device="meta")
    free = partitioner.plan(model, inputs, mesh_shape=(4,), cluster="h100", recompute="none")
    without = partitioner.plan(
        model, inputs, mesh_shape=(4,), cluster="h100", recompute="none", sequence_parallel="none"
    )
    notes = [r.get("notes", {}).get("a0") for r in free.records if "scaled_dot_product_attention" in r["name"]]
    assert notes == ["ring", "ring"], notes
    assert free.estimate().step_time_s < without.estimate().step_time_s / 2
    assert "ring@a0 on 2 attention ops" in free.summary()
    assert "ring@a0" not in without.summary()
    model, inputs = models.gpt_block(batch=1, seq=1024, n_embd=256, n_head=8, n_layer=2, device="meta")
    for mode in ("ring", "ulysses"):
        forced = partitioner.plan(model, inputs, mesh_shape=(4,), cluster="h100", sequence_parallel=mode)
        assert forced.data["sequence_parallel"] == mode
        notes = [r.get("notes", {}).get("a0") for r in forced.records if "scaled_dot_product_attention" in r["name"]]
        assert notes == [mode, mode], notes


def test_bad_input_is_refused_with_the_reason():
    import partitioner

    model, inputs = models.hf_llama(batch=2, seq=16, kv_heads=2, device="meta")
    with pytest.raises(
        ValueError,
        match=r"sequence_parallel='ulysses'.*scaled_dot_product_attention.*"
        r"key/value heads \(4\).*divide by 8.*'ring'",
    ):
        partitioner.plan(model, inputs, mesh_shape=(8,), cluster="h100", sequence_parallel="ulysses")
    model, inputs = models.gpt_demo(batch=2, seq=12, n_layer=1)
    with pytest.raises(ValueError, match=r"sequence_parallel='ring'.*sequence length 12 does not divide by 2 x 4"):
        partitioner.plan(model, inputs, mesh_shape=(4,), cluster="h100", sequence_parallel="ring")
    with pytest.raises(ValueError, match=r"sequence_parallel must be one of"):
        partitioner.plan(model, inputs, mesh_shape=(4,), cluster="h100", sequence_parallel="striped")
    # a length the ring cannot split is not offered in "auto": the plan is still correct
    plan = partitioner.plan(model, inputs, mesh_shape=(4,), cluster="h100")
    assert all(r.get("notes", {}).get("a0") != "ring" for r in plan.records)


def test_ring_transfers_overlap_block_compute_in_the_estimate():
    """Each ring hop runs beside one block's computation: a phase with compute ``c`` on ``p``
    ranks and transfers of ``t`` in all costs ``c + (p - 1) max(0, t / (p - 1) - c / p)``, so the
    plan prices the transfers at that exposed part, with their bytes unchanged: all hidden at
    8,192 tokens (a block's compute outlasts its hop), partly at 64 tokens."""
    import partitioner
    from partitioner.local_cluster import get_cluster
    from passes.plan.cost_model import Collective, collective_time

    cluster = get_cluster("h100")
    p, b, h, d = 4, 1, 8, 32
    for seq, hidden in ((8192, True), (64, False)):
        model, inputs = models.gpt_block(batch=b, seq=seq, n_embd=h * d, n_head=h, n_layer=2, device="meta")
        plan = partitioner.plan(model, inputs, mesh_shape=(p,), cluster="h100", sequence_parallel="ring")
        attention = [r for r in plan.records if "scaled_dot_product_attention" in r["name"]]
        assert len(attention) == 2
        for r in attention:
            ring = [c for c in r["comm"] if c["kind"] == "send_recv"]
            kv_local = 2 * b * h * seq * d * 4 / p
            assert [(c["phase"], c["bytes"]) for c in ring] == [
                ("fwd", (p - 1) * kv_local),
                ("bwd", (p - 1) * kv_local),
                ("bwd", (p - 1) * kv_local),
            ]
            transfer = collective_time(Collective("send_recv", 0, (p - 1) * kv_local), (p,), cluster)
            forward = r["compute_s"] / 3  # backward computes twice the forward
            for phase, compute, hops in (("fwd", forward, 1), ("bwd", 2 * forward, 2)):
                exposed = (p - 1) * max(0.0, hops * transfer / (p - 1) - compute / p)
                priced = sum(c["time_s"] for c in ring if c["phase"] == phase)
                assert priced == pytest.approx(exposed), (seq, phase, priced, exposed, transfer, compute)
                assert (priced == 0) == hidden, (seq, phase, priced)
        est = plan.estimate()
        assert est.comm_bytes["send_recv"]["a0"] == pytest.approx(2 * 3 * (p - 1) * kv_local)


def test_ring_attention_is_priced_at_the_rate_of_its_blocks():
    """An attention rate measured over sequence lengths is read at the length each rank computes
    on: ring attention's blocks of its share of the sequence (1,024 / 4 = 256 tokens), Ulysses'
    whole sequence with a quarter of the heads."""
    import dataclasses

    import partitioner
    from partitioner.local_cluster import get_cluster

    seq, p, h, d = 1024, 4, 8, 32
    grid = {"axes": [[256, 1024], [16, 64]], "rates": [[1e12, 1e12], [4e12, 4e12]]}
    base = get_cluster("h100")
    cluster = dataclasses.replace(base, op_rates={"float32": {"aten.scaled_dot_product_attention:causal": grid}})
    model, inputs = models.gpt_block(batch=1, seq=seq, n_embd=h * d, n_head=h, n_layer=1, device="meta")
    for mode, rate in (("ring", 1e12), ("ulysses", 4e12)):
        plan = partitioner.plan(model, inputs, mesh_shape=(p,), cluster=cluster, sequence_parallel=mode)
        (record,) = [r for r in plan.records if "scaled_dot_product_attention" in r["name"]]
        assert record.get("notes", {}).get("a0") == mode
        flops = 4 * h * seq * seq * d / p  # this rank's share of the score matrix products
        assert record["compute_s"] == pytest.approx(3 * (flops / rate + base.op_overhead_s), rel=1e-9), mode


def test_a_sequence_note_on_a_one_device_axis_runs_the_fused_op(fake_process_group):
    """Ulysses (or ring) on an axis of one device splits nothing: the op itself runs there, its
    fused kernel, as the plan prices it, not the block math of the sequence modules (a pipeline
    stage on one device each met this: its attention ran 1.5x slower than its estimate)."""
    import partitioner
    from partitioner.models import gpt_demo

    fake_process_group(2)
    model, batch = gpt_demo(batch=4, seq=16, n_layer=2, n_embd=32, n_head=4, vocab_size=64)
    pm = partitioner.auto_parallelize(model, batch, mesh=(2, 1), sequence_parallel="ulysses", cluster="cpu")
    notes = [r.get("notes") for r in pm.plan.records if r["target"] == "aten.scaled_dot_product_attention"]
    assert notes and all(n == {"a1": "ulysses"} for n in notes)  # forced onto the one-device axis
    program = pm.program
    modules = [type(program.get_submodule(n.target)).__name__ for n in program.graph.nodes if n.op == "call_module"]
    assert not any("Attention" in name for name in modules), modules
    fused = [n for n in program.graph.nodes if "scaled_dot_product_attention" in str(n.target)]
    assert len(fused) == len(notes)
