"""Every tandem package has its spawn smoke test in the fast tier (``scripts/test.sh --fast``).

A package's smoke test carries ``@pytest.mark.smoke("tandem.X")``; ``tests/conftest.py``
keeps every such test in the fast tier, and fails one that starts no process.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from _tiers import in_fast_tier

ROOT = Path(__file__).resolve().parents[1]


def _packages() -> set[str]:
    return {f"tandem.{p.parent.name}" for p in (ROOT / "tandem").glob("*/__init__.py")}


def _smoke_marks() -> dict[str, list[str]]:
    """package -> the tests that name it in a smoke mark, read from the test files."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if path.name == Path(__file__).name:
            continue  # its own marks are examples
        tree = ast.parse(path.read_text(), str(path))
        owner = {id(call): f.name for f in ast.walk(tree)
                 if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for call in ast.walk(f)}
        for node in ast.walk(tree):  # a decorator, or the marks of one parameter
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "pytest.mark.smoke":
                assert len(node.args) == 1 and isinstance(node.args[0], ast.Constant), \
                    f"{path}:{node.lineno}: smoke takes the package's name, as a string"
                name = f"{path.relative_to(ROOT)}::{owner.get(id(node), '?')}"
                found.setdefault(str(node.args[0].value), []).append(name)
    return found


def test_every_package_has_a_smoke_test() -> None:
    marks = _smoke_marks()
    missing = sorted(_packages() - set(marks))
    assert not missing, (f"no smoke test for {missing}: mark one cheap test that spawns "
                         "ranks using the package @pytest.mark.smoke(\"tandem.X\")")
    unknown = sorted(set(marks) - _packages())
    assert not unknown, f"smoke marks name no tandem package: {unknown}"
    extra = {p: tests for p, tests in marks.items() if len(tests) > 1}
    assert not extra, f"one smoke test a package keeps the fast tier fast: {extra}"


def test_smoke_tests_stay_in_the_fast_tier_even_when_they_start_processes(
        request: pytest.FixtureRequest) -> None:
    def item(*marks: pytest.MarkDecorator) -> pytest.Item:
        made = pytest.Function.from_parent(request.node.parent, name=request.node.name,
                                           callobj=lambda: None)
        for mark in marks:
            made.add_marker(mark)
        return made

    assert in_fast_tier(item())
    assert not in_fast_tier(item(pytest.mark.procs))
    assert in_fast_tier(item(pytest.mark.procs, pytest.mark.smoke("tandem.store")))
