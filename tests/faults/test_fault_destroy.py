"""``destroy_process_group`` releases everything and fails what is still pending.

After it returns, no tandem thread, descriptor or shared mapping of the job is left
in the process (checked within a second, against the state before the job), on
every backend; an async op still waiting fails at once with ``StateError``; a
failed transport set-up closes the store it was given by ``init_process_group``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

import pytest
import torch

import tandem as dist
from _fault_helpers import attempt, values
from tandem.collectives.recorder import STARTED
from tandem.collectives.world import default_group
from tandem.testing import launch, wait_until

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]

SETTLE = 1.0  # seconds allowed for threads to end after destroy_process_group returns


def _threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("tandem"))


def _fds() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return sorted(out)


def _maps() -> list[str]:
    """Shared mappings (rings, arenas): anonymous heap changes are the allocator's."""
    with open("/proc/self/maps") as f:
        return sorted(ln.split(None, 5)[-1].strip() for ln in f
                      if ln.split()[1].endswith("s") or "tandem" in ln or "memfd" in ln)


def _state() -> dict[str, list[str]]:
    return {"threads": _threads(), "fds": _fds(), "maps": _maps()}


def _one_job(rank: int, init_method: str, backend: str) -> None:
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=2,
                            timeout=30)
    t = torch.ones(1 << 16)
    dist.all_reduce(t)  # the default group's arena (shm) and readers/writers
    works = [dist.all_reduce(torch.ones(1 << 18), async_op=True) for _ in range(3)]
    works[0].get_future().then(lambda f: f.value())  # the futures thread
    for w in works:
        w.wait()
    peer = 1 - rank
    if rank == 0:
        dist.send(torch.ones(1 << 20), dst=peer)  # a queued (large) send
    else:
        dist.recv(torch.zeros(1 << 20), src=peer)
    sub = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(8), group=sub)
    dist.barrier()
    dist.destroy_process_group()


def _leaves_nothing(rank: int, world_size: int, tmp: str, backend: str) -> Any:
    threads = _threads()
    _one_job(rank, f"file://{tmp}/warm", backend)  # warm up: lazy imports, torch's pools
    wait_until(lambda: _threads() == threads, "the warm-up job's threads to end", 30)
    before = _state()
    _one_job(rank, f"file://{tmp}/job", backend)
    end = time.monotonic() + SETTLE
    after = _state()
    while after != before and time.monotonic() < end:
        time.sleep(0.05)
        after = _state()
    return {"before": before, "after": after}


@pytest.mark.parametrize("backend", ["tcp", "shm", "auto"])
def test_destroy_leaves_no_thread_descriptor_or_mapping(backend: str, tmp_path: Any) -> None:
    outcomes = launch(2, _leaves_nothing, (str(tmp_path), backend), init=False, timeout=90)
    for rank, r in values(outcomes, [0, 1]).items():
        for what in ("threads", "fds", "maps"):
            extra = sorted(set(r["after"][what]) - set(r["before"][what]))
            assert r["after"][what] == r["before"][what], (rank, what, extra)


