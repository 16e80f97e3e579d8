"""Private state has one owner (issue 27): in ``tandem.parallel``, ``tandem.optim`` and
``tandem.elastic`` a module changes only the private attributes of classes it defines.

ZeroRedundancyOptimizer's helper modules once wrote ``zero._x`` directly, and functions
of ``_zero_state`` were bound into the class as methods, writing ``self._x`` from
another file; DDP's join hook set ``ddp._divide_by_initial_world_size``; ``run_elastic``
set the state's ``_session``. These tests read the source (as ``test_layers.py`` does)
and name each place that does it again.

Run: ``python -m pytest tests/test_owners.py -q``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "tandem"
PACKAGES = ("parallel", "optim", "elastic")
MUTATORS = frozenset({"append", "extend", "insert", "update", "clear", "pop", "popitem",
                      "remove", "add", "discard", "setdefault", "sort", "reverse"})
# torch.nn.Module's private attributes, used the way torch's own replicate and DDP do
TORCH_MODULE = frozenset({"_modules", "_parameters", "_buffers",
                          "_ddp_params_and_buffers_to_ignore"})
ZERO_HELPERS = ("optim/_zero_state.py", "optim/_zero_ddp.py", "optim/_exchange.py",
                "optim/_layout.py")

# Cross-module reads still made, by design. ElasticState's attribute names belong to the
# user's values (state.step, state.history, ...), so the elastic package talks to it, and
# it to its samplers, through underscored methods of the owning class.
KNOWN_READS = frozenset({
    ("elastic/_run.py", "_commits"), ("elastic/_run.py", "_values"),
    ("elastic/_run.py", "_open_session"), ("elastic/_run.py", "_close_session"),
    ("elastic/_sampler.py", "_values"), ("elastic/_sampler.py", "_add_sampler"),
    ("elastic/_session.py", "_take"), ("elastic/_session.py", "_commits"),
    ("elastic/_session.py", "_commits_held"), ("elastic/_session.py", "_snapshot"),
    ("elastic/_session.py", "_roll_back"),
})


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _in_class(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.ClassDef):
            return True
    return False


def owned(tree: ast.AST) -> set[str]:
    """The private names the module's classes define: ``self._x = ...``, methods ``_x``."""
    names: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and _is_self(node.value) and _private(node.attr)):
                names.add(node.attr)
            elif (isinstance(node, ast.Call) and ast.unparse(node.func) == "object.__setattr__"
                  and len(node.args) > 1 and _is_self(node.args[0])
                  and isinstance(node.args[1], ast.Constant) and _private(str(node.args[1].value))):
                names.add(str(node.args[1].value))
        names |= {n.name for n in cls.body
                  if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(n.name)}
    return names


def foreign_writes(source: str) -> list[str]:
    """Each place ``source`` changes a private attribute that none of its classes defines,
    or writes ``self._x`` outside a class (a function bound as a method elsewhere)."""
    tree = ast.parse(source)
    mine, parents = owned(tree), _parents(tree)
    found: list[tuple[int, str]] = []

    def check(target: ast.expr, line: int, how: str) -> None:
        if isinstance(target, ast.Subscript):  # x._y[k] = v changes x._y
            target = target.value
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                check(element, line, how)
            return
        if isinstance(target, ast.Starred):
            check(target.value, line, how)
            return
        if (not isinstance(target, ast.Attribute) or not _private(target.attr)
                or target.attr in TORCH_MODULE):
            return
        if _is_self(target.value):
            if not _in_class(target, parents):
                found.append((line, f"{how} {ast.unparse(target)} in a function outside any "
                                    f"class"))
        elif target.attr not in mine:
            found.append((line, f"{how} {ast.unparse(target)}"))

    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in targets:
                check(t, node.lineno, "writes")
        elif isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            if func in ("object.__setattr__", "setattr", "delattr") and len(node.args) > 1:
                name = node.args[1]
                obj = node.args[0]
                if (isinstance(name, ast.Constant) and isinstance(name.value, str)
                        and _private(name.value) and not _is_self(obj)
                        and name.value not in mine and name.value not in TORCH_MODULE):
                    found.append((node.lineno, f"{func}({ast.unparse(obj)}, {name.value!r})"))
            elif (isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
                  and isinstance(node.func.value, ast.Attribute)):
                check(node.func.value, node.lineno, f"calls .{node.func.attr}() on")
    return [f"line {line}: {what}" for line, what in sorted(found)]


