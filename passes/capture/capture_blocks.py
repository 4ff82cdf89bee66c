"""Fast capture of deep models: export two layers, then repeat the second one in the graph.

``torch.export`` traces every layer, so capture grows linearly with depth and dominates
planning time for deep transformers. When a model's deepest ``nn.ModuleList`` holds identical
layers (same class, same parameter names, shapes and dtypes, same submodule types), this pass
exports the model with the list cut to its first two layers, checks that the two traced
layers are the same program (:mod:`passes.capture.blocks`), and builds the full graph by copying the
second layer's nodes once per missing layer: its references to the previous layer point to the
previous copy, its parameters to new placeholders for that layer, and the nodes after the
layers read the last copy. Node names are then reassigned the way export names them (op name
plus a counter, in graph order), so the result is the graph a full export gives, node for node
(``tests/test_capture.py`` checks names, ops, arguments and fingerprints against full exports).

A layer whose Python code depends on its index (alternating attention kinds, say) would be
traced as the first two only: pass ``capture(..., layers="full")`` for such models.
"""

from __future__ import annotations

import re

import torch
import torch.fx as fx

from passes.capture.capture import CapturedGraph, capture

__all__ = ["repeated_layers", "capture_by_blocks", "capture_model"]


def capture_model(
    model: torch.nn.Module,
    example_inputs,
    *,
    layers: str = "auto",
    min_layers: int = 8,
    autocast_dtype=None,
    expert_capacity=None,
):
    """Capture ``model``: ``layers="full"`` exports every layer; ``"blocks"`` exports two and
    repeats them (an error if the model has no identical layers); ``"auto"`` does that for
    models with ``min_layers`` or more identical layers and exports small ones whole.
    ``autocast_dtype``, ``expert_capacity``: as :func:`passes.capture.capture.capture` takes them."""
    if layers not in ("auto", "full", "blocks"):
        raise ValueError(f"layers must be 'auto', 'full' or 'blocks', got {layers!r}")
    if layers != "full":
        found = repeated_layers(model, min_layers=3 if layers == "blocks" else min_layers)
        cap = (
            capture_by_blocks(model, example_inputs, autocast_dtype=autocast_dtype, expert_capacity=expert_capacity)
            if found is not None
            else None
        )
        if cap is not None:
            return cap
        if layers == "blocks":
            raise ValueError(
                f"{type(model).__name__} has no list of 3 or more identical layers whose traces "
                f"agree; capture it with layers='full'"
            )
    return capture(model, example_inputs, autocast_dtype=autocast_dtype, expert_capacity=expert_capacity)


def _layout(module: torch.nn.Module):
    return (
        type(module),
        tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters()),
        tuple((n, tuple(b.shape), b.dtype) for n, b in module.named_buffers()),
        tuple((n, type(m)) for n, m in module.named_modules()),
    )


def repeated_layers(model: torch.nn.Module, min_layers: int = 3):
    """(path, ModuleList) of the largest list of identical layers, or None."""
    best = None
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) >= min_layers:
            first = _layout(module[0])
            if all(_layout(m) == first for m in module) and (best is None or len(module) > len(best[1])):
                best = (path, module)
    return best


def _parent(model, path):
    owner = model
    parts = path.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part)
    return owner, parts[-1]


_SUFFIX = re.compile(r"_\d+$")


def capture_by_blocks(
    model: torch.nn.Module, example_inputs, *, stack_traces: bool = False, autocast_dtype=None, expert_capacity=None
):
    """Capture through two layers and repeat them; None when the model has no such layers or
    the two traced layers differ (the caller then exports the whole model)."""
    from passes.analysis.analyze import analyze
    from passes.capture.blocks import _signature

    found = repeated_layers(model)
    if found is None:
        return None
    path, layers = found
    owner, attr = _parent(model, path)
    setattr(owner, attr, torch.nn.ModuleList(list(layers)[:2]))
    try:
        short = capture(
            model,
            example_inputs,
            stack_traces=stack_traces,
            autocast_dtype=autocast_dtype,
            expert_capacity=expert_capacity,
        )
    finally:
        setattr(owner, attr, layers)

    if getattr(short.exported_program.graph_signature, "buffers_to_mutate", None):
        return None  # buffer updates (BatchNorm statistics) are outputs per layer: export them all
    prefix = f"{path}."
    ops, params = _first_two_layers(short, prefix)
    if not ops[1] or len(ops[0]) != len(ops[1]) or len(params[0]) != len(params[1]):
        return None
    # the two layers must be one program (same ops, shapes and wiring relative to the layer)
    analyze(short)
    if _signature(params[0] + ops[0], path, 0) != _signature(params[1] + ops[1], path, 1):
        return None
    new, new_params, new_buffers = _LayerRepeater(short, ops, params, prefix, len(layers)).build()
    gm = fx.GraphModule(short.graph_module, _rename_like_export(new))
    return CapturedGraph(
        graph_module=gm,
        exported=short.exported,
        params=new_params,
        buffers=new_buffers,
        user_inputs=list(short.user_inputs),
        input_names=dict(short.input_names),
        training=short.training,
        autocast_dtype=short.autocast_dtype,
        expert_capacity=short.expert_capacity,
    )


