"""Helpers for the multi-process parity tests (test tier 3): models, pins, the rank worker.

One forked run (``runtime.launch.run_on_ranks``) per (model, mesh, plan) config. Each rank:

1. builds the model (deterministic weights) and a deep copy as the single-device reference;
2. ``auto_parallelize``s it with the config's pins / cluster / memory budget;
3. runs ONE forward + backward inside a :class:`runtime.collectives.CommCounter`;
4. compares the loss and every gradient (``pm.full_grads()``) with the reference;
5. optionally: ``local_inputs=True`` mode against the default mode, per-rank parameter bytes;
6. runs 3 AdamW steps on both (the parallel one over its local shards) and compares the
   parameters (``pm.full_state_dict()``).

Comparisons use ``torch.testing.assert_close`` defaults (fp32). A rank collects failures as
text instead of stopping at the first one, and returns them with the counted and estimated
communication, so the test in the parent process reports everything at once.
"""
from __future__ import annotations

import contextlib
import copy
import fnmatch
import gc
import math

import pytest
import scipy.optimize  # noqa: F401
import torch
import torch._dynamo  # noqa: F401
import torch.export._trace  # noqa: F401

# the HF model classes, imported once here for the same reason (transformers is pinned for tests)
import transformers  # noqa: F401,E402
from support import is_replicated
from transformers import BertForMaskedLM, GPT2LMHeadModel, LlamaForCausalLM, ViTForImageClassification  # noqa: F401,E402
from transformers.conversion_mapping import get_checkpoint_conversion_mapping  # noqa: E402

# Import everything the ranks use before forking: every forked worker would otherwise import
# torch.export / dynamo / sympy / scipy / transformers on its own (about 15 s on 2 cores).
import partitioner.parallelize  # noqa: F401
from partitioner import models
from partitioner.captures import capture, keep_captures
from partitioner.pipeline_parallelize import capture_pipeline
from runtime.collectives import CommCounter

# Every rank's auto_parallelize reads the keys transformers renames in checkpoints
# (partitioner.state_names); transformers builds its table of them (thousands of regular
# expressions, 0.09 CPU-s) on first use. Built here once, each forked rank inherits it.
get_checkpoint_conversion_mapping("gpt2")

# ------------------------------------------------------------------------------------ models

