"""Which worker failed first, and the summary the launcher prints about it.

A :class:`Failure` is built from what the agent saw (exit code or signal, exit time)
and, when the worker's bootstrap wrote one, its JSON error record (exception type,
message, traceback, the time it was raised). The root cause is the earliest failure,
preferring failures that are not mere consequences of another rank's death
(``PeerLostError``): a rank killed by SIGKILL is reported before the peers that then
lost their connection to it, even if the agent noticed the death a little late.

The traceback is not repeated: the rank printed it (``_tracebacks.py``: the first
failing rank of a node prints its traceback, the others one line), so the summary
names the rank that did, and prints it only when it did not reach this console.

Before the launcher stops the ranks still running, :func:`let_failing_ranks_exit`
gives those already on their way out a moment to finish: a rank that raised runs its
``finally`` blocks and exit handlers before its exception is recorded and it exits,
and another rank often fails first, of the consequence (it lost its peer). Stopped at
once, the rank that caused it all would be reported as "killed by SIGTERM" or only
"stopped by the launcher"; and ranks failing alike (the same bad flag on each) would
be cut off before they could print the line the console shows once for all.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import signal
import socket
import time
from typing import Any, Sequence

from tandem._words import counted, rank_list, who
from tandem.run._tracebacks import CONSEQUENCES
from tandem.run.oom import oom_kill_line
from tandem.run.workers import WorkerGroup

__all__ = ["Failure", "load_record", "pick_root_cause", "format_summary", "describe_exit",
           "let_failing_ranks_exit", "EXIT_GRACE"]

RULE = "=" * 72
# How long ranks on their way out may take to exit before the launcher stops them: an
# interpreter that imported torch exits in well under a second; a rank's finally
# blocks (destroy_process_group, a last checkpoint) may take a little longer.
EXIT_GRACE = 3.0
SETTLE = 1.0  # how long ranks that fail alike may take to do so (as dedup.WINDOW)
# The summary stays one screen long at any world size: the first few other failures get
# a line each (the rest are mostly consequences), then one line per kind of failure
OTHERS_LISTED = 3
KINDS_LISTED = 4
BRIEF_CHARS = 240  # of another failure's line: the rank's own output has the whole message


def describe_exit(returncode: int | None) -> str:
    """``1`` -> "exit code 1"; ``-9`` -> "signal 9 (SIGKILL)"."""
    if returncode is None:
        return "exit status unknown"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown signal"
        return f"signal {-returncode} ({name})"
    return f"exit code {returncode}"


def load_record(path: str) -> dict[str, Any] | None:
    """The error record a worker's bootstrap wrote, or None if there is none (or it is bad)."""
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


@dataclasses.dataclass
class Failure:
    rank: int
    local_rank: int
    node_rank: int
    host: str
    pid: int
    time: float  # when the exception was raised, else when the agent saw the exit
    returncode: int | None
    role: str = "default"
    exc_type: str = ""
    message: str = ""
    traceback: str = ""
    error_file: str = ""
    log_dir: str = ""
    shown: bool = False  # the rank printed its traceback where this launcher shows it
    blames: list[int] = dataclasses.field(default_factory=list)  # ranks its timeout waited on

    def merge_record(self, record: dict[str, Any] | None, on_console: bool = True) -> None:
        """Add what the worker recorded; ``on_console``: its stderr reaches our console."""
        if not record:
            return
        self.exc_type = str(record.get("exc_type", ""))
        self.message = str(record.get("message", ""))
        self.traceback = str(record.get("traceback", ""))
        self.shown = bool(record.get("shown")) and on_console
        self.host = str(record.get("host") or self.host)
        blames = record.get("blames")
        if isinstance(blames, list) and all(isinstance(r, int) for r in blames):
            self.blames = blames
        if isinstance(record.get("time"), (int, float)):
            self.time = min(self.time, float(record["time"]))

    @property
    def is_consequence(self) -> bool:
        return _consequence(self.exc_type)

    def brief(self) -> str:
        """One line: "rank 1 (local_rank 1, host h): exit code 1, ValueError: boom"."""
        if self.local_rank < 0:  # a whole node was lost with its agent
            return f"node {self.node_rank} (host {self.host}, ranks from {self.rank}): {self.message}"
        what = describe_exit(self.returncode)
        if self.exc_type:
            first = (self.message.splitlines() or [""])[0]
            what += f", {self.exc_type}: {first}"
        return f"rank {self.rank} (local_rank {self.local_rank}, host {self.host}): {what}"

    def kind(self) -> str:
        """What failed, without who: "signal 15 (SIGTERM), PeerLostError"."""
        if self.local_rank < 0:
            return f"node lost: {(self.message.splitlines() or [''])[0]}"
        what = describe_exit(self.returncode)
        return f"{what}, {self.exc_type.rsplit('.', 1)[-1]}" if self.exc_type else what

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Failure:
        """A failure another node published: its traceback was printed over there."""
        data = json.loads(text)
        fields = {f.name for f in dataclasses.fields(cls)} - {"shown"}
        return cls(**{k: v for k, v in data.items() if k in fields})


def pick_root_cause(failures: Sequence[Failure]) -> Failure:
    """The earliest failure, ignoring consequences of another rank's death when possible."""
    if not failures:
        raise ValueError("no failures to choose from")
    primary = [f for f in failures if not f.is_consequence] or list(failures)
    return min(primary, key=lambda f: (f.time, f.rank))


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).isoformat(sep=" ", timespec="milliseconds")


