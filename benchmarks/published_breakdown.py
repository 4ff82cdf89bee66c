"""One published run's estimate taken apart: configurations between the published one and another.

For a row of ``published_runs.RUNS`` this plans each configuration of a ladder (or the ones given
with ``--config``) as given, with :func:`partitioner.search.plan_config`, and prints per
configuration its estimated step against the published step time, the components (compute,
exposed communication, pipeline bubble, gradient reduction, optimizer step), the implied rates
(the published throughput's FLOPs per device, counted as the run counts them, over the estimated
step and over the compute alone) and
the busiest stage's compute by op. A ladder changes one thing per rung, from the published
configuration in its layout to the search's choice, so the difference between their estimates
reads as the sum of what each change is priced at.

    python benchmarks/published_breakdown.py --case megatron-18.4b
    python benchmarks/published_breakdown.py --case megatron-18.4b \\
        --config '{"pipeline": 8, "data": 16, "tensor": 2, "microbatches": 64, "schedule": "1f1b", "recompute": "all"}'
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import published_runs  # noqa: E402

_SEARCHED_18B = dict(pipeline=8, data=16, tensor=2, microbatches=64, zero=1)
LADDERS = {
    "megatron-18.4b": [
        ("published degrees, the solver's layout", "free", {}),
        (
            "the search's degrees, 1F1B, recompute all",
            "free",
            dict(_SEARCHED_18B, schedule="1f1b", recompute="all"),
        ),
        ("... ZB-H1 instead of 1F1B", "free", dict(_SEARCHED_18B, schedule="zb-h1", recompute="all")),
        ("... 1F1B without recomputation", "free", dict(_SEARCHED_18B, schedule="1f1b", recompute="none")),
        (
            "... ZB-H1, recompute none (the choice)",
            "free",
            dict(_SEARCHED_18B, schedule="zb-h1", recompute="none"),
        ),
    ],
}
"""Per row: (what, layout, configuration) after the published configuration in its layout (always
the first rung); ``layout`` ``"free"`` lets the solver place every op; an empty configuration is
the published one."""


def configuration(run: dict, given: dict):
    """The published configuration with ``given``'s fields in place of its own."""
    from dataclasses import replace

    published = published_runs.published_config(run)
    return replace(published, **given) if given else published


def busiest_compute(plan) -> dict:
    """Seconds per microbatch of the busiest stage's compute, by op (the whole plan's without a pipeline)."""
    pipe = plan.data.get("pipeline")
    stage = plan.stage_plans[pipe.get("busiest_stage", 0)] if pipe else plan
    by_op: dict = defaultdict(float)
    for r in stage.node_records:
        if r.compute_s:
            by_op["grad accumulation" if r.kind == "param" else r.target] += r.compute_s
    return dict(sorted(by_op.items(), key=lambda kv: -kv[1]))


def rung(run: dict, model, inputs, what: str, layout: dict, given: dict, published_s: float) -> dict:
    """One configuration planned as given, its estimate taken apart (the module docstring)."""
    from partitioner.search import plan_config

    cfg = configuration(run, given)
    plan = plan_config(model, inputs, cfg, cluster=run["cluster"], precision="bf16", optimizer="adam", **layout)
    parts = published_runs.components(plan)  # the estimate's components, as the published rows report them
    counted = run.get("tflops", 0.0) * published_s  # the published count's TFLOP per device per step
    shared = ("step_s", "compute_s", "comm_s", "bubble_s", "grad_sync_s", "optimizer_s", "memory_gib")
    return {
        "what": what,
        "config": cfg.describe(),
        "layout": layout.get("tensor_parallel", "free"),
        "ratio": parts["step_s"] / published_s,
        **{key: parts[key] for key in shared},
        "implied_tflops": counted / parts["step_s"],
        "implied_compute_tflops": counted / parts["compute_s"],
        "busiest_compute_by_op": busiest_compute(plan),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", required=True, choices=sorted(published_runs.RUNS))
    ap.add_argument("--config", action="append", default=[], help="a configuration as JSON (ParallelConfig fields)")
    ap.add_argument("--json", help="write the rungs here")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    run = published_runs.RUNS[args.case]
    model, inputs = published_runs.build(run)
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    published_s = published_runs.published_step_s(run, params)
    ladder = [("the published configuration in its layout", "published", {})]
    ladder += [("given", "free", json.loads(c)) for c in args.config] or LADDERS.get(args.case, [])
    rungs = []
    for what, layout, given in ladder:
        options = published_runs.published_layout(run) if layout == "published" else {}
        rungs.append(rung(run, model, inputs, what, options, given, published_s))
        r = rungs[-1]
        print(
            f"{r['what']}: {r['config']}, layout {r['layout']}: {r['step_s']:.3f} s, ratio {r['ratio']:.3f}; "
            f"compute {r['compute_s']:.3f}, comm {r['comm_s']:.3f}, bubble {r['bubble_s']:.3f}, "
            f"grad sync {r['grad_sync_s']:.3f}, optimizer {r['optimizer_s']:.3f}; {r['memory_gib']:.1f} GiB; "
            f"implied TFLOP/s per device as the run counts them {r['implied_tflops']:.0f} (step), "
            f"{r['implied_compute_tflops']:.0f} (compute alone; published {run.get('tflops', '-')})",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"run": args.case, "published_step_s": published_s, "rungs": rungs}, f, indent=1)


if __name__ == "__main__":
    main()
