"""Helpers shared by the test files (imported as ``support``; pytest puts tests/ on sys.path)."""
import contextlib
import warnings


@contextlib.contextmanager
def fallback_warnings():
    """Record every warning raised inside (each plan names its fallback ops afresh)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught
