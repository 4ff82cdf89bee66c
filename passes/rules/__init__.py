"""The rule registry: the one home of op semantics (decision 3 in docs/ARCHITECTURE.md).

Importing this package registers every family. ``rule_for(node)`` returns the node's rule,
or the replicate fallback (with one warning naming the op) when none is registered.
"""

from passes.rules import (  # noqa: F401
    attention,
    contractions,
    elementwise,
    embedding_loss,
    experts,
    normalization,
    reductions,
    structured,
    views,
)
from passes.rules.base import (
    IGNORED_OPS,
    REPLICATE_FALLBACK,
    AxisStrategy,
    OpRule,
    OpView,
    Strategy,
    expand_to_mesh,
    has_rule,
    op_name,
    op_view,
    rate_key,
    register,
    rule_for,
    tensor_input_nodes,
)

__all__ = [
    "IGNORED_OPS",
    "REPLICATE_FALLBACK",
    "AxisStrategy",
    "OpRule",
    "OpView",
    "Strategy",
    "expand_to_mesh",
    "has_rule",
    "op_name",
    "op_view",
    "rate_key",
    "register",
    "rule_for",
    "tensor_input_nodes",
]
