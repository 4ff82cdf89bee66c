"""auto_parallelize / dump / state on real gloo ranks: bad input, replay, state, pictures."""
import json
import math
import re
import shutil
import warnings

import pytest
import torch

import partitioner
from partitioner import models
from runtime.launch import RankFailure, run_on_ranks

MEGATRON = {"idx": ["R"], "targets": ["R"], "h.*.attn.c_attn.weight": ["S(0)"], "h.*.mlp.c_fc.weight": ["S(0)"],
            "h.*.attn.c_proj.weight": ["S(1)"], "h.*.mlp.c_proj.weight": ["S(1)"]}


# Configuration errors are raised before any collective: one process on the fake backend sees them.


def test_a_world_size_the_mesh_does_not_divide_is_refused(fake_process_group):
    fake_process_group(3)
    model, inputs = models.gpt_demo(batch=4, seq=8, n_layer=1)
    with pytest.raises(ValueError, match=r"mesh \(2, 2\) needs 4 ranks but this job has 3"):
        partitioner.auto_parallelize(model, inputs, mesh=(2, 2))


def test_replaying_a_saved_plan_and_refusing_one_for_another_model(fake_process_group):
    fake_process_group(2)
    model, inputs = models.gpt_demo(batch=4, seq=8, n_layer=1)
    plan = partitioner.plan(model, inputs, mesh_shape=(2,), mesh_axis_names=("a0",), pins=MEGATRON)
    saved = partitioner.ShardingPlan.from_json(plan.to_json())
    pm = partitioner.auto_parallelize(model, inputs, mesh=(2,), plan=saved)
    assert pm.placement_of("h.0.mlp.c_fc.weight") == "[S(0)]"
    other, other_inputs = models.gpt_demo(batch=4, seq=8, n_layer=2)
    with pytest.raises(partitioner.PlanMismatchError, match="different graph"):
        partitioner.auto_parallelize(other, other_inputs, mesh=(2,), plan=saved)


def _impossible_budget(rank, world):
    model, inputs = models.gpt_demo(batch=4, seq=8, n_layer=1)
    try:
        partitioner.auto_parallelize(model, inputs, mesh=(2,), cluster="h100", memory_budget="1KiB")
    except Exception as exc:   # every rank reports: rank 0 planned, rank 1 must not wait for it
        return type(exc).__name__, str(exc)
    return None


def test_a_planning_error_on_rank_0_is_raised_on_every_rank():
    results = run_on_ranks(_impossible_budget, 2, timeout_s=60)
    assert [name for name, _ in results] == ["InfeasibleBudgetError"] * 2, results
    assert "no plan fits" in results[0][1] and "raised on rank 0 while planning" in results[1][1], results


class _Branchy(torch.nn.Module):
    def forward(self, x):
        return x * 2 if x.sum() > 0 else x


def test_a_model_that_fails_to_export_names_the_construct(fake_process_group):
    fake_process_group(2)
    with pytest.raises(partitioner.CaptureError, match="could not capture _Branchy.*What to do"):
        partitioner.auto_parallelize(_Branchy(), (torch.randn(4),), mesh=(2,))


