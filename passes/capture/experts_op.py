"""Capture HuggingFace experts modules as one op: ``partita.moe_experts``.

HuggingFace transformers 5.x stores a mixture-of-experts layer's experts stacked
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) in a module decorated with
``use_experts_implementation`` and called as ``experts(hidden [T, H], top_k_index [T, k],
top_k_weights [T, k])`` (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, ...). Its forward is an eager
loop over the experts hit (``nonzero``, ``where``: data-dependent), or a sort + grouped matmul,
or a batched matmul, as ``config._experts_implementation`` says. Traced op by op, neither
splits by expert: the expert dim is only ever indexed.

While a model is captured (:func:`experts_as_ops`, entered by :func:`passes.capture.capture.capture`),
every such module's forward is replaced by one call of the custom op
``partita::moe_experts(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation)``,
which computes exactly what the module computes (:func:`runtime.expert_dispatch.experts_forward`,
whichever implementation the config names: they agree). The graph then has one node per MoE
layer whose rule (:mod:`passes.rules.experts`) offers expert parallelism, and whose lowering
runs the all-to-all dispatch. The router (the top-k before it) and the combine's consumers stay
ordinary ops, so a router's auxiliary loss is planned like any other computation.

With an expert capacity (``expert_capacity=``), the module's forward first marks the pairs beyond
each expert's capacity as dropped (:func:`runtime.expert_dispatch.drop_over_capacity`: plain ops
over the whole batch's top-k index, so they are planned and split like any other op) and the op
skips them.

A module whose variant the op does not cover (biases, transposed or interleaved weights, a
post-expert norm, a gating of its own, an activation not in
:data:`runtime.expert_dispatch.ACTIVATIONS`) keeps its own forward and is planned op by op; the
log says which and why.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from runtime.expert_dispatch import ACTIVATIONS, drop_over_capacity, experts_forward

logger = logging.getLogger(__name__)

__all__ = ["MOE_OP", "check_droppable", "experts_as_ops", "experts_activation", "why_not_op"]

_ACTIVATION_CLASSES = {
    "SiLU": "silu",
    "SiLUActivation": "silu",
    "GELUActivation": "gelu",
    "GELU": "gelu",
    "NewGELUActivation": "gelu_tanh",
    "GELUTanh": "gelu_tanh",
    "PytorchGELUTanh": "gelu_tanh",
    "ReLU": "relu",
}


@torch.library.custom_op("partita::moe_experts", mutates_args=())
def moe_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    return experts_forward(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation)


@moe_experts.register_fake
def _moe_experts_fake(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation):
    return torch.empty_like(hidden)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5])
    ctx.activation = inputs[5]


def _backward(ctx, grad):
    """The op run directly (not lowered): backward recomputes it under autograd."""
    saved = ctx.saved_tensors
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(need) for t, need in zip(saved, ctx.needs_input_grad)]
        out = experts_forward(*leaves, ctx.activation)
        wanted = [t for t in leaves if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
    return tuple(next(grads) if t.requires_grad else None for t in leaves) + (None,)


moe_experts.register_autograd(_backward, setup_context=_setup_context)
MOE_OP = torch.ops.partita.moe_experts.default


def experts_activation(module: torch.nn.Module) -> str | None:
    """The activation name of an experts module's ``act_fn`` (None: not one the op has)."""
    return _ACTIVATION_CLASSES.get(type(getattr(module, "act_fn", None)).__name__)


def why_not_op(module: torch.nn.Module) -> str | None:
    """Why ``module`` is not a HuggingFace experts module the op covers (None: it is one)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gate_up, torch.nn.Parameter) or not isinstance(down, torch.nn.Parameter):
        return "no stacked gate_up_proj / down_proj parameters"
    if gate_up.dim() != 3 or down.dim() != 3:
        return f"gate_up_proj {tuple(gate_up.shape)} / down_proj {tuple(down.shape)} are not [experts, out, in]"
    experts, hidden, inner = down.shape
    if tuple(gate_up.shape) != (experts, 2 * inner, hidden):
        return f"gate_up_proj {tuple(gate_up.shape)} is not [E, 2I, H] for down_proj {tuple(down.shape)}"
    for flag, wanted in (("has_gate", True), ("has_bias", False), ("is_transposed", False)):
        if getattr(module, flag, wanted) != wanted:
            return f"{flag}={getattr(module, flag)}"
    if getattr(module, "has_post_expert_norm", False) or not getattr(module, "is_concatenated", True):
        return "a post-expert norm or interleaved gate/up weights"
    gate = getattr(type(module), "_apply_gate", None)
    if gate is not None and gate.__name__ != "_default_apply_gate":
        return "a gating function of its own"
    if experts_activation(module) is None:
        return f"activation {type(getattr(module, 'act_fn', None)).__name__} (the op has {sorted(ACTIVATIONS)})"
    return None


def _op_forward(module: torch.nn.Module, activation: str, capacity_factor: float | None):
    def forward(hidden_states, top_k_index, top_k_weights):
        if capacity_factor is not None:
            top_k_index = drop_over_capacity(top_k_index, module.gate_up_proj.shape[0], capacity_factor)
        return torch.ops.partita.moe_experts(
            hidden_states, top_k_index, top_k_weights, module.gate_up_proj, module.down_proj, activation
        )

    return forward


def _looks_like_experts(module: torch.nn.Module) -> bool:
    return hasattr(module, "gate_up_proj") and hasattr(module, "down_proj") and hasattr(module, "num_experts")


def check_droppable(model: torch.nn.Module, capacity_factor: float | None) -> None:
    """With a capacity: raise naming the first experts module of ``model`` the op does not cover
    (its tokens could not be dropped)."""
    if capacity_factor is None:
        return
    for path, module in model.named_modules():
        problem = why_not_op(module) if _looks_like_experts(module) else None
        if problem is not None:
            raise ValueError(
                f"expert_capacity={capacity_factor!r}: experts module {path or type(module).__name__} is not one "
                f"the experts op covers ({problem}), so its tokens cannot be dropped; leave expert_capacity out"
            )


@contextlib.contextmanager
def experts_as_ops(model: torch.nn.Module, capacity_factor: float | None = None):
    """While inside, every HuggingFace experts module of ``model`` the op covers runs as
    ``partita.moe_experts`` (module docstring); the model is left as it was afterwards.

    ``capacity_factor``: drop the pairs beyond each expert's capacity first
    (:func:`runtime.expert_dispatch.drop_over_capacity`); every experts module must then be one
    the op covers (a ``ValueError`` names the one that is not). Outside an export this is also
    how a model trains on one device with the same dropping (the reference of a split run)."""
    check_droppable(model, capacity_factor)
    patched = []
    for path, module in model.named_modules():
        if not _looks_like_experts(module):
            continue
        problem = why_not_op(module)
        if problem is not None:
            logger.info("experts module %s is planned op by op: %s", path or type(module).__name__, problem)
            continue
        module.forward = _op_forward(module, str(experts_activation(module)), capacity_factor)
        patched.append(module)
    try:
        yield patched
    finally:
        for module in patched:
            del module.forward
