"""Reading what ``_probe.py`` prints: one JSON object per rank."""

from __future__ import annotations

import json
import re
from typing import Any


def rank_reports(text: str) -> list[dict[str, Any]]:
    """Every rank's report in ``text``, by rank. Found by pattern, not by line: a
    scheduler that forwards several ranks' output may run two reports into one line."""
    rows = [json.loads(m.group(0)) for m in re.finditer(r"\{[^{}]*\}", text)]
    return sorted(rows, key=lambda r: int(r["rank"]))