# factory, batch-input names, column-parallel weights, row-parallel weights, norm modules
# (their outputs: batch-sharded on a data-parallel axis, sequence-sharded with sequence
# parallelism), the modules whose outputs are the head's activations, the vocabulary-sized
# weights (embedding, output layer), and whether weights are stored (in, out) (HF Conv1D).
# Tiny configs, dropout 0 (the factories' defaults).
MODELS = {
    "mlp": dict(factory=lambda: models.mlp_demo(batch=8), inputs=("x", "target"),
                column=("layers.0.weight",), row=("layers.1.weight",), norms=(), head=("layers.0", "layers.1", "head"),
                transposed=False),
    "gpt": dict(factory=lambda: models.gpt_demo(batch=8, seq=16, n_layer=2), inputs=("idx", "targets"),
                column=("h.*.attn.c_attn.weight", "h.*.mlp.c_fc.weight"),
                row=("h.*.attn.c_proj.weight", "h.*.mlp.c_proj.weight"),
                norms=("h.*.ln_1", "h.*.ln_2", "ln_f"), head=("lm_head",), vocab=("wte.weight", "lm_head.weight"),
                transposed=False),
    "gpt2": dict(factory=lambda: models.hf_gpt2(batch=4, seq=16), inputs=("input_ids", "labels"),
                 column=("transformer.h.*.attn.c_attn.weight", "transformer.h.*.mlp.c_fc.weight"),
                 row=("transformer.h.*.attn.c_proj.weight", "transformer.h.*.mlp.c_proj.weight"),
                 norms=("transformer.h.*.ln_1", "transformer.h.*.ln_2", "transformer.ln_f"), head=("lm_head",),
                 vocab=("transformer.wte.weight", "lm_head.weight"), transposed=True),
    "bert": dict(factory=lambda: models.hf_bert(batch=4, seq=16), inputs=("input_ids", "attention_mask", "labels"),
                 column=("bert.encoder.layer.*.attention.self.query.weight",
                         "bert.encoder.layer.*.attention.self.key.weight",
                         "bert.encoder.layer.*.attention.self.value.weight",
                         "bert.encoder.layer.*.intermediate.dense.weight"),
                 row=("bert.encoder.layer.*.attention.output.dense.weight",
                      "bert.encoder.layer.*.output.dense.weight"),
                 norms=("bert.encoder.layer.*.attention.output.LayerNorm", "bert.encoder.layer.*.output.LayerNorm"),
                 head=("cls.predictions.decoder",),
                 vocab=("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"), transposed=False),
    "llama": dict(factory=lambda: models.hf_llama(batch=4, seq=16, kv_heads=2), inputs=("input_ids", "labels"),
                  column=("model.layers.*.self_attn.q_proj.weight", "model.layers.*.self_attn.k_proj.weight",
                          "model.layers.*.self_attn.v_proj.weight", "model.layers.*.mlp.gate_proj.weight",
                          "model.layers.*.mlp.up_proj.weight"),
                  row=("model.layers.*.self_attn.o_proj.weight", "model.layers.*.mlp.down_proj.weight"),
                  norms=("model.layers.*.input_layernorm", "model.layers.*.post_attention_layernorm",
                         "model.norm"), head=("lm_head",), vocab=("model.embed_tokens.weight", "lm_head.weight"),
                  transposed=False),
    "vit": dict(factory=lambda: models.hf_vit(batch=4), inputs=("pixel_values", "labels"),
                column=("vit.layers.*.attention.q_proj.weight", "vit.layers.*.attention.k_proj.weight",
                        "vit.layers.*.attention.v_proj.weight", "vit.layers.*.mlp.fc1.weight"),
                row=("vit.layers.*.attention.o_proj.weight", "vit.layers.*.mlp.fc2.weight"),
                norms=("vit.layers.*.layernorm_before", "vit.layers.*.layernorm_after", "vit.layernorm"),
                head=("classifier",), transposed=False),
}


_PREBUILT: dict = {}
"""key -> (model, inputs) that :func:`run_checked` built and captured before forking."""


def prebuilt(key):
    """In a rank forked by :func:`run_checked` with ``prebuild=(key, ...)``: the first call returns
    the (model, inputs) the parent built and captured (``auto_parallelize`` with the default
    capture options then reuses that capture, ``partitioner.captures``); otherwise None."""
    return _PREBUILT.pop(key, None)


def build(model_name: str):
    """``MODELS[model_name]``'s model and inputs (seeded: every call builds the same ones; the
    first in a rank may be the parent's, :func:`prebuilt`)."""
    return prebuilt(model_name) or MODELS[model_name]["factory"]()


def parity_case(model: str, mesh: tuple, plan: str, **extra):
    """One config of a parity test as a ``pytest.param``: the model, the mesh, the plan kind of
    :func:`pins_for` and the worker's extra keys; its id names the three (``-budget``: planned
    under ``budget_fraction``)."""
    cfg = dict(model=model, mesh=mesh, plan=plan, **extra)
    label = plan + ("-budget" if extra.get("budget_fraction") else "")
    return pytest.param(cfg, id=f"{model}-{'x'.join(map(str, mesh))}-{label}")


def slow_tier(case):
    """``case`` (a ``pytest.param``) moved to the slow tier (``make test-slow``): the breadth of a
    path the everyday tier already runs on another model or mesh."""
    return pytest.param(*case.values, marks=[*case.marks, pytest.mark.slow], id=case.id)


# -------------------------------------------------------------------------------------- pins


