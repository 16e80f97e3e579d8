"""Transports move tagged byte messages between ranks (tcp, in-process loopback)."""

from tandem.transport.base import Header, Kind, Mailbox, Slot, Transport
from tandem.transport.wait import wait_all
from tandem.transport.loopback import LoopbackHub, LoopbackTransport
from tandem.transport.tcp import TcpTransport

__all__ = ["Header", "Kind", "Mailbox", "Slot", "Transport", "wait_all", "LoopbackHub",
           "LoopbackTransport", "TcpTransport"]
