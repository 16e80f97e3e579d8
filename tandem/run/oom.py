"""Whether the kernel's OOM killer killed a worker: its line in the kernel log.

A worker the kernel kills for memory dies of SIGKILL with nothing recorded, like one
killed by hand; the kernel log (``/dev/kmsg``, readable by root) tells the two apart.
"""

from __future__ import annotations

import os
import time

__all__ = ["oom_kill_line"]

MAX_RECORDS = 200_000  # the kernel's log buffer holds far fewer; a bound on the scan
WINDOW = 300.0  # a log line this long before the exit was seen may still be this worker's


def oom_kill_line(pid: int, exit_time: float, kmsg: str = "/dev/kmsg") -> str:
    """The kernel's "Killed process PID (...)" line for ``pid``, logged up to ``WINDOW`` s
    before ``exit_time`` (wall clock), or "" when there is none or the log is unreadable."""
    try:
        fd = os.open(kmsg, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return ""
    needle = f"Killed process {pid} ("
    found = ""
    # each record's stamp is microseconds of the monotonic clock: map it to wall time
    offset = time.time() - time.monotonic()
    try:
        for _ in range(MAX_RECORDS):
            try:
                record = os.read(fd, 8192)  # one record per read (of /dev/kmsg)
            except BlockingIOError:
                break  # read to the end
            except OSError:
                continue  # overwritten while read (EPIPE): go on with the next
            if not record:
                break
            for entry in record.decode(errors="replace").splitlines():
                head, _, text = entry.partition(";")
                fields = head.split(",")
                if needle not in text or len(fields) < 3 or not fields[2].isdigit():
                    continue
                if exit_time - WINDOW <= int(fields[2]) / 1e6 + offset <= exit_time + 5:
                    found = text.strip()
    finally:
        os.close(fd)
    return found
