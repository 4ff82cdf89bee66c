"""Helpers the benchmark scripts share (imported by name: scripts run from this folder)."""
from __future__ import annotations

import os
import subprocess


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
