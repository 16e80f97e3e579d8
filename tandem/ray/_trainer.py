"""The driver's side: place the actors, number the ranks, run, watch, replace, collect."""

from __future__ import annotations

import builtins
import dataclasses
import re
import sys
import time
from typing import Any, Callable, Mapping, TextIO

from tandem._words import secs
from tandem.config import load_settings
from tandem.elastic.roster import Roster
from tandem.errors import ArgumentError, StateError, TimeoutError, WorkerFailedError
from tandem.ray._actor import OutputSink, RankActor
from tandem.ray._scaling import Placed, ScalingConfig, assign_ranks
from tandem.secret import new_secret
from tandem.store.tcp import TCPStore

__all__ = ["Trainer"]

ELASTIC_PREFIX = "tandem/ray/elastic"
_POLL_S = 0.2  # how often the driver fetches the ranks' output and looks for deaths
# after a rank fails, how long the others may take to fail too (they notice the closed
# connections at once) before the driver stops them: their errors name the cause
_SETTLE_S = 15.0
_CAUSE_CHARS = 600
_TRACEBACK_CHARS = 4000


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise StateError("tandem.ray needs Ray, which is not installed here: "
                         "pip install 'tandem[ray]' (or pip install ray)") from exc
    return ray


@dataclasses.dataclass
class _Slot:
    """One rank's place: its bundle, the actor in it now, where that actor landed."""

    index: int
    rank: int
    actor: Any = None
    placed: Placed | None = None
    ref: Any = None  # the running ``run`` call
    name: str = ""  # the worker's elastic name
    starts: int = 1
    done: bool = False
    value: Any = None
    joining: bool = False  # a replacement not yet in the elastic joiner queue
    traceback: str = ""  # Ray's account of the exception the function raised


