"""Whether this process can create files in a folder, asked by creating one.

``os.access`` answers from the permission bits and says yes to everything for root, while
a read-only mount, /proc or a full quota still refuse the file written later::

    check_creatable(log_dir)  # raises the OSError the real write would meet
"""

from __future__ import annotations

import os

__all__ = ["check_creatable"]


def check_creatable(folder: str, name: str | None = None) -> None:
    """Create the file ``name`` (default: a probe of this process) in ``folder`` and remove
    it again unless it was there already; raise the OSError that creating it met."""
    path = os.path.join(folder, name or f".tandem-probe-{os.getpid()}")
    existed = os.path.lexists(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.close(fd)
    if not existed:
        os.remove(path)
