"""Weight gathers of recomputed layers started ahead (``passes/lower/prefetch_gathers.py``,
``runtime/recompute.py``), as FSDP with full activation checkpointing does.

GPT on 2 gloo ranks, every layer recomputed (``recompute="all"``), its matrices stored sharded
(ZeRO-3): each layer gathers its weights in forward and again in its rerun. One forked run, every
rank:

* the lowered program starts each recomputed layer's gathers ahead (``PrefetchGather`` of the
  edges inside the layer), and each layer's rerun is linked to the layer before it;
* forward: every gather issued ahead is waited for, and a layer's gathers are issued before any op
  of the layer before it runs;
* backward: each layer's rerun but the first issues the next layer's gathers, and each of them is
  waited for after backward matmuls ran in between (none gathers on the spot);
* loss, every gradient and the parameters after 2 AdamW steps equal the single-device model's;
  the communication counted equals the estimate (prefetching sends the same bytes).

In one process: the rerun gathers' price is their exposed part beside the backward of the next
layer, the known answer of :func:`passes.lower.prefetch_gathers.credit_prefetch`.
"""

import copy

import pytest
from parity_utils import Checks, build, call, check_step_like_one_device, loss_of, run_checked, train_like_one_device

STORED = {name: ["S(1)"] for name in ("wte.weight", "wpe.weight", "lm_head.weight", "h.*.attn.c_attn.weight",
                                      "h.*.attn.c_proj.weight", "h.*.mlp.c_fc.weight", "h.*.mlp.c_proj.weight")}
OPTIONS = dict(cluster="h100", recompute="all", zero=3, pins=STORED)


def _layers(program):
    from runtime.recompute import CheckpointRegion

    return [m for m in program.modules() if isinstance(m, CheckpointRegion) and m.prefetch_sources]


def recompute_prefetch_worker(rank, world, cfg):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import partitioner
    from runtime.prefetch import prefetch_log

    checks = Checks(rank)
    model, inputs = build("gpt")
    ref = copy.deepcopy(model)
    pm = partitioner.auto_parallelize(model, inputs, mesh=(world,), **OPTIONS)
    layers = _layers(pm.program)
    checks.true(f"{len(layers)} recomputed layers gather weights ahead, not 2", len(layers) == 2)
    checks.true("the second layer's rerun does not start the first's gathers",
                len(layers) == 2 and layers[1]._rerun_next[0] is layers[0] and layers[0]._rerun_next[0] is None)
    edges = {id(e): k for k, layer in enumerate(layers) for _, e in layer.prefetch_sources}

    class OpLog(TorchDispatchMode):
        def __init__(self, log):
            super().__init__()
            self.log = log

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.log.append(("op", str(func), None, None))
            return func(*args, **(kwargs or {}))

    names = {layer_edge.weight_name: k for k, layer in enumerate(layers) for _, layer_edge in layer.prefetch_sources}
    with prefetch_log() as log:
        with OpLog(log):
            out = call(pm, inputs)
        fwd_end = len(log)
        with OpLog(log):
            loss_of(out).backward()
    forward = [(i, e) for i, e in enumerate(log[:fwd_end]) if e[0] != "op"]
    issued = [e[1] for _, e in forward if e[0] == "issue"]
    checks.true(f"forward: {len(issued)} gathers issued ahead, {sum(e[0] == 'wait' for _, e in forward)} waited",
                len(issued) == sum(e[0] == "wait" for _, e in forward) and len(issued) >= len(edges))
    # layer 1's gathers are issued before the first op of layer 0 (which waits for layer 0's own)
    first_wait_0 = next(i for i, e in forward if e[0] == "wait" and names.get(e[1]) == 0)
    issue_1 = [i for i, e in forward if e[0] == "issue" and names.get(e[1]) == 1]
    checks.true(f"forward: layer 1's gathers issued at {issue_1}, not before layer 0's first wait ({first_wait_0})",
                issue_1 and max(issue_1) < first_wait_0)
    back = [(i, e) for i, e in enumerate(log) if i >= fwd_end and e[0] in ("issue", "wait")]
    issues = {e[1]: i for i, e in back if e[0] == "issue" and e[1] in names}
    layer0 = [w for w, k in names.items() if k == 0]
    checks.true(f"backward: the rerun issued {sorted(issues)}, not layer 0's gathers {sorted(layer0)}",
                sorted(issues) == sorted(layer0))
    for i, e in back:
        if e[0] == "wait" and e[1] in names:
            start = issues.get(e[1])
            matmuls = [j for j in range(start or i, i) if log[j][0] == "op" and "mm" in log[j][1]]
            checks.true(f"backward: the rerun gather of {e[1]} waited at {i}, issued at {start}, no matmul between",
                        start is not None and start < i and matmuls)
    for p in pm.parameters():
        p.grad = None
    ref.zero_grad(set_to_none=True)
    check_step_like_one_device(pm, ref, inputs, checks, "recomputed, gathers ahead")
    train_like_one_device(pm, ref, inputs, 2, checks, "recomputed, gathers ahead")
    torch.distributed.barrier()
    return {"failures": checks.failures}


def test_recomputed_layers_gather_their_weights_ahead_forward_and_in_the_rerun():
    run_checked(recompute_prefetch_worker, {"mesh": [2]}, 150)


def test_rerun_gathers_are_priced_beside_the_next_layers_backward(fake_process_group):
    """Layer 0's rerun gathers (started by layer 1's rerun) are exposed ``total - min(total, window)``
    together, the window being the backward (rerun included) of the ops after layer 0 up to the
    end of layer 1; layer 1's (the first rerun) are not credited."""
    import partitioner
    from passes.lower.prefetch_gathers import gather_sites, rerun_windows

    fake_process_group(2)
    model, inputs = build("gpt")
    plan = partitioner.plan(model, inputs, mesh_shape=(2,), **OPTIONS)
    ops = [r for r in plan.records if r.get("kind") == "op"]
    reruns = lambda span: [c for i in span for c in ops[i]["comm"] if c.get("recompute") and c["kind"] == "all_gather"]  # noqa: E731
    sites = gather_sites([(r.get("region") if r.get("recompute") else None,
                           [c for c in r["comm"] if c["phase"] == "fwd" and c["kind"] == "all_gather"
                            and not c.get("recompute")]) for r in ops])
    windows = rerun_windows(sites)
    assert len(windows) == 1
    layer0, window = windows[0]
    total = sum(c["gather_s"] for c in reruns(layer0))
    overlapped = sum(ops[i].get("compute_s", 0.0) - ops[i].get("forward_s", 0.0) for i in window)
    assert total > 0 and overlapped > 0
    assert sum(c["time_s"] for c in reruns(layer0)) == pytest.approx(total - min(total, overlapped), rel=1e-9)
    last = [s for _, _, s in sites if s is not None][-1]
    assert all(c["time_s"] == c.get("gather_s", c["time_s"]) for c in reruns(last))
