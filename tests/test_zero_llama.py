"""ZeRO-2 and ZeRO-3 on HF LLaMA (RoPE, grouped-query attention), on real gloo ranks against one device.

The checks of ``tests/test_zero.py`` (its worker, ``tests/zero_utils.py``), in a file of their own because LLaMA's
captures take longest: on (4,) (the solver's plan, unpinned) and (2, 2) (activations pinned data
x Megatron, which keeps the budgeted solve short), ZeRO-3 under half the replicated Adam state
and ZeRO-2 stored where ZeRO-3 stores: loss, every gradient, counted communication == estimate,
saved tensors within 5% of the estimate, parameters after 3 AdamW steps.
"""

import pytest
from zero_utils import run_zero

CONFIGS = [
    {"model": "llama", "mesh": [4], "kind": "free"},
    {"model": "llama", "mesh": [2, 2], "kind": "dp_tp"},
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "x".join(map(str, c["mesh"])))
def test_llama_zero3_and_zero2_match_one_device(cfg):
    results = run_zero(cfg)
    assert results[0]["regathered"] > 0
