"""The launcher's console: identical lines of several ranks merged, a rank's order kept,
nothing held long, progress-bar redraws passed through on a terminal, log files complete."""

from __future__ import annotations

import io
import os
import threading
import time
from pathlib import Path

import pytest

from tandem.run.dedup import BURST, MAX_PENDING, SOLO_AFTER, WINDOW, Merger, rank_ranges
from tandem.run.streams import Console, start_pump, terminal_env


def shown(m: Merger, now: float) -> list[tuple[str, str]]:
    return [(rank_ranges(e.ranks), e.text) for e in m.due(now)]


OUT, ERR = "stdout", "stderr"


def merger(*ranks: int) -> Merger:
    m = Merger()
    for r in ranks:
        m.attach(r, OUT)
        m.attach(r, ERR)
    return m


def test_a_line_every_rank_printed_goes_out_once_as_soon_as_the_last_rank_printed_it() -> None:
    m = merger(0, 1, 2, 3)
    for r in (2, 0, 1):
        m.line(r, OUT, "usage: train.py [-h]", 10.0 + r / 10)
        assert shown(m, 10.3) == []  # rank 3 may print it too
    m.line(3, OUT, "usage: train.py [-h]", 10.4)
    assert shown(m, 10.4 + BURST) == [("0-3", "usage: train.py [-h]")]


