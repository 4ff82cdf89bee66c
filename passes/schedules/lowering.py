"""Lowering a compute-only schedule: insert the sends and receives between ranks.

In a lowered schedule every dependency between stages on different ranks travels as a message:
the producer's rank runs ``SEND`` after the producing action, the consumer's rank runs the
matching ``RECV`` before the consuming action. Stages that share a rank exchange nothing.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict

from passes.schedules.actions import Action, ActionKind
from passes.schedules.schedule import Schedule

logger = logging.getLogger(__name__)


def add_communication(schedule: Schedule) -> Schedule:
    """Lower a compute-only schedule: add ``SEND``/``RECV`` for every dependency across ranks.

    A send goes right after the action that produces the value (``F`` -> ``SEND_F`` to stage
    s+1; ``B``/``I`` -> ``SEND_B`` to stage s-1), a receive right before the action that consumes
    it. Messages between two ranks are matched in order, so when a rank must receive a message
    that its peer sent after others it has not received yet, those earlier ones are received
    first (just before, and buffered): this never waits longer than the needed message would.
    Adjacent stages on the same rank exchange nothing.
    """
    if schedule.has_communication:
        raise ValueError(f"schedule {schedule.name!r} already has sends and receives")
    owner = schedule.stage_to_rank
    last = schedule.num_stages - 1

    def outgoing(a: Action):
        if a.kind == ActionKind.F and a.stage < last and owner[a.stage + 1] != owner[a.stage]:
            return Action(ActionKind.SEND_F, a.stage, a.microbatch, a.stage + 1)
        if a.is_backward and a.stage > 0 and owner[a.stage - 1] != owner[a.stage]:
            return Action(ActionKind.SEND_B, a.stage, a.microbatch, a.stage - 1)
        return None

    def incoming(a: Action):
        if a.kind == ActionKind.F and a.stage > 0 and owner[a.stage - 1] != owner[a.stage]:
            return Action(ActionKind.RECV_F, a.stage, a.microbatch, a.stage - 1)
        if a.is_backward and a.stage < last and owner[a.stage + 1] != owner[a.stage]:
            return Action(ActionKind.RECV_B, a.stage, a.microbatch, a.stage + 1)
        return None

    # Messages on each channel (src rank, dst rank), in the order the source sends them.
    channel = defaultdict(list)
    for rank, acts in enumerate(schedule.actions):
        for a in acts:
            send = outgoing(a)
            if send is not None:
                channel[(rank, owner[send.peer])].append(send.counterpart())
    position = {(key, recv): k for key, msgs in channel.items() for k, recv in enumerate(msgs)}

    lowered = []
    for rank, acts in enumerate(schedule.actions):
        received = Counter()  # channel -> how many messages this rank has received on it
        out = []
        for a in acts:
            recv = incoming(a)
            if recv is not None:
                key = (owner[recv.peer], rank)
                k = position.get((key, recv))
                if k is None:  # nobody sends it: leave the receive, the checker will say why
                    out.append(recv)
                else:
                    while received[key] <= k:
                        out.append(channel[key][received[key]])
                        received[key] += 1
            out.append(a)
            send = outgoing(a)
            if send is not None:
                out.append(send)
        lowered.append(out)
    return Schedule(
        schedule.name,
        schedule.num_ranks,
        schedule.num_stages,
        schedule.num_microbatches,
        schedule.stage_to_rank,
        tuple(lowered),
    )
