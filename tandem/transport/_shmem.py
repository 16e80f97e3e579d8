"""Operating-system pieces of the shared-memory transport: segments, futexes, a fence.

Segments are anonymous: ``memfd_create`` gives memory with no name at all, so a
crash can never leave one behind, and Docker's small default ``/dev/shm`` (64 MB)
does not limit it. Where ``memfd_create`` is missing or forbidden, or when a
directory is asked for, the segment is a file created there with ``O_EXCL`` and
mode 0600 under an unguessable name and unlinked at once; only the file
descriptor lives on, and it is handed to the peer over an authenticated UNIX
socket (``SCM_RIGHTS``). Memory is reserved (``posix_fallocate``) before it is
touched, so a full or unwritable ``/dev/shm`` fails with a clear message instead of
a ``SIGBUS`` on first touch: all of it up front, or (a ring) the first part, the rest
by its writer as its writes reach it (:func:`reserve_more`)::

    fd = create_segment(4 << 20)                  # memfd
    fd = create_segment(4 << 20, "/dev/shm")      # named, 0600, unlinked at once

Waiting uses Linux futexes on words inside the segment (``futex_wait`` releases
the GIL; process-shared, so it wakes across processes).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import secrets
import sys
import threading

from tandem._proc import process_alive
from tandem.errors import NetworkError

__all__ = ["unsupported_reason", "create_segment", "reserve_more", "futex_wait", "futex_wake", "fence",
           "address_of", "sweep_stale"]

_SYS_FUTEX = {"x86_64": 202}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_PREFIX = "tandem-shm-"


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def unsupported_reason() -> str:
    """Why this machine cannot run the shm transport, or "" when it can."""
    if not sys.platform.startswith("linux"):
        return f"it needs Linux (futexes, SCM_RIGHTS), this is {sys.platform}"
    if _SYS_FUTEX is None:
        # the ring publishes data with plain stores: correct under x86-64's total store
        # order, not on weakly ordered CPUs without fences Python cannot emit
        return f"it needs an x86-64 CPU (memory ordering), this is {platform.machine()}"
    return ""


_syscall = None
if not unsupported_reason():
    _syscall = ctypes.CDLL(None, use_errno=True).syscall
    _syscall.restype = ctypes.c_long
    _syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint,
                         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]


def futex_wait(addr: int, expected: int, timeout: float) -> None:
    """Sleep while the 32-bit word at ``addr`` equals ``expected`` (or until woken/timeout)."""
    ts = _Timespec(int(timeout), int((timeout % 1) * 1e9))
    assert _syscall is not None
    _syscall(_SYS_FUTEX, addr, _FUTEX_WAIT, expected & 0xFFFFFFFF, ctypes.addressof(ts), None, 0)


def futex_wake(addr: int) -> None:
    """Wake every thread (of any process) sleeping on the word at ``addr``."""
    assert _syscall is not None
    _syscall(_SYS_FUTEX, addr, _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier (store -> load ordering), which x86 otherwise lacks.

    Python cannot emit ``mfence``; acquiring and releasing a lock runs glibc's
    ``sem_wait``/``sem_post``, whose ``lock``-prefixed instructions are full
    barriers on x86. Used between "publish my counter" and "is the peer asleep?".
    """
    _fence_lock.acquire()
    _fence_lock.release()


def address_of(buffer: object) -> int:
    """The address of a writable buffer's first byte (the export is released at once)."""
    char = ctypes.c_char.from_buffer(buffer)  # type: ignore[arg-type]
    try:
        return ctypes.addressof(char)
    finally:
        del char


def _size(fd: int, size: int) -> None:
    """Give the segment its length (nothing reserved: a sparse file)."""
    try:
        os.ftruncate(fd, size)
    except OSError as exc:
        os.close(fd)
        raise NetworkError(f"cannot size a {size}-byte shared-memory segment: {exc}") from exc


def _reserve(fd: int, size: int, where: str) -> None:
    try:
        reserve_more(fd, 0, size, where)
    except NetworkError:
        os.close(fd)
        raise


def reserve_more(fd: int, offset: int, length: int, where: str = "memory (memfd)") -> None:
    """Reserve ``length`` bytes of segment ``fd`` from ``offset``: a full ``/dev/shm`` (or
    a machine short of memory) fails here with a clear message, not a ``SIGBUS`` on touch."""
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        hint = ""
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT):
            hint = (f"; {where} is full: free space there (df -h {where}), give the container "
                    f"more (docker --shm-size) or use backend='tcp'"
                    if where.startswith("/") else "; the machine is short of memory")
        raise NetworkError(
            f"cannot reserve {length / 2**20:.1f} MiB of shared memory in {where}: "
            f"{exc.strerror or exc}{hint}") from exc


def create_segment(size: int, directory: str | None = None, label: str = "tandem-ring",
                   reserve: int | None = None) -> int:
    """A file descriptor of ``size`` zeroed bytes of shared memory, owned by nobody's name
    (``label`` only shows in ``/proc/PID/maps``); the first ``reserve`` bytes (all by
    default) are reserved now, the rest must be (:func:`reserve_more`) before any touch."""
    if directory is None and hasattr(os, "memfd_create"):
        try:
            fd = os.memfd_create(label, os.MFD_CLOEXEC)
        except OSError as exc:
            if exc.errno not in (errno.ENOSYS, errno.EPERM, errno.EACCES):
                raise NetworkError(f"memfd_create failed: {exc}") from exc
        else:
            _size(fd, size)
            _reserve(fd, size if reserve is None else min(reserve, size), "memory (memfd)")
            return fd
    where = directory or "/dev/shm"
    path = os.path.join(where, f"{_PREFIX}{os.getpid()}-{secrets.token_hex(16)}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise NetworkError(
            f"cannot create a shared-memory segment in {where}: {exc.strerror or exc} "
            f"({path}); make {where} writable for this user, or use backend='tcp'") from exc
    os.unlink(path)  # from here on only the descriptor exists: nothing can be left behind
    _size(fd, size)
    _reserve(fd, size if reserve is None else min(reserve, size), where)
    return fd


def sweep_stale(directory: str = "/dev/shm") -> int:
    """Remove this user's segments whose creating process is gone; return how many.

    A name lives only between ``open`` and ``unlink`` above, so this finds something
    only after a kill in that instant; the next start cleans it up.
    """
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(_PREFIX):
            continue
        path = os.path.join(directory, name)
        try:
            pid = int(name[len(_PREFIX):].split("-", 1)[0])
            if os.stat(path).st_uid != os.getuid() or process_alive(pid):
                continue
            os.unlink(path)
            removed += 1
        except (ValueError, OSError):
            continue
    return removed
