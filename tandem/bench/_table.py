"""A benchmark's table as aligned text or as Markdown (for the docs' benchmark pages)."""

from __future__ import annotations

from typing import Sequence

__all__ = ["render"]


def render(header: Sequence[str], body: Sequence[Sequence[str]], numeric: Sequence[bool],
           markdown: bool = False) -> str:
    """Rows of cells under ``header``; ``numeric`` columns align right."""
    if markdown:
        lines = ["| " + " | ".join(header) + " |",
                 "|" + "|".join("---:" if n else ":---" for n in numeric) + "|"]
        return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in body])
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    return "\n".join("  ".join(c.rjust(w) if n else c.ljust(w)
                               for c, w, n in zip(cells, widths, numeric))
                     for cells in [list(header), *body])
