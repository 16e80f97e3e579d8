"""Wording shared by messages: a count with its noun in the right number, ranks as ranges."""

from __future__ import annotations

from typing import Iterable

__all__ = ["counted", "rank_list", "who", "in_order"]


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``counted(1, "rank")`` is "1 rank", ``counted(3, "rank")`` "3 ranks"."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


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
