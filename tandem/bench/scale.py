"""Scale: tandem against gloo from 8 to 64 ranks on simulated hosts, in the same run.

Run as root (network namespaces), big layouts inside a memory cgroup::

    python -m tandem.bench scale                          # 1x8,1x16,1x32,2x8,4x8,8x8
    python -m tandem.bench scale --layouts 1x8,2x8 --out /tmp/scale.md   # + scale.png, .json
    python -m tandem.bench scale --link 1gbit:0.2ms       # shaped links between hosts
    python -m tandem.bench scale --smoke                  # 1x2 and 2x2, 4 KB, one round
    python -m tandem.bench scale --store 64               # the store alone, 64 ranks
    python -m tandem.bench scale --failures               # failure handling at 8x8

How it measures. A layout ``HxR`` is ``H`` simulated hosts (``tandem.testing.netns``,
links shaped as ``--link`` says) with ``R`` ranks each. Each host has one process that
imports torch, ``torch.distributed`` and tandem and forks that host's ``R`` rank
processes (:mod:`tandem.bench._host_zygote`), so the ranks share torch's pages as
tandemrun's warm workers do (64 processes each importing torch peaked at 13.5 GB, so
the 16 MB sizes did not fit at 8x8 in 14 GB). tandem and gloo run in the same rank
processes. Every rank, in order:

* start-up: all ranks meet at a file barrier, then ``tandem.init_process_group("auto")``
  and a first ``barrier``; again at a file barrier, then ``init_process_group("gloo")``
  and its first barrier (both FileStore rendezvous in a directory every host sees);
  ``--gloo-first`` swaps the two (the first pays the process's first uses; see
  docs/benchmarks.md).
  "init" is the last rank's return from ``init_process_group``, "init+barrier" the last
  rank's first barrier, both counted from the moment the last rank reached the file
  barrier;
* resources per rank: ``/proc/self`` (:mod:`tandem.bench._resources`) before tandem's
  init, after it (plus a 1 MB all_reduce, so buffers made on first use count), after
  gloo's the same way: RSS and PSS grown, descriptors, threads, shared-memory mappings
  added. Both libraries' modules are imported before the first snapshot (in the
  zygote), so neither's figure holds its imports; pages of the zygote's that a library's
  init writes to are copied into the rank and count in that library's PSS, as they
  would in a warm-started job. TCP connections are counted at the end, after every collective (connections
  made on first use count): gloo's are those its init opened, tandem's the rest;
  "same host" connections join two ranks of one host, "across" ones join hosts, and
  per host = the sum over its ranks;
* collectives: all_reduce, all_gather, broadcast, reduce_scatter and barrier at each size
  (``tandem.bench.collectives``: checked once, then rounds alternating between tandem
  and gloo; a round's time is its slowest rank's, the row keeps the best round); after
  each (op, size), untimed, the heap's free memory goes back to the kernel
  (``malloc_trim``), or what glibc keeps of one op's 16 MB temporaries adds up over the
  ops (64 ranks ran out of 14 GB in the fourth op);
  all_gather's size is its output (each rank gives size / world), so 16 MB at 64 ranks
  stays in memory; so are gather's and scatter's (``--ops`` adds reduce, gather,
  scatter and all_to_all, rooted ones at root 0); the others' size is each rank's input
  (all_to_all's: size / world to each rank); barrier has no size;
* waiting: rank 0 sleeps ``--wait`` seconds before a barrier; every other rank's CPU
  time (all its threads) during that barrier, per second waited. 1.0 is one core spun.

Launch, for one-host layouts only: ``tandemrun`` against ``torchrun`` + gloo from the
launcher's start to every rank past its first barrier (:mod:`tandem.bench.startup`).

The store (``--store N``, instead of the layouts): ``N`` harness processes on this host
each do ``--store-ops`` operations (a set and a get of its own key, in turn) on tandem's
``TCPStore`` and on torch's, both served from the benchmark's process, every rank
starting at once; operations per second = all ranks' operations / (last end - first
start), the best of rounds that alternate which store goes first.

Failures (``--failures``, instead of the figures above; default layout 8x8, smoke 2x2):
four scenarios, each with a victim on the second host that is not its first rank
(:mod:`tandem.bench._scale_failures` has the rank bodies; harness children with torch
preloaded, moved into their host's namespace):

* kill: the victim SIGKILLs itself while all loop on all_reduce; held when every survivor
  raised ``PeerLostError`` naming it within 5 s of the kill (wall clock);
* stall: the victim SIGSTOPs itself before an all_reduce, ``TANDEM_STALL_WARN`` =
  ``--stall-warn``; held when every survivor's first report of that call names the victim
  alone among the ranks that have not arrived;
* skip: the victim skips an all_reduce and calls barrier; held when every rank's error
  names the victim and its barrier's file:line (the victim's: the others' all_reduce's);
* summary: ``tandemrun``, one agent per host, a worker per rank; the victim raises at its
  fourth step; held when every agent's root-cause summary names the victim and is at
  most 40 lines.

Ratios are tandem / gloo for times and resources (below 1: tandem is faster or
smaller), and gloo / tandem, a speed-up, for collectives (above 1: tandem is faster).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from tandem.bench._hosts import Hosts, Layout
from tandem.bench.collectives import _fmt_size, pick
from tandem.bench.collectives_hosts import _fmt_time

__all__ = ["main", "parse_scale_layouts", "run_layout", "format_tables"]

DEFAULT_LAYOUTS = "1x8,1x16,1x32,2x8,4x8,8x8"
SMOKE_LAYOUTS = "1x2,2x2"
OPS = ("all_reduce", "all_gather", "broadcast", "reduce_scatter", "barrier")
# on request (--ops): the rooted ones (root 0) and all_to_all (size: each rank's input)
MORE_OPS = ("reduce", "gather", "scatter", "all_to_all")
DEFAULT_SIZES = "4K,1M,16M"
_OP_TIMEOUT_S = 600.0
_BARRIER_TIMEOUT_S = 600.0
_MEASURES = ("rss_kb", "pss_kb", "own_rss_kb", "own_pss_kb", "fds", "threads", "shm_maps")


def parse_scale_layouts(text: str) -> list[Layout]:
    """``"1x8,2x8"`` -> layouts (hosts x ranks per host); one host is allowed here."""
    out = []
    for part in filter(None, (p.strip().lower() for p in text.split(","))):
        hosts, _, per = part.partition("x")
        if not (hosts.isdigit() and per.isdigit()) or int(hosts) < 1 or int(per) < 1 \
                or int(hosts) * int(per) < 2:
            raise ValueError(f"bad layout {part!r}: use HOSTSxRANKS with at least 2 ranks in "
                             f"all, e.g. 1x8 or 2x8")
        out.append(Layout(int(hosts), int(per)))
    if not out:
        raise ValueError(f"no layout in {text!r}")
    return out


# ---- inside each rank process ---------------------------------------------------------


def _file_barrier(workdir: str, name: str, rank: int, world: int) -> float:
    """Wait until every rank reached ``name``; the wall-clock time this rank saw them all."""
    where = Path(workdir) / name
    where.mkdir(exist_ok=True)
    (where / str(rank)).touch()
    deadline = time.monotonic() + _BARRIER_TIMEOUT_S
    while len(os.listdir(where)) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"file barrier {name}: {len(os.listdir(where))} of {world} "
                               f"ranks after {_BARRIER_TIMEOUT_S:.0f} s")
        time.sleep(0.01)  # the ranks are still importing torch: seconds, not microseconds
    return time.time()


def _start(lib: Any, backend: str, store: str, rank: int, world: int) -> dict[str, float]:
    import torch

    start = time.time()
    lib.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                           timeout=datetime.timedelta(seconds=_OP_TIMEOUT_S))
    ready = time.time()
    lib.barrier()
    barrier = time.time()
    lib.all_reduce(torch.ones(1 << 18))  # 1 MB: buffers made on first use are counted
    return {"start": start, "init": ready, "barrier": barrier}


def _give_back() -> None:
    """Return the heap's free memory to the kernel between ops (untimed, both libraries):
    glibc keeps freed 16 MB blocks, 54-170 MB per 2x8 rank after a 16 MB reduce_scatter."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to give back this way
        pass


