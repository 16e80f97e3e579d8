"""Delay (and optionally drop) the packets a simulated host receives, where netem is missing.

Run inside one host's namespace by :class:`tandem.testing.netns.NetnsLab`::

    ip netns exec HOST python -m tandem.testing._delay --iface eth0 --delay 0.0002 \\
        [--loss 0.001] [--seed 7] [--parent PID]

Every IPv4 packet arriving on ``--iface`` is queued in the kernel (``_netlink``: an
nf_tables rule owned by this process, so it disappears with it) and released
``--delay`` seconds after it arrived, in arrival order; with ``--loss`` each packet is
dropped with that probability instead. Only packet ids cross into this process, never
payloads, and one verdict releases every packet that is due, so the cost is a few
microseconds per (GSO-sized) packet. Prints ``ready`` once packets are being queued.

Why not netem: ``sch_netem`` is a kernel option that some kernels (this project's
test machine's among them) are built without. Delaying at the receiver rather than
at the sender also keeps the sender's TCP small-queue accounting out of it: a packet
held here has already left the sending host, as it would on a wire.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import os
import random
import select
import sys
import time
from typing import Sequence

from tandem.testing._netlink import PacketQueue, queue_rule

__all__ = ["main"]

_PR_SET_PDEATHSIG = 1
_PR_SET_TIMERSLACK = 29


def _tight_timers() -> None:
    """Wake within microseconds of the deadline, ahead of the processes being measured.

    The default timer slack is 50 us. Real-time priority: on a machine whose cores are
    all busy, a normal process waited milliseconds for a core and a 0.2 ms delay became
    3 ms (load 17 on 2 cores); this process only sleeps or releases packets.
    """
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50))
    except (OSError, AttributeError):
        with contextlib.suppress(OSError):
            os.nice(-20)


def _die_with(parent: int) -> None:
    """Exit when ``parent`` (the lab that started this process) does, however it ends.

    A lab killed outright cannot stop this process, and a real-time process left
    behind in a namespace keeps its rule and its priority on the machine.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, 9, 0, 0, 0)  # SIGKILL
    if parent and os.getppid() != parent:  # it ended before the line above
        raise SystemExit(1)


def relay(queue: PacketQueue, delay: float, loss: float, rng: random.Random) -> None:
    """Release each queued packet ``delay`` seconds after it arrived; never returns."""
    due: collections.deque[tuple[float, int]] = collections.deque()  # (release time, id)
    while True:
        wait = None if not due else max(0.0, due[0][0] - time.monotonic())
        select.select([queue], [], [], wait)
        arrived = time.monotonic()
        for packet in queue.receive():
            if loss and rng.random() < loss:
                queue.drop(packet)
            else:
                due.append((arrived + delay, packet))
        now = time.monotonic()
        last = -1
        while due and due[0][0] <= now:
            last = due.popleft()[1]
        if last >= 0:
            queue.accept_through(last)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.testing._delay")
    parser.add_argument("--iface", default="eth0")
    parser.add_argument("--queue", type=int, default=0)
    parser.add_argument("--delay", type=float, required=True, help="seconds")
    parser.add_argument("--loss", type=float, default=0.0, help="probability, 0..1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parent", type=int, default=0, help="exit when this process does")
    args = parser.parse_args(argv)
    _die_with(args.parent)
    _tight_timers()
    queue = PacketQueue(args.queue)  # bound first, so no packet meets a queue without reader
    rule = queue_rule(args.iface, args.queue)
    print("ready", flush=True)
    try:
        relay(queue, args.delay, args.loss, random.Random(args.seed))
    finally:
        rule.close()
        queue.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
