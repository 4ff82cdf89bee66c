"""Which edges backward sends a gradient along (:mod:`passes.analysis.gradient_reach`).

A value no output depends on, or read only by an op that passes no gradient back (a
comparison), gets none: its backward and the moves of its gradient are not priced. A value
written in place into a tensor the loss reads keeps its gradient, though the write has no users.
"""

import torch

from passes.analysis.analyze import analyze, info
from passes.capture.capture import capture
from passes.core.node_info import grad_flows


class DeadBranches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        unused = torch.tanh(y) * 2  # computed, never returned
        mask = y > 0  # read only by a comparison
        del unused
        return (y * mask).sum()


class WriteThroughSlice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        buf = torch.zeros(x.shape[0], 8)
        buf[:, :4] = self.lin(x)[:, :4]
        return (buf * x).sum()


def _analyzed(model, x):
    cap = capture(model, (x,))
    analyze(cap)
    return {n.name: n for n in cap.graph.nodes}


def test_no_gradient_reaches_values_the_output_does_not_differentiate():
    nodes = _analyzed(DeadBranches(), torch.randn(4, 8))
    by_target = {str(n.target): n for n in nodes.values() if n.op == "call_function"}
    linear, tanh, gt = by_target["aten.linear.default"], by_target["aten.tanh.default"], by_target["aten.gt.Scalar"]
    assert info(linear).requires_grad and not info(tanh).requires_grad  # no output depends on the tanh
    assert not grad_flows(linear, tanh) and not grad_flows(linear, gt)  # the mask passes none back
    (mul,) = [u for u in linear.users if str(u.target) == "aten.mul.Tensor"]
    assert grad_flows(linear, mul) and not grad_flows(gt, mul)


def test_a_write_into_a_tensor_the_loss_reads_keeps_its_gradient():
    nodes = _analyzed(WriteThroughSlice(), torch.randn(4, 8))
    (write,) = [n for n in nodes.values() if n.op == "call_function" and n.target._schema.is_mutable]
    assert not write.users  # its effect reaches the loss through the tensor it writes
    (linear,) = [n for n in nodes.values() if str(n.target) == "aten.linear.default"]
    assert info(linear).requires_grad and all(grad_flows(linear, u) for u in linear.users)


class CastMask(torch.nn.Module):
    """Funnel's attention bias: a mask cast ``type_as`` the hidden states (its dtype only)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, mask):
        h = self.lin(x)
        return (h + (1.0 - mask.type_as(h)) * -1e4).softmax(-1).sum()


def test_a_value_read_for_its_dtype_passes_no_gradient_on():
    """``type_as(mask, h)`` needs no gradient though ``h`` does: autograd records none, so none of
    the mask's moves has a backward to price (Funnel counted 256 B under its estimate)."""
    model = CastMask()
    cap = capture(model, (torch.randn(4, 8), torch.ones(4, 8, dtype=torch.long)))
    analyze(cap)
    by_target = {str(n.target): n for n in cap.graph.nodes if n.op == "call_function"}
    cast, linear = by_target["aten.type_as.default"], by_target["aten.linear.default"]
    assert info(linear).requires_grad and not info(cast).requires_grad
    assert not any(info(u).requires_grad for u in cast.users)
    (add,) = [u for u in linear.users if str(u.target) == "aten.add.Tensor"]
    assert grad_flows(linear, add) and not any(grad_flows(p, add) for p in add.all_input_nodes if p is not linear)
