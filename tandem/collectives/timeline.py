"""The timeline: this rank's calls as a Chrome / Perfetto trace (``TANDEM_TIMELINE``).

With ``TANDEM_TIMELINE=out/trace.json`` (or inside ``with tandem.timeline(path):``)
each rank records spans in memory and writes ``out/trace.rank<N>.json`` when the
timeline stops (``destroy_process_group``, the end of the ``with`` block, or
process exit). ``tandemrun`` merges the ranks' files into ``out/trace.json`` when
the job ends; ``python -m tandem.trace --timeline out/trace.json`` does the same by
hand. Open it in https://ui.perfetto.dev or chrome://tracing: one process per rank,
one track per thread.

Spans (complete events, ``ph: X``; times in wall-clock microseconds, so ranks of one
host line up):

* every collective and point-to-point call, on the thread that ran it (the caller
  for blocking calls, the group's progress engine for ``async_op=True``), with its
  group, sequence number, signature, call site and bytes; inside it, its phases:
  ``wait for peers`` (until the first message or staging signal from a peer came),
  then ``transfer`` (later waits for peers' data) and ``reduce`` or ``copy`` (this
  rank's own work between waits: combining, copying in and out of staging);
* DistributedDataParallel: ``DDP forward``, ``DDP backward`` (first gradient hook to
  gradients written back), ``wait for gradients`` (backward blocked on the last
  buckets) and one async slice per bucket reduction, from launch to completion,
  to be read against the backward pass;
* ``optimizer.step (SGD)`` for every torch optimizer stepped while the timeline runs
  (torch's global optimizer hooks).

Memory is bounded: after ``MAX_EVENTS`` spans new ones are counted, not kept.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Callable

import torch

from tandem._files import check_creatable
from tandem.collectives.recorder import FAILED, Call, clock
from tandem.collectives.trace_files import rank_file
from tandem.errors import ArgumentError

__all__ = ["Timeline", "MAX_EVENTS"]

MAX_EVENTS = 200_000
MAX_PHASES = 64  # waits drawn per call; the rest of a long call is one span
_MIN_GAP = 1e-6  # seconds: shorter pieces of work between waits are not drawn
_REDUCING = frozenset({"all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter",
                       "reduce_scatter_tensor"})
_P2P_TRACK = "p2p completions"


class Timeline:
    """Spans of one rank; :meth:`write` saves them as ``rank_file(path, rank)``."""

    def __init__(self, path: str, rank: int, max_events: int = MAX_EVENTS) -> None:
        self.path = os.path.abspath(path)
        self.rank = rank
        self.rank_path = rank_file(self.path, rank)
        self.max_events = max_events
        self.dropped = 0
        # ("call", Call, group) | ("X", name, cat, t0, t1, tid, args)
        # | ("b" or "e", name, cat, t, id, args, tid)
        self._events: list[tuple[Any, ...]] = []
        self._threads: dict[int, tuple[int, str]] = {}  # thread ident -> (tid, name)
        self._lock = threading.Lock()
        self._offset_us = (time.time() - clock()) * 1e6
        self._steps = 0
        self._opt_started: dict[int, float] = {}
        self._hooks: list[Any] = []

    # -- recording (any thread) ----------------------------------------------------------
    def _add(self, event: tuple[Any, ...]) -> None:
        if len(self._events) < self.max_events:
            self._events.append(event)
        else:
            self.dropped += 1

    def _tid(self, ident: int | None = None, name: str | None = None) -> int:
        ident = threading.get_ident() if ident is None else ident
        known = self._threads.get(ident)
        if known is None:
            label = name or threading.current_thread().name
            with self._lock:  # two new threads at once must not get one number
                known = self._threads.setdefault(ident, (len(self._threads), label))
        return known[0]

    def call(self, call: Call, group: str) -> None:
        """A finished call (from its recorder)."""
        if call.thread:
            self._tid(call.thread)
        self._add(("call", call, group))

    def span(self, name: str, t0: float, t1: float, cat: str = "tandem",
             args: dict[str, Any] | None = None) -> None:
        """A span on the calling thread; times from :func:`recorder.clock`."""
        self._add(("X", name, cat, t0, t1, self._tid(), args))

    def ddp_backward(self, t_backward: float, t_compute_end: float, t_waited: float,
                     t_end: float, buckets: list[tuple[int, int, float, float]]) -> None:
        """One DDP backward pass; ``buckets`` are (index, bytes, launched, done)."""
        self._steps += 1
        self.span("DDP backward", t_backward, t_end, "ddp", {"step": self._steps})
        if t_waited > t_compute_end:
            self.span("wait for gradients", t_compute_end, t_waited, "ddp")
        tid = self._tid()
        for index, nbytes, launched, done in buckets:
            key = f"{self.rank}.{self._steps}.{index}"
            self._add(("b", f"bucket {index}", "ddp", launched, key, {"bytes": nbytes}, tid))
            self._add(("e", f"bucket {index}", "ddp", done, key, None, tid))

    # -- optimizer steps (torch's global hooks, only while the timeline runs) --------------
    def hook_optimizers(self) -> None:
        from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                           register_optimizer_step_pre_hook)

        def before(opt: torch.optim.Optimizer, *_: Any) -> None:
            self._opt_started[id(opt)] = clock()

        def after(opt: torch.optim.Optimizer, *_: Any) -> None:
            t0 = self._opt_started.pop(id(opt), None)
            if t0 is not None:
                self.span(f"optimizer.step ({type(opt).__name__})", t0, clock(), "optimizer")

        self._hooks = [register_optimizer_step_pre_hook(before),
                       register_optimizer_step_post_hook(after)]

    def unhook_optimizers(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._opt_started.clear()

    # -- output --------------------------------------------------------------------------
    def _us(self, t: float) -> float:
        return round(t * 1e6 + self._offset_us, 3)

    def _x(self, name: str, cat: str, t0: float, t1: float, tid: int,
           args: dict[str, Any] | None) -> dict[str, Any]:
        event = {"name": name, "cat": cat, "ph": "X", "ts": self._us(t0),
                 "dur": round(max(0.0, t1 - t0) * 1e6, 3), "pid": self.rank, "tid": tid}
        if args:
            event["args"] = args
        return event

    def _render_call(self, c: Call, group: str, p2p_tid: Callable[[], int]) -> list[dict[str, Any]]:
        tid = self._threads[c.thread][0] if c.thread in self._threads else p2p_tid()
        args: dict[str, Any] = {"group": group, "site": c.site.decode(errors="replace"),
                                "bytes": c.nbytes}
        if c.is_p2p:
            args.update(peer=c.peer, tag=c.tag)
        else:
            args.update(seq=c.seq, sig=c.sig.decode(errors="replace"),
                        queued_ms=round((c.t_start - c.t_queued) * 1e3, 3))
        if c.state == FAILED:
            args["error"] = c.error
        out = [self._x(c.op, "tandem", c.t_start, c.t_end, tid, args)]
        work = "reduce" if c.op in _REDUCING else "copy"
        t = c.t_start
        for i, (a, b) in enumerate((c.phases or [])[:MAX_PHASES]):
            if a - t > _MIN_GAP:  # before the first wait: sending, or staging for peers
                out.append(self._x("send" if i == 0 else work, "phase", t, a, tid, None))
            out.append(self._x("wait for peers" if i == 0 else "transfer", "phase", a, b, tid,
                               None))
            t = b
        if c.phases and c.t_end - t > _MIN_GAP:
            rest = work if len(c.phases) <= MAX_PHASES else f"transfer + {work}"
            out.append(self._x(rest, "phase", t, c.t_end, tid, None))
        return out

    def events(self) -> list[dict[str, Any]]:
        """Every event as Chrome trace JSON objects, metadata first."""
        p2p: list[int] = []

        def p2p_tid() -> int:
            if not p2p:
                p2p.append(self._tid(-1, _P2P_TRACK))
            return p2p[0]

        body: list[dict[str, Any]] = []
        for e in list(self._events):
            kind = e[0]
            if kind == "call":
                body += self._render_call(e[1], e[2], p2p_tid)
            elif kind == "X":
                body.append(self._x(*e[1:]))
            else:
                _, name, cat, t, key, args, tid = e
                event = {"name": name, "cat": cat, "ph": kind, "ts": self._us(t), "id": key,
                         "pid": self.rank, "tid": tid}
                if args:
                    event["args"] = args
                body.append(event)
        meta: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}},
            {"name": "process_sort_index", "ph": "M", "pid": self.rank,
             "args": {"sort_index": self.rank}}]
        for tid, name in sorted(self._threads.values()):
            meta.append({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                         "args": {"name": name}})
        return meta + body

    def check_writable(self, what: str) -> None:
        """Refuse, naming ``what`` (where the path came from), a file this rank could not
        write when the timeline ends: found then, the spans are lost and the teardown fails."""
        folder = os.path.dirname(self.rank_path) or "."
        try:
            os.makedirs(folder, exist_ok=True)
            if os.path.isdir(self.rank_path):
                raise IsADirectoryError(f"{self.rank_path} is a directory")
            # the file write() creates first, really created: os.access says yes to root
            check_creatable(folder, os.path.basename(f"{self.rank_path}.{os.getpid()}.tmp"))
        except OSError as exc:
            raise ArgumentError(f"{what}={self.path!r}: rank {self.rank} cannot write its "
                                f"timeline {self.rank_path} ({exc}); give a path in a "
                                f"writable directory") from exc

    def write(self) -> str:
        """Write this rank's file (atomically); return its path."""
        data = {"traceEvents": self.events(), "displayTimeUnit": "ms",
                "otherData": {"producer": "tandem", "rank": self.rank,
                              "dropped_events": self.dropped}}
        os.makedirs(os.path.dirname(self.rank_path) or ".", exist_ok=True)
        tmp = f"{self.rank_path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, self.rank_path)
        return self.rank_path
