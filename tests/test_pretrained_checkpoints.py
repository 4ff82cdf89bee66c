"""HuggingFace checkpoints in and out: ``checkpoint=`` an HF directory, ``save_pretrained``.

Three tiny HF models (LLaMA with tied embeddings, Qwen3 saved in bf16, GPT-2 with its tied
head), each written by ``save_pretrained(max_shard_size=...)`` into several safetensors files,
are built on ``meta`` and loaded on 4 gloo ranks, each on one layout: LLaMA on a (2, 2) mesh
(data x Megatron), Qwen3 on (4,) (Megatron, vocabulary-parallel) and GPT-2 as a 2-stage pipeline over (2, 2). Each
must equal the model ``from_pretrained`` loads: loss and every gradient; each rank reads no more
than 1.2x the bytes it holds (counted by the reader, compared with the shards the module holds).
Then each is trained 3 AdamW steps beside the reference, written with ``save_pretrained`` and
loaded back by ``AutoModelForCausalLM.from_pretrained`` strictly (no missing or unexpected
keys) with parameters equal to the parallel model's and logits equal to the reference's.
One forked rank group serves the three models.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

import partitioner.parallelize  # noqa: F401  (imported before forking: see tests/parity_utils.py)
from partitioner.state_names import tied_names
from partitioner.weights import WeightSource
from passes.core.placements import Replicate
from runtime.launch import run_on_ranks
from tests.parity_utils import Checks, check_grads_by_alias, pins_for

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

SHARD = "40KB"
STEPS = 3


def _configs() -> dict:
    common = dict(vocab_size=128, use_cache=False)
    small = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4)
    return {
        "llama": transformers.LlamaConfig(
            **common, **small, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True
        ),
        "qwen3": transformers.Qwen3Config(**common, **small, num_key_value_heads=4, head_dim=16),
        "gpt2": transformers.GPT2Config(
            **common, n_layer=2, n_embd=64, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        ),
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """model name -> an HF directory written by save_pretrained into several files."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for i, (name, config) in enumerate(_configs().items()):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(config)
        if name == "qwen3":
            model = model.to(torch.bfloat16)  # a bf16 checkpoint, loaded into fp32 weights
        model.save_pretrained(root / name, max_shard_size=SHARD)
        out[name] = str(root / name)
    return out


def _layout(name: str) -> dict:
    if name == "llama":  # data parallel x Megatron, the LLaMA parity pins
        return dict(mesh=(2, 2), pins=pins_for("llama", "dp_tp", (2, 2)))
    if name == "qwen3":  # Megatron with a vocabulary-parallel embedding and head (same module names)
        return dict(mesh=(4,), pins=pins_for("llama", "tp", (4,)))
    return dict(mesh=(2, 2), pipeline={"degree": 2, "schedule": "1f1b", "microbatches": 2})


def _inputs():
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(7))
    return {"input_ids": ids, "labels": ids.clone()}


def _held_bytes(pm, itemsize: int) -> int:
    """The elements this rank holds (parameters, persistent buffers), at the checkpoint's itemsize."""
    tensors = {id(t): t for t, _ in pm.state_layouts().values()}
    skip = {id(pm.state_layouts()[f][0]) for f in getattr(pm, "_non_persistent", ()) if f in pm.state_layouts()}
    return sum(t.numel() * itemsize for key, t in tensors.items() if key not in skip)


def _one_model(rank, name, directory, out_dir):
    import partitioner

    inputs = _inputs()
    config = transformers.AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    pm = partitioner.auto_parallelize(model, inputs, cluster="h100", checkpoint=directory, **_layout(name))
    itemsize = 2 if name == "qwen3" else 4
    found = {"read": pm.checkpoint_bytes_read, "held": _held_bytes(pm, itemsize)}
    pipelined = hasattr(pm, "train_step")
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-3)
    for step in range(STEPS):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = pm.train_step(inputs) if pipelined else pm(**inputs).loss
        if not pipelined:
            loss.backward()
        ref_loss = ref(**inputs).loss
        ref_loss.backward()
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), msg=f"{name} loss, step {step}")
        if step == 0:  # every gradient, a tied one under any of its names
            checks = Checks(rank)
            check_grads_by_alias(pm.full_grads(), ref, checks)
            assert not checks.failures, "\n".join(checks.failures)
        opt.step()
        ref_opt.step()
    pm.save_pretrained(out_dir, max_shard_size=SHARD)
    if name == "llama":  # a Partita checkpoint, for `partitioner convert` (the parent converts it)
        partitioner.save_checkpoint(f"{out_dir}-dcp", pm, opt)
    state = {k: v.clone() for k, v in pm.full_state_dict().items()}  # a collective (replicated: the live tensors)
    if name == "llama":  # the source directory converted to a Partita checkpoint loads back
        partitioner.load_checkpoint(f"{directory}-dcp", pm)
        converted = pm.full_state_dict()  # a collective
        found["converted"] = {k: v.clone() for k, v in converted.items()} if rank == 0 else None
    if rank == 0:
        found["state"] = state
        with torch.no_grad():
            found["ref_logits"] = ref(**inputs).logits.clone()
    return found


