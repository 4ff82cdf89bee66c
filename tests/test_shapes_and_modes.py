"""One parallel model serves other batch and sequence sizes, and eval mode.

A plan made at batch 8 / sequence 64 serves batch 6 and sequence 48 (re-lowered once per
shape, cached), with parity against one device: loss, every gradient, and parameters after
AdamW steps taken on the new shapes. A batch whose sharded dim no longer divides is refused on
every rank with an error naming the input, the dim and the mesh axis (no hang). A pipeline serves
other batch and sequence sizes too (its losses equal one device's), and refuses a batch with
fewer samples than microbatches. A plan made in
train mode replays on a model in eval mode (the same plan with dropout off), and ``eval()`` on
a parallel model runs an eval-mode program (no dropout, equal to the single-device model).
"""
import copy

import pytest
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
)

from partitioner import hf_families, models
from partitioner.captures import capture as capture_for_call
from partitioner.specialize import in_mode
from passes.analysis.analyze import analyze
from passes.analysis.shape_check import ShapeMismatchError, check_divisible
from passes.capture.capture import capture, graph_fingerprint
from runtime.launch import run_on_ranks

TIMEOUT_S = 240


def _llama(batch, seq):
    model, inputs = models.hf_llama(batch=8, seq=64, kv_heads=2)
    ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(batch * 100 + seq))
    return model, {"input_ids": ids, "labels": ids.clone()}


def shapes_worker(rank, world, cfg):
    import partitioner

    checks = Checks(rank)
    model, example = prebuilt("llama") or _llama(8, 64)
    ref = copy.deepcopy(model)
    # data parallel on axis 0, Megatron with sequence-parallel norms on axis 1: batch and
    # sequence are both cut, so both new sizes exercise the divisibility rule
    pm = partitioner.auto_parallelize(model, example, mesh=(2, 2), cluster="h100",
                                      pins=pins_for("llama", "tp_sp", (2, 2)))
    result = {"rank": rank, "failures": checks.failures}
    for batch, seq in cfg["shapes"]:
        _, inputs = _llama(batch, seq)
        for module in (pm, ref):
            for p in module.parameters():
                p.grad = None
        loss = loss_of(call(pm, inputs))
        loss.backward()
        ref_loss = loss_of(call(ref, inputs))
        ref_loss.backward()
        checks.close(f"loss at batch {batch}, seq {seq}", loss.detach(), ref_loss.detach())
        check_grads_by_alias(pm.full_grads(), ref, checks)

        def parallel_step(inputs=inputs):
            step_loss = loss_of(call(pm, inputs))
            step_loss.backward()
            return step_loss
        adam_in_lockstep(pm.parameters(), ref, inputs, 2, parallel_step, checks)
    state = pm.full_state_dict()
    for name, p in ref.named_parameters():
        checks.close(f"parameter {name} after the steps on every shape", state[name], p.detach())
    _, odd = _llama(5, 64)   # does not divide the 2-way data-parallel axis: cut 3 and 2
    with torch.no_grad():
        checks.close("loss at batch 5, seq 64", loss_of(call(pm, odd)), loss_of(call(ref, odd)))
    result["variants"] = len(pm.variants)
    pm.eval()
    with torch.no_grad():
        _, inputs = _llama(6, 48)
        checks.close("eval loss at batch 6, seq 48", loss_of(call(pm, inputs)), loss_of(call(ref.eval(), inputs)))
    return result


def _built_and_served(shapes):
    """The model, captured here at the example shape and at every shape the ranks' module serves
    (the train steps' shapes, batch 5, and batch 6 / sequence 48 in eval mode), before forking."""
    model, example = _llama(8, 64)
    capture_served(model, [_llama(b, s)[1] for b, s in [*shapes, (5, 64)]])
    with in_mode(model, False):
        capture_for_call(model, _llama(6, 48)[1])
    return model, example


def test_plan_at_batch_8_seq_64_serves_batch_6_and_seq_48():
    shapes = [(6, 64), (8, 48), (6, 48), (6, 64)]
    results = run_checked(shapes_worker, {"mesh": (2, 2), "shapes": shapes}, TIMEOUT_S,
                          prebuild=("llama", lambda: _built_and_served(shapes)))
    for r in results:
        # the example shape, four new ones (the repeated one is served from the cache)
        assert r["variants"] == 5, r["variants"]


