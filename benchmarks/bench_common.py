"""Helpers the benchmark scripts share (imported by name: scripts run from this folder)."""
from __future__ import annotations

import os
import resource
import subprocess


def cap_private_memory(nbytes: int) -> None:
    """Let this process allocate at most ``nbytes`` more private data (``RLIMIT_DATA`` over what
    it holds now, from ``/proc/self/status``): an allocation past it fails with MemoryError.

    Freed tensors are first made to leave the process (``runtime.host_memory``), whichever
    framework runs under the cap: the cap then measures live tensors, not glibc's heap."""
    from runtime.host_memory import return_freed_blocks

    return_freed_blocks()
    data = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                data = int(line.split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_DATA, (data + int(nbytes), resource.RLIM_INFINITY))


def revision() -> str:
    """The git commit measured, and whether passes/ or partitioner/ had uncommitted edits."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "passes", "partitioner"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown revision"
    return f"commit {head or '?'}" + (" with uncommitted changes in passes/ or partitioner/" if dirty else "")
