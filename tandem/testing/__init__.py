"""Test harness: run a function on N ranks, as processes or as threads.

Processes (real sockets, real failures)::

    from tandem.testing import spawn
    def check(rank, world_size):            # module level, so children can import it
        t = torch.full((4,), float(rank))
        tandem.all_reduce(t)
        return t.tolist()
    results = spawn(2, check)               # [rank0 result, rank1 result]

Each child runs with ``torch.set_num_threads(1)``, joins through a FileStore in a
fresh temporary directory (or a TCPStore on port 0 hosted by the parent), never a
fixed port. The whole run has one deadline; every child is SIGKILLed at the end,
whatever happened; an error comes back with the failing rank's traceback.
:func:`launch` returns per-rank outcomes instead of raising, for fault tests.

Threads over the in-process loopback transport (fast, deterministic algorithm
tests): :func:`run_threads` gives each thread a ``ProcessGroup``.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import pickle
import queue
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Sequence

from tandem._proc import process_stopped

__all__ = ["spawn", "launch", "Outcome", "run_threads", "RankFailed", "wait_until",
           "stay_until_reported"]


class RankFailed(AssertionError):
    """One or more ranks failed; the message has each failing rank's traceback."""


@dataclasses.dataclass
class Outcome:
    rank: int
    ok: bool
    value: Any = None
    error: str = ""  # the formatted traceback, for failures
    error_type: str = ""  # the exception's class name, for failures
    exitcode: int | None = None


def _child(fn: Callable[..., Any], rank: int, world_size: int, args: Sequence[Any],
           init: dict[str, Any], env: dict[str, str], results: Any) -> None:
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    import tandem

    try:
        if init:
            if "store_port" in init:
                store = tandem.TCPStore("127.0.0.1", init["store_port"], world_size,
                                        is_master=False, timeout=init["timeout"])
                tandem.init_process_group(init["backend"], store=store, rank=rank,
                                          world_size=world_size, timeout=init["timeout"])
            else:
                tandem.init_process_group(init["backend"], init_method=init["init_method"],
                                          rank=rank, world_size=world_size,
                                          timeout=init["timeout"])
        # plain pickle copies tensor bytes; the queue's own pickler would share storage by
        # file descriptor, which dies with this process before the parent reads it
        value = pickle.dumps(fn(rank, world_size, *args))
        results.put((rank, True, value, "", ""))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, None, traceback.format_exc(), type(exc).__name__))
    finally:
        if init and tandem.is_initialized():
            try:
                tandem.destroy_process_group()
            except Exception:  # noqa: BLE001 - the result is already reported
                pass
        elif tandem.is_initialized():
            # what the interpreter's exit does for a script: a child ends with os._exit
            from tandem.collectives.world import tell_failures_at_exit

            tell_failures_at_exit()


_context: Any = None
_TEST_SECRET = "tandem-test-secret"


def _mp() -> Any:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        # torch._dynamo: building any torch optimizer imports it (with inductor, sympy and
        # ~800 modules), which took each rank 3-17 s (idle to load 13) before its first
        # step; imported once here, it costs a rank nothing. It starts no thread. The
        # tandem packages after it took a rank 0.2-0.5 s each at load 12.
        _context.set_forkserver_preload(["torch", "torch._dynamo", "tandem.collectives.api",
                                          "tandem.collectives.p2p", "tandem.collectives.objects",
                                          "tandem.collectives.subgroups", "tandem.parallel",
                                          "tandem.optim", "tandem.elastic"])
    return _context


