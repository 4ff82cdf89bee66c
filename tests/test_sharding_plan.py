"""The ShardingPlan value: summary tables, picture, JSON round trip, fingerprint refusal, explain, diff, pins."""
import json
import os
import re
import shutil
import subprocess

import pytest

import partitioner
from partitioner import models
from partitioner.plan_dot import plan_to_dot
from partitioner.plan_table import mask_index_rows, plan_table, short_collectives, shown_rows
from passes.capture.capture import capture, graph_fingerprint
from passes.core.plan_records import CollectiveRecord


@pytest.fixture(scope="module")
def gpt():
    return models.gpt_block(batch=8, seq=128, n_embd=256, n_head=8, n_layer=3, vocab=512)


@pytest.fixture(scope="module")
def plan(gpt):
    model, inputs = gpt
    return partitioner.plan(model, inputs, mesh_shape=(2, 4), mesh_axis_names=("dp", "tp"), cluster="h100",
                            memory_budget="80GiB")


def test_summary_collapses_repeated_blocks(plan):
    text = plan.summary()
    assert "h.[0-2]  ×3 identical blocks, shown once (names relative to h.0)" in text
    assert "placement dp×tp" in text
    # block 0 is shown (its names relative to h.0), blocks 1 and 2 are not
    assert "\nmlp.c_fc.weight " in text and "h.1." not in text
    assert "estimate: step" in text
    wide = plan.summary(wide=True)
    assert "h.0.mlp.c_fc.weight" in wide and "h.1.mlp.c_fc.weight" not in wide


def test_default_summary_is_narrow_and_wide_keeps_every_column(plan):
    text, wide = plan.summary(), plan.summary(wide=True)
    assert max(len(line) for line in text.splitlines()) <= 120
    assert "local shape" in wide and "local shape" not in text
    # collectives: summarised per kind and axis by default, with phase and bytes when wide
    busiest = max(shown_rows(plan), key=lambda r: len(r.comm))
    summary = short_collectives(busiest.comm)
    assert len(summary.split(", ")) < len(busiest.comm) and " x2" in summary   # repeats counted, not listed
    assert next(line for line in text.splitlines() if line.split()[0] == busiest.name).endswith(summary)
    first = busiest.comm[0]
    assert f" {first.phase} " in next(line for line in wide.splitlines() if line.split()[0] == busiest.name)
    entry = lambda kind, axis: CollectiveRecord(kind=kind, axis=axis, bytes=0.0, phase="fwd", input=None, time_s=0.0)  # noqa: E731
    assert short_collectives([entry("all_reduce", "a1")] * 2 + [entry("all_gather", "a0")]) \
        == "AR@a1 x2, AG@a0"
    # a narrower table wraps the collectives onto continuation lines instead of cutting them
    narrow = plan_table(plan, width=100).splitlines()
    assert max(len(line) for line in narrow) <= 100
    wrapped = [i for i, line in enumerate(narrow) if line.endswith(",") and "@" in line]
    assert wrapped and all(narrow[i + 1].startswith(" ") and "@" in narrow[i + 1] for i in wrapped)


@pytest.fixture(scope="module", params=["hf_llama", "hf_gpt2"])
def hf_plan(request):
    model, inputs = getattr(models, request.param)()
    return partitioner.plan(model, inputs, mesh_shape=(2, 2), cluster="h100")


def _reached_by_weights_or_activations(name, by_name):
    """Whether a parameter, buffer or floating-point input reaches node ``name``."""
    stack, seen = [name], set()
    while stack:
        r = by_name[stack.pop()]
        if r["kind"] in ("param", "buffer") or (r["kind"] == "input" and r["dtype"].startswith(("float", "bfloat"))):
            return True
        for src in r["inputs"]:
            if src not in seen:
                seen.add(src)
                stack.append(src)
    return False


def test_hf_plan_table_fits_and_folds_mask_and_index_rows(hf_plan):
    plan = hf_plan
    by_name = {r["name"]: r for r in plan.records}
    folded = mask_index_rows(plan.node_records)
    ops = {by_name[n]["target"].split(".")[1] for n in folded}
    # the causal mask and position ids: built from arange and comparisons, used by attention
    assert "arange" in ops and ops & {"le", "lt", "ge", "gt", "eq", "ne"}
    consumers = {by_name[c]["target"] for c in folded.values() if c}
    assert "aten.scaled_dot_product_attention" in consumers
    assert not any(_reached_by_weights_or_activations(n, by_name) for n in folded)
    assert not any(n in folded for n, r in by_name.items() if r["kind"] == "op" and r["comm"])
    assert "embedding" not in folded and _reached_by_weights_or_activations("embedding", by_name)

    text, verbose = plan.summary(), plan.summary(verbose=True)
    assert max(len(line) for line in text.splitlines()) <= 120
    assert max(len(line) for line in verbose.splitlines()) <= 120
    first_words = lambda t: {line.split()[0] for line in t.splitlines() if line.strip()}  # noqa: E731
    shown = {n for n in folded if by_name[n].get("block") is None}
    assert shown and not shown & first_words(text)          # folded by default ...
    assert shown <= first_words(verbose)                    # ... listed with verbose
    assert f"folded: {len(folded)} mask/index rows" in " ".join(text.split())
    assert "folded:" not in verbose
    assert "scaled_dot_product_attention" in text


