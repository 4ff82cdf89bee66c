"""A batch that does not divide the plan's data-parallel split runs, cut unevenly.

A plan made at batch 8, sequence 32 serves batch 6 and sequence 24 on a (4,) data-parallel mesh
(pieces of 2, 2, 1, 1 samples) and batches 6 and 5 on a (2, 2) data x tensor mesh (5 as 3 and
2 samples), and a plan made at batch 8, sequence 16 whose memory layout cuts the batch over both axes
and grouped-query attention's key/value heads over one serves batch 6, sequence 24 (a dim counts as
uneven only where it carries the batch's pieces), with parity against one device: the loss, every gradient, the gathered logits, and the
parameters after AdamW steps on the new shape. The loss is a mean over the valid tokens of the
whole batch (the sharded cross-entropy all-reduces (sum, count)), and the gradients are summed,
not averaged, over the data-parallel ranks, so unequal pieces weigh exactly as one device does.
A batch smaller than the data-parallel degree (a rank would get no sample) is refused on every
rank, naming the input, the dim and the mesh axis (on 2 data-parallel ranks the only such
batch, 1, captures another graph, size-1 dims being special to export, and is planned anew).
"""
import copy

import torch
from parity_utils import (
    Checks,
    adam_in_lockstep,
    call,
    capture_served,
    check_grads_by_alias,
    loss_of,
    pins_for,
    prebuilt,
    run_checked,
    train_like_one_device,
)

from partitioner import models
from passes.core.placements import Shard, rank_local_shape, split_size

TIMEOUT_S = 240
FACTORIES = {
    "gpt2": lambda: models.hf_gpt2(batch=8, seq=32),
    "llama": lambda: models.hf_llama(batch=8, seq=32, kv_heads=2),
}


def _batch(batch, seq):
    ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(batch * 100 + seq))
    return {"input_ids": ids, "labels": ids.clone()}


def _parallelize(model, cfg):
    import partitioner

    if cfg["kind"] == "memory":  # the solver's own layout, no pins: the one that holds least
        return partitioner.auto_parallelize(model, _batch(*cfg.get("planned", (8, 32))), mesh=cfg["mesh"],
                                            cluster="h100", objective="memory")
    pins = pins_for(cfg["model"], cfg["kind"], cfg.get("pins_mesh", cfg["mesh"]))
    pins.update(cfg.get("weight_pins", {}))  # after the "*" pin: the more specific wins
    return partitioner.auto_parallelize(model, _batch(8, 32), mesh=cfg["mesh"], cluster="h100", pins=pins,
                                        zero=cfg.get("zero", "auto"), pipeline=cfg.get("pipeline"))


def _uneven_edges(pm) -> int:
    """Edges of the programs lowered for other shapes that join or split a dim cut unevenly."""
    from runtime.reshard import Reshard

    return sum(
        isinstance(m, Reshard) and bool(m.uneven)
        for variant in getattr(pm, "_variants", {}).values()
        for m in variant.program.modules()
    )


def uneven_worker(rank, world, cfg):
    checks = Checks(rank)
    model, _ = prebuilt("uneven") or FACTORIES[cfg["model"]]()
    ref = copy.deepcopy(model)
    pm = _parallelize(model, cfg)
    piped = cfg.get("pipeline") is not None
    plans = pm.plan["stages"] if piped else [pm.plan]
    regathered = sum(bool(r.get("regather")) for plan in plans for r in plan.records)
    for batch, seq in cfg["shapes"]:
        inputs = _batch(batch, seq)
        for module in (pm, ref):
            for p in module.parameters():
                p.grad = None
        if piped:
            loss = pm.train_step(inputs)
        else:
            out = call(pm, inputs)
            loss = loss_of(out)
            loss.backward()
        ref_out = call(ref, inputs)
        ref_out.loss.backward()
        checks.close(f"loss at batch {batch}, seq {seq}", loss.detach(), ref_out.loss.detach())
        if not piped:
            checks.close(f"logits at batch {batch}, seq {seq}", pm.gather_outputs(out).logits, ref_out.logits.detach())
        key_of = check_grads_by_alias(pm.full_grads(), ref, checks)
        label = f"batch {batch}, seq {seq}"
        if piped:  # a pipeline's state holds a tied weight under one of its names (key_of)
            adam_in_lockstep(pm.parameters(), ref, inputs, 2, lambda: pm.train_step(inputs), checks)
            state = pm.full_state_dict()
            for name, p in ref.named_parameters():
                checks.close(f"{label}: parameter {name} after 2 AdamW steps", state[key_of[name]], p.detach())
        else:
            train_like_one_device(pm, ref, inputs, 2, checks, label)
    errors = []
    if cfg.get("too_small"):
        try:
            if piped:
                pm.train_step(_batch(cfg["too_small"], 24))
            else:
                call(pm, _batch(cfg["too_small"], 24))
        except ValueError as e:  # ShapeMismatchError is one
            errors.append(f"{type(e).__name__}: {e}")
    return {"rank": rank, "failures": checks.failures, "errors": errors, "regathered": regathered,
            "uneven_edges": 0 if piped else _uneven_edges(pm)}


