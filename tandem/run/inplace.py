"""In-place recovery, the launcher's half: keep the survivors, replace what died.

A job opts in by training under ``tandem.elastic.run_elastic``: its workers say so in
the store once they formed generation 0 (:mod:`tandem.elastic.roster`). From then on a
worker that fails does not stop the others. The agent

* retires it (its failure is kept for the summary);
* starts a new worker for its slot while ``--max-restarts`` allows (each one counts as a
  restart): at once for a slot's first death, then after ``TANDEM_ELASTIC_BACKOFF``
  seconds, doubling with every further death of the slot, at most 64 times that; the
  new worker is announced in the store (``Roster.expect``) when it is planned;
* then tells the store that the old one exited, so the survivors' round closes without
  waiting any longer. In this order: a round short of the minimum (fewer ranks or
  nodes) waits for the exit reports of an agent's job (``Roster.manage``), then for the
  workers announced, and ends the job only when none is coming;
* keeps ``--spares`` extra workers per node waiting to join, started once the job runs
  elastic, so that a lost worker's place is taken in the survivors' own round (the new
  worker started for the lost slot then waits as the next spare);
* starts those new workers warm: forked from a zygote that has imported torch and
  tandem (:mod:`tandem.run.warm`): the agent's, which forked the first workers too,
  or else one started once the job runs elastic; a new worker
  waits for the zygote while it imports (it started earlier, so it is ready sooner
  than a new interpreter would be), and starts cold, with a line saying why, when the
  zygote cannot fork it (``--no-warm-start``: always cold);
* kills its workers that the other members left out of a new generation (they took it
  for lost: a collective timed out waiting on it), so that a stopped or hung worker
  is replaced like a dead one instead of holding its slot;
* falls back to stopping every worker (and the usual restart) when the workers decided
  the job cannot go on (fewer ranks or nodes than the minimum) or no member is alive.

New workers join in a world of their own (``RANK=0 WORLD_SIZE=1`` and a free
``MASTER_PORT`` on loopback, with ``TANDEM_ELASTIC_JOIN=1``): the script's code before
``run_elastic`` runs alone, then the worker waits to be let in (and takes the job's
``MASTER_ADDR`` again, ``TANDEM_ELASTIC_MASTER_ADDR``, so that its transport listens
where the other hosts reach it). Each worker has a name
in the job (``TANDEM_ELASTIC_ID``: node, slot, and the how-many-th of the slot), its own
directory for logs and error file (``rank_<r>``, then ``rank_<r>.<k>``; spares
``spare_<i>.<k>``) and output label (``[rank1.1]``, ``[spare0.0]``); once it is a member,
its lines show its rank in the latest generation (a spare that took rank 1: ``[rank1]``).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import signal
import time
from typing import Callable, Sequence

from tandem._proc import process_alive
from tandem.elastic.roster import Roster
from tandem.run.config import LaunchConfig
from tandem.run.rendezvous import Assignment
from tandem.run.rootcause import Failure
from tandem.run.warm import WarmPool, reap_strays
from tandem.run.workers import Worker, WorkerGroup, WorkerSpec

__all__ = ["InPlace", "elastic_prefix"]

MAX_BACKOFF_FACTOR = 64
STRAYS_INTERVAL = 1.0  # seconds between looks for exited processes the agent adopted


def elastic_prefix(base: str, attempt: int) -> str:
    """The store namespace of one attempt's elastic job."""
    return f"{base}/{attempt}/elastic"


def _name(w: Worker) -> str:
    return w.spec.env.get("TANDEM_ELASTIC_ID", "")