def test_json_round_trip_is_exact_and_pickle_free(plan, tmp_path):
    path = plan.save(tmp_path / "plan.json")
    raw = json.loads(path.read_text())
    assert raw["format"] == "partita.sharding_plan" and raw["version"] == 2
    loaded = partitioner.ShardingPlan.load(path)
    assert loaded.to_dict() == plan.to_dict()
    assert loaded.estimate() == plan.estimate()
    assert not plan.diff(loaded)
    assert loaded.axis_names == ("dp", "tp") and loaded.mesh_shape == (2, 4)


def test_from_json_is_the_inverse_of_to_json(plan):
    text = plan.to_json()
    again = partitioner.ShardingPlan.from_json(text)
    assert again.to_dict() == plan.to_dict()
    assert again.to_json() == text
    assert again.placement_of("h.0.mlp.c_fc.weight") == plan.placement_of("h.0.mlp.c_fc.weight")
    assert isinstance(plan.placement_of("h.0.mlp.c_fc.weight"), str)
    with pytest.raises(ValueError, match="not valid JSON"):
        partitioner.ShardingPlan.from_json("{plan")
    with pytest.raises(ValueError, match="not a Partita sharding plan"):
        partitioner.ShardingPlan.from_json("[]")


def _dot_nodes(dot: str) -> list:
    return re.findall(r'^\s*"([^"]+)" \[label=', dot, re.M)


def test_picture_draws_repeated_layers_once_and_leaves_mask_rows_out(plan):
    one_model, one_inputs = models.gpt_block(batch=8, seq=128, n_embd=256, n_head=8, n_layer=1, vocab=512)
    deep_model, deep_inputs = models.gpt_block(batch=8, seq=128, n_embd=256, n_head=8, n_layer=8, vocab=512)
    one, deep = (partitioner.plan(m, x, mesh_shape=(2, 4), mesh_axis_names=("dp", "tp"), cluster="h100")
                 for m, x in ((one_model, one_inputs), (deep_model, deep_inputs)))
    dot = plan_to_dot(deep)
    nodes = _dot_nodes(dot)
    assert len(deep.records) > 6 * len(nodes)                       # 8 layers of ~37 nodes each ...
    assert len(nodes) <= len(_dot_nodes(plan_to_dot(one))) + 2       # ... drawn like one layer
    assert len(nodes) == len(_dot_nodes(plan_to_dot(plan)))          # and like the 3-layer plan
    assert "h.0: 8 identical blocks; h.1-h.7 same as h.0" in dot and "subgraph cluster_" in dot
    assert not any(n.startswith(("p_h_1_", "p_h_7_")) for n in nodes)
    assert 'label="from h.7"' in dot           # the last layer's output reaches ln_f, drawn from h.0's node
    assert "h.1-h.2 same as h.0" in plan_to_dot(plan)
    # mask/index rows: left out and counted on the node that uses them; drawn with verbose
    folded = mask_index_rows(deep.node_records)
    assert folded and not set(folded) & set(nodes)
    assert "mask/index rows" in dot
    assert set(folded) <= set(_dot_nodes(plan_to_dot(deep, verbose=True)))
    if shutil.which("dot"):                    # Graphviz, where installed, accepts the source
        subprocess.run(["dot", "-Tsvg", "-o", os.devnull], input=dot, text=True, check=True, timeout=120)


def test_load_refuses_other_files_and_versions(plan, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a Partita sharding plan"):
        partitioner.ShardingPlan.load(bad)
    data = dict(plan.to_dict(), version=99)
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="version 99 is not supported"):
        partitioner.ShardingPlan.load(bad)


def test_fingerprint_refuses_a_plan_for_another_model(plan, gpt):
    model, inputs = gpt
    cap = capture(model, inputs)
    plan.check_fingerprint(graph_fingerprint(cap))           # same model, same shapes: accepted
    other_model, other_inputs = models.gpt_block(batch=8, seq=128, n_embd=256, n_head=8, n_layer=2, vocab=512)
    other = graph_fingerprint(capture(other_model, other_inputs))
    with pytest.raises(partitioner.PlanMismatchError, match="different graph.*Plan again"):
        plan.check_fingerprint(other)


