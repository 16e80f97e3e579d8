"""The shared-memory byte ring, in one process: two mappings of one segment, two threads."""

from __future__ import annotations

import mmap
import os
import random
import threading
import time
from typing import Any, Callable

import pytest

from tandem.errors import ProtocolError
from tandem.transport import _ring
from tandem.transport._ring import Ring, init_segment, segment_size
from tandem.transport._shmem import create_segment, unsupported_reason
from tandem.testing import wait_until

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(bool(unsupported_reason()), reason=unsupported_reason())]

CAP = 4096


def never() -> None:
    pass


@pytest.fixture
def pair() -> Any:
    """(producer, consumer): two Ring objects over two mappings of one segment."""
    fd = create_segment(segment_size(CAP))
    maps = [mmap.mmap(fd, segment_size(CAP)) for _ in range(2)]
    os.close(fd)
    init_segment(maps[0], CAP)
    rings = [Ring(m) for m in maps]
    yield rings[0], rings[1]
    for r in rings:
        r.close()


def _asleep_on_a_futex(thread: threading.Thread, timeout: float = 10.0) -> bool:
    """Wait until ``thread`` is blocked in the futex system call (202 on x86-64)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/self/task/{thread.native_id}/syscall") as f:
                if f.read().split()[0] == "202":
                    return True
        except OSError:
            pass
        time.sleep(0.001)
    return False


def _in_thread(fn: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def body() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            errors.append(exc)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, errors


def test_frames_of_every_size_wrap_around_intact(pair: Any) -> None:
    producer, consumer = pair
    rng = random.Random(3)
    sizes = [0, 1, 7, CAP - 1, CAP, CAP + 1, 3 * CAP + 5] + [rng.randrange(20_000) for _ in range(40)]
    frames = [rng.randbytes(n) for n in sizes]
    def write_all() -> None:
        for f in frames:
            producer.write([memoryview(f[:3]), memoryview(f[3:])], never)

    writer, errors = _in_thread(write_all)
    for f in frames:
        got = bytearray(len(f))
        consumer.read_into(memoryview(got), never)
        assert got == f, f"frame of {len(f)} bytes differs"
    writer.join(10)
    assert not errors and not writer.is_alive()
    assert consumer.empty() and producer.free() == CAP


def test_a_full_ring_blocks_the_producer_until_the_consumer_reads(pair: Any) -> None:
    producer, consumer = pair
    data = os.urandom(3 * CAP)
    writer, errors = _in_thread(lambda: producer.write([memoryview(data)], never))
    wait_until(lambda: producer._ctl[_ring._PSLEEP] == 1 or not writer.is_alive(),
               "the producer to sleep for space")
    assert writer.is_alive(), "the producer overran a full ring"
    assert producer.free() == 0
    got = bytearray(len(data))
    consumer.read_into(memoryview(got), never)
    writer.join(5)
    assert not writer.is_alive() and not errors and got == data


def test_check_ends_a_wait_as_soon_as_the_waiter_is_woken(pair: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(_ring, "_SLEEP_S", 10.0)  # only a wake-up can end the sleep early
    _, consumer = pair
    stop = threading.Event()

    def check() -> None:
        if stop.is_set():
            raise ProtocolError("stopped")

    reader, errors = _in_thread(lambda: consumer.read_into(memoryview(bytearray(10)), check))
    assert _asleep_on_a_futex(reader), "the reader never slept on the futex"
    start = time.monotonic()
    stop.set()
    consumer.wake_local()
    reader.join(5)
    assert not reader.is_alive() and isinstance(errors[0], ProtocolError)
    assert time.monotonic() - start < 5.0, "the wake-up did not reach the sleeper"  # not 10 s


def test_a_ring_announcing_a_bad_capacity_is_refused() -> None:
    m = mmap.mmap(-1, segment_size(CAP))
    init_segment(m, 3000)
    with pytest.raises(ProtocolError, match="capacity 3000"):
        Ring(m)


def test_a_reader_sleeps_without_spinning_while_the_ring_is_empty(pair: Any) -> None:
    _, consumer = pair
    before = time.process_time()
    reader, _ = _in_thread(lambda: consumer.read_into(memoryview(bytearray(1)), never))
    time.sleep(1.0)
    used = time.process_time() - before
    assert used < 0.2, f"an idle reader used {used:.2f}s of CPU in 1s"
    pair[0].write([memoryview(b"x")], never)
    reader.join(5)
    assert not reader.is_alive()


def test_try_write_writes_everything_now_or_nothing(pair: Any) -> None:
    producer, consumer = pair
    rng = random.Random(5)
    sent = []
    for _ in range(200):  # many laps: frames straddle the end of the ring
        frame = rng.randbytes(rng.randrange(1, CAP // 3))
        if not producer.try_write([memoryview(frame[:5]), frame[5:]]):
            assert len(frame) > producer.free()
            got = bytearray(sum(len(f) for f in sent))
            consumer.read_into(memoryview(got), never)
            assert got == b"".join(sent), "frames written at once differ"
            sent = []
            assert producer.try_write([memoryview(frame[:5]), frame[5:]])
        sent.append(frame)
    too_big = bytes(producer.free() + 1)
    before = producer.free()
    assert not producer.try_write([too_big]) and producer.free() == before
    got = bytearray(sum(len(f) for f in sent))
    consumer.read_into(memoryview(got), never)
    assert got == b"".join(sent) and consumer.empty()


def test_peek_shows_only_bytes_that_are_there_in_one_piece(pair: Any) -> None:
    producer, consumer = pair
    assert consumer.peek(1) is None  # nothing written yet
    producer.write([memoryview(bytes(CAP - 10))], never)
    consumer.read_into(memoryview(bytearray(CAP - 10)), never)
    producer.write([memoryview(b"abcdefghijklmnopqrst")], never)  # wraps after 10 bytes
    assert consumer.peek(21) is None, "peeked past what was written"
    assert consumer.peek(11) is None, "peeked across the end of the ring"
    view = consumer.peek(10)
    assert view is not None and bytes(view) == b"abcdefghij"
    consumer.skip(10)
    consumer.release()
    assert bytes(consumer.peek(10) or b"") == b"klmnopqrst"
    assert producer.free() == CAP - 10
