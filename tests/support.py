"""Helpers shared by the test files (imported as ``support``; pytest puts tests/ on sys.path).

Test modules import helpers from here, ``parity_utils`` (the rank workers of the parity tests)
and the other non-test helper modules of tests/ (``long_sequence_utils``, ``zero_utils``), never
from one another: ``tests/test_suite_layout.py`` checks it.
"""
import contextlib
import re
import warnings

_AXIS_SEPARATOR = re.compile(r",\s*(?![^()]*\))")  # a comma between axes, not inside "S(0, ...)"


@contextlib.contextmanager
def fallback_warnings():
    """Record every warning raised inside (each plan names its fallback ops afresh)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def placement_axes(placement: str) -> list:
    """A placement as plans and ``ParallelModule.placement_of`` print it, per mesh axis:
    ``"[S(0), R]"`` -> ``["S(0)", "R"]``."""
    body = placement.strip()
    if body[:1] + body[-1:] == "[]":
        body = body[1:-1]
    return [p.strip() for p in _AXIS_SEPARATOR.split(body) if p.strip()]


def is_replicated(placement: str) -> bool:
    """Replicated on every mesh axis (``"[R, R]"``)."""
    return all(p == "R" for p in placement_axes(placement))
