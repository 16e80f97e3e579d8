"""Job start-up time: tandemrun + tandem against torchrun + gloo.

Run::

    python -m tandem.bench startup                      # 2 and 4 ranks, 3 rounds each
    python -m tandem.bench startup --world-sizes 2 --rounds 5 --markdown
    python -m tandem.bench startup --quick              # 2 ranks, 1 round: what a smoke test runs
    python -m tandem.bench startup --ranks 16,32 --rounds 1 --baseline /tmp/old  # before/after
    python -m tandem.bench startup --layouts 2x8,8x8 --rounds 1   # as root: simulated hosts

How it measures. Each round launches a tiny script with ``--standalone
--nproc-per-node N``: ``python -m tandem.run`` whose workers call
``tandem.init_process_group()``, and ``python -m torch.distributed.run`` whose
workers call ``torch.distributed.init_process_group("gloo")``; both over env://.
Every worker notes the wall-clock time when its script starts, when ``import torch``
and the library are done, and when ``init_process_group`` returned. The columns are,
from the moment the launcher process is started:

    script  the last rank's script starts          (launcher start-up + spawning)
    init    the last rank returned from init
    barrier the last rank finished its first barrier (the whole launch: ratio (barrier))
    exit    the launcher exited (workers destroyed their groups and left)

and, counted from the moment the last rank finished importing (torch and the whole
library: tandem's modules load on first use, so the worker touches
``init_process_group`` first), ``init+barrier``: the last rank's first ``barrier``
returned. ``--baseline PATH`` also measures the tandem found at PATH (a checkout of an
earlier commit, put first on ``PYTHONPATH``) in the same rounds, for before/after tables.

``--layouts HxR,...`` launches across ``H`` simulated hosts (``tandem.testing.netns``,
needs root) with ``R`` ranks each, one launcher per host as on a cluster: ``tandemrun
--nnodes H --node-rank h`` against ``torchrun --nnodes H --node-rank h``, static
rendezvous at host 0's address, every launcher started at once; the times count from
then to the last rank of any host. Each host has its own ``TANDEM_HOST_ID`` and
``TANDEM_BIND_ADDR`` (tandem: shared memory within a host, TCP across) and
``GLOO_SOCKET_IFNAME=eth0``.

``PSS MB``: the ranks' memory after their first barrier, the sum of each rank's PSS
(proportional set size: pages it shares counted in part). Workers forked from the
zygote share its pages (torch's and tandem's modules) until they write them; the
zygote's own share is not counted.

Rounds alternate between the two launchers so both see the same machine noise; the
table shows the median round. ratio = torchrun init / tandemrun init: above 1 means
tandem's job is ready sooner. Both launchers import torch themselves (``import
tandem`` imports torch), which dominates on a slow disk.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from tandem.bench._hosts import Hosts, Layout, Unavailable, parse_layouts, simulated_hosts
from tandem.testing.links import LinkShape

__all__ = ["main", "measure", "render"]

WORKER = '''\
import json, os, sys, time
start = time.time()
import torch
lib = sys.argv[1]
if lib == "tandem":
    import tandem as dist
    backend = None
else:
    import torch.distributed as dist
    backend = "gloo"
dist.init_process_group, dist.barrier  # tandem's modules load on first use
imported = time.time()
dist.init_process_group(backend)
ready = time.time()
dist.barrier()
barrier = time.time()
pss = 0
with open("/proc/self/smaps_rollup") as f:  # this rank's share of the memory it maps
    for line in f:
        if line.startswith("Pss:"):
            pss = int(line.split()[1]) * 1024
with open(os.path.join(sys.argv[2], "rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump({"start": start, "imported": imported, "ready": ready, "barrier": barrier,
               "pss": pss}, f)
dist.destroy_process_group()
'''

LAUNCHERS = {"tandem": ["-m", "tandem.run"], "torch": ["-m", "torch.distributed.run"]}
COLUMNS = ("script", "init", "barrier", "exit", "import", "init+barrier", "pss")
NAMES = {"tandem": "tandemrun+tandem", "baseline": "tandemrun+tandem (baseline)",
         "torch": "torchrun+gloo"}


def measure(lib: str, world_size: int, workdir: str, timeout: float = 300.0,
            baseline: str | None = None) -> dict[str, float]:
    """One launch; seconds from launcher start to each milestone (see the module docstring).

    ``lib`` "baseline" runs tandem with ``baseline`` first on ``PYTHONPATH``."""
    script = os.path.join(workdir, "startup_worker.py")
    if not os.path.exists(script):
        with open(script, "w") as f:
            f.write(WORKER)
    out = tempfile.mkdtemp(dir=workdir)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC"))}
    if lib == "baseline":
        assert baseline is not None
        env["PYTHONPATH"] = os.pathsep.join(p for p in (baseline, env.get("PYTHONPATH")) if p)
    name = "torch" if lib == "torch" else "tandem"
    cmd = [sys.executable, *LAUNCHERS[name], "--standalone", "--nproc-per-node",
           str(world_size), script, name, out]
    t0 = time.time()
    # run outside any source tree: "-m" puts the working directory first on sys.path
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=workdir)
    t_exit = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"{lib} launch failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return _milestones(out, world_size, t0, t_exit)


def _milestones(out: str, world_size: int, t0: float, t_exit: float) -> dict[str, float]:
    """The columns of one launch, from the ranks' notes in ``out``."""
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world_size)]
    return {"script": max(r["start"] for r in ranks) - t0,
            "import": max(r["imported"] - r["start"] for r in ranks),
            "init": max(r["ready"] for r in ranks) - t0,
            "barrier": max(r["barrier"] for r in ranks) - t0,
            "exit": t_exit - t0,
            "init+barrier": max(r["barrier"] for r in ranks) - max(r["imported"] for r in ranks),
            "pss": sum(r.get("pss", 0) for r in ranks) / 2**20}