def pins_for(model_name: str, kind: str, mesh: tuple) -> dict | None:
    """Pins for a plan kind: ``free``, ``dp``, ``tp`` (Megatron on every axis of a 1-D mesh),
    ``dp_tp`` (axis 0 data, axis 1 Megatron) or ``tp_sp`` (Megatron + sequence parallel norms,
    on the last axis; data parallel on axis 0 of a 2-D mesh)."""
    m = MODELS[model_name]
    nd = len(mesh)
    if kind == "free":
        return None
    if kind == "dp":
        # inputs batch-sharded, every parameter replicated; the activations between blocks
        # are pinned batch-sharded too, else a tiny model's cheapest plan gathers the batch.
        pins = {name: ["S(0)"] * nd for name in m["inputs"]}
        pins["*"] = ["R"] * nd
        for pattern in m["norms"] + m["head"]:
            pins[pattern] = ["S(0)"] * nd
        return pins
    if kind not in ("tp", "dp_tp", "tp_sp"):
        raise ValueError(kind)
    # "tp": Megatron in full, with vocabulary-parallel embedding and output layer (rows split)
    if kind == "tp" and nd != 1:
        raise ValueError("pure Megatron TP is for 1-D meshes; use dp_tp on 2-D")
    dp = ["S(0)"] if nd == 2 else []          # axis 0 of a 2-D mesh is data parallel
    col, row = ("S(1)", "S(0)") if m["transposed"] else ("S(0)", "S(1)")
    pins = {name: dp + ["R"] for name in m["inputs"]}
    out_dim = 1 if model_name == "mlp" else 2   # the feature dim of a column-parallel output
    for pattern in m["column"]:
        pins[pattern] = ["R"] * len(dp) + [col]
        # and the module's output feature-sharded: else, for models this small, all-gathering
        # the pinned weights (ZeRO-3 style) is cheaper than Megatron
        pins[pattern.rpartition(".")[0]] = dp + [f"S({out_dim})"]
    for pattern in m["row"]:
        pins[pattern] = ["R"] * len(dp) + [row]
        pins[pattern.rpartition(".")[0]] = dp + ["P"]   # Megatron's row-parallel partial sums
    if kind == "tp":
        for pattern in m.get("vocab", ()):
            pins[pattern] = ["S(0)"]
            # outputs: the embedding's partial sums, the head's logits split by vocabulary
            module = pattern.rpartition(".")[0]
            pins[module] = ["S(2)"] if module in m["head"] else ["P"]
    for pattern in m["norms"]:   # sequence parallel: norms run on sequence-sharded activations
        if kind == "tp_sp":
            pins[pattern] = dp + ["S(1)"]
        elif dp:                 # keep the data-parallel axis batch-sharded between the blocks
            pins[pattern] = dp + ["R"]
    return pins


def free_weights(model_name: str, kind: str, mesh: tuple) -> dict | None:
    """``pins_for`` without the pins on weights (a pin names where a weight is stored, so a pinned
    weight cannot be ZeRO-1): the activations alone make the plan data parallel / Megatron."""
    m = MODELS[model_name]
    weights = {"*", *m["column"], *m["row"], *m.get("vocab", ())}
    pins = pins_for(model_name, kind, mesh)
    return None if pins is None else {k: v for k, v in pins.items() if k not in weights}


# ---------------------------------------------------------------------------- the rank worker

LR = 1e-2
ADAM_EPS = 1e-3
"""AdamW's first update is ``lr * g / (|g| + eps)``: near ``g = 0`` it is a sign function, with
slope ``lr / eps``. Parallel and single-device gradients are equal up to fp32 roundoff, which
depends on the order of additions (sharded matmuls, all-reduced halves): measured here up to
3e-7 absolute (ViT), 1e-8..1e-7 elsewhere, while some gradients are analytically zero
(attention key biases) or below 1e-6. With the default ``eps=1e-8`` (or 1e-6) that roundoff
moves such elements by up to ``lr`` (1e-6 eps: 2e-3) after one step, so the comparison would
measure the summation order. ``eps=1e-3`` bounds the effect of 3e-7 of roundoff at 3e-6
per step, under the 1e-5 of ``assert_close``; every other AdamW setting is the default, and a
real gradient error of 1e-6 still moves a parameter by 1e-5 per step."""


def loss_of(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) or hasattr(out, "keys"):
        return out["loss"]
    return out[0]


