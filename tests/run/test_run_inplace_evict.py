"""Which workers the launcher kills for being left out of a new generation: a stuck one
(alive, answering nothing), never one that died by itself while its supervisor has yet
to report the exit (under load the survivors' round can close first). Such a worker
was said to have "stopped answering" and killed, and the summary blamed the launcher's
kill; it is left to the ordinary report of its own death."""

from __future__ import annotations

import signal
import subprocess
import sys
from types import SimpleNamespace
from typing import Iterator

import pytest

from tandem.elastic.roster import Generation, Roster
from tandem.run.inplace import InPlace
from tandem.store import HashStore

pytestmark = pytest.mark.procs


class _Worker:
    """What ``InPlace`` reads of a worker, and the signals it was sent."""

    def __init__(self, name: str, rank: int, worker_pid: int) -> None:
        self.spec = SimpleNamespace(env={"TANDEM_ELASTIC_ID": name}, rank=rank)
        self.worker_pid = worker_pid
        self.alive = True  # the supervisor has not reported an exit
        self.retired = False
        self.sent: list[int] = []

    def send(self, sig: int) -> None:
        self.sent.append(sig)


@pytest.fixture
def pids() -> Iterator[tuple[int, int]]:
    """(a process that runs, one that exited)."""
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    exited = subprocess.Popen([sys.executable, "-c", ""])
    exited.wait()
    yield running.pid, exited.pid
    running.kill()
    running.wait()


def _evict(workers: list[_Worker]) -> list[str]:
    roster = Roster(HashStore(), "job/0/elastic")
    roster.propose(Generation(0, ("n0.s0.0", "n0.s1.0", "n0.s2.0")))
    roster.propose(Generation(1, ("n0.s0.0",)))
    said: list[str] = []
    # the configuration and assignment serve only to start workers, which this does not
    inplace = InPlace(None, None, roster, "tcp://127.0.0.1:1", 2, 1.0, said.append)
    inplace._evict(SimpleNamespace(workers=workers))
    return said


def test_only_a_live_worker_left_out_is_killed(pids: tuple[int, int]) -> None:
    running, exited = pids
    member = _Worker("n0.s0.0", 0, running)
    stuck = _Worker("n0.s1.0", 1, running)
    dead = _Worker("n0.s2.0", 2, exited)
    said = _evict([member, stuck, dead])
    assert stuck.sent == [signal.SIGKILL], said
    assert member.sent == [] and dead.sent == [], said
    assert said == ["worker n0.s1.0 (rank 1) stopped answering and was left out of "
                    "generation 1; killing it"]
