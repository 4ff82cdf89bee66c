"""Where the test suite's CPU goes, test by test: a pytest plugin that records it, and a summary.

Wall times of a test run on a shared machine mostly measure the load (a 1.5 CPU-s pipeline test
took 12-15 s at load 20); CPU seconds do not. The plugin adds, around each test, the CPU time of
the pytest process (``time.process_time``) and of the children it reaped meanwhile (its forked
ranks and subprocesses: ``getrusage(RUSAGE_CHILDREN)``), and appends one JSON line per test to
``$SUITE_CPU_OUT``. Under pytest-xdist each worker loads it and writes its own lines.

Record (a tier, with its usual workers)::

    SUITE_CPU_OUT=out/cpu.jsonl PYTHONPATH=.:benchmarks python -m pytest tests -n 2 -m "not slow" -p suite_cpu

Summarise (the total, the share of the forked ranks, the costliest tests and files)::

    python benchmarks/suite_cpu.py out/cpu.jsonl [--top 40]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import time

import pytest


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Around one test's set-up, call and tear-down: its CPU here and in its reaped children."""
    own, children, wall = time.process_time(), _children_cpu(), time.time()
    yield
    path = os.environ.get("SUITE_CPU_OUT")
    if not path:
        return
    row = {
        "test": item.nodeid,
        "process_s": round(time.process_time() - own, 3),
        "children_s": round(_children_cpu() - children, 3),
        "wall_s": round(time.time() - wall, 3),
    }
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def summary(rows: list, top: int) -> str:
    """Totals, then the ``top`` tests and files by CPU seconds (process + children)."""
    cpu = {r["test"]: r["process_s"] + r["children_s"] for r in rows}
    total = sum(cpu.values()) or 1e-9
    children = sum(r["children_s"] for r in rows)
    lines = [
        f"{len(rows)} tests, {total:.0f} CPU-s ({children:.0f} in forked ranks and subprocesses), "
        f"{sum(r['wall_s'] for r in rows):.0f} s of test wall time summed over workers",
        "",
        f"costliest {top} tests (CPU-s, share of the total):",
    ]
    ranked = sorted(cpu.items(), key=lambda kv: -kv[1])
    lines += [f"  {s:7.2f}  {s / total:5.1%}  {name}" for name, s in ranked[:top]]
    by_file: dict = collections.defaultdict(float)
    for name, s in cpu.items():
        by_file[name.split("::")[0]] += s
    lines += ["", f"costliest {top} files:"]
    files = sorted(by_file.items(), key=lambda kv: -kv[1])
    lines += [f"  {s:7.2f}  {s / total:5.1%}  {name}" for name, s in files[:top]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", help="the JSON lines the plugin wrote ($SUITE_CPU_OUT)")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    with open(args.records) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    print(summary(rows, args.top))


if __name__ == "__main__":
    main()
