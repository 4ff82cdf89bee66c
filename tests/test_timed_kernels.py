"""The fixed-duration kernel model of the pipeline benchmark (``benchmarks/timed_kernels.py``).

Its measurements are only as good as three properties, checked here without timing anything:
the op computes ``x * w`` with exact gradients; a backward that asks for the input's gradient
only (a zero-bubble I pass) holds for ``input_ms`` only, one that asks for the weight's only (a
W pass) for ``weight_ms`` only, a full backward for both; and Partita captures the op as one
node with its declared cost, so the pipeline planner cuts the uniform layers evenly.
"""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
timed_kernels = pytest.importorskip("timed_kernels")


@pytest.fixture
def holds(monkeypatch):
    seen = []
    monkeypatch.setattr(timed_kernels, "hold", seen.append)
    return seen


def test_values_and_gradients_match_a_plain_product(holds):
    torch.manual_seed(0)
    x = torch.randn(5, 3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    y = timed_kernels.timed_scale(x, w, 2.0, 3.0, 4.0)
    torch.testing.assert_close(y, x * w)
    g = torch.randn(5, 3)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    ex, ew = torch.autograd.grad(x * w, (x, w), g)
    torch.testing.assert_close(gx, ex)
    torch.testing.assert_close(gw, ew)
    assert holds == [0.002, 0.003, 0.004]


@pytest.mark.parametrize("wanted, expected", [("input", [0.003]), ("weight", [0.004]), ("both", [0.003, 0.004])])
def test_backward_holds_only_for_the_gradients_asked_for(holds, wanted, expected):
    x = torch.randn(4, 3).requires_grad_()
    w = torch.ones(3, requires_grad=True)
    y = timed_kernels.timed_scale(x * 1.0, w, 2.0, 3.0, 4.0)
    holds.clear()
    inputs = {"input": [x], "weight": [w], "both": [x, w]}[wanted]
    torch.autograd.backward([y.sum()], inputs=inputs)
    assert holds == expected
    assert (x.grad is not None) == (wanted != "weight")
    assert (w.grad is not None) == (wanted != "input")


def test_planner_sees_one_costed_node_per_layer_and_cuts_evenly():
    from passes.analysis.analyze import analyze, info
    from passes.capture.capture import capture
    from passes.plan.split_stages import assign_stages

    model = timed_kernels.TimedLayers(n_layer=8, width=16, forward_ms=10.0, input_ms=10.0, weight_ms=10.0)
    cap = capture(model, (torch.randn(4, 16), torch.randn(4, 16)))
    analyze(cap)
    timed = [n for n in cap.graph.nodes if n.target is torch.ops.partita_bench.timed_scale.default]
    assert len(timed) == 8
    assert all(info(n).flops == 10.0 * 1e9 for n in timed)
    _, runs = assign_stages(cap, 4)
    assert runs == [(0, 1), (2, 3), (4, 5), (6, 7)]