def call(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def grad_label(name: str) -> str:
    """What a gradient's comparison is called (:func:`check_grads_by_alias`; the float64 judge
    finds its truth under the same label)."""
    return f"grad of {name}"


def step_loss_label(step: int) -> str:
    """What the loss before AdamW step ``step`` (> 0) is called (:func:`adam_in_lockstep`)."""
    return f"loss at step {step}"


def param_label(name: str, steps: int) -> str:
    """What a parameter's comparison after ``steps`` AdamW steps is called."""
    return f"parameter {name} after {steps} AdamW steps"


class Checks:
    """Collects comparison failures (text) instead of stopping at the first; those of value
    comparisons also as ``close_failures[what]`` (what the float64 judge may judge,
    ``float64_judge``)."""

    def __init__(self, rank):
        self.rank, self.failures = rank, []
        self.close_failures: dict = {}

    def close(self, what, actual, expected, **kw):
        try:
            torch.testing.assert_close(actual, expected, **kw)
        except AssertionError as e:
            self.failures.append(f"rank {self.rank}: {what}: {e}")
            self.close_failures[what] = self.failures[-1]

    def true(self, what, cond):
        if not cond:
            self.failures.append(f"rank {self.rank}: {what}")


def parity_worker(rank, world, cfg):
    import partitioner

    checks = Checks(rank)
    model, inputs = build(cfg["model"])
    ref = copy.deepcopy(model)
    mesh = tuple(cfg["mesh"])
    pins = pins_for(cfg["model"], cfg["plan"], mesh)
    budget = None
    if cfg.get("budget_fraction"):   # of the replicated fp32 Adam state: the solver must shard to fit
        n_params = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
        budget = int(cfg["budget_fraction"] * 16 * n_params)
    pm = partitioner.auto_parallelize(model, inputs, mesh=mesh, pins=pins, cluster=cfg.get("cluster", "h100"),
                                      memory_budget=budget, tensor_parallel=cfg.get("tensor_parallel", "auto"))
    result = {"rank": rank, "failures": checks.failures}
    result["sharded_params"] = sorted(f for f, _ in pm.named_parameters() if not is_replicated(pm.placement_of(f)))
    result["sharded_inputs"] = sorted(n for n in MODELS[cfg["model"]]["inputs"] if not is_replicated(pm.placement_of(n)))
    result["placements"] = {name: pm.placement_of(name) for name, _ in model.named_parameters(remove_duplicate=False)}
    result["placements"].update({name: pm.placement_of(name) for name in MODELS[cfg["model"]]["inputs"]})
    if cfg.get("return_records"):
        result["records"] = pm.plan.records
        # each parameter's bytes on this rank (what the user's optimizer steps) and whole
        whole = dict(ref.named_parameters(remove_duplicate=False))
        result["param_bytes"] = {
            f: (p.numel() * p.element_size(), whole[f].numel() * whole[f].element_size())
            for f, p in pm.named_parameters(remove_duplicate=False)
        }
    if rank == 0:
        result["summary"] = pm.plan.summary()
        result["code"] = pm.program.code

    # 1. one forward + backward, counted
    with CommCounter() as counter:
        out = call(pm, inputs)
        loss = loss_of(out)
        loss.backward()
    result["counted"] = counter.as_dict()
    result["counted_by_phase"] = counter.phase_dict()
    est = pm.plan.estimate()
    result["estimated"] = est.comm_bytes
    result["estimated_by_phase"] = est.comm_bytes_by_phase

    ref_out = call(ref, inputs)
    ref_loss = loss_of(ref_out)
    ref_loss.backward()
    result["loss"] = loss.item()
    checks.close("loss", loss.detach(), ref_loss.detach())
    grads = pm.full_grads()
    # every name of every parameter: tied weights (GPT-2, BERT) are one tensor under two names
    # (a parameter no gradient reaches: None on one device, no entry in parallel)
    ref_grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False) if p.grad is not None}
    checks.true(f"gradient names differ: {sorted(set(grads) ^ set(ref_grads))}", set(grads) == set(ref_grads))
    result["grad_maxdiff"] = max(((grads[n] - g).abs().max().item() for n, g in ref_grads.items()
                                  if n in grads), default=0.0)
    for name, g in ref_grads.items():
        if name in grads:
            checks.close(f"grad of {name} ({pm.placement_of(name)})", grads[name], g)

    # 2. optional extra checks on the same plan
    if cfg.get("check_local_inputs"):
        _check_local_inputs(pm, inputs, grads, loss.detach(), cfg, checks)
    if cfg.get("check_param_bytes") is not None:
        result["param_bytes"] = _param_bytes(pm, ref, mesh, cfg["check_param_bytes"])

    # 3. three AdamW steps on both
    steps = cfg.get("steps", 3)
    if steps:
        train_like_one_device(pm, ref, inputs, steps, checks)
    return result


