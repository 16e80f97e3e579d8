"""One worker's part in an elastic job: founding it, joining it, and every change after.

The states a worker goes through, all driven from :func:`~tandem.elastic.run_elastic`::

    start ──(initial member)── found generation 0 ───────────────┐
      └───(TANDEM_ELASTIC_JOIN)── queue, wait to be admitted ──── enter generation g
                                                                  │  ready barrier in the store,
    train ◄───────────────────────────────────────────────────────┤  connect, agree on the state,
      │ a peer died (PeerLostError)          ── round g ──────────┤  live checkpoint to joiners
      │ commit sees joiners with room        ── round g ──────────┘
      └ returns ── final commit ── done

A *round* (see :mod:`tandem.elastic.roster`) decides generation g + 1; entering a
generation that fails (a member died meanwhile) is just another round. Agreeing on the
state: every member reports the commits it holds; the survivors roll back to the
oldest *latest* commit among them (they differ by one at most), and each member
without it receives it from a survivor over the new group (``_live``).
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
import time

import torch

from tandem._words import secs
from tandem.collectives.api import all_gather, all_reduce, broadcast
from tandem.collectives.objects import all_gather_object
from tandem.collectives.world import default_group, is_initialized, world
from tandem.config import load_settings
from tandem.elastic import _live
from tandem.elastic._regroup import (DEFAULT_PREFIX, enter, leave, open_elastic_store,
                                     regroup_model)
from tandem.elastic._state import ElasticState
from tandem.elastic.roster import Generation, Roster
from tandem.errors import (CollectiveTimeoutError, ElasticError, PeerLostError, ProtocolError,
                           StateError, TandemError)
from tandem.errors import TimeoutError as TandemTimeout

__all__ = ["Session", "Regroup", "Finished"]


class Regroup(BaseException):
    """Raised by a commit that lets joiners in: the training function stops at once.

    A ``BaseException``, so that a training loop's ``except Exception`` does not take it.
    """


class Finished(Exception):
    """The job finished before this joining worker was admitted."""


class Session:
    """This worker's membership; see the module docstring."""

    def __init__(self, state: ElasticState) -> None:
        if not is_initialized():
            raise StateError("run_elastic: call tandem.init_process_group() first (a joining "
                             "worker's init makes a world of its own until it is admitted)")
        self.settings = settings = load_settings()
        self.state = state
        self.me = settings.elastic_id or (
            f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}")
        self.node = settings.elastic_node or settings.host_id or socket.gethostname()
        w = world()
        self.backend, self.timeout = w.backend, w.default.timeout
        if settings.elastic_store:
            self.store, self.prefix = open_elastic_store(settings.elastic_store, settings)
            self._own_store = True  # ours until a generation's world takes it
        else:  # the process group's own store: it must outlive every rank (file://)
            self.store, self.prefix, self._own_store = w.store, DEFAULT_PREFIX, False
        self.roster = Roster(self.store, self.prefix)
        self.gen = Generation(-1, ())
        self.joining = settings.elastic_join
        self.recoveries = 0
        self._world = -1  # the generation whose process group this worker holds

    @property
    def number(self) -> int:
        return self.gen.number

    # -- beginning and end -------------------------------------------------------------------
    def start(self) -> None:
        self.roster.register(self.me, self.node, socket.gethostname(), os.getpid())
        if self.joining:
            self._enter(self._admission())
        else:
            self._found()

    def _found(self) -> None:
        """Generation 0 is the process group the workers started with."""
        g = default_group()
        names: list[object] = [None] * g.group_size
        all_gather_object(names, self.me)
        gen = Generation(0, tuple(str(n) for n in names))
        if g.group_rank == 0:
            gen = self.roster.propose(gen)
        else:
            decided = self.roster.wait_generation(0, self._deadline())
            assert decided is not None
            gen = decided
        if gen.members != tuple(names):
            raise ElasticError(f"this elastic job already has a generation 0 with members "
                               f"{list(gen.members)}; two jobs share the store prefix "
                               f"{self.prefix!r}")
        self.gen, self._world = gen, 0
        self.state._take(self.state._commits + 1)  # where a failure before any commit returns

    def _admission(self) -> Generation:
        """Queue as a joiner; wait for the first generation that admits this worker."""
        self.roster.enqueue_joiner(self.me)
        number = max(self.roster.latest(), 0)
        # under tandemrun the wait lasts as long as the job (the agent's store); alone it
        # ends when no membership change came for the collective timeout
        bounded = not self.settings.elastic_store
        deadline = self._deadline()
        while True:
            gen = self.roster.poll_generation(number, 0.5)
            if gen is not None:
                if gen.ended or self.me in gen.members:
                    return gen
                number, deadline = number + 1, self._deadline()
                continue
            if self.roster.finished():
                raise Finished()
            self.roster.raise_if_ended()
            if bounded and time.monotonic() >= deadline:
                raise TandemTimeout(f"worker {self.me} waited {secs(self.timeout)}s to join the "
                                    f"elastic job and no membership change came")

    def finish(self) -> None:
        """After the training function returned: a final commit every member reaches."""
        self.state._take(self.state._commits + 1)
        all_reduce(torch.zeros(1))
        if default_group().group_rank == 0:
            self.roster.finish(self.gen.number)

    def close(self) -> None:
        """Hand the elastic store to the current world (which closes it), or close it."""
        if not self._own_store:
            return
        if is_initialized() and world().store is self.store:
            return  # a generation's world owns it now
        self.store.close()

    # -- changes -------------------------------------------------------------------------
    def committed(self) -> None:
        """Called by every commit: rank 0 looks for joiners and tells every member."""
        g = default_group()
        flag = torch.zeros(1, dtype=torch.uint8)
        if g.group_rank == 0 and self.roster.joiners_waiting(
                self.gen, self.settings.elastic_max_ranks):
            flag[0] = 1
        broadcast(flag, src=0)
        if flag[0]:
            raise Regroup()

    def grow(self) -> None:
        """Every member stopped at the same commit: admit the joiners."""
        self._enter(self._round(self._lost(None)))

    def recoverable(self, exc: BaseException) -> bool:
        """Whether ``exc`` comes from a lost member (so the job can go on without it)."""
        if isinstance(exc, (ElasticError, Finished)):
            return False
        if any(isinstance(e, PeerLostError) for e in _chain(exc)):
            return True
        if self._stalled(exc):
            return True  # a member stopped answering: the others go on without it
        if is_initialized():
            t = world().transport
            if t.lost_peers() or t.left_peers():
                return True
            if self._world == self.gen.number >= 0 and any(
                    isinstance(e, (PeerLostError, CollectiveTimeoutError))
                    for e in t.group_failures()):
                # a wrapper kept only the error's text (a torch future's callback, as in a
                # DDP comm hook, re-raises it as a RuntimeError) and the news of the loss
                # came from a peer: the transport still holds why the group failed
                return True
        return self.roster.arrived(self.gen.number, [m for m in self.gen.members
                                                     if m != self.me]) != []

    def recover(self, exc: BaseException) -> None:
        """Roll back and go on without the members that are gone."""
        self.recoveries += 1
        self._enter(self._round(self._lost(exc)))

    def _lost(self, exc: BaseException | None) -> set[str]:
        """Members this worker knows died: connections closed without a goodbye, and
        goodbyes from members that did not arrive at the round (they left for good:
        a member arrives before it leaves its group)."""
        if not is_initialized() or self._world != self.gen.number or self._world < 0:
            return set()
        t, members = world().transport, self.gen.members
        ranks = set(t.lost_peers())
        if exc is not None:
            ranks |= {e.rank for e in _chain(exc) if isinstance(e, PeerLostError)
                      and e.rank in t.lost_peers()}
        if exc is not None:
            ranks |= self._stalled(exc)
        left = {members[r] for r in t.left_peers() if 0 <= r < len(members)}
        arrived = set(self.roster.arrived(self.gen.number, sorted(left)))
        return {members[r] for r in ranks if 0 <= r < len(members)} | (left - arrived)

    def _stalled(self, exc: BaseException) -> set[int]:
        """The ranks of this generation's world that a collective timeout named (its
        verdict: the ranks nobody heard from, e.g. a stopped process), never this one.

        They are taken for lost: left out of the next generation, where the launcher
        kills them (a stopped process never leaves by itself).
        """
        if not is_initialized() or self._world != self.gen.number or self._world < 0:
            return set()
        me, size = world().transport.rank, len(self.gen.members)
        return {r for e in _chain(exc) if isinstance(e, CollectiveTimeoutError)
                for r in e.missing if 0 <= r < size and r != me}

    def _round(self, lost: set[str]) -> Generation:
        """Leave the current generation; the next one, once its round closes.

        The old process group stays open until then: a member that dies while the round
        is open is noticed by its closed connections and reported, whoever else saw it.
        """
        gen, reported = self.gen, set(lost)
        if lost:
            self.roster.report_lost(gen.number, sorted(lost))
        self.roster.arrive(gen.number, self.me)

        def watch() -> None:
            new = self._lost(None) - reported
            if new:
                self.roster.report_lost(gen.number, sorted(new))
                reported.update(new)

        try:
            return self.roster.close_round(
                gen, self._deadline(), max_ranks=self.settings.elastic_max_ranks,
                min_ranks=self.state.min_ranks, min_nodes=self.settings.elastic_min_nodes,
                watch=watch)
        finally:
            leave(self.store)  # after arriving: peers that see us leave know we go on
            self._world = -1

    def _enter(self, gen: Generation) -> None:
        """Become a member of ``gen`` and agree on the state; rounds until one holds."""
        repeats = 0
        while True:
            if gen.ended:
                self.roster.end(gen.ended)
                raise ElasticError(f"the elastic job cannot go on: {gen.ended}")
            if self.me not in gen.members:
                raise ElasticError(f"worker {self.me} was left out of generation {gen.number} "
                                   f"of the elastic job (the others took it for lost)")
            try:
                self._connect(gen)
                self._agree()
                regroup_model(self.state.model)
                return
            except TandemError as exc:
                if not _missing_member(exc):
                    raise
                failed, gen = gen, self._round(self._lost(exc))
                # the same members failing again and again is not a lost member
                repeats = repeats + 1 if set(gen.members) >= set(failed.members) else 0
                if repeats >= 3:
                    raise ElasticError(f"generation {failed.number} failed to form three times "
                                       f"with every member alive: {exc}") from exc

    def _connect(self, gen: Generation) -> None:
        """Meet the members of ``gen`` in the store, then connect to them."""
        gone = self.roster.enter(gen, self.me, time.monotonic() + self.settings.connect_timeout)
        self.gen = gen  # from here, a failure is one of this generation
        if gone:
            self.roster.report_lost(gen.number, gone)
            raise PeerLostError(f"members {', '.join(gone)} did not come to generation "
                                f"{gen.number} of the elastic job")
        leave(self.store)
        self._world = -1
        enter(self.store, self.prefix, gen.number, gen.rank_of(self.me), len(gen.members),
              self.backend, self.timeout, self.settings.elastic_master_addr)
        self._world = gen.number

    def _agree(self) -> None:
        """Roll every member back to one commit; send it to the members without it."""
        g = default_group()
        held = self.state._commits_held()
        mine = torch.tensor([max(held, default=-1), min(held, default=-1)], dtype=torch.int64)
        table = [torch.empty(2, dtype=torch.int64) for _ in range(g.group_size)]
        all_gather(table, mine)
        rows = [(int(t[0]), int(t[1])) for t in table]
        holders = [r for r, (latest, _) in enumerate(rows) if latest >= 0]
        if not holders:
            raise ElasticError("no live rank holds the training state (every rank that held a "
                               "commit is gone); the job must restart from a checkpoint on disk")
        target = min(rows[r][0] for r in holders)
        for r in holders:
            if target not in rows[r]:
                raise ElasticError(f"rank {r} holds commits {sorted(set(rows[r]))}, not commit "
                                   f"{target} that rank {holders[0]} rolls back to: the ranks "
                                   f"did not commit at the same steps")
        me = g.group_rank
        if me in holders:
            self.state._roll_back(self.state._snapshot(target))
        receivers = [r for r in range(g.group_size) if r not in holders]
        packed: tuple[bytes, bytes] | None = None
        for i, r in enumerate(receivers):
            sender = holders[i % len(holders)]
            if me == sender:
                packed = packed or _live.pack(self.state._snapshot(target))
                _live.send_snapshot(g, r, *packed)
            elif me == r:
                snap = _live.recv_snapshot(g, sender, self.settings.max_frame)
                if snap.commit != target:
                    raise ElasticError(f"the live checkpoint from rank {sender} holds commit "
                                       f"{snap.commit}, not {target}")
                self.state._roll_back(snap)

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout


def _missing_member(exc: BaseException) -> bool:
    """Whether a failure to form a generation means a member is missing (then a round
    leaves it out) rather than a fault of this worker (then it propagates)."""
    if isinstance(exc, (ElasticError, ProtocolError)):
        return False
    return any(isinstance(e, (PeerLostError, TandemTimeout)) for e in _chain(exc))


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes and contexts (each once)."""
    out: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo and len(out) < 32:
        e = todo.pop()
        if e is None or any(e is seen for seen in out):
            continue
        out.append(e)
        todo += [e.__cause__, e.__context__]
    return out


def note(text: str) -> None:
    """A line on this worker's stderr (the launcher prefixes it with the rank)."""
    sys.stderr.write(f"tandem.elastic: {text}\n")
    sys.stderr.flush()
