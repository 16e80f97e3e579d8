"""Where did the ranks diverge? Every rank's flight-recorder dump, read side by side.

``python -m tandem.trace DIR`` loads ``DIR/rank<N>.json`` (see
``tandem.collectives.dump``) and reports, in a few lines:

* per group, the first call number at which the ranks disagree: either some ranks
  **called something different** (the signatures differ: op, dtype, shape, reduce
  op, root), or some ranks **are behind** (they never issued the call the others
  wait in), with where the late ranks are instead;
* when the calls agree (dumps taken with ``SIGUSR1`` of a job stuck outside tandem's
  calls), where each rank was: its last call and its main thread's line;
* who **died**: ranks without a dump whose peers lost their connection;
* point-to-point calls still waiting, and calls that failed, once each.

Groups are reported in the order their divergence began. Dumps of another job in
the same directory (an earlier run), and dumps written more than ``MOMENT`` seconds
before the newest (an earlier ``SIGUSR1``, say), are left out and named.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from tandem.collectives.trace_files import DUMP_FORMAT, rank_list, who

__all__ = ["load_dumps", "report"]

Dump = dict[str, Any]
P2P = ("send", "recv")
MAX_FAILURES = 5
# dumps of one event (a failure, a launcher's request) are written within seconds of
# each other; one this much older than the newest is from an earlier moment
MOMENT = 30.0


def load_dumps(directory: str) -> tuple[dict[int, Dump], list[str]]:
    """The dumps of the newest job in ``directory`` by rank, and notes about the rest."""
    found: dict[int, Dump] = {}
    notes: list[str] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError as exc:
        return {}, [f"cannot read {directory}: {exc}"]
    for name in names:
        if not (name.startswith("rank") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            notes.append(f"{name} is not readable: {exc}")
            continue
        if isinstance(data, dict) and data.get("format") == DUMP_FORMAT:
            found[int(data["rank"])] = data
    if not found:
        return {}, notes
    # a rank that dumps before it learnt the job's id (set through the store just after
    # init) writes "": such a dump belongs to any job, and its time alone may leave it out
    named = [d for d in found.values() if d.get("job", "")] or list(found.values())
    newest = max(named, key=lambda d: d.get("time", 0)).get("job", "")
    others = [r for r, d in found.items() if d.get("job", "") not in (newest, "")]
    if others:
        notes.append(f"left out the dumps of {who(others)}: they belong to another job")
    kept = {r: d for r, d in found.items() if r not in others}
    latest = max(d.get("time", 0) for d in kept.values())
    stale = sorted(r for r, d in kept.items() if d.get("time", 0) < latest - MOMENT)
    if stale:
        notes.append(f"left out the older dumps of {who(stale)} (written "
                     f"{_clock(min(kept[r].get('time', 0) for r in stale))}, against "
                     f"{_clock(latest)} for the newest): ranks dumped at different moments "
                     f"look behind only because their dump is older; for one moment's set, "
                     f"send SIGUSR1 to every rank at once")
    return {r: d for r, d in kept.items() if r not in stale}, notes


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def _first_line(text: str, limit: int = 200) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _collectives(group: Dump) -> dict[int, Dump]:
    return {c["seq"]: c for c in group.get("calls", []) if c["seq"] >= 0 and c["op"] not in P2P}


def _call_text(c: Dump) -> str:
    return f"{c['sig'] or c['op']} at {c['site'] or '?'}"


def _error(c: Dump) -> str:
    """A call's error without the call's own description, which the report gives."""
    kind, _, text = c["error"].partition(": ")
    marker = f"called at {c['site']} "
    if marker in text:
        text = text.split(marker, 1)[1].removeprefix("failed: ")
    return _first_line(f"{kind}: {text}", 160)


def _progress(c: Dump, dumped_at: float) -> str:
    """How far a call got by its rank's dump."""
    if c["state"] == "failed":
        return f"failed: {_error(c)}"
    if c["state"] == "completed":
        return "completed"
    if c["state"] == "started" and c.get("started"):
        return f"waiting {dumped_at - c['started']:.1f} s at the dump"
    return c["state"]


def _elsewhere(dump: Dump, gid: int) -> str:
    """What a rank that is behind on group ``gid`` was doing at its dump."""
    for g in dump.get("groups", []):
        for c in g.get("calls", []):
            if c["state"] == "started" and (g["id"] != gid or c["op"] in P2P):
                what = (f"{c['op']} #{c['seq']}" if c["op"] not in P2P
                        else f"{c['op']} (peer {c['peer']}, tag {c['tag']})")
                return f"in {what} on group '{g['name']}' at {c['site']}; "
    return "not in a collective; "


