"""Helpers shared by the fault tests (imported by the test modules and their ranks).

Rank functions catch their own errors and return :func:`attempt` records, so a test can
check the error type, its message, its attributes and how long it took on every rank,
instead of only seeing a traceback. Wall-clock stamps (``time.time()``) are comparable
across the processes of one host, so detection latency is measured from the moment a
rank killed itself.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

from tandem.testing import Outcome


def attempt(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Run ``fn``; describe how it ended (``ok``, error ``type``/``types``/``msg``, timing)."""
    start = time.monotonic()
    try:
        value = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - described for the test
        return {
            "ok": False,
            "type": type(exc).__name__,
            "types": [c.__name__ for c in type(exc).__mro__],
            "msg": str(exc),
            "missing": tuple(getattr(exc, "missing", ())),
            "rank": getattr(exc, "rank", None),
            "elapsed": time.monotonic() - start,
            "at": time.time(),
        }
    return {"ok": True, "value": value, "elapsed": time.monotonic() - start, "at": time.time()}


def kill_self_at(stamp: str | os.PathLike[str]) -> None:
    """Write the wall-clock time to ``stamp``, then SIGKILL this process."""
    Path(stamp).write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def read_stamp(stamp: str | os.PathLike[str]) -> float:
    return float(Path(stamp).read_text())


def values(outcomes: list[Outcome], ranks: list[int]) -> dict[int, Any]:
    """The returned values of ``ranks``; fail with their tracebacks if one did not return."""
    bad = [o for o in outcomes if o.rank in ranks and not o.ok]
    assert not bad, "\n".join(f"--- rank {o.rank} ({o.error_type}) ---\n{o.error}" for o in bad)
    return {o.rank: o.value for o in outcomes if o.rank in ranks}


def line_of(path: str | os.PathLike[str], marker: str) -> int:
    """The 1-based number of the only line of ``path`` that ends with ``# <marker>``."""
    hits = [i for i, line in enumerate(Path(path).read_text().splitlines(), start=1)
            if line.rstrip().endswith(f"# {marker}")]
    assert len(hits) == 1, f"marker {marker!r} found on lines {hits} of {path}"
    return hits[0]


def _noop(rank: int, world_size: int) -> None:
    return None


def warm_up() -> None:
    """Start the harness's fork server now (it preloads torch: seconds on a cold start), so
    that a launch whose deadline is part of the test does not spend it there."""
    from tandem.testing import launch

    assert launch(1, _noop, init=False, timeout=60)[0].ok
