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
        tandem.init_process_group(sys.argv[5], init_method=sys.argv[1], rank=int(sys.argv[2]),
                                  world_size=int(sys.argv[3]),
                                  timeout=datetime.timedelta(seconds=float(sys.argv[4])))
        print("joined")
    except Exception as exc:
        print(f"{type(exc).__name__} {time.monotonic() - start:.2f} {exc}")
""")


def _pair(tmp_path: Path, worlds: tuple[int, int], secrets: tuple[str, str],
          backend: str = "tcp") -> list[tuple[str, float, str]]:
    """Start ranks 0 and 1 on ``backend`` (init timeout 2 s) with these world sizes and
    TANDEM_SECRETs; each one's (error type, seconds, message)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TANDEM_TIMEOUT", "TANDEM_CONNECT_TIMEOUT", "TANDEM_SECRET")}
    store = f"file://{tmp_path}/store"
    procs = [subprocess.Popen([sys.executable, "-c", SIZED, store, str(rank), str(world), "2",
                               backend],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**env, "TANDEM_SECRET": secret})
             for rank, (world, secret) in enumerate(zip(worlds, secrets))]
    try:
        out = [p.communicate(timeout=LIMIT)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    results = []
    for text in out:
        line = (text.strip().splitlines() or [""])[-1]
        kind, seconds, message = (line.split(" ", 2) + ["0", ""])[:3]
        results.append((kind, float(seconds), message))
    return results


def test_the_init_timeout_bounds_connecting_when_it_is_shorter(tmp_path: Path) -> None:
    # rank 1 holds another secret: it registers, but its connection to rank 0 fails
    # authentication, so rank 0 waits for it on its socket, which must end by the init
    # timeout (2 s), not by TANDEM_CONNECT_TIMEOUT (60 s by default)
    kind, seconds, message = _pair(tmp_path, (2, 2), ("one-secret", "another-secret"))[0]
    assert kind == "NetworkError" and "[1] did not connect" in message, (kind, message)
    assert seconds < 2.0 + SLACK, f"took {seconds}s: {message}"


@pytest.mark.parametrize("backend", ["tcp", "auto"])
def test_ranks_given_different_world_sizes_are_told_at_once(tmp_path: Path, backend: str
                                                            ) -> None:
    # tcp compares in each connection's hello; auto and shm in the host exchange
    for rank, (kind, seconds, message) in enumerate(_pair(tmp_path, (2, 3), ("s", "s"),
                                                          backend)):
        assert kind == "ArgumentError", (rank, kind, message)
        world, other = (2, 3) if rank == 0 else (3, 2)
        assert (f"rank {rank} was started with world_size={world} but rank {1 - rank} with "
                f"world_size={other}") in message, message
        assert seconds < SLACK, f"rank {rank} took {seconds}s"
