"""``python -m partitioner`` (also installed as ``partita``): plan from the command line.

Plan a model built by a factory, print the plan table and the estimate, save the plan::

    python -m partitioner plan partitioner.models:gpt_demo --mesh 8x8 --cluster h100 \\
        --budget 80GiB --json plan.json
    python -m partitioner plan my_models.py:build --kwargs '{"n_layer": 4}' --mesh 2x4 \\
        --axis-names dp,tp --pin 'input_ids=[S(0), R]' --explain model.layers.0.mlp

``FACTORY`` is a callable in ``MODULE`` (a dotted module name, or a path to a ``.py`` file)
returning ``(model, example_inputs)`` or a dict with the keys ``model`` and
``example_inputs``. Saved plans are read without the model::

    python -m partitioner show plan.json
    python -m partitioner explain plan.json h.0.mlp.c_fc
    python -m partitioner diff a.json b.json
    python -m partitioner report plan.json -o report.html [--diff other.json] [--trace timeline.json]

Measure this machine (matmul, memory and gloo collective curves on local ranks) into a cluster
file that ``--cluster`` (and ``cluster=`` in Python) accepts::

    python -m partitioner calibrate --ranks 4 --out cluster.json

Turn a checkpoint ``save_checkpoint`` wrote into a HuggingFace directory, or an HF directory
into a checkpoint ``load_checkpoint`` reads (one process, offline; see docs/checkpoints.md)::

    python -m partitioner convert ckpt/step-0000100 hf_out --max-shard-size 2GB
    python -m partitioner convert hf_model_dir ckpt/from_hf

Results go to stdout, progress to stderr. Bad input (an unknown factory, an unreadable mesh
or budget, a file that is not a plan, a budget no plan fits, a model export cannot capture)
ends with one ``partita: error: ...`` line on stderr and exit status 2; ``--debug`` shows the
traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import sys
from pathlib import Path

__all__ = ["main"]

_EXIT_USAGE = 2
_FACTORY_FORM = (
    "expected MODULE:FACTORY, e.g. partitioner.models:gpt_demo, where FACTORY returns (model, example_inputs)"
)


class CLIError(Exception):
    """Bad input: reported as one line on stderr, exit status 2."""


def _status(args, message: str) -> None:
    if not getattr(args, "quiet", False):
        print(f"[partita] {message}", file=sys.stderr, flush=True)


# -- reading the command line ------------------------------------------------------------------


def _load_module(name: str):
    if name.endswith(".py") or os.sep in name or "/" in name:
        path = Path(name)
        if not path.is_file():
            raise CLIError(f"no Python file {name!r} ({_FACTORY_FORM})")
        # Import it as `python path.py` would run it: its folder on sys.path (for its sibling
        # imports) and itself in sys.modules (dataclasses and pickle look classes up there).
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.append(folder)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:  # a suffix Python does not import (e.g. .txt)
            raise CLIError(f"cannot import {name!r}: name a Python source file ending in .py ({_FACTORY_FORM})")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[spec.name]
            raise CLIError(f"importing {name} failed: {type(exc).__name__}: {exc}") from exc
        return module
    # `python -m` puts the working directory on sys.path; the `partita` script does not.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
            raise CLIError(f"no module named {exc.name!r} ({_FACTORY_FORM})") from exc
        raise CLIError(f"importing module {name!r} failed: {exc}") from exc
    except Exception as exc:
        raise CLIError(f"importing module {name!r} failed: {type(exc).__name__}: {exc}") from exc


def _load_factory(spec: str):
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise CLIError(f"cannot read model factory {spec!r}: {_FACTORY_FORM}")
    module = obj = _load_module(module_name)
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(
                n
                for n, v in vars(module).items()
                if inspect.isfunction(v) and v.__module__ == module.__name__ and not n.startswith("_")
            )
            shown = ", ".join(public[:12]) + (", ..." if len(public) > 12 else "")
            raise CLIError(
                f"module {module_name!r} has no factory {attr!r} ({_FACTORY_FORM}); the functions "
                f"it defines are: {shown or 'none'}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise CLIError(f"{spec} is a {type(obj).__name__}, not a callable ({_FACTORY_FORM})")
    return obj


def _parse_kwargs(text: str | None) -> dict:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CLIError(f"--kwargs is not valid JSON ({exc}): write it like '{{\"n_layer\": 4}}'") from None
    if not isinstance(value, dict):
        raise CLIError(f"--kwargs must be a JSON object like '{{\"n_layer\": 4}}', got {type(value).__name__}")
    return value


def _build_model(spec: str, kwargs: dict, args):
    import torch

    factory = _load_factory(spec)
    _status(args, f"building the model: {spec}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})")
    try:
        built = factory(**kwargs)
    except Exception as exc:
        raise CLIError(f"factory {spec} raised {type(exc).__name__}: {exc}") from exc
    if isinstance(built, dict):
        missing = [k for k in ("model", "example_inputs") if k not in built]
        if missing:
            raise CLIError(
                f"factory {spec} returned a dict without {missing}; it must have the keys 'model' and 'example_inputs'"
            )
        model, example_inputs = built["model"], built["example_inputs"]
    elif isinstance(built, (tuple, list)) and len(built) == 2:
        model, example_inputs = built
    else:
        raise CLIError(
            f"factory {spec} returned {type(built).__name__}; it must return (model, example_inputs) "
            f"or a dict with the keys 'model' and 'example_inputs'"
        )
    if not isinstance(model, torch.nn.Module):
        raise CLIError(f"factory {spec} returned a {type(model).__name__} as the model; expected a torch.nn.Module")
    return model, example_inputs


def _parse_pins(items: list[str], ndim: int) -> dict:
    from passes.core.placements import parse_spec

    pins = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise CLIError(
                f"cannot read --pin {item!r}: write it like 'input_ids=[S(0), R]' (one placement per mesh axis)"
            )
        try:
            parse_spec(value, ndim)
        except ValueError as exc:
            raise CLIError(f"--pin {item!r}: {exc}") from None
        pins[key] = value
    return pins


def _parse_size(value, flag: str) -> int | None:
    """A positive byte count from ``80GiB``-style text (None stays None)."""
    from partitioner.cluster import parse_bytes

    if value is None:
        return None
    try:
        size = parse_bytes(value)
    except ValueError as exc:
        raise CLIError(f"{flag}: {exc}") from None
    if size <= 0:
        raise CLIError(f"{flag} must be positive, got {value!r}")
    return size


def _parse_cluster(value: str):
    from partitioner.local_cluster import get_cluster

    try:
        return get_cluster(value)
    except ValueError as exc:
        raise CLIError(str(exc)) from None


def _load_plan(path: str):
    from partitioner.sharding_plan import ShardingPlan

    try:
        return ShardingPlan.load(path)
    except OSError as exc:
        raise CLIError(f"cannot read plan file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise CLIError(f"{path}: not a Partita sharding plan (not a text file)") from None
    except ValueError as exc:
        message = str(exc)
        raise CLIError(message if message.startswith(str(path)) else f"{path}: {message}") from None
    except (KeyError, TypeError) as exc:
        raise CLIError(f"{path}: a damaged sharding plan ({type(exc).__name__}: {exc})") from None


# -- printing ----------------------------------------------------------------------------------


def _format_estimate(plan, *, wide: bool = False) -> str:
    """The estimate, one quantity a line, with communication split by phase (lines wrapped to
    fit 120 columns unless ``wide``)."""
    import textwrap

    from partitioner.plan_table import WIDTH
    from partitioner.units import fmt_bytes as _fmt_bytes
    from partitioner.units import fmt_time as _fmt_time

    est = plan.estimate()
    data = plan.data
    lines = [
        "estimate per device per training step:",
        f"  step time      {_fmt_time(est.step_time_s)} (compute {_fmt_time(est.compute_s)}, "
        f"communication {_fmt_time(est.comm_s)})",
    ]
    budget = data.get("budget")
    share = f" of {_fmt_bytes(budget)} budget ({100 * est.memory_bytes / budget:.1f}%)" if budget else ""
    lines.append(f"  memory         {_fmt_bytes(est.memory_bytes)}{share}")
    if not est.comm_bytes:
        lines.append("  communication  none")
    for i, (kind, per_axis) in enumerate(sorted(est.comm_bytes.items())):
        for j, (axis, total) in enumerate(sorted(per_axis.items())):
            phases = ", ".join(
                f"{phase} {_fmt_bytes(by_kind[kind][axis])}"
                for phase, by_kind in sorted(est.comm_bytes_by_phase.items(), reverse=True)
                if by_kind.get(kind, {}).get(axis)
            )
            label = "communication" if i == 0 and j == 0 else ""
            lines.append(f"  {label:<14} {kind + ' on ' + axis:<28} {_fmt_bytes(total):>12}  ({phases})")
    inputs = ", ".join(
        f"{name} {'x'.join(map(str, shape)) or 'scalar'}" for name, shape in data.get("inputs", {}).items()
    )
    lines.append(
        f"  planned for    inputs {inputs or '-'}; objective {data.get('objective')}, optimizer {data.get('optimizer')}"
    )
    if wide:
        return "\n".join(lines)
    return "\n".join(part for line in lines for part in textwrap.wrap(line, WIDTH, subsequent_indent=" " * 17))


def _print_plan(plan, args) -> None:
    print(plan.summary(verbose=args.verbose_table, wide=args.wide))
    print()
    print(_format_estimate(plan, wide=args.wide))


def _print_explanations(plan, targets: list[str]) -> None:
    for target in targets or []:
        try:
            text = plan.explain(target)
        except KeyError as exc:
            raise CLIError(exc.args[0] if exc.args else f"nothing in this plan is named {target!r}") from None
        print()
        print(f"explain {target}:")
        print(text)


# -- subcommands -------------------------------------------------------------------------------


def _cmd_plan(args) -> int:
    import partitioner
    from partitioner.mesh import MeshSpec

    # Check every cheap argument before building the model: a typo fails in a second.
    axis_names = [s.strip() for s in args.axis_names.split(",")] if args.axis_names else None
    if args.mesh is None and args.devices is None:
        raise CLIError("give --mesh (e.g. 8x8) or --devices N (the configuration is then searched)")
    if args.mesh is None and axis_names is not None:
        raise CLIError("--axis-names names the axes of --mesh: give --mesh with it")
    if args.global_batch is not None and args.devices is None:
        raise CLIError("--global-batch is for the configuration search: give --devices N with it")
    mesh = None
    if args.mesh is not None:
        try:
            mesh = MeshSpec.build(args.mesh, axis_names)
        except ValueError as exc:
            raise CLIError(f"--mesh/--axis-names: {exc}") from None
    budget = _parse_size(args.budget, "--budget")
    host_budget = _parse_size(args.host_budget, "--host-budget")
    cluster = _parse_cluster(args.cluster) if args.cluster is not None else None
    pins = _parse_pins(args.pin, mesh.ndim) if mesh is not None else None
    if args.pin and mesh is None:
        raise CLIError("--pin names mesh axes: give --mesh with it (--devices searches the mesh)")
    kwargs = _parse_kwargs(args.kwargs)
    if args.json is not None and Path(args.json).is_dir():
        raise CLIError(f"--json {args.json} is a directory; give a file name such as plan.json")
    if args.time_limit is not None and args.time_limit <= 0:
        raise CLIError(f"--time-limit must be positive, got {args.time_limit}")

    model, example_inputs = _build_model(args.factory, kwargs, args)
    try:
        plan = partitioner.plan(
            model,
            example_inputs,
            mesh=mesh.shape if mesh is not None else None,
            mesh_axis_names=mesh.axis_names if mesh is not None else None,
            devices=args.devices,
            global_batch=args.global_batch,
            cluster=cluster,
            memory_budget=budget,
            host_memory_budget=host_budget,
            pins=pins,
            precision=args.precision,
            layers=args.layers,
            sequence_parallel=args.sequence_parallel,
            objective=args.objective,
            optimizer=None if args.optimizer == "none" else args.optimizer,
            share_blocks=not args.no_share_blocks,
            **({} if args.time_limit is None else {"time_limit": args.time_limit}),
            recompute=args.recompute,
            zero=args.zero if args.zero == "auto" else int(args.zero),
            tensor_parallel=args.tensor_parallel,
            expert_parallel=args.expert_parallel,
            expert_capacity=args.expert_capacity,
            verbose=not args.quiet,
        )
    except (partitioner.CaptureError, partitioner.InfeasibleBudgetError) as exc:
        raise CLIError(str(exc)) from exc
    except ValueError as exc:  # a pin that matches nothing
        raise CLIError(str(exc)) from exc
    except TypeError as exc:  # example inputs of the wrong kind
        raise CLIError(f"{type(exc).__name__}: {exc} (--debug shows where)") from exc

    if args.json is not None:
        try:
            plan.save(args.json)
        except OSError as exc:
            raise CLIError(f"cannot write the plan to {args.json}: {exc.strerror or exc}") from None
        _status(args, f"plan written to {args.json}")
    _print_plan(plan, args)
    _print_explanations(plan, args.explain)
    return 0


def _cmd_show(args) -> int:
    plan = _load_plan(args.plan)
    _print_plan(plan, args)
    _print_explanations(plan, args.explain)
    return 0


def _cmd_explain(args) -> int:
    plan = _load_plan(args.plan)
    for i, target in enumerate(args.target):
        try:
            text = plan.explain(target)
        except KeyError as exc:
            raise CLIError(exc.args[0] if exc.args else f"nothing in this plan is named {target!r}") from None
        if i:
            print()
        print(text)
    return 0


def _cmd_diff(args) -> int:
    first, second = _load_plan(args.first), _load_plan(args.second)
    diff = first.diff(second)
    print(f"{args.first} -> {args.second}")
    print(diff)
    return 1 if args.exit_code and diff else 0


def _cmd_report(args) -> int:
    plan = _load_plan(args.plan)
    other = _load_plan(args.diff) if args.diff is not None else None
    if Path(args.output).is_dir():
        raise CLIError(f"-o {args.output} is a directory; give a file name such as report.html")
    if args.trace is not None and not Path(args.trace).is_file():
        raise CLIError(f"--trace {args.trace}: no such file (give the timeline.json a pipeline dump wrote)")
    names = (Path(args.plan).name, Path(args.diff).name) if args.diff is not None else None
    try:
        path = plan.report(args.output, other=other, trace=args.trace, names=names)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    except OSError as exc:
        raise CLIError(f"cannot write the report to {args.output}: {exc.strerror or exc}") from None
    _status(args, f"report written to {path}")
    print(path)
    return 0


def _cmd_calibrate(args) -> int:
    from partitioner.calibration.calibrate import calibrate
    from partitioner.calibration.sizes import DEFAULT_SIZES, TINY_SIZES
    from partitioner.local_cluster import installed_cpu_path

    if args.ranks < 2:
        raise CLIError(f"--ranks must be >= 2 (collectives need two ranks), got {args.ranks}")
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    if repeats < 1:
        raise CLIError(f"--repeats must be >= 1, got {repeats}")
    if Path(args.out).is_dir():
        raise CLIError(f"--out {args.out} is a directory; give a file name such as cluster.json")
    memory = _parse_size(args.memory, "--memory")
    sizes = dict(TINY_SIZES if args.quick else DEFAULT_SIZES)
    try:
        spec = calibrate(
            args.out,
            ranks=args.ranks,
            sizes=sizes,
            name=args.name,
            memory_bytes=memory,
            say=lambda m: _status(args, m),
            progress=not args.quiet,
            repeats=repeats,
        )
    except (ValueError, OSError) as exc:
        raise CLIError(f"calibration failed: {exc}") from None
    if args.as_cpu:
        cache = installed_cpu_path()
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(Path(args.out).read_text())
        _status(args, f"also installed as cluster 'cpu' ({cache})")
    print(json.dumps(spec.to_dict(), indent=1))
    return 0


# -- the parser --------------------------------------------------------------------------------


def _cmd_convert(args) -> int:
    from partitioner.convert import dcp_to_hf, hf_to_dcp
    from partitioner.safetensors_source import is_safetensors_checkpoint

    source = Path(args.source)
    try:
        if is_safetensors_checkpoint(source):
            _status(args, f"{source}: a HuggingFace directory -> a Partita checkpoint in {args.target}")
            out = hf_to_dcp(source, args.target)
        elif (source / ".metadata").is_file():
            _status(args, f"{source}: a Partita checkpoint -> a HuggingFace directory in {args.target}")
            out = dcp_to_hf(source, args.target, config=args.config, max_shard_size=args.max_shard_size)
        else:
            raise CLIError(
                f"{source} is neither a HuggingFace directory (model.safetensors or its index) nor a Partita "
                "checkpoint (a folder with .metadata, as save_checkpoint writes)"
            )
    except (ValueError, KeyError, FileNotFoundError) as exc:
        raise CLIError(str(exc)) from exc
    print(out)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="partita",
        description="Partita: plan data / tensor / sequence parallelism for a PyTorch model.",
        epilog="Example: partita plan partitioner.models:gpt_demo --mesh 2x4 --budget 80GiB --json plan.json",
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_plan_command(sub)
    _add_saved_plan_commands(sub)
    _add_calibrate_command(sub)
    _add_convert_command(sub)
    p = sub.add_parser(
        "demo", add_help=False, help="the main job: a GPT auto-parallelized on 4 local gloo ranks next to one process"
    )
    p.add_argument("demo_args", nargs=argparse.REMAINDER)
    p.set_defaults(run=lambda args: __import__("partitioner.demo", fromlist=["main"]).main(args.demo_args))
    return parser


def _add_plan_command(sub) -> None:
    """``partita plan``: what to plan and where, the planning options, what to print or save."""
    p = sub.add_parser(
        "plan",
        help="plan a model built by a factory",
        description="Build a model with FACTORY, plan it on a mesh, print the plan and its estimate.",
    )
    p.add_argument(
        "factory",
        metavar="MODULE:FACTORY",
        help="a callable returning (model, example_inputs), e.g. partitioner.models:gpt_demo; "
        "MODULE may also be a path to a .py file",
    )
    p.add_argument("--kwargs", metavar="JSON", help="keyword arguments for the factory, e.g. '{\"n_layer\": 4}'")
    p.add_argument("--mesh", help="devices per mesh axis, e.g. 8x8 or 4 (or give --devices)")
    p.add_argument("--axis-names", metavar="NAMES", help="comma-separated mesh axis names, e.g. dp,tp")
    p.add_argument(
        "--devices",
        type=int,
        metavar="N",
        help="search the whole configuration for N devices (pipeline x data x tensor x sequence degrees, "
        "microbatches, schedule) instead of planning one --mesh",
    )
    p.add_argument(
        "--global-batch", type=int, metavar="B", help="samples per step for --devices (default: the factory's)"
    )
    p.add_argument(
        "--cluster",
        help="h100, h200, a100, cpu (measured here) or a ClusterSpec JSON file (default: the devices of this "
        "machine: cpu without a GPU, as auto_parallelize)",
    )
    _add_planning_options(p)
    p.add_argument("--json", metavar="PATH", help="save the plan as JSON here")
    p.add_argument(
        "--explain",
        action="append",
        default=[],
        metavar="TARGET",
        help="also explain the choice for a module path, parameter FQN or node; repeatable",
    )
    p.add_argument(
        "--verbose-table", action="store_true", help="show every node: views, getitems and mask/index rows included"
    )
    p.add_argument(
        "--wide",
        action="store_true",
        help="every column in full (op, local shape, collectives with phase and bytes); lines may "
        "exceed 120 characters",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=None,
        metavar="SECONDS",
        help="wall-clock limit of one solve (default 600: a safety net; the node limit normally stops it)",
    )
    p.add_argument(
        "--no-share-blocks", action="store_true", help="decide each repeated block (transformer layer) on its own"
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress messages on stderr")
    p.set_defaults(run=_cmd_plan)


def _add_planning_options(p) -> None:
    """The flags of :class:`partitioner.PlanOptions` (``tests/test_plan_options.py`` checks that
    the plan command has one for each option)."""
    p.add_argument(
        "--precision", choices=("fp32", "bf16", "fp16"), default=None, help="compute precision (default: fp32)"
    )
    p.add_argument("--budget", metavar="BYTES", help="memory per device, e.g. 80GiB (default: the device memory)")
    p.add_argument(
        "--host-budget", metavar="BYTES", help="host memory per device for offloaded optimizer state, e.g. 200GiB"
    )
    p.add_argument(
        "--sequence-parallel",
        choices=("auto", "ring", "ulysses", "none"),
        default="auto",
        help="attention over a sequence split: ring or Ulysses forced, none, or as the solver chooses (auto)",
    )
    p.add_argument(
        "--layers",
        choices=("auto", "full", "blocks"),
        default="auto",
        help="capture deep models by repeating two exported layers (auto) or export every layer (full)",
    )
    p.add_argument("--objective", choices=("time", "memory"), default="time", help="what to minimise")
    p.add_argument(
        "--recompute",
        choices=("auto", "selective", "all", "none"),
        default="auto",
        help="activation checkpointing of repeated blocks: auto (when the budget needs it), selective "
        "(attention cores), all, none",
    )
    p.add_argument(
        "--zero",
        choices=("auto", "1", "2", "3"),
        default="auto",
        help="a replicated weight keeps its optimizer state sharded (1), a weight stored sharded keeps its "
        "gathered copy for backward (2) or gathers it again in backward (3), or the solver chooses (auto)",
    )
    p.add_argument(
        "--tensor-parallel",
        choices=("auto", "1d", "2d", "2.5d", "3d"),
        default="auto",
        help="linear layers as Megatron 1D, 2D (a q x q mesh), 2.5D (d x q x q) or 3D (c x c x c) "
        "tensor parallelism, or as the solver chooses (auto)",
    )
    p.add_argument(
        "--expert-parallel",
        choices=("auto", "on", "off"),
        default="auto",
        help="mixture-of-experts layers: experts split over a mesh axis with all-to-all dispatch (on), "
        "never (off), or as the solver chooses (auto)",
    )
    p.add_argument(
        "--expert-capacity",
        type=float,
        default=None,
        metavar="FACTOR",
        help="mixture-of-experts token dropping: each expert computes at most ceil(FACTOR x tokens x top-k / "
        "experts) pairs per batch, the rest dropped (default: dropless)",
    )
    p.add_argument(
        "--optimizer",
        choices=("adam", "sgd", "none"),
        default="adam",
        help="optimizer state to budget for (default: adam)",
    )
    p.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="KEY=PLACEMENTS",
        help="fix a placement, one per mesh axis, e.g. 'input_ids=[S(0), R]'; KEY is an input, a "
        "parameter FQN, a node name or a module path (globs allowed); repeatable",
    )


def _add_saved_plan_commands(sub) -> None:
    """``show``, ``explain``, ``diff`` and ``report``: commands that read saved plans."""
    p = sub.add_parser("show", help="print a saved plan and its estimate")
    p.add_argument("plan", metavar="PLAN.json")
    p.add_argument("--explain", action="append", default=[], metavar="TARGET", help="also explain TARGET")
    p.add_argument(
        "--verbose-table", action="store_true", help="show every node: views, getitems and mask/index rows included"
    )
    p.add_argument("--wide", action="store_true", help="every column in full; lines may exceed 120 characters")
    p.set_defaults(run=_cmd_show)

    p = sub.add_parser("explain", help="why a saved plan places a module, parameter or node as it does")
    p.add_argument("plan", metavar="PLAN.json")
    p.add_argument("target", nargs="+", metavar="TARGET", help="a module path, parameter FQN or node name")
    p.set_defaults(run=_cmd_explain)

    p = sub.add_parser("diff", help="compare two saved plans")
    p.add_argument("first", metavar="A.json")
    p.add_argument("second", metavar="B.json")
    p.add_argument("--exit-code", action="store_true", help="exit with status 1 when the placements differ")
    p.set_defaults(run=_cmd_diff)

    p = sub.add_parser("report", help="write the plan explorer: one self-contained HTML page")
    p.add_argument("plan", metavar="PLAN.json")
    p.add_argument("-o", "--output", default="report.html", metavar="PATH", help="the HTML file (default: report.html)")
    p.add_argument("--diff", metavar="OTHER.json", help="also compare with this plan (the diff view, folded by block)")
    p.add_argument("--trace", metavar="TIMELINE.json", help="a pipeline's measured step (timeline.json from a dump)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress messages on stderr")
    p.set_defaults(run=_cmd_report)


def _add_calibrate_command(sub) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure this machine into a cluster file (--cluster FILE)",
        description="Time matmuls, elementwise ops, attention, activations and norms, optimizer steps and gloo "
        "collectives on local ranks, fit the cost model's figures and write them to a cluster file.",
    )
    p.add_argument("--ranks", type=int, default=2, help="local gloo ranks, the devices measured (default: 2)")
    p.add_argument(
        "--out", default="cluster.json", metavar="PATH", help="cluster file to write (default: cluster.json)"
    )
    p.add_argument("--name", default="calibrated", help="the cluster's name in plans (default: calibrated)")
    p.add_argument("--memory", metavar="BYTES", help="memory per device (default: the machine's memory / ranks)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a check that it runs, not a calibration")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="measure everything this many times and keep each figure's median (default: 3, 1 with "
        "--quick; a shared machine's speed drifts for tens of seconds at a time)",
    )
    p.add_argument("--as-cpu", action="store_true", help="also make it what cluster='cpu' means on this machine")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress messages on stderr")
    p.set_defaults(run=_cmd_calibrate)


def _add_convert_command(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="a Partita checkpoint (save_checkpoint's folder) to a HuggingFace directory, or back",
        description="The direction follows SOURCE: a HuggingFace directory becomes a Partita checkpoint "
        "(load_checkpoint reads it under any mesh); a Partita checkpoint becomes a HuggingFace directory "
        "that from_pretrained loads. Runs in one process, tensors whole in memory.",
    )
    p.add_argument("source", metavar="SOURCE")
    p.add_argument("target", metavar="TARGET")
    p.add_argument(
        "--config",
        metavar="PATH",
        help="the HF configuration (a directory or config.json), for a Partita checkpoint that records none",
    )
    p.add_argument("--max-shard-size", default="5GB", help="the largest safetensors file written (default 5GB)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress messages on stderr")
    p.set_defaults(run=_cmd_convert)


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed its usage message
        return exc.code if isinstance(exc.code, int) else _EXIT_USAGE
    try:
        return args.run(args)
    except CLIError as exc:
        if args.debug:
            raise
        message = " ".join(str(exc).split())  # one line, whatever the underlying message held
        print(f"partita: error: {message}", file=sys.stderr)
        return _EXIT_USAGE
    except KeyboardInterrupt:
        print("partita: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
