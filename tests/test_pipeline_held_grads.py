"""Pipeline stages' held gradient sums in the memory estimate; no collective on a size-1 axis.

A pipeline stage holds back its parameter-gradient reductions over the microbatches of a step
(``runtime.grad_sync.DeferredSyncs``): every parameter edge whose backward communicates keeps the
sum of its unreduced gradients, in the consumer's layout, until the stage's last backward. The
estimate counts those sums (``MemoryBreakdown.held_gradients``, in both peaks); here the bytes
the runtime holds at the moment it flushes are measured and compared with the stage plans'
figure, on a data x tensor stage mesh and with data parallelism alone. A one-device mesh (and a
pipeline whose stages are one device each) sends nothing, so its plan lists no collective.
"""

from __future__ import annotations

import partitioner
from partitioner.models import gpt_demo
from runtime.launch import run_on_ranks


def _held_worker(rank, world, configs):
    from runtime.grad_sync import DeferredSyncs

    out = []
    for pins in configs:
        model, inputs = gpt_demo(batch=8, seq=16, n_layer=2, n_embd=32, n_head=2, vocab_size=64)
        pipeline = {"degree": 2, "schedule": "1f1b", "microbatches": 4}
        runner = partitioner.auto_parallelize(model, inputs, mesh=(2, 2), pins=pins, cluster="h100", pipeline=pipeline)
        seen = []
        flush = DeferredSyncs.flush

        def measuring_flush(self, flush=flush, seen=seen):
            seen.append(sum(t.numel() * t.element_size() for t in self._held.values()))
            flush(self)

        DeferredSyncs.flush = measuring_flush
        try:
            runner.train_step(inputs)
        finally:
            DeferredSyncs.flush = flush
        est = runner.plan["stages"][runner.comm_pp[1]].estimate()
        out.append({"held": seen, "estimated": est.memory.held_gradients, "memory": est.memory})
    return out


def test_held_gradient_sums_measured_equal_the_estimate():
    """2 stages x 2-way data parallel: replicated weights (their sums held, all-reduced once) and,
    second, MLP weights stored sharded and gathered for use (their sums held whole, reduce-scattered
    once)."""
    dp = {"idx": ["S(0)"], "targets": ["S(0)"], "*": ["R"], "h.?": ["S(0)"], "ln_f": ["S(0)"], "lm_head": ["S(0)"]}
    sharded = dict(dp, **{"h.*.mlp.c_fc.weight": ["S(0)"], "h.*.mlp.c_proj.weight": ["S(1)"]})
    per_rank = run_on_ranks(_held_worker, 4, [dp, sharded], timeout_s=180)
    for runs in per_rank:
        for r in runs:
            assert len(r["held"]) == 1, r["held"]  # one flush per stage and step
            assert r["estimated"] > 0
            assert r["held"][0] == r["estimated"], (r["held"], r["estimated"])
            m = r["memory"]
            assert m.backward_peak >= m.parameters + m.gradients + m.optimizer_state + m.held_gradients
        # the sums are held whole (the consumer's layout) while the stored gradients shrink
        replicated, stored_sharded = runs
        assert stored_sharded["estimated"] == replicated["estimated"]
        assert stored_sharded["memory"].gradients < replicated["memory"].gradients


def test_no_collective_on_a_one_device_axis():
    model, inputs = gpt_demo(batch=4, seq=16, n_layer=2, n_embd=32, n_head=2, vocab_size=64)
    for shape in ((1,), (2, 1), (1, 2)):
        plan = partitioner.plan(model, inputs, mesh_shape=shape, cluster="h100")
        ones = {plan.axis_names[a] for a, n in enumerate(shape) if n == 1}
        listed = [(r["name"], c["kind"], c["axis"]) for r in plan.records for c in r["comm"] if c["axis"] in ones]
        assert not listed, (shape, listed[:5])
        assert all(set(axes) <= set(plan.axis_names) - ones for axes in plan.estimate().comm_bytes.values())
