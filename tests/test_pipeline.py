"""Pipeline parallelism (``auto_parallelize(..., pipeline={...})``): parity, balance, bad configs.

Parity (tier 3, see docs/ARCHITECTURE.md): one forked gloo run per config; each rank builds the model and a
deep copy as the single-device reference (full batch), runs ``runner.train_step(batch)`` (forward
and backward over all microbatches) and checks, fp32 with ``torch.testing.assert_close``
defaults, the loss and EVERY gradient (``runner.full_grads()``) against the reference; then 3
AdamW steps on both sides (the runner's over ``runner.parameters()``, its local pieces) and the
parameters (``runner.full_state_dict()``) and the losses on the way.

The matrix covers each item at least once without the cartesian product:

============  ======  =============  ===========  ==================================
model         mesh    schedule       microbatch   what else
============  ======  =============  ===========  ==================================
gpt           (2,)    gpipe          4
gpt           (2,)    1f1b           8
gpt           (2,)    interleaved 2  4            4 stages on 2 ranks
gpt           (2,)    zb-h1          4
gpt           (2,)    1f1b           4            captured with layers="blocks"
gpt (8 lay.)  (4,)    interleaved 2  8            8 stages on 4 ranks (captured by blocks)
gpt2 eager    (2,)    zb-h1          8            the attention mask crosses stages
gpt2 eager    (4,)    1f1b           4            tied wte / lm_head on ranks 0 and 3
gpt2 eager    (2, 2)  gpipe          4            PP x DP (inputs pinned S(0))
gpt           (2, 2)  1f1b           4            PP x DP to every block: batch-sharded boundary
llama         (2,)    interleaved 2  8
llama         (2, 2)  1f1b           4            PP x TP (Megatron pins in the stages)
gpt           (4,)    1f1b           2            fewer microbatches than stages
============  ======  =============  ===========  ==================================

Fewer microbatches than stages: 1F1B (and GPipe / ZB-H1) schedule it and must be exact;
interleaved refuses it with a ValueError naming the numbers. Bad configurations (unknown
schedule, degree != first mesh axis, a model without repeated layers, a pin no stage resolves,
a ``layers=`` capture the model does not allow) fail with clear errors before a rank's first
exchange: they are checked in this process as rank 0 on torch's fake process group.
Balance: a uniform 16-layer transformer on ``meta`` cut into 4 stages holds whole layers per
stage, within 10% of the mean stage cost.
"""
import contextlib
import copy
import logging
import math
import re

import pytest
import torch
import torch.distributed as dist
from parity_utils import (
    Checks,
    built_in_parent,
    call,
    loss_of,
    nested_approx_equal,
    pipeline_like_one_device,
    prebuilt,
    run_checked,
    slow_tier,
)

from runtime.launch import run_on_ranks

TIMEOUT_S = 180
STEPS = 3
BATCH, SEQ = 8, 16

# Megatron inside each stage (the sub-mesh is 1-D): column-parallel weights split by output
# feature with feature-sharded outputs, row-parallel weights split by input feature with
# partial-sum outputs; the embedding and head split by vocabulary.
LLAMA_COLUMN = ("model.layers.*.self_attn.q_proj", "model.layers.*.self_attn.k_proj",
                "model.layers.*.self_attn.v_proj", "model.layers.*.mlp.gate_proj", "model.layers.*.mlp.up_proj")
LLAMA_ROW = ("model.layers.*.self_attn.o_proj", "model.layers.*.mlp.down_proj")


def _llama_tp_pins():
    pins = {}
    for module in LLAMA_COLUMN:
        pins[f"{module}.weight"] = ["S(0)"]
        pins[module] = ["S(2)"]
    for module in LLAMA_ROW:
        pins[f"{module}.weight"] = ["S(1)"]
        pins[module] = ["P"]
    pins["model.embed_tokens.weight"] = ["S(0)"]
    pins["model.embed_tokens"] = ["P"]
    pins["lm_head.weight"] = ["S(0)"]
    pins["lm_head"] = ["S(2)"]
    return pins


