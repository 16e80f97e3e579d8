"""Socket buffers of data connections: small within one machine, large between hosts.

Between hosts the buffers must cover the bandwidth-delay product; within one machine
very large ones made tcp collectives 2-4x slower on a crowded machine, very small ones
20-30% slower on an idle one (``tandem._wire.tune``). The cross-host half runs in
network namespaces (``tests/netns/test_netns_links.py``).
"""

from __future__ import annotations

import socket

from tandem import _wire


def test_a_loopback_connection_gets_small_buffers_on_both_ends() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = _wire.connect("127.0.0.1", server.getsockname()[1], 5.0, "test server")
        accepted, _ = server.accept()
        with client, accepted:
            _wire.tune(accepted)
            for sock in (client, accepted):
                for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                    # Linux reports twice what was set (bookkeeping overhead)
                    assert sock.getsockopt(socket.SOL_SOCKET, opt) == 2 * (1 << 20)