class InPlace:
    """One attempt's in-place recovery on this node; see the module docstring.

    ``store_url`` is how workers reach ``roster``'s store; ``budget`` the replacements
    still allowed; ``say`` prints a launcher line.
    """

    def __init__(self, cfg: LaunchConfig, a: Assignment, roster: Roster, store_url: str,
                 budget: int, backoff: float, say: Callable[[str], None],
                 pool: WarmPool | None = None) -> None:
        self._cfg, self._a = cfg, a
        self.roster = roster
        roster.manage()  # a round short of the minimum hears our exit reports first
        self._url = store_url
        self.budget = budget
        self._backoff = backoff
        self._say = say
        self.replaced = 0  # new workers started for lost ones (restarts used)
        self.failures: list[Failure] = []  # recovered in place
        self._deaths: collections.Counter[int] = collections.Counter()  # per slot
        self._starts: collections.Counter[int] = collections.Counter()  # per slot
        self._due: list[tuple[float, int]] = []  # (when, slot) of new workers to start
        self._coming: dict[str, Worker] = {}  # joiners started, not yet in the queue
        self._templates: dict[int, WorkerSpec] = {}
        self._spares_started = False
        # the zygote: the agent's, which started the workers (kept for every attempt), or
        # our own, made once the job runs elastic
        self._pool: WarmPool | None = pool
        self._own_pool = False
        self._reaped = 0.0  # when strays were last looked for
        self._labelled = -1  # the generation whose ranks label our workers' lines
        self._generation = 0  # the newest generation looked at for members left out
        self._evicted: dict[str, str] = {}  # workers killed for being left out: why

    # -- the workers' environment ------------------------------------------------------
    def prepare(self, spec: WorkerSpec) -> WorkerSpec:
        """``spec`` with what its worker needs to run elastic (if the script does)."""
        self._templates[spec.local_rank] = spec
        self._starts[spec.local_rank] = 1
        return dataclasses.replace(spec, env={**spec.env, **self._env(spec.local_rank, 0)})

    def _env(self, slot: int, k: int) -> dict[str, str]:
        cfg = self._cfg
        return {"TANDEM_ELASTIC_STORE": self._url,
                "TANDEM_ELASTIC_ID": f"n{self._a.node_rank}.s{slot}.{k}",
                "TANDEM_ELASTIC_MAX_RANKS": str(cfg.max_nodes * cfg.nproc_per_node),
                "TANDEM_ELASTIC_MIN_NODES": str(cfg.min_nodes),
                "TANDEM_ELASTIC_NODE": f"node{self._a.node_rank}"}

    def _joiner_spec(self, slot: int) -> WorkerSpec:
        nproc = self._cfg.nproc_per_node
        base = self._templates.get(slot) or self._templates[0]
        k = self._starts[slot]
        self._starts[slot] += 1
        label = f"rank{base.rank}.{k}" if slot < nproc else f"spare{slot - nproc}.{k}"
        where = os.path.join(os.path.dirname(os.path.dirname(base.error_file)),
                             label.replace("rank", "rank_").replace("spare", "spare_"))
        os.makedirs(where, exist_ok=True)
        error_file = os.path.join(where, "error.json")
        env = {**base.env, **self._env(slot, k), "TANDEM_ELASTIC_JOIN": "1",
               "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": str(slot), "MASTER_PORT": "0",
               "MASTER_ADDR": "127.0.0.1", "TANDEM_ERROR_FILE": error_file,
               "TANDEM_ELASTIC_MASTER_ADDR": base.env.get("MASTER_ADDR", "127.0.0.1")}
        return dataclasses.replace(base, local_rank=slot, env=env, error_file=error_file,
                                   log_dir=where if base.log_dir else None, label=label)

    # -- failures ---------------------------------------------------------------------------
    def recover(self, group: WorkerGroup,
                describe: Callable[[Sequence[Worker]], list[Failure]]) -> bool:
        """Handle ``group``'s failed workers in place; False when the job cannot go on so
        (not elastic, ended by its workers, or no member alive): then stop as before."""
        failed = group.failed()
        if not failed or not self.roster.is_on() or self.roster.ended():
            return False
        names = [_name(w) for w in failed]
        latest = self.roster.generation(self.roster.latest())
        exited = self.roster.exited() | set(names)
        if latest is None or not [m for m in latest.members if m not in exited]:
            for name in names:
                self.roster.report_exit(name)
            return False
        for w in failed:
            w.retired = True
            found = describe([w])
            self.failures += found
            self._forget(_name(w))
            what = found[0].brief() if found else f"rank {w.spec.rank} failed"
            if _name(w) in self._evicted:
                what += f" ({self._evicted.pop(_name(w))})"
            self._say(f"{what}; the other workers go on without it (in-place recovery); "
                      f"{self._plan(w.spec.local_rank)}")
        # after the replacements are announced: a survivors' round short of the minimum
        # waits for these reports, then for the workers announced (Roster.coming)
        for name in names:
            self.roster.report_exit(name)
        return True

    def _plan(self, slot: int) -> str:
        """Schedule a new worker for ``slot``; what the launcher will do, in words."""
        self._deaths[slot] += 1
        if self.replaced >= self.budget:
            return f"no new worker (--max-restarts {self._cfg.max_restarts} used up)"
        self.replaced += 1
        self.roster.expect(+1)  # at once, though it may start later (see recover)
        deaths = self._deaths[slot]
        delay = 0.0 if deaths == 1 else self._backoff * min(2 ** (deaths - 2),
                                                            MAX_BACKOFF_FACTOR)
        self._due.append((time.monotonic() + delay, slot))
        role = "spare" if self._cfg.spares else "replacement"
        when = "now" if not delay else f"in {delay:g}s (death {deaths} of this slot)"
        used = self._a.restart_count + self.replaced
        return f"a {role} starts {when} (restart {used} of {self._cfg.max_restarts})"

    def _forget(self, name: str) -> None:
        if self._coming.pop(name, None) is not None:
            self.roster.expect(-1)

    # -- every look at the workers ----------------------------------------------------------
    def tick(self, group: WorkerGroup) -> None:
        """Start due workers and spares; note joiners that arrived in the queue or died."""
        if self._cfg.warm_start and self._pool is None and self.roster.is_on():
            self._pool, self._own_pool = WarmPool(self._templates[0], self._say), True
            self._pool.start()  # unless its workers cannot start warm (then it says why)
        if self._pool is not None:  # hears the zygote; reaps what the agent adopted and is
            self._pool.ready()     # no worker of it: rare, so once a second (an agent of 32
            if time.monotonic() >= self._reaped + STRAYS_INTERVAL:  # workers has 100 threads
                self._reaped = time.monotonic()                     # to list children of)
                reap_strays([w.pid for w in group.workers] + self._pool.children())
        if self._cfg.spares and not self._spares_started and self.roster.is_on():
            self._spares_started = True
            for i in range(self._cfg.spares):
                self.roster.expect(+1)  # before it exists: a short round waits for it
                self._due.append((0.0, self._cfg.nproc_per_node + i))
        if self.roster.is_on():
            self._evict(group)
            self._label_by_rank(group)
        now = time.monotonic()
        for when, slot in [d for d in self._due if d[0] <= now]:
            if self._start(group, slot):  # announced when it was planned
                self._due.remove((when, slot))
        if self._coming:
            queued = set(self.roster.joiners())
            for name, w in list(self._coming.items()):
                if name in queued or not w.alive:
                    self._forget(name)

    def _label_by_rank(self, group: WorkerGroup) -> None:
        """Once a new generation formed, show each of our members by its rank in it: a
        spare that took rank 1 prints as ``[rank1]``, no longer ``[spare0.0]``."""
        number = self.roster.latest()
        if number == self._labelled:
            return
        gen = self.roster.generation(number)
        if gen is None or gen.ended:
            return
        self._labelled = number
        for w in group.workers:
            name = _name(w)
            if w.retired or name not in gen.members:
                continue
            rank = gen.rank_of(name)
            shown = w.spec.label or f"rank{w.spec.rank}"
            if shown != f"rank{rank}" and not shown.startswith(f"rank{rank}."):
                w.show_as(f"rank{rank}")

    def _evict(self, group: WorkerGroup) -> None:
        """Kill this node's workers that the other members left out of a new generation.

        The members take a member for lost when a collective timed out waiting on it (or
        its connection closed); one that is alive but stuck (stopped, hung in native
        code) never leaves by itself, and its slot would stay taken. Killed, it fails
        like any lost worker, and :meth:`recover` replaces it.
        """
        latest = self.roster.latest()
        while self._generation < latest:
            number = self._generation + 1
            before, after = self.roster.generation(number - 1), self.roster.generation(number)
            if before is None or after is None:
                return  # being written: look again next time
            self._generation = number
            if after.ended:
                continue  # the job stops: every worker is stopped anyway
            out = set(before.members) - set(after.members)
            for w in group.workers:
                name = _name(w)
                if name not in out or not w.alive or w.retired or name in self._evicted:
                    continue
                if w.worker_pid and not process_alive(w.worker_pid):
                    continue  # it died by itself (its supervisor has yet to say): not stuck
                self._evicted[name] = (f"killed: left out of generation {number} by the "
                                       f"other members, whose collectives timed out "
                                       f"waiting on it (it stopped answering)")
                self._say(f"worker {name} (rank {w.spec.rank}) stopped answering and was "
                          f"left out of generation {number}; killing it")
                w.send(signal.SIGKILL)

    def _start(self, group: WorkerGroup, slot: int) -> bool:
        """Start a new worker for ``slot``, warm if the zygote can; False to wait for the
        zygote, which is still importing."""
        pool = self._pool
        if pool is not None and pool.warming():
            return False
        spec = self._joiner_spec(slot)
        why = pool.unusable(spec) if pool is not None else ""
        worker = None
        if pool is not None and not why:
            try:
                worker = group.add(spec, launch=pool.launch)
            except OSError:
                why = pool.broken
        if pool is not None and why:
            self._say(f"worker {spec.env['TANDEM_ELASTIC_ID']} starts cold: {why}")
        worker = worker or group.add(spec)
        self._coming[spec.env["TANDEM_ELASTIC_ID"]] = worker
        return True

    def close(self) -> None:
        """Stop our own zygote; call when the attempt's workers are gone."""
        if self._pool is not None and self._own_pool:
            self._pool.close()

    def running(self) -> bool:
        """Whether the job runs elastic and has not been ended by its workers."""
        return self.roster.is_on() and not self.roster.ended()

    def finished_without_us(self, group: WorkerGroup) -> bool:
        """This node has no worker left in the job, and the job finished elsewhere."""
        return (not any(w.alive for w in group.workers if not w.retired)
                and self.roster.finished())

    def report(self) -> str:
        """The failures recovered in place, one per line (empty if none)."""
        if not self.failures:
            return ""
        lines = [f"tandemrun: recovered in place from {len(self.failures)} failure(s):"]
        lines += [f"  {f.brief()}" for f in sorted(self.failures, key=lambda f: f.time)]
        return "\n".join(lines)