def _first_two_layers(short: CapturedGraph, prefix: str) -> tuple:
    """The op nodes and the parameter / buffer placeholders of layers 0 and 1 (``{0: [...], 1:
    [...]}`` each, in graph order) of a graph captured with the list at ``prefix`` cut to two."""

    def block_index(node):
        stack = node.meta.get("nn_module_stack") or {}
        for p, _ in stack.values():
            p = p if isinstance(p, str) else str(p)
            m = re.match(re.escape(prefix) + r"(\d+)(\.|$)", p)
            if m:
                return int(m.group(1))
        return None

    ops: dict = {0: [], 1: []}
    params: dict = {0: [], 1: []}
    for node in short.graph.nodes:
        if node.op == "call_function":
            k = block_index(node)
            if k in ops:
                ops[k].append(node)
        elif node.op == "placeholder":
            fqn = short.params.get(node.name) or short.buffers.get(node.name)
            if fqn and fqn.startswith(prefix):
                k = int(fqn[len(prefix) :].split(".")[0])
                params[k].append(node)
    return ops, params


class _LayerRepeater:
    """The full graph from the two-layer one: layer 1's placeholders and op nodes copied once per
    missing layer ``k`` (2 to ``n - 1``), each copy reading the previous one where layer 1 read
    layer 0, and the nodes after the layers reading the last copy."""

    def __init__(self, short: CapturedGraph, ops: dict, params: dict, prefix: str, n: int):
        self.short, self.ops, self.params, self.prefix, self.n = short, ops, params, prefix, n
        self.position = {node: i for i, node in enumerate(ops[1])}
        self.previous_of = dict(zip(ops[0], ops[1]))  # layer-0 node -> layer-1 node (same position)
        self.new = fx.Graph()
        self.env: dict = {}
        self.new_params, self.new_buffers = dict(short.params), dict(short.buffers)
        self.layer_placeholders: dict = {}  # (layer, layer-1 placeholder) -> new placeholder
        self.copies: list = []  # per added layer: {layer-1 node -> copy}

    def placeholder(self, name, old):
        node = self.new.placeholder(name)
        node.meta.update(old.meta)
        return node

    def latest(self, a):
        """The newest copy of a layer-1 node (the last added layer's), else the node's own copy."""
        last = self.copies[-1] if self.copies else {}
        return last.get(a, self.env[a]) if a in self.position else self.env[a]

    def build(self) -> tuple:
        """(the new graph, placeholder name -> parameter FQN, likewise for buffers)."""
        last_param_of_layer1 = self.params[1][-1]
        for node in self.short.graph.nodes:
            if node.op == "placeholder":
                self.env[node] = self.placeholder(node.name, node)
                if node is last_param_of_layer1:
                    for k in range(2, self.n):
                        self.add_placeholders(k)
                continue
            if node.op == "output":
                self.new.output(fx.map_arg(node.args[0], self.latest))
                continue
            mapped = fx.map_arg((node.args, node.kwargs), self.latest)
            self.env[node] = self.new.create_node(node.op, node.target, mapped[0], mapped[1], name=node.name)
            self.env[node].meta.update(node.meta)
            if node is self.ops[1][-1]:
                for k in range(2, self.n):
                    self.copies.append(self.copy_layer(k))
        return self.new, self.new_params, self.new_buffers

    def add_placeholders(self, k: int) -> None:
        """Layer ``k``'s parameters and buffers, named as export names them."""
        short, prefix = self.short, self.prefix
        for twin, old in zip(self.params[0], self.params[1]):
            table = short.params if old.name in short.params else short.buffers
            fqn = prefix + str(k) + table[old.name][len(prefix) + 1 :]
            # export's name for layer k: layer 1's with its index replaced
            at = next(i for i, (a, b) in enumerate(zip(twin.name, old.name)) if a != b)
            made = self.placeholder(old.name[:at] + str(k) + old.name[at + 1 :], old)
            (self.new_params if table is short.params else self.new_buffers)[made.name] = fqn
            self.layer_placeholders[(k, old)] = made

    def copy_layer(self, k: int) -> dict:
        """Layer 1's op nodes copied as layer ``k``: {layer-1 node -> copy}."""
        prefix, env = self.prefix, self.env
        copy: dict = {}
        before = self.copies[-1] if self.copies else None

        def remap(a):
            if a in copy:
                return copy[a]
            if a in self.previous_of:  # a layer-0 node: the previous layer's twin
                twin = self.previous_of[a]
                return before[twin] if before is not None else env[twin]
            if (k, a) in self.layer_placeholders:
                return self.layer_placeholders[(k, a)]
            return env[a]

        for old in self.ops[1]:
            margs = fx.map_arg((old.args, old.kwargs), remap)
            made = self.new.create_node(old.op, old.target, margs[0], margs[1], name=old.name)
            made.meta.update(old.meta)
            stack = old.meta.get("nn_module_stack")
            if stack:
                made.meta["nn_module_stack"] = {
                    key.replace(f"{prefix}1", f"{prefix}{k}"): (
                        (p.replace(f"{prefix}1", f"{prefix}{k}", 1) if isinstance(p, str) else p),
                        t,
                    )
                    for key, (p, t) in stack.items()
                }
            copy[old] = made
        return copy


def _rename_like_export(graph: fx.Graph) -> fx.Graph:
    """The same graph rebuilt in order with each op node offered its op's base name, so fx's
    namespace numbers them (``linear``, ``linear_1``, ...; builtins like ``slice`` start at
    ``_1``) exactly as export's tracer did."""
    fresh = fx.Graph()
    env = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            made = fresh.placeholder(node.name)
        elif node.op == "output":
            made = fresh.output(fx.map_arg(node.args[0], env.__getitem__))
        else:
            args, kwargs = fx.map_arg((node.args, node.kwargs), env.__getitem__)
            made = fresh.create_node(node.op, node.target, args, kwargs, name=_SUFFIX.sub("", node.name))
        made.meta.update(node.meta)
        env[node] = made
    return fresh
