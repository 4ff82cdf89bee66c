"""Ranks that outnumber a host's cores: the simulator with a core count, and the shared cluster.

Fixed cluster descriptions and hand-computed schedules only: no timing, no measured calibration.
"""

import dataclasses
import itertools
from types import SimpleNamespace

import pytest
import torch

from partitioner.calibration.fit import message_cpu, time_slice_slowdown
from partitioner.cluster import PRESETS, ClusterSpec, LinkSpec
from partitioner.core_sharing import core_share, message_cpu_time, pipeline_cores, shared_cluster
from partitioner.pipeline_simulation import largest_message, message_prices
from passes.plan.cost_model import compute_time, optimizer_step_time
from passes.schedules import SCHEDULES, add_communication, gpipe, simulate, zb_h1
from passes.schedules.shared_cores import SharedCores

# a 2-core host measured with 4 ranks (a rank's figures: a core to itself)
HOST = ClusterSpec(
    name="two-core host",
    peak_flops={"float32": 40e9},
    memory_bandwidth=10e9,
    memory_bytes=1 << 30,
    devices_per_node=4,
    intra_node=LinkSpec(bandwidth=1e9, latency_s=1e-5),
    inter_node=LinkSpec(bandwidth=1e9, latency_s=1e-5),
    op_overhead_s=5e-6,
    matmul_efficiency=1.0,
    op_rates={"float32": {"aten.gelu": 2e9, "attn": {"axes": [[64, 128], [32]], "rates": [[1e9], [3e9]]}}},
    optimizer_steps={"adam": {"tensor_s": 1e-5, "bandwidth": 4e9}},
    cores_per_node=2,
)


def test_two_ranks_on_one_core_share_it():
    # GPipe, 2 ranks, 2 microbatches, F = 1 s, B = 2 s, one core shared by the busy ranks. By hand:
    # r0 F0 0-1 alone; r0 F1 and r1 F0 both busy from 1, each at half a core: 1-3; r1 F1 3-4,
    # r1 B0 4-6 alone; r1 B1 and r0 B0 from 6 at half a core: 6-10; r0 B1 10-12. Every second of
    # the 12 s of work, one core.
    result = simulate(gpipe(2, 2), 1.0, 2.0, cores=1)
    assert result.makespan == pytest.approx(12.0)
    spans = {r: [(str(t.action), t.start, t.end) for t in ts] for r, ts in result.timelines.items()}
    assert spans[0] == [("0F0", 0, 1), ("0F1", 1, 3), ("0B0", 6, 10), ("0B1", 10, 12)]
    assert spans[1] == [("1F0", 1, 3), ("1F1", 3, 4), ("1B0", 4, 6), ("1B1", 6, 10)]
    assert simulate(gpipe(2, 2), 1.0, 2.0).makespan == pytest.approx(9.0)  # a core each: (p-1+m)(F+B)


def test_time_sliced_work_takes_the_slowdown_only_while_ranks_outnumber_the_cores():
    # as above, the work done while both ranks are busy (F 1+1 s, B 2+2 s) taking 1.5x its CPU
    # time: r0 F1 and r1 F0 run 1-4 at a third of a core, r1 F1 4-5 and r1 B0 5-7 alone, the two
    # backwards 7-13 at a third, r0 B1 13-15: 12 s of work + 3 s of slowdown
    result = simulate(gpipe(2, 2), 1.0, 2.0, cores=SharedCores(1, 1.5))
    assert result.makespan == pytest.approx(15.0)
    spans = {r: [(str(t.action), t.start, t.end) for t in ts] for r, ts in result.timelines.items()}
    assert spans[0] == [("0F0", 0, 1), ("0F1", 1, 4), ("0B0", 7, 13), ("0B1", 13, 15)]
    assert spans[1] == [("1F0", 1, 4), ("1F1", 4, 5), ("1B0", 5, 7), ("1B1", 7, 13)]
    # a core each: no rank ever shares one, so no slowdown
    assert simulate(gpipe(2, 2), 1.0, 2.0, cores=SharedCores(2, 1.5)).makespan == pytest.approx(9.0)
    with pytest.raises(ValueError, match="slowdown of time-sliced cores must be >= 1"):
        SharedCores(2, 0.9)