def _build(model_name, n_layer):
    from partitioner import models
    if model_name == "gpt":
        return models.gpt_demo(batch=BATCH, seq=SEQ, n_layer=n_layer)
    if model_name == "gpt2":
        return models.hf_gpt2(batch=BATCH, seq=SEQ, n_layer=n_layer, attn="eager")
    if model_name == "llama":
        return models.hf_llama(batch=BATCH, seq=SEQ, n_layer=n_layer)
    if model_name == "mlp":
        return models.mlp_demo(batch=BATCH)
    raise ValueError(model_name)


def _input_names(model_name):
    return {"gpt": ("idx", "targets"), "gpt2": ("input_ids", "labels"), "llama": ("input_ids", "labels"),
            "mlp": ("x", "target")}[model_name]


def _pins(model_name, kind):
    if kind is None:
        return None
    if kind == "dp":  # the batch split at the inputs and kept split through every block: a model this
        # small could otherwise gather its token ids and run whole on both ranks (no gradient sync)
        blocks = {"gpt": "h.?", "gpt2": "transformer.h.?", "llama": "model.layers.?"}[model_name]
        return {**{name: ["S(0)"] for name in _input_names(model_name)}, blocks: ["S(0)"]}
    if kind == "tp":
        assert model_name == "llama"
        return _llama_tp_pins()
    if kind == "dpact":   # data parallel down to every block's output (module paths h.0, h.1, ...): the stage boundary is batch-sharded
        assert model_name == "gpt"
        return {**{name: ["S(0)"] for name in _input_names(model_name)}, "h.?": ["S(0)"]}
    raise ValueError(kind)


# ------------------------------------------------------------------------------ the rank worker


def _prebuild(cfg) -> tuple:
    """The config's model built and its stages captured in the parent, once for every rank."""
    options = dict(pipeline=cfg["pipeline"], layers=cfg.get("layers", "auto"))
    return ("pipelined", lambda: _build(cfg["model"], cfg["n_layer"]), options)


