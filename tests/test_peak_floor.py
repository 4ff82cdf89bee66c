"""The floor of every plan's walked peak (passes/plan/peak_floor.py): a budget under it is refused
before any solve, with a message naming the budget, the floor and what dominates it; a budget
that a plan fits is planned. Planning only (torch's fake process group), real solver.

Both sides of the bound on a small GPT on (2, 2): one byte under the floor is refused with no
ILP solved; the planned peak of a plan (at least the floor) is planned again. And the floor is
under the walked peak of plans of other kinds (ZeRO-3, recomputation, a pipeline stage)."""

import pytest

import partitioner
import passes.plan.plan_intra_op as plan_intra_op
from partitioner import models


@pytest.fixture
def solves(monkeypatch):
    """The ILP solves made while planning (counted, the real solver run)."""
    made = []
    real = plan_intra_op.solve_ilp

    def counted(*args, **kwargs):
        made.append(kwargs.get("budget"))
        return real(*args, **kwargs)

    monkeypatch.setattr(plan_intra_op, "solve_ilp", counted)
    return made


def _small_gpt():
    return models.gpt_demo(batch=8, seq=16, n_layer=2, n_embd=32, n_head=2, vocab_size=64)


def test_a_budget_under_the_floor_is_refused_before_any_solve_and_one_that_fits_is_planned(fake_process_group, solves):
    fake_process_group(4)
    model, inputs = _small_gpt()
    planned = partitioner.plan(model, inputs, mesh_shape=(2, 2), memory_budget="64MiB")
    floor = planned.data["stats"]["peak_floor"]
    peak = planned.estimate().memory_bytes
    assert 0 < floor <= peak
    solves.clear()
    with pytest.raises(partitioner.InfeasibleBudgetError) as refused:
        partitioner.plan(model, inputs, mesh_shape=(2, 2), memory_budget=int(floor) - 1)
    assert solves == []  # refused at once
    text = str(refused.value)
    assert f"({int(floor) - 1} bytes)" in text and f"({floor:.0f} bytes) at its peak" in text
    assert "parameters and optimizer state sharded as far as the mesh allows" in text
    assert "Raise the budget, use a larger mesh" in text and "host_memory_budget" in text
    assert refused.value.floor is not None and refused.value.floor.total == floor
    # the other side: a plan's own peak is a budget it fits
    again = partitioner.plan(model, inputs, mesh_shape=(2, 2), memory_budget=int(peak))
    assert floor <= again.estimate().memory_bytes <= peak


def test_the_cli_s_one_mebibyte_budget_is_refused_by_the_floor(fake_process_group, solves):
    """The budget that used to take about ten solves (and a second planning with activations kept
    as shards) before it was refused."""
    fake_process_group(4)
    model, inputs = models.gpt_demo(n_layer=1)
    with pytest.raises(partitioner.InfeasibleBudgetError, match="least memory any plan needs is") as refused:
        partitioner.plan(model, inputs, mesh_shape=(2, 2), memory_budget="1MiB")
    assert refused.value.floor is not None and solves == []


@pytest.mark.parametrize(
    "options",
    [
        {"zero": 3, "objective": "memory"},
        {"recompute": "all"},
        {"pipeline_stage": True},
    ],
    ids=["zero3-memory", "recompute-all", "pipeline-stage"],
)
def test_the_floor_is_under_the_walked_peak(fake_process_group, options):
    from partitioner.intra_op import plan_captured
    from passes.analysis.analyze import analyze
    from passes.capture.capture import capture

    fake_process_group(4)
    model, inputs = _small_gpt()
    options = dict(options)
    stage = options.pop("pipeline_stage", False)
    cap = capture(model, inputs)
    analyze(cap)
    extra = {"activation_copies": 2, "microbatches": 4, "holds_gradient_sums": True} if stage else {}
    plan = plan_captured(
        cap, model_name="gpt", mesh_shape=(4,), cluster="h100", memory_budget="64MiB", **options, **extra
    )
    floor = plan.data["stats"]["peak_floor"]
    assert 0 < floor <= plan.estimate().memory_bytes