def _waiting(lib: Any, rank: int, wait_s: float) -> float:
    """CPU seconds this rank spent per second of waiting for a late rank 0 in a barrier."""
    lib.barrier()
    if rank == 0:
        time.sleep(wait_s)
    cpu, wall = time.process_time(), time.monotonic()
    lib.barrier()
    return (time.process_time() - cpu) / max(time.monotonic() - wall, 1e-9)


def _scale_rank(rank: int, world: int, workdir: str, ops: Sequence[str], sizes: Sequence[int],
                rounds: int, round_s: float, wait_s: float,
                gloo_first: bool = False) -> dict[str, Any]:
    import torch
    import torch.distributed as gloo

    import tandem
    from tandem.bench._resources import snapshot
    from tandem.bench.collectives import _measure_one

    import tandem.collectives.api  # noqa: F401 - imported here, not timed as part of init
    import tandem.collectives.barriers  # noqa: F401 - as torch.distributed's barrier is

    torch.set_num_threads(1)
    base = snapshot()
    out: dict[str, Any] = {"start": {}}
    # the library that starts first pays the process's first uses (of torch, of the
    # allocator's pages): --gloo-first swaps the order, to measure that bias
    before: dict[str, Any] = {}
    after: dict[str, Any] = {}
    previous = base
    for name in ("gloo", "tandem") if gloo_first else ("tandem", "gloo"):
        before[name] = previous
        _file_barrier(workdir, name, rank, world)
        out["start"][name] = _start(tandem if name == "tandem" else gloo,
                                    "auto" if name == "tandem" else "gloo",
                                    f"{workdir}/{name}-store", rank, world)
        after[name] = previous = snapshot()
    out["resources"] = {name: after[name].minus(before[name]) for name in ("tandem", "gloo")}
    times = []
    try:
        for op in ops:
            for size in ([0] if op == "barrier" else sizes):
                per_rank = (4 if op == "barrier" else
                            max(4, size // world) if op in ("all_gather", "gather", "scatter")
                            else size)
                got = _measure_one(tandem, gloo, "auto", "barrier" if op == "barrier" else op,
                                   per_rank, rank, world, rounds, round_s, ("tandem", "gloo"))
                times.append({"op": op, "size": size, "times": got["times"]})
                _give_back()
        out["times"] = times
        end = snapshot()
        gloo_local = after["gloo"].local_tcp - before["gloo"].local_tcp
        gloo_remote = after["gloo"].remote_tcp - before["gloo"].remote_tcp
        for key, gloo_set in (("local_tcp", gloo_local), ("remote_tcp", gloo_remote)):
            now: frozenset[int] = getattr(end, key)
            out["resources"]["tandem"][key] = len(now - getattr(base, key) - gloo_set)
            out["resources"]["gloo"][key] = len(gloo_set)
        out["waiting"] = {"tandem": _waiting(tandem, rank, wait_s),
                          "gloo": _waiting(gloo, rank, wait_s)}
    finally:
        tandem.destroy_process_group()
        gloo.destroy_process_group()
    return out


def _store_rank(rank: int, world: int, ports: dict[str, int], order: Sequence[str],
                ops: int) -> dict[str, list[float]]:
    """``ops`` store operations (set and get of this rank's own keys) on each store, in
    ``order``, all ranks starting together; this rank's (start, end) wall-clock times."""
    import torch.distributed as td

    import tandem

    out = {}
    for lib in order:
        timeout = datetime.timedelta(seconds=_OP_TIMEOUT_S)
        store: Any = (tandem.TCPStore("127.0.0.1", ports[lib], world, timeout=timeout)
                      if lib == "tandem" else
                      td.TCPStore("127.0.0.1", ports[lib], world, timeout=timeout))
        store.add("ready", 1)
        store.wait(["go"])
        start = time.time()
        for i in range(ops // 2):
            store.set(f"k{rank}-{i}", b"0123456789abcdef")
            store.get(f"k{rank}-{i}")
        out[lib] = [start, time.time()]
    return out


# ---- in the parent --------------------------------------------------------------------


def store_rate(world: int, ops: int, rounds: int) -> dict[str, float]:
    """Operations per second of ``world`` ranks on tandem's TCPStore and on torch's, each
    served from this process; rounds alternate which store goes first; the best round."""
    import threading

    import torch.distributed as td

    import tandem
    import secrets

    from tandem.testing import spawn

    best = {"tandem": 0.0, "torch": 0.0}
    secret = secrets.token_hex(16)
    for r in range(rounds):
        order = ["tandem", "torch"] if r % 2 == 0 else ["torch", "tandem"]
        timeout = datetime.timedelta(seconds=_OP_TIMEOUT_S)
        servers: dict[str, Any] = {
            "tandem": tandem.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timeout,
                                      wait_for_workers=False, secret=secret),
            "torch": td.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timeout,
                                 wait_for_workers=False)}

        def starter() -> None:  # let every rank go at once, store by store
            for lib in order:
                deadline = time.monotonic() + _OP_TIMEOUT_S
                while servers[lib].add("ready", 0) < world and time.monotonic() < deadline:
                    time.sleep(0.01)  # ranks are connecting: a poll, not a spin
                servers[lib].set("go", b"1")

        thread = threading.Thread(target=starter, daemon=True)
        thread.start()
        try:
            got = spawn(world, _store_rank, ({k: v.port for k, v in servers.items()}, order,
                                             ops), init=False, timeout=_OP_TIMEOUT_S,
                        env={"TANDEM_SECRET": secret})
        finally:
            servers["tandem"].close()
        thread.join(_OP_TIMEOUT_S)
        for lib in best:
            span = max(g[lib][1] for g in got) - min(g[lib][0] for g in got)
            best[lib] = max(best[lib], world * ops / span)
    return best



