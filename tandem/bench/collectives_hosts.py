"""Collectives across simulated hosts on shaped links: tandem against gloo, and the link bound.

Run as root (network namespaces; ``python -m tandem.bench collectives --help``)::

    python -m tandem.bench collectives --link 1gbit:0.2ms          # layouts 2x1, 2x2, 3x1, 4x1
    python -m tandem.bench collectives --hosts 2 --ranks-per-host 2 --link 10gbit:0.2ms
    python -m tandem.bench collectives --layouts 3x1 --link 1gbit:1ms --ops all_reduce --sizes 64M

How it measures. For each layout (hosts x ranks per host) a fresh lab of network
namespaces (``tandem.testing.netns``) is built with every host's link shaped as
``--link`` says (``tandem.testing.links``: rate each way, one-way delay, loss), and
host 0 -> host 1 is measured (one TCP stream, pings) and printed, so the table says
what the links really did. Then one set of rank processes, ``R`` per host, runs
exactly what the one-host benchmark runs (:func:`tandem.bench.collectives._rank_main`):
gloo and each tandem backend (default ``auto``: shared memory within a host, tcp
across) on the same inputs, checked once, then rounds alternating between the two;
a round's time is its slowest rank's, a row shows the best round's time per op.
ratio = gloo's time / tandem's in the rounds interleaved with it: above 1 means
tandem is faster.

The link bound: the least time the links allow. With ``S`` the per-rank input, ``H``
hosts and ``R`` ranks per host, each host must move at least these bytes over its
link, in one direction (reductions within a host cost no link traffic):

    all_reduce       2 (H-1)/H * S     (a reduce-scatter and an all-gather of S)
    reduce_scatter   (H-1)/H * S       (``reduce_scatter_tensor``: S in, S/(H R) out)
    all_gather       (H-1) * R * S     (every other host's R inputs must come in)
    broadcast        S
    reduce           S                 (a tree: every host but the root's sends S once)

bound = those bytes / rate, and "x/bound" = bound / x's time: the share of the
link's rate that x used (100%: the link never idled). Rates count Ethernet frames,
so TCP payload tops out near 95%.
"""

from __future__ import annotations

from typing import Sequence

from tandem.bench._hosts import Layout, simulated_hosts
from tandem.bench._table import render
from tandem.bench.collectives import Row, _fmt_size, _rank_main, rows_from
from tandem.testing.links import LinkShape

__all__ = ["HostRow", "link_bytes", "run_hosts", "format_hosts_table", "DEFAULT_LAYOUTS"]

DEFAULT_LAYOUTS = "2x1,2x2,3x1,4x1"
DEFAULT_OPS = ("all_reduce", "all_gather", "reduce_scatter")
DEFAULT_SIZES = "4K,1M,16M,64M"
HostRow = tuple[Layout, Row]


def link_bytes(op: str, size: int, layout: Layout) -> float:
    """The bytes each host must move over its link for ``op`` (module docstring)."""
    h, r = layout.hosts, layout.ranks_per_host
    if op == "all_reduce":
        return 2 * (h - 1) / h * size
    if op == "reduce_scatter":
        return (h - 1) / h * size
    if op == "all_gather":
        return (h - 1) * r * size
    return float(size)


def run_hosts(layouts: Sequence[Layout], link: LinkShape, backends: Sequence[str],
              ops: Sequence[str], sizes: Sequence[int], rounds: int, round_s: float,
              timeout: float, report: bool = True) -> list[HostRow]:
    """Measure every (layout, op, size); print each lab's link measurement as it is made."""
    out: list[HostRow] = []
    for layout in layouts:
        with simulated_hosts(layout, link) as hosts:
            if report:
                print(f"{layout}: {hosts.link_report()}", flush=True)
            per_rank = hosts.run(_rank_main, (str(hosts.workdir), list(backends), list(ops),
                                              list(sizes), rounds, round_s, ["tandem", "gloo"]),
                                 timeout=timeout)

        def bound(op: str, size: int, layout: Layout = layout) -> float:
            return link_bytes(op, size, layout) / link.rate_bytes if link.rate_bits else 0.0

        out += [(layout, row) for row in rows_from(per_rank, ops, sizes, rounds, bound)]
    return out


def _fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"


def _share(bound: float, seconds: float) -> str:
    return f"{100 * bound / seconds:.0f}%" if bound else "-"


def format_hosts_table(rows: Sequence[HostRow], markdown: bool = False) -> str:
    backends = list(rows[0][1].tandem_s) if rows else []
    header = ["hosts x ranks", "op", "size", "gloo", *[c for b in backends for c in
                                                       (b, f"{b} ratio")],
              "link bound", "gloo/bound", *[f"{b}/bound" for b in backends]]
    body = []
    for layout, row in rows:
        gloo = min(row.gloo_s.values())
        body.append([str(layout), row.op, _fmt_size(row.size), _fmt_time(gloo),
                     *[c for b in backends for c in (_fmt_time(row.tandem_s[b]),
                                                     f"{row.ratio(b):.2f}")],
                     _fmt_time(row.bound_s) if row.bound_s else "-", _share(row.bound_s, gloo),
                     *[_share(row.bound_s, row.tandem_s[b]) for b in backends]])
    numeric = [False, False] + [True] * (len(header) - 2)
    return render(header, body, numeric, markdown)
