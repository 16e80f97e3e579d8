"""Where flight-recorder dumps and timelines go, and how ranks are named in reports.

Shared by the ranks that write the files and by the tools that read them (the
launcher, ``python -m tandem.trace``), so it imports nothing but the standard
library: reading a dump never imports torch.
"""

from __future__ import annotations

import glob
import os
import re

from tandem._words import rank_list, who

__all__ = ["DUMP_FORMAT", "dump_path", "rank_file", "rank_files", "rank_list", "who"]

DUMP_FORMAT = "tandem-flight-recorder"


def dump_path(directory: str, rank: int) -> str:
    """``DIR/rank3.json``: rank 3's flight-recorder dump."""
    return os.path.join(directory, f"rank{rank}.json")


def rank_file(path: str, rank: int) -> str:
    """``out/trace.json`` -> ``out/trace.rank3.json``: where rank 3 writes its timeline."""
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext or '.json'}"


def rank_files(path: str) -> dict[int, str]:
    """Every rank's timeline file of ``path`` that exists: {rank: file}, by rank."""
    root, ext = os.path.splitext(path)
    ext = ext or ".json"
    name = re.compile(re.escape(os.path.basename(root)) + r"\.rank(\d+)" + re.escape(ext) + "$")
    out = {}
    for found in glob.glob(f"{glob.escape(root)}.rank*{glob.escape(ext)}"):
        m = name.match(os.path.basename(found))
        if m:
            out[int(m.group(1))] = found
    return dict(sorted(out.items()))
