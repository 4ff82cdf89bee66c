"""The layout of the test suite itself: a test module imports helpers (``support``,
``parity_utils`` and the other modules of tests/ whose names do not start with ``test_``), never
another test module: importing one runs its module-level set-up and ties the two files'
collection together (a helper that two files need belongs in a helper module)."""
import ast
from pathlib import Path

TESTS = Path(__file__).parent


def _imported_modules(path: Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_test_module_imports_another():
    test_modules = {p.stem for p in TESTS.glob("test_*.py")}
    offenders = {
        p.name: sorted(_imported_modules(p) & test_modules) for p in sorted(TESTS.glob("*.py"))
    }
    offenders = {name: mods for name, mods in offenders.items() if mods}
    assert not offenders, f"modules of tests/ importing test modules (move what they share to a helper): {offenders}"