def _launch(world: int, rounds: int, timeout: float) -> dict[str, float]:
    """Median seconds from launcher start to every rank past its first barrier."""
    from tandem.bench.startup import measure

    samples: dict[str, list[float]] = {"tandem": [], "torch": []}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-scale-") as workdir:
        for i in range(rounds):
            for lib in (("tandem", "torch") if i % 2 == 0 else ("torch", "tandem")):
                samples[lib].append(measure(lib, world, workdir, timeout=timeout)["barrier"])
    return {lib: statistics.median(s) for lib, s in samples.items()}


def _summary(layout: Layout, per_rank: Sequence[dict[str, Any]], rounds: int
             ) -> dict[str, Any]:
    """The layout's figures from every rank's :func:`_scale_rank` result (see the docstring)."""
    libs = ("tandem", "gloo")
    start: dict[str, dict[str, float]] = {}
    for lib in libs:
        t0 = max(r["start"][lib]["start"] for r in per_rank)
        start[lib] = {k: max(r["start"][lib][k] for r in per_rank) - t0
                      for k in ("init", "barrier")}
    res: dict[str, dict[str, float]] = {}
    for lib in libs:
        rows = [r["resources"][lib] for r in per_rank]
        res[lib] = {k: max(x[k] for x in rows) for k in (*_MEASURES, "local_tcp", "remote_tcp")}
        res[lib]["pss_mean_kb"] = statistics.mean(x["pss_kb"] for x in rows)
        res[lib]["own_pss_mean_kb"] = statistics.mean(x["own_pss_kb"] for x in rows)
        per_host = [sum(rows[h * layout.ranks_per_host + i]["remote_tcp"]
                        for i in range(layout.ranks_per_host)) for h in range(layout.hosts)]
        res[lib]["remote_tcp_per_host"] = max(per_host)
    waiting = {lib: statistics.mean(r["waiting"][lib] for r in per_rank[1:]) for lib in libs}
    colls = []
    for i, entry in enumerate(per_rank[0]["times"]):
        best = {lib: min(max(r["times"][i]["times"][lib][k] for r in per_rank)
                         for k in range(rounds)) for lib in libs}
        colls.append({"op": entry["op"], "size": entry["size"], **best})
    return {"layout": str(layout), "hosts": layout.hosts, "ranks_per_host": layout.ranks_per_host,
            "world_size": layout.world_size, "start": start, "resources": res,
            "waiting": waiting, "collectives": colls}


