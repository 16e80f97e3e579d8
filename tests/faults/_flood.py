"""A stranger flooding a port: ``python _flood.py PORT N`` keeps N idle connections open.

Each connection says nothing; one the server drops is opened again at once. After
every round the process prints how many connections the server has taken in and
challenged so far (``greeted <count>``), so a test knows when the flood is in place.
Run as a process of its own, as an attacker would be, so that it does not share the
store's interpreter (and GIL). It exits when its standard input closes.
"""

from __future__ import annotations

import selectors
import socket
import sys
import threading
import time


def _open(port: int, wait: bool = False) -> socket.socket:
    s = socket.socket()
    if wait:  # connected before the next one starts, as a patient attacker does
        s.settimeout(2.0)
        try:
            s.connect(("127.0.0.1", port))
        except OSError:
            pass  # not taken in yet: it stays in the kernel's queue
    s.setblocking(False)
    if not wait:
        s.connect_ex(("127.0.0.1", port))  # completes in the background
    return s


def main(port: int, n: int) -> None:
    socks = [_open(port, wait=True) for _ in range(n)]
    greeted = 0
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    while not stop.is_set():
        with selectors.DefaultSelector() as sel:
            for s in socks:
                sel.register(s, selectors.EVENT_READ)
            ready = {key.fileobj for key, _ in sel.select(0.05)}
        for i, s in enumerate(socks):
            if s not in ready:
                continue
            try:
                if s.recv(4096):
                    greeted += 1
                    continue  # the server's challenge: stay, and never answer it
            except BlockingIOError:
                continue
            except OSError:
                pass
            s.close()  # dropped by the server: come back
            socks[i] = _open(port)
        print(f"greeted {greeted}", flush=True)
        time.sleep(0.01)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
