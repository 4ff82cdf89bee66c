"""One options object for every entry point: the same names and defaults in ``plan``,
``auto_parallelize`` and the CLI; every option honoured in every mode (a mesh, the
configuration search, a pipeline, a replayed plan) or refused with an error naming it."""

from __future__ import annotations

import contextlib
import inspect
import io
import math
from dataclasses import fields

import pytest
import torch.distributed as dist

import partitioner
from partitioner import PlanOptions, models
from partitioner.__main__ import main

# the CLI's flag for each option whose flag is not the option's name in dashes
_CLI_FLAGS = {"memory_budget": "--budget", "host_memory_budget": "--host-budget", "pins": "--pin",
              "share_blocks": "--no-share-blocks"}


def _cli_flags() -> set:
    import argparse

    from partitioner.__main__ import _parser as build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {flag for action in sub.choices["plan"]._actions for flag in action.option_strings}


def test_plan_auto_parallelize_and_the_cli_take_the_same_options():
    plan_sig = inspect.signature(partitioner.plan).parameters
    run_sig = inspect.signature(partitioner.auto_parallelize).parameters
    flags = _cli_flags()
    for f in fields(PlanOptions):
        for where, sig in (("plan", plan_sig), ("auto_parallelize", run_sig)):
            assert f.name in sig, f"{where} lacks the option {f.name}"
            assert sig[f.name].default == f.default, (where, f.name, sig[f.name].default, f.default)
        flag = _CLI_FLAGS.get(f.name, "--" + f.name.replace("_", "-"))
        assert flag in flags, f"the CLI's plan command lacks {flag} (option {f.name})"
    assert "options" in plan_sig and "options" in run_sig
    assert "devices" in plan_sig and "--devices" in flags


def test_bad_option_values_are_refused_by_name():
    for kwargs, message in [
        (dict(objective="speed"), "objective must be one of"),
        (dict(layers="some"), "layers must be 'auto', 'full' or 'blocks'"),
        (dict(zero=4), "zero must be one of"),
        (dict(time_limit=0), "time_limit must be a positive"),
        (dict(memory_budget="lots"), "memory_budget"),
        (dict(sequence_parallel="zigzag"), "sequence_parallel must be one of"),
        (dict(share_blocks="yes"), "share_blocks must be True or False"),
    ]:
        with pytest.raises(ValueError, match=message):
            PlanOptions(**kwargs)
    with pytest.raises(TypeError, match="unknown planning options"):
        PlanOptions.build(mesh=(2, 2))


def test_options_object_and_keywords_combine():
    base = PlanOptions(zero=3, cluster="h100")
    model, inputs = models.gpt_demo(batch=8, seq=16, n_layer=2)
    plan = partitioner.plan(model, inputs, mesh=(4,), options=base, objective="memory")
    assert (plan.data["zero"], plan.data["objective"], plan.data["cluster"]["name"]) == (3, "memory", "h100")
    with pytest.raises(ValueError, match="give the mesh once"):
        partitioner.plan(model, inputs, mesh=(4,), mesh_shape=(4,))


def test_the_default_cluster_is_this_machine_as_auto_parallelize_uses():
    """No GPU here: plan() and auto_parallelize() both price with the measured CPU cluster
    (tests pin its figures: conftest's FIXED_CPU)."""
    model, inputs = models.gpt_demo(batch=8, seq=16, n_layer=1)
    plan = partitioner.plan(model, inputs, mesh=(2,))
    assert plan.data["cluster"] == partitioner.get_cluster("cpu").to_dict()


def test_the_search_honours_its_options_or_refuses_them():
    model, inputs = models.gpt_demo(batch=8, seq=16, n_layer=2)
    kw = dict(devices=4, cluster="h100")
    with pytest.raises(ValueError, match=r"objective='memory' is not available in the configuration search"):
        partitioner.plan(model, inputs, objective="memory", **kw)
    with pytest.raises(ValueError, match=r"pins=.* is not available in the configuration search"):
        partitioner.plan(model, inputs, pins={"idx": ["S(0)"]}, **kw)
    with pytest.raises(ValueError, match=r"tensor_parallel='2d' is not available in the configuration search"):
        partitioner.plan(model, inputs, tensor_parallel="2d", **kw)
    # a forced ZeRO mode and the other options reach the plan the search makes: it is the plan
    # of the chosen mesh with the same options (a budget that makes the solver shard weights)
    from partitioner.search import search_config
    opts = dict(cluster="h100", zero=3, share_blocks=False, time_limit=30.0, memory_budget=1_450_000)
    searched = search_config(model, inputs, devices=4, pipelines=False, **opts)
    assert searched.data["zero"] == 3 and searched.data["share_blocks"] is False
    # the forced mode changes the plan: the same mesh under zero="auto" holds another amount (a plan
    # on that mesh, not a second search: the search's budgeted solves are most of this test's CPU)
    on_mesh = dict(mesh=searched.mesh_shape, mesh_axis_names=searched.axis_names)
    auto = partitioner.plan(model, inputs, **on_mesh, **dict(opts, zero="auto"))
    assert searched.estimate().memory_bytes != auto.estimate().memory_bytes
    same = partitioner.plan(model, inputs, **on_mesh, **opts)
    assert [(r["name"], r["out"]) for r in searched.records] == [(r["name"], r["out"]) for r in same.records]
    assert searched.estimate().memory_bytes == same.estimate().memory_bytes
    one_d = partitioner.plan(model, inputs, tensor_parallel="1d", **kw)
    assert one_d.config.tensor > 1 and one_d.data["tensor_parallel"] == "1d", one_d.config