def test_sends_and_receives_are_priced_on_their_ranks():
    # GPipe, 2 ranks, 2 microbatches, F = 1 s, B = 2 s, every send and receive 0.25 s of its rank's
    # time (the compute-only schedule is lowered with its sends). By hand: r0 F0 0-1, SEND 1-1.25,
    # F1 1.25-2.25, SEND 2.25-2.5; r1 RECV 1.25-1.5, F0 1.5-2.5, RECV 2.5-2.75, F1 2.75-3.75,
    # B0 3.75-5.75, SEND 5.75-6, B1 6-8, SEND 8-8.25; r0 RECV 6-6.25, B0 6.25-8.25, RECV 8.25-8.5,
    # B1 8.5-10.5: six messages on the critical path, 1.5 s over the 9 s unpriced
    result = simulate(gpipe(2, 2), 1.0, 2.0, transfer_time=0.25)
    assert result.makespan == pytest.approx(10.5)
    spans = {r: [(str(t.action), t.start, t.end) for t in ts] for r, ts in result.timelines.items()}
    assert spans[0] == [("0F0", 0, 1), ("0F1", 1.25, 2.25), ("0B0", 6.25, 8.25), ("0B1", 8.5, 10.5)]
    assert spans[1] == [("1F0", 1.5, 2.5), ("1F1", 2.75, 3.75), ("1B0", 3.75, 5.75), ("1B1", 6, 8)]
    lowered = add_communication(gpipe(2, 2))
    assert simulate(lowered, 1.0, 2.0, transfer_time=0.25).makespan == pytest.approx(10.5)
    assert simulate(lowered, 1.0, 2.0, transfer_time=0.0).makespan == pytest.approx(9.0)
    # on one shared core the messages are work too: 12 s of compute + 8 messages x 0.25 s
    assert simulate(gpipe(2, 2), 1.0, 2.0, transfer_time=0.25, cores=1).makespan == pytest.approx(14.0)


def test_a_ranks_tail_shares_the_core_too():
    # as above with 0.5 s of gradient reduction and optimizer step per stage: r1's tail and r0 B1
    # both start at 10 at half a core: the tail ends at 11, B1 (1.5 s left) at 12.5 alone, then
    # r0's tail 12.5-13
    result = simulate(gpipe(2, 2), 1.0, 2.0, sync_time=0.5, cores=1)
    assert result.makespan == pytest.approx(13.0)
    assert simulate(gpipe(2, 2), 1.0, 2.0, sync_time=0.5).makespan == pytest.approx(9.5)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_enough_cores_change_nothing(name):
    schedule = SCHEDULES[name].make(4, 8, 1)
    free = simulate(schedule, 1.0, 2.0, weight_time=0.75, sync_time=0.3, comm_time=0.1)
    for cores in (4, 5):
        limited = simulate(schedule, 1.0, 2.0, weight_time=0.75, sync_time=0.3, comm_time=0.1, cores=cores)
        assert limited.makespan == pytest.approx(free.makespan)


@pytest.mark.parametrize("lowered", [False, True])
def test_four_ranks_on_two_cores_do_the_work_on_two_cores(lowered):
    schedule = zb_h1(4, 8)
    if lowered:
        schedule = add_communication(schedule)
    result = simulate(schedule, 1.0, 2.0, weight_time=1.0, cores=2)
    work = 4 * 8 * 3.0
    assert result.makespan >= work / 2  # two cores do the 96 s of work at best
    assert result.makespan > simulate(schedule, 1.0, 2.0, weight_time=1.0).makespan
    assert sum(result.busy.values()) == pytest.approx(work)
    slowed = simulate(schedule, 1.0, 2.0, weight_time=1.0, cores=SharedCores(2, 1.2)).makespan
    assert result.makespan < slowed <= 1.2 * result.makespan + 1e-9


def test_core_count_is_validated():
    with pytest.raises(ValueError, match="cores must be >= 1"):
        simulate(gpipe(2, 2), 1.0, 2.0, cores=0)


def test_ranks_that_all_compute_share_the_cores():
    assert core_share(HOST, 2) == 1.0 and core_share(HOST, 4) == 0.5
    assert core_share(dataclasses.replace(HOST, cores_per_node=None), 4) == 1.0
    shared = shared_cluster(HOST, 4)
    assert shared.core_share == 0.5 and shared_cluster(shared, 4) == shared  # priced once
    assert shared_cluster(HOST, 2) is HOST
    for flops, nbytes, contraction, op, shape in [
        (1e9, 1e6, True, None, None),
        (1e3, 1e8, False, None, None),
        (1e8, 1e6, False, "aten.gelu", None),
        (1e8, 1e6, False, "attn", (90, 32)),
    ]:
        alone = compute_time(flops, nbytes, None, contraction, HOST, op, shape)
        assert compute_time(flops, nbytes, None, contraction, shared, op, shape) == pytest.approx(2 * alone)
    alone = optimizer_step_time(1e6, 4, "adam", HOST, offloaded=False)
    assert optimizer_step_time(1e6, 4, "adam", shared, offloaded=False) == pytest.approx(2 * alone)
    assert shared.intra_node == HOST.intra_node and shared.collective_overhead_s == HOST.collective_overhead_s
    assert ClusterSpec.from_dict(shared.to_dict()) == shared
    assert shared_cluster(PRESETS["h100"], 64) is PRESETS["h100"]  # GPUs: a device each


