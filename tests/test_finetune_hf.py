"""``examples/finetune_hf.py`` on 2 gloo ranks: a tiny LLaMA directory fine-tuned for 3 steps,
stopped after the checkpoint at step 2 and resumed for the third, saved with
``save_pretrained``; the result loads strictly and equals the same 3 steps of the same AdamW
schedule on one process (the ``from_pretrained`` model, the script's own batches), and the
metrics log holds one JSON line per step."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import partitioner.parallelize  # noqa: F401  (imported before forking)
from runtime.launch import run_on_ranks
from tests.parity_utils import ADAM_EPS  # AdamW's eps that keeps fp32 roundoff from steering updates

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import finetune_hf  # noqa: E402


def _args(model_dir, tmp_path, steps: int, *extra) -> list:
    return [
        "--model", str(model_dir), "--out", str(tmp_path / "out"), "--steps", str(steps), "--batch", "4",
        "--seq", "16", "--lr", "1e-3", "--adam-eps", str(ADAM_EPS), "--warmup", "0.3", "--mesh", "2",
        "--cluster", "h100", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2", *extra,
    ]  # fmt: skip


def _run(rank, world, model_dir, tmp_path):
    finetune_hf.main(_args(model_dir, tmp_path, 3, "--stop-after", "2"))  # preempted after its checkpoint
    return finetune_hf.main(_args(model_dir, tmp_path, 3, "--resume"))


def test_finetune_resumes_and_saves_what_one_process_trains(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "base", max_shard_size="20KB")
    last = run_on_ranks(_run, 2, tmp_path / "base", tmp_path, timeout_s=300)[0]
    lines = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3] and last["step"] == 3
    assert all(x["tokens_per_s"] > 0 and x["estimated_step_s"] > 0 for x in lines)

    args = finetune_hf.parse_args(_args(tmp_path / "base", tmp_path, 3))
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    tokens = finetune_hf.token_stream(args, config.vocab_size)
    optimizer, scheduler = finetune_hf.make_optimizer(ref.parameters(), args, args.steps)
    for step in range(3):
        optimizer.zero_grad()
        loss = ref(**finetune_hf.batch_at(tokens, args, step, "cpu")).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        torch.testing.assert_close(lines[step]["loss"], float(loss), msg=f"loss at step {step + 1}")
    tuned, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for fqn, value in ref.state_dict().items():
        torch.testing.assert_close(tuned.state_dict()[fqn], value, msg=lambda m, fqn=fqn: f"{fqn}: {m}")
