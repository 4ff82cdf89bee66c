"""Progress and decisions go to Python's ``logging``, under the ``partitioner`` logger.

Every module logs to ``logging.getLogger(__name__)``; this package's loggers are children of
``partitioner``, so one logger turns them all on::

    import logging
    logging.basicConfig()                                   # any handler
    logging.getLogger("partitioner").setLevel(logging.INFO)

INFO carries progress (capture, analysis, strategy space, solve, plan ready, module ready) and
decisions (a pipeline's stages, microbatches and schedule); DEBUG carries detail (pins per
stage, simulated step of every candidate schedule). Nothing is printed by default.

``verbose=True`` on :func:`partitioner.plan` and :func:`partitioner.auto_parallelize` is a
convenience (:func:`verbose_to_stderr`): for the duration of the call, a handler on the
``partitioner`` logger writes its INFO records to stderr, prefixed ``[partita <seconds>s]``
(``[partita rank <r> <seconds>s]`` inside a job), seconds counted from the call's start.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import time

__all__ = ["LOGGER_NAME", "progress_to_stderr", "verbose_to_stderr"]

LOGGER_NAME = "partitioner"


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record comes (so redirections apply)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def _rank():
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return None


class _Elapsed(logging.Formatter):
    """``[partita (rank r) seconds] message``, seconds since the formatter was made."""

    def __init__(self):
        super().__init__("%(message)s")
        self.start = time.time()

    def format(self, record):
        rank = _rank()
        where = "" if rank is None else f" rank {rank}"
        return f"[partita{where} {record.created - self.start:6.2f}s] {super().format(record)}"


@contextlib.contextmanager
def progress_to_stderr(enabled: bool = True):
    """While active (and ``enabled``), the ``partitioner`` logger's INFO records go to stderr."""
    if not enabled:
        yield
        return
    logger = logging.getLogger(LOGGER_NAME)
    handler = _CurrentStderr()
    handler.setLevel(logging.INFO)
    handler.setFormatter(_Elapsed())
    level = logger.level
    if not logger.isEnabledFor(logging.INFO):
        logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def verbose_to_stderr(fn):
    """For an API function with a ``verbose=False`` keyword: ``verbose=True`` runs the call
    inside :func:`progress_to_stderr`."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with progress_to_stderr(bool(kwargs.get("verbose"))):
            return fn(*args, **kwargs)

    return call
