"""Memory that grows with the world: what each connection to a peer holds.

At 8 hosts x 8 a rank held 56 TCP connections, each with its own read buffer; tandem's
own memory per rank was 2.9x its figure at 1 host x 8 (average PSS, 7.7 MB against 2.7).
"""

from __future__ import annotations

import socket

from tandem import _wire

PEERS = 56  # a rank's connections to other hosts at 8 hosts x 8


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_a_quiet_connection_holds_no_more_than_a_few_pages_of_read_buffer() -> None:
    pairs = [socket.socketpair() for _ in range(PEERS)]
    try:
        before = _rss_kb()
        readers = [_wire.BufferedReader(a) for a, _ in pairs]
        for (_, b), reader in zip(pairs, readers):  # a header's worth of traffic each
            b.sendall(b"x" * 40)
            assert reader.read(40) == b"x" * 40
        grown = _rss_kb() - before
        # a 64 KiB buffer each, zeroed whole, grew this process by 1.9 MB (measured)
        assert grown < PEERS * 16, f"{grown} KB for {PEERS} connections' read buffers"
        assert all(len(r.buf) == 64 << 10 for r in readers)  # the size itself is unchanged
    finally:
        for a, b in pairs:
            a.close()
            b.close()
