"""How good the solver's plans are: its estimated step time against hand-written plans.

Usage::

    python benchmarks/plan_quality.py
    python benchmarks/plan_quality.py --markdown benchmarks/results/plan_quality.md
    python benchmarks/plan_quality.py --only llama      # cases whose model or size contains "llama"

For GPT (``partitioner.models.gpt_block``: GPT-2 layout, fused QKV; built in fp32, cast to
bf16 here) and LLaMA (``partitioner.models.llama_meta``: HF ``LlamaForCausalLM``, bf16) shapes
at several sizes and meshes on the ``h100`` preset, the solver plans freely; then baselines
are planned with placements pinned, so the same cost model prices them:

* **Megatron** DP x TP. On a 2-D mesh axis 0 is data parallel, axis 1 tensor parallel: inputs
  ``[S(0), R]``; column-parallel weights (``c_attn``, ``c_fc``; ``q/k/v/gate/up_proj``) and their
  biases ``[R, S(0)]``; row-parallel weights (``c_proj``; ``o_proj``, ``down_proj``) ``[R, S(1)]``,
  their biases ``[R, R]``; norms and embeddings ``[R, R]``; ``lm_head`` ``[R, S(0)]`` (vocab-parallel
  head). On a 1-D mesh: pure tensor parallelism, inputs ``[R]``.
* **DP**: inputs ``S(0)`` on every axis, every parameter replicated.
* **FSDP** (ZeRO-3): inputs ``S(0)`` on every axis, every parameter ``S(0)`` on every axis.

Pinning inputs and parameters fixes where tensors are *stored*; the solver still places every
activation, so it may, say, all-gather a Megatron-sharded weight and run that layer data
parallel. Each baseline therefore also comes *strict* (``*``): the output of every linear
module is pinned as the textbook plan computes it (Megatron: column-parallel outputs
``[S(0), S(2)]``, row-parallel outputs ``[S(0), P]``, the head ``[S(0), S(2)]``; DP and FSDP:
``S(0)`` on every axis), which leaves the solver only the placement of the ops in between
(norms, attention, residual adds).

A baseline whose pins do not divide evenly (a batch smaller than the device count) is "n/a";
one that exceeds the memory budget "does not fit". The bar: solver / best feasible baseline
<= 1.00. Every pinned plan lies in the solver's space, so a ratio above 1.00 means the solver
or the plan's estimate is wrong. Ratios are given by ``plan.estimate()`` (what a user reads)
and by ``stats["objective_s"]`` (what the ILP minimised), which should agree.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import time
from dataclasses import dataclass, field

import torch
from bench_common import revision

import partitioner
from partitioner.models import gpt_block, llama_meta
from passes.core.placements import parse_spec, spec_fits

CLUSTER = "h100"
BUDGET = "80GiB"
GIB = 2 ** 30

COLUMN = ("c_attn", "c_fc", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")
ROW = ("c_proj", "o_proj", "down_proj")


@dataclass
class Case:
    family: str          # "GPT" or "LLaMA"
    size: str            # a label such as "1.3B"
    kwargs: dict         # for the factory
    mesh: tuple
    inputs: tuple = field(init=False)

    def __post_init__(self):
        self.inputs = ("idx", "targets") if self.family == "GPT" else ("input_ids", "labels")

    def build(self):
        if self.family == "GPT":
            model, inputs = gpt_block(**self.kwargs)
            return model.to(torch.bfloat16), inputs  # mixed-precision training keeps bf16 weights
        return llama_meta(**self.kwargs)

    @property
    def label(self) -> str:
        k = self.kwargs
        d = k.get("n_embd", k.get("hidden"))
        return f"{self.size} (d={d} L={k['n_layer']} b={k['batch']} s={k['seq']})"

    @property
    def mesh_label(self) -> str:
        return "x".join(map(str, self.mesh))


def _gpt(size, d, heads, layers, batch, seq, mesh):
    return Case("GPT", size, dict(batch=batch, seq=seq, n_embd=d, n_head=heads, n_layer=layers, vocab=50304), mesh)


def _llama(size, d, heads, kv, inter, batch, seq, mesh, layers=2):
    return Case("LLaMA", size, dict(n_layer=layers, hidden=d, heads=heads, kv_heads=kv, intermediate=inter,
                                    vocab=32000, batch=batch, seq=seq), mesh)


CASES = [
    # GPT at full depth (it captures quickly), so memory is that of the whole model.
    _gpt("350M", 1024, 16, 24, 16, 1024, (8,)),
    _gpt("350M", 1024, 16, 24, 16, 1024, (2, 4)),
    _gpt("1.3B", 2048, 16, 24, 16, 2048, (4, 2)),
    _gpt("6.7B", 4096, 32, 32, 8, 2048, (8,)),
    _gpt("6.7B", 4096, 32, 32, 64, 2048, (8, 8)),
    _gpt("39B", 8192, 64, 48, 16, 2048, (2, 8)),
    # LLaMA with 2 layers: blocks share one decision, so the per-layer plan is that of the
    # full model; memory and the embedding/head share of the step are those of 2 layers.
    _llama("d1024", 1024, 16, 16, 2816, 32, 1024, (8,)),
    _llama("7B", 4096, 32, 32, 11008, 8, 2048, (8,)),
    _llama("7B", 4096, 32, 32, 11008, 8, 2048, (2, 4)),
    _llama("7B", 4096, 32, 32, 11008, 64, 2048, (8, 8)),
    _llama("70B", 8192, 64, 8, 28672, 16, 4096, (2, 8)),
    _llama("70B", 8192, 64, 8, 28672, 64, 4096, (8, 8)),
]


# -- baselines: pins ---------------------------------------------------------------------
def _module_and_leaf(param: str) -> tuple[str, str, str]:
    module, kind = param.rsplit(".", 1)
    return module, module.rsplit(".", 1)[-1], kind


def _generic(name: str) -> str:
    """``h.3.mlp.c_fc.weight`` -> ``h.*.mlp.c_fc.weight`` (all layers alike)."""
    return re.sub(r"\.\d+\.", ".*.", name)


def megatron_pins(case: Case, params: dict) -> dict:
    dp = ["S(0)"] if len(case.mesh) == 2 else []   # inputs: batch split on the data axis
    keep = ["R"] * (len(case.mesh) - 1)             # parameters: replicated on the data axis
    pins = {name: dp + ["R"] for name in case.inputs}
    for name in params:
        _, leaf, kind = _module_and_leaf(name)
        if leaf in COLUMN:
            pins[name] = keep + ["S(0)"]
        elif leaf in ROW and kind == "weight":
            pins[name] = keep + ["S(1)"]
        else:
            pins[name] = keep + ["R"]
    return pins


def dp_pins(case: Case, params: dict) -> dict:
    pins = {name: ["S(0)"] * len(case.mesh) for name in case.inputs}
    pins.update({name: ["R"] * len(case.mesh) for name in params})
    return pins


def fsdp_pins(case: Case, params: dict) -> dict:
    pins = {name: ["S(0)"] * len(case.mesh) for name in case.inputs}
    pins.update({name: ["S(0)"] * len(case.mesh) for name in params})
    return pins


def linear_modules(params: dict) -> dict:
    """Module path glob -> "column" / "row" for every linear module of the model."""
    out = {}
    for name in params:
        module, leaf, _ = _module_and_leaf(name)
        if leaf in COLUMN or leaf in ROW:
            out[_generic(module + ".")[:-1]] = "column" if leaf in COLUMN else "row"
    return out


def megatron_outputs(case: Case, params: dict) -> dict:
    dp = ["S(0)"] if len(case.mesh) == 2 else []
    return {m: dp + (["S(2)"] if kind == "column" else ["P"]) for m, kind in linear_modules(params).items()}


def batch_outputs(case: Case, params: dict) -> dict:
    return {m: ["S(0)"] * len(case.mesh) for m in linear_modules(params)}


# name -> (input and parameter pins, activation pins or None)
BASELINES = {
    "Megatron": (megatron_pins, None), "Megatron*": (megatron_pins, megatron_outputs),
    "DP": (dp_pins, None), "DP*": (dp_pins, batch_outputs),
    "FSDP": (fsdp_pins, None), "FSDP*": (fsdp_pins, batch_outputs),
}
STRICT = tuple(name for name in BASELINES if name.endswith("*"))


def uneven_pin(pins: dict, shapes: dict, mesh: tuple) -> str | None:
    """The first input or parameter pin that does not divide evenly (Partita never pads)."""
    for name, value in pins.items():
        if name in shapes and not spec_fits(shapes[name], parse_spec(value, len(mesh)), mesh):
            return f"{name} {list(shapes[name])} cannot take {value} on mesh {mesh}"
    return None


# -- planning ------------------------------------------------------------------------------
@dataclass
class Outcome:
    status: str                 # "ok", "does not fit", "n/a", "error"
    step_s: float = float("nan")
    objective_s: float = float("nan")
    memory: float = float("nan")
    detail: str = ""
    plan: object = None

    def cell(self) -> str:
        if self.status == "ok":
            return f"{self.step_s * 1e3:.2f} ms, {self.memory / GIB:.1f} GiB"
        return self.status


def run_plan(model, inputs, case: Case, pins=None) -> Outcome:
    try:
        plan = partitioner.plan(model, inputs, mesh_shape=case.mesh, cluster=CLUSTER, memory_budget=BUDGET,
                                pins=pins, objective="time", optimizer="adam")
    except partitioner.InfeasibleBudgetError as exc:
        least = re.search(r"least memory any plan needs is ([\d.]+) GiB", str(exc))
        return Outcome("does not fit", detail=f"needs >= {least.group(1)} GiB" if least else str(exc))
    except ValueError as exc:
        return Outcome("error", detail=str(exc)[:300])
    est = plan.estimate()
    return Outcome("ok", est.step_time_s, float(plan.data["stats"]["objective_s"]), est.memory_bytes, plan=plan)


def differences(solver, other) -> tuple[int, int, list]:
    """(solver decisions placed unlike ``other``, decisions in all, [(param glob, solver, other)]).

    A decision is a leader group of the solver's plan; repeated blocks count once."""
    leaders = {r["name"] for r in solver.records if r.get("decision") == "leader"}
    by_name = {r["name"]: r for r in solver.records}
    differing = {by_name[name]["rep"] for name, *_ in solver.diff(other).changed if by_name[name]["rep"] in leaders}
    params = {}
    for r in solver.records:
        if r["kind"] == "param":
            mine, theirs = r["out"][0], other.record(r["name"])["out"][0]
            if mine != theirs:
                params.setdefault(_generic(r["fqn"]), (mine, theirs))
    return len(differing), int(solver.data["stats"]["decisions"]), sorted((k, *v) for k, v in params.items())


