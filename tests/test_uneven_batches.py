"""A batch that does not divide the plan's data-parallel split runs, cut unevenly.

A plan made at batch 8, sequence 32 serves batch 6 and sequence 24 on a (4,) data-parallel mesh
(pieces of 2, 2, 1, 1 samples) and batches 6 and 5 on a (2, 2) data x tensor mesh (5 as 3 and
2 samples), with parity against one device: the loss, every gradient, the gathered logits, and the
parameters after AdamW steps on the new shape. The loss is a mean over the valid tokens of the
whole batch (the sharded cross-entropy all-reduces (sum, count)), and the gradients are summed,
not averaged, over the data-parallel ranks, so unequal pieces weigh exactly as one device does.
A batch smaller than the data-parallel degree (a rank would get no sample) is refused on every
rank, naming the input, the dim and the mesh axis (on 2 data-parallel ranks the only such
batch, 1, captures another graph, size-1 dims being special to export, and is planned anew).
"""
import copy

import torch
from parity_utils import Checks, call, check_grads_by_alias, loss_of, pins_for, run_checked, train_like_one_device

from partitioner import models
from passes.placements import Shard, rank_local_shape, split_size

TIMEOUT_S = 240
FACTORIES = {
    "gpt2": lambda: models.hf_gpt2(batch=8, seq=32),
    "llama": lambda: models.hf_llama(batch=8, seq=32, kv_heads=2),
}


def _batch(batch, seq):
    ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(batch * 100 + seq))
    return {"input_ids": ids, "labels": ids.clone()}


def uneven_worker(rank, world, cfg):
    import partitioner
    from passes.shape_check import ShapeMismatchError

    checks = Checks(rank)
    model, _ = FACTORIES[cfg["model"]]()
    ref = copy.deepcopy(model)
    pm = partitioner.auto_parallelize(model, _batch(8, 32), mesh=cfg["mesh"], cluster="h100",
                                      pins=pins_for(cfg["model"], cfg["kind"], cfg["mesh"]))
    for batch, seq in cfg["shapes"]:
        inputs = _batch(batch, seq)
        for module in (pm, ref):
            for p in module.parameters():
                p.grad = None
        out = call(pm, inputs)
        loss = loss_of(out)
        loss.backward()
        ref_out = call(ref, inputs)
        ref_out.loss.backward()
        checks.close(f"loss at batch {batch}, seq {seq}", loss.detach(), ref_out.loss.detach())
        checks.close(f"logits at batch {batch}, seq {seq}", pm.gather_outputs(out).logits, ref_out.logits.detach())
        check_grads_by_alias(pm.full_grads(), ref, checks)
        train_like_one_device(pm, ref, inputs, 2, checks, f"batch {batch}, seq {seq}")
    errors = []
    if cfg.get("too_small"):
        try:
            call(pm, _batch(cfg["too_small"], 24))
        except ShapeMismatchError as e:
            errors.append(str(e))
    return {"rank": rank, "failures": checks.failures, "errors": errors}


def _check(cfg):
    results = run_checked(uneven_worker, cfg, TIMEOUT_S)
    for r in results if cfg.get("too_small") else ():
        assert len(r["errors"]) == 1, f"batch {cfg['too_small']} must be refused on rank {r['rank']}"
        message = r["errors"][0]
        assert "input 'input_ids'" in message and "dim 0" in message, message
        assert f"size {cfg['too_small']}" in message and "no element" in message, message


def test_gpt2_plan_at_batch_8_serves_batch_6_seq_24_on_4_data_parallel_ranks():
    _check({"model": "gpt2", "kind": "dp", "mesh": (4,), "shapes": [(6, 24)], "too_small": 3})


def test_llama_plan_at_batch_8_serves_batches_6_and_5_on_data_x_tensor():
    _check({"model": "llama", "kind": "dp_tp", "mesh": (2, 2), "shapes": [(6, 24), (5, 32)]})


def test_uneven_pieces_follow_tensor_split_axis_by_axis():
    for size in range(4, 13):
        assert [split_size(size, 4, i) for i in range(4)] == [len(c) for c in torch.arange(size).tensor_split(4)]
    # batch 6 cut over both axes of a (2, 2) mesh: 3 and 3, then 2 and 1 of each
    spec = (Shard(0), Shard(0))
    sizes = [rank_local_shape((6, 24), spec, (2, 2), (a, b))[0] for a in range(2) for b in range(2)]
    assert sizes == [2, 1, 2, 1]
