"""A batch that does not divide the plan's data-parallel split runs, cut unevenly.

A plan made at batch 8, sequence 32 serves batch 6 and sequence 24 on a (4,) data-parallel mesh
(pieces of 2, 2, 1, 1 samples) and batches 6 and 5 on a (2, 2) data x tensor mesh (5 as 3 and
2 samples), and plans made at batch 8, sequence 16 whose memory layouts cut the batch over both
axes serve batch 6, sequence 24: grouped-query attention's key/value heads cut over one axis (its
views of pieces unequal on two dims take their sizes from each rank's input), MPT's attention
scores cut on both sequence dims (only the dims that carry pieces of the batch are uneven), and
an MLP on flattened (batch * seq, hidden) rows cut between samples; each with parity against one
device: the loss, every gradient, the gathered logits, and the parameters after AdamW steps on
the new shape. The loss is a mean over the valid tokens of the
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
    nested_approx_equal,
    pins_for,
    prebuilt,
    run_checked,
    train_like_one_device,
)

from partitioner import hf_families, models
from passes.core.placements import Shard, rank_local_shape, split_size
from runtime.collectives import CommCounter

TIMEOUT_S = 240
# a LLaMA-sized Starcoder2 (grouped-query attention, biased projections, LayerNorm), built from its config
STARCODER2 = (
    "Starcoder2Config",
    "Starcoder2ForCausalLM",
    dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
         bos_token_id=0, eos_token_id=0),
    "causal",
)
# MPT: eager attention whose scores' softmax the memory layout cuts on the two sequence dims while
# the batch is cut over both axes elsewhere, and a flattened (batch * seq, vocab) loss
MPT = (
    "MptConfig",
    "MptForCausalLM",
    dict(n_layers=2, d_model=64, n_heads=4, expansion_ratio=2, max_seq_len=64),
    "causal",
)


class FlatRowsLM(torch.nn.Module):
    """A one-layer causal LM: attention over heads, then an MLP and the head on the flattened
    (batch * seq, hidden) rows."""

    def __init__(self, vocab=128, hidden=64, heads=4):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.out = torch.nn.Linear(hidden, hidden)
        self.up = torch.nn.Linear(hidden, 4 * hidden)
        self.down = torch.nn.Linear(4 * hidden, hidden)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, input_ids, labels):
        b, s = input_ids.shape
        x = self.embed(input_ids)
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        x = x + self.out(att.transpose(1, 2).reshape(b, s, -1))
        rows = x.reshape(b * s, -1)
        rows = rows + self.down(torch.nn.functional.gelu(self.up(rows)))
        logits = self.head(rows)
        loss = torch.nn.functional.cross_entropy(logits, labels.reshape(-1))
        return {"loss": loss, "logits": logits.view(b, s, -1)}


def _flat_rows():
    torch.manual_seed(0)
    return FlatRowsLM(), _batch(8, 16)


FACTORIES = {
    "gpt2": lambda: models.hf_gpt2(batch=8, seq=32),
    "mpt": lambda: hf_families.build("mpt", spec=MPT, batch=8, seq=16),
    "flat_rows": _flat_rows,
    "llama": lambda: models.hf_llama(batch=8, seq=32, kv_heads=2),
    "starcoder2": lambda: hf_families.build("starcoder2", spec=STARCODER2, batch=8, seq=16),
}


def _batch(batch, seq):
    ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(batch * 100 + seq))
    return {"input_ids": ids, "labels": ids.clone()}


def _parallelize(model, cfg):
    import partitioner

    if cfg["kind"] == "memory":  # the solver's own layout, no pins: the one that holds least
        return partitioner.auto_parallelize(model, _batch(*cfg.get("planned", (8, 32))), mesh=cfg["mesh"],
                                            cluster="h100", objective="memory", pins=cfg.get("pins"))
    pins = pins_for(cfg["model"], cfg["kind"], cfg.get("pins_mesh", cfg["mesh"]))
    pins.update(cfg.get("weight_pins", {}))  # after the "*" pin: the more specific wins
    return partitioner.auto_parallelize(model, _batch(8, 32), mesh=cfg["mesh"], cluster="h100", pins=pins,
                                        zero=cfg.get("zero", "auto"), pipeline=cfg.get("pipeline"))


def _uneven_edges(pm, *, flat: bool = False) -> int:
    """Edges of the programs lowered for other shapes that join or split a dim cut unevenly
    (``flat``: a flattened batch x sequence dim, cut between samples)."""
    from runtime.reshard import Reshard

    return sum(
        isinstance(m, Reshard) and bool(m.uneven) and (not flat or any(u > 1 for u in m.uneven_units.values()))
        for variant in getattr(pm, "_variants", {}).values()
        for m in variant.program.modules()
    )


def _runs_sharded_softmax(pm) -> bool:
    """Does a program lowered for other shapes run a softmax on a dim cut over mesh axes?"""
    from runtime.local_ops import ShardedSoftmax

    return any(
        isinstance(m, ShardedSoftmax) for variant in getattr(pm, "_variants", {}).values()
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
            with CommCounter() as counter:
                out = call(pm, inputs)
                loss = loss_of(out)
                loss.backward()
            if (batch, seq) == cfg.get("planned"):  # the plan's own shapes: it sends what it priced
                for diff in nested_approx_equal(counter.as_dict(), pm.plan.estimate().comm_bytes):
                    checks.true(f"communication at batch {batch}, seq {seq}: {diff}", False)
        ref_out = call(ref, inputs)
        loss_of(ref_out).backward()
        checks.close(f"loss at batch {batch}, seq {seq}", loss.detach(), loss_of(ref_out).detach())
        if not piped:
            logits = pm.gather_outputs(out)["logits"]
            checks.close(f"logits at batch {batch}, seq {seq}", logits, ref_out["logits"].detach())
        key_of = check_grads_by_alias(pm.full_grads(), ref, checks)
        label = f"batch {batch}, seq {seq}"
        if piped:  # a pipeline's state holds a tied weight under one of its names (key_of)
            adam_in_lockstep(pm.parameters(), ref, inputs, 2, lambda x=inputs: pm.train_step(x), checks)
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
            "uneven_edges": 0 if piped else _uneven_edges(pm),
            "flat_uneven_edges": 0 if piped else _uneven_edges(pm, flat=True),
            "sharded_softmax": _runs_sharded_softmax(pm)}


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
    # key/value heads over one: grouped-query attention's expand and reshape of [B, kv, rep, S, D]
    # then hold pieces of unknown size on two dims, each taken from the rank's own input
    # (runtime/uneven_views.py; they were refused)
    cfg = {"model": "starcoder2", "kind": "memory", "mesh": (2, 2), "planned": (8, 16), "shapes": [(6, 24)]}
    results = _check(cfg)
    assert all(r["uneven_edges"] > 0 for r in results), [r["uneven_edges"] for r in results]


def test_attention_cut_on_its_sequence_dims_serves_a_batch_cut_unevenly_elsewhere():
    # MPT planned at batch 8, seq 16: its scores' softmax is cut on both sequence dims (24 divides),
    # while the batch (6 over both axes: 2, 1, 2, 1) is cut unevenly elsewhere; only the dims that
    # carry pieces of the batch count as uneven (passes/analysis/dim_blocks.py), so the sharded
    # softmax runs (it was refused naming its sequence dims)
    cfg = {"model": "mpt", "kind": "memory", "mesh": (2, 2), "planned": (8, 16), "shapes": [(6, 24)]}
    results = _check(cfg)
    assert all(r["uneven_edges"] > 0 for r in results), [r["uneven_edges"] for r in results]


def test_a_flattened_batch_x_sequence_dim_is_cut_between_samples():
    # the MLP and head run on (batch * seq, hidden) rows, pinned cut over both axes: at batch 6,
    # seq 24 the 144 rows divide by 4 but their 6 samples do not, so each rank holds 48 or 24
    # rows; every edge that gathers or cuts them moves whole samples (24 rows), and the loss's
    # labels, flattened the same way, line up
    cfg = {"model": "flat_rows", "kind": "memory", "mesh": (2, 2), "planned": (8, 16), "shapes": [(6, 24)],
           "pins": {"up": "[S(0), S(0)]"}}
    results = _check(cfg)
    assert all(r["flat_uneven_edges"] > 0 for r in results), [r["flat_uneven_edges"] for r in results]


def test_a_softmax_cut_on_its_reduced_dim_serves_rows_cut_unevenly_on_another_axis():
    # the scores' softmax pinned to the batch over one axis and its reduced (key) dim over the
    # other: batch 5 gives the data axis pieces of 3 and 2 samples, and the ranks that reduce the
    # row statistics together hold the same samples, so the sharded softmax runs (it was refused)
    cfg = {"model": "flat_rows", "kind": "memory", "mesh": (2, 2), "planned": (8, 16), "shapes": [(5, 24)],
           "pins": {"softmax": "[S(0), S(3)]"}}
    results = _check(cfg)
    assert all(r["sharded_softmax"] for r in results), results


def test_a_flattened_dim_the_plan_cut_across_samples_is_cut_by_elements():
    # planned at batch 2: the pinned rows (2 samples x 16) over 4 ranks are half samples each, so
    # the plan's pieces straddle samples; at batch 2 and at batch 6, seq 24 (144 rows: 36 each)
    # they are cut by elements as the plan cut them, not between samples (2 samples over 4 ranks
    # would leave two ranks none); at batch 2 it sends what the plan priced
    cfg = {"model": "flat_rows", "kind": "memory", "mesh": (2, 2), "planned": (2, 16), "shapes": [(2, 16), (6, 24)],
           "pins": {"up": "[S(0), S(0)]"}}
    results = _check(cfg)
    assert all(r["flat_uneven_edges"] == 0 for r in results), [r["flat_uneven_edges"] for r in results]


def test_dims_hold_the_blocks_a_flattened_batch_was_made_of():
    from partitioner.captures import captured
    from passes.analysis.dim_blocks import dim_blocks

    def blocks_of(model):
        cap = captured(model, _batch(6, 24), layers="auto", autocast_dtype=None, sequence_parallel=None,
                       routing=False)
        return {node.name: outs[0] for node, outs in dim_blocks(cap.graph).items() if outs and outs[0] is not None}

    blocks = blocks_of(FlatRowsLM())
    batch = ("input_ids", 0)
    rows = [name for name, dims in blocks.items() if dims and dims[0] == (6, 24, batch)]
    # the rows from the flatten to the head are 6 samples of 24 rows (the flattened labels too,
    # from their own input)
    assert {"reshape_1", "linear_2", "gelu", "linear_3", "add_1", "linear_4"} <= set(rows), rows
    assert blocks["reshape_2"][0] == (6, 24, ("labels", 0))
    assert blocks["view_1"][:2] == [(6, 1, batch), (24, 1, None)]  # unflattened back: the samples again
    assert blocks["softmax"][:2] == [(6, 1, batch), (4, 1, None)]  # heads: no input sizes them
    assert blocks["reshape"][2] == (64, 1, None)  # heads x head size: cut by elements
    # grouped-query attention: [B, kv, rep, S, D] -> [B, kv * rep, S, D] makes 4 heads of one (no
    # input sizes the key/value heads), so the repeated keys are cut as the query's heads are
    blocks = blocks_of(FACTORIES["llama"]()[0])
    assert blocks["reshape"][1] == (4, 1, None), blocks["reshape"]
    assert blocks["scaled_dot_product_attention"][:2] == [(6, 1, batch), (4, 1, None)]

    class ScaledInPlace(torch.nn.Module):  # CTRL's embedding scale: an in-place op with no rule
        def __init__(self):
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(128, 16), torch.nn.Linear(16, 128)

        def forward(self, input_ids, labels):
            x = self.embed(input_ids)
            x.mul_(4.0)
            logits = self.head(x.reshape(-1, 16))
            return torch.nn.functional.cross_entropy(logits, labels.reshape(-1))

    blocks = blocks_of(ScaledInPlace())
    assert blocks["mul_"] == [(6, 1, batch), (24, 1, ("input_ids", 1)), (16, 1, None)]
    assert blocks["linear"][0] == (6, 24, batch)  # the logits' rows line up with the labels'


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
