"""The membership of an elastic job, kept in a store that outlives every worker.

Workers (through :mod:`tandem.elastic`) and the launcher's agents read and write the
same keys under one prefix; nothing here imports torch, so the launcher uses it too::

    roster = Roster(store, "elastic/0")
    gen = roster.generation(roster.latest())        # who trains now, in rank order

A *generation* is one membership: its number and its members (worker names, in rank
order). Generation ``g + 1`` is decided in *round* ``g``: the members of ``g`` that go
on arrive (:meth:`arrive`); once every member of ``g`` has arrived or is known gone
(its agent saw it exit, or a member lost its connection to it), the first member to
notice proposes ``g + 1`` = the arrivals plus the joiners waiting in the queue, up to
the job's size limit; ``compare_set`` makes the first proposal the only one. A
failure starts a round (the survivors arrive), and so does a commit that sees joiners
waiting (every member arrives). Keys under the prefix::

    on                  the job runs elastic (set once generation 0 exists)
    latest, gen/<g>     the newest generation; each generation's record (JSON)
    worker/<name>       a worker's node, host and pid
    joinq, joinq/<i>    joiners, in the order they became ready
    exitq, exitq/<i>    workers whose process is gone (written by their agent)
    lost/<g>, .../<i>   workers that members of generation g lost their connection to
    round/<g>/<name>    members of g that arrived at round g (and a counter)
    ready/<g>/<name>    members of g ready to connect (and a counter)
    coming              replacements started by agents that have not joined yet
    managed             agents watch the workers: each reports its workers' exits
    done, ended         training finished; the job cannot go on (the reason)

Queues are append-only: an entry's index comes from ``add`` on the counter, so
concurrent writers never collide and a reader only reads what is new to it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from typing import Callable, Iterable

from tandem._words import counted
from tandem.errors import ElasticError, StoreTimeoutError, TimeoutError
from tandem.store.base import Store

__all__ = ["Generation", "Roster", "POLL"]

POLL = 0.005  # seconds between looks at a round that is still open
# how long a round short of the minimum waits for the agents to report the exits of the
# members it lost: an agent announces a replacement before it reports the exit, so once
# the exit is in, so is the replacement (its monitor loop looks every 0.1 s by default)
AGENT_REPORT_GRACE = 10.0


@dataclasses.dataclass(frozen=True)
class Generation:
    """One membership of the job: ``members`` in rank order."""

    number: int
    members: tuple[str, ...]
    upto: int = 0  # joiners [0, upto) of the queue were considered for this generation
    ended: str = ""  # set instead of members when the job cannot go on

    def rank_of(self, worker: str) -> int:
        return self.members.index(worker)

    def to_json(self) -> str:
        return json.dumps({"number": self.number, "members": list(self.members),
                           "upto": self.upto, "ended": self.ended})

    @classmethod
    def from_json(cls, text: bytes | str) -> Generation:
        data = json.loads(text)
        return cls(int(data["number"]), tuple(data["members"]), int(data["upto"]),
                   str(data.get("ended", "")))


class _Queue:
    """An append-only list in the store; each reader keeps its own position."""

    def __init__(self, store: Store, name: str) -> None:
        self._store, self._name = store, name
        self._seen: list[str] = []

    def append(self, value: str) -> int:
        index = self._store.add(self._name, 1) - 1
        self._store.set(f"{self._name}/{index}", value)
        return index

    def count(self) -> int:
        return self._store.add(self._name, 0)

    def read(self) -> list[str]:
        """Every entry so far (those new to this reader are fetched)."""
        for index in range(len(self._seen), self.count()):
            # the writer bumps the counter first: its entry follows within moments
            self._seen.append(self._store.get(f"{self._name}/{index}").decode())
        return self._seen


class Roster:
    """The job's membership under ``prefix`` of ``store``; see the module docstring."""

    def __init__(self, store: Store, prefix: str) -> None:
        self.store = store
        self.prefix = prefix.rstrip("/")
        self._joinq = _Queue(store, self._k("joinq"))
        self._exitq = _Queue(store, self._k("exitq"))
        self._lost: dict[int, _Queue] = {}
        self._nodes: dict[str, str] = {}

    def _k(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    # -- workers ---------------------------------------------------------------------
    def register(self, worker: str, node: str, host: str, pid: int) -> None:
        self.store.set(self._k(f"worker/{worker}"),
                       json.dumps({"node": node, "host": host, "pid": pid}))
        self._nodes[worker] = node

    def node_of(self, worker: str) -> str:
        if worker not in self._nodes:
            info = json.loads(self.store.get(self._k(f"worker/{worker}")))
            self._nodes[worker] = str(info["node"])
        return self._nodes[worker]

    def report_exit(self, worker: str) -> None:
        """The agent saw ``worker``'s process end."""
        self._exitq.append(worker)

    def exited(self) -> set[str]:
        return set(self._exitq.read())

    def report_lost(self, number: int, workers: Iterable[str]) -> None:
        """Members of generation ``number`` lost their connection to ``workers``."""
        queue = self._lost_queue(number)
        for worker in workers:
            queue.append(worker)

    def gone(self, number: int) -> set[str]:
        """Workers known gone for generation ``number``: exited, or lost by a member."""
        return self.exited() | set(self._lost_queue(number).read())

    def _lost_queue(self, number: int) -> _Queue:
        if number not in self._lost:
            self._lost[number] = _Queue(self.store, self._k(f"lost/{number}"))
        return self._lost[number]

    # -- joiners -----------------------------------------------------------------------
    def enqueue_joiner(self, worker: str) -> int:
        return self._joinq.append(worker)

    def joiners(self) -> list[str]:
        """Every worker that ever joined the queue, in order."""
        return list(self._joinq.read())

    def joiners_waiting(self, gen: Generation, max_ranks: int) -> bool:
        """Whether a joiner waits that ``gen`` has room for (cheap: one counter read)."""
        room = not max_ranks or len(gen.members) < max_ranks
        return room and self._joinq.count() > gen.upto

    def expect(self, delta: int) -> None:
        """An agent started (+1) a joiner, or that joiner joined or died (-1)."""
        self.store.add(self._k("coming"), delta)

    def coming(self) -> int:
        return self.store.add(self._k("coming"), 0)

    def manage(self) -> None:
        """An agent watches this job's workers (and reports every exit)."""
        self.store.set(self._k("managed"), b"1")

    def managed(self) -> bool:
        return self.store.check([self._k("managed")])

    # -- generations -------------------------------------------------------------------
    def latest(self) -> int:
        key = self._k("latest")
        return int(self.store.get(key)) if self.store.check([key]) else -1

    def generation(self, number: int) -> Generation | None:
        key = self._k(f"gen/{number}")
        return Generation.from_json(self.store.get(key)) if self.store.check([key]) else None

    def propose(self, gen: Generation) -> Generation:
        """Decide generation ``gen.number`` as ``gen`` unless someone did first; the decision."""
        key = self._k(f"gen/{gen.number}")
        text = gen.to_json()
        decided = Generation.from_json(self.store.compare_set(key, "", text))
        self._raise_latest(decided.number)
        if decided.number == 0:
            self.store.set(self._k("on"), b"1")
        return decided

    def _raise_latest(self, number: int) -> None:
        key, current = self._k("latest"), b""
        while not current or int(current) < number:
            got = self.store.compare_set(key, current, str(number))
            if got == str(number).encode():
                return
            current = got

    def poll_generation(self, number: int, seconds: float) -> Generation | None:
        """Generation ``number``, waiting up to ``seconds`` for it; None if not decided."""
        try:
            self.store.wait([self._k(f"gen/{number}")], seconds)
        except StoreTimeoutError:
            return None
        return self.generation(number)

    def wait_generation(self, number: int, deadline: float,
                        stop: Callable[[], bool] = lambda: False) -> Generation | None:
        """Block until generation ``number`` is decided; None if ``stop()`` says so first."""
        key = self._k(f"gen/{number}")
        while not stop():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"generation {number} of the elastic job was not decided "
                                   f"in time")
            try:
                self.store.wait([key], min(left, 0.5))
            except StoreTimeoutError:
                continue
            return self.generation(number)
        return None

    # -- rounds ------------------------------------------------------------------------
    def arrive(self, number: int, worker: str) -> None:
        """``worker`` goes on from generation ``number`` (a failure, or joiners waiting)."""
        self.store.set(self._k(f"round/{number}/{worker}"), b"1")
        self.store.add(self._k(f"round/{number}"), 1)

    def arrived(self, number: int, members: Iterable[str]) -> list[str]:
        return [m for m in members if self.store.check([self._k(f"round/{number}/{m}")])]

    def close_round(self, gen: Generation, deadline: float, *, max_ranks: int,
                    min_ranks: int, min_nodes: int,
                    watch: Callable[[], None] = lambda: None) -> Generation:
        """Wait until round ``gen.number`` can close, propose the next generation, return it.

        The round closes once every member of ``gen`` has arrived or is known gone. If
        fewer ranks or nodes than the minimum would go on, it waits for the joiners that
        agents are starting; with none coming, the next generation records why the job
        ends (``ended``). ``watch()`` runs before each look: the caller reports there
        the members it notices gone meanwhile.
        """
        following = gen.number + 1
        counter = self._k(f"round/{gen.number}")
        reports_due = time.monotonic() + AGENT_REPORT_GRACE
        while True:
            watch()
            decided = self.generation(following)
            if decided is not None:
                return decided
            gone = self.gone(gen.number)
            arrivals = self.store.add(counter, 0)
            if arrivals + len(gone.intersection(gen.members)) >= len(gen.members):
                here = set(self.arrived(gen.number, gen.members))
                missing = [m for m in gen.members if m not in here and m not in gone]
                if not missing:
                    now = time.monotonic()
                    proposal = self._next(gen, here, gone, max_ranks, min_ranks, min_nodes,
                                          waiting_allowed=now < deadline,
                                          reports_awaited=now < min(deadline, reports_due))
                    if proposal is not None:
                        return self.propose(proposal)
            if time.monotonic() >= deadline:
                here = set(self.arrived(gen.number, gen.members))
                missing = [m for m in gen.members if m not in here and m not in gone]
                raise TimeoutError(
                    f"round {gen.number} of the elastic job did not close in time: "
                    f"{', '.join(missing) or 'no member'} neither arrived nor were known "
                    f"gone (a member is stuck, or stopped)")
            time.sleep(POLL)

    def _next(self, gen: Generation, here: set[str], gone: set[str], max_ranks: int,
              min_ranks: int, min_nodes: int, waiting_allowed: bool,
              reports_awaited: bool = False) -> Generation | None:
        members = [m for m in gen.members if m in here]
        exited = self.exited()
        queue = self.joiners()
        waiting = [w for w in queue[gen.upto:] if w not in exited and w not in members]
        room = len(waiting) if not max_ranks else max(0, max_ranks - len(members))
        # with more joiners than room, those on the nodes with the fewest members go first
        # (a lost node's own spare before another node's: the minimum of nodes, balance)
        per_node = collections.Counter(self.node_of(m) for m in members)
        for _ in range(min(room, len(waiting))):
            pick = min(waiting, key=lambda w: per_node[self.node_of(w)])  # queue order ties
            waiting.remove(pick)
            members.append(pick)
            per_node[self.node_of(pick)] += 1
        # the joiners left stay in the queue as spares: upto stops at the first of them
        upto = queue.index(waiting[0]) if waiting else len(queue)
        nodes = set(per_node)
        short = ""
        if len(members) < min_ranks:
            short = (f"{len(members)} rank(s) remain and the job needs at least {min_ranks} "
                     f"(ElasticState(min_ranks={min_ranks}))")
        elif len(nodes) < min_nodes:
            short = (f"{len(members)} rank(s) on {len(nodes)} node(s) remain and the job needs "
                     f"at least {counted(min_nodes, 'node')} (--nnodes {min_nodes}:...)")
        if short and waiting_allowed and self.coming() > 0:
            return None  # a replacement is on its way: wait for it
        unreported = [m for m in gen.members if m not in here and m not in exited]
        if short and reports_awaited and unreported and self.managed():
            return None  # an agent may be about to announce a replacement: hear it first
        if short:
            lost = sorted(set(gen.members) - here)
            return Generation(gen.number + 1, (), upto,
                              ended=f"{short}; lost: {', '.join(lost) or 'none'}")
        return Generation(gen.number + 1, tuple(members), upto)

    def enter(self, gen: Generation, worker: str, deadline: float) -> list[str]:
        """Wait until every member of ``gen`` is ready to connect; the members that are
        gone instead (exited, or not ready by ``deadline``) -- empty when all are ready."""
        key = self._k(f"ready/{gen.number}")
        self.store.set(f"{key}/{worker}", b"1")
        self.store.add(key, 1)
        while self.store.add(key, 0) < len(gen.members):
            gone = [m for m in gen.members if m in self.gone(gen.number)]
            if gone:
                return gone
            if time.monotonic() >= deadline:
                return [m for m in gen.members if not self.store.check([f"{key}/{m}"])]
            time.sleep(POLL)
        return []

    # -- the whole job -------------------------------------------------------------------
    def is_on(self) -> bool:
        return self.store.check([self._k("on")])

    def finish(self, number: int) -> None:
        """Training finished in generation ``number``: waiting joiners may leave."""
        self.store.compare_set(self._k("done"), "", str(number))

    def finished(self) -> bool:
        return self.store.check([self._k("done")])

    def ended(self) -> str:
        """Why the job cannot go on, or ``""``."""
        key = self._k("ended")
        return self.store.get(key).decode() if self.store.check([key]) else ""

    def end(self, reason: str) -> None:
        self.store.compare_set(self._k("ended"), "", reason)

    def raise_if_ended(self) -> None:
        reason = self.ended()
        if reason:
            raise ElasticError(f"the elastic job cannot go on: {reason}")
