"""Checkpoint and resume: ``partitioner.save_checkpoint`` / ``load_checkpoint``, the standard
``torch.distributed.checkpoint.state_dict`` functions, pipelines, and a rank killed under torchrun.

Parity (tier 3): every multi-process test trains a parallel model beside a single-device
reference (a deep copy, the same AdamW with the parity tests' ``eps``, and LR schedule), saves,
loads into a fresh parallel model under ANOTHER mesh, plan or pipeline, and checks that

* what was loaded equals what was saved, exactly: every parameter (``full_state_dict()``) and
  every optimizer state tensor, gathered whole;
* training goes on as if uninterrupted: the losses of the next steps and the parameters after
  them equal the reference's (``torch.testing.assert_close`` defaults, fp32).

The kill-a-rank test runs ``tests/fault_train.py`` under ``torchrun --max-restarts 1``; the
whole run's losses (the steps replayed after the restart bitwise equal to the first attempt's)
equal a single-process run of the same training, step for step.
"""
import copy
import os
import random
import signal
import subprocess
import sys

import numpy
import pytest
import torch
import torch.distributed as dist
from parity_utils import ADAM_EPS, LR, Checks, call, loss_of, pins_for, prebuilt, run_checked

import partitioner
from partitioner import models
from passes.core.placements import Shard
from runtime.collectives import MeshComm
from runtime.launch import find_free_port, run_on_ranks
from runtime.sharded_state import TensorLayout

TIMEOUT_S = 180
STEPS = 3
COLUMN = "h.0.mlp.c_fc.weight"      # column-parallel under Megatron pins
STRIDED = "h.0.attn.c_attn.weight"  # fused QKV: stored in the strided layout when split


def _gpt(**kw):
    return models.gpt_demo(batch=8, seq=16, n_layer=2, **kw)


GPT_TWICE = [("gpt", _gpt), ("gpt/fresh", _gpt)]
"""The two GPTs a resume worker plans (trained, then fresh to load into), built and captured in the
parent before it forks the ranks (``parity_utils.run_checked``)."""


def _gpt2():
    return models.hf_gpt2(batch=4, seq=16)


PIPELINE = {"degree": 2, "schedule": "1f1b", "microbatches": 2}
GPT2_THREE = [("gpt2/pipeline", _gpt2, {"pipeline": PIPELINE}), ("gpt2/whole", _gpt2),
              ("gpt2/pipeline-again", _gpt2, {"pipeline": PIPELINE})]
"""The GPT-2s of the pipeline checkpoint worker (pipelined, not, pipelined again), built and their
captures made in the parent."""


def _optimizer(params, scheduled=True):
    opt = torch.optim.AdamW(params, lr=LR, eps=ADAM_EPS)
    return opt, (torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if scheduled else None)


def _lockstep(step_fn, opt, sched, ref, ref_opt, ref_sched, inputs, steps, checks, what):
    """``steps`` optimizer steps on the parallel model (``step_fn()``: forward + backward, returns
    the loss) and the reference side by side, comparing the losses."""
    for step in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = step_fn()
        ref_loss = loss_of(call(ref, inputs))
        ref_loss.backward()
        checks.close(f"loss at step {step} {what}", loss.detach(), ref_loss.detach())
        for o, s in ((opt, sched), (ref_opt, ref_sched)):
            o.step()
            if s is not None:
                s.step()


def _forward_backward(model, inputs):
    def step():
        loss = loss_of(call(model, inputs))
        loss.backward()
        return loss
    return step


def _full_optimizer_state(optimizer) -> dict:
    """FQN -> {state name: whole tensor} for every parameter ``optimizer`` steps, on every rank (a
    collective over the job: each rank gathers its own stages' tensors, then all exchange)."""
    from torch.distributed.tensor import DTensor

    from runtime.sharded_state import layout_of, parameter_fqns

    mine = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = {}
            for name, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    value = layout_of(p).to_global(value)
                    value = value.full_tensor() if isinstance(value, DTensor) else value
                entry[name] = value.clone() if isinstance(value, torch.Tensor) else value
            for fqn in parameter_fqns(p):
                mine[fqn] = entry
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {fqn: entry for part in parts for fqn, entry in part.items()}


