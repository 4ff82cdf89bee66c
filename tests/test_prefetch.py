"""Prefetched weight gathers (``passes/lower/prefetch_gathers.py``, ``runtime/prefetch.py``), on 4 gloo ranks.

GPT on (4,), ZeRO-3 under half the replicated Adam state, its matrices stored sharded (each gathered for
use and gathered again in backward). One forked run, every rank:

* the lowered program starts one gather per gathered weight edge ahead (``PrefetchGather``);
* one forward + backward, with the prefetch events and every aten op logged in one sequence:
  forward, weight ``i + 1``'s gather is issued after weight ``i``'s was waited for and before the
  first op using weight ``i``'s gathered copy runs, and waited for before the first op using its
  own; backward, every regather but the first is issued (when the one after it in forward is
  unpacked) before matmuls of backward that it overlaps, and waited for later;
* loss and every gradient equal the single-device model's, the communication counted equals the
  estimate (prefetching sends the same bytes), the all-reduced gradients are one flat collective
  and each ZeRO-3 weight's gradient is reduce-scattered alone, at once;
* a prefetched gather that one rank does not join in time raises ``RuntimeError`` naming the
  weight (the other ranks join it afterwards, so the run ends cleanly); without a limit of its
  own, the wait has the job's collective timeout (``tests/test_runtime_api.py``'s stalled rank).

The credited overlap is checked in one process: each prefetched gather's exposed time is
``max(0, gather - compute it overlaps)`` and the estimate's step is the solver's less the credit
(plus the optimizer step, also priced after solving).
"""

import copy

import pytest
from parity_utils import MODELS, Checks, build, call, check_step_like_one_device, loss_of, run_checked

BUDGET = 0.5
# every matrix stored sharded and gathered for use: with the backward walked op by op the
# time-optimal plan under BUDGET gathers few of them, and the checks want gathers to order; on
# dim 0, whose gather copies nothing (stored S(1), each gather also copies the weight back into
# order, passes/plan/move_scratch.py, and under BUDGET the plan moves them by all-to-all instead)
STORED = {name: ["S(0)"] for name in ("wte.weight", "wpe.weight", "lm_head.weight", "h.*.attn.c_attn.weight",
                                      "h.*.attn.c_proj.weight", "h.*.mlp.c_fc.weight", "h.*.mlp.c_proj.weight")}


def _ptr(t):
    return t.untyped_storage().data_ptr()


def prefetch_worker(rank, world, cfg):
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    import partitioner
    from runtime.prefetch import PrefetchGather, finish, issue, prefetch_log, wait_timeout

    checks = Checks(rank)
    model, inputs = build("gpt")
    ref = copy.deepcopy(model)
    n_params = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    pm = partitioner.auto_parallelize(model, inputs, mesh=(4,), cluster="h100", recompute="none", zero=3,
                                      memory_budget=int(BUDGET * 16 * n_params), pins=STORED)
    program = pm.program
    prefetches = [m for m in program.modules() if isinstance(m, PrefetchGather)]
    checks.true("no prefetched gather in the program", len(prefetches) >= 4)

    class OpLog(TorchDispatchMode):
        def __init__(self, log):
            super().__init__()
            self.log = log

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ptrs = {_ptr(a) for a in args if isinstance(a, torch.Tensor)}
            self.log.append(("op", str(func), None, ptrs))
            return func(*args, **(kwargs or {}))

    with prefetch_log() as log:
        with OpLog(log):
            out = call(pm, inputs)
        fwd_end = len(log)
        with OpLog(log):
            loss_of(out).backward()
    issued = [i for i, e in enumerate(log) if e[0] == "issue" and e[2] == "fwd"]
    waited = [i for i, e in enumerate(log) if e[0] == "wait" and e[2] == "fwd"]
    checks.true(f"{len(issued)} forward gathers issued, {len(waited)} waited, {len(prefetches)} edges",
                len(issued) == len(waited) == len(prefetches))

    def first_use(i):
        ptr = _ptr(log[i][3])
        return next((j for j in range(i + 1, fwd_end) if log[j][0] == "op" and ptr in log[j][3]
                     and "copy" not in log[j][1]), None)

    for k in range(len(issued) - 1):
        a_wait, b_issue, b_wait = waited[k], issued[k + 1], waited[k + 1]
        a, b = log[a_wait][1], log[b_issue][1]
        use_a, use_b = first_use(a_wait), first_use(b_wait)
        checks.true(f"forward: {b}'s gather issued at {b_issue}, not between {a}'s wait ({a_wait}) and "
                    f"its first use ({use_a})", use_a is not None and a_wait < b_issue < use_a)
        checks.true(f"forward: {b}'s gather waited at {b_wait}, not before its first use ({use_b})",
                    use_b is not None and b_issue < b_wait < use_b)
    # backward: regathers issued ahead, with backward matmuls between issue and wait
    back = [(i, e) for i, e in enumerate(log) if i >= fwd_end and e[0] in ("issue", "wait")]
    regathered = sum(1 for r in pm.plan.records for c in r["comm"] if c.get("regather"))
    issues = {e[1]: i for i, e in back if e[0] == "issue"}
    checks.true(f"backward: {len(issues)} regathers prefetched, the plan regathers {regathered} edges",
                len(issues) == regathered - 1 and regathered > 1)
    for i, e in back:
        if e[0] != "wait":
            continue
        start = issues.get(e[1])
        matmuls = [j for j in range(start or i, i) if log[j][0] == "op" and "mm" in log[j][1]]
        checks.true(f"backward: regather of {e[1]} waited at {i}, issued at {start} with no matmul between",
                    start is not None and start < i and matmuls)
    # parity and communication: one more step, with the reference
    for p in pm.parameters():
        p.grad = None
    counter = check_step_like_one_device(pm, ref, inputs, checks, "prefetched")
    # the all-reduced gradients share one flat collective (one bucket); a ZeRO-3 weight's gradient
    # is reduce-scattered at once, alone (runtime/grad_sync.py): one call per regathered weight edge
    calls = {k: dict(v) for k, v in counter.grad_sync_calls.items()}
    by_name = {r["name"]: r for r in pm.plan.records}
    alone = sum(1 for r in pm.plan.records for c in r["comm"]
                if c["phase"] == "bwd" and c["kind"] == "reduce_scatter" and c.get("bucketed")
                and by_name[r["inputs"][c["input"]]].get("regather"))
    checks.true(f"gradient syncs: {calls}, not one flat all-reduce and {alone} reduce-scatters",
                alone > 0 and calls.get("reduce_scatter") == {"a0": alone}
                and all(n == 1 for n in calls.get("all_reduce", {}).values()))

    # a gather one rank does not join in time: rank 0 waits 1 s, then the others join it
    edge = prefetches[0].edge
    shard = dict(program.named_parameters()).get(edge.param_edge)
    shard = shard if shard is not None else next(p for n, p in pm.named_parameters() if n == edge.weight_name)
    if rank == 0:
        pending = issue(edge, shard, "fwd")
        try:
            with wait_timeout(1.0):
                finish(edge, pending)
            checks.true("a gather no other rank joined did not time out", False)
        except RuntimeError as exc:
            checks.true(f"the timeout does not name the weight: {exc}",
                        edge.weight_name in str(exc) and "did not complete within 1 s" in str(exc))
        for r in range(1, world):
            dist.send(torch.zeros(1), r)
        finish(edge, pending)
    else:
        dist.recv(torch.zeros(1), 0)
        finish(edge, issue(edge, shard, "fwd"))
    dist.barrier()
    return {"failures": checks.failures}


