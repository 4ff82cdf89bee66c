"""The whole configuration for N devices (``plan(..., devices=N)``, partitioner/search/):
known answers, the chosen configuration as a value, pipelined plans as one ShardingPlan, bad
input, and ``auto_parallelize`` without ``mesh=`` on 4 gloo ranks against one process."""

import copy
import json

import pytest
from parity_utils import Checks, adam_in_lockstep, check_grads_by_alias, nested_approx_equal, run_checked

import partitioner
from partitioner import models
from partitioner.axis_uses import axis_uses, describe_config
from partitioner.parallel_config import ParallelConfig
from partitioner.search import enumerate_configs, plan_config, search_config, zero_stage_of
from passes.plan.plan_intra_op import InfeasibleBudgetError


def _state_bytes(model) -> int:
    return 16 * sum(p.numel() for p in model.parameters())  # fp32 weights, gradients, Adam moments


@pytest.mark.parametrize("devices", [4, 8])
def test_search_returns_a_plan_for_n_devices_with_its_configuration_and_runner_ups(devices, tmp_path):
    model, inputs = models.gpt_demo(batch=32, seq=32, n_layer=2)
    plan = partitioner.plan(model, inputs, devices=devices, cluster="h100")
    config = plan.config
    assert config.devices == devices and config.global_batch == 32
    size = 1
    for n in plan.mesh_shape:
        size *= n
    assert size == devices and plan.mesh_shape == config.mesh_shape and plan.axis_names == config.axis_names
    est = plan.estimate()
    assert est.step_time_s > 0 and est.memory_bytes <= 80 * 2**30
    assert est.model_flops > 0 and est.devices == devices
    assert est.tflops_per_device == pytest.approx(est.model_flops / devices / est.step_time_s / 1e12)
    assert 0 < est.mfu < 1
    assert f"configuration: {describe_config(plan)}" in plan.summary().replace("\n  ", " ")
    why = plan.explain()
    assert why.count("-> ") == 1 and "chosen" in why
    search = plan.data["search"]
    planned = [r for r in search["rows"] if r["status"] == "planned"]
    assert planned and "slower by" in why
    # every runner-up that was planned is no faster than the chosen one
    assert all(r["step_time_s"] >= est.step_time_s for r in planned)
    # the memory bounds are lower bounds of the plans (a pipeline's held gradient sums included),
    # for the candidates planned at the ZeRO stage they asked
    kept = [r for r in search["rows"] if r["memory_bytes"] is not None and "asked ZeRO" not in r["reason"]]
    assert kept and all(r["memory_lower_bound"] <= r["memory_bytes"] for r in kept), kept
    # the configuration round-trips through save / load
    loaded = partitioner.ShardingPlan.load(plan.save(tmp_path / "plan.json"))
    assert loaded.config == config
    assert loaded.estimate().step_time_s == pytest.approx(est.step_time_s)
    assert loaded.explain() == why


def test_pure_data_parallel_wins_for_a_small_model_on_a_large_batch():
    # 134k parameters (a 0.5 MB gradient: one bucketed all-reduce, ~11 us on NVLink) against
    # ~0.5 ms of compute for 16k tokens: splitting the batch 4 ways is the whole gain; a pipeline
    # adds its bubble, tensor parallelism an all-reduce of 16k-token activations per layer
    model, inputs = models.gpt_demo(batch=256, seq=64, n_layer=2)
    plan = partitioner.plan(model, inputs, devices=4, cluster="h100")
    assert (plan.config.pipeline, plan.config.data, plan.config.tensor) == (1, 4, 1)
    assert plan.mesh_shape == (4,) and plan.axis_names == ("dp",)
    assert plan.placement_of("idx") == "[S(0)]"
    assert all(plan.placement_of(name) == "[R]" for name, _ in model.named_parameters())


