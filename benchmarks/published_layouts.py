"""A published row's degrees planned in the run's own layout and in the solver's free layout, side
by side: the pipeline's step and, per stage class, the ILP's objective and the estimate's parts.

Where the free layout's objective is below the published layout's but its estimate is above, the
ILP leaves out something the estimate charges (Megatron 1T: the gradient sums over microbatches).
``--uncapped`` also plans the free layout without the search's cap on an op's options
(:data:`partitioner.search.planner.SEARCH_MAX_OPTIONS`), to tell the cap from the pricing.

    python benchmarks/published_layouts.py megatron-1t [--uncapped]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import published_runs  # noqa: E402


def planned(name: str, layout: dict, max_options: int | None) -> dict:
    import partitioner.search.planner as planner
    from partitioner.search import plan_config

    run = published_runs.RUNS[name]
    model, inputs = published_runs.build(run)
    kept = planner.SEARCH_MAX_OPTIONS
    planner.SEARCH_MAX_OPTIONS = max_options or kept
    try:
        t0 = time.process_time()
        plan = plan_config(
            model,
            inputs,
            published_runs.published_config(run),
            cluster=run["cluster"],
            precision="bf16",
            optimizer="adam",
            **layout,
        )
    finally:
        planner.SEARCH_MAX_OPTIONS = kept
    stage_map = plan.data["pipeline"]["stage_map"] if plan.data.get("pipeline") else [0]
    classes = []
    for k in sorted(set(stage_map)):
        stage = plan.stage_plans[stage_map.index(k)] if plan.stage_plans else plan
        est = stage.estimate()
        classes.append(
            {
                "objective_s": stage.data["stats"].get("objective_s"),
                "compute_s": est.compute_s,
                "grad_sync_s": est.grad_sync_s,
                "memory_gib": est.memory_bytes / 2**30,
            }
        )
    return {"step_s": plan.estimate().step_time_s, "cpu_s": time.process_time() - t0, "classes": classes}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case", choices=sorted(published_runs.RUNS))
    ap.add_argument("--uncapped", action="store_true", help="also the free layout with every option kept")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    layouts = [("published", published_runs.published_layout(published_runs.RUNS[args.case]), None), ("free", {}, None)]
    if args.uncapped:
        layouts.append(("free, uncapped", {}, 10**9))
    for label, layout, cap in layouts:
        print(json.dumps({"layout": label, **planned(args.case, layout, cap)}), flush=True)


if __name__ == "__main__":
    main()