def test_estimate_adds_up(plan):
    est = plan.estimate()
    assert est.step_time_s == pytest.approx(est.compute_s + est.comm_s + est.optimizer_s)
    # the estimate credits prefetched gathers' overlap and adds the optimizer step, after solving
    stats = plan.data["stats"]
    solved = stats["objective_s"] - stats["prefetch_overlap_s"] - stats["bucket_overlap_s"] + stats["optimizer_step_s"]
    solved += est.flat_latency_s
    assert est.step_time_s == pytest.approx(solved, rel=1e-9)
    comm = sum(c["bytes"] for r in plan.records for c in r["comm"])
    assert est.total_comm_bytes() == pytest.approx(comm)
    assert est.memory_bytes <= plan.data["budget"]
    assert set(a for kinds in est.comm_bytes.values() for a in kinds) <= {"dp", "tp"}


def test_explain_lists_alternatives_with_the_choice_marked(plan):
    text = plan.explain("h.1.mlp.c_fc")                       # a later block explains through block 0
    assert "decided once for 3 identical nodes" in text
    chosen = [line for line in text.splitlines() if line.strip().startswith("->")]
    assert chosen and plan.placement_of("h.0.mlp.c_fc.weight") in "\n".join(chosen)
    assert text.count("out [") >= 3                           # alternatives are listed
    with pytest.raises(KeyError, match="nothing in this plan is named"):
        plan.explain("no.such.module")


def test_diff_reports_changed_placements(gpt, plan):
    model, inputs = gpt
    pinned = partitioner.plan(model, inputs, mesh_shape=(2, 4), mesh_axis_names=("dp", "tp"), cluster="h100",
                              pins={"h.*.mlp.c_fc.weight": ["R", "S(0)"]})
    assert plan.placement_of("h.0.mlp.c_fc.weight") != "[R, S(0)]"
    d = plan.diff(pinned)
    assert d
    names = [c[0] for c in d.changed]
    assert "p_h_0_mlp_c_fc_weight" in names
    assert pinned.placement_of("h.2.mlp.c_fc.weight") == "[R, S(0)]"
    assert "->" in str(d) and d.same_graph
    assert pinned.estimate().step_time_s >= plan.estimate().step_time_s - 1e-12   # the solver's plan is optimal


def test_pins_by_input_module_and_errors(gpt):
    model, inputs = gpt
    p = partitioner.plan(model, inputs, mesh_shape=(4,), cluster="h100",
                         pins={"idx": "[S(0)]", "h.*.ln_1": ["S(1)"]})
    assert p.placement_of("idx") == "[S(0)]"
    norms = [r for r in p.records if r["target"] == "aten.layer_norm" and r["module"].endswith("ln_1")]
    assert len(norms) == 3 and all(r["out"] == ["[S(1)]"] for r in norms)
    with pytest.raises(ValueError, match="matches no input, parameter, node or module"):
        partitioner.plan(model, inputs, mesh_shape=(4,), pins={"nope.weight": ["R"]})
    with pytest.raises(ValueError, match="has 2 entries; the mesh has 1 axes"):
        partitioner.plan(model, inputs, mesh_shape=(4,), pins={"idx": ["R", "R"]})
    with pytest.raises(ValueError, match="not reachable"):
        partitioner.plan(model, inputs, mesh_shape=(4,), pins={"h.*.ln_1": ["P"]})  # a norm is never partial


def test_memory_objective_uses_less_memory(gpt, plan):
    model, inputs = gpt
    lean = partitioner.plan(model, inputs, mesh_shape=(2, 4), cluster="h100", objective="memory")
    assert lean.estimate().memory_bytes < plan.estimate().memory_bytes
    lean_m, fast_m = lean.estimate().memory, plan.estimate().memory
    assert lean_m.state + lean_m.saved < fast_m.state + fast_m.saved
    assert 0 < lean.data["stats"]["least_memory"] <= lean_m.state + lean_m.inputs + lean_m.saved


def test_repeated_blocks_make_depth_nearly_free():
    sizes = {}
    for layers in (2, 8):
        model, inputs = models.gpt_block(batch=8, seq=64, n_embd=128, n_head=4, n_layer=layers, vocab=256)
        p = partitioner.plan(model, inputs, mesh_shape=(2, 2), cluster="h100")
        sizes[layers] = (p.data["stats"]["decisions"], p.data["stats"]["options"])
    assert sizes[2] == sizes[8]