def run_layout(layout: Layout, link: Any, ops: Sequence[str], sizes: Sequence[int],
               rounds: int, round_s: float, wait_s: float, launch_rounds: int,
               timeout: float, cold: bool = False, gloo_first: bool = False) -> dict[str, Any]:
    """Every figure of one layout (launch first, outside the lab, for one-host layouts)."""
    from tandem.bench._resources import memory_cgroup, reset_cgroup_peak
    from tandem.testing.netns import netns_lab

    launch = (_launch(layout.world_size, launch_rounds, timeout)
              if layout.hosts == 1 and launch_rounds > 0 else None)
    reset_cgroup_peak()  # the layout's own peak, in a cgroup made for the run
    with tempfile.TemporaryDirectory(prefix="tandem-bench-scale-") as tmp:
        with netns_lab(layout.hosts, Path(tmp), link) as lab:
            hosts = Hosts(lab, layout)
            per_rank = hosts.run(_scale_rank, (str(lab.workdir), list(ops), list(sizes), rounds,
                                               round_s, wait_s, gloo_first),
                                 timeout=timeout, zygote=not cold)
    summary = _summary(layout, per_rank, rounds)
    # whose start-up came first, as the ranks' clocks tell
    summary["first"] = min(("tandem", "gloo"),
                           key=lambda lib: min(r["start"][lib]["start"] for r in per_rank))
    summary["launch"] = launch
    cgroup = memory_cgroup()
    summary["memory"] = cgroup.describe() if cgroup else ""
    return summary


# ---- failures ------------------------------------------------------------------------

FAILURE_LAYOUTS = "8x8"
SMOKE_FAILURE_LAYOUTS = "2x2"
NAMED_WITHIN_S = 5.0  # a SIGKILLed rank is named by every survivor within this
SUMMARY_LINES = 40  # one screen
SCENARIOS = ("kill", "stall", "skip", "summary")


def _victim(layout: Layout) -> int:
    """A rank on the second host (the first if there is one), neither a host's first rank
    nor the last rank when the layout allows."""
    host = min(1, layout.hosts - 1)
    return host * layout.ranks_per_host + min(1, layout.ranks_per_host - 1)


def _ranks_in(text: str) -> list[int]:
    """``"6, 17, 20-21"`` -> [6, 17, 20, 21]."""
    out: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


def _gist(message: str) -> str:
    """An error's first line, its start and its end (where the cause is said)."""
    first = (message.splitlines() or [""])[0]
    return first if len(first) <= 400 else f"{first[:150]} ... {first[-250:]}"


def _errors(got: dict[int, dict[str, Any]]) -> dict[str, str]:
    """Every rank's error, for the figures file."""
    return {str(r): f"{v['type']}: {v['msg']}" for r, v in sorted(got.items())}


def _failed(outcomes: Sequence[Any], victim: int) -> str:
    """The survivors whose function raised (harness errors), described briefly."""
    bad = [o for o in outcomes if o.rank != victim and not o.ok]
    return "; ".join(f"rank {o.rank}: {o.error_type} {o.error.strip()[-1500:]}" for o in bad[:2])


def _kill_scenario(lab: Any, layout: Layout, tmp: Path, timeout: float) -> dict[str, Any]:
    from tandem.bench import _scale_failures as body
    from tandem.testing import launch

    victim = _victim(layout)
    stamp = tmp / "killed"
    outcomes = launch(layout.world_size, body.killed,
                      (str(tmp / "store-kill"), lab.names, lab.addrs, layout.ranks_per_host,
                       victim, str(stamp), 60.0), init=False, timeout=timeout)
    broken = _failed(outcomes, victim)
    if broken or not stamp.exists():
        return {"held": False, "time_s": None, "named": f"rank {victim} killed",
                "detail": broken or "the victim did not die"}
    killed_at = float(stamp.read_text())
    got = {o.rank: o.value for o in outcomes if o.rank != victim}
    wrong = sorted(r for r, v in got.items()
                   if v["type"] != "PeerLostError" or f"rank {victim}" not in v["msg"])
    took = {r: v["at"] - killed_at for r, v in got.items()}
    slowest = max(took.values())
    late = sorted(r for r, t in took.items() if t > NAMED_WITHIN_S)
    first = got[min(got)]
    detail = [f"{len(got) - len(wrong)} of {len(got)} survivors named rank {victim} "
              f"(PeerLostError)"]
    if wrong:
        detail.append(f"not: ranks {wrong[:8]}: {got[wrong[0]]['type']}: "
                      f"{_gist(got[wrong[0]]['msg'])}")
    if late:
        detail.append(f"after {NAMED_WITHIN_S:.0f} s: ranks {late[:8]}")
    return {"held": not wrong and not late, "time_s": slowest, "errors": _errors(got),
            "named": f"{first['type']}: {first['msg'].splitlines()[0][:160]}",
            "detail": "; ".join(detail)}


def _stall_scenario(lab: Any, layout: Layout, tmp: Path, timeout: float, stall_s: float,
                    op_s: float) -> dict[str, Any]:
    import re

    from tandem.bench import _scale_failures as body
    from tandem.testing import launch

    victim = _victim(layout)
    outcomes = launch(layout.world_size, body.stalled,
                      (str(tmp / "store-stall"), lab.names, lab.addrs, layout.ranks_per_host,
                       victim, op_s), init=False, timeout=timeout,
                      env={"TANDEM_STALL_WARN": str(stall_s)})
    broken = _failed(outcomes, victim)
    if broken:
        return {"held": False, "time_s": None, "named": "", "detail": broken}
    # reports of the stalled call only (the first call may be reported while ranks join)
    reports = {o.rank: [(t, m) for t, m in o.value if "all_reduce #1 " in m]
               for o in outcomes if o.rank != victim}
    silent = sorted(r for r, v in reports.items() if not v)
    wrong: dict[int, list[int]] = {}
    firsts: list[float] = []
    sample = ""
    for rank, values in reports.items():
        if not values:
            continue
        took, first = values[0]
        firsts.append(took)
        named = [r for line in re.findall(r"^  ranks? ([\d, -]+) ha(?:s|ve) not arrived",
                                          first, re.MULTILINE) for r in _ranks_in(line)]
        if named != [victim]:
            wrong[rank] = named
        sample = sample or next((line.strip() for line in first.splitlines()
                                 if "not arrived" in line), "")
    detail = [f"{len(reports) - len(silent) - len(wrong)} of {len(reports)} survivors' first "
              f"report named rank {victim} alone"]
    if silent:
        detail.append(f"no report within {op_s:.0f} s: ranks {silent[:8]}")
    if wrong:
        r = min(wrong)
        detail.append(f"named others: {len(wrong)} ranks, e.g. rank {r} named {wrong[r][:10]}")
    return {"held": not silent and not wrong, "time_s": max(firsts) if firsts else None,
            "named": sample[:160], "detail": "; ".join(detail)}


