"""What a CPU host's ranks spend beyond their ops (step 4 of :mod:`partitioner.calibration`): the
CPU a point-to-point message costs at each end, and how much slower work runs while more ranks
than cores are busy.

**Messages** (:func:`message_samples`). A pipeline stage's rank sends its activations (and
receives gradients) with gloo's ``isend`` / ``irecv``: the call, the copy through the kernel's
socket and gloo's own threads take CPU on both ranks, which ranks sharing cores pay out of the
same cores their compute needs. Ranks 0 and 1 (the others waiting) pass ``count`` messages of
each payload, one direction, each side timing its calls in **process** CPU time (the main
thread and gloo's threads: a wait that blocks costs nothing); the mean over the two ends per
message. :func:`partitioner.calibration.fit.message_cpu` fits ``seconds + bytes x per-byte``.

**Time slicing** (:func:`time_slice_sample`). Where ranks outnumber the cores, the operating
system time-slices the busy ranks (a few milliseconds each); a rank that gets a core back finds
its caches refilled by another rank's data, so its work takes more CPU time than on a core of its
own. The sample is the work of a pipeline action: a small MLP's forward and backward through
autograd (a linear layer out to four times its width, GELU, back; operands of a few MiB), timed
in the rank's **thread** CPU time per iteration, first on as many ranks at once as there are
cores (the others waiting), then on every rank at once; the slowdown is the ratio of the medians
(at least 1). Not measured (1.0) where the cores suffice for the ranks.
"""

from __future__ import annotations

import logging
import statistics
import time

logger = logging.getLogger(__name__)

MESSAGE_PAYLOADS = (1 << 12, 1 << 20)
"""Bytes of the two message sizes timed (a tiny message: the fixed cost; an activation's size)."""


def message_samples(rank: int, count: int = 40) -> list:
    """``[{"bytes", "s"}]``: process CPU seconds per message and end (see the module docstring),
    on every rank (rank 0's figures broadcast). Collective: every rank calls it."""
    import torch
    import torch.distributed as dist

    out = []
    for payload in MESSAGE_PAYLOADS:
        buf = torch.ones(payload // 4)
        spent = torch.zeros(1, dtype=torch.float64)
        for _ in range(2):  # the first pass warms the pair's connection up; the second is kept
            dist.barrier()
            if rank < 2:
                start = time.process_time()
                for i in range(count):
                    work = dist.isend(buf, 1, tag=i) if rank == 0 else dist.irecv(buf, 0, tag=i)
                    assert work is not None  # point-to-point calls always return their work
                    work.wait()
                spent.fill_((time.process_time() - start) / count)
        dist.all_reduce(spent)  # ranks 0 and 1: the two ends; the others add 0
        out.append({"bytes": payload, "s": float(spent.item()) / 2})
    return out


def _mlp_step(width: int, tokens: int):
    import torch

    x = torch.randn(tokens, width)
    up = torch.nn.Linear(width, 4 * width)
    down = torch.nn.Linear(4 * width, width)

    def step():
        y = down(torch.nn.functional.gelu(up(x)))
        y.sum().backward()

    return step


def time_slice_sample(rank: int, world: int, cores: int, seconds: float = 0.3, width: int = 256) -> dict | None:
    """``{"alone_s", "shared_s"}``: thread CPU seconds per iteration of an action's work on a core
    of its own and with every rank busy (see the module docstring); None where ``world <= cores``.
    Collective: every rank calls it; every rank gets rank 0's figures."""
    import torch.distributed as dist

    if world <= cores:
        return None
    step = _mlp_step(width, 256)
    for _ in range(3):
        step()
    start = time.perf_counter()
    for _ in range(3):
        step()
    count = max(5, int(seconds / max((time.perf_counter() - start) / 3, 1e-6)))
    box = [count]
    dist.broadcast_object_list(box, src=0)  # every rank runs as many iterations
    medians = []
    for busy in (cores, world):
        dist.barrier()
        times = []
        if rank < busy:
            for _ in range(box[0]):
                t0 = time.thread_time()
                step()
                times.append(time.thread_time() - t0)
        medians.append(statistics.median(times) if times else 0.0)
    figures = [{"alone_s": medians[0], "shared_s": medians[1]}]
    dist.broadcast_object_list(figures, src=0)
    return figures[0]