def _work(rank, world, checkpoints, out_root):
    return {name: _one_model(rank, name, directory, f"{out_root}/{name}") for name, directory in checkpoints.items()}


def test_hf_directories_load_into_shards_and_save_back(checkpoints, tmp_path):
    from partitioner.__main__ import main

    assert main(["convert", "-q", checkpoints["llama"], checkpoints["llama"] + "-dcp"]) == 0
    results = run_on_ranks(_work, 4, checkpoints, str(tmp_path), timeout_s=600)
    _check_conversions(results[0]["llama"], checkpoints["llama"], tmp_path)
    for name, directory in checkpoints.items():
        total = json.loads((Path(directory) / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
        for rank, found in enumerate(r[name] for r in results):  # a shard, not the checkpoint
            assert found["read"] <= 1.2 * found["held"], (name, rank, found["read"], found["held"])
            assert found["read"] < 0.75 * total, (name, rank, found["read"], total)
        saved = tmp_path / name
        index = json.loads((saved / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1, f"{name}: one file only"
        model, info = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], (name, info)
        assert not any("inv_freq" in k for k in index["weight_map"]), name
        state = results[0][name]["state"]
        if name != "gpt2":  # a parallel module's full_state_dict has the model's own keys (a runner's: its stages')
            assert set(state) == set(model.state_dict()), name
            model.load_state_dict(state, strict=True)
        aliases = tied_names(model)
        for fqn, value in model.state_dict().items():
            held = state[next(n for n in [fqn, *aliases.get(fqn, [])] if n in state)]
            torch.testing.assert_close(value, held, rtol=0, atol=0, msg=f"{name}: {fqn} saved")
        with torch.no_grad():
            logits = model(**_inputs()).logits
        torch.testing.assert_close(logits, results[0][name]["ref_logits"], msg=f"{name}: logits after {STEPS} steps")


def _check_conversions(found: dict, source: str, tmp_path) -> None:
    """HF -> DCP: the converted source loaded into the parallel model equals the source; DCP -> HF:
    the parallel model's checkpoint converted reloads strictly, equal to its save_pretrained."""
    from partitioner.__main__ import main

    original = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).state_dict()
    for fqn, value in original.items():
        torch.testing.assert_close(found["converted"][fqn], value, rtol=0, atol=0, msg=f"converted {fqn}")
    dcp, hf = str(tmp_path / "llama-dcp"), str(tmp_path / "llama-hf")
    assert main(["convert", "-q", dcp, hf, "--max-shard-size", SHARD]) == 0
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "llama-hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "llama").state_dict()
    for fqn, value in model.state_dict().items():
        torch.testing.assert_close(value, saved[fqn], rtol=0, atol=0, msg=f"DCP -> HF {fqn}")


def _unit_comm():
    return types.SimpleNamespace(shape=(1,), coords=[0], ndim=1)


def test_a_missing_tensor_names_itself_and_its_file(checkpoints):
    config = transformers.AutoConfig.from_pretrained(checkpoints["llama"])
    config.num_hidden_layers = 3  # a layer the checkpoint does not have
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    source = WeightSource(model, checkpoint=checkpoints["llama"])
    with pytest.raises(KeyError, match=r"model\.layers\.2\.mlp\.up_proj\.weight .*model\.safetensors\.index\.json"):
        source.piece("model.layers.2.mlp.up_proj.weight", (Replicate(),), _unit_comm(), None, None)
    piece, shape = source.piece("lm_head.weight", (Replicate(),), _unit_comm(), None, None)  # tied: the embedding
    assert shape == (128, 64) and source.bytes_read == 128 * 64 * 4
    source.close()


def test_state_dict_on_meta_rebuilds_the_rotary_buffer(checkpoints):
    """The reported crash: a state dict without the non-persistent ``inv_freq`` into a model on
    meta; the buffer is computed by the model's own initialisation and equals a real model's."""
    config = transformers.AutoConfig.from_pretrained(checkpoints["qwen3"])
    real = AutoModelForCausalLM.from_config(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    source = WeightSource(model, state_dict=real.state_dict())
    fqn = "model.rotary_emb.inv_freq"
    assert fqn not in real.state_dict()
    value, _ = source.piece(fqn, (Replicate(),), _unit_comm(), None, None)
    torch.testing.assert_close(value, real.get_buffer(fqn), rtol=0, atol=0)


def test_convert_refuses_what_is_no_checkpoint(tmp_path, capsys):
    from partitioner.__main__ import main

    assert main(["convert", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "neither a HuggingFace directory" in capsys.readouterr().err
