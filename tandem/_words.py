"""Wording shared by messages: a count with its noun in the right number, ranks as ranges,
durations to three significant digits."""

from __future__ import annotations

import math
from typing import Iterable

__all__ = ["counted", "rank_list", "who", "in_order", "secs"]


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``counted(1, "rank")`` is "1 rank", ``counted(3, "rank")`` "3 ranks"."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def secs(value: float) -> str:
    """A duration in seconds as messages show it: three significant digits, so a positive
    one never shows as 0 (``{:.1f}`` made a 0.04 s timeout "0.0s"), and no exponent:
    0.000123, 0.04, 1.5, 30, 1800."""
    if not math.isfinite(value) or value == 0:
        return f"{value:g}"
    digits = max(0, 2 - math.floor(math.log10(abs(value))))
    text = f"{value:.{digits}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def rank_list(ranks: Iterable[int]) -> str:
    """``0-3, 7``: sorted ranks with consecutive runs collapsed."""
    rs = sorted(set(ranks))
    out: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ", ".join(out)


def who(ranks: Iterable[int]) -> str:
    """``rank 3`` or ``ranks 0-2, 5``."""
    rs = sorted(set(ranks))
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {rank_list(rs)}"


def in_order(ranks: Iterable[int], most: int | None = None) -> str:
    """``[4, 1-3]``: ranks in their given order (a group's), rising runs collapsed, so a
    message about a 64-rank group stays one line; past ``most`` runs, ``...`` and the
    count (a list an outsider passed may hold a million scattered ranks)."""
    out: list[str] = []
    run: list[int] = []
    count = 0
    for r in ranks:
        count += 1
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [r]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    if most is not None and len(out) > most:
        return "[" + ", ".join(out[:most]) + f", ... ({count} ranks)]"
    return "[" + ", ".join(out) + "]"
