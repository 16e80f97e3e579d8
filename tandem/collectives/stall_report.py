"""Stall reports: what this process is doing, and the warning that names who is missing.

When a call has waited ``TANDEM_STALL_WARN`` seconds, the waiting rank asks every
peer of the call what it is doing (through the store, see
:mod:`tandem.collectives.watchdog`); each peer answers with :func:`process_state`,
and :func:`stall_warning` turns the answers into one message::

    tandem: rank 0 has waited 30 s in all_reduce #7 on group 'default' (train.py:42)
      arrived: ranks 0, 2 (2 of 4)
      rank 1 has not arrived: not in a collective; main thread at train.py:57 in load
      rank 3 has not arrived: in broadcast #7 on group 'default' (train.py:60) for 31 s;
        main thread at train.py:60 in main
      next report at 60 s; the call times out in 1770 s

A rank that has *arrived* has issued the call (its sequence number on the group is
past it). Ranks with the same story are named together.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import time
from types import FrameType
from typing import Any, Iterable

from tandem.collectives.group import ProcessGroup
from tandem.collectives.recorder import STARTED, STATE_NAMES, Call, clock
from tandem.collectives.trace_files import who

__all__ = ["frame_site", "main_thread_site", "main_thread_stack", "process_state",
           "stall_warning"]

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STDLIB = tuple({os.path.abspath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib")})
_SITE = f"{os.sep}site-packages{os.sep}"
MAX_CALLS = 8  # in-flight calls a state describes (async queues can hold many)


def _short(path: str) -> str:
    """The file name, as in call sites; from the package directory for installed packages
    (``torch/nn/modules/module.py``), whose file names alone say little."""
    if _SITE in path:
        return path.split(_SITE, 1)[1]
    return os.path.basename(path)


_BENCH = os.path.join(_PKG, "bench") + os.sep  # the benchmarks run tandem as users do


def _ours(path: str) -> bool:
    if path.startswith(_BENCH):
        return False
    return path.startswith(_PKG) or path.startswith(_STDLIB) or path.startswith("<frozen")


def frame_site(frame: FrameType | None) -> str:
    """``file:line in function`` of the innermost frame outside tandem and the standard
    library (e.g. the line that called ``time.sleep``); the innermost frame otherwise."""
    f, first = frame, frame
    while f is not None:
        if not _ours(f.f_code.co_filename):
            break
        f = f.f_back
    f = f or first
    if f is None:
        return "?"
    return f"{_short(f.f_code.co_filename)}:{f.f_lineno} in {f.f_code.co_name}"


def _main_frame() -> FrameType | None:
    ident = threading.main_thread().ident
    return sys._current_frames().get(ident) if ident is not None else None


def main_thread_site() -> str:
    """Where this process's main thread is executing now."""
    return frame_site(_main_frame())


def main_thread_stack(limit: int = 30) -> list[str]:
    """The main thread's stack, outermost first, as ``file:line in function``."""
    out: list[str] = []
    f = _main_frame()
    while f is not None and len(out) < limit:
        out.append(f"{_short(f.f_code.co_filename)}:{f.f_lineno} in {f.f_code.co_name}")
        f = f.f_back
    return out[::-1]


def process_state(rank: int, groups: Iterable[ProcessGroup], ask: int) -> dict[str, Any]:
    """What this process is doing: the answer a stalled peer gets (JSON-ready)."""
    now = clock()
    calls: list[dict[str, Any]] = []
    issued: dict[str, int] = {}
    for g in groups:
        issued[str(g.group_id)] = g.recorder.issued
        for c in g.recorder.in_flight():
            calls.append({"group": g.group_name, "what": c.what(),
                          "site": c.site.decode(errors="replace"), "state": STATE_NAMES[c.state],
                          "for": round(now - (c.t_start or c.t_queued), 1)})
    calls.sort(key=lambda c: -c["for"])
    return {"rank": rank, "ask": ask, "pid": os.getpid(), "time": time.time(),
            "main": main_thread_site(), "calls": calls[:MAX_CALLS], "issued": issued}


def _doing(state: dict[str, Any] | None, answer_wait: float) -> str:
    if state is None:
        return (f"no answer within {answer_wait:.0f} s (the process may be stopped, or busy "
                f"in native code that holds the GIL)")
    calls = state.get("calls") or []
    main = f"main thread at {state.get('main', '?')}"
    running = [c for c in calls if c.get("state") == STATE_NAMES[STARTED]]
    if not running:
        return f"not in a collective; {main}"
    c = running[0]
    return f"in {c['what']} on group '{c['group']}' ({c['site']}) for {c['for']:.0f} s; {main}"


def stall_warning(rank: int, group: ProcessGroup, call: Call, states: dict[int, Any],
                  lost: dict[int, str], answer_wait: float, next_at: float | None,
                  note: str = "") -> str:
    """The warning for ``call`` on ``group``, which has been waiting since ``call.t_start``.

    ``states`` maps the peers that answered to their :func:`process_state`; ``lost``
    maps peers known dead to the reason; ``next_at`` is the wait at which the next
    report comes (None: none before the deadline).
    """
    waited = clock() - call.t_start
    site = call.site.decode(errors="replace") or "?"
    lines = [f"tandem: rank {rank} has waited {waited:.0f} s in {call.what()} on group "
             f"'{group.group_name}' ({site})"]
    if call.is_p2p:
        peers = [call.peer] if call.peer >= 0 else [r for r in group.ranks if r != rank]
        arrived: list[int] = []
    else:
        key = str(group.group_id)
        arrived = [rank] + [r for r, s in states.items()
                            if s is not None and s.get("issued", {}).get(key, 0) > call.seq]
        peers = [r for r in group.ranks if r not in arrived]
        lines.append(f"  arrived: {who(arrived)} ({len(arrived)} of {group.group_size})")
    stories: dict[str, list[int]] = {}
    for r in peers:
        story = f"lost: {lost[r]}" if r in lost else _doing(states.get(r), answer_wait)
        stories.setdefault(story, []).append(r)
    for story, ranks in stories.items():
        label = who(ranks)
        if not call.is_p2p:
            label += " has not arrived" if len(ranks) == 1 else " have not arrived"
        lines.append(f"  {label}: {story}")
    if note:
        lines.append(f"  {note}")
    left = call.deadline - time.monotonic() if call.deadline else None
    tail = [] if next_at is None else [f"next report at {next_at:.0f} s"]
    if left is not None:
        tail.append(f"the call times out in {max(0.0, left):.0f} s")
    if tail:
        lines.append("  " + "; ".join(tail))
    return "\n".join(lines)
