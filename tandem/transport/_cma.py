"""Cross-memory attach: read a same-host peer's memory in one copy (``process_vm_readv``).

The shm transport streams payloads through a ring: the sender copies them in, the
receiver copies them out, a ring-sized piece at a time, with a wake-up per piece.
For a large payload the sender can instead name where its bytes are (address,
length) and the receiver's kernel copies them straight into the destination: one
copy, no wake-ups in between. The sender keeps that memory alive and unchanged until
the receiver acknowledges it (:mod:`~tandem.transport._shm_peer`).

The kernel allows it only where ptrace would be allowed (same user and, under Yama's
``ptrace_scope`` >= 1, more); containers may forbid it. So a receiver first probes:
it reads a word the sender published at a known address of the sender's own memory
(:func:`probe`); only after that succeeded does the sender use the path, and any
refusal leaves the ring path in place. Measured on a 2-core VM: 16 MB read in 3-5 ms
into memory already faulted in (about one memcpy), against two ring copies with a
wake-up per 1 MiB piece.

    read_from(pid, dst_address, src_address, nbytes)   # raises OSError
    write_to(pid, dst_address, src_address, nbytes)    # the other way (dst is the peer's)

Shared-memory collectives also use both directions on tensors (see
``tandem.collectives.algorithms.shm_direct``): there :func:`may_write` proves the
write direction too, since a write is what they do to a peer.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np

__all__ = ["available", "read_from", "write_to", "probe", "may_write", "address_of_view"]


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_readv = None
_writev = None
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _readv, _writev = _libc.process_vm_readv, _libc.process_vm_writev  # both release the GIL
    for _fn in (_readv, _writev):
        _fn.restype = ctypes.c_ssize_t
        _fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                        ctypes.c_ulong, ctypes.c_ulong]
except (AttributeError, OSError):  # not Linux, or a libc without them
    _readv = _writev = None


def available() -> bool:
    return _readv is not None


def read_from(pid: int, dst: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``src`` of process ``pid`` to ``dst`` of this one."""
    assert _readv is not None
    _move(_readv, "process_vm_readv from", pid, dst, src, nbytes)


def write_to(pid: int, dst: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``src`` of this process to ``dst`` of process ``pid``."""
    assert _writev is not None
    _move(_writev, "process_vm_writev to", pid, src, dst, nbytes)


def _move(call: Any, what: str, pid: int, local_at: int, remote_at: int, nbytes: int) -> None:
    local, remote = _Iovec(local_at, nbytes), _Iovec(remote_at, nbytes)
    done = 0
    while done < nbytes:  # the kernel may move less than asked (a partial copy)
        local.base, local.len = local_at + done, nbytes - done
        remote.base, remote.len = remote_at + done, nbytes - done
        n = call(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if n <= 0:
            err = ctypes.get_errno() if n < 0 else 0
            raise OSError(err, f"{what} pid {pid} moved nothing at byte {done} of {nbytes}: "
                               f"{os.strerror(err) if err else 'EOF'}")
        done += n


def probe(pid: int, address: int, expected: int) -> bool:
    """Whether this process may read ``pid``'s memory: the u64 at ``address`` there must
    read back as ``expected``."""
    if _readv is None or not pid or not address:
        return False
    word = ctypes.c_uint64(0)
    try:
        read_from(pid, ctypes.addressof(word), address, 8)
    except OSError:
        return False
    return word.value == expected


def may_write(pid: int, address: int, expected: int) -> bool:
    """Whether this process may also write ``pid``'s memory: the u64 at ``address`` there
    (which reads as ``expected``) is written back with the value it already holds."""
    if _writev is None or not probe(pid, address, expected):
        return False
    word = ctypes.c_uint64(expected)
    try:
        write_to(pid, address, ctypes.addressof(word), 8)
    except OSError:
        return False
    return True


def address_of_view(view: memoryview) -> int:
    """The address of a (possibly read-only) contiguous byte view's first byte."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