def _check_equal(checks, what, loaded: dict, saved: dict, keys):
    for key in keys:
        checks.close(f"{what} {key}", loaded[key], saved[key], rtol=0, atol=0)


def _check_against_reference(checks, what, state: dict, ref):
    for name, p in ref.named_parameters(remove_duplicate=False):
        if name in state:
            checks.close(f"{what}: parameter {name}", state[name], p.detach())


def _draws() -> tuple:
    return torch.rand(3), random.random(), numpy.random.rand(2)


# ---------------------------------------------------------------- save_checkpoint / load_checkpoint


def _resume_worker(rank, world, cfg):
    checks = Checks(rank)
    model, inputs = prebuilt("gpt") or _gpt()  # the parent's, captured there (GPT_TWICE)
    ref = copy.deepcopy(model)
    ref_opt, ref_sched = _optimizer(ref.parameters())
    pm = partitioner.auto_parallelize(model, inputs, mesh=cfg["mesh_a"], cluster="h100",
                                      pins=pins_for("gpt", cfg["plan_a"], cfg["mesh_a"]))
    opt, sched = _optimizer(pm.parameters())
    _lockstep(_forward_backward(pm, inputs), opt, sched, ref, ref_opt, ref_sched, inputs, STEPS, checks,
              "before saving")
    partitioner.save_checkpoint(cfg["path"], pm, opt, scheduler=sched, step=STEPS, position={"epoch": 1, "batch": 5})
    expected_draws = _draws()                        # what the generators give next, as saved
    saved_params, saved_optim = pm.full_state_dict(), _full_optimizer_state(opt)

    fresh, _ = prebuilt("gpt/fresh") or _gpt()
    pm_b = partitioner.auto_parallelize(fresh, inputs, mesh=cfg["mesh_b"], cluster="h100",
                                        pins=pins_for("gpt", cfg["plan_b"], cfg["mesh_b"]))
    random.seed(100 + rank)                          # move every generator on
    numpy.random.seed(100 + rank)
    torch.manual_seed(100 + rank)
    opt_b, sched_b = _optimizer(pm_b.parameters())
    try:                                             # refused before anything is loaded
        partitioner.load_checkpoint(cfg["path"], pm_b, opt_b, sampler=sched_b)
        checks.true("a stateful object the checkpoint does not hold was accepted", False)
    except KeyError as exc:
        checks.true(f"error for a missing stateful object: {exc}", "saved no state dict named 'sampler'" in str(exc))
    extra = partitioner.load_checkpoint(cfg["path"], pm_b, opt_b, scheduler=sched_b)
    checks.true(f"extra values {extra}", extra == {"step": STEPS, "position": {"epoch": 1, "batch": 5},
                                                   "scheduler": sched.state_dict()})
    for what, got, want in zip(("torch", "random", "numpy"), _draws(), expected_draws):
        checks.true(f"{what} generator after loading: {got} vs {want}", numpy.array_equal(numpy.asarray(got),
                                                                                        numpy.asarray(want)))
    checks.true(f"learning rate {opt_b.param_groups[0]['lr']} vs {ref_opt.param_groups[0]['lr']}",
                opt_b.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == sched.get_last_lr()[0])
    _check_equal(checks, "loaded parameter", pm_b.full_state_dict(), saved_params, saved_params)
    loaded_optim = _full_optimizer_state(opt_b)
    for fqn, entry in saved_optim.items():
        _check_equal(checks, f"loaded optimizer state of {fqn}:", loaded_optim[fqn], entry, entry)

    _lockstep(_forward_backward(pm_b, inputs), opt_b, sched_b, ref, ref_opt, ref_sched, inputs, STEPS, checks,
              "after loading")
    _check_against_reference(checks, f"after {2 * STEPS} steps", pm_b.full_state_dict(), ref)
    return {"failures": checks.failures, "placements": [pm.placement_of(COLUMN), pm_b.placement_of(COLUMN)],
            "strided": [STRIDED in pm.strided_layouts(), STRIDED in pm_b.strided_layouts()]}