class Trainer:
    """Run ``train_loop_per_worker`` on ``scaling_config.num_workers`` Ray actors as the
    ranks of one tandem job; :meth:`fit` returns each rank's return value.

    ``train_loop_per_worker(config)`` (or ``()`` without ``train_loop_config``) calls
    ``tandem.init_process_group()`` with nothing else: ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT`` and ``TANDEM_SECRET`` are set in its actor. ``address``: the Ray
    cluster (``ray.init(address)``); None and Ray not yet initialised: ``ray.init()``,
    which starts Ray on this machine unless ``RAY_ADDRESS`` names a cluster.
    ``max_restarts``: for a job that trains under ``tandem.elastic.run_elastic``, how
    many lost actors are replaced in place (the others keep going). ``start_timeout``
    bounds placing the actors; ``timeout`` (None: none) the whole run.
    """

    def __init__(self, train_loop_per_worker: Callable[..., Any], *,
                 scaling_config: ScalingConfig,
                 train_loop_config: Mapping[str, Any] | None = None,
                 address: str | None = None, max_restarts: int = 0,
                 start_timeout: float = 180.0, timeout: float | None = None,
                 stdout: TextIO | None = None, stderr: TextIO | None = None) -> None:
        if not callable(train_loop_per_worker):
            raise ArgumentError(f"Trainer(train_loop_per_worker={train_loop_per_worker!r}): "
                                f"expected a function")
        if not isinstance(scaling_config, ScalingConfig):
            raise ArgumentError(f"Trainer(scaling_config={scaling_config!r}): expected a "
                                f"tandem.ray.ScalingConfig")
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) \
                or max_restarts < 0:
            raise ArgumentError(f"Trainer(max_restarts={max_restarts!r}): expected an int >= 0")
        for what, value in (("start_timeout", start_timeout), ("timeout", timeout)):
            if value is not None and not value > 0:
                raise ArgumentError(f"Trainer({what}={value!r}): expected seconds > 0")
        self.fn = train_loop_per_worker
        self.scaling = scaling_config
        self.config = train_loop_config
        self.address = address
        self.max_restarts = max_restarts
        self.start_timeout = start_timeout
        self.timeout = timeout
        self._out = stdout
        self._err = stderr
        self.replaced = 0  # actors replaced in place during the last fit()
        self.failures: list[str] = []  # ranks recovered from in place, in words
        self._sink: Any = None
        self._labels: dict[str, str] = {}  # an actor's key in the sink -> its line prefix
        self._dropped = 0

    # -- the run ---------------------------------------------------------------------------
    def fit(self) -> list[Any]:
        """Run the job; each rank's return value, by rank (see the module docstring)."""
        ray = _ray()
        self.replaced, self.failures, self._labels, self._dropped = 0, [], {}, 0
        started = False
        if not ray.is_initialized():
            ray.init(address=self.address)
            started = True
        pg = None
        slots: list[_Slot] = []
        store: TCPStore | None = None
        try:
            self.scaling.check_fits(ray.nodes())
            pg = self._place(ray)
            self._sink = self._new_sink(ray)
            slots = [_Slot(i, -1) for i in range(self.scaling.num_workers)]
            for s in slots:
                s.actor = self._new_actor(ray, pg, s)
            deadline = time.monotonic() + self.start_timeout
            placed = self._get(ray, [s.actor.where.remote() for s in slots], deadline,
                               "the actors to start")
            for s, p in zip(slots, placed):
                s.placed = Placed(*p)
            ranks = assign_ranks([s.placed for s in slots if s.placed is not None])
            for s, (rank, *_rest) in zip(slots, ranks):
                s.rank = rank
                self._labels[f"{s.index}.0"] = f"rank{rank}"
            first = next(s for s in slots if s.rank == 0)
            assert first.placed is not None
            port = self._get(ray, [first.actor.free_port.remote()], deadline,
                             "rank 0's actor to pick a port")[0]
            secret = new_secret()  # handed to the actors in their call, never logged
            base = {"WORLD_SIZE": str(len(slots)), "MASTER_ADDR": first.placed.ip,
                    "MASTER_PORT": str(port), "TANDEM_SECRET": secret,
                    "GROUP_WORLD_SIZE": str(len({s.placed.node_id for s in slots
                                                 if s.placed is not None}))}
            roster = None
            if self.max_restarts:
                store, roster = self._elastic_store(ray, secret)
                base["TANDEM_ELASTIC_STORE"] = f"tcp://{store.host}:{store.port}" \
                    f"?prefix={ELASTIC_PREFIX}"
                base["TANDEM_ELASTIC_MAX_RANKS"] = str(len(slots))
            fn = ray.put(self.fn)
            for s, (rank, local, local_size, node_rank) in zip(slots, ranks):
                assert s.placed is not None
                s.name = f"w{s.index}.0"
                env = {**base, "RANK": str(rank), "LOCAL_RANK": str(local),
                       "LOCAL_WORLD_SIZE": str(local_size), "GROUP_RANK": str(node_rank),
                       "TANDEM_ELASTIC_ID": s.name, "TANDEM_ELASTIC_NODE": s.placed.node_id}
                s.ref = s.actor.run.remote(fn, self.config, env)
            return self._watch(ray, pg, slots, fn, base, roster)
        finally:
            if self._sink is not None:
                self._kill(ray, self._sink)
                self._sink = None
            for s in slots:
                if s.actor is not None:
                    self._kill(ray, s.actor)
            if pg is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(pg)
            if store is not None:
                store.close()
            if started:
                ray.shutdown()

    def _place(self, ray: Any) -> Any:
        from ray.util.placement_group import placement_group, remove_placement_group

        n = self.scaling.num_workers
        pg = placement_group([self.scaling.bundle()] * n,
                             strategy=self.scaling.placement_strategy)
        ready, _ = ray.wait([pg.ready()], timeout=self.start_timeout)
        if not ready:
            remove_placement_group(pg)
            raise TimeoutError(f"tandem.ray: {n} bundles of {self.scaling.bundle()} "
                               f"({self.scaling.placement_strategy}) were not placed within "
                               f"start_timeout={secs(self.start_timeout)}s; the cluster has "
                               f"{ray.available_resources()} free of "
                               f"{ray.cluster_resources()}")
        return pg

    def _new_actor(self, ray: Any, pg: Any, s: _Slot) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=s.index)
        extra = dict(self.scaling.resources_per_worker)
        return ray.remote(RankActor).options(
            num_cpus=self.scaling.cpus_per_worker, resources=extra or None, max_restarts=0,
            scheduling_strategy=strategy).remote(self._sink, f"{s.index}.{s.starts - 1}")

    @staticmethod
    def _new_sink(ray: Any) -> Any:
        """The actors' output sink, on the driver's node (no CPU of the job's)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                              soft=True)
        return ray.remote(OutputSink).options(num_cpus=0, scheduling_strategy=here).remote()

    @staticmethod
    def _kill(ray: Any, actor: Any) -> None:
        try:
            ray.kill(actor)
        except Exception:  # already gone
            pass

    @staticmethod
    def _get(ray: Any, refs: list[Any], deadline: float, what: str) -> list[Any]:
        left = max(deadline - time.monotonic(), 0.0)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=left)
        if len(ready) < len(refs):
            raise TimeoutError(f"tandem.ray: timed out waiting for {what} "
                               f"({len(ready)} of {len(refs)} answered)")
        return list(ray.get(refs))

    def _elastic_store(self, ray: Any, secret: str) -> tuple[TCPStore, Roster]:
        """The membership store, in the driver: it outlives every actor."""
        settings = load_settings()
        store = TCPStore(ray.util.get_node_ip_address(), 0, is_master=True,
                         wait_for_workers=False, timeout=settings.timeout, secret=secret)
        roster = Roster(store, ELASTIC_PREFIX)
        roster.manage()  # the driver reports every lost actor, as a launcher's agent does
        return store, roster

    # -- watching ----------------------------------------------------------------------
    def _print(self, label: str, stream: str, text: str) -> None:
        out = (self._out or sys.stdout) if stream == "stdout" else (self._err or sys.stderr)
        out.write(f"[{label}]: {text}\n")
        out.flush()

    def _drain(self, ray: Any) -> None:
        """Print every line the actors pushed since the last look."""
        if self._sink is None:
            return
        try:
            lines, dropped = ray.get(self._sink.take.remote(), timeout=60)
        except (ray.exceptions.RayError, builtins.TimeoutError) as exc:  # its node is gone
            self._print("tandem.ray", "stderr", f"the ranks' output is lost from here on: "
                        f"its sink actor failed ({type(exc).__name__}); the job goes on")
            self._sink = None
            return
        if dropped > self._dropped:
            self._print("tandem.ray", "stderr", f"{dropped - self._dropped} lines of the "
                        f"ranks' output were dropped: the driver fell behind")
            self._dropped = dropped
        for key, stream, text in lines:
            self._print(self._labels.get(key, key), stream, text)

    def _watch(self, ray: Any, pg: Any, slots: list[_Slot], fn: Any, base: dict[str, str],
               roster: Roster | None) -> list[Any]:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        failed: list[tuple[float, _Slot, str, bool]] = []  # (when, slot, cause, died)
        settle_until = None
        while True:
            running = [s for s in slots if not s.done]
            if not running:
                break
            done, _ = ray.wait([s.ref for s in running], num_returns=1, timeout=_POLL_S)
            self._drain(ray)
            self._joined(slots, roster)
            for s in running:
                if s.ref not in done:
                    continue
                try:
                    s.value = ray.get(s.ref)
                    s.done = True
                    continue
                except ray.exceptions.RayActorError as exc:
                    cause, died = self._death(exc), True
                except ray.exceptions.RayTaskError as exc:
                    cause, died = self._raised(exc), False
                    s.traceback = str(exc)
                except ray.exceptions.RayError as exc:  # lost with its node, out of memory
                    cause, died = self._death(exc), True
                if died and roster is not None and self._replace(ray, pg, s, fn, base,
                                                                 roster, cause):
                    continue
                s.done = True
                failed.append((time.monotonic(), s, cause, died))
                if settle_until is None:
                    settle_until = time.monotonic() + _SETTLE_S
            now = time.monotonic()
            if settle_until is not None and now > settle_until:
                break
            if deadline is not None and self.timeout is not None and now > deadline and not failed:
                raise TimeoutError(f"tandem.ray: the job ran past timeout="
                                   f"{secs(self.timeout)}s ({len(running)} ranks still running)")
        self._drain(ray)  # the lines pushed as the last ranks ended
        if failed:
            raise self._failure(slots, failed)
        return [s.value for s in sorted(slots, key=lambda s: s.rank)]

    @staticmethod
    def _death(exc: Exception) -> str:
        """How Ray says the actor's process ended, in one line."""
        text = " ".join(str(exc).split())
        kind = re.search(r"Worker exit type: (\S+)", text)
        detail = re.search(r"Worker exit detail: (.*?)\.(?: End of file\.)?(?= |$)", text)
        if kind or detail:
            eof = " (end of file: killed, by a signal or the OOM killer, or crashed)" \
                if "End of file" in text else ""
            said = ", ".join(x for x in (kind.group(1) if kind else "",
                                         detail.group(1) if detail else "") if x)
            return f"died: its actor's process ended{eof}; Ray says {said}"[:_CAUSE_CHARS]
        return f"died: {text}"[:_CAUSE_CHARS]

    @staticmethod
    def _raised(exc: Exception) -> str:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            return f"raised {type(cause).__name__}: {cause}"
        return "raised " + " ".join(str(exc).split())[-_CAUSE_CHARS:]

    def _where(self, s: _Slot) -> str:
        p = s.placed
        return f"rank {s.rank} (node {p.ip}, host {p.host}, pid {p.pid})" if p else \
            f"rank {s.rank}"

    def _failure(self, slots: list[_Slot], failed: list[tuple[float, _Slot, str, bool]],
                 ) -> WorkerFailedError:
        # the root cause: a death before the peers that lost their connection to it
        consequence = ("PeerLostError", "CollectiveTimeoutError")

        def order(item: tuple[float, _Slot, str, bool]) -> tuple[int, float]:
            when, _, cause, died = item
            return (0 if died or not any(c in cause for c in consequence) else 1, when)

        root = min(failed, key=order)
        _, s, cause, _ = root
        lines = [f"tandem.ray: {self._where(s)} {cause}"]
        if s.traceback:  # the root cause's own traceback, from Ray
            lines.append(s.traceback[-_TRACEBACK_CHARS:])
        for _, other, ocause, _ in sorted(failed, key=order)[1:]:
            lines.append(f"  then {self._where(other)} {ocause}")
        still = [x for x in slots if not x.done]
        if still:
            lines.append(f"  stopped by the driver: rank(s) {sorted(x.rank for x in still)}")
        p = s.placed
        return WorkerFailedError("\n".join(lines), rank=s.rank, node=p.ip if p else "",
                                 cause=cause)

    # -- in-place recovery -----------------------------------------------------------------
    def _replace(self, ray: Any, pg: Any, s: _Slot, fn: Any, base: dict[str, str],
                 roster: Roster, cause: str) -> bool:
        """A new actor for lost slot ``s`` that joins the survivors; False: cannot."""
        if not roster.is_on() or roster.ended() or self.replaced >= self.max_restarts:
            return False
        old = s.name
        if s.joining:  # a replacement lost before it queued: its announcement goes
            s.joining = False
            roster.expect(-1)
        self.failures.append(f"{self._where(s)} {cause}")
        self.replaced += 1
        self._print("tandem.ray", "stderr",
                    f"{self._where(s)} {cause}; the other ranks go on without it; a "
                    f"replacement starts now (restart {self.replaced} of "
                    f"{self.max_restarts})")
        roster.expect(+1)  # before the exit report: a short round waits for it
        roster.report_exit(old)
        s.starts += 1
        key = f"{s.index}.{s.starts - 1}"
        self._labels[key] = f"rank{s.rank}.{s.starts - 1}"
        s.actor = self._new_actor(ray, pg, s)
        deadline = time.monotonic() + self.start_timeout
        s.placed = Placed(*self._get(ray, [s.actor.where.remote()], deadline,
                                     "a replacement actor to start")[0])
        port = self._get(ray, [s.actor.free_port.remote()], deadline,
                         "a replacement actor to pick a port")[0]
        s.name = f"w{s.index}.{s.starts - 1}"
        # a joiner's code before run_elastic runs in a world of its own, then it waits to
        # be let in; its transport then listens where the other nodes reach it
        env = {**base, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
               "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "TANDEM_ELASTIC_JOIN": "1",
               "TANDEM_ELASTIC_MASTER_ADDR": base["MASTER_ADDR"],
               "TANDEM_ELASTIC_ID": s.name, "TANDEM_ELASTIC_NODE": s.placed.node_id}
        s.ref = s.actor.run.remote(fn, self.config, env)
        s.joining = True  # announced (expect +1) until it is in the joiner queue
        return True

    @staticmethod
    def _joined(slots: list[_Slot], roster: Roster | None) -> None:
        """Withdraw the announcement of each replacement now queued (or gone)."""
        joining = [s for s in slots if s.joining]
        if roster is None or not joining:
            return
        queued = set(roster.joiners())
        for s in joining:
            if s.name in queued or s.done:
                s.joining = False
                roster.expect(-1)
