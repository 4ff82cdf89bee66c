"""HuggingFace model families as users build them: default configurations, small sizes.

Each factory builds one family's usual training head from its *default* config (``use_cache``
on, the family's own attention implementation, positional scheme and tied weights) with only
the sizes shrunk (layers, width, heads, vocabulary), random weights, and example inputs with
labels. ``dropout=None`` keeps the config's own dropout probabilities; a number sets every
dropout probability the config has (``0.0`` for exact single-device parity).

Families cover the four shapes of model users bring: decoder-only (GPT-2, LLaMA, Mistral,
Qwen2, Falcon, BLOOM with ALiBi, GPT-J, GPT-NeoX, OPT, Phi, Gemma), encoder-only (BERT,
RoBERTa, DistilBERT), encoder-decoder (BART, T5) and vision (ViT; BEiT with its layer
scales, mean pooling and stochastic depth; DeiT with its distillation head, trained by
:class:`HardDistillation`). :data:`MOE_FAMILIES` adds mixtures of experts (Mixtral, Qwen3-MoE,
OLMoE, DeepSeek-V3 with its latent attention and shared expert), router auxiliary loss on.

Parameters a family initialises to zero that a trained checkpoint holds as ordinary values
(DeiT's class and distillation tokens and position embeddings) start from small random values
instead, as ViT's do. At zero, tokens 0 and 1 enter the first LayerNorm as zero-variance
vectors, whose backward multiplies by ``1 / sqrt(eps)`` (``1e6`` at DeiT's ``eps = 1e-12``):
their gradients (about ``4e3`` at these sizes) then carry fp32 roundoff of ``2e-3``, so that
one device summing the batch in two halves (what a data-parallel plan does) differs from one
device summing it whole by as much.

Example::

    model, inputs = partitioner.hf_families.build("falcon", batch=4, seq=16)
    plan = partitioner.plan(model, inputs, mesh_shape=(2, 2), cluster="h100")
"""

from __future__ import annotations

import torch

__all__ = ["FAMILIES", "MOE_FAMILIES", "DECODER_ONLY", "HardDistillation", "build"]

VOCAB = 128
_DROPOUT_KEYS = (
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "hidden_dropout",
    "attention_dropout",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "dropout",
    "activation_dropout",
    "classifier_dropout",
    "dropout_rate",
    "qa_dropout",
    "seq_classif_dropout",
    "resid_dropout",
    "embed_dropout",
    "summary_first_dropout",
    "drop_path_rate",  # stochastic depth (BEiT, Swin): whole residual branches dropped at random
)

# any other config key ending so is a dropout probability too (SeedOss's ``residual_dropout``)
_DROPOUT_ENDINGS = ("dropout", "_pdrop", "dropout_prob", "dropout_rate", "drop_rate")

_VISION_SIZES = dict(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    image_size=32,
    patch_size=8,
    num_labels=10,
)

# family -> (config class, model class, size overrides, kind of inputs)
FAMILIES = {
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(n_layer=2, n_embd=64, n_head=4, bos_token_id=0, eos_token_id=0),
        "causal",
    ),
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
        "causal",
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
        "causal",
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
        "causal",
    ),
    "falcon": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, bos_token_id=0, eos_token_id=0),
        "causal",
    ),
    "bloom": (
        "BloomConfig",
        "BloomForCausalLM",
        dict(n_layer=2, hidden_size=64, n_head=4, bos_token_id=0, eos_token_id=0),
        "causal",
    ),
    "gptj": (
        "GPTJConfig",
        "GPTJForCausalLM",
        dict(n_layer=2, n_embd=64, n_head=4, rotary_dim=8, n_positions=64, bos_token_id=0, eos_token_id=0),
        "causal",
    ),
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            bos_token_id=0,
            eos_token_id=0,
        ),
        "causal",
    ),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            ffn_dim=128,
            num_attention_heads=4,
            word_embed_proj_dim=64,
            max_position_embeddings=64,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=1,
        ),
        "causal",
    ),
    "phi": (
        "PhiConfig",
        "PhiForCausalLM",
        dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4),
        "causal",
    ),
    "gemma": (
        "GemmaConfig",
        "GemmaForCausalLM",
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=1,
        ),
        "causal",
    ),
    "bert": (
        "BertConfig",
        "BertForMaskedLM",
        dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4),
        "masked",
    ),
    "roberta": (
        "RobertaConfig",
        "RobertaForMaskedLM",
        dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4),
        "masked",
    ),
    "distilbert": (
        "DistilBertConfig",
        "DistilBertForMaskedLM",
        dict(n_layers=2, dim=64, hidden_dim=128, n_heads=4),
        "masked",
    ),
    "bart": (
        "BartConfig",
        "BartForConditionalGeneration",
        dict(
            encoder_layers=2,
            decoder_layers=2,
            d_model=64,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            max_position_embeddings=64,
        ),
        "seq2seq",
    ),
    "t5": (
        "T5Config",
        "T5ForConditionalGeneration",
        dict(num_layers=2, d_model=64, d_ff=128, num_heads=4, d_kv=16, decoder_start_token_id=0),
        "seq2seq",
    ),
    "vit": ("ViTConfig", "ViTForImageClassification", _VISION_SIZES, "image"),
    "beit": ("BeitConfig", "BeitForImageClassification", _VISION_SIZES, "image"),
    "deit_distilled": ("DeiTConfig", "DeiTForImageClassificationWithTeacher", _VISION_SIZES, "image_distillation"),
}
# mixture-of-experts families (docs/moe.md): 4 experts, top-2, the router's auxiliary loss on
# (output_router_logits); kept apart from FAMILIES, whose test trains every family
_MOE_SIZES = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_experts_per_tok=2)
MOE_FAMILIES = {
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(_MOE_SIZES, intermediate_size=64, num_key_value_heads=2, num_local_experts=4, output_router_logits=True),
        "causal",
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            _MOE_SIZES,
            intermediate_size=64,
            moe_intermediate_size=32,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            output_router_logits=True,
        ),
        "causal",
    ),
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(
            _MOE_SIZES,
            intermediate_size=32,
            num_key_value_heads=4,
            num_experts=4,
            output_router_logits=True,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=1,
        ),
        "causal",
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            _MOE_SIZES,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_key_value_heads=4,
            n_routed_experts=4,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            n_shared_experts=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        ),
        "causal",
    ),
}
# family -> names of parameters its init leaves at zero that start random here (module docstring)
# (``deit``: DeiT's single-head classifier, a held-out family of benchmarks/family_zoo.py)
_ZERO_INITIALISED = {
    "deit_distilled": ("cls_token", "distillation_token", "position_embeddings"),
    "deit": ("cls_token", "position_embeddings"),
}
DECODER_ONLY = tuple(name for name, (*_, kind) in FAMILIES.items() if kind == "causal")