def launch(world_size: int, fn: Callable[..., Any], args: Sequence[Any] = (), *,
           timeout: float = 60.0, backend: str = "tcp", init: bool = True,
           rendezvous: str = "file", op_timeout: float = 30.0,
           env: dict[str, str] | None = None) -> list[Outcome]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; never raises for ranks.

    Ranks still running at ``timeout`` are killed and reported with
    ``error == "deadline"``. Ranks left stopped (SIGSTOP) once every other rank has
    exited, which nothing here would resume, are killed then, without waiting for the
    deadline, and reported with ``error == "stopped"``.
    """
    ctx = _mp()
    results = ctx.Queue()
    server = None
    with tempfile.TemporaryDirectory(prefix="tandem-test-") as tmp:
        spec: dict[str, Any] = {}
        if init:
            spec = {"backend": backend, "timeout": op_timeout}
            if rendezvous == "tcp":
                import tandem

                secret = (env or {}).get("TANDEM_SECRET", _TEST_SECRET).encode()
                server = tandem.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                                         wait_for_workers=False, timeout=op_timeout,
                                         secret=secret)
                spec["store_port"] = server.port
            else:
                spec["init_method"] = f"file://{tmp}/store"
        # flight-recorder dumps of failing ranks stay in the test's temporary directory
        child_env = {"TANDEM_SECRET": _TEST_SECRET, "TANDEM_TRACE_DIR": f"{tmp}/trace",
                     **(env or {})}
        procs = [ctx.Process(target=_child, args=(fn, r, world_size, tuple(args), spec,
                                                  child_env, results), daemon=True)
                 for r in range(world_size)]
        deadline = time.monotonic() + timeout
        outcomes: dict[int, Outcome] = {}
        stopped: list[int] = []
        try:
            for p in procs:
                p.start()
            while len(outcomes) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    _record(results.get(timeout=min(left, 0.2)), outcomes)
                except queue.Empty:
                    for r, p in enumerate(procs):  # a child that died without reporting
                        if r not in outcomes and p.exitcode is not None:
                            _drain(results, outcomes)
                            if r not in outcomes:
                                outcomes[r] = Outcome(r, False, error=f"exited with code "
                                                      f"{p.exitcode} without a result",
                                                      error_type="exit", exitcode=p.exitcode)
                    stopped = _only_stopped_left(procs, outcomes)
                    if stopped:
                        break
        finally:
            started = [p for p in procs if p.pid is not None]
            for p in started:
                if p.is_alive():
                    p.kill()
            for p in started:
                p.join(5)
            if server is not None:
                server.close()
            results.close()
        for r, p in enumerate(procs):
            if r not in outcomes:
                why = "stopped" if r in stopped else "deadline"
                outcomes[r] = Outcome(r, False, error=why, error_type=why)
            outcomes[r].exitcode = p.exitcode
        return [outcomes[r] for r in range(world_size)]


def _only_stopped_left(procs: Sequence[Any], outcomes: dict[int, Outcome]) -> list[int]:
    """The ranks without an outcome if every one of them is stopped and every other rank
    has exited (then nothing here can resume them); else []."""
    left = [r for r in range(len(procs)) if r not in outcomes]
    if any(procs[r].exitcode is None for r in outcomes):
        return []
    if left and all(process_stopped(procs[r].pid) for r in left):
        return left
    return []


def _drain(results: Any, outcomes: dict[int, Outcome]) -> None:
    time.sleep(0.05)  # the queue feeder thread may still be flushing the report
    while True:
        try:
            _record(results.get_nowait(), outcomes)
        except queue.Empty:
            return


def _record(report: tuple[int, bool, Any, str, str], outcomes: dict[int, Outcome]) -> None:
    rank, ok, value, error, etype = report
    if ok:
        try:
            value = pickle.loads(value)
        except Exception:  # noqa: BLE001 - reported as this rank's failure
            ok, value, error, etype = False, None, traceback.format_exc(), "unpickling"
    outcomes[rank] = Outcome(rank, ok, value, error, etype)


def spawn(world_size: int, fn: Callable[..., Any], args: Sequence[Any] = (), **kw: Any) -> list[Any]:
    """Like :func:`launch`, but raise :class:`RankFailed` if any rank failed."""
    outcomes = launch(world_size, fn, args, **kw)
    failed = [o for o in outcomes if not o.ok]
    if failed:
        text = "\n".join(f"--- rank {o.rank} ({o.error_type}) ---\n{o.error}" for o in failed)
        raise RankFailed(f"{len(failed)} of {world_size} ranks failed:\n{text}")
    return [o.value for o in outcomes]


def wait_until(done: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Return once ``done()`` holds (another thread or process makes it true); raise
    ``AssertionError`` naming ``what`` if it does not within ``timeout`` seconds."""
    tick = threading.Event()  # a wait that never fires: a pause that is not a bare sleep
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:g}s for {what}")
        tick.wait(0.005)


def stay_until_reported(directory: str, rank: int, ranks: Sequence[int],
                        timeout: float = 60.0) -> None:
    """In a rank with its result: note it in ``directory`` (shared by the ranks), then
    wait until each of ``ranks`` noted its own. A rank that left earlier would show a
    peer still in its call a departure instead of the failure that peer should report."""
    def noted(r: int) -> str:
        return os.path.join(directory, f"reported.{r}")

    open(noted(rank), "w").close()
    wait_until(lambda: all(os.path.exists(noted(r)) for r in ranks),
               f"ranks {list(ranks)} to have their results", timeout)


def run_threads(world_size: int, fn: Callable[..., Any], args: Sequence[Any] = (), *,
                timeout: float = 30.0, op_timeout: float = 10.0, settings: Any = None,
                hosts: Sequence[str] | None = None) -> list[Any]:
    """Run ``fn(group, *args)`` on ``world_size`` threads over the loopback transport.

    ``hosts`` (one name per rank) makes the ranks look as if they ran on those hosts.
    """
    from tandem.collectives.group import ProcessGroup
    from tandem.config import Settings
    from tandem.transport.loopback import LoopbackHub

    hub = LoopbackHub(world_size, hosts)
    cfg = settings or Settings()
    groups = [ProcessGroup(t, list(range(world_size)), 0, "threads", op_timeout, cfg, "loopback")
              for t in hub.transports]
    values: list[Any] = [None] * world_size
    errors: dict[int, str] = {}

    def body(r: int) -> None:
        try:
            values[r] = fn(groups[r], *args)
        except BaseException:  # noqa: BLE001 - reported below
            errors[r] = traceback.format_exc()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    if stuck:
        for transport in hub.transports:
            transport.close()
        raise RankFailed(f"ranks {stuck} did not finish within {timeout}s")
    if errors:
        raise RankFailed("\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items())))
    return values
