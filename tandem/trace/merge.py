"""Merge the ranks' timeline files into one Chrome / Perfetto trace, a process per rank.

Each rank writes ``<stem>.rank<N><suffix>`` (see ``tandem.collectives.timeline``);
:func:`merge_timeline` gathers every such file next to ``path`` into ``path``.
The launcher calls it when a job run with ``TANDEM_TIMELINE`` ends.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tandem.collectives.trace_files import rank_files

__all__ = ["merge_timeline"]


def merge_timeline(path: str) -> tuple[str, list[int]] | None:
    """Write the merged trace to ``path``; return (path, ranks merged), None if no files.

    A rank's file that is not valid trace JSON is skipped (named in ``otherData``).
    """
    files = rank_files(path)
    if not files:
        return None
    events: list[Any] = []
    merged, skipped, dropped = [], [], 0
    for rank, name in files.items():
        try:
            with open(name, encoding="utf-8") as f:
                data = json.load(f)
            events += data["traceEvents"]
            dropped += int(data.get("otherData", {}).get("dropped_events", 0))
            merged.append(rank)
        except (OSError, ValueError, KeyError, TypeError):
            skipped.append(name)
    out = {"traceEvents": events, "displayTimeUnit": "ms",
           "otherData": {"producer": "tandem", "ranks": merged, "skipped_files": skipped,
                         "dropped_events": dropped}}
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(out, f)
    os.replace(tmp, path)
    return path, merged
