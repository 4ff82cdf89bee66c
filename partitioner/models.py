"""Embedded models and factories: the demo, the tests and the benchmarks plan these.

* :class:`MLP` and :class:`GPT` are small hand-written models (GPT follows the GPT-2 layout
  with a fused QKV projection and a loss computed inside ``forward``).
* ``hf_*`` build HuggingFace models from configs with random weights (no hub access).
* ``llama_7b_meta`` builds LLaMA-7B shapes on the ``meta`` device: planning needs no memory.

Every factory returns ``(model, example_inputs)``; the CLI takes ``module:factory``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "MLP",
    "GPTConfig",
    "GPT",
    "mlp_demo",
    "gpt_demo",
    "gpt_block",
    "hf_gpt2",
    "hf_bert",
    "hf_llama",
    "hf_vit",
    "llama_7b_meta",
    "llama_meta",
]


class MLP(nn.Module):
    def __init__(self, d_in=32, d_hidden=64, d_out=10, depth=2):
        super().__init__()
        dims = [d_in] + [d_hidden] * depth
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x, target=None):
        for layer in self.layers:
            x = F.gelu(layer(x))
        logits = self.head(x)
        if target is None:
            return logits
        return F.cross_entropy(logits, target)


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True
    attention: str = "sdpa"
    """``"sdpa"``: one fused causal attention op (FlashAttention-style); ``"eager"``: attention as
    it was computed before fused kernels (Megatron-LM 2021, Megatron-DeepSpeed): the scores
    ``q k^T`` of every head materialised by a batched matmul, masked, softmax, dropout, times
    ``v``: the ``heads x seq^2`` scores are written and read by each step and kept for backward."""


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.n_embd = cfg.n_head, cfg.n_embd
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.dropout = cfg.dropout
        if cfg.attention not in ("sdpa", "eager"):
            raise ValueError(f"GPTConfig.attention must be 'sdpa' or 'eager', got {cfg.attention!r}")
        self.eager = cfg.attention == "eager"

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        if self.eager:
            y = self._eager_attention(q, k, v)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
            )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.c_proj(y))

    def _eager_attention(self, q, k, v):
        t = q.shape[-2]
        scores = (q * (1.0 / math.sqrt(q.shape[-1]))) @ k.transpose(-2, -1)
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        probs = F.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        return F.dropout(probs, self.dropout, self.training) @ v


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = nn.ModuleDict(
            dict(
                c_fc=nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias),
                c_proj=nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias),
                dropout=nn.Dropout(cfg.dropout),
            )
        )

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        m = self.mlp
        return x + m.dropout(m.c_proj(F.gelu(m.c_fc(self.ln_2(x)))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _tokens(batch, seq, vocab, device=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return ids.to(device) if device else ids


def mlp_demo(batch=32):
    torch.manual_seed(0)
    model = MLP()
    return model, (torch.randn(batch, 32), torch.randint(0, 10, (batch,)))


def gpt_demo(batch=8, seq=64, **overrides):
    cfg = GPTConfig(block_size=seq, **overrides)
    torch.manual_seed(0)
    model = GPT(cfg)
    ids = _tokens(batch, seq, cfg.vocab_size)
    return model, (ids, torch.roll(ids, -1, dims=1))


def gpt_block(batch=8, seq=128, n_embd=1024, n_head=16, n_layer=1, vocab=1024, device="meta", attention="sdpa"):
    """A GPT at planning scale, on ``meta`` by default (``attention``: :attr:`GPTConfig.attention`)."""
    cfg = GPTConfig(
        vocab_size=vocab, block_size=seq, n_layer=n_layer, n_head=n_head, n_embd=n_embd, attention=attention
    )
    with torch.device(device):
        model = GPT(cfg)
    ids = _tokens(batch, seq, vocab, device)
    return model, (ids, torch.roll(ids, -1, dims=1) if device != "meta" else torch.zeros_like(ids))


def hf_gpt2(batch=2, seq=16, n_layer=2, n_embd=64, n_head=4, vocab=128, attn="sdpa"):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        vocab_size=vocab,
        n_positions=max(64, seq),
        use_cache=False,
        attn_implementation=attn,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    ids = _tokens(batch, seq, vocab)
    return GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids.clone()}


def hf_bert(batch=2, seq=16, n_layer=2, hidden=64, heads=4, vocab=128):
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        num_hidden_layers=n_layer,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_attention_heads=heads,
        vocab_size=vocab,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    ids = _tokens(batch, seq, vocab)
    return BertForMaskedLM(cfg), {
        "input_ids": ids,
        "attention_mask": torch.ones(batch, seq, dtype=torch.long),
        "labels": ids.clone(),
    }


def hf_llama(batch=2, seq=16, n_layer=2, hidden=64, heads=4, kv_heads=2, vocab=128, device=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        num_hidden_layers=n_layer,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 8 * 8 or 8,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=max(64, seq),
        use_cache=False,
    )
    torch.manual_seed(0)
    if device is not None:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    else:
        model = LlamaForCausalLM(cfg)
    ids = _tokens(batch, seq, vocab, device)
    return model, {"input_ids": ids, "labels": ids.clone()}


def hf_vit(batch=2, image=32, patch=8, n_layer=2, hidden=64, heads=4, labels=10):
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(
        num_hidden_layers=n_layer,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_attention_heads=heads,
        image_size=image,
        patch_size=patch,
        num_labels=labels,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    return ViTForImageClassification(cfg), {
        "pixel_values": torch.randn(batch, 3, image, image, generator=g),
        "labels": torch.randint(0, labels, (batch,), generator=g),
    }


def llama_meta(
    n_layer=32,
    hidden=4096,
    heads=32,
    kv_heads=32,
    intermediate=11008,
    vocab=32000,
    batch=8,
    seq=2048,
    dtype=torch.bfloat16,
):
    """LLaMA shapes on ``meta`` (defaults: LLaMA-7B, sequence 2048)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        num_hidden_layers=n_layer,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=seq,
        use_cache=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(dtype)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": torch.zeros_like(ids)}


def llama_7b_meta():
    return llama_meta()