def train_like_one_device(pm, ref, inputs, steps, checks, label="", *, losses=None, parallel_step=None):
    """``steps`` AdamW steps on ``pm`` and the single-device ``ref`` in lockstep (both start from
    the gradients they hold; see :func:`adam_in_lockstep`), then every parameter of ``ref``
    compared with ``pm``'s full state dict. ``parallel_step``: the parallel forward + backward of
    each later step (default: ``pm`` on ``inputs``). With ``losses`` (the two runs' losses at the
    gradients they hold) also returns both runs' :class:`Trajectory` (parallel, one device), for
    ``float64_judge``; else None."""

    def default_step():
        step_loss = loss_of(call(pm, inputs))
        step_loss.backward()
        return step_loss

    runs = None if losses is None else (Trajectory(), Trajectory())

    def record(loss, ref_loss):  # both runs where they are, before their next AdamW step
        runs[0].point(pm.full_state_dict(), pm.full_grads(), loss)
        runs[1].point(dict(ref.named_parameters(remove_duplicate=False)), named_grads(ref), ref_loss)

    if runs is not None:
        record(*losses)
    adam_in_lockstep(pm.parameters(), ref, inputs, steps, parallel_step or default_step, checks,
                     on_step=None if runs is None else record)
    state = pm.full_state_dict()
    check_params_after_steps(state, ref, steps, checks, prefix=f"{label}: " if label else "")
    if runs is not None:
        runs[0].final = state
        runs[1].final = {n: p.detach().clone() for n, p in ref.named_parameters(remove_duplicate=False)}
    return runs


class Trajectory:
    """One run's points along :func:`train_like_one_device`: ``params[k]`` and ``grads[k]`` (name ->
    whole tensor, every name of a tied weight the run returns) and ``losses[k]`` at AdamW step
    ``k``, and ``final``: the parameters after the last step."""

    def __init__(self):
        self.params: list = []
        self.grads: list = []
        self.losses: list = []
        self.final: dict = {}

    def point(self, params: dict, grads: dict, loss) -> None:
        """The run at its next step: its parameters, their gradients (before the step) and loss."""
        self.params.append({n: t.detach().clone() for n, t in params.items()})
        self.grads.append({n: g.detach().clone() for n, g in grads.items() if g is not None})
        self.losses.append(loss.detach().clone())


def check_params_after_steps(state: dict, ref, steps: int, checks, *, prefix: str = "", key_of=None) -> None:
    """Every parameter of ``ref`` (every name; with ``key_of``, ref name -> the name the parallel
    model holds it under, those names only) after ``steps`` AdamW steps against the parallel
    model's full state dict. A parameter the parallel model does not hold (one its captured
    program never reads) must be one that no gradient reached on one device either: AdamW left
    it as it was there, and a gradient the parallel model has nowhere to put is a failure."""
    names = ref.named_parameters(remove_duplicate=False) if key_of is None else (
        (n, p) for n, p in ref.named_parameters() if n in key_of)
    for name, p in names:
        key = name if key_of is None else key_of[name]
        if key not in state:
            checks.true(f"{prefix}parameter {name}: one device trains it, the parallel model does not hold it",
                        p.grad is None)
            continue
        checks.close(f"{prefix}{param_label(name, steps)}", state[key], p.detach())


def named_grads(model) -> dict:
    """Every name of every parameter of ``model`` -> its gradient (None where none reached it)."""
    return {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}