def test_resume_under_another_mesh_and_plan_continues_like_one_device(tmp_path):
    """AdamW + StepLR, 3 steps on (2, 2) data x Megatron, saved; loaded into Megatron with
    vocabulary-parallel embedding on (4,); 3 more steps equal the uninterrupted reference."""
    cfg = {"mesh": (2, 2), "mesh_a": (2, 2), "plan_a": "dp_tp", "mesh_b": (4,), "plan_b": "tp",
           "path": str(tmp_path / "ckpt")}
    results = run_checked(_resume_worker, cfg, TIMEOUT_S, prebuild=GPT_TWICE)
    assert results[0]["placements"] == ["[R, S(0)]", "[S(0)]"], results[0]["placements"]
    assert results[0]["strided"] == [True, True]      # the fused QKV is gathered on save, sliced on load


# ------------------------------------------------------ torch.distributed.checkpoint's own functions


def _dcp_worker(rank, world, cfg):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor import DTensor, Replicate

    checks = Checks(rank)
    model, inputs = prebuilt("gpt") or _gpt()  # the parent's, captured there (GPT_TWICE)
    ref = copy.deepcopy(model)
    ref_opt, _ = _optimizer(ref.parameters(), scheduled=False)
    pm = partitioner.auto_parallelize(model, inputs, mesh=(2, 2), cluster="h100", pins=pins_for("gpt", "dp_tp", (2, 2)))
    moved = {name: value + 0.5 for name, value in ref.state_dict().items()}
    pm.load_state_dict(moved)                        # a single-device state dict loads as it is
    _check_equal(checks, "after load_state_dict of a whole state dict:", pm.full_state_dict(), moved, moved)
    pm.load_state_dict(ref.state_dict())
    opt, _ = _optimizer(pm.parameters(), scheduled=False)
    _lockstep(_forward_backward(pm, inputs), opt, None, ref, ref_opt, None, inputs, STEPS, checks, "before saving")

    model_state, optim_state = get_state_dict(pm, opt)
    column, whole = model_state[COLUMN], model_state[STRIDED]
    checks.true(f"{COLUMN} in the state dict: {type(column).__name__} {getattr(column, 'placements', None)}",
                isinstance(column, DTensor) and tuple(column.placements) == (Replicate(), Shard(0))
                and column.shape == ref.get_parameter(COLUMN).shape)
    checks.true(f"{STRIDED} (strided layout) in the state dict: {type(whole).__name__} {tuple(whole.shape)}",
                not isinstance(whole, DTensor) and whole.shape == ref.get_parameter(STRIDED).shape)
    moment = optim_state["state"][COLUMN]["exp_avg"]
    checks.true(f"optimizer state of {COLUMN}: {type(moment).__name__}",
                isinstance(moment, DTensor) and moment.shape == ref.get_parameter(COLUMN).shape)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=cfg["path"])
    saved_params, saved_optim = pm.full_state_dict(), _full_optimizer_state(opt)

    fresh, _ = prebuilt("gpt/fresh") or _gpt()
    pm_b = partitioner.auto_parallelize(fresh, inputs, mesh=(4,), cluster="h100", pins=pins_for("gpt", "dp", (4,)))
    opt_b, _ = _optimizer(pm_b.parameters(), scheduled=False)
    model_b, optim_b = get_state_dict(pm_b, opt_b)
    dcp.load({"model": model_b, "optim": optim_b}, checkpoint_id=cfg["path"])
    set_state_dict(pm_b, opt_b, model_state_dict=model_b, optim_state_dict=optim_b)

    _check_equal(checks, "loaded parameter", pm_b.full_state_dict(), saved_params, saved_params)
    loaded_optim = _full_optimizer_state(opt_b)
    for fqn, entry in saved_optim.items():
        _check_equal(checks, f"loaded optimizer state of {fqn}:", loaded_optim[fqn], entry, entry)
    _lockstep(_forward_backward(pm_b, inputs), opt_b, None, ref, ref_opt, None, inputs, 2, checks, "after loading")
    _check_against_reference(checks, f"after {STEPS + 2} steps", pm_b.full_state_dict(), ref)
    return {"failures": checks.failures, "placement": pm_b.placement_of(COLUMN)}


