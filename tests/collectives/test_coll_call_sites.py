"""Call sites and mismatch detection: ``TANDEM_CHECK_CALL_SITES``.

A rank that skips a collective meets its peers' skipped call with its next one; when
both have the same signature, the two are combined and nothing says so until a later
call stalls. Comparing call sites would catch it, but torch lets ranks call one
collective from different lines (``if rank == 0: broadcast(t, 0) else: broadcast(t,
0)``), so by default sites are only reported (in mismatch, stall and timeout
messages), and ``TANDEM_CHECK_CALL_SITES=1`` makes them part of what ranks compare.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

import tandem
from tandem.testing import launch

pytestmark = pytest.mark.timeout(240)

BACKENDS = ["tcp", "shm"]
OP_TIMEOUT = 40.0


def _skips_a_call(rank: int, world_size: int) -> dict[str, Any]:
    t = torch.ones(4)
    try:
        if rank != 0:
            tandem.all_reduce(t)  # SKIPPED: rank 0 never makes this call
        tandem.all_reduce(t)  # NEXT
        tandem.barrier()
    except Exception as exc:  # noqa: BLE001 - described for the test
        return {"ok": False, "type": type(exc).__name__, "msg": str(exc)}
    return {"ok": True, "value": t.tolist()}


def _one_call_from_two_lines(rank: int, world_size: int) -> dict[str, Any]:
    t = torch.full((4,), float(rank + 1))
    try:
        if rank == 0:
            tandem.broadcast(t, 0)
        else:
            tandem.broadcast(t, 0)
        tandem.barrier()
    except Exception as exc:  # noqa: BLE001 - described for the test
        return {"ok": False, "type": type(exc).__name__, "msg": str(exc)}
    return {"ok": True, "value": t.tolist()}


def _line(marker: str) -> str:
    """``file:line`` of the line of this module that carries ``marker``."""
    lines, start = inspect.getsourcelines(_skips_a_call)
    index = next(i for i, text in enumerate(lines) if marker in text)
    return f"test_coll_call_sites.py:{start + index}"


def _run(body: Any, backend: str, strict: bool) -> list[dict[str, Any]]:
    env = {"TANDEM_CHECK_CALL_SITES": "1"} if strict else {}
    outcomes = launch(2, body, backend=backend, timeout=200, op_timeout=OP_TIMEOUT, env=env)
    assert all(o.ok for o in outcomes), [o.error for o in outcomes if not o.ok]
    return [o.value for o in outcomes]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.procs
def test_a_skipped_call_is_a_mismatch_naming_both_lines_when_sites_are_checked(
        backend: str) -> None:
    for rank, r in enumerate(_run(_skips_a_call, backend, strict=True)):
        assert not r["ok"], f"{backend}: rank {rank} completed with {r['value']}"
        assert r["type"] == "CollectiveMismatchError" or (
            r["type"] == "StateError" and "collective mismatch" in r["msg"]), (backend, rank, r)
        assert _line("SKIPPED") in r["msg"] and _line("NEXT") in r["msg"], (backend, rank, r)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.procs
def test_one_collective_from_two_lines_works_by_default(backend: str) -> None:
    results = _run(_one_call_from_two_lines, backend, strict=False)
    for rank, r in enumerate(results):
        assert r == {"ok": True, "value": [1.0] * 4}, (backend, rank, r)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.procs
def test_one_collective_from_two_lines_is_refused_when_sites_are_checked(backend: str) -> None:
    for rank, r in enumerate(_run(_one_call_from_two_lines, backend, strict=True)):
        assert not r["ok"] and "collective mismatch" in r["msg"], (backend, rank, r)


def test_the_setting_is_a_flag() -> None:
    from tandem.config import load_settings
    from tandem.errors import ArgumentError

    assert load_settings({}).check_call_sites is False
    assert load_settings({"TANDEM_CHECK_CALL_SITES": "1"}).check_call_sites is True
    with pytest.raises(ArgumentError, match="TANDEM_CHECK_CALL_SITES"):
        load_settings({"TANDEM_CHECK_CALL_SITES": "strict"})
