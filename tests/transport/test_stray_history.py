"""A message for a call this rank already completed is a stray: the peer called something
else. The rank knows its completed calls from its group's flight recorder when that is
on (one record per call), else from the transport's own short history."""

from __future__ import annotations

import torch

from tandem.collectives import api
from tandem.collectives.group import ProcessGroup
from tandem.collectives.recorder import Recorder, clock
from tandem.config import Settings
from tandem.testing import run_threads
from tandem.transport.message import Header, Kind
from tandem.transport.mismatch import History

SIG, SITE = b"all_reduce float32[2] op=SUM", b"train.py:7"


def _header(seq: int, sig: bytes = b"broadcast float32[2] root=1") -> Header:
    return Header(Kind.COLL, 3, seq, 0, 8, sig, b"peer.py:9")


def _record(recorder: Recorder, seq: int, started: bool = True, ended: bool = True,
            error: str = "") -> list:
    # what ProcessGroup._execute (or Recorder.queued) leaves in the ring
    record = [seq, "all_reduce", SIG, SITE, 8, 0.0, clock() if started else 0.0,
              clock() if ended else object(), error]
    i = seq % recorder.slots
    if i < len(recorder.ring):
        recorder.ring[i] = record
    else:
        recorder.grow(i, record)
    return record


def test_a_followed_recorder_tells_which_calls_completed() -> None:
    history = History(rank=0)
    recorder = Recorder(4)
    history.follow(3, recorder.completed)
    _record(recorder, 0)
    _record(recorder, 1, ended=False)  # running
    _record(recorder, 2, error="CollectiveTimeoutError: ...")  # failed: not a stray's cause
    error = history.stray(1, _header(0))
    assert error is not None and "rank 0 completed all_reduce float32[2] op=SUM at train.py:7" \
        in str(error) and "rank 1 called broadcast float32[2] root=1 at peer.py:9" in str(error)
    assert history.stray(1, _header(1)) is None  # still running here
    assert history.stray(1, _header(2)) is None
    assert history.stray(1, _header(3)) is None  # not reached
    assert history.stray(1, Header(Kind.P2P, 3, 0, 0, 8)) is None  # only collectives


def test_a_call_whose_slot_was_taken_by_later_calls_is_known_completed_once_one_ran() -> None:
    # async calls are recorded when issued: a queued call in a slot proves nothing
    history = History(rank=0)
    recorder = Recorder(4)
    history.follow(3, recorder.completed)
    _record(recorder, 0)
    for seq in range(1, 5):  # calls 1-4 queued; 4 takes call 0's slot
        _record(recorder, seq, started=False, ended=False)
    assert history.stray(1, _header(0)) is None
    _record(recorder, 2, ended=False)  # call 2 runs: calls 0 and 1 completed
    error = history.stray(1, _header(0))
    assert error is not None and "completed an earlier collective" in str(error)


def test_calls_completed_while_recording_was_off_are_kept_by_the_transport() -> None:
    history = History(rank=0)
    recorder = Recorder(4)
    history.follow(3, recorder.completed)
    history.record(3, 0, SIG, SITE)  # recording off for call 0 (the group told the mailbox)
    _record(recorder, 1)
    assert "completed all_reduce" in str(history.stray(1, _header(0)))
    assert "completed all_reduce" in str(history.stray(1, _header(1)))
    assert history.stray(1, _header(2)) is None


def test_unfollowing_keeps_the_last_completed_calls() -> None:
    history = History(rank=0)
    recorder = Recorder(8)
    history.follow(3, recorder.completed)
    for seq in range(10):
        _record(recorder, seq)
    _record(recorder, 10, ended=False)
    history.unfollow(3, recorder.last_completed)
    recorder.ring[:] = [None] * 8  # the group is gone: only the transport's copy is left
    assert "completed all_reduce" in str(history.stray(1, _header(9)))
    assert "completed all_reduce" in str(history.stray(1, _header(3)))
    assert "an earlier collective" in str(history.stray(1, _header(2)))  # beyond the ring
    assert history.stray(1, _header(10)) is None  # it never completed


def test_a_group_completes_each_call_in_one_place() -> None:
    # a real group: with recording on, the recorder says a finished call completed and
    # the transport keeps no copy; with it off, the transport does
    def body(g: ProcessGroup) -> tuple[bool, bool, int]:
        api.all_reduce(torch.ones(2), group=g)
        work = api.all_reduce(torch.ones(2), group=g, async_op=True)
        assert work is not None
        work.wait()
        history = g.transport.mailbox.history
        kept = len(history._done.get(g.group_id, ()))
        return (history.stray(1 - g.group_rank, _header(0)._replace(group=g.group_id))
                is not None, history.stray(1 - g.group_rank, _header(1)._replace(
                    group=g.group_id)) is not None, kept)

    assert run_threads(2, body, settings=Settings(flight_recorder=16)) == [(True, True, 0)] * 2
    assert run_threads(2, body, settings=Settings(flight_recorder=0)) == [(True, True, 2)] * 2
