"""ZeRO-3 plans: the measured peak (MemTracker) against the plan's estimated peak, per rank.

``python benchmarks/zero3_peak.py [gpt|moe]``: a small dense GPT (``tests/parity_utils``) under
half the replicated fp32 Adam state with ``zero=3`` on 4 gloo ranks, or the 64-expert Mixtral of
``benchmarks/moe.py`` with ``expert_parallel="off"`` under 24 MiB on 4 ranks. Prints, per rank,
the measured peak, the estimate's peak and breakdown, and MemTracker's peak by category.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import torch  # noqa: E402

MiB = 2**20


def _worker(rank, world, which):
    from torch.distributed._tools.mem_tracker import MemTracker

    import partitioner
    from passes.core import bucket_sizes

    if os.environ.get("BUCKET_BYTES"):  # the gradient bucket cap (the runtime's and the plan's alike)
        bucket_sizes.BUCKET_BYTES = int(os.environ["BUCKET_BYTES"])
    if which == "gpt":
        from parity_utils import build, free_weights

        model, inputs = build("gpt")
        n = sum(p.numel() for p in model.parameters())
        net = partitioner.auto_parallelize(
            model,
            inputs,
            mesh=(world,),
            cluster="h100",
            zero=3,
            memory_budget=int(0.5 * 16 * n),
            recompute="none",
            pins=free_weights("gpt", "dp", (world,)) or {},
        )
        batch = inputs

        def loss_of():
            out = net(*batch) if isinstance(batch, tuple) else net(**batch)
            return out if torch.is_tensor(out) else out.loss
    else:
        from moe import BUDGET, build

        model, inputs = build(64)
        net = partitioner.auto_parallelize(
            model, inputs, mesh=(4,), cluster="h100", memory_budget=BUDGET, recompute="none", expert_parallel="off"
        )
        batch = inputs

        def loss_of():
            return net(**batch).loss

    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)

    def step():
        loss = loss_of()
        if loss.dim():
            loss = loss.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    tracker = MemTracker()
    tracker.track_external(net, opt)
    with tracker:
        step()
    snap = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    fb = MemTracker()
    fb.track_external(net, opt)
    with fb:  # forward and backward only: the optimizer step's own temporaries left out
        loss = loss_of()
        (loss.float().pow(2).mean() if loss.dim() else loss).backward()
    fb_peak = fb.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    opt.step()
    opt.zero_grad(set_to_none=True)
    fwd = MemTracker()
    fwd.track_external(net, opt)
    with fwd:
        loss = loss_of()
    fwd_peak = fwd.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    del loss
    est = net.plan.estimate().memory
    return {
        "peak": {str(k): v for k, v in snap.items()},
        "fb_peak": fb_peak,
        "fwd_peak": fwd_peak,
        "est_peak": net.plan.estimate().memory_bytes,
        "est": {
            k: getattr(est, k) for k in dir(est) if not k.startswith("_") and isinstance(getattr(est, k), (int, float))
        },
    }


def main(which="gpt"):
    from runtime.launch import run_on_ranks

    world = 4
    out = run_on_ranks(_worker, world, which, timeout_s=900)
    for rank, r in enumerate(out[:1]):
        print(f"rank {rank}: measured peak {r['peak']['Total'] / MiB:.2f} MiB, estimated {r['est_peak'] / MiB:.2f} MiB")
        print(f"  forward only {r['fwd_peak'] / MiB:.2f} MiB, forward + backward {r['fb_peak'] / MiB:.2f} MiB")
        print("  measured by category:", {k: round(v / MiB, 3) for k, v in r["peak"].items()})
        print("  estimate:", {k: round(v / MiB, 3) for k, v in r["est"].items()})
    return out


if __name__ == "__main__":
    main(*sys.argv[1:])
