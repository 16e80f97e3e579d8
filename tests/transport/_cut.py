"""Breaking a transport from inside, as a killed process would: for the failure tests.

``cut_message`` writes a message's header and only part of its payload (a sender
killed in the middle of a send); ``vanish`` closes every connection without a word
(what the kernel does for a SIGKILLed process).
"""

from __future__ import annotations

from tandem.transport import Header, Transport
from tandem.transport.shm import ShmTransport
from tandem.transport.tcp import TcpTransport


def cut_message(sender: Transport, peer: int, header: Header, part: bytes) -> None:
    """Write ``header`` and only ``part`` of its payload, as a sender killed mid-send."""
    if isinstance(sender, TcpTransport):
        from tandem.transport.tcp import _HDR

        head = _HDR.pack(header.kind, header.group, header.seq, header.step, header.nbytes,
                         0, 0)
        sender._peers[peer].sock.sendall(head + part)
    else:
        from tandem.transport._shm_peer import frame

        assert isinstance(sender, ShmTransport)
        sender._peers[peer].outbound.write(frame(header, memoryview(part)), lambda: None)


def vanish(t: Transport) -> None:
    """Vanish as a SIGKILLed process would: connections close, nothing is said."""
    if isinstance(t, TcpTransport):
        t._closing = True
        for p in t._peers.values():
            p.sock.shutdown(2)
    else:
        assert isinstance(t, ShmTransport)
        for p in t._peers.values():
            p.sock.shutdown(2)
