"""Pipeline stages' gradient reductions: held back or moved per microbatch, measured against the plan.

A pipeline stage holds back the all-reduces of its parameter gradients over the microbatches of a
step (``runtime.grad_sync.DeferredSyncs``): every parameter edge whose backward communicates
without shrinking the gradient keeps the sum of its unreduced gradients, in the consumer's layout,
until the stage's last backward. An edge whose backward shrinks it (a reduce-scatter onto a weight
stored sharded, ZeRO-2 / ZeRO-3) moves it in every microbatch and holds nothing: the stage keeps
only the shard, in ``.grad``. The estimate counts the held sums (``MemoryBreakdown.held_gradients``,
in both peaks) and prices the reduce-scatters once per microbatch, the all-reduces once per step.

Here, on 2 stages x 2-way data parallelism (4 ranks), first with every weight replicated, then with
the MLP weights stored sharded beside replicated ones in the same stages: the bytes the runtime holds
when it flushes equal the stage plans' figure, and so do the ``.grad`` bytes it has then (made
per microbatch: in the forward peak, ``gradients_in_forward``); the communication counted over a
step (bytes and calls) equals the estimate's, and the runner matches one device (loss, every
gradient, the parameters after 3 AdamW steps). The rule's two sides (the estimate's
``grad_held_back``, the runtime's ``Reshard.backward_shrinks``) agree on mixed edges too. A one-device mesh (and a pipeline whose
stages are one device each) sends nothing, so its plan lists no collective.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

from parity_utils import Checks, built_in_parent, nested_approx_equal, pipeline_like_one_device, prebuilt

import partitioner
from partitioner.models import gpt_demo
from runtime.launch import run_on_ranks

STEPS = 3
MLP_WEIGHTS = ("h.*.mlp.c_fc.weight", "h.*.mlp.c_proj.weight")


PIPELINE = {"degree": 2, "schedule": "1f1b", "microbatches": 4}


def _model():
    return gpt_demo(batch=8, seq=16, n_layer=2, n_embd=32, n_head=2, vocab_size=64)


def _held_worker(rank, world, configs):
    from partitioner.plan_estimate import grad_sync_calls, per_step_comm, plan_collective_calls
    from passes.core.placements import is_shard
    from runtime.collectives import CommCounter
    from runtime.grad_sync import DeferredSyncs

    out = []
    for i, pins in enumerate(configs):
        checks = Checks(rank)
        model, inputs = prebuilt(i) or _model()  # the parent's, its stages captured there
        ref = copy.deepcopy(model)
        pipeline = PIPELINE
        runner = partitioner.auto_parallelize(model, inputs, mesh=(2, 2), pins=pins, cluster="h100", pipeline=pipeline)
        seen, grads = [], []
        flush = DeferredSyncs.flush
        (stage,) = runner.stages.values()  # one stage per rank here

        def measuring_flush(self, flush=flush, seen=seen, grads=grads, stage=stage):
            # after the stage's last backward: the held sums, and the .grad made before them
            seen.append(sum(t.numel() * t.element_size() for t in self._held.values()))
            made = [p.grad for _, p in stage.named_fqn_parameters() if p.grad is not None]
            grads.append(sum(g.numel() * g.element_size() for g in made))
            flush(self)

        DeferredSyncs.flush = measuring_flush
        try:
            with CommCounter() as counter:
                loss = runner.train_step(inputs)
        finally:
            DeferredSyncs.flush = flush
        (key,) = runner.stages
        plan = runner.plan["stages"][int(key)]
        est = plan.estimate()
        expected = per_step_comm(est.comm_bytes, est.grad_sync_bytes, pipeline["microbatches"])
        for diff in nested_approx_equal(counter.as_dict(), expected):
            checks.true(f"communication over the step: {diff}", False)
        # and the calls: per edge (a stage buckets nothing), the held-back ones once per step
        calls = plan_collective_calls(plan, bucket_grads=False)
        held_calls = grad_sync_calls(plan)
        for phase, kinds in calls.items():
            want = per_step_comm(kinds, held_calls if phase == "bwd" else {}, pipeline["microbatches"])
            for diff in nested_approx_equal(counter.calls_phase_dict().get(phase, {}), want):
                checks.true(f"{phase} collective calls over the step: {diff}", False)
        pipeline_like_one_device(runner, ref, inputs, loss, checks, steps=STEPS)
        out.append(
            {
                "held": seen,
                "estimated": est.memory.held_gradients,
                "grads_before_flush": grads,
                "memory": est.memory,
                "sharded_bytes": sum(  # this rank's pieces of the weights stored sharded
                    p.numel() * p.element_size()
                    for _, p, spec in runner.stages[key].placed_parameters()
                    if any(is_shard(pl) for pl in spec)
                ),
                "failures": checks.failures,
                "counted_reduce_scatter": sum(counter.grad_sync_dict().get("reduce_scatter", {}).values()),
                "grad_sync_bytes": est.grad_sync_bytes,
            }
        )
    return out


def test_held_gradient_sums_and_communication_equal_the_estimate():
    """2 stages x 2-way data parallel: replicated weights (their sums held, all-reduced once) and,
    second, MLP weights stored sharded beside replicated ones (theirs reduce-scattered in every
    microbatch, nothing held for them)."""
    dp = {"idx": ["S(0)"], "targets": ["S(0)"], "*": ["R"], "h.?": ["S(0)"], "ln_f": ["S(0)"], "lm_head": ["S(0)"]}
    mixed = dict(dp, **{MLP_WEIGHTS[0]: ["S(0)"], MLP_WEIGHTS[1]: ["S(1)"]})
    with built_in_parent({i: (_model, {"pipeline": PIPELINE}) for i in range(2)}):  # a model per config
        per_rank = run_on_ranks(_held_worker, 4, [dp, mixed], timeout_s=180)
    failures = [f for runs in per_rank for r in runs for f in r["failures"]]
    assert not failures, f"{len(failures)} mismatches, first ones:\n" + "\n".join(failures[:12])
    for runs in per_rank:
        for r in runs:
            assert len(r["held"]) == 1, r["held"]  # one flush per stage and step
            assert r["estimated"] > 0  # the replicated weights' sums, in both configurations
            assert r["held"][0] == r["estimated"], (r["held"], r["estimated"])
            m = r["memory"]
            # the .grad alive while later microbatches run forward, as the forward peak counts it
            assert r["grads_before_flush"] == [m.gradients_in_forward], (r["grads_before_flush"], m)
            assert m.backward_peak >= m.parameters + m.gradients + m.optimizer_state + m.held_gradients
            assert "reduce_scatter" not in r["grad_sync_bytes"]  # never held back, never once per step
        replicated, mixed_run = runs
        assert replicated["sharded_bytes"] == 0 and replicated["counted_reduce_scatter"] == 0
        # the sharded weights' gradients are no longer held (their whole size drops out of the
        # sums), they are reduce-scattered in each of the 4 microbatches, and .grad holds the shard
        whole = 2 * mixed_run["sharded_bytes"]  # 2-way data parallel: the whole is twice the shard
        assert whole > 0
        assert mixed_run["estimated"] == replicated["estimated"] - whole
        assert mixed_run["counted_reduce_scatter"] == 4 * whole
        assert mixed_run["memory"].gradients == replicated["memory"].gradients - whole / 2
        # the shards are made by the first microbatch's backward (the replicated weights' .grad
        # by the flush): in the forward peak
        assert mixed_run["memory"].gradients_in_forward >= mixed_run["sharded_bytes"] > 0


def test_held_back_rule_on_mixed_edges():
    """Which parameter edges a stage holds back, on a 2 x 2 stage mesh: the estimate's rule and
    the runtime's agree (a reduce-scatter on any axis, with an all-reduce on the other or not,
    moves every microbatch; an all-reduce alone, or a gradient all-gathered, is held)."""
    from passes.core.placements import dual_spec, parse_spec
    from passes.plan.cost_model import grad_held_back
    from runtime.reshard import Reshard

    mesh = (2, 2)
    cases = {  # (parameter placement, gradient placement from the consumer) -> held back
        ("[R, R]", "[P, R]"): True,  # data-parallel all-reduce
        ("[R, S(1)]", "[P, S(1)]"): True,  # Megatron weight, all-reduced over dp
        ("[R, R]", "[S(0), R]"): True,  # a gradient all-gathered onto replicated storage
        ("[S(0), R]", "[P, R]"): False,  # ZeRO over dp: reduce-scatter
        ("[S(0), R]", "[P, P]"): False,  # mixed: reduce-scatter on dp, all-reduce on tp
        ("[S(0), S(1)]", "[P, S(1)]"): False,  # ZeRO over dp of a Megatron weight
        ("[R, S(0)]", "[P, R]"): False,  # all-reduce on dp, the piece cut locally on tp
        ("[R, R]", "[R, R]"): False,  # nothing to send
    }
    fake_comm = SimpleNamespace(shape=mesh)
    for (src, grad), held in cases.items():
        s, g = parse_spec(src, 2), parse_spec(grad, 2)
        assert grad_held_back(s, g, mesh) is held, (src, grad)
        edge = Reshard(fake_comm, s, s, g)
        assert edge.grad_dst == dual_spec(s)
        assert (edge.backward_communicates and not edge.backward_shrinks) is held, (src, grad)


def test_no_collective_on_a_one_device_axis():
    model, inputs = gpt_demo(batch=4, seq=16, n_layer=2, n_embd=32, n_head=2, vocab_size=64)
    for shape in ((1,), (2, 1), (1, 2)):
        plan = partitioner.plan(model, inputs, mesh_shape=shape, cluster="h100")
        ones = {plan.axis_names[a] for a, n in enumerate(shape) if n == 1}
        listed = [(r["name"], c["kind"], c["axis"]) for r in plan.records for c in r["comm"] if c["axis"] in ones]
        assert not listed, (shape, listed[:5])
        assert all(set(axes) <= set(plan.axis_names) - ones for axes in plan.estimate().comm_bytes.values())
