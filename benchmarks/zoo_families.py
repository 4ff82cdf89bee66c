"""Held-out HuggingFace families: ones the suite's own list (``partitioner.hf_families``) does not hold.

Each entry is ``(config class, model class, size overrides, kind)``, the shape of
``hf_families.FAMILIES``, built by ``hf_families.build(name, spec=ZOO[name])``: the family's
default configuration with only the sizes shrunk (2 layers, width 64, 4 heads, vocabulary 128,
images 32 x 32), random weights, dropout 0. ``kind`` is the inputs' kind (``causal``: token ids
and labels; ``masked``: ids, an attention mask and labels; ``seq2seq``: ids and labels, the model
shifting them into decoder inputs; ``image``: pixels and class labels).

:data:`RECURRENT` lists the recurrent and hybrid decoders (state-space scans, RWKV, linear
recurrences): the zoo runs them too, and reports what becomes of them.
"""

from __future__ import annotations

# the usual transformer sizes, under the names most configs use
S = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4)
KV = dict(S, num_key_value_heads=2)
IDS = dict(pad_token_id=0, bos_token_id=0, eos_token_id=0)
IMAGE = dict(image_size=32, num_labels=10)
# encoder-decoders in BART's naming
BART_LIKE = dict(
    encoder_layers=2,
    decoder_layers=2,
    d_model=64,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=128,
    decoder_ffn_dim=128,
    max_position_embeddings=64,
    pad_token_id=1,
    bos_token_id=0,
    eos_token_id=2,
    decoder_start_token_id=2,
)
# two-stage hierarchical vision transformers (SegFormer's naming)
STAGES = dict(
    IMAGE,
    num_encoder_blocks=2,
    depths=[1, 1],
    sr_ratios=[2, 1],
    hidden_sizes=[16, 32],
    num_attention_heads=[1, 2],
    patch_sizes=[7, 3],
    strides=[4, 2],
)
T5_LIKE = dict(num_layers=2, d_model=64, d_ff=128, num_heads=4, d_kv=16, decoder_start_token_id=0)