def evaluate(case: Case) -> dict:
    model, inputs = case.build()
    params = {name: tuple(p.shape) for name, p in model.named_parameters()}
    shapes = dict(params)
    values = inputs.values() if isinstance(inputs, dict) else inputs
    shapes.update({name: tuple(t.shape) for name, t in zip(case.inputs, values)})
    row = {"case": case, "solver": run_plan(model, inputs, case)}
    for name, (storage, activations) in BASELINES.items():
        pins = storage(case, params)
        why = uneven_pin(pins, shapes, case.mesh)
        if activations is not None:
            pins.update(activations(case, params))
        row[name] = Outcome("n/a", detail=why) if why else run_plan(model, inputs, case, pins)
    ok = [name for name in BASELINES if row[name].status == "ok"]
    row["best"] = min(ok, key=lambda n: row[n].step_s, default=None)
    row["best_objective"] = min(ok, key=lambda n: row[n].objective_s, default=None)
    row["best_strict"] = min((n for n in ok if n in STRICT), key=lambda n: row[n].step_s, default=None)
    ref = next((n for n in ("Megatron*", "Megatron") if row[n].status == "ok"), None)
    row["diff_ref"] = ref
    row["diff"] = differences(row["solver"].plan, row[ref].plan) if row["solver"].status == "ok" and ref else None
    return row