class HardDistillation(torch.nn.Module):
    """DeiT's training objective for a model with a class-token and a distillation-token head
    (``DeiTForImageClassificationWithTeacher``, which has no loss of its own): the class head
    learns the labels, the distillation head the teacher's predicted labels, weighted equally.
    Returns the loss."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values, labels, teacher_labels):
        out = self.model(pixel_values=pixel_values)
        cross_entropy = torch.nn.functional.cross_entropy
        return (cross_entropy(out.cls_logits, labels) + cross_entropy(out.distillation_logits, teacher_labels)) / 2


def _randomise_zero_initialised(family: str, model: torch.nn.Module, std: float, seed: int) -> None:
    names = _ZERO_INITIALISED.get(family, ())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rpartition(".")[2] in names:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def build(
    family: str,
    *,
    batch: int = 4,
    seq: int = 16,
    dropout: float | None = 0.0,
    n_layer: int | None = None,
    seed: int = 0,
    spec: tuple | None = None,
):
    """``(model, example_inputs)`` for ``family`` (a key of :data:`FAMILIES`), in train mode.

    ``spec``: ``(config class, model class, size overrides, kind)`` of a family that is not one of
    these (the held-out families of ``benchmarks/family_zoo.py``), built the same way."""
    import transformers

    families = {**FAMILIES, **MOE_FAMILIES}
    if spec is None and family not in families:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(families)}")
    config_name, model_name, sizes, kind = spec or families[family]
    config_cls = getattr(transformers, config_name)
    overrides: dict[str, object] = dict(sizes)  # sizes, the vocabulary, layers and dropout
    if not kind.startswith("image"):
        overrides["vocab_size"] = VOCAB
    if n_layer is not None:
        for key in ("n_layer", "num_hidden_layers", "n_layers", "num_layers", "encoder_layers", "decoder_layers"):
            if key in overrides:
                overrides[key] = n_layer
    defaults = config_cls()
    if dropout is not None:
        keys = set(_DROPOUT_KEYS) | {key for key in vars(defaults) if key.endswith(_DROPOUT_ENDINGS)}
        for key in sorted(keys):
            value = getattr(defaults, key, None)
            if isinstance(value, float):
                overrides[key] = dropout
            elif isinstance(value, (list, tuple)) and value and all(isinstance(v, float) for v in value):
                given = overrides.get(key, value)  # one per stage (CvT's lists), as many as the sizes give
                overrides[key] = [dropout] * (len(given) if isinstance(given, (list, tuple)) else len(value))
    config = config_cls(**overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    if family in _ZERO_INITIALISED:
        _randomise_zero_initialised(family, model, config.initializer_range, seed)
    model.train()
    g = torch.Generator().manual_seed(seed)
    if kind in ("image", "image_distillation"):
        side = config.image_size  # a number, or (height, width) (PVTv2's config keeps a pair)
        pixels = torch.randn(batch, 3, *(side if isinstance(side, (list, tuple)) else (side, side)), generator=g)
        inputs = {"pixel_values": pixels, "labels": torch.randint(0, config.num_labels, (batch,), generator=g)}
        if kind == "image":
            return model, inputs
        inputs["teacher_labels"] = torch.randint(0, config.num_labels, (batch,), generator=g)
        return HardDistillation(model), inputs
    ids = torch.randint(2, VOCAB, (batch, seq), generator=g)
    if kind == "masked":
        return model, {
            "input_ids": ids,
            "attention_mask": torch.ones(batch, seq, dtype=torch.long),
            "labels": ids.clone(),
        }
    return model, {"input_ids": ids, "labels": ids.clone()}