def test_the_configuration_is_named_by_what_each_axis_does_in_the_plan():
    # a 2-sample MLP on 4 devices: every split costs more in collectives than it saves, so the
    # solver replicates everything on the (dp, tp) mesh the search gave it; the label must not
    # say "data 2 x tensor 2" for a plan whose four devices repeat the same work
    model, inputs = models.mlp_demo(batch=2)
    plan = partitioner.plan(model, inputs, devices=4, cluster="h100")
    assert plan.axis_names == ("dp", "tp")
    assert all(set(r["out"]) <= {"[R, R]"} for r in plan.records), "the solver split something"
    assert axis_uses(plan) == ("replicated", "replicated")
    text = plan.summary().replace("\n  ", " ")
    assert "configuration: pipeline 1 x replicated 2 (dp) x replicated 2 (tp) = 4 devices" in text
    assert "nothing is split on dp, tp: their devices repeat the same work" in text
    # a plan that splits the batch on dp and the weights on tp keeps the plain label
    model, inputs = models.gpt_demo(batch=8, seq=16, n_layer=1, n_embd=256)
    plan = plan_config(model, inputs, ParallelConfig(data=2, tensor=2), cluster="h100", tensor_parallel="1d")
    assert axis_uses(plan) == ("data", "tensor")
    assert describe_config(plan) == plan.config.describe()
    assert plan.config.describe().startswith("pipeline 1 x data 2 x tensor 2 = 4 devices")


@pytest.mark.slow  # every configuration of 4 devices planned under a budget (the ILPs of the search)
def test_a_budget_under_half_the_state_forces_the_weights_apart():
    # no device can hold the replicated parameter state: every device's share of it must be
    # cut, by pipeline stages or by sharded weights, and the plan's peak must fit
    model, inputs = models.gpt_demo(batch=8, seq=16, n_layer=2, n_embd=128, vocab_size=512)
    state = _state_bytes(model)
    budget = int(0.5 * state)
    plan = partitioner.plan(model, inputs, devices=4, cluster="h100", memory_budget=budget)
    est = plan.estimate()
    assert est.memory_bytes <= budget
    held = est.memory.parameters + est.memory.gradients + est.memory.optimizer_state
    assert held < state / 2
    if plan.config.pipeline == 1:  # then the solver sharded the weights themselves
        assert any("S(" in plan.placement_of(name) for name, _ in model.named_parameters())


def test_a_budget_under_the_replicated_state_makes_the_search_choose_zero_2():
    # on 2 data-parallel ranks the replicated state (16 B per parameter) is over a budget of 0.95
    # of it, and ZeRO-1 saves nothing there (a whole compute copy and its gradient, 8 B, beside
    # 16 B / 2 of shards): only storing weights sharded (ZeRO-2, 4 + 16 / 2 B; ZeRO-3 only adds
    # a regather) fits; without pipelines the one set of degrees is (1, 2, 1)
    model, inputs = models.gpt_demo(batch=8, seq=16, n_layer=2, n_embd=128, vocab_size=512)
    state = _state_bytes(model)
    budget = int(0.95 * state)
    plan = search_config(model, inputs, devices=2, cluster="h100", memory_budget=budget, pipelines=False)
    assert (plan.config.data, plan.config.zero) == (2, 2)
    assert zero_stage_of(plan) == 2 and "ZeRO-2" in plan.summary()
    est = plan.estimate()
    assert est.memory_bytes <= budget
    assert est.memory.parameters + est.memory.gradients + est.memory.optimizer_state < state
    stored = {r["out"][0] for r in plan.records if r["kind"] == "param"}
    assert "[S(0)]" in stored and all(r.get("zero") != 3 for r in plan.records)
    rows = {r["config"]["zero"]: r for r in plan.data["search"]["rows"]}
    for stage in (0, 1):  # their bounds keep 16 B per parameter whole
        assert rows[stage]["status"] == "over budget" and rows[stage]["memory_lower_bound"] > budget
    assert "ZeRO-0" in plan.explain() and "ZeRO-1" in plan.explain()


def test_a_pipelined_plan_is_one_sharding_plan_with_bubble_and_send_recv(tmp_path):
    model, inputs = models.gpt_demo(batch=8, seq=16, n_layer=4)
    config = ParallelConfig(pipeline=2, data=2, microbatches=4, schedule="1f1b")
    plan = plan_config(model, inputs, config, cluster="h100")
    assert plan.config == ParallelConfig(2, 2, 1, 4, "1f1b", 1, "none", 8, zero="auto")
    assert plan.mesh_shape == (2, 2) and plan.axis_names == ("pp", "dp")
    stages = plan.stage_plans
    assert len(stages) == 2 and all(s.mesh_shape == (2,) for s in stages)
    est = plan.estimate()
    per_micro = [s.estimate().step_time_s for s in stages]
    # the 1F1B step covers 4 microbatches of the slowest stage, and its bubble is idle time
    assert est.step_time_s >= 4 * max(per_micro)
    assert est.bubble_s > 0 and est.step_time_s >= est.compute_s
    # point-to-point: each microbatch sends a (4, 16, 64) fp32 activation cut on dp, and its gradient back
    assert est.comm_bytes["send_recv"]["pp"] == pytest.approx(4 * 2 * (4 * 16 * 64 * 4) / 2)
    assert est.model_flops == pytest.approx(4 * sum(s.data["model_flops"] for s in stages))
    text = plan.summary()
    assert "schedule 1f1b: 4 microbatches" in text
    # 2-sample microbatches on H100s: the stage plans keep them whole on dp (the sends above)
    assert "configuration: pipeline 2 x replicated 2 (dp) = 4 devices" in text
    loaded = partitioner.ShardingPlan.load(plan.save(tmp_path / "pipe.json"))
    assert loaded.config == plan.config
    assert loaded.estimate().step_time_s == pytest.approx(est.step_time_s)
    assert loaded.estimate().comm_bytes == est.comm_bytes
    assert "stage 0" in loaded.explain("h.0.attn.c_attn")


