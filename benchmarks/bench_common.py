"""Helpers the benchmark scripts share (imported by name: scripts run from this folder)."""
from __future__ import annotations

import os
import resource
import subprocess


def process_status(field: str) -> int:
    """One ``kB`` field of ``/proc/self/status`` in bytes (``VmData``: private data, what
    ``RLIMIT_DATA`` limits; ``VmRSS``; ``VmHWM``: the peak resident set); 0 when absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> bool:
    """Restart ``VmHWM`` from the current resident set (Linux ``clear_refs`` 5); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cap_private_memory(nbytes: int, since: int | None = None) -> None:
    """Let this process allocate at most ``nbytes`` more private data (``RLIMIT_DATA`` over what
    it holds now, from ``/proc/self/status``; with ``since``, a ``VmData`` reading taken earlier,
    over that: what was allocated since counts against the cap): an allocation past it fails
    with MemoryError.

    Freed tensors are first made to leave the process (``runtime.host_memory``), whichever
    framework runs under the cap: the cap then measures live tensors, not glibc's heap."""
    from runtime.host_memory import return_freed_blocks

    return_freed_blocks()
    data = process_status("VmData") if since is None else since
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


def markdown_table(columns: list, rows: list) -> list:
    """The lines of a markdown table: ``columns`` as ``(title, align)`` pairs (``"l"`` left,
    ``"r"`` right), then one line per row of cells (a row may have fewer cells: an error line)."""
    line = lambda cells: "| " + " | ".join(str(c) for c in cells) + " |"  # noqa: E731
    rule = "|" + "|".join("---:" if align == "r" else "---" for _, align in columns) + "|"
    return [line(title for title, _ in columns), rule] + [line(cells) for cells in rows]