def stalled_ranks(failures: Sequence[Failure], stopped: Sequence[int]) -> list[int]:
    """The ranks the first failure timed out waiting on, when none of them failed by itself:
    they stalled (a hung data loader, a stopped process) and the others only reported it."""
    root = pick_root_cause(failures)
    failed = {f.rank for f in failures}
    blamed = [r for r in root.blames if r != root.rank]
    if blamed and not failed & set(blamed) and set(blamed) <= set(stopped):
        return blamed
    return []


def format_summary(failures: Sequence[Failure], *, run_id: str, attempts: int,
                   stopped: Sequence[int] = (), headline: str = "") -> str:
    """The multi-line report printed when the job gives up."""
    root = pick_root_cause(failures)
    plural = "s" if attempts != 1 else ""
    lines = [RULE, headline or f"tandemrun: job {run_id} failed after {attempts} attempt{plural}"]
    stalled = stalled_ranks(failures, stopped)
    if stalled:
        waiting = sorted({f.rank for f in failures if set(stalled) & set(f.blames)})
        lines += [f"Root cause: {_ranks(stalled)} stopped making progress",
                  f"  rank       : {', '.join(map(str, stalled))} (still running when the "
                  f"launcher stopped it)",
                  f"  seen by    : {_ranks(waiting)}, which timed out waiting for it",
                  "First failure it caused:"]
    else:
        lines.append("Root cause (first failure):")
    lines += [f"  rank       : {root.rank} (local_rank {root.local_rank}, node {root.node_rank}, "
              f"role {root.role})" if root.local_rank >= 0 else
              f"  ranks      : all of node {root.node_rank}, from rank {root.rank} "
              f"(role {root.role})",
              f"  host       : {root.host}",
              f"  pid        : {root.pid}",
              f"  time       : {_when(root.time)}",
              f"  exit       : {describe_exit(root.returncode)}"]
    if root.exc_type:
        lines.append(f"  exception  : {root.exc_type}: {root.message}")
        if root.shown:
            lines.append(f"  traceback  : printed above by [rank{root.rank}]")
        else:
            lines.append("  traceback  :")
            lines += ["    " + line for line in root.traceback.rstrip("\n").splitlines()]
    elif root.returncode is not None and root.returncode > 0:
        lines.append(f"  exception  : none recorded: the worker exited with status "
                     f"{root.returncode} itself (sys.exit, argparse refusing its arguments, or "
                     f"a --no-python command); see its output above")
    elif root.returncode == -signal.SIGKILL and root.host == socket.gethostname() \
            and (line := oom_kill_line(root.pid, root.time)):
        lines.append(f"  exception  : none recorded: the kernel's OOM killer killed it (out of "
                     f"memory); the kernel log says: {line}")
    else:
        lines.append("  exception  : none recorded (the worker was killed); see its stderr "
                     "above")
    if root.error_file:
        lines.append(f"  error file : {root.error_file}")
    if root.log_dir:
        lines.append(f"  logs       : {root.log_dir}")
    others = sorted((f for f in failures if f is not root), key=lambda f: (f.time, f.rank))
    if others:
        lines.append("Other failures:")
        lines += [_clip(f"  {f.brief()}") for f in others[:OTHERS_LISTED]]
        lines += _grouped(others[OTHERS_LISTED:])
    if stopped:
        lines.append(f"Stopped by the launcher: ranks {rank_list(stopped)}")
    lines.append(RULE)
    return "\n".join(lines)


def let_failing_ranks_exit(group: WorkerGroup, timeout: float, settle: float = SETTLE) -> None:
    """Wait up to ``timeout`` while ranks may still be on their way out by themselves: for
    ``settle`` seconds in any case (ranks that fail alike, an argparse error on each, do
    so within moments), then while a running rank has recorded an error (it is
    exiting), or while every failure so far is a consequence of another rank's (the
    cause may still be unwinding)."""
    start = time.monotonic()
    deadline = start + timeout
    while group.alive() and time.monotonic() < deadline:
        exiting = any(load_record(w.spec.error_file) is not None for w in group.alive())
        records = [load_record(w.spec.error_file) or {} for w in group.failed()]
        causes = [r for r in records if not _consequence(str(r.get("exc_type", "")))]
        if time.monotonic() >= start + settle and not exiting and causes:
            return
        group.changed.wait(min(0.05, max(0.0, deadline - time.monotonic())))
        group.changed.clear()


def _ranks(ranks: Sequence[int]) -> str:
    return who(ranks)


def _clip(line: str) -> str:
    return line if len(line) <= BRIEF_CHARS else line[:BRIEF_CHARS - 3] + "..."


def _grouped(failures: Sequence[Failure]) -> list[str]:
    """One line per kind of failure (most ranks first), at most ``KINDS_LISTED``; the
    remaining kinds together on one more."""
    if not failures:
        return []
    kinds: dict[str, list[int]] = {}
    for f in failures:
        kinds.setdefault(f.kind(), []).append(f.rank)
    ordered = sorted(kinds.items(), key=lambda k: (-len(k[1]), min(k[1])))
    lines = [_clip(f"  {who(ranks)} ({len(ranks)} more): {kind}")
             for kind, ranks in ordered[:KINDS_LISTED]]
    rest = [r for _, ranks in ordered[KINDS_LISTED:] for r in ranks]
    if rest:
        kinds_left = counted(len(ordered) - KINDS_LISTED, "other kind")
        lines.append(_clip(f"  {who(rest)} ({len(rest)} more): {kinds_left} of failure"))
    return lines


def _consequence(exc_type: str) -> bool:
    """Whether an exception of this type is raised because another rank failed first."""
    return exc_type.rsplit(".", 1)[-1] in CONSEQUENCES