# -- report ---------------------------------------------------------------------------------
def _ratio(row, best, attr="step_s") -> str:
    solver = row["solver"]
    if solver.status != "ok" or best is None:
        return "-"
    value = getattr(solver, attr) / getattr(row[best], attr)
    return f"**{value:.3f}**" if value > 1.0 + 1e-9 else f"{value:.3f}"


def table(rows) -> list:
    lines = ["| model | size (L = layers planned) | mesh | solver | " + " | ".join(BASELINES) +
             " | best baseline | ratio (estimate) | ratio (objective) | best strict | ratio to strict | "
             "decisions unlike Megatron |",
             "|---|---|---|---|" + "---|" * len(BASELINES) + "---|---:|---:|---|---:|---|"]
    for row in rows:
        case = row["case"]
        d = row["diff"]
        unlike = f"{d[0]} of {d[1]} (vs {row['diff_ref']})" if d else "-"
        lines.append(f"| {case.family} | {case.label} | {case.mesh_label} | {row['solver'].cell()} | " +
                     " | ".join(row[name].cell() for name in BASELINES) +
                     f" | {row['best'] or '-'} | {_ratio(row, row['best'])} | "
                     f"{_ratio(row, row['best_objective'], 'objective_s')} | {row['best_strict'] or '-'} | "
                     f"{_ratio(row, row['best_strict'])} | {unlike} |")
    return lines