def _skip_scenario(lab: Any, layout: Layout, tmp: Path, timeout: float,
                   op_s: float) -> dict[str, Any]:
    from tandem.bench import _scale_failures as body
    from tandem.testing import launch

    victim = _victim(layout)
    outcomes = launch(layout.world_size, body.skipped,
                      (str(tmp / "store-skip"), lab.names, lab.addrs, layout.ranks_per_host,
                       victim, op_s), init=False, timeout=timeout)
    broken = _failed(outcomes, -1)  # the victim too returns its error
    if broken:
        return {"held": False, "time_s": None, "named": "", "detail": broken}
    here = Path(body.__file__).name
    skip_site, call_site = f"{here}:{body.SKIP_LINE}", f"{here}:{body.CALL_LINE}"
    got = {o.rank: o.value for o in outcomes}
    # the victim must be told where the others were; everyone else where the victim was
    want = {r: (call_site if r == victim else skip_site) for r in got}
    named = sorted(r for r, v in got.items() if want[r] in v["msg"] and
                   (r == victim or f"rank {victim}" in v["msg"]))
    missed = sorted(set(got) - set(named))
    detail = [f"{len(named)} of {len(got)} ranks' errors named rank {victim} at {skip_site} "
              f"(the victim: the others' {call_site})"]
    if missed:
        r = missed[0]
        detail.append(f"not: {len(missed)} ranks ({missed[:8]}), e.g. rank {r}: "
                      f"{got[r]['type']}: {_gist(got[r]['msg'])}")
    sample = got[min(r for r in got if r != victim)]
    return {"held": not missed, "time_s": max(v["took"] for v in got.values()),
            "errors": _errors(got),
            "named": f"{sample['type']}: {sample['msg'].splitlines()[0][:200]}" if sample["msg"]
            else "no error", "detail": "; ".join(detail)}


def _summary_scenario(lab: Any, layout: Layout, tmp: Path, timeout: float) -> dict[str, Any]:
    import secrets

    from tandem.bench import _scale_failures as body
    from tandem.run.rootcause import RULE

    victim = _victim(layout)
    secret = secrets.token_hex(16)

    def args(node: int) -> list[str]:
        # a fixed port is safe: the lab's namespaces are private
        return ["--nnodes", str(layout.hosts), "--nproc-per-node", str(layout.ranks_per_host),
                "--node-rank", str(node), "--master-addr", lab.addrs[0],
                "--master-port", "29611", str(Path(body.__file__)), str(victim), "100000"]

    def env(node: int) -> dict[str, str]:
        return {"TANDEM_SECRET": secret, "TANDEM_HOST_ID": f"labhost{node}",
                "TANDEM_BIND_ADDR": lab.addrs[node], "TANDEM_TIMEOUT": "120",
                "TANDEM_TRACE_DIR": str(tmp / "trace"), "OMP_NUM_THREADS": "1"}

    began = time.monotonic()
    runs = lab.run(["-m", "tandem.run"], list(range(layout.hosts)), args, env,
                   timeout=timeout, grace=60.0)
    took = time.monotonic() - began
    summaries = []
    for run in runs:
        parts = run.log.split(RULE)
        if len(parts) >= 3:
            summaries.append((run.host, RULE + parts[-2] + RULE))
    if not summaries:
        tail = runs[0].log.strip().splitlines()[-5:]
        return {"held": False, "time_s": took, "lines": None, "named": "",
                "detail": f"no summary printed; node 0 ended {runs[0].returncode}: {tail}"}
    lines = max(len(text.splitlines()) for _, text in summaries)
    want = f"  rank       : {victim} "
    right = [h for h, text in summaries if want in text]
    text = summaries[0][1]
    root = next((line.strip() for line in text.splitlines() if line.startswith("  rank ")), "")
    detail = (f"{len(summaries)} of {layout.hosts} agents printed a summary; "
              f"{len(right)} named rank {victim}")
    return {"held": len(right) == len(summaries) and lines <= SUMMARY_LINES, "time_s": took,
            "lines": lines, "named": root, "detail": detail, "text": text}


