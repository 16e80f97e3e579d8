"""Large payloads read with a low-water mark (``BufferedReader(wake_bytes=...)``).

The reader wakes once per ``wake_bytes`` arrived instead of once per packet. The
hazard is a mark above what a payload still lacks while its sender waits for an
answer: the reader would never wake. These tests send payloads whose tail is shorter
than the mark and then go quiet, and check that what follows (a header, read with the
mark back at 1) still arrives.
"""

from __future__ import annotations

import socket
import threading
from typing import Callable, Iterator

import pytest

from tandem import _wire
from tandem.errors import NetworkError

pytestmark = pytest.mark.procs

_MARK = 512 << 10
_DEADLINE_S = 20.0


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[socket.socket, socket.socket]]:
    # the reader's periodic re-poll would hide a mark that is never reached (as a 1 s
    # stall per step): past the test's deadline, such a mark shows as a hang
    monkeypatch.setattr(_wire, "_LOWAT_POLL_MS", int(2 * _DEADLINE_S * 1000))
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = _wire.connect("127.0.0.1", server.getsockname()[1], 5.0, "test server")
        accepted, _ = server.accept()
        with client, accepted:
            _wire.tune(client)
            _wire.tune(accepted)
            yield client, accepted


def _in_thread(fn: Callable[[], object]) -> list[object]:
    """Run ``fn`` on a thread; its result (or exception) once it ends within the deadline."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(_DEADLINE_S)
    assert not t.is_alive(), f"the reader did not finish within {_DEADLINE_S}s"
    return out


@pytest.mark.parametrize("size", [_MARK + 1, 3 * _MARK + 12345, 8 << 20])
def test_a_payload_whose_tail_is_below_the_mark_arrives_whole(
        pair: tuple[socket.socket, socket.socket], size: int) -> None:
    sender, receiver = pair
    payload = bytes(i % 251 for i in range(size))
    reader = _wire.BufferedReader(receiver, wake_bytes=_MARK)
    got = bytearray(size)

    def read() -> bytes:
        reader.read_into(memoryview(got))
        return reader.read(8)  # with the mark still set this would wait for _MARK bytes

    writer = threading.Thread(target=lambda: sender.sendall(payload + b"12345678"))
    writer.start()
    result = _in_thread(read)
    writer.join(_DEADLINE_S)
    assert result == [b"12345678"]
    assert got == payload
    assert receiver.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1


def test_a_payload_cut_short_by_a_closed_connection_fails_at_once(
        pair: tuple[socket.socket, socket.socket]) -> None:
    sender, receiver = pair
    reader = _wire.BufferedReader(receiver, wake_bytes=_MARK)
    sender.sendall(b"x" * (_MARK + 1000))
    sender.shutdown(socket.SHUT_WR)
    result = _in_thread(lambda: reader.read_into(memoryview(bytearray(4 * _MARK))))
    assert isinstance(result[0], NetworkError), result
    assert "connection closed after" in str(result[0])
