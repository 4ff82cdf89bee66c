"""No function of partitioner/, passes/ or runtime/ is over 100 lines.

Read with ``ast`` from the source: a function's length is from its ``def`` line to its last line,
docstring and nested functions included (a nested function counts on its own as well). A long
function is split into named steps, each a function of its own, so a reader sees the order at a
glance. ``KNOWN`` lists the functions not split yet, each with why; the test fails on any other
function over the limit, and on a listed one that is no longer over it (take it out).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("partitioner", "passes", "runtime")
MAX_LINES = 100

# "path:function" -> why it is not split yet
KNOWN: dict = {}


def source_files() -> list:
    return [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]


def long_functions(paths, root=ROOT) -> dict:
    """``"path:name"`` -> (line of its ``def``, length in lines) for every function of ``paths``
    over the limit (paths relative to ``root``)."""
    found = {}
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_LINES:
                    found[f"{path.relative_to(root)}:{node.name}"] = (node.lineno, length)
    return found


def test_the_scan_finds_a_planted_long_method_and_passes_one_at_the_limit(tmp_path):
    body = "".join(f"        x += {i}\n" for i in range(MAX_LINES - 2))
    source = tmp_path / "planted.py"
    source.write_text(f"class C:\n    def at_limit(self, x):\n{body}        return x\n\n"
                      f"    def over(self, x):\n{body}        x += 1\n        return x\n")
    assert long_functions([source], tmp_path) == {"planted.py:over": (MAX_LINES + 3, MAX_LINES + 1)}


def test_no_function_over_100_lines():
    found = long_functions(source_files())
    new = [
        f"{key.split(':')[0]}:{line} {key.split(':')[1]} is {length} lines"
        for key, (line, length) in sorted(found.items())
        if key not in KNOWN
    ]
    assert not new, f"functions over {MAX_LINES} lines (split them into named steps):\n" + "\n".join(new)
    gone = sorted(set(KNOWN) - set(found))
    assert not gone, f"these are {MAX_LINES} lines or fewer now; take them out of KNOWN: {gone}"