def replay_worker(rank, world, cfg):
    import partitioner

    checks = Checks(rank)
    model, inputs = models.gpt_demo(batch=8, seq=16, n_layer=2, dropout=0.1)
    ref = copy.deepcopy(model).eval()
    trained = partitioner.auto_parallelize(copy.deepcopy(model), inputs, mesh=(2,), cluster="h100",
                                           pins=pins_for("gpt", "dp", (2,)))
    assert trained.plan.data["training"] is True
    model.eval()
    replayed = partitioner.auto_parallelize(model, inputs, mesh=(2,), plan=trained.plan)
    checks.true("the replayed module follows the model's eval mode", not replayed.training)
    with torch.no_grad():
        checks.close("eval loss of a train-mode plan replayed", call(replayed, inputs), call(ref, inputs))
    replayed.train()
    loss = call(replayed, inputs)
    checks.true("train mode draws dropout again", abs(loss.item() - call(ref, inputs).item()) > 1e-4)
    return {"rank": rank, "failures": checks.failures}


def test_train_mode_plan_replays_in_eval_mode():
    run_checked(replay_worker, {"mesh": (2,)}, TIMEOUT_S)


# -- one process: the checks themselves -----------------------------------------------------


def _captured(batch, seq, training=True):
    model, inputs = hf_families.build("gpt2", batch=batch, seq=seq, dropout=0.1)
    model.train(training)
    cap = capture(model, inputs)
    analyze(cap)
    return cap


def test_structure_fingerprint_ignores_sizes_but_not_mode():
    a, b = _captured(8, 64), _captured(6, 48)
    assert graph_fingerprint(a) != graph_fingerprint(b)
    assert graph_fingerprint(a, shapes=False) == graph_fingerprint(b, shapes=False)
    assert a.training and not _captured(8, 64, training=False).training


def test_check_divisible_names_an_inner_node_and_its_module():
    cap = _captured(4, 16)
    records = {}
    for node in cap.graph.nodes:
        if node.op == "call_function" and "addmm" in str(node.target):
            records[node.name] = {"out": ["[S(0)]"]}   # 4*16 rows cut 3 ways: does not divide
            break
    with pytest.raises(ShapeMismatchError, match=r"node addmm \(aten.addmm.default in transformer.h.0.attn"
                                                 r".*size 64 on dim 0.*'a0' \(3 ranks\)"):
        check_divisible(cap, records, (3,), ("a0",))
    check_divisible(cap, records, (2,), ("a0",))   # 64 rows in 2 pieces: fine


def pipeline_shape_worker(rank, world, cfg):
    import partitioner

    model, inputs = models.gpt_demo(batch=8, seq=16, n_layer=2)
    ref = copy.deepcopy(model)
    runner = partitioner.auto_parallelize(model, inputs, mesh=(2,), cluster="h100",
                                          pipeline={"degree": 2, "schedule": "1f1b", "microbatches": 2})
    losses, errors = [], []
    # other shapes: the stage plans lowered again (seq 12); batch 3 as microbatches of 2 and 1 samples, their
    # losses weighted 2/3 and 1/3 (this graph captures alike at one sample; HF GPT-2's does not:
    # tests/test_uneven_batches.py)
    for batch, seq in ((8, 12), (3, 16)):
        _, other = models.gpt_demo(batch=batch, seq=seq, n_layer=2)
        losses.append((runner.train_step(other).item(), loss_of(call(ref, other)).item()))
    try:  # one sample for 2 microbatches: one would be empty
        runner.train_step(models.gpt_demo(batch=1, seq=16, n_layer=2)[1])
    except ValueError as e:
        errors.append(str(e))
    loss = runner.train_step(inputs)    # still runs on the shapes it was built for
    return {"errors": errors, "losses": losses, "loss": loss.item()}


def test_pipeline_serves_other_shapes_and_refuses_an_empty_microbatch():
    results = run_on_ranks(pipeline_shape_worker, 2, {}, timeout_s=TIMEOUT_S)
    for r in results:
        assert len(r["losses"]) == 2
        for got, want in r["losses"]:
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want))
        assert len(r["errors"]) == 1, r["errors"]
        assert "input 'idx' has 1 samples" in r["errors"][0] and "2 microbatches" in r["errors"][0], r["errors"][0]
    assert results[0]["loss"] == results[1]["loss"] > 0