def test_the_search_honours_a_forced_sequence_algorithm():
    """A batch smaller than the devices offers sequence splits: a forced algorithm keeps only
    the candidates running it, and ``"none"`` none of them."""
    model, inputs = models.gpt_demo(batch=2, seq=64, n_layer=2)
    kw = dict(devices=4, cluster="h100", sequence_parallel="ulysses")
    forced = partitioner.plan(model, inputs, **kw)
    assert forced.config.sequence > 1 and forced.config.sequence_parallel == "ulysses", forced.config
    none = partitioner.plan(model, inputs, devices=4, cluster="h100", sequence_parallel="none")
    assert none.config.sequence == 1 and none.data["sequence_parallel"] == "none"


@contextlib.contextmanager
def _fake_job(world: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kwargs, message", [
    (dict(host_memory_budget="1GiB"), r"host_memory_budget='1GiB' is not available with pipeline="),
    (dict(local_inputs=True), r"local_inputs=True is not available with pipeline="),
    (dict(tensor_parallel="2d"), r"tensor_parallel='2d' is not available with pipeline="),
    (dict(recompute="all"), r"recompute='all' is not available with pipeline="),
])
def test_pipeline_mode_refuses_what_its_stages_cannot_honour(kwargs, message):
    model, inputs = models.gpt_demo(batch=8, seq=16, n_layer=2)
    with _fake_job(4), pytest.raises(ValueError, match=message):
        partitioner.auto_parallelize(model, inputs, mesh=(2, 2), cluster="h100", pipeline={"degree": 2}, **kwargs)


def test_a_replayed_plan_refuses_options_it_was_not_made_with():
    model, inputs = models.gpt_demo(batch=8, seq=16, n_layer=1)
    plan = partitioner.plan(model, inputs, mesh=(2,), cluster="h100")
    with _fake_job(2):
        with pytest.raises(ValueError, match=r"zero=3 is not available with plan=: the plan was made with zero='auto'"):
            partitioner.auto_parallelize(model, inputs, mesh=(2,), plan=plan, zero=3)
        with pytest.raises(ValueError, match=r"pins=.* is not available with plan="):
            partitioner.auto_parallelize(model, inputs, mesh=(2,), plan=plan, pins={"idx": ["R"]})


def _preview_worker(rank, world, cfg):
    import partitioner
    model, inputs = models.hf_llama(batch=2, seq=64, kv_heads=2)
    pm = partitioner.auto_parallelize(model, inputs, mesh=tuple(cfg["mesh"]), precision="bf16")
    return {"records": [(r["name"], r.get("out"), r.get("in")) for r in pm.plan.records],
            "step": pm.plan.estimate().step_time_s, "failures": []}


def test_the_preview_is_the_plan_that_runs():
    """``plan()`` and ``auto_parallelize()`` with the same arguments and their defaults make the
    same plan (the same cluster: this machine's)."""
    from tests.parity_utils import run_checked
    cfg = {"mesh": [2]}
    model, inputs = models.hf_llama(batch=2, seq=64, kv_heads=2)
    preview = partitioner.plan(model, inputs, mesh=(2,), precision="bf16")
    ran = run_checked(_preview_worker, cfg, timeout_s=240)[0]
    assert ran["records"] == [(r["name"], r.get("out"), r.get("in")) for r in preview.records]
    assert math.isclose(ran["step"], preview.estimate().step_time_s, rel_tol=1e-9)


def test_cli_plans_for_a_device_count_without_a_mesh():
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", "partitioner.models:gpt_demo", "--kwargs", '{"n_layer": 2, "seq": 16}',
                     "--devices", "4", "--precision", "bf16", "--cluster", "h100", "-q"])
    assert code == 0, err.getvalue()
    assert "bfloat16" in out.getvalue() or "bf16" in out.getvalue(), out.getvalue()[:2000]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err := io.StringIO()):
        code = main(["plan", "partitioner.models:gpt_demo", "-q"])
    assert code == 2 and "give --mesh (e.g. 8x8) or --devices N" in err.getvalue()


def test_pipeline_stages_are_planned_with_the_options_given():
    """Every stage plan carries the job's options (before, stages dropped zero, tensor_parallel,
    optimizer and share_blocks): with ``optimizer="sgd"`` a stage counts no Adam moments."""
    model, inputs = models.gpt_demo(batch=8, seq=16, n_layer=4)
    pipeline = {"degree": 2, "schedule": "1f1b", "microbatches": 4}
    opts = dict(zero=3, share_blocks=False, tensor_parallel="1d", optimizer="sgd")
    with _fake_job(4):
        runner = partitioner.auto_parallelize(model, inputs, mesh=(2, 2), cluster="h100", pipeline=pipeline, **opts)
        adam = partitioner.auto_parallelize(model, inputs, mesh=(2, 2), cluster="h100", pipeline=pipeline)
    for stage, other in zip(runner.plan["stages"], adam.plan["stages"], strict=True):
        assert {k: stage.data[k] for k in opts} == opts
        assert stage.data["recompute"] == "none"
        assert stage.estimate().memory.optimizer_state < other.estimate().memory.optimizer_state


def test_a_pin_that_shards_a_dim_its_tensor_lacks_is_refused_naming_both():
    import torch

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
    x = torch.randn(4, 3, 8, 8)
    # "1.*" matches the norm's weight and bias (1-d) and its 0-d step counter as well
    refused = r"pin '1\.\*' .* shards dim 0 of '1\.num_batches_tracked', whose shape is \(\)"
    with pytest.raises(ValueError, match=refused):
        partitioner.plan(model, x, mesh=(2,), pins={"1.*": ["S(0)"]})
