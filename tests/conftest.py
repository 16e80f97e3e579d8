"""The suite's tiers: ``--fast`` for the edit loop, everything by default.

The fast tier is every test that runs in this process (threads over the loopback
transport, units), plus one spawn smoke test per tandem package. A test that starts a
process (``multiprocessing``, ``subprocess``) is marked ``procs`` and left out of it; a
test marked ``smoke("tandem.X")`` is its package's smoke test and stays in. Markers
cannot drift: a test that starts a process without either marker fails, and so does a
smoke test that starts none under ``--fast`` (``tests/test_tiers.py`` checks every package
has one).
"""

from __future__ import annotations

import multiprocessing.process
import subprocess
from typing import Any

import pytest
import torch._dynamo  # noqa: F401

from _tiers import in_fast_tier

# torch.optim and nested tensors import torch._dynamo on first use: rank threads doing it
# at once see a half-initialised module, and under load the import alone took 30 s of a
# test's deadline, so it happens here, once
_state: dict[str, Any] = {"test": None, "started": []}
_PASSED = pytest.StashKey[bool]()


def _note(what: str) -> None:
    if _state["test"] is not None:
        _state["started"].append(what)


_process_start = multiprocessing.process.BaseProcess.start
_popen_init = subprocess.Popen.__init__


def _start(self: Any, *args: Any, **kwargs: Any) -> None:
    _note(f"multiprocessing process {self.name}")
    _process_start(self, *args, **kwargs)


def _init(self: Any, *args: Any, **kwargs: Any) -> None:
    _note(f"subprocess {str(args[0] if args else kwargs.get('args'))[:120]}")
    _popen_init(self, *args, **kwargs)


multiprocessing.process.BaseProcess.start = _start  # type: ignore[method-assign]
subprocess.Popen.__init__ = _init  # type: ignore[method-assign]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true",
                     help="the fast tier: tests in this process and one smoke test a package")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "procs: the test starts processes (not in --fast)")
    config.addinivalue_line("markers",
                            "smoke(package): the package's spawn smoke test (in --fast)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--fast"):
        return
    keep = [item for item in items if in_fast_tier(item)]
    config.hook.pytest_deselected(items=[item for item in items if not in_fast_tier(item)])
    items[:] = keep


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    _state["test"], _state["started"] = item.nodeid, []
    try:
        yield
    finally:
        _state["test"] = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome = yield
    report = outcome.get_result()
    if call.when == "call":
        item.stash[_PASSED] = report.passed
    if call.when != "teardown" or report.failed:
        return
    started, smoke = _state["started"], item.get_closest_marker("smoke")
    if started and smoke is None and item.get_closest_marker("procs") is None:
        problem = (f"{item.nodeid} started {len(started)} process(es) ({started[0]}) but is "
                   "not marked: mark it @pytest.mark.procs (or module-wide pytestmark), so "
                   "the fast tier (--fast) leaves it out")
    elif smoke is not None and not started and item.stash.get(_PASSED, False) \
            and item.config.getoption("--fast"):  # alone in its module: its fixtures are its own
        problem = (f"{item.nodeid} is {smoke.args[0]}'s smoke test but started no process: "
                   "a smoke test spawns ranks")
    else:
        return
    report.outcome = "failed"
    report.longrepr = problem
