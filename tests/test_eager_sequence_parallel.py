"""Ring and Ulysses for eager attention (``attn_implementation="eager"``), and cross-attention.

With ``sequence_parallel="ring"`` / ``"ulysses"`` the eager core (``matmul(q, k^T)``, scale, mask,
softmax, casts, dropout that drops nothing, ``matmul(., v)``) is fused into one
``scaled_dot_product_attention`` op (``passes/capture/eager_attention.py``) and runs the same ring /
Ulysses modules. Parity (tier 3, one 4-rank run, the standard of ``tests/test_long_sequence.py``:
loss, every gradient, parameters after 3 AdamW steps, counted communication = estimate = the
formulas, saved bytes = estimate within 1%): HF LLaMA eager (RoPE, grouped-query heads repeated
before the matmul, an additive causal mask) ring on (4,) and Ulysses on (2, 2); HF GPT-2 eager
(learned positions) Ulysses on (4,) and ring on (2, 2); HF BART eager (encoder 16 tokens,
decoder 8) on two 2-rank jobs side by side, ring and Ulysses: its self-attention ops run the
algorithm, its cross-attention (8 queries, 16 keys) is planned with the other candidates (a
priced fallback), exactly.

Single process: what the fusion leaves as ops (attention dropout in training, a learned bias
as the mask, probabilities the model returns) and why; a fused op where the model is in eval
mode; a ``scaled_dot_product_attention`` whose mask needs a gradient gets neither algorithm
(forced: an error naming the mask; ``"auto"``: a plan without them).
"""

from __future__ import annotations

import logging

import pytest
import torch
from long_sequence_utils import check_sequence_results, hf_bart, run_sequence_cases, sequence_case

from partitioner import models

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def test_eager_attention_parity_and_cross_attention_fallback():
    cfgs = [
        sequence_case("llama_eager", "ring", (4,)),
        sequence_case("gpt2_eager", "ulysses", (4,)),
        sequence_case("gpt2_eager", "ring", (2, 2)),
        sequence_case("llama_eager", "ulysses", (2, 2)),
    ]
    bart = [sequence_case("bart_eager", "ring", (2,), ranks=(0, 1)), sequence_case("bart_eager", "ulysses", (2,), ranks=(2, 3))]
    results = run_sequence_cases(cfgs + bart)
    check_sequence_results([dict(r, results=[x for x in r["results"] if "bart" not in x["id"]]) for r in results], cfgs)
    for r in results:
        for res in r["results"]:
            if "bart" not in res["id"]:
                continue
            mode = res["id"].split("-")[1]
            # encoder self-attention (16 x 16), decoder self-attention (8 x 8), cross-attention (8 x 16)
            assert list(res["algos"].values()) == [{"a0": mode}, {"a0": mode}, None], res["algos"]
            per_kind = "send_recv" if mode == "ring" else "all_to_all"
            assert res["counted"]["fwd"][per_kind] > 0 and res["counted"]["bwd"][per_kind] > 0


def _capture(model, inputs):
    from passes.analysis.analyze import analyze
    from passes.capture.capture_blocks import capture_model

    cap = capture_model(model, inputs)
    analyze(cap)
    return cap


class _BiasAttention(torch.nn.Module):
    """Eager attention with a learned bias added to the scores (T5-style), returning what
    ``probabilities`` says: the output, or the output and the probabilities."""

    def __init__(self, probabilities=False, fused=False):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)
        self.bias = torch.nn.Parameter(torch.zeros(1, 2, 8, 8))
        self.probabilities, self.fused = probabilities, fused

    def forward(self, x):
        q, k, v = (t.view(2, 8, 2, 8).transpose(1, 2) for t in self.qkv(x).split(16, dim=-1))
        if self.fused:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.bias).sum()
        bias = self.bias if not self.probabilities else self.bias.detach()
        p = torch.softmax(q @ k.transpose(-2, -1) * 8**-0.5 + bias, dim=-1)
        out = (p @ v).sum()
        return (out, p) if self.probabilities else out


def test_what_the_fusion_leaves_as_ops(caplog):
    from passes.capture.eager_attention import fuse_eager_attention

    model, inputs = models.hf_llama(batch=2, seq=16, kv_heads=2)
    model.set_attn_implementation("eager")
    cap = _capture(model, inputs)
    fused = fuse_eager_attention(cap)
    assert len(fused) == 2
    nodes = [n for n in cap.graph.nodes if n.target is SDPA]
    assert [n.kwargs["scale"] for n in nodes] == [0.25, 0.25]  # 1 / sqrt(head_dim 16), from the mul
    assert not any("softmax" in str(n.target) for n in cap.graph.nodes)
    assert all(len(n.args) == 4 for n in nodes)  # q, k, v and the additive causal mask

    model, inputs = models.hf_gpt2(batch=2, seq=16, attn="eager")
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.1
    with caplog.at_level(logging.INFO, logger="passes.capture.eager_attention"):
        assert fuse_eager_attention(_capture(model, inputs)) == []
    assert "it has attention dropout" in caplog.text and "stays as ops" in caplog.text
    model.eval()  # no dropout in eval mode: fused
    assert len(fuse_eager_attention(_capture(model, inputs))) == 2

    x = torch.randn(2, 8, 16)
    for probabilities, reason in ((False, "learned bias"), (True, "also read outside the attention core")):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="passes.capture.eager_attention"):
            assert fuse_eager_attention(_capture(_BiasAttention(probabilities), (x,))) == []
        assert reason in caplog.text, caplog.text


def test_a_mask_that_needs_a_gradient_gets_neither_algorithm():
    import partitioner

    model, x = _BiasAttention(fused=True), (torch.randn(2, 8, 16),)
    for mode in ("ring", "ulysses"):
        reason = rf"sequence_parallel='{mode}'.*mask bias needs a gradient.*try sequence_parallel='auto', or"
        with pytest.raises(ValueError, match=reason):
            partitioner.plan(model, x, mesh_shape=(2,), cluster="h100", sequence_parallel=mode)
    plan = partitioner.plan(model, x, mesh_shape=(2,), cluster="h100")
    assert not any(r.get("notes") for r in plan.records if "scaled_dot_product_attention" in r["name"])


def test_bart_cross_attention_is_planned_without_the_algorithm():
    import partitioner

    model, inputs = hf_bart()
    plan = partitioner.plan(model, inputs, mesh_shape=(2,), cluster="h100", sequence_parallel="ring")
    attention = [r for r in plan.records if "scaled_dot_product_attention" in r["name"]]
    assert [r["shapes"][0][2] for r in attention] == [16, 8, 8]
    assert [r.get("notes") for r in attention] == [{"a0": "ring"}, {"a0": "ring"}, None]
