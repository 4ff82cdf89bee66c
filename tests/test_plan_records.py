"""The plan's records typed (``passes.core.plan_records``): every key the planner writes is a field,
and the JSON round-trips exactly, on plans of several kinds and on a version-1 file. Single process."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import partitioner
from partitioner import ShardingPlan, models
from passes.core.plan_records import CollectiveRecord, NodeRecord

V1_FILE = Path(__file__).parent / "data" / "plan_v1_mlp.json"


@pytest.fixture(scope="module")
def plans():
    mlp, mlp_inputs = models.mlp_demo(batch=8)
    gpt, gpt_inputs = models.gpt_demo(batch=2, seq=16, n_layer=2, n_embd=32, n_head=2)
    return {
        "mlp 2x2": partitioner.plan(mlp, mlp_inputs, mesh=(2, 2), cluster="h100", memory_budget="80GiB"),
        "gpt recomputed, ZeRO-1": partitioner.plan(gpt, gpt_inputs, mesh=(4,), cluster="h100", recompute="all", zero=1),
        "version-1 file": ShardingPlan.load(V1_FILE),
    }


def test_every_key_is_a_field_and_the_json_round_trips(plans):
    seen = set()
    for label, plan in plans.items():
        assert len(plan.node_records) == len(plan.records), label
        for raw, typed in zip(plan.records, plan.node_records):
            assert typed.extra == {} and all(c.extra == {} for c in typed.comm), (label, typed.name, typed.extra)
            assert typed.to_dict() == raw, (label, raw["name"])
            assert NodeRecord.from_dict(json.loads(json.dumps(typed.to_dict()))) == typed
            seen |= {k for k, v in raw.items() if v is not None}
    # the plans exercise the optional fields as well as the required ones
    assert {"stored", "recompute", "recompute_s", "region", "block", "grads", "saved_activations"} <= seen, seen


def test_typed_records_read_what_the_dicts_hold(plans):
    plan = plans["gpt recomputed, ZeRO-1"]
    raw = next(r for r in plan.records if r.get("stored"))
    typed = plan.node_by_name[raw["name"]]
    assert (typed.stored, typed.out, typed.kind, typed.fqn) == (raw["stored"], raw["out"], "param", raw["fqn"])
    assert [c.time_s for c in typed.comm] == [c["time_s"] for c in raw["comm"]]
    assert typed.output_placement == raw["out"][0]


def test_unknown_keys_are_kept_and_missing_ones_named():
    comm = {"kind": "all_reduce", "axis": "dp", "bytes": 8.0, "phase": "bwd", "input": 0, "time_s": 1e-6}
    raw = {
        "name": "mm", "kind": "op", "module": "", "target": "aten.mm.default", "fqn": None, "shapes": [[2, 2]],
        "dtype": "float32", "inputs": ["x", "w"], "rep": "mm", "out": ["[R]"], "ins": ["[R]", "[R]"],
        "local_shapes": [[2, 2]], "comm": [dict(comm, from_a_newer_writer=1)], "compute_s": 1e-6, "memory": 16.0,
        "also_newer": [1, 2],
    }
    typed = NodeRecord.from_dict(raw)
    assert typed.extra == {"also_newer": [1, 2]} and typed.comm[0].extra == {"from_a_newer_writer": 1}
    assert typed.to_dict() == raw
    del raw["rep"]
    with pytest.raises(ValueError, match=r"NodeRecord: the plan record 'mm' lacks \['rep'\]"):
        NodeRecord.from_dict(raw)
    with pytest.raises(ValueError, match=r"lacks \['time_s'\]"):
        CollectiveRecord.from_dict({k: v for k, v in comm.items() if k != "time_s"})