def test_a_line_waits_at_most_the_window_for_its_twins() -> None:
    m = merger(0, 1, 2)
    m.line(0, OUT, "hello", 5.0)
    m.line(2, OUT, "hello", 5.5)
    assert shown(m, 5.0 + WINDOW - 0.01) == []
    assert shown(m, 5.0 + WINDOW) == [("0,2", "hello")]
    assert rank_ranges({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"


def test_a_closed_stream_is_not_waited_for() -> None:
    m = merger(0, 1)
    m.line(0, OUT, "bye", 1.0)
    m.detach(1, OUT)
    assert shown(m, 1.0 + BURST) == [("0", "bye")]


def test_a_ranks_own_lines_keep_their_order_when_others_print_them_in_another() -> None:
    m = merger(0, 1, 2)
    m.line(0, OUT, "A", 0.0)
    m.line(0, OUT, "B", 0.0)
    m.line(1, OUT, "B", 0.1)
    m.line(1, OUT, "A", 0.2)  # rank 1's A comes after its B: it cannot join rank 0's A
    assert shown(m, 0.2 + WINDOW) == [("0", "A"), ("0-1", "B"), ("1", "A")]


def test_a_rank_printing_alone_is_shown_at_once_until_another_rank_repeats_it() -> None:
    m = merger(0, 1)
    for i in range(SOLO_AFTER):
        m.line(0, OUT, f"step {i}", float(i))
        assert shown(m, float(i)) == []
        assert shown(m, i + WINDOW) == [("0", f"step {i}")]
    m.line(0, OUT, "step 9", 10.0)
    assert shown(m, 10.0) == [("0", "step 9")]  # solo: no waiting
    m.line(0, OUT, "warning: slow", 11.0)
    assert shown(m, 11.0) == [("0", "warning: slow")]
    m.line(1, OUT, "warning: slow", 11.2)  # the same line, too late to merge
    assert shown(m, 11.2 + WINDOW) == [("1", "warning: slow")]
    m.line(0, OUT, "warning: slow", 12.0)  # rank 0 is held again, so its twin can join
    m.line(1, OUT, "warning: slow", 12.3)
    assert shown(m, 12.3 + BURST) == [("0-1", "warning: slow")]


def test_blocks_that_differ_after_a_common_first_line_stay_whole() -> None:
    m = merger(0, 1)
    for i, text in enumerate(["Traceback (most recent call last):", '  File "a.py"', "KeyError"]):
        m.line(1, OUT, text, 1.0 + i * 1e-4)
    for i, text in enumerate(["Traceback (most recent call last):", '  File "b.py"', "ValueError"]):
        m.line(0, OUT, text, 2.0 + i * 1e-4)
    assert shown(m, 2.1 + WINDOW) == [
        ("1", "Traceback (most recent call last):"), ("1", '  File "a.py"'), ("1", "KeyError"),
        ("0", "Traceback (most recent call last):"), ("0", '  File "b.py"'), ("0", "ValueError")]


def test_a_shared_line_stays_shared_when_the_next_one_comes_later() -> None:
    m = merger(0, 1)
    m.line(0, OUT, "epoch 1 done", 1.0)
    m.line(1, OUT, "epoch 1 done", 1.1)
    m.line(0, OUT, "saving", 1.2)  # printed later, not in the same write
    assert shown(m, 1.2 + WINDOW) == [("0-1", "epoch 1 done"), ("0", "saving")]


def test_redraws_are_never_held_and_only_the_newest_waits() -> None:
    m = merger(0, 1)
    m.line(1, OUT, "held", 0.0)
    m.redraw(0, ERR, " 10%|#", 0.1)
    m.redraw(0, ERR, " 20%|##", 0.2)
    assert shown(m, 0.2) == []  # behind rank 1's line, which keeps its place
    assert shown(m, WINDOW) == [("1", "held"), ("0", " 20%|##")]
    m.redraw(0, ERR, " 30%|###", 2.0)
    assert shown(m, 2.0) == [("0", " 30%|###")]


def test_the_number_of_waiting_lines_is_bounded() -> None:
    m = merger(0, 1)
    for i in range(MAX_PENDING + 5):
        m.line(0, OUT, f"line {i}", 0.0)
    assert [text for _, text in shown(m, 0.0)] == [f"line {i}" for i in range(5)]


class Screen(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_on_a_terminal_a_bar_redraws_in_place_and_other_lines_go_above_it() -> None:
    screen = Screen()
    _, console = Console.pair(err=lambda: screen, merger=merger(0, 1))
    console.redraw(0, b" 10%|#")
    console.redraw(0, b" 20%|##")
    console.message("tandemrun: hi")
    console.line(0, b"100%|##########")
    console.close()
    assert screen.getvalue() == ("\r[rank0]:  10%|#"
                                 "\r[rank0]:  20%|##"
                                 "\rtandemrun: hi   \n[rank0]:  20%|##"  # over it, then the bar
                                 "\r[rank0]: 100%|##########\n")  # the bar's last state


def test_a_line_held_on_stdout_is_not_overtaken_by_a_bar_on_stderr() -> None:
    screen = Screen()
    out, err = Console.pair(lambda: screen, lambda: screen, Merger(window=0.2))
    for console in (out, err):
        console.attach(0)
        console.attach(1)
    out.line(0, b"train: 2 ranks")  # held: rank 1 might print it too
    err.redraw(0, b" 10%|#")
    assert screen.getvalue() == ""
    out.message("tandemrun: bye")  # shows what waits, in order
    err.close()
    assert screen.getvalue() == ("[rank0]: train: 2 ranks\n"
                                 "\r[rank0]:  10%|#"
                                 "\rtandemrun: bye \n[rank0]:  10%|#"  # the bar moves down
                                 "\n")


def test_elsewhere_only_whole_lines_are_shown() -> None:
    out = io.StringIO()
    _, console = Console.pair(err=lambda: out, merger=merger(0))
    console.redraw(0, b" 10%|#")
    console.line(0, b"100%|####")
    console.close()
    assert out.getvalue() == "[rank0]: 100%|####\n"


def test_a_worker_is_told_of_a_terminal_only_when_there_is_one() -> None:
    assert terminal_env(io.StringIO()) == {}


def pump_through(tmp_path: Path, *writes: bytes) -> tuple[str, bytes]:
    """Send ``writes`` through a pipe to a pump; what a terminal and the log file got."""
    screen = Screen()
    _, console = Console.pair(err=lambda: screen, merger=Merger(window=0.0))
    read_fd, write_fd = os.pipe()
    log = tmp_path / "stderr.log"
    pump = start_pump(os.fdopen(read_fd, "rb"), 3, console, str(log), "test-pump")
    for data in writes:
        os.write(write_fd, data)
        time.sleep(0.02)
    os.close(write_fd)
    pump.join(10)
    console.close()
    return screen.getvalue(), log.read_bytes()


def test_the_pump_turns_carriage_returns_into_redraws_and_keeps_every_byte(
        tmp_path: Path) -> None:
    writes = (b"start\n", b"\r 50%|##", b"\r100%|####", b"\n", b"part", b"ial\n", b"no end")
    screen, log = pump_through(tmp_path, *writes)
    assert log == b"".join(writes)  # unprefixed and complete
    assert screen == ("[rank3]: start\n"
                      "\r[rank3]:  50%|##"
                      "\r[rank3]: 100%|####"
                      "\r[rank3]: 100%|####\n"
                      "[rank3]: partial\n"
                      "[rank3]: no end\n")


def test_a_line_shorter_than_the_redraw_it_ends_shows_what_a_terminal_would(
        tmp_path: Path) -> None:
    screen, _ = pump_through(tmp_path, b"abcdef\rxy\n")
    assert screen.endswith("[rank3]: xycdef\n")


def two_ranks_on_stderr(window: float) -> tuple[io.StringIO, Console]:
    """Ranks 0 and 1 attached to a stderr console writing to the returned buffer."""
    out = io.StringIO()
    _, console = Console.pair(err=lambda: out, merger=Merger(window=window))
    console.attach(0)
    console.attach(1)
    return out, console


@pytest.mark.timeout(30)
def test_lines_of_one_read_stay_one_block_however_slowly_the_reader_runs() -> None:
    out, console = two_ranks_on_stderr(window=0.5)
    for rank, frame in ((1, b'  File "a.py"'), (0, b'  File "b.py"')):
        console.read(rank, [(b"Traceback (most recent call last):", False), (frame, False),
                            (b"KeyError", False)])  # one read brought the whole traceback
        time.sleep(4 * BURST)  # a loaded machine: the reader threads were preempted
    console.close()
    assert out.getvalue().splitlines() == [
        "[rank1]: Traceback (most recent call last):", '[rank1]:   File "a.py"',
        "[rank1]: KeyError",
        "[rank0]: Traceback (most recent call last):", '[rank0]:   File "b.py"',
        "[rank0]: KeyError"]


@pytest.mark.timeout(30)
def test_held_lines_go_out_on_time_without_new_input() -> None:
    out, console = two_ranks_on_stderr(window=0.2)
    console.line(0, b"alone")
    assert out.getvalue() == ""
    deadline = time.monotonic() + 5
    while not out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert out.getvalue() == "[rank0]: alone\n"
    console.close()
    assert not [t for t in threading.enumerate() if t.name == "tandem-console"]
