"""Weights stored in one placement and read by their matmul in another, on real gloo ranks.

A fused projection (GPT-2's ``c_attn``: q, k and v in one weight) whose output is split while
sharded is computed from a weight in the strided layout: rank ``c`` holds block ``c`` of each of
q, k and v (``passes/lower/strided_layout.py``). A ZeRO-3 plan may store that weight cut along its
*other* dim on the same mesh axis (pinned here; the memory objective on (2, 2) with 1-D tensor
parallelism chose it before a gather's copy back into order was counted): there its stored
blocks are contiguous, and the edge into the matmul all-to-alls them into the strided shard
(``runtime/collectives.py``). The loader must cut the stored blocks the way the edge reads them.
One forked run on 4 ranks, with ``zero=3`` (the weights stored sharded,
gathered for use and gathered again in backward; the layer norms, their hidden dim split, run
``runtime.sharded_norm``, whose backward keeps the weight but not the bias, so only the weight
is gathered again, as priced), checks the loss, every gradient and the
communication counted against the plan's estimate, and the parameters after 3 AdamW steps,
against one device; the same options inside a 2-stage pipeline are checked to build on torch's
fake process group.

The strided layout also begins where no matmul makes the split dim: RoFormer splits its
sinusoidal position table (an embedding read at the positions) into sine and cosine halves in
every layer. :class:`TableHalves` is that in small, on 2 ranks with the table's width cut (pinned):
the table is loaded strided, the value both layers split is shared by their chains, a copy of it
read whole elsewhere is gathered from its strided blocks, and ``reshape_as`` takes its sizes from
its own output piece, not from the other tensor's (placed otherwise); loss, gradients,
communication and parameters after AdamW steps against one device.
"""

import copy

import torch
from parity_utils import Checks, check_step_like_one_device, prebuilt, run_checked, train_like_one_device

TIMEOUT_S = 240
STEPS = 3
OPTIONS = {"cluster": "h100", "objective": "memory", "tensor_parallel": "1d"}
# the layout under test, pinned: the solver now prefers storing a weight along the dim its gather
# needs no copy back into order for (passes/plan/move_scratch.py), where it chose this one before
LAYOUT = {"h.*.attn.c_attn.weight": ["S(1)", "S(1)"]}


def _gpt():
    from partitioner import models

    return models.gpt_demo(batch=8, seq=16, n_layer=4)


def memory_tp_worker(rank, world, cfg):
    import partitioner
    from passes.core.placements import parse_spec

    checks = Checks(rank)
    model, inputs = prebuilt("gpt") or _gpt()  # the parent's, captured there
    ref = copy.deepcopy(model)
    pm = partitioner.auto_parallelize(model, inputs, mesh=tuple(cfg["mesh"]), zero=cfg["zero"], pins=LAYOUT, **OPTIONS)
    # the layout under test: c_attn's weight stored cut along dim 1 on an axis where the matmul
    # reads it strided along dim 0 (so its stored blocks are contiguous, its bias's strided)
    fqn = "h.0.attn.c_attn.weight"
    stored = parse_spec(pm.placement_of(fqn), len(cfg["mesh"]))
    strided_axes = set(pm.strided_layouts().get("h.0.attn.c_attn.bias", {}))
    checks.true(
        f"{fqn} is placed {stored}, bias strided on {strided_axes}: not the layout under test",
        any(getattr(stored[a], "dim", None) == 1 for a in strided_axes),
    )
    regathered = [r["fqn"] for r in pm.plan.records if r.get("regather")]
    checks.true(f"zero={cfg['zero']}: regathered weights {regathered}", bool(regathered) == (cfg["zero"] == 3))
    check_step_like_one_device(pm, ref, inputs, checks, "memory objective, 1-D TP")
    train_like_one_device(pm, ref, inputs, STEPS, checks, "memory objective, 1-D TP")
    return {"rank": rank, "failures": checks.failures}


def test_fused_weight_stored_along_its_other_dim_matches_one_device():
    run_checked(memory_tp_worker, {"mesh": [2, 2], "zero": 3}, TIMEOUT_S, prebuild=("gpt", _gpt))


def test_fused_weight_layout_builds_inside_a_pipeline(fake_process_group):
    import partitioner

    fake_process_group(4)
    model, inputs = _gpt()
    pm = partitioner.auto_parallelize(
        model,
        inputs,
        mesh=(2, 2),
        zero=3,
        optimizer="sgd",
        share_blocks=False,
        pipeline={"degree": 2, "schedule": "1f1b", "microbatches": 4},
        **OPTIONS,
    )
    assert sum(p.numel() for p in pm.parameters()) > 0


class _Mix(torch.nn.Module):
    def forward(self, h, pos):
        return h + pos


class TableHalves(torch.nn.Module):
    """RoFormer's rotary tables in small: a position table split into halves in each layer."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(16, 8)
        self.proj = torch.nn.Linear(8, 8)
        self.mix = _Mix()

    def forward(self, x, target):
        pos = self.table(torch.arange(x.shape[1]))[None]
        h = x
        for _ in range(2):
            sin, cos = pos.chunk(2, dim=-1)
            sin2 = torch.stack([sin, sin], dim=-1).reshape_as(pos)
            cos2 = torch.stack([cos, cos], dim=-1).reshape_as(pos)
            h = self.proj(h) * cos2 + h * sin2
        return torch.nn.functional.mse_loss(self.mix(h, pos), target)


# the table's width cut on the mesh axis, both splits on it, the sum with the table read whole, and
# one reshape_as made whole while the tensor whose shape it takes is cut
TABLE_PINS = {"table.weight": ["S(1)"], "chunk": ["S(2)"], "chunk_1": ["S(2)"], "mix": ["R"], "reshape_as": ["R"]}


def table_halves_worker(rank, world, cfg):
    import partitioner

    checks = Checks(rank)
    torch.manual_seed(0)
    model = TableHalves()
    inputs = {"x": torch.randn(4, 8, 8), "target": torch.randn(4, 8, 8)}
    ref = copy.deepcopy(model)
    pm = partitioner.auto_parallelize(model, inputs, mesh=tuple(cfg["mesh"]), cluster="h100", pins=TABLE_PINS)
    split = {r.name: r.notes for r in pm.plan.node_records if r.name in ("chunk", "chunk_1")}
    checks.true(f"the splits' notes {split}", split == {"chunk": {"a0": "strided"}, "chunk_1": {"a0": "strided"}})
    checks.true(f"strided layouts {pm.strided_layouts()}", pm.strided_layouts() == {"table.weight": {0: 2}})
    check_step_like_one_device(pm, ref, inputs, checks, "a table split while cut")
    train_like_one_device(pm, ref, inputs, STEPS, checks, "a table split while cut")
    return {"rank": rank, "failures": checks.failures}


def test_a_table_split_while_cut_is_loaded_strided():
    run_checked(table_halves_worker, {"mesh": [2]}, TIMEOUT_S)
