"""``python -m tandem.trace DIR`` or ``python -m tandem.trace --timeline PATH``."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from tandem.trace.analyze import report
from tandem.trace.merge import merge_timeline

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tandem.trace",
        description="Say where the ranks of a job diverged, from their flight-recorder "
                    "dumps (TANDEM_TRACE_DIR); or merge the ranks' timeline files.")
    parser.add_argument("directory", nargs="?", help="a directory of rank<N>.json dumps")
    parser.add_argument("--timeline", metavar="PATH",
                        help="merge PATH's per-rank files (<stem>.rank<N>.json) into PATH")
    args = parser.parse_args(argv)
    if (args.directory is None) == (args.timeline is None):
        parser.error("give either a dump directory or --timeline PATH")
    if args.timeline is not None:
        merged = merge_timeline(args.timeline)
        if merged is None:
            print(f"no per-rank timeline files for {args.timeline}", file=sys.stderr)
            return 1
        path, ranks = merged
        print(f"merged the timelines of ranks {', '.join(map(str, ranks))} into {path}")
        return 0
    lines = report(args.directory)
    print("\n".join(lines))
    return 0 if not lines[-1].startswith("no flight-recorder dumps") else 1


if __name__ == "__main__":
    sys.exit(main())