def _modules() -> dict[str, ast.Module]:
    return {path.relative_to(ROOT).as_posix(): ast.parse(path.read_text())
            for pkg in PACKAGES for path in sorted((ROOT / pkg).rglob("*.py"))}


def _reads(tree: ast.AST, names: set[str]) -> set[tuple[int, str]]:
    """``x._y`` (x not self) for every ``_y`` in ``names``."""
    return {(node.lineno, node.attr) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr in names
            and not _is_self(node.value)}


def test_the_check_finds_each_way_of_writing_another_objects_private_state() -> None:
    source = '''
class Mine:
    def __init__(self):
        self._ok = 1
    def go(self, other, zero):
        other._ok = 2                  # a name this module's class owns: allowed
        zero._grads_sharded = True
        zero._steps += 1
        zero._owners[0] = 1
        zero._owners.append(3)
        object.__setattr__(zero, "_session", None)
        a, zero._flat = 1, 2

def consolidate(self):
    self._all_state_dicts = []
'''
    found = foreign_writes(source)
    for expected in ("zero._grads_sharded", "zero._steps", "zero._owners", ".append() on",
                     "'_session'", "zero._flat", "self._all_state_dicts in a function outside"):
        assert any(expected in f for f in found), (expected, found)
    assert not any("other._ok" in f for f in found), found
    assert len(found) == 7, found


def test_no_module_writes_the_private_attributes_of_another_class() -> None:
    bad = [f"tandem/{name}: {w}" for name, tree in _modules().items()
           for w in foreign_writes(ast.unparse(tree))]
    assert not bad, ("private attributes written outside their class's module (give the "
                     "owning class a method):\n" + "\n".join(bad))


def test_zero_helpers_use_no_private_attribute_of_the_optimizer() -> None:
    modules = _modules()
    zero = owned(modules["optim/zero.py"])
    assert {"_owners", "_steps", "_grads_sharded"} <= zero
    bad = [f"tandem/{name}:{line}: .{attr}" for name in ZERO_HELPERS
           for line, attr in sorted(_reads(modules[name], zero - owned(modules[name])))]
    for name in ZERO_HELPERS:  # functions bound into the class as methods, reading self._x
        parents = _parents(modules[name])
        bad += [f"tandem/{name}:{node.lineno}: self.{node.attr} outside any class"
                for node in ast.walk(modules[name])
                if isinstance(node, ast.Attribute) and _is_self(node.value)
                and _private(node.attr) and not _in_class(node, parents)]
    assert not bad, ("ZeroRedundancyOptimizer's helper modules use its private attributes; "
                     "use its methods (param_owners, repartition, end_step, ...):\n"
                     + "\n".join(bad))


def test_private_names_are_used_only_by_the_module_that_defines_them() -> None:
    modules = _modules()
    defined = {name: owned(tree) for name, tree in modules.items()}
    everyone = set().union(*defined.values())
    seen, bad = set(), []
    for name, tree in modules.items():
        for line, attr in sorted(_reads(tree, everyone - defined[name])):
            if (name, attr) in KNOWN_READS:
                seen.add((name, attr))
            else:
                owners = sorted(n for n, d in defined.items() if attr in d)
                bad.append(f"tandem/{name}:{line}: .{attr} (defined in {owners})")
    assert not bad, "private names used outside their module:\n" + "\n".join(bad)
    assert not KNOWN_READS - seen, f"no longer read, remove from KNOWN_READS: {KNOWN_READS - seen}"
