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

__all__ = ["Snapshot", "snapshot", "tcp_connections", "CgroupMemory", "memory_cgroup",
           "reset_cgroup_peak"]

_ESTABLISHED = "01"


@dataclasses.dataclass(frozen=True)
class Snapshot:
    rss_kb: int
    pss_kb: int
    # what the process allocated: anonymous memory (in full: pages made since a fork are
    # its alone, and a copy on write leaves the count as it was) and shared memory (PSS:
    # split with the ranks that map it); no file pages (code), no share of a zygote's pages
    own_rss_kb: int
    own_pss_kb: int
    fds: int
    threads: int
    shm_maps: int  # mappings of memfd or /dev/shm files
    local_tcp: frozenset[int]  # socket inodes of connections to this host
    remote_tcp: frozenset[int]  # socket inodes of connections to other hosts

    def minus(self, base: "Snapshot") -> dict[str, int]:
        """What this snapshot holds beyond ``base``; connections: those not in ``base``."""
        return {"rss_kb": self.rss_kb - base.rss_kb, "pss_kb": self.pss_kb - base.pss_kb,
                "own_rss_kb": self.own_rss_kb - base.own_rss_kb,
                "own_pss_kb": self.own_pss_kb - base.own_pss_kb,
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


def _fields(path: str) -> dict[str, int]:
    """``Name: N kB`` lines of a ``/proc`` file, in kB."""
    out = {}
    with open(path) as f:
        for line in f:
            name, _, value = line.partition(":")
            parts = value.split()
            if parts and parts[0].isdigit():
                out[name] = int(parts[0])
    return out


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
    status, rollup = _fields("/proc/self/status"), _fields("/proc/self/smaps_rollup")
    anon = status.get("RssAnon", 0)
    return Snapshot(rss_kb=status.get("VmRSS", 0), pss_kb=rollup.get("Pss", 0),
                    own_rss_kb=anon + status.get("RssShmem", 0),
                    own_pss_kb=anon + rollup.get("Pss_Shmem", 0),
                    fds=len(os.listdir("/proc/self/fd")),
                    threads=len(os.listdir("/proc/self/task")),
                    shm_maps=_shm_maps(), local_tcp=frozenset(here), remote_tcp=frozenset(there))


@dataclasses.dataclass(frozen=True)
class CgroupMemory:
    """This process's memory cgroup: where it is, its limit and what it saw (bytes)."""

    path: str
    limit: int | None  # None: unlimited
    peak: int | None  # the most it held since made (or since :func:`reset_cgroup_peak`)
    failcnt: int | None  # times its limit was hit (v1)
    oom_kills: int | None  # processes its OOM killer killed

    def describe(self, since: "CgroupMemory | None" = None) -> str:
        """``memory cgroup /x: limit 14.0 GiB, peak 13.9 GiB, limit hit 12 times, 1 OOM kill``"""
        def gib(n: int | None) -> str:
            return "unlimited" if n is None else f"{n / (1 << 30):.1f} GiB"

        kills = self.oom_kills
        if since is not None and kills is not None and since.oom_kills is not None:
            kills -= since.oom_kills
        hits = self.failcnt
        if since is not None and hits is not None and since.failcnt is not None:
            hits -= since.failcnt
        return (f"memory cgroup {self.path}: limit {gib(self.limit)}, peak {gib(self.peak)}"
                + ("" if hits is None else f", limit hit {hits} times")
                + ("" if kills is None else f", {kills} OOM kills")
                + (" during the run" if since is not None else ""))


def _memory_cgroup_dir() -> tuple[str, str, int] | None:
    """(cgroup path, its directory, version) of this process's memory cgroup."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found = None
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in controllers.split(","):
            found = (path, os.path.join("/sys/fs/cgroup/memory", path.lstrip("/")), 1)
        elif controllers == "" and found is None:
            found = (path, os.path.join("/sys/fs/cgroup", path.lstrip("/")), 2)
    if found is None or not os.path.isdir(found[1]):
        return None
    return found


def _read(directory: str, name: str) -> str:
    try:
        with open(os.path.join(directory, name)) as f:
            return f.read()
    except OSError:
        return ""


def _number(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isdigit() and int(text) < (1 << 62) else None


def _field(text: str, key: str) -> int | None:
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return _number(value)
    return None


def memory_cgroup() -> CgroupMemory | None:
    """This process's memory cgroup (v1 or v2) as it is now; None where none is readable."""
    where = _memory_cgroup_dir()
    if where is None:
        return None
    path, d, version = where
    if version == 1:
        return CgroupMemory(path, _number(_read(d, "memory.limit_in_bytes")),
                            _number(_read(d, "memory.max_usage_in_bytes")),
                            _number(_read(d, "memory.failcnt")),
                            _field(_read(d, "memory.oom_control"), "oom_kill"))
    return CgroupMemory(path, _number(_read(d, "memory.max")), _number(_read(d, "memory.peak")),
                        None, _field(_read(d, "memory.events"), "oom_kill"))


def reset_cgroup_peak() -> None:
    """Start this cgroup's peak afresh where the kernel allows it (v1; else left as is)."""
    where = _memory_cgroup_dir()
    if where is not None and where[2] == 1:
        try:
            with open(os.path.join(where[1], "memory.max_usage_in_bytes"), "w") as f:
                f.write("0")
        except OSError:
            pass