DECODERS = {
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(KV, **IDS), "causal"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(KV, head_dim=16, **IDS), "causal"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(KV, head_dim=16, sliding_window=8, **IDS), "causal"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(KV, head_dim=16), "causal"),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(KV, bos_token_id=0, eos_token_id=0), "causal"),
    "gpt_bigcode": (
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        dict(n_layer=2, n_embd=64, n_head=4, bos_token_id=0, eos_token_id=0),
        "causal",
    ),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", dict(KV, **IDS), "causal"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(KV, **IDS), "causal"),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(KV, bos_token_id=0, eos_token_id=0), "causal"),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(KV, **IDS), "causal"),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(KV, **IDS), "causal"),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(KV, sliding_window=8, **IDS), "causal"),
    "gpt_neo": (
        "GPTNeoConfig",
        "GPTNeoForCausalLM",
        dict(
            num_layers=2,
            hidden_size=64,
            num_heads=4,
            attention_types=[[["global", "local"], 1]],
            window_size=8,
            bos_token_id=0,
            eos_token_id=0,
        ),
        "causal",
    ),
    "mpt": (
        "MptConfig",
        "MptForCausalLM",
        dict(n_layers=2, d_model=64, n_heads=4, expansion_ratio=2, max_seq_len=64),
        "causal",
    ),
    "persimmon": ("PersimmonConfig", "PersimmonForCausalLM", dict(S, **IDS), "causal"),
    "codegen": (
        "CodeGenConfig",
        "CodeGenForCausalLM",
        dict(n_layer=2, n_embd=64, n_head=4, rotary_dim=8, n_positions=64, bos_token_id=0, eos_token_id=0),
        "causal",
    ),
    "xglm": (
        "XGLMConfig",
        "XGLMForCausalLM",
        dict(num_layers=2, d_model=64, ffn_dim=128, attention_heads=4, max_position_embeddings=64, **IDS),
        "causal",
    ),
    "biogpt": ("BioGptConfig", "BioGptForCausalLM", dict(S, max_position_embeddings=64, **IDS), "causal"),
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", dict(KV, **IDS), "causal"),
    "glm": ("GlmConfig", "GlmForCausalLM", dict(KV, head_dim=16, **IDS), "causal"),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(KV, head_dim=16, **IDS), "causal"),
    "helium": ("HeliumConfig", "HeliumForCausalLM", dict(KV, head_dim=16, **IDS), "causal"),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", dict(KV, sliding_window=8, **IDS), "causal"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(KV, **IDS), "causal"),
    "ministral": ("MinistralConfig", "MinistralForCausalLM", dict(KV, head_dim=16, sliding_window=8, **IDS), "causal"),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", dict(KV, head_dim=16, **IDS), "causal"),
    "arcee": ("ArceeConfig", "ArceeForCausalLM", dict(KV, **IDS), "causal"),
    "apertus": ("ApertusConfig", "ApertusForCausalLM", dict(KV, **IDS), "causal"),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(KV, sliding_window=8, **IDS), "causal"),
    "vaultgemma": ("VaultGemmaConfig", "VaultGemmaForCausalLM", dict(KV, head_dim=16, **IDS), "causal"),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(KV, **IDS), "causal"),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", dict(KV, head_dim=16, **IDS), "causal"),
    "openai_gpt": (
        "OpenAIGPTConfig",
        "OpenAIGPTLMHeadModel",
        dict(n_layer=2, n_embd=64, n_head=4, n_positions=64),
        "causal",
    ),
    "ctrl": ("CTRLConfig", "CTRLLMHeadModel", dict(n_layer=2, n_embd=64, n_head=4, dff=128, n_positions=64), "causal"),
    "xlnet": ("XLNetConfig", "XLNetLMHeadModel", dict(n_layer=2, d_model=64, n_head=4, d_inner=128), "causal"),
}
RECURRENT = {
    "mamba": ("MambaConfig", "MambaForCausalLM", dict(num_hidden_layers=2, hidden_size=64, state_size=8), "causal"),
    "falcon_mamba": (
        "FalconMambaConfig",
        "FalconMambaForCausalLM",
        dict(num_hidden_layers=2, hidden_size=64, state_size=8),
        "causal",
    ),
    "mamba2": (
        "Mamba2Config",
        "Mamba2ForCausalLM",
        dict(num_hidden_layers=2, hidden_size=64, state_size=8, num_heads=8, head_dim=16, n_groups=1, chunk_size=8),
        "causal",
    ),
    "rwkv": ("RwkvConfig", "RwkvForCausalLM", dict(num_hidden_layers=2, hidden_size=64, context_length=64), "causal"),
    "recurrent_gemma": (
        "RecurrentGemmaConfig",
        "RecurrentGemmaForCausalLM",
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=1,
            lru_width=64,
            attention_window_size=8,
            block_types=["recurrent", "attention"],
            **IDS,
        ),
        "causal",
    ),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(KV, layer_types=["conv", "full_attention"], **IDS), "causal"),
    "bamba": (
        "BambaConfig",
        "BambaForCausalLM",
        dict(KV, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8, **IDS),
        "causal",
    ),
}
ENCODERS = {
    "electra": ("ElectraConfig", "ElectraForMaskedLM", dict(S, embedding_size=32), "masked"),
    "albert": ("AlbertConfig", "AlbertForMaskedLM", dict(S, embedding_size=32, **IDS), "masked"),
    "deberta": ("DebertaConfig", "DebertaForMaskedLM", dict(S), "masked"),
    "deberta_v2": ("DebertaV2Config", "DebertaV2ForMaskedLM", dict(S), "masked"),
    "xlm_roberta": ("XLMRobertaConfig", "XLMRobertaForMaskedLM", dict(S), "masked"),
    "camembert": ("CamembertConfig", "CamembertForMaskedLM", dict(S), "masked"),
    "mpnet": ("MPNetConfig", "MPNetForMaskedLM", dict(S), "masked"),
    "funnel": (
        "FunnelConfig",
        "FunnelForMaskedLM",
        dict(block_sizes=[1, 1], d_model=64, n_head=4, d_head=16, d_inner=128),
        "masked",
    ),
    "megatron_bert": ("MegatronBertConfig", "MegatronBertForMaskedLM", dict(S), "masked"),
    "ernie": ("ErnieConfig", "ErnieForMaskedLM", dict(S), "masked"),
    "rembert": (
        "RemBertConfig",
        "RemBertForMaskedLM",
        dict(S, input_embedding_size=32, output_embedding_size=32),
        "masked",
    ),
    "roformer": ("RoFormerConfig", "RoFormerForMaskedLM", dict(S, embedding_size=64), "masked"),
    "squeezebert": ("SqueezeBertConfig", "SqueezeBertForMaskedLM", dict(S, embedding_size=64), "masked"),
    "convbert": ("ConvBertConfig", "ConvBertForMaskedLM", dict(S, embedding_size=64), "masked"),
    "nystromformer": ("NystromformerConfig", "NystromformerForMaskedLM", dict(S, num_landmarks=4), "masked"),
    "data2vec_text": ("Data2VecTextConfig", "Data2VecTextForMaskedLM", dict(S), "masked"),
    "modernbert": (
        "ModernBertConfig",
        "ModernBertForMaskedLM",
        dict(S, local_attention=8, global_attn_every_n_layers=2, **IDS),
        "masked",
    ),
    "esm": ("EsmConfig", "EsmForMaskedLM", dict(S, pad_token_id=1, mask_token_id=3), "masked"),
    "big_bird": ("BigBirdConfig", "BigBirdForMaskedLM", dict(S, attention_type="original_full"), "masked"),
    "mra": ("MraConfig", "MraForMaskedLM", dict(S), "masked"),
    "ibert": ("IBertConfig", "IBertForMaskedLM", dict(S), "masked"),
    "mobilebert": (
        "MobileBertConfig",
        "MobileBertForMaskedLM",
        dict(S, embedding_size=32, intra_bottleneck_size=32, num_feedforward_networks=1),
        "masked",
    ),
    "fnet": ("FNetConfig", "FNetForMaskedLM", dict(S), "masked"),
    "longformer": ("LongformerConfig", "LongformerForMaskedLM", dict(S, attention_window=8), "masked"),
}
ENCODER_DECODERS = {
    "mt5": ("MT5Config", "MT5ForConditionalGeneration", T5_LIKE, "seq2seq"),
    "umt5": ("UMT5Config", "UMT5ForConditionalGeneration", T5_LIKE, "seq2seq"),
    "longt5": ("LongT5Config", "LongT5ForConditionalGeneration", dict(T5_LIKE, local_radius=4), "seq2seq"),
    "pegasus": ("PegasusConfig", "PegasusForConditionalGeneration", BART_LIKE, "seq2seq"),
    "marian": ("MarianConfig", "MarianMTModel", dict(BART_LIKE, decoder_vocab_size=128), "seq2seq"),
    "mbart": ("MBartConfig", "MBartForConditionalGeneration", BART_LIKE, "seq2seq"),
    "blenderbot": ("BlenderbotConfig", "BlenderbotForConditionalGeneration", BART_LIKE, "seq2seq"),
    "blenderbot_small": ("BlenderbotSmallConfig", "BlenderbotSmallForConditionalGeneration", BART_LIKE, "seq2seq"),
    "plbart": ("PLBartConfig", "PLBartForConditionalGeneration", BART_LIKE, "seq2seq"),
    "m2m_100": ("M2M100Config", "M2M100ForConditionalGeneration", BART_LIKE, "seq2seq"),
    "led": (
        "LEDConfig",
        "LEDForConditionalGeneration",
        dict(BART_LIKE, max_encoder_position_embeddings=64, max_decoder_position_embeddings=64, attention_window=8),
        "seq2seq",
    ),
}
VISION = {
    "swin": (
        "SwinConfig",
        "SwinForImageClassification",
        dict(IMAGE, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4),
        "image",
    ),
    "swinv2": (
        "Swinv2Config",
        "Swinv2ForImageClassification",
        dict(IMAGE, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4),
        "image",
    ),
    "deit": (
        "DeiTConfig",
        "DeiTForImageClassification",
        dict(S, patch_size=8, **IMAGE),
        "image",
    ),
    "dinov2": ("Dinov2Config", "Dinov2ForImageClassification", dict(S, patch_size=8, **IMAGE), "image"),
    "vit_msn": ("ViTMSNConfig", "ViTMSNForImageClassification", dict(S, patch_size=8, **IMAGE), "image"),
    "ijepa": ("IJepaConfig", "IJepaForImageClassification", dict(S, patch_size=8, **IMAGE), "image"),
    "data2vec_vision": (
        "Data2VecVisionConfig",
        "Data2VecVisionForImageClassification",
        dict(S, patch_size=8, **IMAGE),
        "image",
    ),
    "resnet": (
        "ResNetConfig",
        "ResNetForImageClassification",
        # GroupNorm's groups must divide every width (the bottlenecks' are a quarter: 4 and 8)
        dict(IMAGE, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_groups=4),
        "image",
    ),
    "regnet": (
        "RegNetConfig",
        "RegNetForImageClassification",
        dict(IMAGE, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], groups_width=8),
        "image",
    ),
    "convnext": (
        "ConvNextConfig",
        "ConvNextForImageClassification",
        dict(IMAGE, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2),
        "image",
    ),
    "convnextv2": (
        "ConvNextV2Config",
        "ConvNextV2ForImageClassification",
        dict(IMAGE, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2),
        "image",
    ),
    "bit": (
        "BitConfig",
        "BitForImageClassification",
        # GroupNorm's groups must divide every width (the bottlenecks' are a quarter: 4 and 8)
        dict(IMAGE, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_groups=4),
        "image",
    ),
    "poolformer": (
        "PoolFormerConfig",
        "PoolFormerForImageClassification",
        dict(
            IMAGE,
            num_encoder_blocks=2,
            depths=[1, 1],
            hidden_sizes=[16, 32],
            patch_sizes=[7, 3],
            strides=[4, 2],
            padding=[2, 1],
        ),
        "image",
    ),
    "segformer": (
        "SegformerConfig",
        "SegformerForImageClassification",
        STAGES,
        "image",
    ),
    "pvt_v2": (
        "PvtV2Config",
        "PvtV2ForImageClassification",
        dict(STAGES, mlp_ratios=[2, 2]),
        "image",
    ),
    "mobilevit": (
        "MobileViTConfig",
        "MobileViTForImageClassification",
        dict(IMAGE, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64], num_attention_heads=2),
        "image",
    ),
    "levit": (
        "LevitConfig",
        "LevitForImageClassification",
        dict(
            IMAGE,
            image_size=64,
            hidden_sizes=[32, 48, 64],
            num_attention_heads=[2, 2, 2],
            depths=[1, 1, 1],
            key_dim=[8, 8, 8],
        ),
        "image",
    ),
    "cvt": (
        "CvtConfig",
        "CvtForImageClassification",
        # stage i reads its layers' drop-path list at index i (HF's CvtStage), so stage i needs i + 1 layers
        dict(IMAGE, embed_dim=[16, 32, 48], num_heads=[1, 2, 2], depth=[1, 2, 3]),
        "image",
    ),
    "focalnet": (
        "FocalNetConfig",
        "FocalNetForImageClassification",
        dict(IMAGE, embed_dim=16, depths=[1, 1], hidden_sizes=[16, 32], patch_size=4),
        "image",
    ),
    "efficientnet": (
        "EfficientNetConfig",
        "EfficientNetForImageClassification",
        dict(IMAGE, width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320),
        "image",
    ),
    "mobilenet_v2": (
        "MobileNetV2Config",
        "MobileNetV2ForImageClassification",
        dict(IMAGE, depth_multiplier=0.25),
        "image",
    ),
}
# decoders whose layers are not one repeated block (recurrent and attention layers mixed, RWKV's
# first block with its own norm): pipeline stages are cut at repeated layers, so the pipeline is
# refused for them (a clear ValueError); the zoo runs them without it
UNPIPELINED = ("rwkv", "recurrent_gemma", "lfm2", "bamba")
ZOO = {**DECODERS, **RECURRENT, **ENCODERS, **ENCODER_DECODERS, **VISION}