def test_bad_input_is_refused_with_what_to_do():
    model, inputs = models.gpt_demo(batch=8, seq=16, n_layer=2)
    for bad in (0, -2, 2.5, True, "4"):
        with pytest.raises(ValueError, match="devices must be a positive int"):
            partitioner.plan(model, inputs, devices=bad, cluster="h100")
    with pytest.raises(ValueError, match=r"devices=4 and mesh=\(2,\) \(2 devices\) disagree"):
        partitioner.plan(model, inputs, devices=4, mesh_shape=(2,), cluster="h100")
    with pytest.raises(ValueError, match="give devices=N with it"):
        partitioner.plan(model, inputs, global_batch=8, cluster="h100")
    with pytest.raises(InfeasibleBudgetError, match="the least memory any needs is at least") as err:
        partitioner.plan(model, inputs, devices=2, cluster="h100", memory_budget="64KiB")
    assert "needs at least" in str(err.value) and "devices of this budget" in str(err.value)
    # a mesh that agrees with devices is planned as given
    plan = partitioner.plan(model, inputs, devices=2, mesh_shape=(2,), cluster="h100")
    assert plan.mesh_shape == (2,) and plan.config is None
    assert "not chosen by a configuration search" in plan.explain()


# ---------------------------------------------------------------------- tier 3: gloo parity


def _searched_parity_worker(rank, world, cfg):
    from runtime.collectives import CommCounter

    checks = Checks(rank)
    model, inputs = models.gpt_demo(batch=cfg["batch"], seq=cfg["seq"], n_layer=2)
    ref = copy.deepcopy(model)
    pm = partitioner.auto_parallelize(model, inputs, cluster="h100")  # no mesh=: searched
    result = {"rank": rank, "failures": checks.failures, "config": pm.plan.config.to_dict()}
    with CommCounter() as counter:
        loss = pm(*inputs)
        loss.backward()
    ref_loss = ref(*inputs)
    ref_loss.backward()
    checks.close("loss", loss.detach(), ref_loss.detach())
    check_grads_by_alias(pm.full_grads(), ref, checks)
    checks.true(
        f"counted communication differs from the estimate: "
        f"{nested_approx_equal(counter.as_dict(), pm.plan.estimate().comm_bytes)}",
        not nested_approx_equal(counter.as_dict(), pm.plan.estimate().comm_bytes),
    )

    def step():
        out = pm(*inputs)
        out.backward()
        return out

    adam_in_lockstep(list(pm.parameters()), ref, inputs, 3, step, checks)
    full = pm.full_state_dict()
    for name, p in ref.named_parameters():
        checks.close(f"parameter {name} after 3 AdamW steps", full[name], p.detach())
    return result


def test_auto_parallelize_without_mesh_trains_the_searched_configuration_like_one_device():
    cfg = {"mesh": (4,), "batch": 256, "seq": 64}
    model, inputs = models.gpt_demo(batch=cfg["batch"], seq=cfg["seq"], n_layer=2)
    expected = partitioner.plan(model, inputs, devices=4, cluster="h100").config
    results = run_checked(_searched_parity_worker, cfg, timeout_s=240)
    assert all(ParallelConfig.from_dict(r["config"]) == expected for r in results)
    assert json.dumps(results[0]["config"]) == json.dumps(expected.to_dict())


