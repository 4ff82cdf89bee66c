"""The plan file's format: a typed header (``partitioner.plan_format.PlanHeader``), version 2, and
the migration that reads version-1 files. ``tests/data/plan_v1_mlp.json`` was written by the
code before version 2 (``partitioner.plan(mlp_demo(batch=8), mesh=(2, 2), cluster="h100",
memory_budget="80GiB")``); it loads as the plan the same call makes now, but for the memory
fields written differently since (:data:`CHANGED_SINCE`: the backward walk's gradients; a file
without them reports the peak from the bound that does not walk backward). Single process."""
from __future__ import annotations

import copy
import json
from dataclasses import fields, replace
from pathlib import Path

import pytest

import partitioner
from partitioner import ShardingPlan, models
from partitioner.plan_format import PLAN_VERSION, PlanHeader

V1_FILE = Path(__file__).parent / "data" / "plan_v1_mlp.json"
HEADER_KEYS = [f.name for f in fields(PlanHeader)]
# record fields written since the file was made (gradients alive in backward, out of transient_bwd)
CHANGED_SINCE = ("gradients_alive", "transient_bwd")


def _unchanged(records: list) -> list:
    return [{k: v for k, v in r.items() if k not in CHANGED_SINCE} for r in records]


def _options_but_memory(alternatives: dict) -> dict:
    """The alternatives without the options' memory (the ILP's row has held a parameter gather's
    copy back into order since the file was made: passes/plan/move_scratch.py)."""
    return {
        name: {**a, "options": [{k: v for k, v in o.items() if k != "memory"} for o in a["options"]]}
        for name, a in alternatives.items()
    }


def _same_but_memory(old, fresh) -> None:
    """The estimates agree on everything but the peak (the old file's is the backward bound)."""
    a, b = old.estimate(), fresh.estimate()
    assert replace(a, memory_bytes=0, memory=None) == replace(b, memory_bytes=0, memory=None)
    assert a.memory_bytes >= b.memory.forward_peak and a.memory.state == b.memory.state


@pytest.fixture(scope="module")
def fresh():
    model, inputs = models.mlp_demo(batch=8)
    return partitioner.plan(model, inputs, mesh=(2, 2), mesh_axis_names=("dp", "tp"), cluster="h100",
                            memory_budget="80GiB")


def test_a_version_1_file_loads_as_the_plan_made_now(fresh):
    raw = json.loads(V1_FILE.read_text())
    assert raw["version"] == 1
    old = ShardingPlan.load(V1_FILE)
    assert PLAN_VERSION == 2 and old.data["version"] == 2 and fresh.data["version"] == 2
    assert old.header == fresh.header
    assert _unchanged(old.data["records"]) == _unchanged(fresh.data["records"])
    assert _options_but_memory(old.data["alternatives"]) == _options_but_memory(fresh.data["alternatives"])
    assert old.data["blocks"] == fresh.data["blocks"]
    _same_but_memory(old, fresh)
    untimed = lambda plan: [  # noqa: E731
        line for line in plan.summary().splitlines() if "solved in" not in line and "memory" not in line
    ]
    assert untimed(old) == untimed(fresh)


def test_keys_an_older_version_1_writer_left_out_get_their_defaults(fresh):
    raw = json.loads(V1_FILE.read_text())
    dropped = ["structure", "routing", "tensor_parallel", "expert_parallel", "host_memory_budget", "flops_dtype"]
    for key in dropped:
        del raw[key]
    old = ShardingPlan.from_dict(raw)
    assert set(HEADER_KEYS) <= set(old.data)
    header = old.header
    assert (header.tensor_parallel, header.expert_parallel, header.routing, header.structure) == ("auto", "auto", None, None)
    _same_but_memory(old, fresh)


def test_the_stage_plans_of_a_version_1_pipeline_are_migrated_too():
    stage = json.loads(V1_FILE.read_text())
    del stage["expert_parallel"]
    pipelined = {k: stage[k] for k in ("format", "version", "model", "inputs", "mesh", "cluster", "budget")}
    pipelined.update(fingerprint=None, records=[], alternatives={}, blocks=[], stats={},
                     pipeline={"stage_plans": [copy.deepcopy(stage), copy.deepcopy(stage)]})
    plan = ShardingPlan.from_dict(pipelined)
    assert plan.data["version"] == 2
    assert [s["version"] for s in plan.data["pipeline"]["stage_plans"]] == [2, 2]
    assert all(s["expert_parallel"] == "auto" for s in plan.data["pipeline"]["stage_plans"])


def test_json_round_trip_keeps_the_typed_header(fresh, tmp_path):
    again = ShardingPlan.load(fresh.save(tmp_path / "plan.json"))
    assert again.header == fresh.header and again.to_dict() == fresh.to_dict()
    assert list(fresh.data)[: len(HEADER_KEYS)] == HEADER_KEYS  # the header first, in its fields' order
    assert fresh.header.mesh == {"shape": [2, 2], "axis_names": ["dp", "tp"]}


def test_unknown_versions_and_incomplete_files_are_refused_by_name(fresh):
    with pytest.raises(ValueError, match="version 3 is not supported .*reads versions 1 and 2"):
        ShardingPlan.from_dict(dict(fresh.to_dict(), version=3))
    incomplete = {k: v for k, v in fresh.to_dict().items() if k != "mesh"}
    with pytest.raises(ValueError, match=r"lacks \['mesh'\]"):
        ShardingPlan.from_dict(incomplete)
    with pytest.raises(ValueError, match="not a Partita sharding plan"):
        ShardingPlan.from_dict({"version": 2})


def test_a_file_written_before_the_planner_recorded_its_prices_is_priced_as_it_loads():
    """The estimate adds up prices the planner wrote (the header's ``flat_latency_s`` and
    ``arrival_wait_s``, the ``held`` marks of the gradient reductions a pipeline stage holds back);
    a file without them gets them from the planner's own functions as it loads, equal to a fresh plan's."""
    import dataclasses

    model, inputs = models.gpt_demo(batch=8, seq=16, n_layer=2, n_embd=64, n_head=4, vocab_size=128)
    cluster = dataclasses.replace(partitioner.get_cluster("h100"), arrival_wait=[[0.0, 2e-6], [1e-3, 5e-6]])
    pins = {"idx": ["S(0)"], "targets": ["S(0)"], "*": ["R"], "h.*": ["S(0)"], "ln_f": ["S(0)"], "lm_head": ["S(0)"]}
    fresh = partitioner.plan(model, inputs, mesh=(4,), cluster=cluster, pins=pins, recompute="none")
    est = fresh.estimate()
    held = [c for r in fresh.records for c in r["comm"] if c.get("held")]
    assert held and est.flat_latency_s > 0 and est.arrival_wait_s > 0
    assert est.grad_sync_s == pytest.approx(sum(c["time_s"] for c in held), rel=1e-12)
    older = copy.deepcopy(fresh.to_dict())
    del older["flat_latency_s"], older["arrival_wait_s"]
    for r in older["records"]:
        for c in r["comm"]:
            c.pop("held", None)
    again = ShardingPlan.from_dict(older)
    assert again.header == fresh.header and again.data["records"] == fresh.data["records"]
    assert again.estimate() == est
    # the estimate prices nothing itself: it adds up what the header says
    more = ShardingPlan.from_dict(dict(fresh.to_dict(), flat_latency_s=est.flat_latency_s + 1.0))
    assert more.estimate().comm_s == pytest.approx(est.comm_s + 1.0, rel=1e-12)