def test_weight_gathers_are_prefetched_forward_and_backward():
    run_checked(prefetch_worker, {"mesh": [4]}, 150, prebuild=("gpt", MODELS["gpt"]["factory"]))


def test_prefetch_overlap_is_priced(fake_process_group):
    """Each prefetched gather's time is its exposed part; the estimate is the solver's step less
    the credited overlap, which is positive for a ZeRO-3 GPT."""
    import partitioner

    fake_process_group(4)
    model, inputs = build("gpt")
    n_params = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    plan = partitioner.plan(model, inputs, mesh_shape=(4,), cluster="h100", recompute="none", zero=3,
                            memory_budget=int(BUDGET * 16 * n_params), pins=STORED)
    prefetched = [c for r in plan.records for c in r["comm"] if "gather_s" in c]
    assert prefetched and all(c["kind"] == "all_gather" for c in prefetched)
    assert all(0.0 <= c["time_s"] <= c["gather_s"] for c in prefetched)
    credit = sum(c["gather_s"] - c["time_s"] for c in prefetched)
    stats = plan.data["stats"]
    assert credit > 0 and stats["prefetch_overlap_s"] == pytest.approx(credit, rel=1e-12)
    # the step is priced after solving too, with the flat buffers' call latency (passes/plan/collective_calls.py),
    # less the gradient reductions backward hides (ZeRO-3's, reduced alone: passes/plan/bucket_overlap.py)
    assert stats["bucket_overlap_s"] > 0
    solved = (stats["objective_s"] - credit - stats["bucket_overlap_s"] + stats["optimizer_step_s"]
              + plan.estimate().flat_latency_s)
    assert plan.estimate().step_time_s == pytest.approx(solved, rel=1e-9)


def test_prefetch_credit_scales_with_the_measured_overlap(fake_process_group):
    """``ClusterSpec.prefetch_overlap`` (``partitioner calibrate`` measures it) is the fraction of
    the overlapped compute a prefetched gather is credited with: the same plan (the solver prices
    gathers whole, so the overlap does not change it) gets that fraction of the full credit, and
    none at 0."""
    import dataclasses

    import partitioner

    fake_process_group(4)
    model, inputs = build("gpt")
    n_params = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    credit, placements = {}, {}
    for f in (1.0, 0.25, 0.0):
        cluster = dataclasses.replace(partitioner.get_cluster("h100"), prefetch_overlap=f)
        plan = partitioner.plan(model, inputs, mesh_shape=(4,), cluster=cluster, recompute="none", zero=3,
                                memory_budget=int(BUDGET * 16 * n_params), pins=STORED)
        credit[f] = plan.data["stats"]["prefetch_overlap_s"]
        placements[f] = [r["out"] for r in plan.records]
        prefetched = [c for r in plan.records for c in r["comm"] if "gather_s" in c]
        assert prefetched and all(c["gather_s"] - c["time_s"] <= f * c["gather_s"] + 1e-15 for c in prefetched)
    assert placements[1.0] == placements[0.25] == placements[0.0]
    assert credit[1.0] > 0 and credit[0.25] == pytest.approx(0.25 * credit[1.0], rel=1e-9) and credit[0.0] == 0.0
