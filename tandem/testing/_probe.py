"""Measure a simulated link from inside its namespaces: round trips and TCP throughput.

Run by :class:`tandem.testing.netns.NetnsLab` (``lab.ping``, ``lab.throughput``)::

    ip netns exec H0 python -m tandem.testing._probe ping 10.77.3.2 --count 20
    ip netns exec H1 python -m tandem.testing._probe sink --seconds 3     # prints its port
    ip netns exec H0 python -m tandem.testing._probe source 10.77.3.2 PORT --seconds 2

``ping`` sends ICMP echo requests from a raw socket (root) one at a time and prints
each round trip in seconds (``null`` when no reply came within ``--wait``), as JSON.
``sink`` accepts one connection and prints ``{"bytes": N, "seconds": T}`` for what
arrived after the first ``--skip`` seconds (TCP's ramp-up), until the sender closed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
import time
from typing import Sequence

__all__ = ["main", "ping"]

_ECHO_REQUEST, _ECHO_REPLY = 8, 0


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def ping(addr: str, count: int, wait: float, interval: float) -> list[float | None]:
    """Round-trip seconds of ``count`` echo requests to ``addr`` (None: no reply in ``wait``)."""
    ident = os.getpid() & 0xFFFF
    payload = b"tandem-probe".ljust(56, b".")
    out: list[float | None] = []
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as sock:
        for seq in range(count):
            bare = struct.pack("!BBHHH", _ECHO_REQUEST, 0, 0, ident, seq) + payload
            packet = struct.pack("!BBHHH", _ECHO_REQUEST, 0, _checksum(bare), ident, seq) + payload
            start = time.perf_counter()
            sock.sendto(packet, (addr, 0))
            rtt = None
            while rtt is None:
                left = start + wait - time.perf_counter()
                if left <= 0:
                    break
                sock.settimeout(left)
                try:
                    reply = sock.recv(2048)
                except socket.timeout:
                    break
                at = (reply[0] & 0x0F) * 4  # past the IP header
                kind, _, _, rid, rseq = struct.unpack_from("!BBHHH", reply, at)
                if (kind, rid, rseq) == (_ECHO_REPLY, ident, seq):
                    rtt = time.perf_counter() - start
            out.append(rtt)
            time.sleep(interval)
    return out


def _sink(seconds: float, skip: float) -> dict[str, float]:
    with socket.create_server(("0.0.0.0", 0)) as server:
        print(server.getsockname()[1], flush=True)
        server.settimeout(seconds)
        conn, _ = server.accept()
    buf = bytearray(1 << 20)
    counted, first, mark = 0, 0.0, 0.0
    with conn:
        conn.settimeout(seconds)
        while True:
            n = conn.recv_into(buf)
            now = time.perf_counter()
            if not n:
                break
            if not first:
                first = now
            if now - first >= skip:
                if not mark:
                    mark = now
                else:
                    counted += n
    return {"bytes": counted, "seconds": max(0.0, now - mark) if mark else 0.0}


def _source(addr: str, port: int, seconds: float) -> None:
    data = memoryview(bytearray(1 << 20))
    with socket.create_connection((addr, port), timeout=seconds + 10) as sock:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            sock.sendall(data)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.testing._probe")
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("ping")
    p.add_argument("addr")
    p.add_argument("--count", type=int, default=20)
    p.add_argument("--wait", type=float, default=1.0)
    p.add_argument("--interval", type=float, default=0.01)
    s = sub.add_parser("sink")
    s.add_argument("--seconds", type=float, default=10.0, help="give up after this long idle")
    s.add_argument("--skip", type=float, default=0.3)
    src = sub.add_parser("source")
    src.add_argument("addr")
    src.add_argument("port", type=int)
    src.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args(argv)
    if args.what == "ping":
        print(json.dumps(ping(args.addr, args.count, args.wait, args.interval)))
    elif args.what == "sink":
        print(json.dumps(_sink(args.seconds, args.skip)))
    else:
        _source(args.addr, args.port, args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