def test_standard_get_state_dict_and_set_state_dict_reshard_under_another_plan(tmp_path):
    """``dcp.save(get_state_dict(pm, opt))`` on (2, 2) data x Megatron, ``dcp.load`` +
    ``set_state_dict`` into data parallel on (4,): shards are DTensors (the strided QKV whole),
    and training goes on equal to the reference."""
    results = run_checked(_dcp_worker, {"mesh": (2, 2), "path": str(tmp_path / "dcp")}, TIMEOUT_S, prebuild=GPT_TWICE)
    assert results[0]["placement"] == "[R]"


# ---------------------------------------------------------------------------------- pipelines


def _pipeline_worker(rank, world, cfg):
    checks = Checks(rank)
    # the three models the parent built and captured (GPT2_THREE); tied wte / lm_head: one name per stage
    (model, inputs), (whole, _), (again, _) = (prebuilt(key) or _gpt2() for key, *_ in GPT2_THREE)
    ref = copy.deepcopy(model)
    ref_opt, _ = _optimizer(ref.parameters(), scheduled=False)
    pipeline = PIPELINE

    def runner_from(fresh):
        return partitioner.auto_parallelize(fresh, inputs, mesh=(2, 2), cluster="h100", pipeline=pipeline)

    runner = runner_from(model)
    opt_r, _ = _optimizer(runner.parameters(), scheduled=False)
    _lockstep(lambda: runner.train_step(inputs), opt_r, None, ref, ref_opt, None, inputs, 2, checks, "pipelined")
    saved_params, saved_optim = runner.full_state_dict(), _full_optimizer_state(opt_r)
    partitioner.save_checkpoint(cfg["path"] + "/from_pipeline", runner, opt_r)

    pm = partitioner.auto_parallelize(whole, inputs, mesh=(2, 2), cluster="h100")
    opt_pm, _ = _optimizer(pm.parameters(), scheduled=False)
    partitioner.load_checkpoint(cfg["path"] + "/from_pipeline", pm, opt_pm)
    _check_equal(checks, "pipeline -> parallel module: parameter", pm.full_state_dict(), saved_params, saved_params)
    loaded_optim = _full_optimizer_state(opt_pm)
    for fqn, entry in saved_optim.items():
        _check_equal(checks, f"pipeline -> parallel module: optimizer state of {fqn}:", loaded_optim[fqn], entry,
                     entry)
    _lockstep(_forward_backward(pm, inputs), opt_pm, None, ref, ref_opt, None, inputs, 1, checks, "not pipelined")
    saved_params, saved_optim = pm.full_state_dict(), _full_optimizer_state(opt_pm)
    partitioner.save_checkpoint(cfg["path"] + "/to_pipeline", pm, opt_pm)

    runner_b = runner_from(again)
    opt_rb, _ = _optimizer(runner_b.parameters(), scheduled=False)
    partitioner.load_checkpoint(cfg["path"] + "/to_pipeline", runner_b, opt_rb)
    loaded = runner_b.full_state_dict()
    _check_equal(checks, "parallel module -> pipeline: parameter", loaded, saved_params, loaded)
    loaded_optim = _full_optimizer_state(opt_rb)
    for fqn, entry in loaded_optim.items():
        _check_equal(checks, f"parallel module -> pipeline: optimizer state of {fqn}:", entry, saved_optim[fqn],
                     entry)
    _lockstep(lambda: runner_b.train_step(inputs), opt_rb, None, ref, ref_opt, None, inputs, 1, checks,
              "pipelined again")
    _check_against_reference(checks, "after 4 steps", runner_b.full_state_dict(), ref)
    names = sorted(n for n in loaded if n.endswith(("wte.weight", "lm_head.weight")))
    return {"failures": checks.failures, "tied_names_in_runner": names}