def check_grads_by_alias(grads: dict, ref, checks, *, one_name: bool = False) -> dict:
    """Compare gathered gradients with the reference's, every parameter once: tied weights (one
    tensor under several names, e.g. GPT-2's ``wte`` / ``lm_head``) may come back under any of
    their names (``one_name``: under exactly one). Returns reference name -> the name the
    gradient came under."""
    aliases = {}
    for name, p in ref.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    known = {n for names in aliases.values() for n in names}
    checks.true(f"gradients for names the model does not have: {sorted(set(grads) - known)}", set(grads) <= known)
    key_of = {}
    for name, p in ref.named_parameters():
        present = [a for a in aliases[id(p)] if a in grads]
        if p.grad is None:  # no gradient reached it on one device: none may come back in parallel
            checks.true(f"{name} has no gradient on one device, but the parallel model returns one under "
                        f"{present}", not present)
            key_of[name] = name
            continue
        checks.true(f"{len(present)} gradients for {name} (names {aliases[id(p)]})",
                    len(present) == 1 if one_name else len(present) >= 1)
        if not present:
            continue
        key_of[name] = present[0]
        for alias in present:
            checks.close(grad_label(alias), grads[alias], p.grad)
    return key_of


def adam_in_lockstep(params, ref, inputs, steps, parallel_step, checks, on_step=None):
    """``steps`` AdamW steps on the parallel ``params`` and the single-device ``ref`` side by side.
    The first step uses the gradients both already hold; before each later one, gradients are
    cleared and recomputed (``parallel_step()`` runs forward + backward and returns the loss) and
    the two losses compared, then ``on_step(parallel loss, reference loss)`` is called if given.
    Returns the parallel side's optimizer."""
    opt = torch.optim.AdamW(params, lr=LR, eps=ADAM_EPS)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=ADAM_EPS)
    for step in range(steps):
        if step > 0:
            opt.zero_grad(set_to_none=True)
            ref_opt.zero_grad(set_to_none=True)
            step_loss = parallel_step()
            step_ref = loss_of(call(ref, inputs))
            step_ref.backward()
            checks.close(step_loss_label(step), step_loss.detach(), step_ref.detach())
            if on_step is not None:
                on_step(step_loss, step_ref)
        opt.step()
        ref_opt.step()
    return opt


def pipeline_like_one_device(runner, ref, inputs, loss, checks, *, steps, one_name=True, label=""):
    """The pipelined ``runner`` against the single-device ``ref`` after the runner's first
    ``train_step(inputs)`` (which returned ``loss``): the reference's loss and every gradient (tied
    weights under exactly one of their names with ``one_name``), ``steps`` AdamW steps in lockstep
    (:func:`adam_in_lockstep`, each later ``train_step`` inside a :class:`CommCounter`), then every
    parameter of ``ref`` against the runner's full state dict. Returns (the runner's optimizer,
    the last step's counter, or None for one step)."""
    prefix = f"{label}: " if label else ""
    ref_loss = loss_of(call(ref, inputs))
    ref_loss.backward()
    checks.close(f"{prefix}loss", loss.detach(), ref_loss.detach())
    key_of = check_grads_by_alias(runner.full_grads(), ref, checks, one_name=one_name)
    counters = []

    def counted_step():
        with CommCounter() as counter:
            step_loss = runner.train_step(inputs)
        counters.append(counter)
        return step_loss

    opt = adam_in_lockstep(runner.parameters(), ref, inputs, steps, counted_step, checks)
    check_params_after_steps(runner.full_state_dict(), ref, steps, checks, prefix=prefix, key_of=key_of)
    return opt, counters[-1] if counters else None


def _check_local_inputs(pm, inputs, grads, loss, cfg, checks):
    """Replay the plan with ``local_inputs=True``: each rank passes ``pm.shard_batch(batch)``."""
    import partitioner

    fresh, _ = build(cfg["model"])
    pm_local = partitioner.auto_parallelize(fresh, inputs, mesh=tuple(cfg["mesh"]), plan=pm.plan,
                                            local_inputs=True)
    batch = pm_local.shard_batch(inputs)
    flat_in = list(inputs.values()) if isinstance(inputs, dict) else list(inputs)
    flat_local = list(batch.values()) if isinstance(batch, dict) else list(batch)
    checks.true("shard_batch returned no smaller piece although inputs are batch-sharded",
                any(a.numel() < b.numel() for a, b in zip(flat_local, flat_in)))
    local_loss = loss_of(call(pm_local, batch))
    local_loss.backward()
    checks.close("local_inputs loss vs default mode", local_loss.detach(), loss)
    local_grads = pm_local.full_grads()
    for name, g in grads.items():
        checks.close(f"local_inputs grad of {name} vs default mode", local_grads[name], g)
    # the local parameters themselves are the same slices
    for (name, a), (_, b) in zip(pm_local.named_parameters(), pm.named_parameters()):
        checks.close(f"local_inputs local shard of {name}", a.grad, b.grad)


