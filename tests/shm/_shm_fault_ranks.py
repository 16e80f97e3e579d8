"""Rank bodies of the shm fault, hygiene and set-up tests (importable by spawned children).

Rank functions catch their own errors and return :func:`attempt` records (type,
message, rank attribute, wall-clock time), so tests can check what every rank saw.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

import tandem as dist
from tandem.collectives.backend import Backend
from tandem.collectives.world import world
from tandem.errors import TandemError
from tandem.testing import stay_until_reported, wait_until
from tandem.transport.mixed import host_key
from tandem.transport.shm import ShmTransport


def attempt(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        value = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - described for the test
        return {"ok": False, "type": type(exc).__name__, "msg": str(exc),
                "rank": getattr(exc, "rank", None), "at": time.time(),
                "elapsed": time.monotonic() - start}
    return {"ok": True, "value": value, "at": time.time(), "elapsed": time.monotonic() - start}


def kill_self_at(stamp: str) -> None:
    Path(stamp).write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def mappings() -> list[str]:
    """The tandem segments this process maps, one entry per segment (inode)."""
    found: dict[str, str] = {}
    with open("/proc/self/maps") as f:
        for ln in f:
            fields = ln.split(None, 5)
            if len(fields) == 6 and "tandem" in fields[5]:
                found[fields[4]] = fields[5].strip()
    return sorted(found.values())


def open_fds() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return out


def use_dev_shm() -> None:
    """Register 'shm-devshm': the shm transport with named segments in /dev/shm."""
    def make(o: Any) -> ShmTransport:
        return ShmTransport(o.rank, o.world_size, o.store, o.secret, hostname=o.hostname,
                            shm_dir="/dev/shm")
    Backend.register_backend("shm-devshm", make)


def _join(rank: int, p: int, backend: str, store: str) -> None:
    use_dev_shm()
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=p,
                            timeout=60)


def kill_during_all_reduce(rank: int, p: int, backend: str, store: str, stamp: str) -> Any:
    _join(rank, p, backend, store)
    t = torch.ones(1 << 20)  # 4 MiB: several ring pieces in flight when the kill lands
    if rank == 2:
        dist.all_reduce(t)
        timer = threading.Timer(0.3, kill_self_at, (stamp,))
        timer.daemon = True
        timer.start()
        while True:
            dist.all_reduce(t)

    def loop() -> None:
        for _ in range(100_000):
            dist.all_reduce(t)

    failure = attempt(loop)
    later = attempt(dist.all_reduce, torch.ones(4))
    # stay up, so the other survivors' errors are about rank 2
    stay_until_reported(os.path.dirname(stamp), rank, [r for r in range(p) if r != 2])
    return {"failure": failure, "later": later, "maps": mappings()}


def exits_normally(rank: int, p: int, backend: str, store: str, fail: bool) -> Any:
    """A short job; with ``fail`` rank 1 raises after a collective (the exception path)."""
    _join(rank, p, backend, store)
    t = torch.ones(3 << 20)
    dist.all_reduce(t)
    dist.barrier()  # through the arena too: no ring between ranks that share memory
    w = world()
    keys = [f"tandem/{w.generation}/shm/addr/{r}" for r in range(p)]
    # only a host's first rank listens (it hands every other pair its socket)
    sockets = [w.store.get(k).decode() for k in keys if w.store.check([k])]
    arena = w.default.arena
    seen = {"maps": mappings(), "fds": [f for f in open_fds() if "memfd" in f or "shm" in f],
            "sockets": sockets,
            # the arena keeps its descriptor until this rank's staging is all reserved
            "reserving": arena is not None and arena.reserved < arena.chunk}
    if fail and rank == 1:
        raise RuntimeError("rank 1 fails on purpose")  # exits without destroy_process_group
    dist.destroy_process_group()
    seen["fds_after"] = [f for f in open_fds() if "memfd" in f or "shm" in f]
    return seen


def hosts_differ(rank: int, p: int, store: str) -> Any:
    os.environ["TANDEM_HOST_ID"] = f"node-{rank % 2}"
    return attempt(dist.init_process_group, "shm", init_method=f"file://{store}", rank=rank,
                   world_size=p, timeout=30)


def stranger_knocks(rank: int, p: int, store: str) -> Any:
    """Rank 1 first plays a stranger at rank 0's socket, then joins; the job must work."""
    knocks = []
    if rank == 1:
        from tandem import _wire
        from tandem.store.file import FileStore

        raw = FileStore(store, p, timeout=30)
        # rank 0 listens only once it knows every rank's host: publish ours early
        raw.set("tandem/0/topology/host/1", host_key(socket.gethostname()))
        name = "\0" + raw.get("tandem/0/shm/addr/0").decode()
        for payload in (b"GET / HTTP/1.0\r\n\r\n" * 4, None):  # junk of the reply's size (72)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect(name)
            try:
                if payload is None:
                    _wire.client_handshake(s, b"not-the-secret", b"tandem-shm-transport")
                    knocks.append("accepted")
                else:
                    s.sendall(payload)
                    got = b""
                    while chunk := s.recv(4096):  # the challenge, then EOF
                        got += chunk
                    knocks.append(f"closed after {len(got)} bytes")
            except (OSError, TandemError) as exc:
                knocks.append(f"rejected: {type(exc).__name__}")
            finally:
                s.close()
    dist.init_process_group("shm", init_method=f"file://{store}", rank=rank, world_size=p,
                            timeout=30)
    t = torch.full((10,), float(rank))
    dist.all_reduce(t)
    return {"knocks": knocks, "sum": t[0].item()}


