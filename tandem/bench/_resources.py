"""What one process holds, read from ``/proc``: memory, descriptors, threads, shared-memory
mappings and its established TCP connections (split by whether the peer is on this host).

    before = snapshot()
    ...                                   # e.g. init_process_group
    after = snapshot()
    grown = after.minus(before)           # what the step added; connections: the new ones

Connections are matched by socket inode between ``/proc/self/fd`` and
``/proc/self/net/tcp{,6}`` (the process's own network namespace), so each process counts
only its own. A peer is on this host when its address is a loopback address or one of
this namespace's own addresses (what a connection to the host's address looks like).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable

__all__ = ["Snapshot", "snapshot", "tcp_connections"]

_ESTABLISHED = "01"


@dataclasses.dataclass(frozen=True)
class Snapshot:
    rss_kb: int
    pss_kb: int
    fds: int
    threads: int
    shm_maps: int  # mappings of memfd or /dev/shm files
    local_tcp: frozenset[int]  # socket inodes of connections to this host
    remote_tcp: frozenset[int]  # socket inodes of connections to other hosts

    def minus(self, base: "Snapshot") -> dict[str, int]:
        """What this snapshot holds beyond ``base``; connections: those not in ``base``."""
        return {"rss_kb": self.rss_kb - base.rss_kb, "pss_kb": self.pss_kb - base.pss_kb,
                "fds": self.fds - base.fds, "threads": self.threads - base.threads,
                "shm_maps": self.shm_maps - base.shm_maps,
                "local_tcp": len(self.local_tcp - base.local_tcp),
                "remote_tcp": len(self.remote_tcp - base.remote_tcp)}


def _kb(path: str, field: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _shm_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "/memfd:" in line or "/dev/shm/" in line)


def _socket_inodes() -> set[int]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since listing (the listing's own descriptor, for one)
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def _addr(hex_addr: str) -> bytes:
    """The address bytes of a ``/proc/net/tcp`` ``ADDR:PORT`` field (host-order words)."""
    raw = bytes.fromhex(hex_addr.split(":")[0])
    return b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))


def _is_loopback(addr: bytes) -> bool:
    if len(addr) == 4:
        return addr[0] == 127
    if addr[:12] == b"\0" * 10 + b"\xff\xff":  # IPv4-mapped
        return addr[12] == 127
    return addr == b"\0" * 15 + b"\1"


def _established() -> Iterable[tuple[int, bytes, bytes]]:
    for name in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(name) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == _ESTABLISHED:
                yield int(cols[9]), _addr(cols[1]), _addr(cols[2])


def tcp_connections() -> tuple[set[int], set[int]]:
    """This process's established TCP connections: (to this host, to other hosts)."""
    mine = _socket_inodes()
    rows = [(inode, local, peer) for inode, local, peer in _established() if inode in mine]
    # every local address of this namespace appears as the local end of some socket
    own = {local for _, local, _ in _established()}
    here: set[int] = set()
    there: set[int] = set()
    for inode, _, peer in rows:
        (here if _is_loopback(peer) or peer in own else there).add(inode)
    return here, there


def snapshot() -> Snapshot:
    here, there = tcp_connections()
    return Snapshot(rss_kb=_kb("/proc/self/status", "VmRSS"),
                    pss_kb=_kb("/proc/self/smaps_rollup", "Pss"),
                    fds=len(os.listdir("/proc/self/fd")),
                    threads=len(os.listdir("/proc/self/task")),
                    shm_maps=_shm_maps(), local_tcp=frozenset(here), remote_tcp=frozenset(there))
