"""A pipelined context-parallel plan (what the configuration search offers for a long sequence:
pipeline x sequence, ring attention on ``sp``) trained on real gloo ranks against one device.

A small HF LLaMA (2 layers, 64 tokens per sample, 2 samples) on 2 stages x 2 sequence ranks
(4 ranks, mesh ``(pp, sp)``), 2 microbatches of one sample each under 1F1B, built as
``auto_parallelize`` builds a searched pipelined choice (``mesh``, axis names, ``pipeline`` and
the searched ``sequence_parallel="ring"``). One forked run:

* every attention of each stage runs as ring attention on ``sp`` (causal: zig-zag chunks);
* the loss and every gradient of the first step equal one device's, and so do the loss of the
  second step and the parameters after 2 AdamW steps;
* the communication counted over the second step equals the stage plan's estimate per phase,
  kind and axis, bytes and calls (``partitioner.plan_estimate.stage_step_comm``): the ring's
  send/recv and zig-zag all-to-alls per microbatch, the held-back gradient syncs once.
"""

from __future__ import annotations

import copy

from parity_utils import Checks, nested_approx_equal, pipeline_like_one_device, prebuilt

import partitioner
from partitioner.models import hf_llama

MICROBATCHES = 2
PIPELINE = {"degree": 2, "schedule": "1f1b", "microbatches": MICROBATCHES}
OPTIONS = dict(mesh=(2, 2), mesh_axis_names=("pp", "sp"), cluster="h100", sequence_parallel="ring")


def _llama():
    return hf_llama(batch=2, seq=64, n_layer=2, hidden=64, heads=4, kv_heads=2, vocab=128)


def _pipelined_ring_worker(rank, world, _cfg):
    from partitioner.plan_estimate import stage_step_comm

    checks = Checks(rank)
    model, inputs = prebuilt("llama-cp") or _llama()
    ref = copy.deepcopy(model)
    runner = partitioner.auto_parallelize(model, inputs, pipeline=PIPELINE, **OPTIONS)
    (key,) = runner.stages
    plan = runner.stages[key].plan
    attention = [r for r in plan.records if "attention" in r["name"] and r.get("kind") == "op"]
    checks.true(f"stage {key}: attention records {[(r['name'], r.get('notes')) for r in attention]} are not ring on sp",
                bool(attention) and all((r.get("notes") or {}).get("sp") == "ring" for r in attention))

    loss = runner.train_step(inputs)
    _, counter = pipeline_like_one_device(runner, ref, inputs, loss, checks, steps=2)
    want_bytes, want_calls = stage_step_comm(plan, MICROBATCHES)
    sent = counter.phase_dict()
    checks.true(f"stage {key}: no send_recv on sp counted ({sent})",
                any("send_recv" in kinds for kinds in sent.values()))
    for phase in ("fwd", "bwd"):
        for diff in nested_approx_equal(sent.get(phase, {}), want_bytes.get(phase, {})):
            checks.true(f"stage {key}: {phase} communication over the step: {diff}", False)
        for diff in nested_approx_equal(counter.calls_phase_dict().get(phase, {}), want_calls.get(phase, {})):
            checks.true(f"stage {key}: {phase} collective calls over the step: {diff}", False)
    return {"failures": checks.failures}


def test_a_pipelined_ring_attention_plan_trains_like_one_device_and_sends_its_estimate():
    from parity_utils import run_checked

    capture = {"pipeline": PIPELINE, "sequence_parallel": "ring"}
    run_checked(_pipelined_ring_worker, {"mesh": [4]}, 240, prebuild=("llama-cp", _llama, capture))
