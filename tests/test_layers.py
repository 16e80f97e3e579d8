"""Imports point downward only (DESIGN.md, "Layers"): a module imports from its own
layer or below. This test reads every module's imports and names each violation."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "tandem"

# lower number = lower layer; a module may import only layers <= its own
LAYERS = {
    "tandem.errors": 0, "tandem.config": 0, "tandem.secret": 0, "tandem._wire": 0, "tandem._proc": 0,
    "tandem._gate": 0, "tandem._words": 0, "tandem._files": 0,
    "tandem.store": 1,
    "tandem.transport": 2,
    "tandem.collectives": 3,
    "tandem.parallel": 4, "tandem.rpc": 4, "tandem.checkpoint": 4, "tandem._dcp": 4, "tandem.torch_backend": 4,
    "tandem.autograd": 4, "tandem.nn": 4, "tandem.optim": 4, "tandem.algorithms": 4,
    "tandem.run": 5, "tandem.elastic": 5, "tandem.trace": 5,
    "tandem.testing": 6, "tandem.bench": 6, "tandem.ray": 6,
}


def _layer(module: str) -> int | None:
    best = None
    for prefix, level in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, level)
    return None if best is None else best[1]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "tandem":  # "from tandem import _wire" imports a submodule
                found += [(node.lineno, f"tandem.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
    return [(line, name) for line, name in found if name.startswith("tandem")]


def test_every_module_belongs_to_a_layer() -> None:
    orphans = [_module_name(p) for p in ROOT.rglob("*.py")
               if _module_name(p) != "tandem" and _layer(_module_name(p)) is None]
    assert not orphans, f"modules missing from LAYERS in {__file__}: {orphans}"


def test_imports_point_downward_only() -> None:
    violations = []
    for path in ROOT.rglob("*.py"):
        me = _module_name(path)
        if me == "tandem":
            continue  # the package root re-exports the public API
        mine = _layer(me)
        for line, name in _imports(path):
            theirs = _layer(name)
            if theirs is not None and mine is not None and theirs > mine:
                violations.append(f"{path.relative_to(ROOT.parent)}:{line} ({me}, layer {mine}) "
                                  f"imports {name} (layer {theirs})")
            if theirs is None and name.startswith("tandem.") and mine is not None and mine < 4:
                violations.append(f"{path.relative_to(ROOT.parent)}:{line} imports {name} "
                                  f"(public API, a top layer) from layer {mine}")
    assert not violations, "upward imports:\n" + "\n".join(violations)


def _runs_at_import(tree: ast.Module) -> list[ast.stmt]:
    """The module's top-level statements, into ``if``/``try`` blocks: what importing it
    runs, plus ``if TYPE_CHECKING:`` blocks (a type named there ties the modules as much)."""
    out: list[ast.stmt] = []
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If):
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody
            for handler in node.handlers:
                todo += handler.body
    return out


def _module_imports(source: str, me: str, is_package: bool, modules: set[str]) -> set[str]:
    """The tandem modules that module ``me`` imports at module level (a function's own
    import runs when called: lazy, for a dependency that exists only at run time, and
    not counted)."""
    package = me if is_package else me.rpartition(".")[0]
    found: set[str] = set()
    for node in _runs_at_import(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            # "from package import module" names the module, "from module import name" the module
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                      for a in node.names}
    return {m for m in found if m in modules and m != me}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
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
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _import_graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {m: _module_imports(p.read_text(), m, p.name == "__init__.py", set(paths))
            for m, p in paths.items()}


def test_no_import_cycles() -> None:
    """No modules import each other in a circle, at module level (type-only imports
    included): a helper that needs its owner declares what it needs (a Protocol), and
    code two modules share moves below both. A module may still import another inside
    a function, when it needs it only at run time (say why there)."""
    cycles = _cycles(_import_graph())
    assert not cycles, "import cycles (module-level imports, TYPE_CHECKING included):\n" + \
        "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_counts_type_only_imports_and_not_lazy_ones() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}) == [["a", "b", "c"]]
    source = ("from typing import TYPE_CHECKING\nfrom . import _codec\n"
              "if TYPE_CHECKING:\n    from tandem.rpc._agent import Agent\n"
              "def f():\n    from tandem.rpc import api\n")
    modules = {"tandem.rpc._agent", "tandem.rpc.api", "tandem.rpc._codec", "tandem.rpc.m"}
    assert _module_imports(source, "tandem.rpc.m", False, modules) == {"tandem.rpc._agent",
                                                                       "tandem.rpc._codec"}