@pytest.mark.parametrize(
    "pipeline, stage_ranks, expected", [(4, 1, 2), (2, 2, 1), (2, 1, None), (1, 4, None), (8, 1, None)]
)
def test_pipeline_cores(pipeline, stage_ranks, expected):
    # 4 one-rank stages on 2 cores: two at once; 2 stages of 2 ranks: one stage at once (its two
    # ranks take both cores); 2 ranks: no limit; 8 ranks span more than the host's 4
    sliced = dataclasses.replace(HOST, time_slice_slowdown=1.25)
    for spec, slowdown in ((HOST, 1.0), (sliced, 1.25)):
        got = pipeline_cores(spec, pipeline, stage_ranks)
        assert got == (None if expected is None else SharedCores(expected, slowdown))


def test_time_sliced_ranks_that_all_compute_pay_the_slowdown_too():
    sliced = dataclasses.replace(HOST, time_slice_slowdown=1.25)
    shared = shared_cluster(sliced, 4)  # half a core each, 1.25x the CPU time: 2.5x a core's time
    alone = compute_time(1e9, 1e6, None, True, sliced)
    assert compute_time(1e9, 1e6, None, True, shared) == pytest.approx(2.5 * alone)
    assert shared_cluster(shared, 4) == shared and shared_cluster(sliced, 2) is sliced  # cores suffice: as measured


def test_a_message_costs_its_cpu_at_each_end_and_its_link_time_between():
    spec = dataclasses.replace(HOST, message_cpu_s=1e-4, message_cpu_s_per_byte=2e-10)
    assert message_cpu_time(spec, 0) == 0.0 and message_cpu_time(HOST, 1 << 20) == 0.0  # GPU presets: none
    link_s, cpu_s = message_prices(spec, (4, 1), 1 << 20)
    assert cpu_s == pytest.approx(1e-4 + 2e-10 * (1 << 20))
    assert link_s == pytest.approx((1 << 20) / 1e9 + 1e-5)  # the intra-node link's latency and bandwidth
    assert message_prices(spec, (4, 1), 0) == (0.0, 0.0)
    # the largest message a stage receives, as the runner's receive buffers hold it
    graphs = [SimpleNamespace(receives=[]), SimpleNamespace(receives=["h"]), SimpleNamespace(receives=["h2", "ids"])]
    carried = {
        "h": ((2, 128, 256), torch.float32),
        "h2": ((2, 128, 256), torch.bfloat16),
        "ids": ((2, 128), torch.int64),
    }
    assert largest_message(graphs, carried) == 2 * 128 * 256 * 4


def test_the_sharing_figures_fit_and_round_trip():
    samples = [{"bytes": 4096, "s": 1.1e-4}, {"bytes": 4096 + 1_000_000, "s": 3.1e-4}]
    fitted = message_cpu(samples)
    assert fitted["message_cpu_s_per_byte"] == pytest.approx(2e-10)
    assert fitted["message_cpu_s"] == pytest.approx(1.1e-4 - 4096 * 2e-10)
    assert message_cpu(None) == {} and message_cpu(samples[:1]) == {}
    assert time_slice_slowdown({"alone_s": 0.010, "shared_s": 0.012}) == pytest.approx(1.2)
    assert time_slice_slowdown({"alone_s": 0.010, "shared_s": 0.009}) == 1.0  # never faster than alone
    assert time_slice_slowdown(None) == 1.0
    spec = dataclasses.replace(HOST, time_slice_slowdown=1.2, **fitted)
    assert ClusterSpec.from_dict(spec.to_dict()) == spec
    unset = HOST.to_dict()  # files written before these figures read back as written
    assert not {"time_slice_slowdown", "message_cpu_s", "message_cpu_s_per_byte"} & set(unset)


