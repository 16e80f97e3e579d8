"""One simulated host's benchmark ranks, forked from one process that imported torch.

``python -m tandem.bench._host_zygote SPEC WORLD PREFIX RANK [RANK ...]``

Started by :class:`tandem.bench._hosts.Hosts` (``zygote=True``) once per simulated
host, inside the host's namespace, with the host's environment. It imports torch,
``torch.distributed``, tandem's collectives and the module of the function ``SPEC``
names (``tandem.bench._host_rank`` says what a rank does with it), checks that it has
one thread, freezes what it made out of the garbage collector's reach, then forks one
process per ``RANK``. The ranks of a host so share torch's pages (copy on write) as
tandemrun's warm workers do (docs/launching.md#warm-start), where a process per rank
that imports torch itself holds a copy of everything that import made.

Each rank writes its output and errors to ``PREFIX-RANK.log``, its result to
``PREFIX-RANK.out``. The zygote waits for every rank and writes, as each one ends,
``PREFIX-RANK.status``: its pid, exit code or the signal that killed it, and the wall
clock time it ended, so the parent can say which rank ended first and how, even when
the rank itself could print nothing (SIGKILL, the OOM killer). The zygote exits 0 when
every rank did, 1 otherwise. The ranks stay in the zygote's process group, which the
lab kills at its deadline.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
import traceback
from typing import Any

from tandem.bench._host_rank import load, run_rank
from tandem.run._zygote import bind_exports

_PRELOAD = ("torch", "torch.distributed", "tandem", "tandem.collectives.api",
            "tandem.collectives.barriers")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _status(pid: int, status: int) -> dict[str, Any]:
    """``waitpid``'s status as JSON: exit code, or signal (and whether it dumped core)."""
    if os.WIFSIGNALED(status):
        return {"pid": pid, "exit": None, "signal": os.WTERMSIG(status),
                "core": os.WCOREDUMP(status), "ended": time.time()}
    return {"pid": pid, "exit": os.WEXITSTATUS(status), "signal": None, "core": False,
            "ended": time.time()}


def _rank(spec: dict[str, Any], fn: Any, rank: int, world: int, prefix: str) -> None:
    """The forked rank: its own log as stdout and stderr, then the function; never returns."""
    code = 1
    try:
        log = os.open(f"{prefix}-{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        import torch

        torch.default_generator.seed()  # a generator seeded in the zygote is not shared
        run_rank(spec, fn, rank, world, f"{prefix}-{rank}.out")
        code = 0
    except BaseException:  # noqa: BLE001 - into the rank's log, for the parent's report
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - the exit status still tells
                pass
        os._exit(code)  # the zygote's own exit handlers are not this rank's


def main(argv: list[str]) -> int:
    spec_path, world, prefix = argv[0], int(argv[1]), argv[2]
    ranks = [int(a) for a in argv[3:]]
    import importlib

    for name in _PRELOAD:
        importlib.import_module(name)
    spec, fn = load(spec_path)
    bind_exports()  # as tandemrun's zygote: each rank finds tandem's names bound
    if _threads() != 1:  # a lock held by another thread would stay held in every rank
        print(f"zygote: {_threads()} threads after importing torch: cannot fork the ranks "
              f"safely (set OMP_NUM_THREADS=1)", file=sys.stderr)
        return 2
    # what the imports made lives as long as the ranks: the collector must not touch (copy) it
    gc.collect()
    gc.freeze()
    children: dict[int, int] = {}
    for rank in ranks:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _rank(spec, fn, rank, world, prefix)
        children[pid] = rank
    failed = 0
    while children:
        pid, status = os.waitpid(-1, 0)
        rank = children.pop(pid, -1)
        if rank < 0:
            continue
        got = _status(pid, status)
        failed += got["exit"] != 0
        path = f"{prefix}-{rank}.status"
        with open(path + ".tmp", "w") as f:
            json.dump(got, f)
        os.rename(path + ".tmp", path)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
