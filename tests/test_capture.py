"""Capture: nn.Module + example inputs -> aten-level fx graph, clear errors, fingerprints."""
from __future__ import annotations

import logging
import resource

import pytest
import torch
import torch.nn as nn

import partitioner
from partitioner import models
from passes.capture.capture import CapturedGraph, capture, graph_fingerprint
from passes.rules import op_name


def _ops(cap: CapturedGraph) -> list:
    return [op_name(n.target) for n in cap.graph.nodes if n.op == "call_function"]


def test_capture_mlp():
    model, inputs = models.mlp_demo(batch=8)
    cap = capture(model, inputs)
    assert _ops(cap).count("aten.linear") == 3
    assert "aten.cross_entropy_loss" in _ops(cap)
    assert sorted(cap.params.values()) == sorted(n for n, _ in model.named_parameters())
    assert len(cap.user_inputs) == 2
    for node in cap.graph.nodes:
        if node.op == "call_function":
            assert "val" in node.meta and "nn_module_stack" in node.meta, node.name
    first = next(n for n in cap.graph.nodes if n.op == "call_function" and op_name(n.target) == "aten.linear")
    assert tuple(first.meta["val"].shape) == (8, 64)


def test_capture_gpt():
    model, inputs = models.gpt_demo(batch=2, seq=16, n_layer=2)
    cap = capture(model, inputs)
    ops = _ops(cap)
    assert ops.count("aten.scaled_dot_product_attention") == 2
    assert ops.count("aten.embedding") == 2
    assert ops.count("aten.layer_norm") == 5
    assert {"wte.weight", "h.1.attn.c_attn.weight", "lm_head.weight"} <= set(cap.params.values())
    modules = {path for n in cap.graph.nodes for path, _ in (n.meta.get("nn_module_stack") or {}).values()}
    assert "h.0.attn.c_attn" in modules and "h.1.mlp.c_fc" in modules