def _check(cfg, refusal=("input 'input_ids'", "dim 0", "no element")):
    # the model built and captured here at the planned shape (a pipeline: its stages), once for every rank
    # and at every shape the ranks' module will be called with (the batch too small for it included:
    # it is captured, then refused)
    options = {"pipeline": cfg["pipeline"]} if cfg.get("pipeline") else {}
    shapes = cfg["shapes"] + ([(cfg["too_small"], 24)] if cfg.get("too_small") else [])

    def made():
        model = FACTORIES[cfg["model"]]()[0]
        capture_served(model, [_batch(b, s) for b, s in shapes], **options)
        return model, _batch(*cfg.get("planned", (8, 32)))

    prebuild = ("uneven", made, options)
    results = run_checked(uneven_worker, cfg, TIMEOUT_S, prebuild=prebuild)
    for r in results if cfg.get("too_small") else ():
        assert len(r["errors"]) == 1, f"batch {cfg['too_small']} must be refused on rank {r['rank']}"
        message = r["errors"][0]
        assert all(words in message for words in refusal), message
    return results


def test_gpt2_plan_at_batch_8_serves_batch_6_seq_24_on_4_data_parallel_ranks_with_zero_3_weights():
    # the attention and MLP input projections stored sharded and gathered for use (ZeRO-3: again in
    # backward): the weights' gathers and reduce-scatters are whole, whatever the batch's pieces
    sharded = {"transformer.h.*.attn.c_attn.weight": ["S(0)"], "transformer.h.*.mlp.c_fc.weight": ["S(0)"]}
    cfg = {"model": "gpt2", "kind": "dp", "mesh": (4,), "shapes": [(6, 24)], "too_small": 3, "zero": 3,
           "weight_pins": sharded}
    results = _check(cfg, ("ShapeMismatchError", "input 'input_ids'", "dim 0", "size 3", "no element"))
    assert results[0]["regathered"] == 4  # 2 layers x 2 weights


def test_pipeline_plan_at_batch_8_serves_batches_6_and_5():
    # 2 stages x 2 data-parallel ranks, 2 microbatches of 4 planned: batch 6 runs as 2 microbatches
    # of 3 (each cut 2 + 1 over dp), batch 5 as 3 + 2 (two programs per stage, each microbatch's
    # loss weighted by its samples); batch 3 would leave a microbatch of one sample, which export
    # captures as another program: refused on every rank, naming the stage and what to do
    cfg = {"model": "gpt2", "kind": "dp", "mesh": (2, 2), "pins_mesh": (2,), "shapes": [(6, 24), (5, 32)],
           "pipeline": {"degree": 2, "schedule": "1f1b", "microbatches": 2}, "too_small": 3}
    _check(cfg, ("pipeline stage 0", "(1, 24)", "at least 2 samples"))


def test_llama_plan_at_batch_8_serves_batches_6_and_5_on_data_x_tensor():
    _check({"model": "llama", "kind": "dp_tp", "mesh": (2, 2), "shapes": [(6, 24), (5, 32)]})


def test_uneven_pieces_move_through_collectives_on_the_solvers_own_layout():
    # no pins, the memory objective: the solver's layout gathers and cuts activations whose batch
    # (6 or 5 on 2 x 2) splits unevenly: each such edge exchanges its pieces' sizes, pads, gathers
    # and cuts back (runtime/uneven_moves.py), with parity
    results = _check({"model": "llama", "kind": "memory", "mesh": (2, 2), "shapes": [(6, 24), (5, 32)]})
    assert all(r["uneven_edges"] > 0 for r in results), [r["uneven_edges"] for r in results]


def test_a_batch_cut_on_both_axes_serves_values_cut_on_two_dims():
    # planned at batch 8, seq 16, the solver cuts the batch over both axes somewhere and the
    # key/value heads over one: only the dims carrying the batch count as uneven
    # (passes/analysis/sample_dims.py), so grouped-query attention's expand and reshape of
    # [B, kv, rep, S, D] lower (they were refused: every dim cut on either axis counted as uneven)
    results = _check({"model": "llama", "kind": "memory", "mesh": (2, 2), "planned": (8, 16), "shapes": [(6, 24)]})
    assert all(r["uneven_edges"] > 0 for r in results), [r["uneven_edges"] for r in results]


def test_a_reshape_of_pieces_unequal_on_two_dims_takes_each_size_from_its_run_of_dims():
    from passes.rules.views import view_groups
    from runtime.uneven_views import reshape_by_groups

    groups = view_groups((6, 2, 2, 24, 16), (6, 4, 24, 16))
    assert groups == [((0,), (0,)), ((1, 2), (1,)), ((3,), (2,)), ((4,), (3,))]
    assert view_groups((8, 2, 1, 16), (8, 2, 16)) == [((0,), (0,)), ((1, 2), (1,)), ((3,), (2,))]
    assert view_groups((6, 24, 64), (144, 64)) == [((0, 1), (0,)), ((2,), (1,))]
    piece = torch.randn(2, 1, 2, 12, 16)  # a rank's piece: 2 of 6 samples, 1 of 2 kv heads
    out = reshape_by_groups(piece, [-1, -1, 12, 16], groups)
    torch.testing.assert_close(out, piece.reshape(2, 2, 12, 16))


def test_uneven_pieces_follow_tensor_split_axis_by_axis():
    for size in range(4, 13):
        assert [split_size(size, 4, i) for i in range(4)] == [len(c) for c in torch.arange(size).tensor_split(4)]
    # batch 6 cut over both axes of a (2, 2) mesh: 3 and 3, then 2 and 1 of each
    spec = (Shard(0), Shard(0))
    sizes = [rank_local_shape((6, 24), spec, (2, 2), (a, b))[0] for a in range(2) for b in range(2)]
    assert sizes == [2, 1, 2, 1]
