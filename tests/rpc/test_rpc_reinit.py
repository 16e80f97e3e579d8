"""``init_rpc`` -> call -> ``shutdown()`` many times in the same processes, on one address.

Under ``tcp://`` (and ``env://``) worker 0 hosts the store, so each shutdown closes a
server and the next ``init_rpc`` starts one on the same port, while the other worker may
already be knocking: it must wait for the new server rather than join the closing one,
and worker 0 must not close its server before the others have their last reply from it.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest

import tandem.rpc as rpc
from _rpc_workers import attempt, echo
from tandem.testing import launch

pytestmark = [pytest.mark.timeout(120), pytest.mark.procs]

CYCLES = 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cycles(rank: int, world: int, port: int) -> dict[str, Any]:
    for i in range(CYCLES):
        opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                               rpc_timeout=30)
        r = attempt(rpc.init_rpc, f"worker{rank}", rank=rank, world_size=world,
                    rpc_backend_options=opts)
        if not r["ok"]:
            return {"cycles": i, "error": r}
        r = attempt(rpc.rpc_sync, f"worker{1 - rank}", echo, args=(i,))
        if not r["ok"] or r["value"] != i:
            return {"cycles": i, "error": r}
        r = attempt(rpc.shutdown)
        if not r["ok"]:
            return {"cycles": i, "error": r}
    return {"cycles": CYCLES, "error": None}


def test_init_call_shutdown_twelve_times_on_one_address() -> None:
    outcomes = launch(2, _cycles, (_free_port(),), init=False, timeout=100,
                      env={"TANDEM_CONNECT_TIMEOUT": "20"})
    for o in outcomes:
        assert o.ok, o.error
        assert o.value["error"] is None, (o.rank, o.value)
