"""The TCPStore under load: tandem's against torch's, in one run.

Run::

    python -m tandem.bench store                         # 64 clients x 1,000 operations
    python -m tandem.bench store --clients 8 --ops 100   # what the smoke test runs

How it measures. For each store, one process serves it (``is_master``) and
``--clients`` client processes, forked from this one after torch is imported (so 64 of
them cost little memory), each connect, meet at a ``wait`` on a key the last one sets
(the rendezvous), then run ``--ops`` operations, a third each ``set``, ``get`` and
``add`` on keys of their own and shared ones. ops/s = every client's operations over
the time from the first client's start to the last client's end; a client that fails
or times out is counted and its error shown. ``ratio`` = tandem's ops/s / torch's.
Rounds alternate between the stores.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from typing import Any, Sequence

from tandem.bench.startup import render

__all__ = ["main", "measure"]

STORE_TIMEOUT = 120.0  # seconds any one operation may wait; none should come near it


def _make(lib: str, port: int, master: bool, clients: int) -> Any:
    if lib == "tandem":
        from tandem.store import TCPStore
        return TCPStore("127.0.0.1", port, None, master, timeout=STORE_TIMEOUT,
                        secret=b"bench-store-secret")
    import datetime

    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", port, None, master,
                         timeout=datetime.timedelta(seconds=STORE_TIMEOUT),
                         wait_for_workers=False)


def _client(lib: str, port: int, index: int, clients: int, ops: int, out: str) -> None:
    result: dict[str, Any] = {"ok": False}
    try:
        store = _make(lib, port, False, clients)
        start = time.time()
        if int(store.add("joined", 1)) == clients:
            store.set("go", b"1")
        store.wait(["go"])
        met = time.time()
        for i in range(ops):
            kind = i % 3
            if kind == 0:
                store.set(f"c{index}/{i % 16}", b"x" * 32)
            elif kind == 1:
                store.get(f"c{index}/{(i - 1) % 16}")
            else:
                store.add("shared", 1)
        result = {"ok": True, "start": start, "met": met, "end": time.time()}
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    with open(os.path.join(out, f"c{index}.json"), "w") as f:
        json.dump(result, f)


def _fork(target: Any, *args: Any) -> int:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            target(*args)
            code = 0
        finally:
            os._exit(code)
    return pid


def _serve(lib: str, port_file: str, clients: int) -> None:
    store = _make(lib, 0, True, clients)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(store.port))
    os.rename(port_file + ".tmp", port_file)
    signal.sigwait({signal.SIGTERM})  # serve until the parent is done


def measure(lib: str, clients: int, ops: int, timeout: float = 600.0) -> dict[str, Any]:
    """One round: rendezvous seconds, ops/s and failures for ``clients`` x ``ops``."""
    with tempfile.TemporaryDirectory(prefix="tandem-bench-store-") as out:
        port_file = os.path.join(out, "port")
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # the server's sigwait
        try:
            server = _fork(_serve, lib, port_file, clients)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        pids: list[int] = []
        deadline = time.monotonic() + timeout
        try:
            while not os.path.exists(port_file):
                if time.monotonic() > deadline or os.waitpid(server, os.WNOHANG)[0]:
                    raise RuntimeError(f"{lib}: the store server did not start")
                time.sleep(0.01)
            port = int(open(port_file).read())
            pids = [_fork(_client, lib, port, i, clients, ops, out) for i in range(clients)]
            for pid in pids:
                while not os.waitpid(pid, os.WNOHANG)[0]:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{lib}: clients still running after {timeout:.0f}s")
                    time.sleep(0.02)
            pids = []
        finally:
            for pid in [*pids, server]:
                try:
                    os.kill(pid, signal.SIGKILL if pid != server else signal.SIGTERM)
                    os.waitpid(pid, 0)
                except (ProcessLookupError, ChildProcessError):
                    pass
        results = []
        for i in range(clients):
            try:
                results.append(json.load(open(os.path.join(out, f"c{i}.json"))))
            except (OSError, ValueError):
                results.append({"ok": False, "error": "the client left no result"})
    done = [r for r in results if r["ok"]]
    errors = [r["error"] for r in results if not r["ok"]]
    if not done:
        raise RuntimeError(f"{lib}: every client failed, e.g. {errors[0]}")
    first = min(r["met"] for r in done)
    return {"rendezvous": max(r["met"] for r in done) - min(r["start"] for r in done),
            "ops_per_s": len(done) * ops / (max(r["end"] for r in done) - first),
            "failed": float(len(errors)), "error": errors[0] if errors else ""}


def format_table(rows: dict[str, dict[str, float]], clients: int, ops: int,
                 markdown: bool = False) -> str:
    head = ["store", "clients", "ops each", "rendezvous s", "ops/s", "failed", "ratio"]
    body = [[lib, str(clients), str(ops), f"{m['rendezvous']:.2f}", f"{m['ops_per_s']:.0f}",
             f"{int(m['failed'])}", f"{m['ops_per_s'] / rows['torch']['ops_per_s']:.2f}"]
            for lib, m in rows.items()]
    return render(head, body, markdown)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench store",
                                     description="TCPStore under load: tandem vs torch.")
    parser.add_argument("--clients", type=int, default=64, help="client processes (default 64)")
    parser.add_argument("--ops", type=int, default=1000, help="operations each (default 1000)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds per store (default 1)")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if not 1 <= args.clients <= 256:
        parser.error(f"--clients {args.clients}: give 1 to 256 client processes")
    if not 1 <= args.ops <= 1_000_000:
        parser.error(f"--ops {args.ops}: give 1 to 1000000 operations per client")
    import torch  # before forking: the clients share its pages

    torch.set_num_threads(1)
    start = time.monotonic()
    samples: dict[str, list[dict[str, Any]]] = {"tandem": [], "torch": []}
    for i in range(max(1, args.rounds)):
        for lib in (("tandem", "torch") if i % 2 == 0 else ("torch", "tandem")):
            samples[lib].append(measure(lib, args.clients, args.ops))
    rows = {lib: {k: statistics.median(float(s[k]) for s in runs)
                  for k in ("rendezvous", "ops_per_s", "failed")} for lib, runs in samples.items()}
    print(f"# store: {args.clients} client processes x {args.ops} operations (set/get/add), "
          f"median of {max(1, args.rounds)} round(s), {os.cpu_count()} CPUs; ratio = tandem's "
          f"ops/s / torch's; {time.monotonic() - start:.0f} s")
    print(format_table(rows, args.clients, args.ops, args.markdown))
    for lib, runs in samples.items():
        for run in runs:
            if run["failed"]:
                print(f"# {lib}: {int(run['failed'])} client(s) failed, e.g. {run['error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
