"""Rank bodies for tests/scale/test_scale_hosts.py, run by ``tandem.bench._hosts.Hosts``
(imported by module name in the rank processes: the test puts this directory on
``PYTHONPATH``)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

_WAIT_S = 60.0


def _rollup() -> dict[str, int]:
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            name, _, value = line.partition(":")
            if value.split() and value.split()[0].isdigit():
                out[name] = int(value.split()[0])
    return out


def where(rank: int, world: int) -> dict[str, Any]:
    """This rank's parent, whether torch was imported before its own code ran, and its
    anonymous memory: resident, and its proportional share (shared pages split)."""
    rollup = _rollup()
    return {"pid": os.getpid(), "ppid": os.getppid(), "host": os.environ["TANDEM_HOST_ID"],
            "anon_kb": rollup["Anonymous"], "anon_pss_kb": rollup["Pss_Anon"]}


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + _WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {_WAIT_S:.0f} s")
        time.sleep(0.01)  # another rank's end: a poll with a deadline


def dies(rank: int, world: int, workdir: str, how: str) -> str:
    """Rank 1 dies ``how`` ("kill": SIGKILL; "raise": an exception; "oom": the kernel's
    OOM killer, once the test moved it into a small memory cgroup: it writes its pid to
    ``oom-pid`` and waits for ``oom-moved``, as a namespace's /sys has no cgroups); rank 2
    fails only after rank 1's end was recorded; the others return."""
    if rank == 1:
        print("rank 1 was here", flush=True)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif how == "raise":
            raise ValueError("rank 1 broke on purpose")
        elif how == "oom":
            (Path(workdir) / "oom-pid.tmp").write_text(str(os.getpid()))
            os.rename(Path(workdir) / "oom-pid.tmp", Path(workdir) / "oom-pid")
            _wait_for(Path(workdir) / "oom-moved")
            hog = []
            for _ in range(10_000):  # the cgroup's limit ends this long before the loop
                hog.append(bytearray(8 << 20))
                hog[-1][::4096] = b"x" * len(hog[-1][::4096])
        sys.exit(3)
    if rank == 2:
        _wait_for(Path(workdir) / "run1-1.status")
        raise RuntimeError("rank 2 saw rank 1 go")
    return "ok"