def _param_bytes(pm, ref, mesh, tp_axis):
    """Per-rank parameter bytes against total / (tensor-parallel degree) + replicated tensors."""
    tp = mesh[tp_axis]
    total = sum(p.numel() * p.element_size() for p in ref.parameters())
    replicated = 0
    for fqn, p in ref.named_parameters():
        if is_replicated(pm.placement_of(fqn)):
            replicated += p.numel() * p.element_size()
    local = pm.local_parameter_bytes()
    return {"local": local, "total": total, "tp": tp, "replicated": replicated,
            "bound": 1.05 * total / tp + replicated, "ratio": local / (total / tp)}


def check_step_like_one_device(pm, ref, inputs, checks, label="", grad_checks=None):
    """One forward + backward of ``pm`` (communication counted) and of the single-device ``ref``
    on the same inputs: the loss, every gradient (``grad_checks``, default ``checks``) and the
    counted communication against the plan's estimate. Returns the counter."""
    from runtime.collectives import CommCounter

    prefix = f"{label}: " if label else ""
    with CommCounter() as counter:
        out = call(pm, inputs)
        loss_of(out).backward()
    ref_loss = loss_of(call(ref, inputs))
    ref_loss.backward()
    checks.close(f"{prefix}loss", loss_of(out).detach(), ref_loss.detach())
    check_grads_by_alias(pm.full_grads(), ref, grad_checks or checks)
    for diff in nested_approx_equal(counter.as_dict(), pm.plan.estimate().comm_bytes):
        checks.true(f"{prefix}communication: {diff}", False)
    return counter


def nested_approx_equal(counted: dict, estimated: dict) -> list:
    """Differences between two {kind: {axis: bytes}} dicts (same keys, values within 1e-6)."""
    diffs = []
    if set(counted) != set(estimated):
        diffs.append(f"collective kinds differ: counted {sorted(counted)}, estimated {sorted(estimated)}")
    for kind in set(counted) | set(estimated):
        c, e = counted.get(kind, {}), estimated.get(kind, {})
        if set(c) != set(e):
            diffs.append(f"{kind}: axes differ: counted {c}, estimated {e}")
        for axis in set(c) | set(e):
            a, b = c.get(axis, 0.0), e.get(axis, 0.0)
            if not math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6):
                diffs.append(f"{kind}@{axis}: counted {a:.0f} B, estimated {b:.0f} B")
    return diffs


def glob_any(name, patterns):
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def gpt_with_dropout():
    return models.gpt_demo(batch=8, seq=16, n_layer=2, dropout=0.1)


def dropout_worker(rank, world, mesh):
    """gpt_demo(dropout=0.1) under DP x TP: one training step, the eval-mode loss, and the masks
    each rank's dropout modules draw (on a probe tensor, from a copy: the step is untouched)."""
    import partitioner
    from runtime.local_ops import RankDropout

    model, inputs = prebuilt("gpt-dropout") or gpt_with_dropout()  # the parent's, when it built one
    ref = copy.deepcopy(model).eval()
    pm = partitioner.auto_parallelize(model, inputs, mesh=mesh, pins=pins_for("gpt", "dp_tp", mesh),
                                      cluster="h100")
    assert pm.training
    loss = pm(*inputs)
    loss.backward()
    grads = pm.full_grads()
    out = {"rank": rank, "coords": list(pm.comm.coords), "loss": loss.item(),
           "grad_norm": math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values())),
           "ref_eval_loss": ref(*inputs).item(), "modules": {}}
    for name, module in pm.program.named_modules():
        if isinstance(module, RankDropout):
            probe = copy.copy(module)    # shallow: its own call counter, the same process groups
            probe.calls = 0
            probe.train()
            if type(module).__name__ == "RankAttention":
                q = torch.randn(4, 2, 16, 8, generator=torch.Generator().manual_seed(1))
                mask = probe(q, q, q, None, module.p, False)
            else:
                mask = probe(torch.ones(4, 16, 64))
            out["modules"][name] = {"kind": type(module).__name__, "p": module.p,
                                    "sharded_axes": list(module.sharded_axes),
                                    "placement": pm.plan.record(name)["out"][0], "probe": mask}
    pm.eval()
    with torch.no_grad():
        out["eval_loss"] = pm(*inputs).item()
    return out