def test_capture_on_meta_allocates_nothing():
    # about 1.8 G parameters: 7 GB if materialised; on meta the capture costs no memory
    model, inputs = models.gpt_block(batch=2, seq=64, n_embd=8192, n_head=64, n_layer=1, vocab=65536)
    assert all(p.is_meta for p in model.parameters())
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cap = capture(model, inputs)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak_before
    assert grown < 1 << 30, f"capture on meta grew the peak RSS by {grown / 2**30:.2f} GiB"
    vals = [n.meta["val"] for n in cap.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    assert vals and all(v.device.type == "meta" for v in vals)
    assert "aten.scaled_dot_product_attention" in _ops(cap)


def test_capture_moves_cpu_inputs_of_a_meta_model_to_meta():
    model, _ = models.gpt_block(batch=2, seq=16, n_embd=64, n_head=4, vocab=128)
    ids = torch.randint(0, 128, (2, 16))
    cap = capture(model, (ids, ids))
    placeholder = cap.graph.find_nodes(op="placeholder", target=cap.user_inputs[0])[0]
    assert placeholder.meta["val"].device.type == "meta"


class BranchOnValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.lin(x)
        return -x


class ItemAsShape(nn.Module):
    def forward(self, x):
        return torch.zeros(int(x.max().item())) + 1


class BranchOnItem(nn.Module):
    """Longformer's and LED's ``is_global_attn = mask.any().item(); if is_global_attn:``."""

    def forward(self, x):
        anything = (x > 0).any().item()
        if anything:
            return x * 2
        return x


@pytest.mark.parametrize(
    "model_cls,x,code",
    [
        (BranchOnValue, torch.randn(2, 4), "if x.sum() > 0:"),
        (ItemAsShape, torch.tensor([3.0, 1.0]), "return torch.zeros(int(x.max().item())) + 1"),
        (BranchOnItem, torch.randn(2, 4), "if anything:"),
    ],
)
def test_export_failure_is_a_clear_capture_error(model_cls, x, code):
    """The error names the model, the line of its code export stopped at (file, line and the
    code itself, also where torch's message names none) and what to do."""
    with pytest.raises(partitioner.CaptureError) as err:
        capture(model_cls(), (x,))
    message = str(err.value)
    assert model_cls.__name__ in message
    assert "test_capture.py:" in message and f"`{code}`" in message, message
    assert "What to do" in message
    assert "torch.where" in message or "torch.cond" in message, message


def test_plan_reports_capture_error():
    with pytest.raises(partitioner.CaptureError, match="BranchOnValue"):
        partitioner.plan(BranchOnValue(), (torch.randn(2, 4),), mesh_shape=(2,))


class RecordsTorchLogging(nn.Module):
    """Records, while it is exported, which torch loggers would still print an error."""

    def __init__(self, names):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.names, self.loud = names, set()

    def forward(self, x):
        self.loud |= {n for n in self.names if logging.getLogger(n).isEnabledFor(logging.ERROR)}
        return self.lin(x)


def test_capture_silences_every_torch_logger_and_restores_their_levels():
    own = logging.getLogger("torch._partita_test.own_level")  # a level of its own, and a child without one
    own.setLevel(logging.INFO)
    names = ["torch", "torch._dynamo", "torch._partita_test.own_level", "torch._partita_test.own_level.child"]
    before = {n: logging.getLogger(n).level for n in names}
    model = RecordsTorchLogging(names)
    capture(model, (torch.randn(2, 4),))
    assert model.loud == set()
    assert {n: logging.getLogger(n).level for n in names} == before
    assert logging.getLogger("torch._partita_test.own_level.child").isEnabledFor(logging.INFO)


@pytest.mark.parametrize("bad", [42, "input_ids", None])
def test_wrong_example_inputs_type(bad):
    model, _ = models.mlp_demo()
    with pytest.raises(TypeError, match="example_inputs must be a tuple of positional arguments or a dict"):
        capture(model, bad)
    with pytest.raises(TypeError, match=type(bad).__name__):
        partitioner.plan(model, bad)


def test_model_must_be_a_module():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        capture(lambda x: x, (torch.randn(2),))


def test_graph_fingerprint():
    model, inputs = models.mlp_demo(batch=8)
    first = graph_fingerprint(capture(model, inputs))
    again = graph_fingerprint(capture(model, inputs))
    assert first == again
    _, bigger = models.mlp_demo(batch=16)
    assert graph_fingerprint(capture(model, bigger)) != first
    other, other_inputs = models.mlp_demo(batch=8)
    assert graph_fingerprint(capture(other, other_inputs)) == first, "same architecture, same shapes"
    deeper = models.MLP(depth=3)
    assert graph_fingerprint(capture(deeper, inputs)) != first


# -- capture by blocks: two layers exported, the rest repeated in the graph -----------------------
import pytest  # noqa: E402

from passes.capture.capture import graph_fingerprint as _fingerprint  # noqa: E402
from passes.capture.capture_blocks import capture_by_blocks, capture_model  # noqa: E402

_DEEP = {
    "gpt": lambda: models.gpt_demo(batch=4, seq=8, n_layer=4),
    "llama": lambda: models.hf_llama(n_layer=4),
    "gpt2": lambda: models.hf_gpt2(n_layer=4),
    "bert": lambda: models.hf_bert(n_layer=4),
    "vit": lambda: models.hf_vit(n_layer=4),
}


@pytest.mark.parametrize("name", sorted(_DEEP))
def test_block_capture_equals_a_full_export_node_for_node(name):
    model, inputs = _DEEP[name]()
    full = capture(model, inputs)
    fast = capture_by_blocks(model, inputs)
    assert fast is not None
    rows = lambda cap: [(n.name, n.op, str(n.target), str(n.args), str(n.kwargs)) for n in cap.graph.nodes]  # noqa: E731
    assert rows(fast) == rows(full)
    assert fast.params == full.params and fast.buffers == full.buffers
    assert _fingerprint(fast) == _fingerprint(full)
    stacks = lambda cap: [list(n.meta.get("nn_module_stack", {}))[-1:] for n in cap.graph.nodes]  # noqa: E731
    assert stacks(fast) == stacks(full)           # module paths name the right layer


def test_block_capture_needs_identical_layers():
    model, inputs = models.mlp_demo()
    with pytest.raises(ValueError, match="no list of 3 or more identical layers"):
        capture_model(model, inputs, layers="blocks")
    assert capture_model(model, inputs, layers="auto").graph is not None   # small: exported whole
