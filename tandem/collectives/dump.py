"""Flight-recorder dumps: one JSON file per rank with every group's recent calls.

A dump is written to ``TANDEM_TRACE_DIR/rank<N>.json`` (replacing the rank's earlier
dump) when a call fails (timeout, mismatch, lost peer), when a group is aborted by a
failure elsewhere or a peer lost while calls are pending, on ``SIGUSR1``, before
``tandemrun`` stops a failed job, and on :func:`tandem.dump_flight_recorder`.
``python -m tandem.trace DIR`` reads every rank's file and says where the ranks
diverged.

The file::

    {"format": "tandem-flight-recorder", "version": 1, "rank": 0, "world_size": 4,
     "job": "...", "pid": ..., "host": "...", "time": <unix seconds>,
     "reason": "all_reduce #7 failed: CollectiveTimeoutError: ...", "reasons": [...],
     "main_thread": "train.py:57 in load", "stack": ["train.py:80 in <module>", ...],
     "lost": {"3": "rank 3 closed its connection ..."},
     "groups": [{"id": 0, "name": "default", "ranks": [0, 1, 2, 3], "issued": 8,
                 "aborted": "", "calls": [CALL, ...]}]}

    CALL = {"seq": 7, "op": "all_reduce", "sig": "all_reduce float32[1024] op=SUM ...",
            "site": "train.py:42", "bytes": 4096, "peer": -1, "tag": 0,
            "state": "started", "queued": <unix s>, "started": <unix s>|null,
            "ended": <unix s>|null, "duration_ms": <float>|null, "error": ""}

Calls are oldest first; ``peer`` and ``tag`` describe sends and receives (``seq`` is
-1 for them). Times are wall-clock, comparable between the ranks of one host.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Any, Iterable, Mapping

from tandem.collectives.group import ProcessGroup
from tandem.collectives.recorder import STATE_NAMES, Call, clock
from tandem.collectives.stall_report import main_thread_site, main_thread_stack
from tandem.collectives.trace_files import DUMP_FORMAT, dump_path

__all__ = ["snapshot", "write_dump"]

def _call(c: Call, offset: float) -> dict[str, Any]:
    def wall(t: float) -> float | None:
        return round(t + offset, 6) if t else None

    ended = c.t_end if c.state >= 2 else 0.0
    return {"seq": c.seq, "op": c.op, "sig": c.sig.decode(errors="replace"),
            "site": c.site.decode(errors="replace"), "bytes": c.nbytes, "peer": c.peer,
            "tag": c.tag, "state": STATE_NAMES[c.state], "queued": wall(c.t_queued),
            "started": wall(c.t_start), "ended": wall(ended),
            "duration_ms": round((ended - c.t_start) * 1e3, 3) if ended and c.t_start else None,
            "error": c.error}


def snapshot(rank: int, world_size: int, job: str, groups: Iterable[ProcessGroup],
             aborted: Mapping[int, BaseException], lost: Mapping[int, BaseException],
             reason: str, reasons: list[str]) -> dict[str, Any]:
    """Everything a dump holds, as plain JSON values."""
    offset = time.time() - clock()  # recorder timestamps -> wall clock
    out = []
    for g in groups:
        failure = aborted.get(g.group_id)
        out.append({"id": g.group_id, "name": g.group_name, "ranks": list(g.ranks),
                    "issued": g.recorder.issued, "aborted": "" if failure is None else str(failure),
                    "calls": [_call(c, offset) for c in g.recorder.calls()]})
    return {"format": DUMP_FORMAT, "version": 1, "rank": rank, "world_size": world_size,
            "job": job, "pid": os.getpid(), "host": socket.gethostname(), "time": time.time(),
            "reason": reason, "reasons": list(reasons), "main_thread": main_thread_site(),
            "stack": main_thread_stack(), "lost": {str(r): str(e) for r, e in lost.items()},
            "groups": out}


def write_dump(directory: str, rank: int, data: dict[str, Any]) -> str:
    """Write ``data`` atomically as this rank's dump; return its path."""
    os.makedirs(directory, exist_ok=True)
    path = dump_path(directory, rank)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
    return path
