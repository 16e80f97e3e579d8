"""What tandem logged in this process, kept for a test or a benchmark to check.

A rank that must report what it logged (stall reports, unreceived sends) installs a
capture before the call and returns its records::

    from tandem.testing.logs import capture_stall_reports
    reports = capture_stall_reports()
    start = time.monotonic()
    ...                                     # a call that waits for a stopped rank
    return reports.since(start)             # [(seconds into the call, text), ...]
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

__all__ = ["LogCapture", "capture_logs", "capture_stall_reports", "STALL_REPORT"]

STALL_REPORT = "has waited"  # in every stall report: "tandem: rank 0 has waited 1 s in ..."


class LogCapture(logging.Handler):
    """Keeps each message that contains ``containing`` (every message if it is empty),
    with the ``time.monotonic()`` it was logged at; ``then(text)`` runs after each one kept."""

    def __init__(self, containing: str = "", then: Callable[[str], None] | None = None) -> None:
        super().__init__()
        self.containing = containing
        self.then = then
        self.records: list[tuple[float, str]] = []
        self._kept = threading.Lock()  # the watchdog's thread logs beside the caller's

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if self.containing not in text:
            return
        with self._kept:
            self.records.append((time.monotonic(), text))
        if self.then is not None:
            self.then(text)

    def messages(self) -> list[str]:
        """The texts kept so far, in the order they were logged."""
        with self._kept:
            return [text for _, text in self.records]

    def since(self, start: float) -> list[tuple[float, str]]:
        """``(seconds after start, text)`` for each message kept, ``start`` a monotonic time."""
        with self._kept:
            return [(at - start, text) for at, text in self.records]


def capture_logs(containing: str = "", then: Callable[[str], None] | None = None,
                 logger: str = "tandem") -> LogCapture:
    """A :class:`LogCapture` added to ``logger`` (tandem's by default) from now on."""
    handler = LogCapture(containing, then)
    logging.getLogger(logger).addHandler(handler)
    return handler


def capture_stall_reports(then: Callable[[str], None] | None = None) -> LogCapture:
    """Keeps tandem's stall reports (the watchdog's "rank R has waited N s in ..." texts)."""
    return capture_logs(STALL_REPORT, then)