def pipeline_worker(rank, world, cfg):
    import partitioner

    checks = Checks(rank)
    model, inputs = prebuilt("pipelined") or _build(cfg["model"], cfg["n_layer"])
    ref = copy.deepcopy(model)
    runner = partitioner.auto_parallelize(model, inputs, mesh=cfg["mesh"], pipeline=cfg["pipeline"],
                                          cluster="h100", pins=_pins(cfg["model"], cfg.get("pins")),
                                          layers=cfg.get("layers", "auto"))
    result = {"rank": rank, "failures": checks.failures}
    sched = runner.schedule
    result["schedule"] = {"name": sched.name, "ranks": sched.num_ranks, "stages": sched.num_stages,
                          "microbatches": sched.num_microbatches, "stage_to_rank": list(sched.stage_to_rank)}
    result["layers"] = [list(run) for run in runner.plan["layers"]]
    if cfg["pipeline"].get("schedule") is None:   # what the stage estimates favour, recomputed here
        from partitioner.pipeline_simulation import stage_times
        from passes.schedules import choose_schedule
        name, _ = choose_schedule(sched.num_ranks, sched.num_microbatches, *stage_times(runner))
        result["expected_schedule"] = name.replace("-", "_")
    result["sends"] = [list(g.sends) for g in runner.stage_graphs]
    result["carried"] = {name: list(shape) for name, (shape, _) in runner.carried_meta.items()}
    result["activation_copies"] = [plan.data["activation_copies"] for plan in runner.plan["stages"]]
    from passes.schedules import stage_in_flight
    result["in_flight"] = [stage_in_flight(sched)[s] for s in range(sched.num_stages)]
    if rank == 0:   # what the stage plans decided for parameters and inputs (FQN / argument name)
        placements = []
        for plan in runner.plan["stages"]:
            placements.append({r.get("fqn") or r["name"]: r["out"][0] for r in plan.records
                               if r["kind"] in ("param", "input") and r["out"]})
        result["placements"] = placements

    # 1. loss and every gradient after one pipelined forward + backward; the stages' collectives
    # are those their plans price: per microbatch, parameter gradients once per step
    from partitioner.plan_estimate import per_step_comm
    from runtime.collectives import CommCounter
    with CommCounter() as counter:
        loss = runner.train_step(inputs)
    expected: dict = {}
    for key in runner.stages:
        plan = runner.plan["stages"][int(key)]
        est, sizes = plan.estimate(), dict(zip(plan.axis_names, plan.mesh_shape))
        for kind, axes in per_step_comm(est.comm_bytes, est.grad_sync_bytes, sched.num_microbatches).items():
            for axis, nbytes in axes.items():
                if sizes[axis] > 1 and nbytes:   # (a one-device stage mesh sends nothing)
                    expected.setdefault(kind, {}).setdefault(axis, 0.0)
                    expected[kind][axis] += nbytes
    diffs = nested_approx_equal(counter.as_dict(), expected)
    checks.true(f"counted communication differs from the estimate: {diffs}", not diffs)
    own = [runner.plan["stages"][int(key)].estimate().grad_sync_bytes for key in runner.stages]
    result["grad_sync"] = (sum(counter.grad_sync_dict().get("all_reduce", {}).values()),
                           sum(v for syncs in own for v in syncs.get("all_reduce", {}).values()))
    result["loss"] = loss.item()
    # 2. the loss, every gradient (tied weights, GPT-2's wte / lm_head, under exactly one of their
    # names), three AdamW steps on both (the first reuses the gradients above), the parameters
    pipeline_like_one_device(runner, ref, inputs, loss, checks, steps=STEPS)
    return result


# -------------------------------------------------------------------------------------- parity


def pipeline_case(model, mesh, schedule, microbatches, *, n_layer=4, virtual_stages=None, pins=None, layers="auto",
                  note=""):
    """One pipelined config as a ``pytest.param``: stages on mesh axis 0, the rest of the mesh
    inside each stage (``pins``: how), its id naming the layout, schedule and microbatches."""
    pipeline = {"degree": mesh[0], "schedule": schedule, "microbatches": microbatches}
    if virtual_stages:
        pipeline["virtual_stages"] = virtual_stages
    cfg = {"model": model, "mesh": mesh, "pipeline": pipeline, "n_layer": n_layer, "pins": pins, "layers": layers}
    layout = f"pp{mesh[0]}" + "".join(f"x{pins or 'sub'}{n}" for n in mesh[1:])
    label = f"{model}-{layout}-{schedule}{virtual_stages or ''}-m{microbatches}"
    label += f"-{note}" if note else ""
    return pytest.param(cfg, id=label)