def test_every_pair_of_options_of_a_tiny_schedule_is_consistent():
    # the limited simulation never beats the unlimited one and never needs more than all work serial
    for (p, m), cores in itertools.product([(2, 2), (3, 4), (4, 4)], [1, 2, 3]):
        schedule = zb_h1(p, m)
        free = simulate(schedule, 1.0, 2.0, weight_time=1.0).makespan
        limited = simulate(schedule, 1.0, 2.0, weight_time=1.0, cores=cores).makespan
        assert free - 1e-9 <= limited <= p * m * 3.0 + 1e-9


def test_the_search_prices_every_candidate_on_the_shared_cores():
    # GPT on 4 ranks of the 2-core host: a pipeline's step is simulated with two stages computing
    # at once (the report's timeline of the chosen plan says the same step), never below its
    # work over the two cores; data parallel 4 computes at half a core per rank
    import partitioner
    from partitioner.models import gpt_demo
    from partitioner.report.timeline import simulate_plan
    from passes.schedules import stage_durations, stage_syncs

    model, inputs = gpt_demo(8, 32, n_layer=4, n_embd=64, n_head=4, vocab_size=128)
    host = dataclasses.replace(HOST, memory_bytes=8 << 30)
    searched = partitioner.plan(model, inputs, devices=4, cluster=host)
    pipe = searched.data.get("pipeline")
    if pipe:
        assert simulate_plan(searched)["step_s"] == pytest.approx(pipe["step_time_s"])
        estimates = [stage.estimate() for stage in searched.stage_plans]
        f, b, _ = stage_durations(estimates, pipe["takes_activations"])
        work = sum(pipe["microbatches"] * (f[s] + b[s]) + t for s, t in stage_syncs(estimates).items())
        assert pipe["step_time_s"] >= work / 2 - 1e-12
    intra_op = partitioner.plan(model, inputs, mesh_shape=(4,), cluster=host)  # how the search plans a candidate
    assert intra_op.data["cluster"]["core_share"] == 0.5  # priced at half a core per rank
    assert pipe or searched.data["cluster"]["core_share"] == 0.5


def test_a_planned_pipeline_prices_its_messages_and_time_slicing_in_one_step_everywhere():
    # a 4-stage GPT pipeline planned as the search plans a candidate, on the 2-core host whose
    # time-sliced work takes 1.2x and whose messages cost CPU at each end: the plan's step, its
    # report timeline and the simulation with those prices are one number, and each figure adds
    from partitioner.models import gpt_demo
    from partitioner.parallel_config import ParallelConfig
    from partitioner.report.timeline import simulate_plan
    from partitioner.search import plan_config
    from passes.schedules import stage_durations, stage_syncs

    model, inputs = gpt_demo(8, 32, n_layer=4, n_embd=64, n_head=4, vocab_size=128)
    host = dataclasses.replace(
        HOST, memory_bytes=8 << 30, time_slice_slowdown=1.2, message_cpu_s=1e-4, message_cpu_s_per_byte=1e-10
    )
    config = ParallelConfig(pipeline=4, microbatches=4, schedule="zb-h1", recompute="none")
    plan = plan_config(model, inputs, config, cluster=host)
    pipe = plan.data["pipeline"]
    largest = 2 * 32 * 64 * 4  # a microbatch's hidden state, float32
    assert pipe["message_cpu_s"] == pytest.approx(message_cpu_time(host, largest))
    assert simulate_plan(plan)["step_s"] == pytest.approx(pipe["step_time_s"], rel=1e-12)
    assert plan.estimate().step_time_s == pytest.approx(pipe["step_time_s"], rel=1e-12)
    assert f"{pipe['message_cpu_s'] * 1e6:.1f} us of CPU at each end" in plan.summary()
    estimates = [stage.estimate() for stage in plan.stage_plans]
    f, b, w = stage_durations(estimates, pipe["takes_activations"])
    schedule = SCHEDULES["zb-h1"].make(4, 4, 1)

    def step(slowdown, messages):
        return simulate(
            schedule,
            f,
            b,
            w,
            comm_time=pipe["p2p_time_s"],
            sync_time=stage_syncs(estimates),
            cores=SharedCores(2, slowdown),
            transfer_time=pipe["message_cpu_s"] if messages else None,
        ).makespan

    assert step(1.2, True) == pytest.approx(pipe["step_time_s"], rel=1e-12)
    assert step(1.0, False) < step(1.0, True) < step(1.2, True)
    assert step(1.0, False) < step(1.2, False) < step(1.2, True)
