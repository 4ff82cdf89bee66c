"""Capture: ``nn.Module`` + example inputs -> an aten-level ``torch.fx`` graph.

Capture uses ``torch.export.export(strict=False)`` (decision 1 in docs/ARCHITECTURE.md).
Parameters and buffers come out as placeholders (the graph signature maps them to their fully
qualified names); every node carries ``meta["val"]`` (a FakeTensor: shape and dtype) and
``meta["nn_module_stack"]``. Models built on the ``meta`` device capture without memory:
example inputs are moved to ``meta`` too. A failure is re-raised as :class:`CaptureError`
naming the construct that export could not handle and what to try. HuggingFace
mixture-of-experts modules are captured as one op each (:mod:`passes.capture.experts_op`).
"""

from __future__ import annotations

import contextlib
import io
import linecache
import logging
import os
import re
import traceback
import warnings
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.fx.config  # noqa: F401  (fx.config.do_not_emit_stack_traces)

from passes.capture.autocast_regions import inline_autocast_regions
from passes.capture.errors import CaptureError
from passes.capture.experts_op import check_droppable, experts_as_ops

__all__ = [
    "CaptureError",
    "CapturedGraph",
    "capture",
    "describe_captured",
    "graph_fingerprint",
    "tied_placeholders",
    "training_configs",
]


@dataclass
class CapturedGraph:
    """The captured program and what each placeholder stands for."""

    graph_module: fx.GraphModule
    exported: torch.export.ExportedProgram | None
    """The ``torch.export.ExportedProgram``; None for a pipeline stage's piece of one."""
    params: dict
    """placeholder name -> parameter FQN."""
    buffers: dict
    """placeholder name -> buffer / constant FQN."""
    user_inputs: list
    """placeholder names of the user's inputs, in call order."""
    input_names: dict
    """placeholder name -> the user's argument name (``input_ids``, ``idx``, ...)."""
    training: bool = True
    """The model's mode when captured (``aten.dropout`` and batch-norm ops bake it in)."""
    autocast_dtype: object = None
    """The ``torch.autocast`` dtype it was captured (and must run) under; None: none."""
    expert_capacity: float | None = None
    """The capacity factor its MoE layers drop tokens at (None: dropless; see
    :func:`passes.capture.experts_op.experts_as_ops`)."""

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    def frozen_params(self) -> set:
        """FQNs of the parameters that need no gradient (``requires_grad=False``: frozen, or a
        fixed table such as Marian's sinusoidal positions): they are neither trained nor synced."""
        return {
            self.params[n.name]
            for n in self.graph.nodes
            if n.op == "placeholder" and n.name in self.params and not getattr(n.meta.get("val"), "requires_grad", True)
        }

    @property
    def exported_program(self) -> torch.export.ExportedProgram:
        """``exported``, for a capture of a whole model (a pipeline stage's piece has none)."""
        if self.exported is None:
            raise ValueError("this captured graph is a pipeline stage's piece: it has no ExportedProgram")
        return self.exported


def _split_inputs(example_inputs):
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise TypeError(
        f"example_inputs must be a tuple of positional arguments or a dict of keyword arguments, "
        f"got {type(example_inputs).__name__}"
    )


def _on_meta(model: torch.nn.Module) -> bool:
    tensors = list(model.parameters()) + list(model.buffers())
    return bool(tensors) and all(t.is_meta for t in tensors)


@contextlib.contextmanager
def training_configs(model: torch.nn.Module):
    """Capture a training program: HuggingFace models with ``config.use_cache`` on (the default
    of most decoder-only and encoder-decoder families) return a key/value cache object that
    training never reads and ``torch.export`` cannot flatten; switch it off on every config in
    the model for the duration of the capture (the user's model is left as it was)."""
    configs = {
        id(c): c
        for m in model.modules()
        if (c := getattr(m, "config", None)) is not None and getattr(c, "use_cache", None)
    }
    for config in configs.values():
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs.values():
            config.use_cache = True


_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # passes/


def _site_of(message: str, exc: BaseException) -> str:
    """Where the model's code met the construct: the last call the message names, else the
    deepest frame of the failure (and of its causes) outside torch and Partita, with its line."""
    named = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', message)
    if named:
        path, line, func = named[-1]
    else:
        frames: list = []
        seen: set = set()
        failure: BaseException | None = exc
        while failure is not None and id(failure) not in seen:
            seen.add(id(failure))
            frames = traceback.extract_tb(failure.__traceback__) + frames
            failure = failure.__cause__ or failure.__context__
        model = [
            f
            for f in frames
            if not f.filename.startswith((_TORCH_DIR, _OWN_DIR, "<")) and "contextlib" not in f.filename
        ]
        if not model:
            return ""
        path, line, func = model[-1].filename, str(model[-1].lineno), model[-1].name
    code = linecache.getline(path, int(line)).strip()
    return f" (at {path}:{line} in {func}" + (f": `{code}`)" if code else ")")


