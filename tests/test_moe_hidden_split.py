"""EP x TP: experts split over one mesh axis, their hidden dim over the other.

On a (2, 2) mesh, Qwen3-MoE with its tokens and experts split on ``a0`` (all-to-all dispatch)
and the experts' ``H`` dim split on ``a1`` (``hidden_split_experts``: partial gate/up products
summed by an all-reduce of ``N x 2I`` forward, the activation's gradient by one of ``N x I``
backward) trains like one device: loss, router auxiliary loss, every gradient and the parameters
after 2 AdamW steps. The collectives follow each rank's routed rows, so the test compares their
mean over the ranks with the plan's estimate, kind by kind and axis by axis, exactly; the
hidden-split all-reduces alone are checked against the formula on every rank.
"""

import copy

from moe_utils import (
    adam_steps_like_one_device,
    build,
    built_before_forking,
    first_step_like_one_device,
    parallel_beside_one_device,
    routing,
)
from parity_utils import Checks, nested_approx_equal, run_checked

TIMEOUT_S = 240
STEPS = 2
PINS = {"input_ids": ["S(0)", "R"], "labels": ["S(0)", "R"], "model.layers.*.mlp.experts": ["S(0)", "S(1)"]}


def _hidden_all_reduce_bytes(ref, inputs, rank) -> float:
    """This rank's all-reduce bytes inside the experts on ``a1``: its experts' rows ``N`` (those
    routed to experts ``[c E/2, (c+1) E/2)``, ``c`` its ``a0`` coordinate) times ``2I`` forward
    and ``I`` backward, fp32, per layer."""
    experts, inner = ref.config.num_experts, ref.config.moe_intermediate_size
    first = (rank // 2) * experts // 2
    total = 0.0
    for index in routing(ref, inputs):
        rows = int(((index >= first) & (index < first + experts // 2)).sum())
        total += 4 * rows * 3 * inner
    return total


def hidden_split_worker(rank, world, cfg):
    checks = Checks(rank)
    model, inputs = build("qwen3_moe")
    pm, ref = parallel_beside_one_device(model, inputs, mesh=(2, 2), expert_parallel="on", pins=PINS, recompute="none")
    notes = [r.get("notes") for r in pm.plan.records if str(r["target"]).startswith("partita.moe_experts")]
    checks.true(f"experts notes {notes}", all(n == {"a0": "experts", "a1": "hidden_split_experts"} for n in notes))
    counted = first_step_like_one_device(pm, ref, inputs, checks)
    hidden = _hidden_all_reduce_bytes(copy.deepcopy(ref), inputs, rank)
    adam_steps_like_one_device(pm, ref, inputs, STEPS, checks)
    return {
        "rank": rank,
        "failures": checks.failures,
        "counted": counted,
        "hidden": hidden,
        "estimated": pm.plan.estimate().comm_bytes,
        "summary": pm.plan.summary(wide=True) if rank == 0 else "",
    }


def test_experts_split_on_one_axis_and_their_hidden_dim_on_the_other_match_one_device():
    results = run_checked(hidden_split_worker, {"mesh": (2, 2)}, TIMEOUT_S, prebuild=built_before_forking("qwen3_moe"))
    mean: dict = {}
    for r in results:
        for kind, per_axis in r["counted"].items():
            for axis, nbytes in per_axis.items():
                mean.setdefault(kind, {}).setdefault(axis, 0.0)
                mean[kind][axis] += nbytes / len(results)
    assert not nested_approx_equal(mean, results[0]["estimated"]), (mean, results[0]["estimated"])
    # the rows differ per rank: the a1 all-reduces beyond the rank-uniform ones are the formula's
    uniform = [r["counted"]["all_reduce"]["a1"] - r["hidden"] for r in results]
    assert max(uniform) == min(uniform) and len({r["hidden"] for r in results}) > 1, uniform
    assert "split over mesh axis a0 (2 ranks) in 2 MoE layer(s)" in results[0]["summary"]
    assert "hidden dim split over mesh axis a1" in results[0]["summary"]