# The forked ranks share this process's memory copy-on-write; a collection in a rank would
# touch (and so copy) every page of the modules imported above. Move them out of the GC's way.
gc.freeze()


@contextlib.contextmanager
def built_in_parent(factories: dict):
    """Inside: ``factories`` (key -> (factory, capture options of the ``auto_parallelize`` call the
    ranks will make)) built and captured in this process under ``keep_captures``, for ranks forked
    inside to take with :func:`prebuilt`; at the end, none is left for this process."""
    with keep_captures():
        made = {}  # published when all are made: a factory calling build() must not take an earlier one
        for key, (factory, options) in factories.items():
            model, inputs = factory()
            if "pipeline" in options:  # what a pipelined call captures: one microbatch, cut into stages
                capture_pipeline(model, inputs, **options)
            else:
                capture(model, inputs, **options)
            made[key] = (model, inputs)
        _PREBUILT.update(made)
        try:
            yield
        finally:
            _PREBUILT.clear()


def run_checked(worker, cfg, timeout_s, *, prebuild=None):
    """Run ``worker(rank, world, cfg)`` on the config's mesh; fail on any rank's mismatches.

    ``prebuild=(key, factory)``: ``factory()``'s model is built and captured here first, inside
    ``keep_captures``, and each forked rank's first :func:`prebuilt` of ``key`` returns it, so
    ``auto_parallelize`` (fp32, the default capture options) reuses the capture instead of
    exporting the model once per rank, and every rank starts with the caches of torch.export and
    fake tensors warm for that model (a forked rank otherwise pays their first use again).
    ``(key, factory, options)``: captured for a call with those options (``pipeline=`` among
    them: its stages); a list of such tuples: each. The default, for a worker that calls
    :func:`build`: ``cfg["model"]`` of :data:`MODELS`."""
    import math

    from runtime.launch import run_on_ranks

    name = cfg.get("model")
    if prebuild is None and "build" in worker.__code__.co_names and isinstance(name, str) and name in MODELS:
        prebuild = (name, MODELS[name]["factory"])
    prebuilds = [prebuild] if isinstance(prebuild, tuple) else list(prebuild or ())
    with built_in_parent({p[0]: (p[1], p[2] if len(p) > 2 else {}) for p in prebuilds}):
        # the other ranks wait in a broadcast while rank 0 plans: up to the ILP's 60 s time limit
        results = run_on_ranks(worker, math.prod(cfg["mesh"]), cfg, timeout_s=timeout_s, collective_timeout_s=150)
    failures = [f for r in results for f in r["failures"]]
    assert not failures, f"{len(failures)} mismatches, first ones:\n" + "\n".join(failures[:12])
    return results


def capture_served(model, served: list, **options) -> None:
    """Inside ``keep_captures`` (a ``built_in_parent`` factory): capture ``model`` as the module that
    ``auto_parallelize(model, example, **options)`` makes will when it is called on each of ``served``
    (other batch or sequence sizes): the whole model at those shapes
    (``partitioner.specialize``), or a pipeline's stages at each distinct microbatch of them, cut
    like the runner's ``torch.tensor_split`` (``partitioner.pipeline_shapes``). Forked ranks then
    take these instead of exporting the model once per rank and shape."""
    pipeline = options.pop("pipeline", None)
    for inputs in served:
        if pipeline is None:
            capture(model, inputs, **options)
            continue
        pieces = {k: v.tensor_split(pipeline["microbatches"], dim=0) for k, v in inputs.items()}
        for i in range(pipeline["microbatches"]):
            # one microbatch as a whole batch of one microbatch: the stages the runner asks for
            capture_pipeline(model, {k: p[i] for k, p in pieces.items()}, {**pipeline, "microbatches": 1}, **options)
