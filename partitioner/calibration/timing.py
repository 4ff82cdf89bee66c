"""Timing loops: seconds per call of a function (the mean over trials, the slowest rank), and
seconds inside a call that follows a burst of work (a collective as a training step meets it);
calls on operands cycled beyond the core's cache, their results kept (an op as a step meets it)."""

from __future__ import annotations

import itertools
import logging
import math
import statistics
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


COLD_BYTES = 16 << 20
"""Bytes of distinct operand sets (inputs and output) :func:`cold_calls` cycles through: more than
the private cache of one core of current CPUs (1-2 MiB of L2), so each call reads its inputs and
writes its output further out, as a step's ops do."""


COLD_SETS = (2, 64)
"""The fewest and the most operand sets :func:`cold_sets` makes: tiny operands (the tests' sizes,
ops that cost their fixed cost) are not worth thousands of sets."""


def cold_sets(operands: Callable[[], tuple], nbytes: int) -> list:
    """As many distinct ``operands()`` sets as fill :data:`COLD_BYTES` (``nbytes``: one call's
    inputs and output), within :data:`COLD_SETS`."""
    fewest, most = COLD_SETS
    return [operands() for _ in range(min(most, max(fewest, math.ceil(COLD_BYTES / nbytes))))]


def cold_calls(sets: list, op: Callable) -> Callable[[], None]:
    """A function that calls ``op`` on the next of ``sets`` (:func:`cold_sets`), its result kept
    until the sets come round again. A timed loop of one call on the same operands, its result
    dropped, reads them from the core's cache and writes its result into the block just freed,
    also cached; a training step's op reads what the step streamed through the cache earlier and
    writes fresh memory (autograd and the next op keep its output): on the 2-core CPU an add of
    two 256 KiB activations took 19 us the first way and 55 us with its results kept. Every set
    is called once first: a first call's one-off costs (autograd's first pass through a graph)
    are not what a step pays."""
    for operands in sets:
        op(*operands)
    order, kept = itertools.cycle(range(len(sets))), []

    def call():
        i = next(order)
        if i == 0:
            kept.clear()
        kept.append(op(*sets[i]))

    return call


def timed(fn, seconds: float, trials: int, sync=None) -> float:
    """Seconds per call of ``fn``: the median over ``trials`` loops of about ``seconds`` each (the
    mean of two; not the best: on a shared machine the best loop is the moment the rank had a
    core to itself, while a training step meets the typical share; with three or more, one loop
    spoiled by another job's burst does not move the figure). With ``sync`` (max over ranks,
    which also lines the ranks up) every rank makes the same calls and each loop counts as long
    as its slowest rank's."""
    fn()
    start = time.perf_counter()
    for _ in range(3):
        fn()
    per = (time.perf_counter() - start) / 3
    reps = max(1, min(10000, int(seconds / max(per, 1e-9))))
    if sync is not None:
        reps = int(sync(float(reps)))
    loops = []
    for _ in range(trials):
        if sync is not None:
            sync(0.0)
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        elapsed = (time.perf_counter() - start) / reps
        loops.append(sync(elapsed) if sync is not None else elapsed)
    return statistics.median(loops)


def timed_after(work, fn, seconds: float, trials: int, agree, mean) -> float:
    """Seconds inside ``fn`` per call when each call follows ``work`` (see the module docstring):
    the mean over ``trials`` and ranks; ``agree`` (max over ranks) fixes the call count."""
    work()
    fn()
    start = time.perf_counter()
    for _ in range(3):
        work()
        fn()
    reps = int(agree(float(max(1, min(10000, int(seconds * 3 / max(time.perf_counter() - start, 1e-9)))))))
    total = 0.0
    for _ in range(trials):
        agree(0.0)
        inside = 0.0
        for _ in range(reps):
            work()
            t0 = time.perf_counter()
            fn()
            inside += time.perf_counter() - t0
        total += mean(max(inside / reps, 1e-7))
    return total / trials
