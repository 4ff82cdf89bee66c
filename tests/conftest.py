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
* **Test tiers.** Every test that starts processes (gloo ranks through
  ``runtime.launch.run_on_ranks``, Python or torchrun in a subprocess) is marked ``multiproc``
  (registered in pyproject.toml) at collection, so ``pytest -m "not multiproc"`` is the fast,
  single-process tier. The mark is found, not written: the test's code, its fixtures and every
  function or class of tests/ that they name (followed transitively) are read for the names
  ``run_on_ranks`` or ``multiprocessing``, or ``subprocess`` together with ``sys.executable``
  or a ``"python..."``/``"torchrun..."`` string (a ``dot`` subprocess does not count). Product
  code is not followed; no test reaches the one product function that starts ranks
  (``partitioner.demo``). A test that only hands ``run_on_ranks`` bad arguments is counted too.
* **The longest tests start first.** The ``multiproc`` tests (a few CPU-seconds each, the two-host
  job and the composition matrix a minute or more) are moved ahead of the single-process ones,
  each tier in its own order. Under ``pytest -n 3`` a worker that draws a long test late leaves
  the other cores idle at the end of the run; with the long ones first, the many short tests
  fill the gaps at the end instead. Only the order changes: every test runs, alone, as before.
* **A process group in this process.** ``fake_process_group(n)`` starts torch's ``fake``
  backend as rank 0 of ``n`` (collectives do nothing) and destroys it after the test: for
  tests that only validate or plan, where forking real ranks would check nothing more.
"""
import os
import shutil
import tempfile
import types
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

    from partitioner.cluster import ClusterSpec
    from partitioner.local_cluster import get_cluster
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


@pytest.fixture
def fake_process_group():
    """``fake_process_group(n)``: this process becomes rank 0 of n on torch's fake backend, until the test ends."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(world_size: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


_TESTS_DIR = str(Path(__file__).parent) + os.sep


def _code_objects(code: types.CodeType):
    """A code object and those of the functions, lambdas and classes defined inside it."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _collect(obj, seen: set, names: set, texts: set) -> None:
    """The names and string constants of ``obj`` and of every tests/ function or class it names."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, type):
        for member in vars(obj).values():
            _collect(member, seen, names, texts)
        return
    func = getattr(obj, "__func__", obj)         # a bound method, classmethod or staticmethod
    code = getattr(func, "__code__", None)
    if code is None or not code.co_filename.startswith(_TESTS_DIR):
        return
    own = set()
    for c in _code_objects(code):
        own.update(c.co_names)
        texts.update(const for const in c.co_consts if isinstance(const, str))
    names.update(part for name in own for part in name.split("."))
    for name in own:
        if name in func.__globals__:
            _collect(func.__globals__[name], seen, names, texts)


def _starts_processes(funcs) -> bool:
    """Forks ranks (run_on_ranks, multiprocessing) or starts Python or torchrun in a subprocess."""
    names: set = set()
    texts: set = set()
    seen: set = set()
    for func in funcs:
        _collect(func, seen, names, texts)
    if names & {"run_on_ranks", "multiprocessing"}:
        return True
    launches_python = "executable" in names or any(t.startswith(("python", "torchrun")) for t in texts)
    return "subprocess" in names and launches_python


def pytest_collection_modifyitems(config, items):
    for item in items:
        fixtures = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        funcs = [getattr(item, "function", None)] + [d.func for defs in fixtures.values() for d in defs]
        if _starts_processes(func for func in funcs if func is not None):
            item.add_marker(pytest.mark.multiproc)
    items.sort(key=lambda item: item.get_closest_marker("multiproc") is None)  # stable: each tier keeps its order