class _Cumprod(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.cumprod(self.lin(x), dim=1).sum()


def _unknown_op(rank, world):
    torch.manual_seed(0)
    model = _Cumprod()
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = partitioner.auto_parallelize(model, (x,), mesh=(2,), pins={"x": ["S(0)"]})
    loss = pm(x)
    loss.backward()
    ref = model(x)
    ref.backward()
    grads = pm.full_grads()
    return ([str(w.message) for w in caught], loss.item(), ref.item(),
            max((grads[n] - p.grad).abs().max().item() for n, p in model.named_parameters()))


def test_an_op_without_a_rule_warns_and_stays_correct():
    messages, loss, ref, grad_diff = run_on_ranks(_unknown_op, 2, timeout_s=60)[0]
    assert any("no sharding rule for op aten.cumprod" in m for m in messages), messages
    assert loss == pytest.approx(ref, rel=1e-6)
    assert grad_diff < 1e-5


def _state_round_trip(rank, world, path):
    model, inputs = models.gpt_demo(batch=4, seq=8, n_layer=1)
    pm = partitioner.auto_parallelize(model, inputs, mesh=(2,), pins=MEGATRON)
    full = pm.full_state_dict()
    same = all(torch.equal(full[k], v) for k, v in model.state_dict().items() if k in full)
    torch.manual_seed(1)
    other, _ = models.gpt_demo(batch=4, seq=8, n_layer=1)
    for p in other.parameters():
        torch.nn.init.normal_(p)
    pm.load_full_state_dict(other.state_dict())
    loaded = pm.full_state_dict()
    matches_other = all(torch.equal(loaded[k], v) for k, v in other.state_dict().items() if k in loaded)
    if rank == 0:
        torch.save(model.state_dict(), path)
    torch.distributed.barrier()
    with torch.device("meta"):
        meta_model, _ = models.gpt_demo(batch=4, seq=8, n_layer=1)
    meta_model = meta_model.to("meta")
    from_ckpt = partitioner.auto_parallelize(meta_model, inputs, mesh=(2,), pins=MEGATRON, checkpoint=path)
    loss_a, loss_b = pm(*inputs), from_ckpt(*inputs)
    pm.load_full_state_dict(model.state_dict())
    return same, matches_other, float(pm(*inputs)), float(model(*inputs)), float(from_ckpt(*inputs)), \
        from_ckpt.local_parameter_bytes(), sum(p.numel() * 4 for p in model.parameters()), float(loss_a), float(loss_b)


def test_full_state_dict_load_and_meta_model_from_checkpoint(tmp_path):
    results = run_on_ranks(_state_round_trip, 2, str(tmp_path / "full.pt"), timeout_s=90)
    same, matches_other, reloaded, ref, from_ckpt, local_bytes, total_bytes, _, _ = results[0]
    assert same and matches_other
    assert reloaded == pytest.approx(ref, rel=1e-6) and from_ckpt == pytest.approx(ref, rel=1e-6)
    assert local_bytes < total_bytes                    # the meta model's weights arrived as shards


def _dump_job(rank, world, out):
    # Fixed cluster, weights large against the activations: the planned Megatron all-reduce beats all-gathering them.
    model, inputs = models.gpt_demo(batch=4, seq=8, n_layer=1, n_embd=512)
    pm = partitioner.auto_parallelize(model, inputs, mesh=(2,), cluster="h100", pins=MEGATRON)
    return [str(p) for p in partitioner.dump(pm, out)]


def test_dump_writes_programs_plan_and_picture(tmp_path):
    files = run_on_ranks(_dump_job, 2, str(tmp_path), timeout_s=60)
    assert (tmp_path / "rank_0.py").exists() and (tmp_path / "rank_1.py").exists()
    code = (tmp_path / "rank_1.py").read_text()
    assert "mesh coordinates (1,)" in code and "def forward" in code and "Reshard(" in code
    assert "[R] -> [P]" in code or "[P] -> [R]" in code            # the Megatron all-reduce is visible
    plan = partitioner.ShardingPlan.load(tmp_path / "plan.json")
    assert "Sharding plan for GPT" in (tmp_path / "plan.txt").read_text()
    dot = (tmp_path / "graph.dot").read_text()
    assert "color=red" in dot and "AR@a0" in dot
    if shutil.which("dot"):
        assert (tmp_path / "graph.svg").read_text().lstrip().startswith("<?xml")
    assert plan.mesh_shape == (2,)
    assert all("rank_" in f or "plan" in f or "graph" in f or "report" in f for f in files[0])


def test_dump_from_a_plan_alone_for_a_large_mesh(tmp_path):
    model, inputs = models.gpt_block(batch=64, seq=128, n_embd=512, n_head=16, n_layer=2, vocab=512)
    plan = partitioner.plan(model, inputs, mesh_shape=(16, 16), cluster="h100")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        files = partitioner.dump(plan, tmp_path, model=model, example_inputs=inputs)
    names = {f.name for f in files}
    assert {"plan.json", "plan.txt", "graph.dot", "rank_0.py", "rank_255.py"} <= names
    assert "mesh coordinates (15, 15)" in (tmp_path / "rank_255.py").read_text()
    with pytest.raises(ValueError, match="rank 256 is not on mesh"):
        partitioner.dump(plan, tmp_path, model=model, example_inputs=inputs, ranks=[256])


def test_a_searched_pipeline_saves_loads_and_dumps_each_stage_for_its_ranks(tmp_path, fake_process_group):
    """A pipelined plan (the search's choice) round-trips through save / load as a ShardingPlan
    does, and dump lowers each stage's plan, on the model cut as the search cut it, for every rank
    that runs the stage: ``stage_<s>/rank_<r>.py`` (global ranks, the pipeline coordinate first).
    ``auto_parallelize`` does not replay it: refused, saying how to build it."""
    import passes.schedules as ps
    from partitioner.demo_clusters import meta_gpt
    from tests.report_plans import SEARCHED_GPT, searched_pipeline

    searched = searched_pipeline()
    plan = partitioner.ShardingPlan.load(searched.save(tmp_path / "pipe.json"))
    assert plan.to_dict() == searched.to_dict() and plan.estimate() == searched.estimate()
    model, inputs = meta_gpt(*SEARCHED_GPT)
    files = partitioner.dump(plan, tmp_path / "dump", model=model, example_inputs=inputs)
    pipe = plan.data["pipeline"]
    schedule = ps.SCHEDULES[pipe["schedule"]].make(pipe["degree"], pipe["microbatches"], pipe["virtual_stages"])
    sub = math.prod(plan.mesh_shape) // pipe["degree"]  # ranks per stage: the mesh is pp x the stage mesh
    stages = range(len(pipe["stage_map"]))
    want = {f"stage_{s}/rank_{schedule.stage_to_rank[s] * sub + r}.py" for s in stages for r in range(sub)}
    assert {str(f.relative_to(tmp_path / "dump")) for f in files if f.suffix == ".py"} == want
    stage_mesh = plan.stage_plans[0].mesh_shape
    last = (tmp_path / "dump" / f"stage_1/rank_{schedule.stage_to_rank[1] * sub + 1}.py").read_text()
    assert f"on mesh {stage_mesh}" in last and "def forward" in last
    fake_process_group(math.prod(plan.mesh_shape))
    with pytest.raises(ValueError, match=r"plan= is a pipelined plan .*does not replay: leave plan= out .*pipeline="):
        partitioner.auto_parallelize(model, inputs, plan=plan)


def _pipeline_dump_job(rank, world, out):
    model, inputs = models.gpt_demo(batch=8, seq=16, n_layer=4)
    # no cluster=: on CPUs the stages are priced with the measured "cpu" cluster
    runner = partitioner.auto_parallelize(model, inputs, mesh=(2,),
                                          pipeline={"degree": 2, "schedule": "1f1b", "microbatches": 4})
    runner.train_step(inputs)
    files = partitioner.dump(runner, out)
    return [str(f) for f in files], [plan.data["cluster"]["name"] for plan in runner.plan["stages"]]


def test_dump_of_a_pipeline_puts_simulated_and_measured_side_by_side(tmp_path):
    (files, clusters), _ = run_on_ranks(_pipeline_dump_job, 2, str(tmp_path), timeout_s=120)
    assert clusters == ["cpu", "cpu"]
    assert str(tmp_path / "timeline.txt") in files
    text = (tmp_path / "timeline.txt").read_text()
    assert "cluster cpu (the cluster the stage plans were priced with); job device: cpu" in text
    assert "note:" not in text                      # priced for the device it ran on
    lines = text.splitlines()
    header = next(line for line in lines if line.split()[:2] == ["stage", "action"])
    assert header.split()[2:] == ["simulated", "measured", "measured/simulated"]
    body = [line.split() for line in lines[lines.index(header) + 1:] if line.strip()]
    per_action = {(cells[0], cells[1]): cells[2:] for cells in body if cells[0].isdigit()}
    assert set(per_action) == {("0", "F"), ("0", "B"), ("1", "F"), ("1", "B")}
    step = next(cells[1:] for cells in body if cells[0] == "step")
    for values in [*per_action.values(), step]:        # simulated, measured, their ratio: no values asserted
        assert values[1] == "ms" and values[3] == "ms" and values[4].endswith("x"), values
    assert "cluster cpu" in (tmp_path / "timeline.svg").read_text()
    # the whole pipeline's report: the simulated step beside the measured one read from timeline.json
    from partitioner.report.timeline import read_trace
    report = (tmp_path / "report.html").read_text()
    data = json.loads(re.search(r'id="plan-data">(.*?)</script>', report, re.S).group(1).replace("<\\/", "</"))
    measured = read_trace(tmp_path / "timeline.json")
    assert {int(r): [a for a, _, _ in rows] for r, rows in data["timeline"]["measured"].items()} == {
        r: [a for a, _, _ in rows] for r, rows in measured.items()}
    assert data["timeline"]["simulated"] and data["axes"][0]["role"] == "pipeline"
    assert {row["stage"] for row in data["rows"]} == {0, 1}


def test_comparison_says_when_plans_were_priced_for_another_device():
    from runtime.pipeline_trace import comparison_text
    simulated = {0: [("0F0", 0.0, 1.0), ("0B0", 2.0, 4.0)], 1: [("1F0", 1.0, 2.0), ("1B0", 2.0, 3.0)]}
    measured = {0: [("0F0", 0.0, 3.0), ("0B0", 6.0, 12.0)], 1: [("1F0", 3.0, 6.0), ("1B0", 6.0, 9.0)]}
    text = comparison_text(measured, simulated, cluster="h100", device="cpu", schedule="1f1b")
    assert "note: the stage plans were priced for h100, not for this job's cpu" in text
    lines = text.splitlines()
    assert any(line.split() == ["0", "F", "1000.000", "ms", "3000.000", "ms", "3.00x"] for line in lines)
    assert any(line.split() == ["step", "4000.000", "ms", "12000.000", "ms", "3.00x"] for line in lines)
    assert "note:" not in comparison_text(measured, simulated, cluster="cpu", device="cpu")


def _sharded_checkpoint(rank, world, path):
    model, inputs = models.gpt_demo(batch=4, seq=8, n_layer=1)
    tp = partitioner.auto_parallelize(model, inputs, mesh=(2,), pins=MEGATRON)
    with torch.no_grad():                               # make the saved state differ from the init
        for p in tp.parameters():
            p.add_(0.5)
    tp.save_sharded(path)
    expected = tp.full_state_dict()
    fresh, _ = models.gpt_demo(batch=4, seq=8, n_layer=1)
    dp = partitioner.auto_parallelize(fresh, inputs, mesh=(2,), cluster="h100",
                                      pins={"idx": ["S(0)"], "targets": ["S(0)"]})
    dp.load_sharded(path)                               # another plan: replicated weights
    loaded = dp.full_state_dict()
    return all(torch.equal(loaded[k], expected[k]) for k in expected), dp.placement_of("h.0.mlp.c_fc.weight")


def test_sharded_checkpoint_reloads_under_another_plan(tmp_path):
    results = run_on_ranks(_sharded_checkpoint, 2, str(tmp_path / "ckpt"), timeout_s=90)
    assert results == [(True, "[R]"), (True, "[R]")]


def _rank0_stalls(rank, world):
    import time
    model, inputs = models.gpt_demo(batch=4, seq=8, n_layer=1)
    pm = partitioner.auto_parallelize(model, inputs, mesh=(2,), pins=MEGATRON)
    if rank == 0:
        time.sleep(45)                                  # never joins the step's collectives
        return "stalled"
    started = time.perf_counter()
    try:
        pm(*inputs).backward()
    except RuntimeError as exc:
        raise RuntimeError(f"rank {rank} gave up after {time.perf_counter() - started:.1f} s: {exc}") from None
    return "finished"


def test_a_stalled_rank_makes_the_others_fail_within_the_job_timeout():
    import re
    with pytest.raises(RankFailure, match=r"rank 1 gave up after [0-9.]+ s") as failure:
        run_on_ranks(_rank0_stalls, 2, timeout_s=120, collective_timeout_s=10)
    # rank 1's own wait in its step (its planning not counted): it gave up while rank 0 still slept
    # (45 s), so the mesh groups use the job's 10 s, not torch's 30 min, and not the peer's exit.
    # (10 s, not less: planning's own collectives must outlast the ranks' skew on a loaded host.)
    waited = float(re.search(r"rank 1 gave up after ([0-9.]+) s", str(failure.value)).group(1))
    assert waited < 40


def _bucketed_dp(rank, world):
    from runtime.collectives import CommCounter
    torch.manual_seed(0)
    model, inputs = models.gpt_demo(batch=8, seq=16, n_layer=2)
    reference = __import__("copy").deepcopy(model)
    pm = partitioner.auto_parallelize(model, inputs, mesh=(2,), cluster="h100",
                                      pins={"idx": ["S(0)"], "targets": ["S(0)"],
                                            "h.*.ln_1": ["S(0)"], "h.*.ln_2": ["S(0)"]})
    bucketed = sum("bucketed" in repr(m) for m in pm.program.modules())
    with CommCounter() as counter:
        loss = pm(*inputs)
        loss.backward()
    reference(*inputs).backward()
    grads = pm.full_grads()
    worst = max((grads[n] - p.grad).abs().max().item() for n, p in reference.named_parameters())
    n_params = sum(1 for _ in pm.parameters())
    return bucketed, n_params, counter.calls, counter.as_dict(), pm.plan.estimate().comm_bytes, worst


def test_data_parallel_gradients_are_bucketed_and_overlapped():
    bucketed, n_params, calls, counted, planned, worst = run_on_ranks(_bucketed_dp, 2, timeout_s=90)[0]
    assert bucketed >= n_params - 2                        # (nearly) every weight's sync joins a bucket
    assert calls < n_params                                # fewer, larger all-reduces than parameters
    assert counted.keys() == planned.keys()
    for kind in planned:                                   # the same bytes the plan priced
        assert counted[kind] == pytest.approx(planned[kind])
    assert worst < 1e-5


def _gathered_outputs(rank, world):
    from parity_utils import pins_for

    model, inputs = models.hf_gpt2(batch=4, seq=16)
    ref = __import__("copy").deepcopy(model)
    pm = partitioner.auto_parallelize(model, inputs, mesh=(2,), cluster="h100", pins=pins_for("gpt2", "tp", (2,)))
    out = pm(**inputs)
    whole = pm.gather_outputs(out)
    try:
        pm(input_ids=inputs["input_ids"])
        message = None
    except TypeError as e:
        message = str(e)
    try:  # a batch made under `with torch.device("meta")` is named before any collective
        pm(**{k: v.to("meta") for k, v in inputs.items()})
        meta_message = None
    except ValueError as e:
        meta_message = str(e)
    return (tuple(out.logits.shape), whole.logits, ref(**inputs).logits.detach(), whole.loss.item(), message,
            meta_message)


def test_outputs_gather_whole_and_wrong_keywords_are_named():
    for local_shape, logits, ref_logits, loss, message, meta_message in run_on_ranks(
        _gathered_outputs, 2, timeout_s=90
    ):
        assert local_shape == (4, 16, 64), local_shape       # vocabulary-parallel head: each rank half the vocab
        torch.testing.assert_close(logits, ref_logits)
        assert loss > 0
        assert message is not None and "missing ['labels']" in message, message
        assert meta_message is not None and "input ['input_ids'] is a tensor on the meta device" in meta_message, (
            meta_message
        )
