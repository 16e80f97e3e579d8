"""The live checkpoint: a snapshot sent from a member that holds it to one that does not.

A joining worker gets the model, the optimizer state and the user's values from a live
peer over the process group's transport, not from disk. What travels is checked
before anything of it is used::

    header = pack(snap)                     # (bytes to send first, payload)
    snap = unpack(header, payload, sender)  # ProtocolError unless intact

The header (fixed size) carries a magic, a version, the payload's length, the commit
number and a BLAKE2b digest of the payload; the payload is ``torch.save`` of the
snapshot, read back with ``torch.load(weights_only=True)`` (tensors and plain
containers only, no code runs). A transfer cut short, a payload of the wrong length,
one whose bytes changed, or a header that is not one is refused with
:class:`~tandem.errors.ProtocolError` naming the sender; the receiver's model is
untouched then.
"""

from __future__ import annotations

import hashlib
import io
import struct

import torch

from tandem.collectives.group import ProcessGroup
from tandem.collectives.p2p import recv, send
from tandem.elastic._snapshot import Snapshot
from tandem.errors import CollectiveMismatchError, ProtocolError

__all__ = ["pack", "unpack", "send_snapshot", "recv_snapshot", "HEADER_BYTES"]

_MAGIC = b"TNDMLIVE"
_VERSION = 1
_FORMAT = "<8sIQQ32s"  # magic, version, payload length, commit, digest
HEADER_BYTES = struct.calcsize(_FORMAT)
_TAG = 0x7E1A  # p2p tag of live checkpoints (headers and payloads travel in order)


def _digest(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=32).digest()


def pack(snap: Snapshot) -> tuple[bytes, bytes]:
    """(header, payload) for ``snap``."""
    buf = io.BytesIO()
    torch.save(snap.as_dict(), buf)
    payload = buf.getvalue()
    header = struct.pack(_FORMAT, _MAGIC, _VERSION, len(payload), snap.commit, _digest(payload))
    return header, payload


def read_header(header: bytes, sender: int, limit: int) -> tuple[int, int, bytes]:
    """(payload length, commit, digest) from ``header``; ProtocolError if it is not one."""
    if len(header) != HEADER_BYTES:
        raise ProtocolError(f"live checkpoint from rank {sender}: a {len(header)}-byte header, "
                            f"expected {HEADER_BYTES}")
    magic, version, length, commit, digest = struct.unpack(_FORMAT, header)
    if magic != _MAGIC or version != _VERSION:
        raise ProtocolError(f"live checkpoint from rank {sender}: not a tandem live checkpoint "
                            f"header (magic {magic!r}, version {version})")
    if length > limit:
        raise ProtocolError(f"live checkpoint from rank {sender} announces {length} bytes; "
                            f"the cap is {limit} (TANDEM_MAX_FRAME)")
    return length, commit, digest


def unpack(header: bytes, payload: bytes | memoryview, sender: int, limit: int) -> Snapshot:
    """The snapshot in ``payload``, after checking it against ``header``."""
    length, commit, digest = read_header(header, sender, limit)
    if len(payload) != length:
        raise ProtocolError(f"live checkpoint from rank {sender} is truncated or padded: "
                            f"{len(payload)} bytes arrived, the header announced {length}; "
                            f"refused")
    if _digest(payload) != digest:
        raise ProtocolError(f"live checkpoint from rank {sender}: its {length} bytes do not "
                            f"match the digest in its header (corrupted in transit); refused")
    data = torch.load(io.BytesIO(payload), weights_only=True)
    snap = Snapshot.from_dict(data)
    if snap.commit != commit:
        raise ProtocolError(f"live checkpoint from rank {sender}: its header says commit "
                            f"{commit}, its payload {snap.commit}; refused")
    return snap


def send_snapshot(group: ProcessGroup, dst: int, header: bytes, payload: bytes) -> None:
    """Send a packed snapshot to group rank ``dst`` (blocking)."""
    send(torch.frombuffer(bytearray(header), dtype=torch.uint8), group_dst=dst, group=group,
         tag=_TAG)
    if payload:
        send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), group_dst=dst,
             group=group, tag=_TAG)


def recv_snapshot(group: ProcessGroup, src: int, limit: int) -> Snapshot:
    """Receive and check a snapshot from group rank ``src`` (blocking)."""
    sender = group.ranks[src]
    head = torch.empty(HEADER_BYTES, dtype=torch.uint8)
    recv(head, group_src=src, group=group, tag=_TAG)
    header = head.numpy().tobytes()
    length, _, _ = read_header(header, sender, limit)
    body = torch.empty(length, dtype=torch.uint8)
    if length:
        try:
            recv(body, group_src=src, group=group, tag=_TAG)
        except CollectiveMismatchError as exc:  # the payload's size is not the announced one
            raise ProtocolError(f"live checkpoint from rank {sender} does not have the "
                                f"{length} bytes its header announced; refused: {exc}") from exc
    return unpack(header, body.numpy().tobytes(), sender, limit)
