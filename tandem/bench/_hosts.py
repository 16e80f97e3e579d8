"""Benchmark ranks on simulated hosts: a layout of hosts x ranks, on shaped links.

    with simulated_hosts(Layout(2, 2), LinkShape.parse("1gbit:0.2ms")) as hosts:
        print(hosts.link_report())                  # measured rate and round trip
        results = hosts.run(fn, (arg1, arg2))       # fn(rank, world_size, arg1, arg2) per rank

``fn`` must be a module-level function; each rank process (``tandem.bench._host_rank``,
inside its host's namespace) imports it, calls it with the JSON-decoded arguments and
returns its JSON-encodable result. Ranks ``h*R .. h*R+R-1`` live on host ``h``. Every
rank gets a fresh job secret, ``TANDEM_HOST_ID``, ``TANDEM_BIND_ADDR`` = its host's
address, ``GLOO_SOCKET_IFNAME=eth0`` and the caller's other ``TANDEM_*`` settings
(``TANDEM_RING_THRESHOLD=... python -m tandem.bench ...`` tunes the ranks), so tandem
and gloo both go across hosts over the shaped links; ranks of one host reach each other through the host's loopback
(and tandem's ``auto`` backend through shared memory). Rendezvous through files in
``hosts.workdir``, which every namespace sees.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from tandem.bench._resources import CgroupMemory
from tandem.testing.links import LinkShape
from tandem.testing.netns import NetnsLab, RankRun, Unavailable, netns_lab

__all__ = ["Layout", "Hosts", "RankEnd", "describe_failures", "parse_layouts",
           "simulated_hosts", "Unavailable"]

_PER_RANK = ("TANDEM_SECRET", "TANDEM_SECRET_FILE", "TANDEM_HOST_ID", "TANDEM_BIND_ADDR")
_LISTED = 14  # failed ranks named one line each after the first two (the rest counted)


@dataclasses.dataclass(frozen=True)
class Layout:
    hosts: int
    ranks_per_host: int

    @property
    def world_size(self) -> int:
        return self.hosts * self.ranks_per_host

    @property
    def placement(self) -> list[int]:
        return [h for h in range(self.hosts) for _ in range(self.ranks_per_host)]

    def __str__(self) -> str:
        return f"{self.hosts}x{self.ranks_per_host}"


def parse_layouts(text: str) -> list[Layout]:
    """``"2x1,2x2"`` -> layouts of (hosts, ranks per host); at least 2 hosts each."""
    out = []
    for part in filter(None, (p.strip().lower() for p in text.split(","))):
        hosts, _, per = part.partition("x")
        if not (hosts.isdigit() and per.isdigit()) or int(hosts) < 2 or int(per) < 1:
            raise ValueError(f"bad layout {part!r}: use HOSTSxRANKS with HOSTS >= 2, e.g. 2x2")
        out.append(Layout(int(hosts), int(per)))
    if not out:
        raise ValueError(f"no layout in {text!r}")
    return out


class Hosts:
    """Run benchmark functions on the ranks of ``layout`` in ``lab``."""

    def __init__(self, lab: NetnsLab, layout: Layout) -> None:
        self.lab = lab
        self.layout = layout
        self.workdir = lab.workdir
        self._runs = 0

    def run(self, fn: Callable[..., Any], args: Sequence[Any], timeout: float,
            env: dict[str, str] | None = None, zygote: bool = False) -> list[Any]:
        """``fn(rank, world_size, *args)`` on every rank; the results in rank order.

        ``zygote``: fork each host's ranks from one process per host that imported torch
        (:mod:`tandem.bench._host_zygote`), so they share its pages; else every rank is a
        new interpreter. When ranks fail, the error names the rank that ended first, how
        (exit code, signal, the kernel's OOM-kill line) and what it printed.
        """
        from tandem.bench._resources import memory_cgroup

        self._runs += 1
        tag = f"run{self._runs}"
        spec = self.workdir / f"{tag}.json"
        spec.write_text(json.dumps({"module": fn.__module__, "function": fn.__qualname__,
                                    "args": list(args)}))
        secret = secrets.token_hex(16)
        world = self.layout.world_size
        placement = self.layout.placement
        prefix = self.workdir / tag

        # tuning settings (TANDEM_RING_THRESHOLD, ...) reach the ranks; identity does not
        tuning = {k: v for k, v in os.environ.items()
                  if k.startswith("TANDEM_") and k not in _PER_RANK}

        def host_env(host: int) -> dict[str, str]:
            return {**tuning, "TANDEM_SECRET": secret, "TANDEM_HOST_ID": f"labhost{host}",
                    "TANDEM_BIND_ADDR": self.lab.addrs[host], "GLOO_SOCKET_IFNAME": "eth0",
                    **(env or {})}

        before = memory_cgroup()
        if zygote:
            per = self.layout.ranks_per_host

            def zygote_args(host: int) -> list[str]:
                return [str(spec), str(world), str(prefix),
                        *(str(r) for r in range(host * per, (host + 1) * per))]

            def zygote_env(host: int) -> dict[str, str]:
                # a BLAS thread pool started by the imports would make forking unsafe
                return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                        **host_env(host)}

            hosts = self.lab.run(["-m", "tandem.bench._host_zygote"],
                                 list(range(self.layout.hosts)), zygote_args, zygote_env,
                                 timeout=timeout, grace=30.0)
            ends = [_forked_end(rank, hosts[placement[rank]], prefix) for rank in range(world)]
            broken = [h for h in hosts if not h.ok]
        else:
            def rank_args(rank: int) -> list[str]:
                return [str(spec), str(rank), str(world), f"{prefix}-{rank}.out"]

            runs = self.lab.run(["-m", "tandem.bench._host_rank"], placement, rank_args,
                                lambda rank: host_env(placement[rank]), timeout=timeout,
                                grace=30.0)
            ends = [RankEnd.of(r) for r in runs]
            broken = []
        if any(not e.ok for e in ends) or broken:
            raise RuntimeError(describe_failures(str(self.layout), ends, broken, before,
                                                 memory_cgroup()))
        return [json.loads(Path(f"{prefix}-{r}.out").read_text()) for r in range(world)]

    def link_report(self) -> str:
        """One line: the configured link and what host 0 -> host 1 measures now."""
        rtts = [r for r in self.lab.ping(0, 1, count=20) if r is not None]
        rtt = f"{statistics.median(rtts) * 1e3:.2f} ms" if rtts else "no replies"
        rate = self.lab.throughput(0, 1, seconds=1.5)
        return (f"link {self.lab.link} per host; measured host 0 -> 1: one TCP stream "
                f"{rate / 1e6:.0f} Mbit/s, ping round trip median {rtt}")


@dataclasses.dataclass
class RankEnd:
    """How one rank ended: exit code or signal, when (wall clock), what it printed."""

    rank: int
    host: int
    pid: int
    exit: int | None  # None: killed by a signal, or never seen to end
    signal: int | None
    ended: float | None  # None: still running when the harness killed it
    log: str

    @property
    def ok(self) -> bool:
        return self.exit == 0

    @classmethod
    def of(cls, run: RankRun) -> "RankEnd":
        code = run.returncode
        return cls(run.rank, run.host, run.pid, code if code is None or code >= 0 else None,
                   -code if code is not None and code < 0 else None, run.ended, run.log)

    def how(self) -> str:
        """``exit 1``, ``killed by SIGKILL (signal 9)``, or why no end was seen."""
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = "an unknown signal"
            return f"killed by {name} (signal {self.signal})"
        if self.exit is not None:
            return f"exit {self.exit}"
        return "never ended: killed by the harness (deadline, or 30 s after another rank failed)"


def _forked_end(rank: int, zygote: RankRun, prefix: Path) -> RankEnd:
    """Rank ``rank``'s end as its host's zygote recorded it (``PREFIX-RANK.status``)."""
    log_path = Path(f"{prefix}-{rank}.log")
    log = log_path.read_text(errors="replace") if log_path.exists() else ""
    try:
        got = json.loads(Path(f"{prefix}-{rank}.status").read_text())
    except (OSError, ValueError):
        if zygote.returncode is not None and zygote.returncode != 0 and not log:
            log = f"(host {zygote.host}'s zygote ended {zygote.returncode}:)\n{zygote.log}"
        return RankEnd(rank, zygote.host, 0, None, None, None, log)
    return RankEnd(rank, zygote.host, got["pid"], got["exit"], got["signal"], got["ended"], log)


def describe_failures(layout: str, ends: Sequence[RankEnd], broken: Sequence[RankRun],
                      before: CgroupMemory | None, after: CgroupMemory | None) -> str:
    """The error of a run whose ranks failed: the first to end, how, and what it printed
    (in full), the memory cgroup's account, then the others, one line each."""
    from tandem.run.oom import oom_kill_line

    failed = [e for e in ends if not e.ok]
    order = sorted(failed, key=lambda e: (e.ended is None, e.ended or 0.0, e.rank))
    lines = [f"{len(failed)} of {len(ends)} ranks failed on {layout} hosts"]
    for h in broken:
        if not failed:
            lines.append(f"host {h.host}'s zygote ended {h.returncode}: {h.log[-4000:]}")
    if order:
        first = order[0]
        oom = (oom_kill_line(first.pid, first.ended or time.time())
               if first.signal == signal.SIGKILL and first.pid else "")
        lines.append(f"first to end: rank {first.rank} on host {first.host}, {first.how()}"
                     + (f"; the kernel's OOM killer: {oom}" if oom else ""))
    if after is not None:
        lines.append(after.describe(before))
    for i, e in enumerate(order):
        tail = e.log.strip()
        if i < 2:  # the first ends tell the cause; the rest mostly name it
            lines.append(f"--- rank {e.rank} on host {e.host}: {e.how()} ---")
            lines.append(tail[-4000:] if tail else "(it printed nothing)")
        elif i < 2 + _LISTED:
            last = tail.splitlines()[-1] if tail else "(it printed nothing)"
            lines.append(f"rank {e.rank} (host {e.host}): {e.how()}: {last[-300:]}")
    if len(order) > 2 + _LISTED:
        lines.append(f"... and {len(order) - 2 - _LISTED} more")
    return "\n".join(lines)


@contextlib.contextmanager
def simulated_hosts(layout: Layout, link: LinkShape) -> Iterator[Hosts]:
    """A lab of ``layout.hosts`` hosts on ``link``; :class:`Unavailable` if none can be made."""
    with tempfile.TemporaryDirectory(prefix="tandem-bench-hosts-") as tmp:
        with netns_lab(layout.hosts, Path(tmp), link) as lab:
            yield Hosts(lab, layout)
