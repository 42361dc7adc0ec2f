"""The pure parts import no torch, so trainers and launchers can use them on their own and
their tests run thousands of cases a second: checked on the source, with ast."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PURE = [
    "gradaccum.schedule",
    "gradaccum.window",
    "gradaccum.plan",
    "gradaccum.record",
    "gradaccum.order",
]
TESTS = [
    "tests/test_schedule.py",
    "tests/test_window.py",
    "tests/test_plan.py",
    "tests/test_record.py",
    "tests/test_order.py",
]


def imported(path: Path) -> set[str]:
    """The modules a file imports (absolute imports)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def imports_of(module: str) -> set[str]:
    """Every module ``module`` imports, following the gradaccum submodules it imports in
    turn (not the package's ``__init__``, which imports torch)."""
    found: set[str] = set()
    todo, seen = [module], set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            names = imported(ROOT / (name.replace(".", "/") + ".py"))
            found |= names
            todo.extend(other for other in names if other.startswith("gradaccum."))
    return found


@pytest.mark.parametrize("module", PURE)
def test_pure_module_imports_no_torch(module: str) -> None:
    """The module and the gradaccum modules it imports import neither torch nor the package."""
    found = imports_of(module)
    assert not {name for name in found if name.split(".")[0] == "torch"}
    assert "gradaccum" not in found


@pytest.mark.parametrize("path", TESTS)
def test_pure_tests_import_no_torch(path: str) -> None:
    """The tests of the pure parts import no torch of their own."""
    assert not {name for name in imported(ROOT / path) if name.split(".")[0] == "torch"}
