"""all_reduce over tandem tcp, tandem shm and torch gloo, side by side in the same processes.

Run (about a minute on 2 cores)::

    .venv/bin/python tests/shm/bench_allreduce.py                  # 2 ranks, 4K,1M,64M
    .venv/bin/python tests/shm/bench_allreduce.py --ranks 4 --sizes 4K,64M

Each rank builds three process groups at once: tandem over a TcpTransport, tandem
over a ShmTransport (both made by the backend registry, on separate store
prefixes) and gloo; one torch thread per rank. Per size every library first runs
once on known values (checked), then rounds alternate between the libraries so
they see the same machine noise; a round is a gloo barrier plus ``iters`` ops, its
time the slowest rank's; the table shows the best round. Bus bandwidth follows
nccl-tests: size / time * 2(p-1)/p. Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from typing import Any

import torch

LIBS = ("tcp", "shm", "gloo")


def _rank(rank: int, p: int, tmp: str, sizes: list[int], rounds: int, round_s: float) -> Any:
    torch.set_num_threads(1)
    import torch.distributed as tdist

    from tandem.collectives.api import all_reduce
    from tandem.collectives.backend import Backend, BackendOptions
    from tandem.collectives.group import ProcessGroup
    from tandem.config import load_secret, load_settings
    from tandem.store.file import FileStore
    from tandem.store.prefix import PrefixStore

    store = FileStore(f"{tmp}/store", p, timeout=120)
    groups: dict[str, Any] = {}
    for name in ("tcp", "shm"):
        opts = BackendOptions(store=PrefixStore(name, store), rank=rank, world_size=p,
                              host="127.0.0.1", hostname="bench", secret=load_secret(),
                              settings=load_settings())
        groups[name] = ProcessGroup(Backend.factory(name)(opts), list(range(p)), 0, name,
                                    300.0, opts.settings, name)
    tdist.init_process_group("gloo", init_method=f"file://{tmp}/gloo", rank=rank, world_size=p,
                             timeout=datetime.timedelta(seconds=300))
    run = {n: (lambda t, g=g: all_reduce(t, group=g)) for n, g in groups.items()}
    run["gloo"] = tdist.all_reduce
    out = []
    for size in sizes:
        numel = size // 4
        for name in LIBS:
            t = torch.full((numel,), float(rank + 1))
            run[name](t)
            assert bool((t == p * (p + 1) / 2).all()), f"{name} all_reduce of {size} B is wrong"
        t = torch.zeros(numel)
        start = time.perf_counter()
        run["gloo"](t)
        est = torch.tensor([time.perf_counter() - start])
        tdist.all_reduce(est, op=tdist.ReduceOp.MAX)
        iters = max(1, min(2000, int(round_s / max(est.item(), 1e-6))))
        times: dict[str, list[float]] = {n: [] for n in LIBS}
        for r in range(rounds):
            for name in LIBS if r % 2 == 0 else LIBS[::-1]:
                tdist.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    run[name](t)
                times[name].append((time.perf_counter() - start) / iters)
        out.append({"size": size, "iters": iters, "times": times})
    tdist.destroy_process_group()
    for g in groups.values():
        g.transport.close()
    return out


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--sizes", default="4K,1M,64M")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--round-ms", type=float, default=100.0)
    args = parser.parse_args(argv)
    sizes = [_size(s.strip().upper().rstrip("B")) for s in args.sizes.split(",")]
    os.environ.setdefault("TANDEM_SECRET", "bench-secret")
    from tandem.testing import spawn

    with tempfile.TemporaryDirectory(prefix="tandem-bench-shm-") as tmp:
        per_rank = spawn(args.ranks, _rank, (tmp, sizes, args.rounds, args.round_ms / 1e3),
                         init=False, timeout=900, env={"GLOO_SOCKET_IFNAME": "lo"})
    p = args.ranks
    print(f"all_reduce float32, {p} ranks, 1 thread/rank, {os.cpu_count()} CPUs, "
          f"best of {args.rounds} rounds, load {os.getloadavg()[0]:.1f}")
    print(f"{'size':>8} " + " ".join(f"{n + ' lat':>12} {n + ' busbw':>13}" for n in LIBS)
          + f" {'shm/gloo':>9}")
    for i, row in enumerate(per_rank[0]):
        best = {n: min(max(r[i]["times"][n][k] for r in per_rank) for k in range(args.rounds))
                for n in LIBS}
        bw = {n: row["size"] / best[n] * 2 * (p - 1) / p / 1e9 for n in LIBS}
        cells = " ".join(f"{best[n] * 1e6:>9.1f} us {bw[n]:>8.3f} GB/s" for n in LIBS)
        print(f"{row['size']:>8} {cells} {bw['shm'] / bw['gloo']:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
