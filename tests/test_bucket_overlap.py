"""The bucketed gradient reductions' overlap with backward (passes/plan/bucket_overlap.py): a known
answer on hand-made records, and on 2 gloo ranks the runtime launching, during backward, the
buckets the estimate credits, with parity and counted bytes = estimate."""

import copy

from parity_utils import Checks, check_step_like_one_device, run_checked

from passes.plan.bucket_overlap import credit_bucket_overlap

MIB = 2**20


def _record(name: str, kind: str, inputs: list, out: str, **more) -> dict:
    """A plan record with the keys every record has (plain values where the test needs none)."""
    base = dict(module="", target="", fqn=None, shapes=[], dtype="float32", rep=name, ins=[], local_shapes=[])
    return {**base, "name": name, "kind": kind, "inputs": inputs, "out": [out], "memory": 0.0, **more}


def _layer_records(n: int, grad_bytes: float, comm_s: float, backward_s: float) -> list:
    """``n`` matmuls in a chain on a 4-way ``dp`` mesh, each with a weight whose gradient is
    all-reduced in a bucket (``grad_bytes``, ``comm_s``) and ``backward_s`` of backward compute."""
    records = [_record("x", "input", [], "[S(0)]", comm=[], compute_s=0.0)]
    previous = "x"
    for k in range(n):
        records.append(_record(f"w{k}", "param", [], "[R]", comm=[], compute_s=0.0))
        sync = dict(kind="all_reduce", axis="dp", bytes=grad_bytes, phase="bwd", input=1, time_s=comm_s, bucketed=True)
        more = dict(grads=["[S(0)]", "[P]"], comm=[sync], compute_s=0.5 + backward_s, forward_s=0.5)
        records.append(_record(f"mm{k}", "op", [previous, f"w{k}"], "[S(0)]", **more))
        previous = f"mm{k}"
    return records


def _times(records) -> list:
    return [c["time_s"] for r in records for c in r["comm"]]


def test_full_buckets_hide_behind_the_backward_compute_after_them_and_the_last_one_is_exposed():
    # each layer's 30 MiB gradient fills a bucket (25 MiB); its 0.5 s all-reduce runs beside the
    # 1 s backward of the layer before it: only the first layer's (the last in backward) is exposed
    records = _layer_records(3, 30 * MIB, 0.5, 1.0)
    got = credit_bucket_overlap(records, (4,), ("dp",))
    assert got.launched_in_backward == 3 and got.total_s == 1.5 and abs(got.exposed_s - 0.5) < 1e-12
    assert all(abs(t - 0.5 / 3) < 1e-12 for t in _times(records))
    assert all(c["sync_s"] == 0.5 and c["bytes"] == 30 * MIB for r in records for c in r["comm"])
    again = credit_bucket_overlap(records, (4,), ("dp",))  # crediting twice changes nothing
    assert again == got and all(abs(t - 0.5 / 3) < 1e-12 for t in _times(records))


def test_a_short_backward_hides_part_of_a_reduction_and_small_gradients_wait_for_the_end():
    # 0.2 s of backward after each launch: 0.3 s of each earlier all-reduce still queued, the
    # queue grows: 0.5 - 0.2 = 0.3, + 0.5 - 0.2 = 0.6, + 0.5 (the last) = 1.1 s exposed of 1.5
    records = _layer_records(3, 30 * MIB, 0.5, 0.2)
    got = credit_bucket_overlap(records, (4,), ("dp",))
    assert abs(got.exposed_s - 1.1) < 1e-12
    # gradients of 1 MiB never fill a bucket: all sent at the end of backward, nothing hidden
    small = _layer_records(3, MIB, 0.5, 1.0)
    got = credit_bucket_overlap(small, (4,), ("dp",))
    assert got.launched_in_backward == 0 and abs(got.exposed_s - 1.5) < 1e-12 and _times(small) == [0.5] * 3