def test_bad_arguments_are_named():
    model, inputs = models.mlp_demo()
    with pytest.raises(ValueError, match="objective"):
        partitioner.plan(model, inputs, objective="speed")
    with pytest.raises(ValueError, match="unknown cluster 'tpu'"):
        partitioner.plan(model, inputs, cluster="tpu")
    with pytest.raises(ValueError, match="cannot read memory size"):
        partitioner.plan(model, inputs, memory_budget="lots")
    with pytest.raises(ValueError, match="cannot read mesh"):
        partitioner.plan(model, inputs, mesh_shape="8by8")
    with pytest.raises(TypeError, match="example_inputs must be"):
        partitioner.plan(model, 3.0)


class _TransposedWeight(__import__("torch").nn.Module):
    """A matmul whose weight arrives through a view (``x @ W.t()``), then a data-only product."""

    def __init__(self):
        import torch
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 32))

    def forward(self, x):
        y = x @ self.w.t()
        return (y @ y.transpose(0, 1)).sum()


def test_estimate_prices_weight_gradients_through_views():
    """``Estimate.weight_grad_s`` (what a zero-bubble W pass runs) is the weight product of the
    matmul whose weight is a view of a parameter, and nothing of the data-only product."""
    import torch
    model, x = _TransposedWeight(), torch.randn(128, 32)
    p = partitioner.plan(model, (x,), mesh_shape=(1,), cluster="h100")
    matmuls = [r for r in p.records if r["target"].startswith("aten.mm") or r["target"].startswith("aten.matmul")]
    assert len(matmuls) == 2, [r["target"] for r in p.records]
    weighted, data_only = matmuls
    # x needs no gradient: the record's time is forward + weight product, half each
    assert weighted["weight_grad_s"] == pytest.approx(weighted["compute_s"] / 2)
    assert "weight_grad_s" not in data_only
    assert p.estimate().weight_grad_s == pytest.approx(weighted["weight_grad_s"])


def test_activation_copies_multiply_activation_memory_only():
    """A pipeline stage holding k microbatches' activations is planned with ``activation_copies=k``:
    every op's saved-activation memory is k times one copy's; parameters and optimizer state are
    counted once."""
    from partitioner.api import plan_captured
    from passes.analysis.analyze import analyze
    model, inputs = models.gpt_demo(batch=4, seq=16, n_layer=2)
    cap = capture(model, inputs)
    analyze(cap)
    one = plan_captured(cap, model_name="gpt", mesh_shape=(1,), cluster="h100")
    three = plan_captured(cap, model_name="gpt", mesh_shape=(1,), cluster="h100", activation_copies=3)
    assert three.data["activation_copies"] == 3
    ops = [(a, b) for a, b in zip(one.records, three.records, strict=True) if a["kind"] == "op" and a.get("memory")]
    assert ops and all(b["memory"] == pytest.approx(3 * a["memory"]) for a, b in ops)
    params = [(a, b) for a, b in zip(one.records, three.records, strict=True) if a["kind"] == "param"]
    assert params and all(b["memory"] == a["memory"] for a, b in params)
    m1, m3 = one.estimate().memory, three.estimate().memory
    assert m1.saved > 0 and m3.saved == pytest.approx(3 * m1.saved)
    assert (m3.parameters, m3.gradients, m3.optimizer_state) == (m1.parameters, m1.gradients, m1.optimizer_state)


def test_a_recomputed_layer_rebuilds_one_microbatch_whatever_the_copies_in_flight():
    """With recomputation, k microbatches in flight keep k copies of what leaves each layer, but
    backward reruns one layer of one microbatch at a time: the solver's memory (the records) grows
    by the kept bytes only, as the estimate's does."""
    from partitioner.api import plan_captured
    from passes.analysis.analyze import analyze
    model, inputs = models.gpt_demo(batch=4, seq=16, n_layer=3)
    cap = capture(model, inputs)
    analyze(cap)

    def solver_memory(copies):
        plan = plan_captured(cap, model_name="gpt", mesh_shape=(1,), cluster="h100", recompute="all",
                             activation_copies=copies)
        assert any(r.get("recompute") for r in plan.records)
        ops = [r for r in plan.records if r["kind"] == "op"]
        return sum(r.get("memory", 0.0) for r in ops), plan.estimate().memory

    (one, m1), (two, m2), (eight, m8) = solver_memory(1), solver_memory(2), solver_memory(8)
    kept_per_copy = two - one
    rebuilt = one - kept_per_copy
    assert kept_per_copy > 0 and rebuilt > 0
    assert eight == pytest.approx(rebuilt + 8 * kept_per_copy)   # the rebuild is counted once
    # the estimate agrees: kept activations grow by the same bytes per copy
    assert m2.saved_activations - m1.saved_activations == pytest.approx(kept_per_copy)
    assert m8.saved_activations - m1.saved_activations == pytest.approx(7 * (m2.saved_activations - m1.saved_activations))
