"""Set-up shared by every test module.

* **One thread per process** (``OMP_NUM_THREADS=1``): the multi-process tests run several
  ranks on a 2-core machine.
* **No test reaches the measured CPU calibration.** ``cluster="cpu"`` (what
  ``auto_parallelize`` plans with on CPUs unless told otherwise) measures the machine it runs
  on and caches the figures in ``$XDG_CACHE_HOME/partita/cpu_cluster.json``; a plan chosen from
  them may differ from one machine, or one run, to the next. For the test session,
  ``XDG_CACHE_HOME`` points at a fresh temporary folder whose ``partita/cpu_cluster.json``
  holds ``FIXED_CPU`` below, fixed figures near a 2-core machine's calibration. The variable
  is inherited, so this process, its forked ranks and its subprocesses all plan ``"cpu"``
  from the same numbers, on every machine, and the suite never writes to the user's cache.
  ``pytest_configure`` checks that ``get_cluster("cpu")`` returns ``FIXED_CPU``: if the
  calibration's cache moves, the session stops here instead of measuring in silence.
  This is a safety net, not licence: a test that checks a planning choice names a fixed
  cluster itself (``cluster="h100"``, or pins).
"""
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

_LINK = {"bandwidth": 7.5e9, "latency_s": 50e-6}
FIXED_CPU = {
    "name": "cpu",
    "peak_flops": {"float32": 100e9, "bfloat16": 25e9, "float16": 25e9},
    "memory_bandwidth": 60e9,
    "memory_bytes": 16 << 30,
    "devices_per_node": 2,
    "intra_node": _LINK,
    "inter_node": _LINK,
    "collective_overhead_s": 100e-6,
    "matmul_efficiency": 1.0,
    "notes": "fixed figures for the test suite (tests/conftest.py), not measured",
}

_saved_cache_home = None
_cache_home = None


def pytest_configure(config):
    global _saved_cache_home, _cache_home
    import json

    _saved_cache_home = os.environ.get("XDG_CACHE_HOME")
    _cache_home = tempfile.mkdtemp(prefix="partita-test-cache-")
    path = Path(_cache_home) / "partita" / "cpu_cluster.json"
    path.parent.mkdir()
    path.write_text(json.dumps(FIXED_CPU))
    os.environ["XDG_CACHE_HOME"] = _cache_home

    from partitioner.cluster import ClusterSpec, get_cluster
    if get_cluster("cpu") != ClusterSpec.from_dict(FIXED_CPU):
        raise pytest.UsageError(f"get_cluster('cpu') no longer reads {path}: tests/conftest.py must pin the CPU "
                                "cluster another way, or tests would plan from this machine's measurement")


def pytest_unconfigure(config):
    if _cache_home is None:
        return
    if _saved_cache_home is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = _saved_cache_home
    shutil.rmtree(_cache_home, ignore_errors=True)


@pytest.fixture(autouse=True)
def _quiet_transformers_warnings():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="transformers")
        yield