def _hint_for(message: str) -> str:
    unknown = re.search(r"Found <class '([^']+)'> in output", message)
    if unknown:
        kind = unknown.group(1).rpartition(".")[2]
        return (
            f"the model returns a {kind} object, which torch.export cannot take apart; if it is a cache "
            f"for generation, build the model with use_cache=False (Partita already switches "
            f"config.use_cache off), else return plain tensors or register {kind} with "
            f"torch.utils._pytree.register_pytree_node"
        )
    if "data-dependent" in message or "GuardOnDataDependentSymNode" in message:
        return (
            "the model branches on tensor values; replace the Python `if`/`.item()` on a tensor "
            "with torch.where / torch.cond, or pass inputs that avoid that branch"
        )
    if "Unsupported" in message or "not supported" in message:
        return "rewrite that construct with plain torch ops, or capture a submodule that avoids it"
    return "check that the model runs eagerly on these example inputs; then simplify the construct named above"


@contextlib.contextmanager
def _on_fake_cpu(model: torch.nn.Module, args, kwargs):
    """The model's ``meta`` parameters and buffers swapped for fake CPU tensors (no memory), and
    the inputs made fake CPU tensors of the same mode, for the block: autocast has no ``meta``
    device, so a model on ``meta`` is captured under mixed precision as if on the CPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    fakes: dict = {}  # id(original) -> fake: tied weights stay one tensor
    saved: list[tuple[dict, str, torch.Tensor]] = []  # (a module's parameter or buffer table, name, original)

    def fake(t, parameter=False):
        if id(t) not in fakes:
            with mode:
                made = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            fakes[id(t)] = torch.nn.Parameter(made, requires_grad=t.requires_grad) if parameter else made
        return fakes[id(t)]

    for module in model.modules():
        for table, parameter in ((module._parameters, True), (module._buffers, False)):
            for name, t in list(table.items()):
                if t is not None:
                    saved.append((table, name, t))
                    table[name] = fake(t, parameter)
    to_fake = lambda t: fake(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
    try:
        yield torch.utils._pytree.tree_map(to_fake, args), torch.utils._pytree.tree_map(to_fake, kwargs)
    finally:
        for original_table, name, original in saved:
            original_table[name] = original


def _device_type(model: torch.nn.Module) -> str:
    tensor = next(iter(list(model.parameters()) + list(model.buffers())), None)
    return tensor.device.type if tensor is not None else "cpu"


def _torch_loggers_with_levels() -> list:
    """The ``torch`` logger and those below it that set a level of their own: raising these to
    CRITICAL silences every torch logger (the others take the level of their nearest ancestor
    that sets one). Each ``setLevel`` clears the cache of every logger the process has, so
    setting all of them (several hundred in a process that imported transformers) cost about
    0.4 CPU-s per capture."""
    loggers = logging.root.manager.loggerDict
    return [logging.getLogger("torch")] + [
        log
        for name, log in list(loggers.items())
        if name.startswith("torch.") and isinstance(log, logging.Logger) and log.level != logging.NOTSET
    ]


def capture(
    model: torch.nn.Module, example_inputs, *, stack_traces: bool = False, autocast_dtype=None, expert_capacity=None
) -> CapturedGraph:
    """Export ``model`` on ``example_inputs`` (a tuple of positional args or a dict of kwargs).

    ``stack_traces=True`` keeps each node's Python stack trace in ``meta["stack_trace"]``;
    off by default because collecting them costs about a third of the export time, and
    plans name nodes by module path instead. ``autocast_dtype`` (``torch.bfloat16`` or
    ``torch.float16``): capture under ``torch.autocast`` on the model's device type, so the
    graph's values carry the dtypes mixed precision computes in (the lowered program runs
    under the same autocast); a model on ``meta`` is autocast as on the CPU. ``expert_capacity``:
    the MoE layers drop the tokens beyond each expert's capacity at this factor.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    args, kwargs = _split_inputs(example_inputs)
    if _on_meta(model):
        to_meta = lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t  # noqa: E731
        args = torch.utils._pytree.tree_map(to_meta, args)
        kwargs = torch.utils._pytree.tree_map(to_meta, kwargs)
    check_droppable(model, expert_capacity)  # before export: its errors would read as a capture failure
    saved_flag = fx.config.do_not_emit_stack_traces
    fx.config.do_not_emit_stack_traces = not stack_traces
    # A failing export logs partial graphs from several torch loggers; our error says it once.
    torch_logs = _torch_loggers_with_levels()
    saved_levels = [log.level for log in torch_logs]
    for log in torch_logs:
        log.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()), contextlib.ExitStack() as stack:
            warnings.simplefilter("ignore")
            if autocast_dtype is not None and autocast_dtype != torch.float32:
                device_type = _device_type(model)
                if device_type == "meta":
                    args, kwargs = stack.enter_context(_on_fake_cpu(model, args, kwargs))
                    device_type = "cpu"
                stack.enter_context(torch.autocast(device_type, dtype=autocast_dtype))
            with training_configs(model), experts_as_ops(model, expert_capacity):
                exported = torch.export.export(model, args, kwargs, strict=False)
    except Exception as exc:  # export raises many types; all become one clear error
        message = str(exc).strip()
        first = next((line for line in message.splitlines() if line.strip()), type(exc).__name__)
        site = _site_of(message, exc)
        error = CaptureError(
            f"could not capture {type(model).__name__} with torch.export: {type(exc).__name__}: "
            f"{first[:400]}{site}. What to do: {_hint_for(message)}."
        )
        error.partial_graph = str(getattr(exc, "partial_fx_graph", "") or "")
        raise error from exc
    finally:
        fx.config.do_not_emit_stack_traces = saved_flag
        for log, level in zip(torch_logs, saved_levels):
            log.setLevel(level)

    inline_autocast_regions(exported.graph_module)  # a region under another autocast state: plain nodes
    signature = exported.graph_signature
    params = dict(signature.inputs_to_parameters)
    buffers = dict(signature.inputs_to_buffers)
    buffers.update(getattr(signature, "inputs_to_lifted_tensor_constants", {}) or {})
    user_inputs = list(signature.user_inputs)
    # Export names user-input placeholders after the forward's parameters (or the kwargs).
    input_names = {name: name for name in user_inputs}
    gm = exported.graph_module
    return CapturedGraph(
        graph_module=gm,
        exported=exported,
        params=params,
        buffers=buffers,
        user_inputs=user_inputs,
        input_names=input_names,
        training=model.training,
        autocast_dtype=autocast_dtype if autocast_dtype != torch.float32 else None,
        expert_capacity=expert_capacity,
    )


