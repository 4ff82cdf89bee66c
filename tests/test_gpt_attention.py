"""The embedded GPT's two attention forms compute the same thing; the eager one is priced as its
unfused passes over the ``heads x seq^2`` scores (what the published Megatron and BLOOM rows run)."""

import pytest
import torch

from partitioner import models
from partitioner.parallel_config import ParallelConfig
from partitioner.search import plan_config


def test_eager_attention_matches_the_fused_op_in_loss_and_every_gradient():
    torch.manual_seed(0)
    fused = models.GPT(models.GPTConfig(attention="sdpa"))
    eager = models.GPT(models.GPTConfig(attention="eager"))
    eager.load_state_dict(fused.state_dict())
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    losses = [m(ids, torch.roll(ids, -1, dims=1)) for m in (fused, eager)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[0], losses[1])
    for (name, p), (_, q) in zip(fused.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_an_unknown_attention_form_is_refused_by_name():
    with pytest.raises(ValueError, match="GPTConfig.attention"):
        models.GPT(models.GPTConfig(attention="flash"))


def test_eager_attention_costs_its_score_passes_on_a100():
    """On the a100 preset (bf16, one device) each of the eager form's elementwise steps over the
    scores (mask, softmax, dropout) is one memory-bound pass, reading and writing ``b h s^2`` bf16
    elements at 2.0 TB/s, in forward and again in backward (the mask also reads its ``s^2`` booleans
    both ways)."""
    b, s, h, heads = 2, 1024, 512, 8
    model, inputs = models.gpt_block(batch=b, seq=s, n_embd=h, n_head=heads, n_layer=1, vocab=512, attention="eager")
    plan = plan_config(model, inputs, ParallelConfig(data=1), cluster="a100", precision="bf16", optimizer="adam")
    scores = {r.target: r for r in plan.node_records if r.shapes and r.shapes[0] == [b, heads, s, s]}
    read_write = 2 * (2 * b * heads * s * s) / 2.0e12
    mask_read = s * s / 2.0e12
    assert scores["aten.masked_fill.Scalar"].compute_s == pytest.approx(2 * (read_write + mask_read))
    for op in ("aten.softmax.int", "aten.dropout"):
        assert scores[op].forward_s == pytest.approx(read_write), op
        assert scores[op].compute_s == pytest.approx(2 * read_write), op
    assert not any(r.target == "aten.scaled_dot_product_attention" for r in plan.node_records)
