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
import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from tandem.testing.links import LinkShape
from tandem.testing.netns import NetnsLab, Unavailable, netns_lab

__all__ = ["Layout", "Hosts", "parse_layouts", "simulated_hosts", "Unavailable"]

_PER_RANK = ("TANDEM_SECRET", "TANDEM_SECRET_FILE", "TANDEM_HOST_ID", "TANDEM_BIND_ADDR")


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
            env: dict[str, str] | None = None) -> list[Any]:
        """``fn(rank, world_size, *args)`` on every rank; the results in rank order."""
        self._runs += 1
        tag = f"run{self._runs}"
        spec = self.workdir / f"{tag}.json"
        spec.write_text(json.dumps({"module": fn.__module__, "function": fn.__qualname__,
                                    "args": list(args)}))
        secret = secrets.token_hex(16)
        world = self.layout.world_size
        placement = self.layout.placement

        def rank_args(rank: int) -> list[str]:
            return [str(spec), str(rank), str(world), str(self.workdir / f"{tag}-{rank}.out")]

        # tuning settings (TANDEM_RING_THRESHOLD, ...) reach the ranks; identity does not
        tuning = {k: v for k, v in os.environ.items()
                  if k.startswith("TANDEM_") and k not in _PER_RANK}

        def rank_env(rank: int) -> dict[str, str]:
            host = placement[rank]
            return {**tuning, "TANDEM_SECRET": secret, "TANDEM_HOST_ID": f"labhost{host}",
                    "TANDEM_BIND_ADDR": self.lab.addrs[host], "GLOO_SOCKET_IFNAME": "eth0",
                    **(env or {})}

        runs = self.lab.run(["-m", "tandem.bench._host_rank"], placement, rank_args, rank_env,
                            timeout=timeout, grace=30.0)
        failed = [r for r in runs if not r.ok]
        if failed:
            logs = "\n".join(f"--- rank {r.rank} on host {r.host}: "
                             f"{'deadline' if r.returncode is None else f'exit {r.returncode}'}"
                             f" ---\n{r.log[-4000:]}" for r in failed)
            raise RuntimeError(f"{len(failed)} of {world} ranks failed on {self.layout} "
                               f"hosts:\n{logs}")
        return [json.loads((self.workdir / f"{tag}-{r}.out").read_text()) for r in range(world)]

    def link_report(self) -> str:
        """One line: the configured link and what host 0 -> host 1 measures now."""
        rtts = [r for r in self.lab.ping(0, 1, count=20) if r is not None]
        rtt = f"{statistics.median(rtts) * 1e3:.2f} ms" if rtts else "no replies"
        rate = self.lab.throughput(0, 1, seconds=1.5)
        return (f"link {self.lab.link} per host; measured host 0 -> 1: one TCP stream "
                f"{rate / 1e6:.0f} Mbit/s, ping round trip median {rtt}")


@contextlib.contextmanager
def simulated_hosts(layout: Layout, link: LinkShape) -> Iterator[Hosts]:
    """A lab of ``layout.hosts`` hosts on ``link``; :class:`Unavailable` if none can be made."""
    with tempfile.TemporaryDirectory(prefix="tandem-bench-hosts-") as tmp:
        with netns_lab(layout.hosts, Path(tmp), link) as lab:
            yield Hosts(lab, layout)
