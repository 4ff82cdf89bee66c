"""The forced algorithm modes reach the op rules as a value (``passes.core.rule_options.RuleOptions``
on every ``OpView``), not as module state: two strategy spaces of one graph built with
different modes, interleaved, each offer their own candidates. Single process."""
from __future__ import annotations

import pytest
import torch

from partitioner import PlanOptions, models
from partitioner.local_cluster import get_cluster
from passes.analysis.analyze import analyze
from passes.capture.blocks import find_blocks
from passes.capture.capture import capture
from passes.core.rule_options import RuleOptions
from passes.plan.strategy_space import build_space
from passes.rules import op_view, rule_for

aten = torch.ops.aten


@pytest.fixture(scope="module")
def gpt_capture():
    model, inputs = models.gpt_block(batch=2, seq=16, n_embd=32, n_head=4, n_layer=1, vocab=64)
    cap = capture(model, inputs)
    analyze(cap)
    return cap


def _attention(cap):
    return next(n for n in cap.graph.nodes if n.target is aten.scaled_dot_product_attention.default)


def _attention_notes(space, node) -> set:
    group = space.groups[space.group_of[node]]
    return {a.note for option in group.options for a in option[node].strategy.axes}


def test_a_rule_reads_the_modes_of_the_view_it_is_given(gpt_capture):
    node = _attention(gpt_capture)
    rule = rule_for(node)

    def notes(options):
        return {s.note for s in rule.axis_strategies(op_view(node, options))}

    mesh = (2,)
    assert {"ring", "ulysses"} <= notes(RuleOptions(mesh_shape=mesh))
    assert "ulysses" not in notes(RuleOptions(mesh_shape=mesh, sequence_parallel="ring"))
    assert not {"ring", "ulysses"} & notes(RuleOptions(mesh_shape=mesh, sequence_parallel="none"))
    # a view made without options plans as "auto" (nothing forced)
    assert notes(RuleOptions(mesh_shape=mesh)) == {s.note for s in rule.axis_strategies(op_view(node))}


def test_two_spaces_with_different_modes_built_interleaved_keep_their_own(gpt_capture):
    cap, mesh = gpt_capture, (2,)
    blocks, cluster, node = find_blocks(cap.graph), get_cluster("h100"), _attention(gpt_capture)

    def space(mode):
        return build_space(cap.graph, blocks, mesh, cluster, rule_options=RuleOptions(mesh_shape=mesh, sequence_parallel=mode))

    ring, none, ulysses = space("ring"), space("none"), space("ulysses")
    assert "ring" in _attention_notes(ring, node) and "ulysses" not in _attention_notes(ring, node)
    assert not {"ring", "ulysses"} & _attention_notes(none, node)
    assert "ulysses" in _attention_notes(ulysses, node) and "ring" not in _attention_notes(ulysses, node)
    # the rule's candidates are cached per space, never across spaces
    assert _attention_notes(space("auto"), node) >= {"ring", "ulysses"}


def test_plan_options_make_the_rule_options_and_bad_modes_are_refused_by_name():
    opts = PlanOptions(tensor_parallel="1d", sequence_parallel="ring", expert_parallel="off")
    assert opts.rule_options((2, 2)) == RuleOptions(
        mesh_shape=(2, 2), tensor_parallel="1d", sequence_parallel="ring", expert_parallel="off"
    )
    for name in ("tensor_parallel", "sequence_parallel", "expert_parallel"):
        with pytest.raises(ValueError, match=f"{name} must be one of"):
            RuleOptions(**{name: "sideways"})
    with pytest.raises(AttributeError):
        RuleOptions().tensor_parallel = "2d"  # frozen: a plan's modes cannot change under it
