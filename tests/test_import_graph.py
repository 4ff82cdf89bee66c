"""The layering of partitioner/, passes/ and runtime/, read from the source.

The import graph is built with ``ast`` from every module of the three packages: every
``import`` and ``from ... import`` counts, at module level or inside a function (a lazy
import still ties the two modules together), except those under ``if TYPE_CHECKING:``, which
never run. An edge goes to the deepest module of the three packages the statement names
(``from passes.rules import base`` is an edge to ``passes.rules.base``; ``from passes.rules
import rule_for`` to the package ``passes.rules``). The checks:

* no circle: every strongly connected component of the graph is one module (named, with one
  cycle through it, when it is not);
* ``runtime/`` (what runs on a rank) imports nothing that plans: of ``passes/`` and
  ``partitioner/`` only the bottom layer both share (``SHARED_BOTTOM``: placements, node info, rule options,
  plan records, bucket sizes),
  never the cost model, the strategy space, the solver, the schedule simulator, the configuration
  search or graph analysis; and the bottom layer imports only itself;
* ``passes/`` (the compiler) never imports ``partitioner/`` (the API above it).
"""

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("partitioner", "passes", "runtime")

# The bottom layer shared by passes/ and runtime/ (docs/ARCHITECTURE.md, "Layers"): the
# vocabulary both speak. These modules import nothing else of the three packages, and runtime/
# imports nothing of passes/ or partitioner/ but them: never the cost model, the strategy space,
# the solver, the schedule simulator, the configuration search or graph analysis.
SHARED_BOTTOM = (
    "passes.core.placements",
    "passes.core.node_info",
    "passes.core.rule_options",
    "passes.core.plan_records",
    "passes.core.bucket_sizes",
)

# Circles not broken yet, each with what is left to do; the test fails on any circle not listed
# here, and when a listed one is gone (take it out).
KNOWN_CIRCLES: dict = {}


def module_files() -> dict:
    """Dotted module name -> source file, for every module of the three packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _type_checking_only(tree: ast.AST) -> set:
    """The import statements under ``if TYPE_CHECKING:`` (never executed)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                skipped.update(id(n) for n in ast.walk(inner))
    return skipped


def _named_modules(module: str, path: Path, node, modules: dict) -> list:
    """The modules of the three packages one import statement names."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join([*package, base] if base else package)
        names = [f"{base}.{alias.name}" for alias in node.names]
    found = []
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            found.append(name)
    return found


@functools.cache
def import_graph() -> dict:
    """Module -> {imported module: line of the first import}, over the three packages (read once
    per session; the tests only read it)."""
    modules = module_files()
    graph: dict = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skipped = _type_checking_only(tree)
        edges = graph.setdefault(module, {})
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped:
                for target in _named_modules(module, path, node, modules):
                    if target != module:
                        edges.setdefault(target, node.lineno)
    return graph


def strongly_connected(graph: dict) -> list:
    """Tarjan's strongly connected components of ``graph`` (iterative), each a sorted list."""
    index: dict = {}
    low: dict = {}
    stack: list = []
    on_stack: set = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            step = next(successors, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph.get(step, ())))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def one_cycle(graph: dict, component: list) -> str:
    """A cycle through the component's first module, as ``a (line) -> b (line) -> ... -> a``."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for step in sorted(graph[node]):
                if step == start:
                    cycle = paths[node] + [start]
                    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {start}"
                if step in members and step not in paths:
                    paths[step] = paths[node] + [step]
                    following.append(step)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {component}")


def test_the_graph_is_read_from_the_source():
    graph = import_graph()
    assert len(graph) > 70, sorted(graph)
    # a module-level import, an import inside a function, a package and one of its modules
    assert "passes.core.placements" in graph["runtime.collectives"]
    assert "runtime.launch" in graph["partitioner.demo"]
    assert "passes.rules.base" in graph["passes.rules"]
    # imports under TYPE_CHECKING never run, and do not count
    assert "partitioner.sharding_plan" not in graph["runtime.parallel_module"]


def test_the_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}}
    assert strongly_connected(graph) == [["d"], ["a", "b", "c"]]
    assert one_cycle(graph, ["a", "b", "c"]) == "a (line 1) -> b (line 2) -> c (line 3) -> a"


def test_no_import_circle():
    graph = import_graph()
    circles = {tuple(c): f"{c}: {one_cycle(graph, c)}" for c in strongly_connected(graph) if len(c) > 1}
    new = {c: cycle for c, cycle in circles.items() if c not in KNOWN_CIRCLES}
    assert not new, "import circles (move what both sides need into a lower module):\n" + "\n".join(new.values())
    gone = [c for c in KNOWN_CIRCLES if c not in circles]
    assert not gone, f"these circles are broken now; take them out of KNOWN_CIRCLES: {gone}"


def forbidden_imports(package: str, allowed) -> list:
    """``module (line n) imports target`` for each import of a module of ``package`` that
    ``allowed(target)`` refuses."""
    return [
        f"{module} (line {line}) imports {target}"
        for module, edges in import_graph().items()
        if module.split(".")[0] == package
        for target, line in edges.items()
        if not allowed(target)
    ]


def test_runtime_imports_only_runtime_and_the_bottom_layer():
    bad = forbidden_imports("runtime", lambda target: target.split(".")[0] == "runtime" or target in SHARED_BOTTOM)
    assert not bad, (
        "runtime/ runs plans and never makes one: it imports only runtime/ and " + ", ".join(SHARED_BOTTOM) + ":\n"
    ) + "\n".join(bad)


def test_the_bottom_layer_imports_only_itself():
    graph = import_graph()
    bad = [f"{m} (line {line}) imports {t}" for m in SHARED_BOTTOM for t, line in graph[m].items() if t not in SHARED_BOTTOM]
    assert not bad, "the bottom layer imports nothing above it:\n" + "\n".join(bad)


def test_passes_never_import_partitioner():
    bad = forbidden_imports("passes", lambda target: target.split(".")[0] != "partitioner")
    assert not bad, (
        "passes/ is the compiler under the API: it imports passes/, runtime/ and the bottom layer, never "
        "partitioner/ (move what it needs down into passes/):\n"
    ) + "\n".join(bad)