# slow_tier: cases that repeat a schedule or a layout another case runs (make test-slow)
CONFIGS = [
    # hand-written GPT: every schedule on 2 stages, and 8 stages interleaved on 4 ranks
    pipeline_case("gpt", (2,), "gpipe", 4),
    pipeline_case("gpt", (2,), "1f1b", 8),
    pipeline_case("gpt", (2,), "interleaved", 4, virtual_stages=2),
    pipeline_case("gpt", (2,), "zb-h1", 4),
    pipeline_case("gpt", (2,), "1f1b", 4, layers="blocks", note="captured-by-blocks"),
    slow_tier(pipeline_case("gpt", (4,), "interleaved", 8, n_layer=8, virtual_stages=2)),
    # HF GPT-2, eager attention: its causal mask is made before the layers and crosses stages
    slow_tier(pipeline_case("gpt2", (2,), "zb-h1", 8)),
    slow_tier(pipeline_case("gpt2", (4,), "1f1b", 4)),
    pipeline_case("gpt2", (2, 2), "gpipe", 4, pins="dp"),
    slow_tier(pipeline_case("gpt2", (2, 2), "zb-h1", 4, pins="dp", note="weight-pass-reduces-once")),
    pipeline_case("gpt", (2, 2), "zb-h1", 4, pins="dpact", note="weight-pass-reduces-once"),
    pipeline_case("gpt", (2, 2), "1f1b", 4, pins="dpact", note="batch-sharded-stage-boundary"),
    # HF LLaMA (rotary embeddings cross stages)
    pipeline_case("llama", (2,), "interleaved", 8, virtual_stages=2),
    pipeline_case("llama", (2, 2), "1f1b", 4, pins="tp"),
    # fewer microbatches than stages: 1F1B degrades towards GPipe and stays exact
    pipeline_case("gpt", (4,), "1f1b", 2, note="fewer-microbatches-than-stages"),
]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_pipeline_parity(cfg):
    results = run_checked(pipeline_worker, cfg, TIMEOUT_S, prebuild=_prebuild(cfg))
    assert len({r["loss"] for r in results}) == 1, [r["loss"] for r in results]   # broadcast to every rank

    pipe, r0 = cfg["pipeline"], results[0]
    degree, v = pipe["degree"], pipe.get("virtual_stages", 1)
    sched = r0["schedule"]
    assert (sched["ranks"], sched["stages"], sched["microbatches"]) == (degree, degree * v, pipe["microbatches"])
    # each stage was planned for the activations its schedule keeps alive
    assert r0["activation_copies"] == r0["in_flight"], (r0["activation_copies"], r0["in_flight"])
    # the stages hold whole, contiguous layers, all of them, in order
    layers = r0["layers"]
    assert len(layers) == degree * v and all(layers), layers
    assert [i for run in layers for i in run] == list(range(cfg["n_layer"])), layers

    if cfg["model"] == "gpt2":   # the eager attention mask is built once, before the first layer
        assert all(len(sends) >= 2 for sends in r0["sends"][:-1]), r0["sends"]
    placements = r0["placements"]
    if cfg["pins"] == "dp":      # every stage on its 2 ranks: the batch split, the weights replicated
        # their gradients all-reduced over dp once per step (one stage's gradients), not per microbatch
        syncs = [r["grad_sync"] for r in results]
        assert all(counted == once for counted, once in syncs) and any(once for _, once in syncs), syncs
        for name in _input_names(cfg["model"]):
            used = [p[name] for p in placements if name in p]
            assert used and all(pl == "[S(0)]" for pl in used), (name, used)
        for p in placements:  # the parameters (FQNs; inputs and activations are plain names)
            assert all(pl == "[R]" for name, pl in p.items() if "." in name), p
    if cfg["pins"] == "dpact":   # each rank sends only its half of the microbatch across the boundary
        micro = BATCH // pipe["microbatches"]
        assert r0["carried"] and all(shape[0] == micro // 2 for shape in r0["carried"].values()), r0["carried"]
        assert all(p[name] == "[S(0)]" for p in placements[1:] for name in p if name in r0["carried"]), placements
    if cfg["pins"] == "tp":      # Megatron in every stage's layers
        for p in placements:
            weights = {n: pl for n, pl in p.items() if n.startswith("model.layers.") and n.endswith("proj.weight")}
            assert weights, p
            for name, pl in weights.items():
                column = any(name.endswith(m.rpartition(".")[2] + ".weight") for m in LLAMA_COLUMN)
                assert pl == ("[S(0)]" if column else "[S(1)]"), (name, pl)


# ------------------------------------------------------------------------------ refusals, errors


@contextlib.contextmanager
def fake_job(world: int):
    """This process as rank 0 of a ``world``-rank job on torch's fake process group: collectives
    return at once and carry nothing, so everything a rank decides before its first real
    exchange (configuration checks, capture, rank 0's planning) runs in this one process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


ERRORS = [
    pytest.param("gpt", 4, (2,), {"degree": 2, "schedule": "interleaved", "microbatches": 1, "virtual_stages": 2},
                 {}, r"m=1 microbatches on p=2 ranks", id="interleaved-fewer-microbatches-than-ranks"),
    pytest.param("gpt", 4, (2,), {"degree": 2, "schedule": "pipedream"},
                 {}, r"unknown pipeline schedule 'pipedream'.*gpipe.*1f1b.*interleaved.*zb-h1", id="unknown-schedule"),
    pytest.param("gpt", 4, (4,), {"degree": 2, "schedule": "1f1b"},
                 {}, r"pipeline degree 2 must equal the first mesh axis \(4\)", id="degree-not-first-mesh-axis"),
    pytest.param("gpt", 4, (2, 2), {"degree": 4, "schedule": "gpipe"},
                 {}, r"pipeline degree 4 must equal the first mesh axis \(2\)", id="degree-not-first-mesh-axis-2d"),
    pytest.param("mlp", None, (2,), {"degree": 2, "schedule": "1f1b", "microbatches": 2},
                 {}, r"repeated layers.*has none", id="no-repeated-layers"),
    pytest.param("gpt", 2, (4,), {"degree": 4, "schedule": "gpipe", "microbatches": 4},
                 {}, r"4 pipeline stages need at least 4 layers; the model has 2", id="more-stages-than-layers"),
    pytest.param("gpt", 4, (2,), {"degree": 2, "schedule": "1f1b", "microbatches": 3},
                 {}, r"batch dim.*\b8\b.*3 microbatches", id="batch-not-divisible"),
    # a pin no stage resolves is the error it is without pipelines, not silently dropped
    pytest.param("gpt", 4, (2,), {"degree": 2}, {"pins": {"h.9.attn": ["R"]}},
                 r"pin 'h.9.attn' matches no input, parameter, node or module of this model",
                 id="pin-matches-no-stage"),
    pytest.param("gpt", 4, (2,), {"degree": 2}, {"pins": {"h.0.attn": ["R", "S(0)"]}},
                 r"placement .* has 2 entries; the mesh has 1 axes", id="pin-for-the-wrong-mesh"),
    # layers= reaches the pipeline's capture: GPT with 2 layers has no 3 identical ones to repeat
    pytest.param("gpt", 2, (2,), {"degree": 2}, {"layers": "blocks"},
                 r"no list of 3 or more identical layers.*layers='full'", id="layers-blocks-without-blocks"),
    pytest.param("gpt", 4, (2,), {"degree": 2}, {"layers": "some"},
                 r"layers must be 'auto', 'full' or 'blocks', got 'some'", id="layers-unknown"),
]


@pytest.mark.parametrize("model_name, n_layer, mesh, pipeline, options, message", ERRORS)
def test_pipeline_config_errors(model_name, n_layer, mesh, pipeline, options, message):
    """Every check here runs before a rank's first real exchange, the same on every rank (the
    memory test below covers an error raised on rank 0 while planning reaching the others)."""
    import partitioner
    model, inputs = _build(model_name, n_layer)
    with fake_job(math.prod(mesh)), pytest.raises(ValueError, match=message):
        partitioner.auto_parallelize(model, inputs, mesh=mesh, pipeline=pipeline, cluster="h100", **options)


def test_pins_may_match_some_stages():
    """A pin for one layer's module binds in the one stage that holds it, and is no error for
    the stage that does not (planned here as rank 0 of a 2 x 2 job on the fake process group)."""
    import partitioner
    from partitioner.api import resolve_pins
    model, inputs = _build("gpt", 4)
    pin = {"h.3": ["S(1)"]}    # the last layer's output split by sequence on its stage's 2 ranks
    with fake_job(4):
        runner = partitioner.auto_parallelize(model, inputs, mesh=(2, 2), cluster="h100", pins=pin,
                                              pipeline={"degree": 2, "schedule": "1f1b"})
    first, last = runner.stage_graphs
    with pytest.raises(ValueError, match="matches no input"):
        resolve_pins(first.captured, pin, 1)
    (node,) = resolve_pins(last.captured, pin, 1)
    assert runner.plan["stages"][1].data["pins"][node.name] == "[S(1)]"
    assert node.name not in runner.plan["stages"][0].data["pins"]


# ---------------------------------------------------------------------------------------- balance


def test_stage_balance_uniform_transformer():
    """16 identical layers on 4 stages: whole layers per stage, slowest stage <= 1.10 x the mean.

    Stage costs two ways, the embedding and head ops included (they ride with the first and last
    layer): the analysed FLOPs of each stage's ops (what the splitter balances), and the cost
    model's compute estimate (forward + backward seconds on an H100) of each split stage planned
    on one device."""
    from partitioner import models
    from partitioner.api import plan_captured
    from passes.analysis.analyze import analyze, info
    from passes.capture.blocks import find_blocks
    from passes.capture.capture import capture
    from passes.plan.split_stages import assign_stages, split_stages

    model, inputs = models.gpt_block(batch=8, seq=128, n_embd=256, n_head=4, n_layer=16, vocab=1024)
    cap = capture(model, inputs)
    analyze(cap)
    stage_of, runs = assign_stages(cap, 4)

    # whole layers: runs partition the 16 layers in order, and every op of a layer is on one stage
    assert [i for run in runs for i in run] == list(range(16)), runs
    assert all(runs), runs
    group = max(find_blocks(cap.graph).groups, key=lambda g: len(g.indices))
    assert len(group.indices) == 16
    for k, members in enumerate(group.members):
        stages = {stage_of[n] for n in members if n.op == "call_function"}
        assert len(stages) == 1, (group.indices[k], stages)
        assert stages == {next(s for s, run in enumerate(runs) if group.indices[k] in run)}
    # stages are contiguous in graph order and every op has one
    ops = [n for n in cap.graph.nodes if n.op == "call_function"]
    assert set(stage_of) == set(ops)
    order = [stage_of[n] for n in ops]
    assert order == sorted(order) and set(order) == {0, 1, 2, 3}

    cost = [0.0] * 4
    for node in ops:
        cost[stage_of[node]] += info(node).flops
    ratio = max(cost) / (sum(cost) / 4)
    assert ratio <= 1.10, (ratio, cost, runs)

    seconds = []
    for g in split_stages(cap, stage_of, runs):
        analyze(g.captured)
        plan = plan_captured(g.captured, model_name=f"stage {g.index}", mesh_shape=(1,), cluster="h100")
        seconds.append(plan.estimate().compute_s)
    ratio = max(seconds) / (sum(seconds) / 4)
    assert ratio <= 1.10, (ratio, seconds, runs)


# ------------------------------------------------------------------ zero-bubble: a real I / W split


ZB_H1 = {"degree": 2, "schedule": "zb-h1", "microbatches": 4}


def _zb_split_worker(rank, world, cfg):
    """Records every autograd.backward call of a ZB-H1 step with the action it ran in."""
    import partitioner
    from partitioner.models import gpt_demo

    model, inputs = prebuilt("pipelined") or gpt_demo(batch=BATCH, seq=SEQ, n_layer=4)  # the parent's
    ref = copy.deepcopy(model)
    runner = partitioner.auto_parallelize(model, inputs, mesh=(2,), cluster="h100", pipeline=ZB_H1)
    params = {id(p) for p in runner.parameters()}
    calls, real_backward, real_run, current = [], torch.autograd.backward, runner._run, []

    def recording_run(action, *args):
        current[:] = [action]
        return real_run(action, *args)

    def recording_backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False, inputs=None, **kw):
        kind = current[0].kind.value
        which = {"param" if id(t) in params else "data" for t in (inputs or [])}
        from_outputs = any(t.grad_fn is not None and t.grad_fn.name().startswith("NllLoss") for t in tensors)
        calls.append((kind, sorted(which), from_outputs))
        return real_backward(tensors, grad_tensors, retain_graph=retain_graph, create_graph=create_graph,
                             inputs=inputs, **kw)

    torch.autograd.backward, runner._run = recording_backward, recording_run
    try:
        loss = runner.train_step(inputs)
    finally:
        torch.autograd.backward = real_backward
    ref_loss = loss_of(call(ref, inputs))
    ref_loss.backward()
    checks = Checks(rank)
    checks.close("loss", loss.detach(), ref_loss.detach())
    grads = runner.full_grads()
    for name, p in ref.named_parameters():
        checks.close(f"grad of {name}", grads[name], p.grad)
    try:  # a pipeline is stepped, not called: the error says how
        runner(*inputs)
        checks.true("calling a PipelineRunner is refused", False)
    except TypeError as exc:
        checks.true(f"the refusal names train_step: {exc}", "train_step" in str(exc))
    from partitioner.pipeline_simulation import stage_times
    return {"rank": rank, "failures": checks.failures, "calls": calls, "stage_times": stage_times(runner)}


def test_zero_bubble_splits_input_and_weight_gradients():
    """ZB-H1 on 2 stages: on the last stage, I passes ask autograd for the received activations'
    gradients only and W passes for parameters only, starting from the weight ops' outputs (not
    the loss again), so no work is done twice; the first stage (token ids in, nothing to send
    back) has no input gradient and does its whole backward in W. Gradients stay exact. Calling
    the runner like a module is refused with a TypeError naming ``train_step``."""
    prebuild = _prebuild({"model": "gpt", "n_layer": 4, "pipeline": ZB_H1})
    results = run_checked(_zb_split_worker, {"mesh": (2,)}, TIMEOUT_S, prebuild=prebuild)
    first, last = (r["calls"] for r in sorted(results, key=lambda r: r["rank"]))
    i_calls = [c for c in last if c[0] == "I"]
    w_calls = [c for c in last if c[0] == "W"]
    assert len(i_calls) == 4 and all(which == ["data"] for _, which, _ in i_calls), last
    assert w_calls and all(which == ["param"] for _, which, _ in w_calls), last
    assert not any(from_loss for _, _, from_loss in w_calls), "a W pass backpropagated from the loss again"
    assert {c[0] for c in last} == {"I", "W"}, last
    assert [c[0] for c in first] == ["W"] * 4 and all(which == ["param"] for _, which, _ in first), first
    # the cost model prices the same split: the first stage's W is its whole backward; the last
    # stage's W is its weight products, a share of its backward near a half (GPT is matmul-bound)
    forward, backward, weight, _ = results[0]["stage_times"]
    assert weight[0] == backward[0] > forward[0] > 0, (forward, backward, weight)
    assert 0.3 * backward[1] < weight[1] < 0.7 * backward[1], (backward, weight)


# ------------------------------------------------------------------ chosen microbatches and schedule


def test_open_config_chooses_microbatches_and_schedule_and_stays_exact():
    """``pipeline={"degree": 2}`` alone: the microbatches are the most (4 per stage) that divide
    the batch, the schedule is the one simulated fastest with the stage plans' estimates (the
    same choice ``choose_schedule`` makes from them here), and the run is exact."""
    cfg = {"model": "gpt", "mesh": (2,), "pipeline": {"degree": 2}, "n_layer": 4, "pins": None}
    results = run_checked(pipeline_worker, cfg, TIMEOUT_S, prebuild=_prebuild(cfg))
    sched = results[0]["schedule"]
    assert sched["microbatches"] == 8 and sched["stages"] == 2, sched
    assert sched["name"] == results[0]["expected_schedule"], (sched, results[0]["expected_schedule"])
    # GPT's matmuls leave weight gradients to defer: zero-bubble simulates fastest
    assert sched["name"] == "zb_h1", sched


def test_open_config_choices_are_logged(caplog, capsys):
    """The microbatches and the schedule an open config gets are decisions logged at INFO on the
    ``partitioner`` logger, and ``verbose=True`` shows them on stderr (built in this process as
    rank 0 of a 2-rank job on the fake process group: no forking)."""
    import partitioner
    from passes.schedules import SCHEDULES
    model, inputs = _build("gpt", 4)
    with fake_job(2), caplog.at_level(logging.INFO, logger="partitioner"):
        runner = partitioner.auto_parallelize(model, inputs, mesh=(2,), cluster="h100", pipeline={"degree": 2},
                                              verbose=True)
    messages = [r.getMessage() for r in caplog.records if r.name == "partitioner.pipeline_parallelize"]
    assert any(re.search(r"8 microbatches \(chosen: .*batch of 8\), schedule chosen after planning", m)
               for m in messages), messages
    chosen = [re.search(r"schedule (\S+) chosen \(simulated step", m) for m in messages]
    (name,) = [m.group(1) for m in chosen if m]
    assert SCHEDULES[name].make(2, 8, 1).name == runner.schedule.name, (name, runner.schedule.name)
    err = capsys.readouterr().err
    assert f"schedule {name} chosen" in err and "[partita rank 0" in err, err


# ------------------------------------------------------------------ memory: activations kept alive


def _memory_worker(rank, world, schedule, budget):
    import partitioner
    model, inputs = prebuilt("pipelined") or _build("gpt", 4)  # the parent's, its stages captured there
    try:
        runner = partitioner.auto_parallelize(model, inputs, mesh=(2,), cluster="h100", memory_budget=budget,
                                              pipeline={"degree": 2, "schedule": schedule, "microbatches": 8})
    except Exception as exc:   # reported per rank: every rank must raise, none may wait
        return {"error": type(exc).__name__, "message": str(exc)}
    plan = runner.plan["stages"][0]
    activations = sum(r.get("memory", 0.0) for r in plan.records if r["kind"] == "op")
    return {"memory": plan.estimate().memory_bytes, "activations": activations,
            "copies": plan.data["activation_copies"], "loss": runner.train_step(inputs).item()}


def test_stage_memory_counts_the_activations_its_schedule_keeps_alive():
    """Stage 0 of 2 with 8 microbatches holds 2 microbatches' activations under 1F1B and all 8
    under GPipe; its plan counts exactly that. A per-device budget between the two lets 1F1B
    run and makes GPipe fail on every rank with the planner's budget error (no hang)."""
    # one model built and its stages captured here serves the three forked runs (the schedule is no
    # capture option: the stages are cut the same)
    cfg = {"model": "gpt", "n_layer": 4, "pipeline": {"degree": 2, "schedule": "1f1b", "microbatches": 8}}
    key, factory, options = _prebuild(cfg)
    with built_in_parent({key: (factory, options)}):
        first = run_on_ranks(_memory_worker, 2, "1f1b", None, timeout_s=120)[0]
        assert first["copies"] == 2
        one_copy = first["activations"] / 2
        fixed = first["memory"] - first["activations"]          # parameters, gradients, optimizer state
        budget = fixed + 5 * one_copy                           # room for 5 copies: 1F1B's 2, not GPipe's 8
        fits = run_on_ranks(_memory_worker, 2, "1f1b", int(budget), timeout_s=120)
        failed = run_on_ranks(_memory_worker, 2, "gpipe", int(budget), timeout_s=120)
    assert all(r["copies"] == 2 and r["memory"] <= budget and "error" not in r for r in fits), fits
    # rank 0 planned and failed; rank 1 does not wait for plans that will not come: same error
    assert [r.get("error") for r in failed] == ["InfeasibleBudgetError"] * 2, failed
    assert all(re.search(r"no plan fits .* the least memory any plan needs", r["message"]) for r in failed), failed
    assert "raised on rank 0 while planning the stages" in failed[1]["message"], failed[1]