def test_a_long_sequence_on_one_sample_is_split_over_a_sequence_axis_and_trains_like_one_device():
    # batch 1 cannot be split over 4 data-parallel ranks, nor into microbatches for a pipeline:
    # without a sequence degree no configuration of 4 devices exists; with it, the search splits
    # the 512 tokens 2 ways with ring attention on ``sp`` and the heads 2 ways on ``tp`` (context
    # parallelism beside tensor parallelism), faster than the 4-way split alone
    assert enumerate_configs(4, 1, 2, 8, seq_len=0) == []
    cfg = {"mesh": (4,), "batch": 1, "seq": 512}
    model, inputs = models.gpt_demo(batch=1, seq=512, n_layer=2)
    budget = 8 * 2**20
    plan = partitioner.plan(model, inputs, devices=4, cluster="h100", memory_budget=budget)
    config = plan.config
    assert (config.sequence, config.data, config.tensor, config.pipeline) == (2, 1, 2, 1)
    assert plan.mesh_shape == (2, 2) and plan.axis_names == ("sp", "tp")
    assert config.sequence_parallel == "ring" and plan.data["sequence_parallel"] == "ring"
    attention = [r for r in plan.records if "scaled_dot_product_attention" in r["name"]]
    assert attention and all(r["notes"] == {"sp": "ring"} and r["out"][0] == "[S(2), S(1)]" for r in attention)
    assert "ring@sp" in plan.summary()
    assert plan.estimate().memory_bytes <= budget
    assert "sequence 4 (ulysses)" in plan.explain() and "sequence 4 (ring)" in plan.explain()
    results = run_checked(_searched_parity_worker, cfg, timeout_s=240)
    assert all(ParallelConfig.from_dict(r["config"]) == config for r in results)


# ------------------------------------------------------------------ simulation of every rank


def _swap_two_collectives(program):
    """``program`` with the modules of its first two Reshards that send different collectives
    exchanged: the rank then runs them in the other order (a deliberately broken program)."""
    from partitioner.simulate_ranks import _moves
    from runtime.reshard import Reshard

    found = []
    for node in program.graph.nodes:
        module = program.get_submodule(node.target) if node.op == "call_module" else None
        if isinstance(module, Reshard):
            kinds = _moves(module.forward_steps, module.comm.shape) + _moves(module.backward_steps, module.comm.shape)
            if kinds and (not found or kinds != found[0][1]):
                found.append((node.target, kinds, module))
        if len(found) == 2:
            break
    (a, _, ma), (b, _, mb) = found
    setattr(program, a, mb)
    setattr(program, b, ma)
    return program, a, b


def test_every_rank_is_lowered_and_checked_and_a_rank_with_another_order_is_named():
    from partitioner.simulate_ranks import check_events, plan_graphs, rank_events, simulate_ranks
    from passes.lower.lower_to_local import lower_to_local
    from runtime.collectives import MeshComm

    model, inputs = models.gpt_demo(batch=64, seq=64, n_layer=4, n_embd=128)
    # ZeRO-0: the stages' weights replicated on dp, their gradient all-reduces on the program's edges
    config = ParallelConfig(pipeline=2, data=4, tensor=2, microbatches=2, schedule="1f1b", zero=0)
    plan = plan_config(model, inputs, config, cluster="h100")
    graphs = plan_graphs(plan, model, inputs)
    every, shape, _ = rank_events(plan, graphs)  # each of the 16 ranks lowered
    assert shape == (2, 4, 2) and len(every) == 16
    assert check_events(every, shape) == []
    # each rank sends and receives an activation and a gradient per microbatch (2), collectives too
    assert sum(e.kind in ("send", "recv") for events in every for e in events) == 16 * 2 * 2
    assert sum(e.kind not in ("send", "recv") for events in every for e in events) > 0
    # lowering one rank per stage gives every rank the same events as lowering each of them
    assert rank_events(plan, graphs, every_rank=False)[0] == every

    broken_names = {}

    def lower(stage, sub_rank):
        k = plan.data["pipeline"]["stage_map"][stage]
        stage_plan = plan.stage_plans[stage]
        comm = MeshComm.for_codegen(stage_plan.mesh_shape, stage_plan.axis_names, sub_rank)
        program = lower_to_local(graphs[k].graph, {r["name"]: r for r in stage_plan.records}, comm)
        if stage == 0 and sub_rank == 5:  # global rank 5: pipeline stage 0, stage-mesh rank 5
            program, a, b = _swap_two_collectives(program)
            broken_names.update(a=a, b=b)
        return program

    broken = simulate_ranks(plan, graphs, lower=lower)
    assert not broken.ok
    text = "\n".join(broken.problems)
    assert "rank 5 (coordinates [0, 2, 1])" in text
    assert broken_names["a"] in text or broken_names["b"] in text
