"""One benchmark rank on a simulated host: ``python -m tandem.bench._host_rank SPEC RANK WORLD OUT``.

Started by :class:`tandem.bench._hosts.Hosts` inside the host's namespace (or forked
by the host's zygote, :mod:`tandem.bench._host_zygote`, which calls :func:`run_rank`).
``SPEC`` is a JSON file naming a module-level function and its arguments; the rank
calls ``function(RANK, WORLD, *args)`` with one torch thread and writes the result as
JSON to ``OUT`` (atomically, so a half-written result is never read). A failure exits
non-zero with the traceback in the rank's log.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any


def load(spec_path: str) -> tuple[dict[str, Any], Any]:
    """The spec in ``spec_path`` and the function it names (its module imported)."""
    with open(spec_path) as f:
        spec: dict[str, Any] = json.load(f)
    fn: Any = importlib.import_module(spec["module"])
    for name in spec["function"].split("."):
        fn = getattr(fn, name)
    return spec, fn


def run_rank(spec: dict[str, Any], fn: Any, rank: int, world: int, out: str) -> None:
    """``fn(rank, world, *args)`` with one torch thread; its result written to ``out``."""
    import torch

    torch.set_num_threads(1)
    result = fn(rank, world, *spec["args"])
    with open(out + ".tmp", "w") as f:
        json.dump(result, f)
    os.rename(out + ".tmp", out)


def main(argv: list[str]) -> int:
    spec_path, rank, world, out = argv[0], int(argv[1]), int(argv[2]), argv[3]
    import torch  # noqa: F401 - before the spec's module, as the rank always did

    spec, fn = load(spec_path)
    run_rank(spec, fn, rank, world, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