def _zero3_records(n: int, comm_s: float, backward_s: float) -> list:
    """``n`` matmuls in a chain on a 4-way ``dp`` mesh, each with a ZeRO-3 weight (stored
    ``S(0)``, gathered for use, gathered again in backward) whose gradient is reduce-scattered
    (``comm_s``) after ``backward_s`` of backward compute: the runtime launches each alone, at once."""
    records = [_record("x", "input", [], "[S(0)]", comm=[], compute_s=0.0)]
    previous = "x"
    for k in range(n):
        records.append(_record(f"w{k}", "param", [], "[S(0)]", comm=[], compute_s=0.0, regather=True))
        sync = dict(kind="reduce_scatter", axis="dp", bytes=MIB, phase="bwd", input=1, time_s=comm_s, bucketed=True)
        more = dict(grads=["[S(0)]", "[P]"], comm=[sync], compute_s=0.5 + backward_s, forward_s=0.5)
        records.append(_record(f"mm{k}", "op", [previous, f"w{k}"], "[S(0)]", **more))
        previous = f"mm{k}"
    return records


def test_zero3_gradients_sent_alone_hide_behind_backward_and_a_reduce_scatter_waits_for_the_one_in_flight():
    # each 1 MiB gradient is far below a bucket, but a ZeRO-3 weight's is launched at once: its
    # 0.5 s reduce-scatter runs beside the 1 s backward of the layer before; the last is exposed
    records = _zero3_records(3, 0.5, 1.0)
    got = credit_bucket_overlap(records, (4,), ("dp",))
    assert got.launched_in_backward == 3 and got.total_s == 1.5 and abs(got.exposed_s - 0.5) < 1e-12
    assert all(abs(t - 0.5 / 3) < 1e-12 for t in _times(records))
    # 0.2 s of backward between launches: each launch waits for the 0.3 s left of the one in
    # flight (the runtime holds one reduce-scatter input at a time): 0.3 + 0.3 + 0.5 exposed
    records = _zero3_records(3, 0.5, 0.2)
    got = credit_bucket_overlap(records, (4,), ("dp",))
    assert abs(got.exposed_s - 1.1) < 1e-12


def _overlap_worker(rank, world, cfg):
    import torch

    import partitioner
    import runtime.grad_sync as grad_sync
    from partitioner import models
    from passes.core import bucket_sizes

    bucket_sizes.BUCKET_BYTES = cfg["bucket_bytes"]  # small buckets: several fill before backward ends
    launches = {"in_backward": 0, "at_end": 0, "finishing": False}
    launch, finish = grad_sync.GradientBuckets._launch, grad_sync.GradientBuckets._finish

    def counted_launch(self, key, entries):
        launches["at_end" if launches["finishing"] else "in_backward"] += 1
        return launch(self, key, entries)

    def counted_finish(self):
        launches["finishing"] = True
        try:
            return finish(self)
        finally:
            launches["finishing"] = False

    grad_sync.GradientBuckets._launch, grad_sync.GradientBuckets._finish = counted_launch, counted_finish
    torch.manual_seed(0)
    checks = Checks(rank)
    model, inputs = models.gpt_demo(batch=cfg["batch"], seq=cfg["seq"], n_layer=2)
    ref = copy.deepcopy(model)
    pm = partitioner.auto_parallelize(
        model, inputs, mesh=cfg["mesh"], mesh_axis_names=("dp",), cluster="h100", pins={"idx": ["S(0)"]}
    )
    check_step_like_one_device(pm, ref, inputs, checks)
    credit = credit_bucket_overlap(copy.deepcopy(pm.plan.records), pm.plan.mesh_shape, pm.plan.axis_names)
    credited = [c for r in pm.plan.records for c in r["comm"] if "sync_s" in c]
    return {
        "failures": checks.failures,
        "launches": dict(launches),
        "credit": credit,
        "credited_below_full": all(c["time_s"] <= c["sync_s"] for c in credited),
    }


def test_the_runtime_launches_during_backward_the_buckets_the_estimate_credits():
    cfg = {"mesh": (2,), "batch": 64, "seq": 32, "bucket_bytes": 64 * 1024}
    results = run_checked(_overlap_worker, cfg, timeout_s=240)
    for r in results:
        credit = r["credit"]
        assert credit.launched_in_backward >= 2 and 0 < credit.exposed_s < credit.total_s
        assert r["launches"]["in_backward"] == credit.launched_in_backward, r
        assert r["credited_below_full"]
