"""The parity worker of the ring attention and Ulysses tests (``tests/test_long_sequence.py``,
``tests/test_eager_sequence_parallel.py``): model factories, the communication formulas, the
per-rank parity run and the checks of its results. The standard is stated in
``tests/test_long_sequence.py``'s docstring.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from parity_utils import (
    Checks,
    adam_in_lockstep,
    built_in_parent,
    call,
    check_grads_by_alias,
    loss_of,
    nested_approx_equal,
    prebuilt,
)

from partitioner import models

TIMEOUT_S = 240

FACTORIES = {
    "gpt": lambda: models.gpt_demo(batch=4, seq=16, n_layer=2),
    "llama": lambda: models.hf_llama(batch=2, seq=16, kv_heads=2),
    "gpt2": lambda: models.hf_gpt2(batch=2, seq=16),
    "llama_eager": lambda: _eager(models.hf_llama(batch=2, seq=16, kv_heads=2)),
    "gpt2_eager": lambda: models.hf_gpt2(batch=2, seq=16, attn="eager"),
    "bart_eager": lambda: hf_bart(attn="eager"),
}
# per model: layers, (batch, heads, kv heads as sdpa sees them, sequence, head dim), is_causal
SHAPES = {
    "gpt": (2, (4, 4, 4, 16, 16), True),
    "llama": (2, (2, 4, 4, 16, 16), False),
    "gpt2": (2, (2, 4, 4, 16, 16), False),
    "llama_eager": (2, (2, 4, 4, 16, 16), False),
    "gpt2_eager": (2, (2, 4, 4, 16, 16), False),
}


def hf_bart(batch=2, source=16, target=8, attn="eager"):
    """A 1 + 1 layer BART (width 32, 4 heads): encoder and decoder self-attention, and the
    decoder's cross-attention from ``target`` queries to ``source`` keys."""
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(
        vocab_size=128,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        use_cache=False,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        attn_implementation=attn,
    )
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    ids, dec = torch.randint(3, 128, (batch, source), generator=g), torch.randint(3, 128, (batch, target), generator=g)
    return BartForConditionalGeneration(cfg), {"input_ids": ids, "decoder_input_ids": dec, "labels": dec.clone()}


def _eager(built):
    """An HF model built with its default attention, switched to ``attn_implementation="eager"``."""
    model, inputs = built
    model.set_attn_implementation("eager")
    return model, inputs


def expected_comm(model, mode, mesh, layers=None, batch=None):
    """{phase: {kind: bytes}} of the attention algorithm alone, from the formulas (``layers`` /
    ``batch``: a pipeline stage's attention layers and its microbatch, instead of the model's)."""
    all_layers, (b, h, hkv, s, d), causal = SHAPES[model]
    layers, b = layers or all_layers, batch or b
    p = mesh[-1]
    split = p * (mesh[0] if len(mesh) == 2 and b % mesh[0] == 0 else 1)
    q_local = b * h * s * d * 4 / split
    kv_local = 2 * b * hkv * s * d * 4 / split
    if mode == "ring":
        fwd = {"send_recv": layers * (p - 1) * kv_local}
        bwd = {"send_recv": layers * 2 * (p - 1) * kv_local}
        if causal:  # zig-zag: q and the output forward; q, dO, dq and the row sums backward
            fwd["all_to_all"] = layers * 2 * q_local
            bwd["all_to_all"] = layers * (3 * q_local + q_local / d)
        return {"fwd": fwd, "bwd": bwd}
    per = layers * (2 * q_local + kv_local)
    return {"fwd": {"all_to_all": per}, "bwd": {"all_to_all": per + layers * q_local / d}}


_SUB_MESHES: dict = {}