def named_gloo(rank: int, p: int, store: str) -> Any:
    """init_process_group("gloo") as a torch script writes it; which transport it got."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=p,
                            timeout=30)
    t = torch.full((10,), float(rank))
    dist.all_reduce(t)
    transport = type(world().default.transport).__name__
    dist.destroy_process_group()
    return {"transport": transport, "sum": t[0].item()}


def idle_waiter_cpu(rank: int, p: int, store: str) -> Any:
    """Rank 0 sleeps 2 s before joining an all_reduce; the others wait for it meanwhile."""
    dist.init_process_group("shm", init_method=f"file://{store}", rank=rank, world_size=p,
                            timeout=60)
    t = torch.ones(1000)
    dist.all_reduce(t)
    if rank == 0:
        time.sleep(2.0)
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    dist.all_reduce(t)
    after, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - start
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    dist.destroy_process_group()
    return {"cpu": cpu, "wall": wall, "transport": "shm"}


def mismatched(rank: int, p: int, store: str) -> Any:
    """Rank 0 calls all_reduce, rank 1 broadcast: the mismatch is caught, nothing combined."""
    dist.init_process_group("shm", init_method=f"file://{store}", rank=rank, world_size=p,
                            timeout=30)
    t = torch.full((8,), float(rank + 1))
    if rank == 0:
        r = attempt(dist.all_reduce, t)
    else:  # a broadcast root only sends: it learns of the mismatch at its next call
        r = attempt(dist.broadcast, t, src=1)
        r["later"] = attempt(dist.all_reduce, torch.ones(2))
    r["tensor"] = t.tolist()
    dist.destroy_process_group()
    return r


def forks_then_dies(rank: int, p: int, store: str, stamp: str) -> Any:
    """Rank 1 forks a child that lives on, then is killed; rank 0 must still notice."""
    dist.init_process_group("shm", init_method=f"file://{store}", rank=rank, world_size=p,
                            timeout=60)
    t = torch.ones(4)
    dist.all_reduce(t)
    if rank == 1:
        child = os.fork()
        if child == 0:  # a DataLoader-like worker: outlives its parent for a while
            time.sleep(5)
            os._exit(0)
        time.sleep(0.3)
        kill_self_at(stamp)
    return attempt(dist.recv, t, src=1)


def oversized(rank: int, p: int, store: str) -> Any:
    """TANDEM_MAX_FRAME=4096 on rank 1 only: rank 0 (whose own cap lets it) sends 16 KB;
    both ranks must learn at once."""
    if rank == 0:
        os.environ["TANDEM_MAX_FRAME"] = str(1 << 16)
    dist.init_process_group("shm", init_method=f"file://{store}", rank=rank, world_size=p,
                            timeout=30)
    learnt = os.path.join(os.path.dirname(store), "rank0.learnt")
    if rank == 0:
        big = attempt(dist.send, torch.zeros(4096), dst=1)
        after = attempt(dist.all_reduce, torch.ones(4))
        open(learnt, "w").close()
        return {"big": big, "after": after}
    got = attempt(dist.recv, torch.zeros(4096), src=0)
    # stay alive: rank 0 must learn from the closed connection, not our exit
    wait_until(lambda: os.path.exists(learnt), "rank 0 to learn of the refusal", 60)
    return {"big": got}


def handshakes_at_init(rank: int, p: int, store: str) -> Any:
    """Count the secret handshakes and thread starts of this rank while joining a one-host
    job, then use the socket of a pair that made none (ranks 1 and 2: a ring travels on
    it) and report which local peers this rank holds a socket to."""
    from tandem import _wire

    count = 0
    start = _wire.client_handshake_start  # every client handshake begins here

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal count
        count += 1
        return start(*args, **kwargs)

    started: list[str] = []
    thread_start = threading.Thread.start

    def counted_thread(self: threading.Thread) -> None:
        if threading.current_thread() is threading.main_thread():  # init waits for these
            started.append(self.name)
        thread_start(self)

    _wire.client_handshake_start = counted
    threading.Thread.start = counted_thread  # type: ignore[method-assign]
    try:
        dist.init_process_group("shm", init_method=f"file://{store}", rank=rank, world_size=p,
                                timeout=30)
    finally:
        _wire.client_handshake_start = start
        threading.Thread.start = thread_start  # type: ignore[method-assign]
    t = world().transport
    assert isinstance(t, ShmTransport)
    got = torch.zeros(4)
    if rank == 1:
        dist.send(torch.full((4,), 7.0), 2)
    elif rank == 2:
        dist.recv(got, 1)
    total = torch.ones(1)
    dist.all_reduce(total)
    dist.destroy_process_group()
    return {"handshakes": count, "peers": sorted(t._peers), "got": got.tolist(),
            "sum": total.item(), "threads_started": started}
