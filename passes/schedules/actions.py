"""One pipeline action and its text form: ``<stage><KIND><microbatch>``, with ``->peer``/``<-peer``.

One action is ``<stage><KIND><microbatch>``, with ``->peer`` for a send and ``<-peer`` for a
receive (``peer`` is the stage at the other end)::

    2F0          stage 2, forward of microbatch 0
    1B3          stage 1, full backward (input and weight gradients) of microbatch 3
    0I1  0W1     stage 0, input-gradient-only backward / weight-gradient of microbatch 1
    1SEND_F0->2  stage 1 sends microbatch 0's activation to stage 2
    2RECV_F0<-1  stage 2 receives it from stage 1
    2SEND_B0->1  stage 2 sends microbatch 0's input gradient to stage 1
    1RECV_B0<-2  stage 1 receives it

Numbers have no leading zeros, so ``format_action(parse_action(s)) == s`` for every valid ``s``.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from enum import Enum

logger = logging.getLogger(__name__)


class ActionKind(str, Enum):
    F = "F"
    """Forward."""
    B = "B"
    """Full backward: input and weight gradients."""
    I = "I"  # noqa: E741
    """Backward for the input gradient only (zero-bubble split)."""
    W = "W"
    """Weight gradient only; needs the stage's ``I`` first."""
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"


_KIND_OF = {k.value: k for k in ActionKind}
_COMPUTE = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W})
SENDS = frozenset({ActionKind.SEND_F, ActionKind.SEND_B})
RECVS = frozenset({ActionKind.RECV_F, ActionKind.RECV_B})
# Where the peer of a communication action sits relative to its own stage.
PEER_OFFSET = {ActionKind.SEND_F: 1, ActionKind.RECV_F: -1, ActionKind.SEND_B: -1, ActionKind.RECV_B: 1}
_COUNTERPART = {
    ActionKind.SEND_F: ActionKind.RECV_F,
    ActionKind.RECV_F: ActionKind.SEND_F,
    ActionKind.SEND_B: ActionKind.RECV_B,
    ActionKind.RECV_B: ActionKind.SEND_B,
}


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    stage: int
    """The (virtual) stage that runs the action."""
    microbatch: int
    peer: int | None = None
    """For sends and receives: the stage at the other end. ``None`` for compute actions."""

    def __post_init__(self):
        if self.kind.__class__ is not ActionKind:  # a plain string such as "F"
            object.__setattr__(self, "kind", _KIND_OF.get(self.kind) or ActionKind(self.kind))
        if self.stage < 0 or self.microbatch < 0 or (self.peer is not None and self.peer < 0):
            raise ValueError(
                f"stage, microbatch and peer must be >= 0, got {self.stage}, {self.microbatch} and {self.peer}"
            )
        if self.is_compute != (self.peer is None):
            need = "takes no peer" if self.is_compute else "needs the peer stage"
            raise ValueError(f"action kind {self.kind.value} {need} (got peer={self.peer})")

    @property
    def is_compute(self) -> bool:
        return self.kind in _COMPUTE

    @property
    def is_send(self) -> bool:
        return self.kind in SENDS

    @property
    def is_recv(self) -> bool:
        return self.kind in RECVS

    @property
    def is_backward(self) -> bool:
        """``B`` or ``I``: the action that produces the stage's input gradient."""
        return self.kind in (ActionKind.B, ActionKind.I)

    @property
    def makes_weight_grads(self) -> bool:
        """``B`` or ``W``: the action that produces the stage's parameter gradients."""
        return self.kind in (ActionKind.B, ActionKind.W)

    def counterpart(self) -> Action:
        """The receive matching this send, or the send matching this receive."""
        assert self.peer is not None, "a compute action has no counterpart"  # sends and receives have a peer
        return Action(_COUNTERPART[self.kind], self.peer, self.microbatch, self.stage)

    def __str__(self) -> str:
        return format_action(self)


def format_action(action: Action) -> str:
    """``Action(F, 2, 0)`` -> ``"2F0"``; ``Action(SEND_F, 1, 0, peer=2)`` -> ``"1SEND_F0->2"``."""
    text = f"{action.stage}{action.kind.value}{action.microbatch}"
    if action.is_send:
        text += f"->{action.peer}"
    elif action.is_recv:
        text += f"<-{action.peer}"
    return text


_NUM = r"(0|[1-9][0-9]*)"
_ACTION_RE = re.compile(rf"^{_NUM}(SEND_F|SEND_B|RECV_F|RECV_B|F|B|I|W){_NUM}(?:(->|<-){_NUM})?$")


def parse_action(text: str) -> Action:
    """Inverse of :func:`format_action`; raises ``ValueError`` naming the text it cannot read."""
    match = _ACTION_RE.match(text.strip())
    if not match:
        raise ValueError(
            f"cannot parse pipeline action {text!r}: expected <stage><KIND><microbatch> "
            "like '2F0', '1B3', '0W1', '1SEND_F0->2' or '2RECV_F0<-1'"
        )
    stage, kind, mb, arrow, peer = match.groups()
    kind = ActionKind(kind)
    expected_arrow = "->" if kind in SENDS else "<-" if kind in RECVS else None
    if arrow != expected_arrow:
        need = f"'{expected_arrow}<peer stage>'" if expected_arrow else "no peer"
        raise ValueError(f"cannot parse pipeline action {text!r}: {kind.value} takes {need}")
    return Action(kind, int(stage), int(mb), None if peer is None else int(peer))