def test_pipeline_checkpoint_reloads_without_pipeline_and_back(tmp_path):
    """GPT-2 as a 2-stage pipeline on (2, 2) (stage sub-meshes of 2) -> the same model without a
    pipeline on (2, 2) -> a pipeline again: parameters and optimizer state equal at each load,
    losses equal the reference's."""
    results = run_checked(_pipeline_worker, {"mesh": (2, 2), "path": str(tmp_path)}, TIMEOUT_S, prebuild=GPT2_THREE)
    assert results[0]["tied_names_in_runner"], "the tied embedding should be reached under one of its names"


# ------------------------------------------------------------------------- dropout counters


def _dropout_worker(rank, world, path):
    from runtime.local_ops import RankDropout

    model, inputs = _gpt(dropout=0.1)
    pins = pins_for("gpt", "dp", (2,))
    pm = partitioner.auto_parallelize(model, inputs, mesh=(2,), cluster="h100", pins=pins)
    opt, _ = _optimizer(pm.parameters(), scheduled=False)
    for _ in range(2):
        opt.zero_grad()
        pm(*inputs).backward()
        opt.step()
    partitioner.save_checkpoint(path, pm, opt)
    opt.zero_grad()
    next_loss = pm(*inputs)

    pm_b = partitioner.auto_parallelize(_gpt(dropout=0.1)[0], inputs, mesh=(2,), cluster="h100", pins=pins)
    opt_b, _ = _optimizer(pm_b.parameters(), scheduled=False)
    partitioner.load_checkpoint(path, pm_b, opt_b)
    calls = sorted({m.calls for m in pm_b.program.modules() if isinstance(m, RankDropout)})
    return next_loss.item(), pm_b(*inputs).item(), calls


def test_resume_with_dropout_draws_the_same_masks(tmp_path):
    """Dropout masks are keyed by a per-module call counter (runtime/local_ops.RankDropout): the
    checkpoint carries it, so the step after loading equals the step after saving, bitwise."""
    results = run_on_ranks(_dropout_worker, 2, str(tmp_path / "ckpt"), timeout_s=TIMEOUT_S)
    for saved_next, loaded_next, calls in results:
        assert calls == [2], calls
        assert saved_next == loaded_next, (saved_next, loaded_next)


# ------------------------------------------------------------------------------ a rank killed


FAULT_TIMEOUT_S = 240  # the run takes ~45 s on 2 shared cores; the bound is for a stuck torchrun


@pytest.mark.slow
def test_a_killed_rank_resumes_from_the_last_checkpoint_with_the_same_losses(tmp_path):
    """``tests/fault_train.py`` under ``torchrun --nproc-per-node 4 --max-restarts 1`` (gloo,
    c10d rendezvous on a free local port): 12 steps, a checkpoint every 4, rank 3 SIGKILLs itself
    as step 7 starts. The restarted group resumes from step_000004 (data position and RNG
    included: an epoch ends there, and the next one's order comes from the restored generator),
    replays steps 4-6 bitwise as the first attempt ran them, and the whole curve and the final
    parameters equal a single-process run of the same training."""
    import fault_train

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--max-restarts", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{find_free_port()}",
               "--monitor-interval", "0.1", fault_train.__file__, str(tmp_path),
               "--steps", "12", "--every", "4", "--kill-at", "7", "--collective-timeout-s", "60"]
    # the restarted workers must not meet the first attempt's keys in torchrun's shared store
    # (pytorch/pytorch#135712): each attempt gets its own
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=FAULT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {FAULT_TIMEOUT_S} s:\n{output[-4000:]}")
    assert proc.returncode == 0, output[-4000:]
    assert "exitcode: -9" in output or "Signals.SIGKILL" in output, "rank 3 was not killed"

    attempts: dict = {}
    for line in (tmp_path / "losses.txt").read_text().splitlines():
        attempt, step, loss = line.split()
        attempts.setdefault(int(attempt), {})[int(step)] = float(loss)
    assert sorted(attempts) == [0, 1], sorted(attempts)
    first, second = attempts[0], attempts[1]
    assert max(first) <= 7 and sorted(first) == list(range(max(first) + 1)), sorted(first)
    assert sorted(second) == list(range(4, 12)), sorted(second)      # resumed at the last checkpoint
    for step in sorted(set(first) & set(second)):
        assert first[step] == second[step], (step, first[step], second[step])
    curve = {**first, **second}
    reference, reference_params = fault_train.reference_run(12)
    torch.testing.assert_close(torch.tensor([curve[s] for s in range(12)]), torch.tensor(reference))
    final = torch.load(tmp_path / "final.pt")
    for name, value in reference_params.items():
        torch.testing.assert_close(final[name], value, msg=lambda m, name=name: f"{name}: {m}")


