"""Imports point downward only (DESIGN.md, "Layers"): a module imports from its own
layer or below. This test reads every module's imports and names each violation."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "tandem"

# lower number = lower layer; a module may import only layers <= its own
LAYERS = {
    "tandem.errors": 0, "tandem.config": 0, "tandem.secret": 0, "tandem._wire": 0, "tandem._proc": 0,
    "tandem._gate": 0, "tandem._words": 0,
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