def measure_hosts(lib: str, hosts: Hosts, workdir: str, port: int,
                  timeout: float = 600.0) -> dict[str, float]:
    """One launch across simulated hosts: a launcher per host (see the module docstring)."""
    script = os.path.join(workdir, "startup_worker.py")
    if not os.path.exists(script):
        with open(script, "w") as f:
            f.write(WORKER)
    out = tempfile.mkdtemp(dir=workdir)
    layout, lab = hosts.layout, hosts.lab
    secret = secrets.token_hex(16)

    def args(host: int) -> list[str]:
        return [*LAUNCHERS[lib], "--nnodes", str(layout.hosts), "--node-rank", str(host),
                "--nproc-per-node", str(layout.ranks_per_host), "--master-addr",
                lab.addrs[0], "--master-port", str(port), script, lib, out]

    def env(host: int) -> dict[str, str]:
        return {"TANDEM_SECRET": secret, "TANDEM_HOST_ID": f"labhost{host}",
                "TANDEM_BIND_ADDR": lab.addrs[host], "GLOO_SOCKET_IFNAME": "eth0"}

    t0 = time.time()
    runs = lab.run([], list(range(layout.hosts)), args, env, timeout=timeout, grace=30.0)
    t_exit = time.time()
    failed = [r for r in runs if not r.ok]
    if failed:
        raise RuntimeError(f"{lib} launch on {layout} hosts failed on host "
                           f"{failed[0].host} ({failed[0].returncode}):\n{failed[0].log[-3000:]}")
    return _milestones(out, layout.world_size, t0, t_exit)


def run_hosts(layouts: Sequence[Layout], rounds: int) -> list[dict[str, object]]:
    """The rows of ``--layouts``: each layout in a lab of its own, launchers alternating."""
    rows: list[dict[str, object]] = []
    for layout in layouts:
        with simulated_hosts(layout, LinkShape()) as hosts:
            workdir = str(hosts.workdir)
            samples: dict[str, list[dict[str, float]]] = {"tandem": [], "torch": []}
            for i in range(rounds):
                for lib in ("tandem", "torch") if i % 2 == 0 else ("torch", "tandem"):
                    port = 20000 + secrets.randbelow(20000)  # in the lab's own namespaces
                    samples[lib].append(measure_hosts(lib, hosts, workdir, port))
            med = {lib: {c: statistics.median(s[c] for s in samples[lib]) for c in COLUMNS}
                   for lib in samples}
            rows.append({"world_size": str(layout), **med})
    return rows