# ------------------------------------------------------------------ one process: layouts, errors


def test_to_local_takes_whole_tensors_pieces_and_names_a_wrong_shape():
    comm = MeshComm.for_codegen((2,), ("a0",), rank=1)
    layout = TensorLayout(comm, (Shard(0),), (4, 3))
    whole = torch.arange(12.0).view(4, 3)
    torch.testing.assert_close(layout.to_local(whole, "w"), whole[2:])
    torch.testing.assert_close(layout.to_local(whole[2:], "w"), whole[2:])   # already this rank's piece
    with pytest.raises(ValueError, match=r"w: got shape \(5, 3\); expected the whole tensor \(4, 3\) or this "
                                         r"rank's piece \(2, 3\)"):
        layout.to_local(torch.zeros(5, 3), "w")
    strided = TensorLayout(comm, (Shard(0),), (6, 2), {0: 3})   # 3 fused pieces: rank 1 keeps row 1 of each
    torch.testing.assert_close(strided.to_local(torch.arange(12.0).view(6, 2), "qkv"),
                               torch.arange(12.0).view(6, 2)[[1, 3, 5]])
    assert TensorLayout.from_local(comm, (Shard(1),), torch.zeros(4, 3)).global_shape == (4, 6)


def test_latest_checkpoint_is_the_newest_complete_one(tmp_path):
    assert partitioner.latest_checkpoint(tmp_path / "none") is None
    for name, complete in (("step_000002", True), ("step_000010", True), ("step_000012", False)):
        (tmp_path / name).mkdir()
        if complete:
            (tmp_path / name / ".metadata").write_bytes(b"")
    assert partitioner.latest_checkpoint(tmp_path) == tmp_path / "step_000010"


def test_checkpoints_refuse_what_they_cannot_save_or_load(tmp_path, fake_process_group):
    plain = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="model must be what partitioner.auto_parallelize returned"):
        partitioner.save_checkpoint(tmp_path / "c", plain, torch.optim.SGD(plain.parameters()))
    with pytest.raises(ValueError, match="holds no parameter of a parallel model"):
        partitioner.shard_optimizer_state(torch.optim.SGD(plain.parameters(), lr=0.1))
    fake_process_group(2)
    model, inputs = models.gpt_demo(batch=4, seq=8, n_layer=1)
    pm = partitioner.auto_parallelize(model, inputs, mesh=(2,), pins={"idx": ["S(0)"], "targets": ["S(0)"]})
    with pytest.raises(FileNotFoundError, match="is not a complete checkpoint"):
        partitioner.load_checkpoint(tmp_path / "empty", pm)
    with pytest.raises(ValueError, match="holds a parameter .* of no parallel model"):
        partitioner.save_checkpoint(tmp_path / "c", pm, torch.optim.SGD([*pm.parameters(), *plain.parameters()]))