def details(rows) -> list:
    lines = []
    for row in rows:
        case = row["case"]
        notes = []
        for name in ("solver", *BASELINES):
            o = row[name]
            if o.status not in ("ok",) and o.detail:
                notes.append(f"{name} {o.status}: {o.detail}.")
        for strict in STRICT:
            loose = row[strict[:-1]]
            if loose.status == "ok" and row[strict].status == "ok" and loose.step_s > row[strict].step_s * (1 + 1e-9):
                notes.append(f"Anomaly: {strict} ({row[strict].step_s * 1e3:.3f} ms) is cheaper than {strict[:-1]} "
                             f"({loose.step_s * 1e3:.3f} ms) although it only adds pins.")
        if row["diff"]:
            _, _, params = row["diff"]
            if params:
                shown = "; ".join(f"`{p}` {a} ({row['diff_ref']} {b})" for p, a, b in params[:9])
                more = f"; and {len(params) - 9} more" if len(params) > 9 else ""
                notes.append(f"Parameters placed unlike Megatron: {shown}{more}.")
            else:
                notes.append("Every parameter placed as Megatron places it.")
        lines.append(f"- {case.family} {case.size}, mesh {case.mesh_label}: " + " ".join(notes))
    return lines


def machine() -> str:
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{os.cpu_count()}-core CPU ({cpu}), Python {platform.python_version()}, torch {torch.__version__}"


def describe_revision(at_start: str) -> str:
    at_end = revision()
    return at_end if at_end == at_start else f"{at_start} when the run started, {at_end} when it ended"


HEADER = """# Plan quality: the solver against Megatron, DP and FSDP, priced by one cost model

Reproduce: `python benchmarks/plan_quality.py --markdown {path}` ({elapsed:.0f} s here).

Code: {revision}.

Machine: {machine}; planning only, on `meta` (no accelerator). Cluster preset `{cluster}`, memory
budget {budget} per device, Adam (16 bytes per parameter), objective time.

Each cell: estimated step time (`plan.estimate().step_time_s`) and memory per device. The baselines
are plans with placements pinned (see the script's docstring): Megatron DP x TP (mesh axis 0 data,
axis 1 tensor; pure TP on a 1-D mesh), DP (parameters replicated), FSDP/ZeRO-3 (parameters S(0) on
every axis). Without a star only inputs and parameters are pinned, and the solver places the
activations (it may all-gather a sharded weight, or slice a replicated one, and so leave the
textbook plan); with a star (strict) the output of every linear module is pinned too, as the
textbook plan computes it. "n/a": a pin does not divide evenly; "does not fit": over the budget.
GPT rows plan the whole depth (vocab 50304, `gpt_block` cast to bf16); LLaMA rows plan 2 layers
(vocab 32000, bf16): repeated blocks share one decision, so the per-layer plan is that of the full
model, but memory and the share of embedding and head are those of 2 layers.

Bar: solver / best feasible baseline <= 1.00 ("ratio (estimate)"; "ratio (objective)" is the same
with the ILP objective `stats['objective_s']`; "ratio to strict" compares with the best textbook
plan). Every pinned plan lies in the solver's space, so a ratio above 1.00 is a bug in the solver or
in the estimate. "decisions unlike Megatron": solver decisions (leader groups, repeated blocks
counted once) whose placements differ from the Megatron* plan (`plan.diff`).

"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", help="run only cases whose family or size contains this text")
    parser.add_argument("--markdown", metavar="PATH", help="also write the report as markdown")
    args = parser.parse_args(argv)
    cases = [c for c in CASES if not args.only or args.only.lower() in f"{c.family} {c.size}".lower()]
    code_at_start = revision()
    start = time.perf_counter()
    rows = []
    for case in cases:
        t0 = time.perf_counter()
        row = evaluate(case)
        rows.append(row)
        cells = "; ".join(f"{name} {row[name].cell()}" for name in ("solver", *BASELINES))
        print(f"[{time.perf_counter() - start:6.1f}s] {case.family} {case.size} {case.mesh_label}: {cells} "
              f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - start
    over = [r for r in rows if r["solver"].status == "ok" and r["best"]
            and r["solver"].step_s > r[r["best"]].step_s * (1.0 + 1e-9)]
    verdict = "PASS" if not over else f"FAIL ({len(over)} of {len(rows)} cases)"
    body = table(rows) + ["", f"Bar: solver / best feasible baseline <= 1.00 (by plan.estimate()): {verdict}.",
                          "", "Notes per case:", ""] + details(rows)
    print("\n".join(body))
    print(f"\n{len(rows)} cases, {elapsed:.0f} s")
    if args.markdown:
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        with open(args.markdown, "w") as f:
            f.write(HEADER.format(path=args.markdown, elapsed=elapsed, machine=machine(),
                                  revision=describe_revision(code_at_start), cluster=CLUSTER, budget=BUDGET)
                    + "\n".join(body) + "\n")
        print(f"wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