def tied_placeholders(cap: CapturedGraph) -> list:
    """Placeholders that are one tensor under several names (tied weights: GPT-2's ``lm_head``
    and ``wte``), as lists of placeholder names in graph order; export lifts each name apart."""
    state = getattr(cap.exported, "state_dict", None) or {}
    by_tensor: dict = {}
    for node in cap.graph.nodes:
        if node.op != "placeholder":
            continue
        fqn = cap.params.get(node.name) or cap.buffers.get(node.name)
        if fqn is not None and fqn in state:
            by_tensor.setdefault(id(state[fqn]), []).append(node.name)
    return [names for names in by_tensor.values() if len(names) > 1]


def describe_captured(cap: CapturedGraph) -> str:
    n = sum(1 for node in cap.graph.nodes if node.op == "call_function")
    return f"{n} ops, {len(cap.params)} parameters, {len(cap.user_inputs)} inputs"


def graph_fingerprint(cap: CapturedGraph, *, shapes: bool = True) -> str:
    """A hash of the program: ops, wiring, parameter names and (``shapes=True``) shapes and dtypes.

    Two captures of the same model on inputs of the same shapes agree; a different model,
    or the same model at another batch or sequence size, disagrees. With ``shapes=False`` the
    hash is the program's structure alone, which other batch and sequence sizes share (a plan
    made for one serves the others where its shards still divide).
    """
    import hashlib

    index = {}
    h = hashlib.sha256()
    for i, node in enumerate(cap.graph.nodes):
        index[node] = i
        val = node.meta.get("val")
        vals = val if isinstance(val, (list, tuple)) else [val]
        tensors = [v for v in vals if isinstance(v, torch.Tensor)]
        described = (
            [(tuple(v.shape), str(v.dtype)) for v in tensors] if shapes else [(v.dim(), str(v.dtype)) for v in tensors]
        )
        args = [index.get(a, "?") for a in node.all_input_nodes]
        name = cap.params.get(node.name) or cap.buffers.get(node.name) or ""
        h.update(repr((node.op, str(node.target), described, args, name)).encode())
    return h.hexdigest()[:16]
