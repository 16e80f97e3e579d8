"""Wording shared by messages: a count with its noun in the right number."""

from __future__ import annotations

__all__ = ["counted"]


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``counted(1, "rank")`` is "1 rank", ``counted(3, "rank")`` "3 ranks"."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
