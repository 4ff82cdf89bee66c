"""The memory estimate is the truth: measured per rank, on real gloo ranks, against the plan.

For every parity config (the models and pins of ``parity_utils``, the configs of
``test_parity``: data parallel, Megatron, DP x TP, sequence parallel, the solver free and under
a budget, whose plans gather weights for use), each rank plans, runs one forward + backward through
``partitioner.measure_memory`` (saved-tensor hooks, each storage counted once) and compares with
``plan.estimate().memory``:

* what backward keeps (saved activations + gathered buffers) within 5%;
* parameters, gradients and Adam's state within 5% (the measurement assumes Adam: two moments);
* a plan made under a memory budget fits it: its estimated peak, and the measured state, batch
  and saved tensors (the peak itself is measurable on CUDA only).

Configs sharing a mesh run in one forked run, each model built and captured once before the
ranks fork. The breakdown's own arithmetic (the peak follows the step's order) is checked in one
process.
"""

import pytest
from parity_utils import MODELS, Checks, build, built_in_parent, pins_for

from runtime.launch import run_on_ranks

TIMEOUT_S = 240
TOLERANCE = 0.05


def _within(checks, what, estimated, measured):
    checks.true(f"{what}: estimated {estimated:.0f} B, measured {measured:.0f} B",
                abs(estimated - measured) <= TOLERANCE * measured)


def memory_worker(rank, world, mesh, configs):
    import partitioner

    checks = Checks(rank)
    report = []
    models: dict = {}  # a model serves several configs: planning leaves it as it was, its capture is reused
    for model_name, kind, budget_fraction in configs:
        if model_name not in models:
            models[model_name] = build(model_name)
        model, inputs = models[model_name]
        budget = None
        if budget_fraction:
            n_params = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
            budget = int(budget_fraction * 16 * n_params)
        pm = partitioner.auto_parallelize(model, inputs, mesh=mesh, pins=pins_for(model_name, kind, mesh),
                                          cluster="h100", memory_budget=budget)
        measured = partitioner.measure_memory(pm, inputs)
        est = pm.plan.estimate().memory
        label = f"{model_name} {kind} {mesh}"
        _within(checks, f"{label}: saved for backward", est.saved, measured.saved_activations)
        _within(checks, f"{label}: parameters", est.parameters, measured.parameters)
        _within(checks, f"{label}: gradients", est.gradients, measured.gradients)
        _within(checks, f"{label}: optimizer state", est.optimizer_state, measured.optimizer_state)
        if budget is not None:  # the plan fits its budget: its estimated peak, and what was measured
            needed = measured.state + measured.inputs + measured.saved_activations
            checks.true(f"{label}: estimated peak {pm.plan.estimate().memory_bytes:.0f} B over the budget {budget} B",
                        pm.plan.estimate().memory_bytes <= budget)
            checks.true(f"{label}: measured {needed} B (state, batch, saved) over the budget {budget} B",
                        needed <= budget)
        report.append((label, budget, est.gathered_buffers))
    return {"failures": checks.failures, "report": report}


BUDGET = 0.75  # of the replicated fp32 Adam state, as the parity tests: the solver must shard

RUNS = [  # every config of tests/test_parity.py, grouped by mesh
    pytest.param((2,), [("gpt", "dp", None), ("bert", "dp", None), ("llama", "tp", None), ("gpt2", "tp", None),
                        ("vit", "free", None), ("mlp", "free", BUDGET)], id="2"),
    pytest.param((4,), [("gpt", "tp", None), ("vit", "tp", None), ("mlp", "tp", None), ("gpt2", "tp_sp", None),
                        ("gpt", "free", BUDGET), ("gpt2", "free", BUDGET), ("llama", "free", BUDGET),
                        ("bert", "free", BUDGET)], id="4", marks=pytest.mark.slow),  # the budgeted ILPs again
    pytest.param((2, 2), [("gpt", "dp_tp", None), ("gpt", "tp_sp", None), ("bert", "dp_tp", None),
                          ("llama", "tp_sp", None), ("gpt2", "dp_tp", None), ("mlp", "dp", None),
                          ("gpt", "free", None), ("vit", "free", BUDGET)], id="2x2"),
]


@pytest.mark.parametrize("mesh,configs", RUNS)
def test_estimate_equals_measured(mesh, configs):
    import math

    # each model built and captured once, here, before the ranks fork (parity_utils.built_in_parent);
    # the other ranks wait in a broadcast while rank 0 plans (budgeted plans included)
    with built_in_parent({name: (MODELS[name]["factory"], {}) for name, _, _ in configs}):
        results = run_on_ranks(memory_worker, math.prod(mesh), mesh, configs, timeout_s=TIMEOUT_S,
                               collective_timeout_s=150)
    failures = [f for r in results for f in r["failures"]]
    assert not failures, "\n".join(failures[:12])
    # the budgeted plan gathers weights for use and keeps them for backward: counted, not missed
    for label, budget, gathered in results[0]["report"]:
        if label.startswith("gpt free") and budget is not None:
            assert gathered > 0, label


def test_peak_follows_the_step():
    """Forward peak: resident state + kept so far + the op's transient; backward: + gradients,
    everything kept and the largest backward transient."""
    from partitioner.memory import memory_breakdown

    records = [
        {"name": "w", "parameters": 100.0, "gradients": 100.0, "optimizer_state": 200.0},
        {"name": "x", "input_bytes": 10.0},
        {"name": "a", "saved_activations": 50.0, "transient_fwd": 70.0, "transient_bwd": 30.0},
        {"name": "b", "gathered_buffers": 40.0, "transient_fwd": 5.0, "transient_bwd": 60.0},
    ]
    m = memory_breakdown(records)
    assert (m.state, m.saved, m.inputs, m.offloaded) == (400.0, 90.0, 10.0, 0.0)
    assert m.forward_peak == 310.0 + max(50 + 70, 90 + 5)
    assert m.backward_peak == 410.0 + 90 + 60
    assert m.peak == m.backward_peak
    legacy = memory_breakdown([{"name": "w", "memory": 7.0}, {"name": "a", "memory": 3.0}])
    assert legacy.peak == 10.0


def test_measure_memory_counts_each_storage_once():
    """A plain two-layer MLP: the ReLU keeps its output and the second matmul keeps the same
    tensor (one storage, counted once); inputs and parameters are not activations."""
    import torch

    import partitioner

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    m = partitioner.measure_memory(model, (torch.randn(2, 8),), loss_fn=lambda out: out.sum(), by_node=True)
    param_bytes = 4 * (8 * 16 + 16 + 16 * 4 + 4)
    assert (m.parameters, m.gradients, m.optimizer_state) == (param_bytes, param_bytes, 2 * param_bytes)
    assert m.saved_activations == 2 * 16 * 4 and m.inputs == 2 * 8 * 4
    assert m.state == 4 * param_bytes and m.peak_allocated is None
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    assert partitioner.measure_memory(model, (torch.randn(2, 8),), optimizer=sgd,
                                      loss_fn=lambda out: out.sum()).optimizer_state == 0


def test_measure_memory_bad_input_says_what_to_pass():
    import torch

    import partitioner

    model = torch.nn.Linear(4, 2)
    with pytest.raises(TypeError, match="batch must be a tuple"):
        partitioner.measure_memory(model, torch.randn(3, 4))
    with pytest.raises(ValueError, match="loss_fn="):
        partitioner.measure_memory(model, (torch.randn(3, 4),))
