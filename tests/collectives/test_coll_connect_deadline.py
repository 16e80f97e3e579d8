"""Set-up waits TANDEM_CONNECT_TIMEOUT, not the 30-minute op timeout, and says what it tried.

Each case starts one rank of a job whose other ranks, or whose store, never appear,
with ``TANDEM_CONNECT_TIMEOUT=2`` and the default op timeout (1800 s): it must fail
within seconds, naming the host or the rank it waited for.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(200)

CONNECT_TIMEOUT = 2.0
LIMIT = 90.0  # seconds a case may take at most: far below the op timeout it must not use
SLACK = 15.0  # set-up beyond the connect timeout on a busy machine (store, threads, files)

RANK = textwrap.dedent("""
    import sys, time
    import tandem, tandem.collectives.world  # imports (torch's too) before the clock starts
    start = time.monotonic()
    try:
        tandem.init_process_group(sys.argv[1], init_method=sys.argv[2] or None,
                                  rank=int(sys.argv[3]), world_size=2)
        print("joined")
    except Exception as exc:
        print(f"{type(exc).__name__} {time.monotonic() - start:.2f} {exc}")
""")


def _run(backend: str, init_method: str, rank: int, **env: str) -> tuple[str, float, str]:
    child_env = {**os.environ, "TANDEM_CONNECT_TIMEOUT": str(CONNECT_TIMEOUT), **env}
    child_env.pop("TANDEM_TIMEOUT", None)
    done = subprocess.run([sys.executable, "-c", RANK, backend, init_method, str(rank)],
                          capture_output=True, text=True, timeout=LIMIT, env=child_env)
    line = (done.stdout.strip().splitlines() or [""])[-1]
    kind, seconds, message = (line.split(" ", 2) + ["0", ""])[:3]
    assert kind != "joined" and kind, f"{done.stdout}\n{done.stderr[-3000:]}"
    return kind, float(seconds), message


def test_a_misspelled_master_addr_fails_within_the_connect_timeout_naming_the_host() -> None:
    kind, seconds, message = _run("tcp", "env://", 1, MASTER_ADDR="no-such-host.invalid",
                                  MASTER_PORT="29999", RANK="1", WORLD_SIZE="2")
    assert kind == "StoreTimeoutError", f"{kind}: {message}"
    assert "no-such-host.invalid" in message and "does not resolve" in message, message
    assert seconds < CONNECT_TIMEOUT + SLACK, f"took {seconds}s"


def test_a_store_nobody_serves_fails_within_the_connect_timeout_naming_the_address() -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on (the kernel just handed it out)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kind, seconds, message = _run("tcp", f"tcp://127.0.0.1:{port}", 1)
    assert kind == "StoreTimeoutError", f"{kind}: {message}"
    assert f"127.0.0.1:{port}" in message and "nothing listens" in message, message
    assert seconds < CONNECT_TIMEOUT + SLACK, f"took {seconds}s"


@pytest.mark.parametrize("backend,rank", [("auto", 0), ("tcp", 1), ("shm", 0)])
def test_a_peer_that_never_starts_fails_set_up_within_the_connect_timeout(
        tmp_path: Path, backend: str, rank: int) -> None:
    # the other rank never runs: its address (or host) never appears in the store
    kind, seconds, message = _run(backend, f"file://{tmp_path}/store", rank)
    assert kind in ("StoreTimeoutError", "NetworkError"), f"{kind}: {message}"
    assert "TANDEM_CONNECT_TIMEOUT" in message or "did not connect" in message, message
    other = 1 - rank
    assert f"/{other}" in message or f"[{other}]" in message, (
        f"the message should name rank {other}: {message}")
    assert seconds < CONNECT_TIMEOUT + SLACK, f"took {seconds}s"


SIZED = textwrap.dedent("""
    import datetime, sys, time
    import tandem, tandem.collectives.world
    start = time.monotonic()
    try:
        tandem.init_process_group("tcp", init_method=sys.argv[1], rank=int(sys.argv[2]),
                                  world_size=int(sys.argv[3]),
                                  timeout=datetime.timedelta(seconds=float(sys.argv[4])))
        print("joined")
    except Exception as exc:
        print(f"{type(exc).__name__} {time.monotonic() - start:.2f} {exc}")
""")


def test_the_init_timeout_bounds_connecting_when_it_is_shorter(tmp_path: Path) -> None:
    # rank 1 believes in a world of 3: it registers, but its connection to rank 0 is
    # refused, so rank 0 waits for it on its socket, which must end by the init timeout
    # (2 s), not by TANDEM_CONNECT_TIMEOUT (60 s by default)
    env = {k: v for k, v in os.environ.items()
           if k not in ("TANDEM_TIMEOUT", "TANDEM_CONNECT_TIMEOUT")}
    store = f"file://{tmp_path}/store"
    procs = [subprocess.Popen([sys.executable, "-c", SIZED, store, str(rank), str(world), "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for rank, world in ((0, 2), (1, 3))]
    try:
        out = [p.communicate(timeout=LIMIT)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    line = (out[0].strip().splitlines() or [""])[-1]
    kind, seconds, message = (line.split(" ", 2) + ["0", ""])[:3]
    assert kind in ("NetworkError", "StoreTimeoutError"), out
    assert float(seconds) < 2.0 + SLACK, f"took {seconds}s: {message}"