def sub_mesh(size, rank, world):
    """A 1-D DeviceMesh over this rank's block of ``size`` consecutive ranks (every rank makes
    every block's group, in the same order, once per size)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if size in _SUB_MESHES:
        return _SUB_MESHES[size]
    groups = [dist.new_group(list(range(s, s + size))) for s in range(0, world, size)]
    mine = rank // size
    _SUB_MESHES[size] = DeviceMesh.from_group(
        groups[mine], "cpu", mesh=torch.arange(mine * size, (mine + 1) * size), mesh_dim_names=("a0",)
    )
    return _SUB_MESHES[size]


def _parity(cfg, rank, world, checks):
    import partitioner
    from partitioner.sharding_plan import ShardingPlan
    from runtime.collectives import CommCounter, on_rank0

    model, inputs = prebuilt(cfg["id"]) or FACTORIES[cfg["model"]]()
    ref = copy.deepcopy(model)
    mesh = tuple(cfg["mesh"])
    if math.prod(mesh) == world:
        pm = partitioner.auto_parallelize(model, inputs, mesh=mesh, cluster="h100", sequence_parallel=cfg["mode"])
    else:  # a smaller job beside others: rank 0 plans for every rank, each replays it on its sub-mesh
        opts = dict(mesh_shape=mesh, cluster="h100", sequence_parallel=cfg["mode"])
        text = on_rank0(lambda: partitioner.plan(model, inputs, **opts).to_json(), "planning the sub-mesh job")
        plan = ShardingPlan.from_dict(json.loads(text))
        pm = partitioner.auto_parallelize(model, inputs, mesh=sub_mesh(mesh[0], rank, world), plan=plan)
    with CommCounter() as counter:
        loss = loss_of(call(pm, inputs))
        loss.backward()
    ref_loss = loss_of(call(ref, inputs))
    ref_loss.backward()
    checks.close(f"{cfg['id']}: loss", loss.detach(), ref_loss.detach())
    check_grads_by_alias(pm.full_grads(), ref, checks)
    est = pm.plan.estimate()
    for diff in nested_approx_equal(counter.phase_dict().get("fwd", {}), est.comm_bytes_by_phase.get("fwd", {})):
        checks.failures.append(f"{cfg['id']} fwd counted != estimated: {diff}")
    for diff in nested_approx_equal(counter.phase_dict().get("bwd", {}), est.comm_bytes_by_phase.get("bwd", {})):
        checks.failures.append(f"{cfg['id']} bwd counted != estimated: {diff}")
    for phase in ("fwd", "bwd"):  # ring transfers: calls as the runtime issues them (each pays its latency)
        counted_calls = counter.calls_phase_dict().get(phase, {}).get("send_recv", {})
        estimated_calls = est.comm_calls_by_phase.get(phase, {}).get("send_recv", {})
        checks.true(
            f"{cfg['id']} {phase} send_recv calls: counted {counted_calls}, estimated {estimated_calls}",
            counted_calls == estimated_calls,
        )
    algos = {r["name"]: r.get("notes") for r in pm.plan.records if "scaled_dot_product_attention" in r["name"]}

    def parallel_step():
        step_loss = loss_of(call(pm, inputs))
        step_loss.backward()
        return step_loss

    adam_in_lockstep(pm.parameters(), ref, inputs, 3, parallel_step, checks)
    state = pm.full_state_dict()
    for name, p in ref.named_parameters(remove_duplicate=False):
        checks.close(f"{cfg['id']}: parameter {name} after 3 AdamW steps", state[name], p.detach())
    # what backward keeps, measured (saved-tensor hooks, each storage once) = the estimate, within 1%
    measured = partitioner.measure_memory(pm, inputs).saved_activations
    estimated = pm.plan.estimate().memory.saved
    checks.true(
        f"{cfg['id']}: saved for backward: estimated {estimated:.0f} B, measured {measured} B",
        abs(estimated - measured) <= 0.01 * measured,
    )
    axis = pm.comm.axis_names[-1]
    phases = counter.phase_dict()
    counted = {
        ph: {k: phases.get(ph, {}).get(k, {}).get(axis, 0.0) for k in ("send_recv", "all_to_all")}
        for ph in ("fwd", "bwd")
    }
    return {"id": cfg["id"], "algos": algos, "counted": counted, "summary": pm.plan.summary() if rank == 0 else None}


def model_worker(rank, world, cfgs):
    checks = Checks(rank)
    out = []
    for cfg in cfgs:
        if cfg.get("ranks") is not None and rank not in cfg["ranks"]:
            continue
        out.append(_parity(cfg, rank, world, checks))
    return {"rank": rank, "failures": checks.failures, "results": out}


def sequence_case(model, mode, mesh, ranks=None):
    """A config of :func:`model_worker`: ``mode`` forced on the last axis of ``mesh`` (``ranks``:
    the ranks of a smaller job run beside others in one rank group)."""
    return dict(model=model, mode=mode, mesh=mesh, ranks=ranks, id=f"{model}-{mode}-{'x'.join(map(str, mesh))}")


def run_sequence_cases(cfgs: list, timeout_s: float = TIMEOUT_S) -> list:
    """:func:`model_worker` over ``cfgs`` on 4 forked ranks, each case's model built and captured
    here first (``parity_utils.built_in_parent``) with the algorithm its ranks force."""
    from runtime.launch import run_on_ranks

    factories = {c["id"]: (FACTORIES[c["model"]], {"sequence_parallel": c["mode"]}) for c in cfgs}
    with built_in_parent(factories):
        return run_on_ranks(model_worker, 4, cfgs, timeout_s=timeout_s, collective_timeout_s=150)


def check_sequence_results(results, cfgs):
    """No rank's check failed; every attention op ran the forced algorithm, with the formulas' traffic."""
    failures = [f for r in results for f in r["failures"]]
    assert not failures, f"{len(failures)} mismatches, first ones:\n" + "\n".join(failures[:12])
    by_id = {c["id"]: c for c in cfgs}
    for r in results:
        for res in r["results"]:
            cfg = by_id[res["id"]]
            axis = f"a{len(cfg['mesh']) - 1}"
            # every attention op runs the forced algorithm on the last axis, and the plan says so
            assert res["algos"] and all(n == {axis: cfg["mode"]} for n in res["algos"].values()), res["algos"]
            want = expected_comm(cfg["model"], cfg["mode"], cfg["mesh"])
            for phase, kinds in want.items():
                for kind, nbytes in kinds.items():
                    got = res["counted"][phase][kind]
                    if cfg["model"] != "gpt" or kind != "all_to_all" or cfg["mode"] != "ring":
                        # outside the attention op the plan may use all-to-alls of its own
                        assert got >= nbytes, (res["id"], phase, kind, got, nbytes)
                    if kind == "send_recv" or cfg["mode"] == "ring" and cfg["model"] == "gpt":
                        assert got == pytest.approx(nbytes), (res["id"], phase, kind, got, nbytes)
            if res["summary"] is not None:
                assert f"{cfg['mode']}@{axis}" in res["summary"], res["summary"][:2000]