def run_failures(layout: Layout, timeout: float, stall_s: float, op_s: float,
                 scenarios: Sequence[str] = SCENARIOS) -> dict[str, Any]:
    """The failure scenarios on ``layout`` (see the module docstring), one after another."""
    from tandem.testing.netns import netns_lab

    out: dict[str, Any] = {"layout": str(layout), "world_size": layout.world_size,
                           "victim": _victim(layout), "scenarios": {}}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-fail-") as tmp:
        with netns_lab(layout.hosts, Path(tmp)) as lab:
            for name in scenarios:
                work = Path(tmp) / name
                work.mkdir()
                t = time.monotonic()
                if name == "kill":
                    got = _kill_scenario(lab, layout, work, timeout)
                elif name == "stall":
                    got = _stall_scenario(lab, layout, work, timeout, stall_s, op_s)
                elif name == "skip":
                    got = _skip_scenario(lab, layout, work, timeout, op_s)
                else:
                    got = _summary_scenario(lab, layout, work, timeout)
                got["wall_s"] = time.monotonic() - t
                out["scenarios"][name] = got
                print(f"{layout} {name}: {'held' if got['held'] else 'NOT held'} "
                      f"({got['wall_s']:.0f} s): {got['detail']}", flush=True)
    return out


_TARGETS = {"kill": f"every survivor names the killed rank within {NAMED_WITHIN_S:.0f} s",
            "stall": "every survivor's first stall report names the stopped rank alone",
            "skip": "every rank's error names the skipping rank and its file:line",
            "summary": f"tandemrun's summary names the failing rank in <= {SUMMARY_LINES} lines"}


def format_failures(results: Sequence[dict[str, Any]], stall_s: float) -> str:
    """One markdown table per run: scenario, target, held, time, summary lines, named."""
    rows = []
    for r in results:
        for name, got in r["scenarios"].items():
            took = got.get("time_s")
            when = "-" if took is None else f"{took:.1f}"
            lines = got.get("lines")
            named = str(got.get("named", "")).replace("|", "\\|")
            rows.append([r["layout"], name, _TARGETS[name], "yes" if got["held"] else "**no**",
                         when, "-" if lines is None else str(lines), named])
    head = ("Failures (victim: a rank of the second host; time: kill: the slowest survivor's "
            f"error after the kill; stall: the latest first report, stall warning at "
            f"{stall_s:g} s; skip: the slowest rank's error; summary: the whole tandemrun job)")
    return "\n".join([head, "", _md(["layout", "scenario", "target", "held", "time s",
                                     "summary lines", "named (first survivor / agent)"], rows)])


def _own(res: dict[str, float], key: str) -> float:
    """A library's own memory (``own_*``: no code pages); runs before it had totals only."""
    return res.get(f"own_{key}", res[key])


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def _md(head: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in body])


def format_tables(results: Sequence[dict[str, Any]]) -> str:
    """Markdown tables: start-up, resources per rank, connections, waiting, collectives."""
    start = []
    for r in results:
        t, g, la = r["start"]["tandem"], r["start"]["gloo"], r["launch"]
        launch = ([f"{la['tandem']:.2f}", f"{la['torch']:.2f}", _ratio(la["tandem"], la["torch"])]
                  if la else ["-", "-", "-"])
        start.append([r["layout"], *launch, f"{t['init']:.2f}", f"{g['init']:.2f}",
                      _ratio(t["init"], g["init"]), f"{t['barrier']:.2f}",
                      f"{g['barrier']:.2f}", _ratio(t["barrier"], g["barrier"])])
    out = ["Start-up, seconds (ratio = tandem / gloo; launch: tandemrun vs torchrun + gloo, "
           "one host only)", "",
           _md(["layout", "launch tandem", "launch gloo", "ratio", "init tandem", "init gloo",
                "ratio", "init+barrier tandem", "init+barrier gloo", "ratio"], start)]
    res = []
    for r in results:
        t, g = r["resources"]["tandem"], r["resources"]["gloo"]
        res.append([r["layout"], *(f"{_own(t, k) / 1024:.1f} / {_own(g, k) / 1024:.1f}"
                                   for k in ("rss_kb", "pss_kb", "pss_mean_kb")),
                    f"{t['fds']} / {g['fds']}", f"{t['threads']} / {g['threads']}",
                    f"{t['shm_maps']} / {g['shm_maps']}"])
    out += ["", "Resources per rank, the most any rank added (tandem / gloo; RSS and PSS: "
            "anonymous and shared memory, code pages left out; PSS mean: averaged over "
            "ranks)", "",
            _md(["layout", "RSS MB", "PSS MB", "PSS mean MB", "fds", "threads", "shm mappings"],
                res)]
    conn = []
    for r in results:
        t, g = r["resources"]["tandem"], r["resources"]["gloo"]
        h, per = r["hosts"], r["ranks_per_host"]
        conn.append([r["layout"], f"{t['local_tcp']} / {g['local_tcp']}",
                     f"{t['remote_tcp']} / {g['remote_tcp']}",
                     f"{t['remote_tcp_per_host']} / {g['remote_tcp_per_host']}",
                     f"{(h - 1) * per * per}", f"{2 * (h - 1)}",
                     f"{r['waiting']['tandem']:.2f} / {r['waiting']['gloo']:.2f}"])
    out += ["", "TCP connections (tandem / gloo; same host: per rank; across hosts: per rank "
            "and per host), against a full mesh's (H-1)*R*R per host and the O(hosts) target "
            "2*(H-1); CPU seconds per second spent waiting in a barrier", "",
            _md(["layout", "same host /rank", "across /rank", "across /host",
                 "mesh (H-1)R^2", "target 2(H-1)", "CPU waiting"], conn)]
    keys = sorted({(c["op"], c["size"]) for r in results for c in r["collectives"]},
                  key=lambda k: ((OPS + MORE_OPS).index(k[0]), k[1]))
    coll = []
    for op, size in keys:
        cells = []
        for r in results:
            c = next((c for c in r["collectives"] if (c["op"], c["size"]) == (op, size)), None)
            cells.append(f"{_ratio(c['gloo'], c['tandem'])} ({_fmt_time(c['tandem'])} vs "
                         f"{_fmt_time(c['gloo'])})" if c else "-")
        coll.append([op, "-" if op == "barrier" else _fmt_size(size), *cells])
    out += ["", "Collectives: speed-up = gloo time / tandem time (above 1, tandem is faster), "
            "then tandem's and gloo's time per op", "",
            _md(["op", "size", *[r["layout"] for r in results]], coll)]
    return "\n".join(out)