def run(world_sizes: Sequence[int], rounds: int,
        baseline: str | None = None) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    libs = ("tandem", "torch") + (("baseline",) if baseline else ())
    with tempfile.TemporaryDirectory(prefix="tandem-bench-startup-") as workdir:
        for n in world_sizes:
            samples: dict[str, list[dict[str, float]]] = {lib: [] for lib in libs}
            for i in range(rounds):
                order = libs if i % 2 == 0 else libs[::-1]
                for lib in order:
                    samples[lib].append(measure(lib, n, workdir, baseline=baseline))
            med = {lib: {c: statistics.median(s[c] for s in samples[lib])
                         for c in COLUMNS} for lib in samples}
            rows.append({"world_size": n, **med})
    return rows


def format_table(rows: Sequence[dict[str, object]], markdown: bool = False) -> str:
    head = ["ranks", "launcher", "script s", "import s", "init s", "barrier s", "exit s",
            "ratio (init)", "init+barrier s", "ratio (init+barrier)", "ratio (barrier)",
            "ratio (exit)", "PSS MB"]
    body = []
    for row in rows:
        g = row["torch"]
        assert isinstance(g, dict)
        for lib in ("tandem", "baseline", "torch"):
            m = row.get(lib)
            if not isinstance(m, dict):
                continue
            ratios = ([f"{g['init'] / m['init']:.2f}", f"{m['init+barrier']:.2f}",
                       f"{g['init+barrier'] / m['init+barrier']:.2f}",
                       f"{m['barrier'] / g['barrier']:.2f}",
                       f"{m['exit'] / g['exit']:.2f}"] if lib != "torch"
                      else ["", f"{m['init+barrier']:.2f}", "", "", ""])
            body.append([str(row["world_size"]), NAMES[lib], f"{m['script']:.2f}",
                         f"{m['import']:.2f}", f"{m['init']:.2f}", f"{m['barrier']:.2f}",
                         f"{m['exit']:.2f}", *ratios, f"{m['pss']:.0f}"])
    return render(head, body, markdown)


def render(head: Sequence[str], body: Sequence[Sequence[str]], markdown: bool) -> str:
    """A table of text cells: markdown, or columns aligned right."""
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in body])
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(x.rjust(w) for x, w in zip(r, widths)) for r in [head, *body])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench startup",
                                     description="Launch-to-ready time: tandemrun vs torchrun.")
    parser.add_argument("--world-sizes", "--ranks", default="2,4",
                        help="comma-separated rank counts (default 2,4)")
    parser.add_argument("--rounds", type=int, default=3, help="launches per library (default 3)")
    parser.add_argument("--layouts", default="",
                        help="HOSTSxRANKS,...: launch across simulated hosts, one launcher "
                             "per host (needs root), instead of --ranks on this host")
    parser.add_argument("--quick", action="store_true", help="2 ranks, 1 round")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--baseline", metavar="PATH",
                        help="also measure the tandem package found in PATH (e.g. an earlier "
                             "commit's tree from git archive), in the same rounds")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    sizes = [2] if args.quick else [int(x) for x in args.world_sizes.split(",") if x]
    rounds = 1 if args.quick else max(1, args.rounds)
    start = time.monotonic()
    if args.baseline and not os.path.isfile(os.path.join(args.baseline, "tandem",
                                                          "__init__.py")):
        parser.error(f"--baseline {args.baseline}: no tandem package there (expected "
                     f"{os.path.join(args.baseline, 'tandem', '__init__.py')})")
    if args.layouts:
        if args.baseline:
            parser.error("--baseline measures one host only; drop it or --layouts")
        try:
            layouts = parse_layouts(args.layouts)
        except ValueError as exc:
            parser.error(f"--layouts: {exc}")
        try:
            rows = run_hosts(layouts, rounds)
        except Unavailable as exc:
            print(f"# startup --layouts: simulated hosts unavailable: {exc}")
            return 1
    else:
        rows = run(sizes, rounds, args.baseline)
    print(f"# startup: median of {rounds} round(s), {os.cpu_count()} CPUs; seconds from "
          f"launcher start (init+barrier: from the last rank's imports); ratio (init), "
          f"ratio (init+barrier) = gloo's / tandem's (>1: tandem ready sooner); ratio "
          f"(barrier), ratio (exit) = tandemrun's launch to the first barrier done, to its "
          f"exit / torchrun's (<1: tandem sooner); PSS MB: the ranks' memory after the barrier; "
          f"{time.monotonic() - start:.0f} s")
    print(format_table(rows, markdown=args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