def _group_verdict(gid: int, entries: dict[int, Dump], dumps: dict[int, Dump]
                   ) -> tuple[float, int, list[str]] | None:
    """(when it began, call number, lines) for the first divergence on group ``gid``."""
    calls = {r: _collectives(g) for r, g in entries.items()}
    issued = {r: int(g.get("issued", 0)) for r, g in entries.items()}
    lo = max((min(c) if c else issued[r]) for r, c in calls.items())
    any_group = next(iter(entries.values()))
    title = f"group '{any_group['name']}' (ranks {rank_list(any_group['ranks'])})"
    for seq in range(lo, max(issued.values())):
        have = {r: c[seq] for r, c in calls.items() if seq in c}
        behind = sorted(r for r in calls if issued[r] <= seq)
        kinds: dict[str, list[int]] = {}
        for r, c in sorted(have.items()):
            kinds.setdefault(c["sig"], []).append(r)
        if len(kinds) < 2 and not behind:
            continue
        began = min((c.get("started") or c.get("queued") or 0.0) for c in have.values())
        if len(kinds) > 1:
            lines = [f"{title}, call #{seq}: ranks called different collectives"]
            for ranks in kinds.values():
                lines.append(f"  {who(ranks)}: {_call_text(have[ranks[0]])}")
        else:
            ranks = next(iter(kinds.values()))
            # the furthest state among them: a failure says the most
            order = {"failed": 0, "completed": 1, "started": 2, "queued": 3}
            first = min(ranks, key=lambda r: order.get(have[r]["state"], 4))
            c = have[first]
            lines = [f"{title}, call #{seq}: {who(behind)} "
                     f"{'is' if len(behind) == 1 else 'are'} behind",
                     f"  {who(ranks)} {'is' if len(ranks) == 1 else 'are'} in {_call_text(c)} "
                     f"({_progress(c, dumps[first]['time'])})"]
        for r in behind:
            last = calls[r].get(issued[r] - 1)
            prior = (f"last call #{issued[r] - 1} {last['op']} at {last['site']} "
                     f"({_progress(last, dumps[r]['time'])})" if last else "no call on it yet")
            lines.append(f"  rank {r}: {prior}; {_elsewhere(dumps[r], gid)}"
                         f"main thread at {dumps[r].get('main_thread', '?')}")
        return began, seq, lines
    return None


def _died(dumps: dict[int, Dump], world_size: int) -> list[str]:
    """Ranks without a dump: died (their peers lost them) or never wrote one.

    A rank that dumped and exited afterwards (ranks exit after a failed call) is no news.
    """
    lost: dict[int, dict[int, str]] = {}
    for r, d in dumps.items():
        for peer, why in d.get("lost", {}).items():
            lost.setdefault(int(peer), {})[r] = why
    lines = []
    for r in range(world_size):
        if r in dumps:
            continue
        by = lost.get(r, {})
        if by:
            lines.append(f"rank {r} died: no dump; {who(by)} lost it: "
                         f"{_first_line(next(iter(by.values())), 160)}")
        else:
            lines.append(f"rank {r} wrote no dump (killed before it could, still running, "
                         f"or never started)")
    return lines


def _whereabouts(dumps: dict[int, Dump]) -> list[str]:
    """Where each rank was at its dump, ranks with the same story together."""
    stories: dict[str, list[int]] = {}
    for r, d in sorted(dumps.items()):
        last = max((c for g in d.get("groups", []) for c in g.get("calls", [])),
                   key=lambda c: c.get("queued") or 0.0, default=None)
        did = ("no call yet" if last is None else
               f"last call {last['op']} at {last['site']} ({last['state']})")
        story = f"{did}; {_elsewhere(d, -1)}main thread at {d.get('main_thread', '?')}"
        stories.setdefault(story, []).append(r)
    return [f"{who(ranks)}: {story}" for story, ranks in stories.items()]


def _waiting_p2p(dumps: dict[int, Dump]) -> list[str]:
    lines = []
    for r, d in sorted(dumps.items()):
        for g in d.get("groups", []):
            for c in g.get("calls", []):
                if c["op"] in P2P and c["state"] == "started":
                    peer = "any rank" if c["peer"] < 0 else f"rank {c['peer']}"
                    way = "to" if c["op"] == "send" else "from"
                    lines.append(f"rank {r} waits in {c['op']} {way} {peer} (tag {c['tag']}) "
                                 f"at {c['site']} ({_progress(c, d['time'])})")
    return lines


def _failures(dumps: dict[int, Dump], shown: set[tuple[int, int]]) -> list[str]:
    """Failed calls not already in a verdict (``shown``: (group id, seq)), once per kind."""
    seen: dict[tuple[str, str], tuple[list[int], str]] = {}
    for r, d in sorted(dumps.items()):
        for g in d.get("groups", []):
            for c in g.get("calls", []):
                if c["state"] != "failed" or (g["id"], c["seq"]) in shown:
                    continue
                what = c["op"] if c["op"] in P2P else f"{c['op']} #{c['seq']}"
                key = (f"{what} on group '{g['name']}' at {c['site']}", c["error"].split(":")[0])
                seen.setdefault(key, ([], _error(c)))[0].append(r)
    lines = [f"{who(ranks)}: {what} failed: {error}"
             for (what, _), (ranks, error) in seen.items()]
    if len(lines) > MAX_FAILURES:
        lines = lines[:MAX_FAILURES] + [f"... and {len(lines) - MAX_FAILURES} more failed calls"]
    return lines


def report(directory: str) -> list[str]:
    """The analysis of ``directory`` as lines of text."""
    dumps, notes = load_dumps(directory)
    if not dumps:
        return notes + [f"no flight-recorder dumps (rank<N>.json) in {directory}"]
    world_size = max(int(d.get("world_size", 0)) for d in dumps.values())
    when = sorted(d["time"] for d in dumps.values())
    span = _clock(when[0])
    if when[-1] - when[0] >= 1:
        span += "-" + _clock(when[-1])
    lines = [f"flight recorders of {who(dumps)} ({len(dumps)} of {world_size}), written "
             f"{span}"] + notes
    groups: dict[int, dict[int, Dump]] = {}
    for r, d in dumps.items():
        for g in d.get("groups", []):
            groups.setdefault(int(g["id"]), {})[r] = g
    verdicts = {gid: v for gid, entries in sorted(groups.items())
                if (v := _group_verdict(gid, entries, dumps)) is not None}
    for _, _, block in sorted(verdicts.values(), key=lambda v: v[0]):
        lines += block
    if not verdicts:
        lines.append("the ranks' recorded calls agree on every group")
        lines += _whereabouts(dumps)
    lines += _died(dumps, world_size)
    lines += _waiting_p2p(dumps)
    lines += _failures(dumps, {(gid, v[1]) for gid, v in verdicts.items()})
    return lines