def plot(results: Sequence[dict[str, Any]], path: Path) -> None:
    """Time (or the resource) against ranks, one panel per measure; tandem solid, gloo dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = sorted(results, key=lambda r: (r["world_size"], r["hosts"]))
    labels = [f"{r['world_size']}\n({r['layout']})" for r in rs]
    x = list(range(len(rs)))
    panels: list[tuple[str, list[tuple[str, list[float]]]]] = [
        ("init + first barrier, s", [(lib, [r["start"][lib]["barrier"] for r in rs])
                                     for lib in ("tandem", "gloo")]),
        ("PSS added per rank, MB", [(lib, [_own(r["resources"][lib], "pss_kb") / 1024
                                           for r in rs]) for lib in ("tandem", "gloo")]),
        ("fds added per rank", [(lib, [r["resources"][lib]["fds"] for r in rs])
                                for lib in ("tandem", "gloo")]),
        ("threads added per rank", [(lib, [r["resources"][lib]["threads"] for r in rs])
                                    for lib in ("tandem", "gloo")]),
        ("TCP across hosts per host", [(lib, [r["resources"][lib]["remote_tcp_per_host"]
                                              for r in rs]) for lib in ("tandem", "gloo")]),
        ("CPU s per s waiting", [(lib, [r["waiting"][lib] for r in rs])
                                 for lib in ("tandem", "gloo")]),
    ]
    launched = [r for r in rs if r["launch"]]
    keys = sorted({(c["op"], c["size"]) for r in rs for c in r["collectives"]},
                  key=lambda k: ((OPS + MORE_OPS).index(k[0]), k[1]))
    for op, size in keys:
        title = op if op == "barrier" else f"{op} {_fmt_size(size)}"
        series = []
        for lib in ("tandem", "gloo"):
            series.append((lib, [next((c[lib] * 1e3 for c in r["collectives"]
                                       if (c["op"], c["size"]) == (op, size)), float("nan"))
                                 for r in rs]))
        panels.append((f"{title}, ms", series))
    extra = 1 if launched else 0
    cols = 4
    rows = (len(panels) + extra + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    flat = list(axes.flat)
    if launched:
        ax = flat.pop(0)
        lx = [rs.index(r) for r in launched]
        ax.plot(lx, [r["launch"]["tandem"] for r in launched], "o-", label="tandemrun")
        ax.plot(lx, [r["launch"]["torch"] for r in launched], "s--", label="torchrun+gloo")
        ax.set_title("launch to first barrier, s")
        ax.set_xticks(x, labels, fontsize=7)
        ax.legend(fontsize=7)
    for ax, (title, series) in zip(flat, panels):
        for lib, ys in series:
            ax.plot(x, ys, "o-" if lib == "tandem" else "s--", label=lib)
        ax.set_title(title, fontsize=9)
        ax.set_xticks(x, labels, fontsize=7)
        ax.legend(fontsize=7)
    for ax in flat[len(panels):]:
        ax.axis("off")
    fig.suptitle("tandem vs gloo against ranks (x: world size, hosts x ranks per host)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _failures_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from tandem.bench.collectives import machine
    from tandem.testing.netns import Unavailable

    default = args.layouts == DEFAULT_LAYOUTS
    text = SMOKE_FAILURE_LAYOUTS if args.smoke else FAILURE_LAYOUTS if default else args.layouts
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    try:
        layouts = parse_scale_layouts(text)
    except ValueError as exc:
        parser.error(str(exc))
    if not scenarios or set(scenarios) - set(SCENARIOS):
        parser.error(f"--scenarios: unknown {sorted(set(scenarios) - set(SCENARIOS)) or scenarios}"
                     f"; choose from {list(SCENARIOS)}")
    if not 0 < args.stall_warn < args.op_timeout:
        parser.error(f"need 0 < --stall-warn ({args.stall_warn}) < --op-timeout "
                     f"({args.op_timeout}): the stall report must come before the deadline")
    print(f"machine: {machine()}", flush=True)
    results = []
    try:
        for layout in layouts:
            # per scenario: a scenario that hangs is a finding, not a reason to wait 30 min
            results.append(run_failures(layout, min(args.timeout, 600.0), args.stall_warn,
                                        args.op_timeout, scenarios))
    except Unavailable as exc:
        print(f"simulated hosts are unavailable here: {exc}")
        return 1
    text = format_failures(results, args.stall_warn)
    print(f"{text}\nload average {os.getloadavg()[0]:.0f}")
    for r in results:
        summary = r["scenarios"].get("summary", {}).get("text")
        if summary:
            print(f"\ntandemrun's summary at {r['layout']}:\n{summary}")
    if args.out:
        out = Path(args.out)
        out.write_text(text + "\n")
        out.with_suffix(".json").write_text(json.dumps(results, indent=1))
        print(f"wrote {out} and {out.with_suffix('.json')}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from tandem.bench.collectives import machine, parse_sizes
    from tandem.testing.links import LinkShape
    from tandem.testing.netns import Unavailable

    parser = argparse.ArgumentParser(prog="python -m tandem.bench scale",
                                     description="tandem vs gloo from 8 to 64 ranks on "
                                                 "simulated hosts (root).")
    parser.add_argument("--layouts", default=DEFAULT_LAYOUTS,
                        help=f"HOSTSxRANKS comma list (default {DEFAULT_LAYOUTS})")
    parser.add_argument("--link", default="", help="every host's link, RATE[:DELAY[:LOSS]], "
                        "e.g. 1gbit:0.2ms (default unshaped)")
    parser.add_argument("--ops", default=",".join(OPS), help="comma list (default all)")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"default {DEFAULT_SIZES}")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per op (default 3)")
    parser.add_argument("--round-ms", type=float, default=100.0, help="default 100")
    parser.add_argument("--wait", type=float, default=1.0,
                        help="seconds rank 0 keeps the others waiting (default 1)")
    parser.add_argument("--launch-rounds", type=int, default=1,
                        help="tandemrun/torchrun launches per one-host layout (default 1; 0: none)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="per layout, seconds")
    parser.add_argument("--out", default="",
                        help="write the tables to OUT (markdown), the plot to OUT's .png and "
                             "the figures to its .json")
    parser.add_argument("--store", type=int, default=0, metavar="RANKS",
                        help="measure only the store: RANKS ranks (harness processes on this "
                             "host) each doing --store-ops operations on tandem's TCPStore "
                             "and on torch's")
    parser.add_argument("--store-ops", type=int, default=1000, help="per rank (default 1000)")
    parser.add_argument("--render", default="", metavar="JSON[,JSON]",
                        help="measure nothing: print (and --out) the tables and plot of "
                             "figures saved by earlier runs' --out, one file per run")
    parser.add_argument("--failures", action="store_true",
                        help=f"measure only failure handling: {', '.join(SCENARIOS)} on "
                             f"--layouts (default {FAILURE_LAYOUTS}; --smoke: "
                             f"{SMOKE_FAILURE_LAYOUTS})")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"with --failures: comma list (default all of {','.join(SCENARIOS)})")
    parser.add_argument("--stall-warn", type=float, default=2.0,
                        help="with --failures: TANDEM_STALL_WARN of the stall scenario (default 2)")
    parser.add_argument("--op-timeout", type=float, default=30.0,
                        help="with --failures: the collectives' deadline in the stall and skip "
                             "scenarios (default 30 s)")
    parser.add_argument("--gloo-first", action="store_true",
                        help="start gloo's process group first (default tandem's): the first "
                             "pays the process's first uses")
    parser.add_argument("--cold", action="store_true",
                        help="every rank a new interpreter importing torch itself, as before "
                             "the per-host zygotes (for comparison; 8x8 needs ~14 GB then)")
    parser.add_argument("--smoke", action="store_true",
                        help=f"layouts {SMOKE_LAYOUTS}, 4 KB, one short round: a quick check")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.failures:
        return _failures_main(parser, args)
    try:
        layouts = parse_scale_layouts(SMOKE_LAYOUTS if args.smoke else args.layouts)
        link = LinkShape.parse(args.link) if args.link else LinkShape()
        sizes = parse_sizes("4K" if args.smoke else args.sizes)
    except ValueError as exc:
        parser.error(str(exc))
    ops = pick(parser, "--ops", args.ops, OPS + MORE_OPS)
    if args.rounds < 1 or args.round_ms <= 0 or args.wait <= 0 or args.launch_rounds < 0:
        parser.error("need --rounds >= 1, --round-ms > 0, --wait > 0, --launch-rounds >= 0")
    rounds, round_s, wait_s = args.rounds, args.round_ms / 1e3, args.wait
    if args.smoke:
        rounds, round_s, wait_s = 1, 0.01, 0.3
    if args.store:
        if args.store < 2 or args.store_ops < 2:
            parser.error("need --store >= 2 ranks and --store-ops >= 2")
        rate = store_rate(args.store, args.store_ops, max(2, args.rounds))
        print(f"store: {args.store} ranks x {args.store_ops} operations (set + get), best of "
              f"{max(2, args.rounds)} rounds: tandem TCPStore {rate['tandem']:.0f} ops/s, "
              f"torch TCPStore {rate['torch']:.0f} ops/s, ratio tandem/torch "
              f"{rate['tandem'] / rate['torch']:.2f}")
        return 0
    if args.render:
        results = [r for name in args.render.split(",") if name.strip()
                   for r in json.loads(Path(name.strip()).read_text())]
        text = format_tables(results)
    else:
        print(f"machine: {machine()}", flush=True)
        results = []
        began = time.monotonic()
        try:
            for layout in layouts:
                t = time.monotonic()
                results.append(run_layout(layout, link, ops, sizes, rounds, round_s, wait_s,
                                          args.launch_rounds, args.timeout, args.cold,
                                          args.gloo_first))
                print(f"{layout}: {time.monotonic() - t:.0f} s, load average "
                      f"{os.getloadavg()[0]:.0f}; {results[-1]['memory']}", flush=True)
        except Unavailable as exc:
            print(f"simulated hosts are unavailable here: {exc}")
            return 1
        text = (f"tandem 'auto' vs torch.distributed 'gloo' on simulated hosts, links "
                f"{link}; {'gloo' if args.gloo_first else 'tandem'} started first; "
                f"float32, 1 thread/rank; best of {rounds} rounds of "
                f"~{round_s * 1e3:.0f} ms; {time.monotonic() - began:.0f} s\n\n"
                + format_tables(results))
    print(text)
    if args.out:
        out = Path(args.out)
        out.write_text(text + "\n")
        out.with_suffix(".json").write_text(json.dumps(results, indent=1))
        plot(results, out.with_suffix(".png"))
        print(f"wrote {out}, {out.with_suffix('.png')} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
