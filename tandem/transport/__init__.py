"""Transports move tagged byte messages between ranks (tcp, shm, mixed, in-process loopback).

The public surface the upper layers use: :class:`Transport` (see its module,
``tandem.transport.base``), the message types (:class:`Header`, :class:`Kind`,
:class:`Slot`), :class:`Arena` (shared staging memory of same-host ranks) and the
concrete transports. Modules whose names start with ``_`` are internal.
"""

from tandem.transport.message import Header, Kind, Slot
from tandem.transport.mailbox import Mailbox
from tandem.transport.wait import wait_all
from tandem.transport.base import Transport
from tandem.transport._arena import Arena
from tandem.transport.loopback import LoopbackHub, LoopbackTransport
from tandem.transport.tcp import TcpTransport

__all__ = ["Header", "Kind", "Mailbox", "Slot", "Transport", "wait_all", "Arena", "LoopbackHub",
           "LoopbackTransport", "TcpTransport"]