def _pending_at_destroy(rank: int, world_size: int, tmp: str) -> Any:
    gone = os.path.join(tmp, "gone")
    dist.barrier()
    if rank == 1:  # never joins the all_reduce: it waits for rank 0 to destroy
        wait_until(lambda: os.path.exists(gone), "rank 0 to destroy its group", 60)
        return None
    work = dist.all_reduce(torch.ones(4), async_op=True)
    recorder, deadline = default_group().recorder, time.monotonic() + 20
    while not [c for c in recorder.in_flight() if c.state == STARTED]:  # waits on rank 1
        assert time.monotonic() < deadline, "the all_reduce never started"
        time.sleep(0.005)
    start = time.monotonic()
    dist.destroy_process_group()
    took = time.monotonic() - start
    open(gone, "w").close()
    outcome = attempt(work.wait)
    outcome["destroy_took"] = took
    outcome["since_destroy"] = time.monotonic() - start
    return outcome


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_an_async_op_pending_at_destroy_fails_at_once_with_state_error(
        backend: str, tmp_path: Any) -> None:
    outcomes = launch(2, _pending_at_destroy, (str(tmp_path),), backend=backend, timeout=60,
                      op_timeout=30.0)
    r = values(outcomes, [0])[0]
    assert not r["ok"] and r["type"] == "StateError", r
    assert "destroy" in r["msg"], r
    assert r["since_destroy"] < 2.0, r


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _send_dropped_at_destroy(rank: int, world_size: int, tmp: str) -> Any:
    """Every rank but 0 stops; rank 0 sends each a message the kernel cannot buffer whole,
    then destroys: what its first send's wait raised, and the warnings it logged."""
    gone = os.path.join(tmp, "gone")
    dist.barrier()
    if rank != 0:
        pid_file = os.path.join(tmp, f"pid{rank}")
        with open(pid_file + ".new", "w") as f:
            f.write(str(os.getpid()))
        os.replace(pid_file + ".new", pid_file)
        os.kill(os.getpid(), signal.SIGSTOP)  # takes nothing until rank 0 has destroyed
        wait_until(lambda: os.path.exists(gone), "rank 0 to destroy its group", 60)
        return None
    peers = []
    for r in range(1, world_size):
        pid_file = os.path.join(tmp, f"pid{r}")
        wait_until(lambda: os.path.exists(pid_file), f"rank {r} to note its pid", 60)
        peers.append(int(open(pid_file).read()))
        wait_until(lambda: _stopped(peers[-1]), f"rank {r} to stop", 60)
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("tandem").addHandler(handler)
    try:
        works = [dist.isend(torch.ones(64 << 20), dst=r, tag=7)  # more than the kernel buffers
                 for r in range(1, world_size)]
        dist.destroy_process_group()
    finally:
        for peer in peers:
            os.kill(peer, signal.SIGCONT)
        open(gone, "w").close()
    outcome = attempt(works[0].wait)
    outcome["warnings"] = warnings
    return outcome


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_send_dropped_at_destroy_is_named_by_peer_tag_and_call_site(
        backend: str, tmp_path: Any) -> None:
    outcomes = launch(2, _send_dropped_at_destroy, (str(tmp_path),), backend=backend,
                      timeout=90)
    r = values(outcomes, [0])[0]
    what = "send to rank 1 (tag 7, group id 0, called at test_fault_destroy.py:"
    assert not r["ok"] and r["type"] == "StateError", r
    assert what in r["msg"] and "gave it up" in r["msg"], r
    assert any(what in w and "1 send(s)" in w for w in r["warnings"]), r


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_sends_dropped_to_several_peers_at_destroy_are_one_warning(
        backend: str, tmp_path: Any) -> None:
    # a warning per peer (and per transport of a mixed one) was one per connection
    outcomes = launch(3, _send_dropped_at_destroy, (str(tmp_path),), backend=backend,
                      timeout=90)
    r = values(outcomes, [0])[0]
    dropped = [w for w in r["warnings"] if "now dropped" in w]
    assert len(dropped) == 1, r["warnings"]
    assert "2 send(s)" in dropped[0], dropped
    for peer in (1, 2):
        assert f"send to rank {peer} (tag 7," in dropped[0], dropped


def _failing_backend(options: Any) -> Any:
    from tandem.errors import NetworkError

    raise NetworkError("this backend always fails to connect")


def _store_closed_on_failed_setup(rank: int, world_size: int, tmp: str) -> Any:
    import socket

    from tandem.collectives.backend import Backend

    Backend.register_backend("failing", _failing_backend)
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    before = _state()
    kept: list[BaseException] = []  # the error and its traceback stay alive, as in a REPL
    try:
        dist.init_process_group("failing", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=2, timeout=10)
    except Exception as exc:  # noqa: BLE001 - checked below
        kept.append(exc)
    error = {"ok": not kept, "msg": str(kept[0]) if kept else ""}
    end = time.monotonic() + SETTLE
    after = _state()
    while after != before and time.monotonic() < end:
        time.sleep(0.05)
        after = _state()
    return {"error": error, "before": before, "after": after,
            "initialized": dist.is_initialized()}


def test_a_failed_transport_set_up_closes_the_store(tmp_path: Any) -> None:
    outcomes = launch(1, _store_closed_on_failed_setup, (str(tmp_path),), init=False,
                      timeout=60)
    r = values(outcomes, [0])[0]
    assert not r["error"]["ok"] and "always fails" in r["error"]["msg"], r
    assert not r["initialized"]
    assert r["after"] == r["before"], r
