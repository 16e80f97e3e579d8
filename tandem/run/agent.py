"""The agent: rendezvous, start the local workers, watch them, restart or report.

One attempt: rendezvous -> start every local worker -> every ``--monitor-interval``
(or at once when a worker exits) check them. A failed worker (or a failure reported
by another node) stops the whole local group: SIGTERM to each worker's process group,
SIGKILL after ``--shutdown-timeout``. Up to ``--max-restarts`` further attempts follow
(``TANDEM_RESTART_COUNT`` = attempt number); then the agent prints the root-cause
summary (:mod:`tandem.run.rootcause`) and exits 1. The signals of
``--signals-to-handle`` are forwarded to every worker; SIGINT/SIGTERM/SIGHUP/SIGQUIT
also end the job (exit 128+signal, no restart), a second one skips the grace period.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
import secrets
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
from types import FrameType
from typing import Callable, ParamSpec, Sequence, TypeVar

from tandem._files import check_creatable
from tandem.config import load_secret, load_settings
from tandem.elastic.roster import Roster
from tandem.errors import ArgumentError
from tandem.run._reaper import MARK
from tandem.run._supervisor import KILL_REQUEST
from tandem.run.config import LaunchConfig
from tandem.run.containment import Containment, make_scratch
from tandem.run.dumps import (DUMP_CLOCK_SLACK, DUMP_WAIT, fresh_dumps, merge_job_timeline,
                              request_dumps)
from tandem.run.inplace import InPlace, elastic_prefix
from tandem.run.rendezvous import Assignment, LocalRendezvous, Rendezvous, StillWaiting
from tandem.run.rootcause import (EXIT_GRACE, Failure, format_summary, let_failing_ranks_exit,
                                  load_record, pick_root_cause)
from tandem.run.streams import Console
from tandem.run.workerenv import worker_specs
from tandem.run.warm import WarmPool
from tandem.run.workers import Launcher, Process, Worker, WorkerGroup, WorkerSpec, popen
from tandem.store.base import Store
from tandem.store.tcp import TCPStore

__all__ = ["Agent", "Outcome"]

ENDING = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT})
SHARED_SECRET_HELP = (
    "a multi-node job needs one secret shared by every node: export the same "
    "TANDEM_SECRET on each node (e.g. made once in the batch script with "
    "export TANDEM_SECRET=$(python -m tandem.secret)), or point "
    "TANDEM_SECRET_FILE at a file every node can read")


P = ParamSpec("P")
T = TypeVar("T")


class Outcome(enum.Enum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # a local worker failed
    REMOTE_FAILED = "remote failed"  # another node's worker failed
    MEMBERSHIP = "membership"  # a node waits to join (c10d with room to grow)
    SIGNALED = "signaled"


class _Interrupted(Exception):
    """Raised by the signal handler to leave a blocking rendezvous wait."""


class Agent:
    """Runs one node's share of a job; ``Agent(cfg).run()`` returns the exit code."""

    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg
        self.out, self.err = Console.pair()
        self.group: WorkerGroup | None = None
        self.ending: int | None = None  # the terminating signal received, if any
        self.ending_at = 0.0  # when (time.time()) it was received
        self._interruptible = False
        self.failures: list[Failure] = []
        self.stopped: list[int] = []
        self.containment = Containment()  # made by run()
        self.scratch = ""  # the launch's private directory, removed at the end
        self.inplace: InPlace | None = None  # the attempt's in-place recovery (elastic jobs)
        self._secret = b""
        self._own_store: TCPStore | None = None  # one node: the store elastic workers share
        self._pool: WarmPool | None = None  # the node's zygote, kept for every attempt

    def _say(self, text: str) -> None:
        self.err.message(f"tandemrun: {text}")

    def _env_extra(self) -> tuple[dict[str, str], bytes]:
        env, extra = os.environ, {}
        if "OMP_NUM_THREADS" not in env and self.cfg.nproc_per_node > 1:
            extra["OMP_NUM_THREADS"] = "1"  # as torchrun: N workers must not each use every core
            self._say("setting OMP_NUM_THREADS=1 for each worker (export it to tune)")
        if env.get("TANDEM_SECRET") or env.get("TANDEM_SECRET_FILE"):
            return extra, load_secret()
        if self.cfg.multi_node:
            raise ArgumentError(SHARED_SECRET_HELP)
        secret = secrets.token_hex(32)  # one per job: other jobs on the host cannot join
        extra["TANDEM_SECRET"] = secret
        return extra, secret.encode()

    def _rendezvous(self, secret: bytes) -> Rendezvous:
        if not self.cfg.multi_node:
            return LocalRendezvous(self.cfg, self.cfg.rdzv_id or uuid.uuid4().hex[:12])
        if self.cfg.rdzv_backend == "c10d":
            from tandem.run.dynamic import DynamicRendezvous

            return DynamicRendezvous(self.cfg, secret)
        from tandem.run.multinode import StoreRendezvous

        return StoreRendezvous(self.cfg, secret)

    def _still_waiting(self, rdzv: Rendezvous | None) -> StillWaiting | contextlib.nullcontext[None]:
        """Notices while the nodes meet: reaching the store (``rdzv`` None), then a round."""
        if not self.cfg.multi_node:
            return contextlib.nullcontext()
        from tandem.run.multinode import JOIN_TIMEOUT, connect_waiting

        if rdzv is None:
            describe, timeout = connect_waiting(self.cfg)
        else:
            describe, timeout = rdzv.waiting, self.cfg.conf("join_timeout", JOIN_TIMEOUT)
        return StillWaiting(self._say, describe, timeout)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        group = self.group
        if group is not None:
            group.signal_all(signal.SIGKILL if self.ending and signum in ENDING else signum)
        if signum in ENDING:
            if not self.ending:
                self.ending_at = time.time()
            self.ending = self.ending or signum
            if self._interruptible:
                raise _Interrupted()

    def _install_signals(self) -> dict[int, object]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {s: signal.signal(s, self._on_signal) for s in self.cfg.signals}

    def _blocking(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Call a rendezvous method that may block; an ending signal interrupts it."""
        self._interruptible = True
        try:
            if self.ending:
                raise _Interrupted()
            return fn(*args, **kwargs)
        finally:
            self._interruptible = False

    def run(self) -> int:
        extra, secret = self._env_extra()
        self._secret = secret
        files_root, self.scratch = self.cfg.log_dir, ""
        if files_root is not None:
            _check_log_dir(files_root)
        self.cfg.check_script()
        note = self.cfg.filter_note()
        if note:
            self._say(note)
        if files_root is None and self.cfg.keeps_files:
            files_root = tempfile.mkdtemp(prefix="tandemrun_logs_")  # kept: never swept
            self._say(f"-r/-t without --log-dir: logs go to {files_root}")
        elif files_root is None:
            files_root = self.scratch = make_scratch()
        self.containment = Containment.create()
        self._say(self.containment.describe())
        previous = self._install_signals()
        rdzv = None
        try:
            with self._still_waiting(None):
                rdzv = self._blocking(self._rendezvous, secret)
            return self._loop(rdzv, extra, files_root)
        except _Interrupted:
            return self._signaled()
        finally:
            try:
                merged = merge_job_timeline(os.environ)  # [timeline hook] TANDEM_TIMELINE
            except OSError as exc:
                merged = f"could not merge the timeline: {exc}"
            if merged:
                self._say(merged)
            if self.group is not None:
                self.group.close()
            if self._pool is not None:  # after the workers it forked
                self._pool.close()
            if self._own_store is not None:
                self._own_store.close()
            self.containment.close()
            if rdzv is not None:
                rdzv.close()
            for s, handler in previous.items():
                signal.signal(s, handler)  # type: ignore[arg-type]
            if self.scratch:
                shutil.rmtree(self.scratch, ignore_errors=True)
            self.out.close()  # shows the worker lines still held for de-duplication
            self.err.close()

    def _supervisor_options(self) -> tuple[str, ...]:
        """What each worker's supervisor needs (see ``tandem/run/_supervisor.py``)."""
        options: tuple[str, ...] = ("--parent", str(os.getpid()), "--kill-signal",
                                    str(int(KILL_REQUEST)),
                                    "--forward", ",".join(map(str, self.cfg.signals)))
        if self.containment.cgroup:
            options += ("--cgroup", self.containment.cgroup)
        if self.scratch:  # removed by the supervisors if the launcher dies first
            options += ("--scratch", self.scratch)
        return options

    def _signaled(self) -> int:
        sig = self.ending or signal.SIGTERM
        self._say(f"received {signal.Signals(sig).name}; workers stopped")
        return 128 + int(sig)

    def _loop(self, rdzv: Rendezvous, extra: dict[str, str], files_root: str) -> int:
        cfg = self.cfg
        attempt, restarts = 0, 0
        while True:
            with self._still_waiting(rdzv):
                a: Assignment = self._blocking(rdzv.next_round, attempt, restarts)
            attempt, restarts = a.attempt, a.restart_count
            outcome = self._attempt(rdzv, a, extra, files_root)
            if self.inplace is not None:  # workers replaced in place used restarts
                restarts += self.inplace.replaced
            if outcome is Outcome.SUCCEEDED:
                if self.inplace is not None and self.inplace.report():
                    self.err.message(self.inplace.report())
                return 0
            if outcome is Outcome.SIGNALED:
                return self._signaled()
            attempt += 1
            if outcome is Outcome.MEMBERSHIP:
                self._say(f"a node is waiting to join; restarting the workers with it "
                          f"(round {attempt}; not counted as a restart)")
                continue
            # every node's records: a failure elsewhere may have come first
            self.failures += self._blocking(rdzv.remote_failures, a.attempt)
            if restarts < cfg.max_restarts:
                restarts += 1
                first = pick_root_cause(self.failures).brief() if self.failures else None
                self._say(f"attempt {a.attempt} failed ({first or 'on another node'}); "
                          f"restarting the workers (restart {restarts} of {cfg.max_restarts})")
                self.failures, self.stopped = [], []
                continue
            if not self.failures:
                self._say("the job failed on another node, which reported no details")
                return 1
            self.err.message(format_summary(self.failures, run_id=a.run_id,
                                            attempts=restarts + 1, stopped=self.stopped))
            return 1

    def _attempt(self, rdzv: Rendezvous, a: Assignment, extra: dict[str, str],
                 files_root: str) -> Outcome:
        cfg = self.cfg
        specs = worker_specs(cfg, a, base=os.environ, extra=extra, files_root=files_root,
                             keep_logs=cfg.keeps_files, supervisor=self._supervisor_options(),
                             cgroup=self.containment.cgroup)
        if self.containment.mark:  # what the job's reaper looks for, and its pipe
            specs = [dataclasses.replace(s, env={**s.env, MARK: self.containment.mark},
                                         guard=self.containment.guard) for s in specs]
        pool = self._warm_pool(specs)
        inplace = self.inplace = self._in_place(rdzv, a, pool)
        specs = [inplace.prepare(spec) for spec in specs]
        group = self.group = WorkerGroup(specs, self.out, self.err)
        started = time.time()
        while pool is not None and pool.warming() and self.ending is None:
            pool.wait(cfg.monitor_interval)  # one import for the node, not one per worker
        if pool is not None:
            pool.hold()  # they start together
        try:
            group.start(lambda: self.ending is not None,
                        launch=popen if pool is None else self._warm_launcher(pool))
        finally:
            if pool is not None:
                pool.release()
        try:
            while True:
                if self.ending:
                    self.stopped = group.stop(None, cfg.shutdown_timeout)
                    # only dumps the signal caused (Ctrl-C in a collective), not older ones
                    dumped = fresh_dumps(group.workers, self.ending_at - DUMP_CLOCK_SLACK)
                    if dumped:
                        self._say(dumped)
                    return Outcome.SIGNALED
                if rdzv.membership_changed(a.attempt):  # before failures: ours may follow
                    group.stop(signal.SIGTERM, cfg.shutdown_timeout)
                    return Outcome.MEMBERSHIP
                if group.failed() and inplace.recover(group, lambda ws: self._failures(ws, a)):
                    continue  # the others go on without it (tandem.elastic)
                if group.failed():
                    rdzv.publish_failure(a.attempt, self._collect(group, a, None))
                    # [root cause hook] the rank that caused it may still be exiting
                    let_failing_ranks_exit(group, min(EXIT_GRACE, cfg.shutdown_timeout))
                    since = time.time()
                    self._dump_recorders(group, started)  # [flight recorder hook]
                    self.stopped = group.stop(signal.SIGTERM, cfg.shutdown_timeout)
                    self.failures = inplace.failures + self._collect(group, a, since)
                    rdzv.publish_failure(a.attempt, self.failures)
                    return Outcome.FAILED
                inplace.tick(group)
                if inplace.finished_without_us(group):
                    return Outcome.SUCCEEDED  # this node's workers were lost; the job went on
                if group.all_succeeded():
                    ok = self._blocking(rdzv.finish, a.attempt, cfg.monitor_interval,
                                        lambda: self.ending is not None)
                    return Outcome.SUCCEEDED if ok else (
                        Outcome.SIGNALED if self.ending else Outcome.REMOTE_FAILED)
                if rdzv.remote_failed(a.attempt) and not inplace.running():
                    since = time.time()
                    self._dump_recorders(group, started)  # [flight recorder hook]
                    self.stopped = group.stop(signal.SIGTERM, cfg.shutdown_timeout)
                    self.failures = self._collect(group, a, since)
                    if self.failures:
                        rdzv.publish_failure(a.attempt, self.failures)
                    return Outcome.REMOTE_FAILED
                group.changed.wait(cfg.monitor_interval)
                group.changed.clear()
        finally:
            if group.alive():  # leaving on an error (e.g. the store's host is gone)
                group.stop(signal.SIGTERM, cfg.shutdown_timeout)
            group.close()
            inplace.close()  # the zygote, after the workers it forked
            self.group = None

    def _warm_pool(self, specs: Sequence[WorkerSpec]) -> WarmPool | None:
        """The node's zygote, started with the first attempt's workers: they and every
        later one are forked from it, ``import torch`` paid once per node instead of once
        per worker. None when warm starts are off, for one worker per node (nothing to
        share: its zygote starts once the job runs elastic, :mod:`tandem.run.inplace`),
        and for workers that are no script or module of this interpreter."""
        if self._pool is not None:  # broken or not: the workers start cold, with its reason
            return self._pool
        if not self.cfg.warm_start or self.cfg.nproc_per_node < 2 or not specs:
            return None
        pool = WarmPool(specs[0], self._say)
        if pool.unusable(specs[0]):  # --no-python: no zygote, and nothing to say
            return None
        pool.start()
        self._pool = pool
        return pool

    def _warm_launcher(self, pool: WarmPool) -> Launcher:
        """Start a worker forked from ``pool``'s zygote, or cold when it cannot (the pool
        said why: it failed, or was not ready within its deadline)."""

        def launch(spec: WorkerSpec, report: int, wanted: dict[str, bool]) -> Process:
            why = pool.unusable(spec)
            if not why:
                try:
                    return pool.launch(spec, report, wanted)
                except OSError:
                    pass  # the pool is broken now and said so; this worker and the rest cold
            elif not pool.broken:
                self._say(f"worker of rank {spec.rank} starts cold: {why}")
            return popen(spec, report, wanted)

        return launch

    def _dump_recorders(self, group: WorkerGroup, started: float) -> None:
        """Let the live workers dump their flight recorders before they are stopped."""
        request_dumps(group.alive(), min(DUMP_WAIT, self.cfg.shutdown_timeout))
        line = fresh_dumps(group.workers, started)
        if line:
            self._say(line)

    def _in_place(self, rdzv: Rendezvous, a: Assignment, pool: WarmPool | None) -> InPlace:
        """The attempt's in-place recovery, on the store every node shares (one node: a
        store of our own, made once and kept for every attempt)."""
        shared = rdzv.shared_store()
        if shared is None:
            if self._own_store is None:
                self._own_store = TCPStore(self.cfg.master_addr, 0, is_master=True,
                                           wait_for_workers=False, secret=self._secret)
            store: Store = self._own_store
            where = f"{self.cfg.master_addr}:{self._own_store.port}"
        else:
            store, where = shared
        prefix = elastic_prefix("tandemrun", a.attempt)
        return InPlace(self.cfg, a, Roster(store, prefix), f"tcp://{where}?prefix={prefix}",
                       budget=self.cfg.max_restarts - a.restart_count,
                       backoff=load_settings().elastic_backoff, say=self._say, pool=pool)

    def _collect(self, group: WorkerGroup, a: Assignment, since: float | None) -> list[Failure]:
        """Failed workers, leaving out those that only died of our stop signal and those
        recovered in place (``self.inplace`` has them)."""
        return self._failures([w for w in group.workers if not w.retired], a, since)

    def _failures(self, workers: Sequence[Worker], a: Assignment,
                  since: float | None = None) -> list[Failure]:
        out = []
        host = socket.gethostname()
        for w in workers:
            if w.returncode in (None, 0):
                continue
            record = load_record(w.spec.error_file)
            if since is not None and record is None and (w.exit_time or 0) >= since:
                continue  # stopped by us, not a failure of its own
            f = Failure(rank=w.spec.rank, local_rank=w.spec.local_rank, node_rank=a.node_rank,
                        host=host, pid=w.worker_pid or w.pid, time=w.exit_time or time.time(),
                        returncode=w.returncode, role=self.cfg.role,
                        error_file=w.spec.error_file if record and self.cfg.keeps_files else "",
                        log_dir=w.spec.log_dir or "")
            f.merge_record(record, on_console=w.spec.stderr_console)
            out.append(f)
        if since is not None:
            self.stopped = [r for r in self.stopped if r not in {f.rank for f in out}]
        return out


def _check_log_dir(path: str) -> None:
    """Make ``--log-dir`` now, so that a bad one is a one-line error before any worker runs."""
    try:
        os.makedirs(path, exist_ok=True)
        check_creatable(path)  # a real file: os.access says yes to root on a read-only mount
    except OSError as exc:
        raise ArgumentError(f"--log-dir {path}: cannot write logs there "
                            f"({exc.strerror or exc})") from None
