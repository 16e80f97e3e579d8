"""What the job is doing, from inside it: ``stats``, ``timeline``, ``dump_flight_recorder``.

::

    import tandem
    tandem.stats()                          # {'default': {'all_reduce': OpStats(count=120,
                                            #   bytes=491520, seconds=0.0131, failed=0)}}
    with tandem.timeline("out/trace.json"): # this rank's part: out/trace.rank<N>.json
        train_one_epoch()
    tandem.dump_flight_recorder()           # TANDEM_TRACE_DIR/rank<N>.json, now

Stall warnings and dumps on failure need no call: see ``tandem.config``
(``TANDEM_STALL_WARN``, ``TANDEM_FLIGHT_RECORDER``, ``TANDEM_TRACE_DIR``,
``TANDEM_TIMELINE``) and the README's "Debugging a hang".
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from tandem.collectives.process_monitor import Monitor
from tandem.collectives.recorder import OpStats
from tandem.collectives.timeline import Timeline
from tandem.collectives.world import AnyGroup, resolve_group, world
from tandem.errors import StateError

__all__ = ["stats", "timeline", "dump_flight_recorder", "OpStats"]


def _monitor() -> Monitor:
    monitor = world().monitor
    if monitor is None:  # pragma: no cover - every initialised world has one
        raise StateError("tandem's monitor is not running")
    return monitor


def stats(group: AnyGroup | None = None) -> dict[str, dict[str, OpStats]]:
    """Per group name, per operation: calls finished, bytes, seconds spent, failures.

    Bytes are those of the tensors each call returns (an all_gather counts its whole
    output). Counts cover the calls since the group was made; with
    ``TANDEM_FLIGHT_RECORDER=0`` nothing is counted.
    """
    groups = [resolve_group(group, "stats")] if group is not None else world().process_groups()
    out: dict[str, dict[str, OpStats]] = {}
    for g in groups:
        name = g.group_name if g.group_name not in out else f"{g.group_name}#{g.group_id}"
        out[name] = g.recorder.totals()
    return out


@contextlib.contextmanager
def timeline(path: str) -> Iterator[Timeline]:
    """Record this rank's calls while the block runs; write ``<path stem>.rank<N>.json``.

    ``python -m tandem.trace --timeline PATH`` merges the ranks' files into PATH.
    """
    monitor = _monitor()
    recording = monitor.start_timeline(path, "tandem.timeline: path")
    try:
        yield recording
    finally:
        if monitor.timeline is recording:
            monitor.stop_timeline()


def dump_flight_recorder(reason: str = "requested") -> str:
    """Write this rank's flight recorder to ``TANDEM_TRACE_DIR`` now; return the file."""
    path = _monitor().dump(reason)
    if path is None:
        raise StateError("the flight recorder could not be written (see the log)")
    return path
