"""Worker bootstrap: every worker the launcher starts runs through this file.

::

    python tandem/run/_worker.py --parent PID script.py ARGS...     # like python script.py
    python tandem/run/_worker.py --parent PID -m pkg.mod ARGS...    # like python -m pkg.mod
    python tandem/run/_worker.py --parent PID --exec prog ARGS...   # --no-python: exec prog

    options before the target: --forward 15,2,... --kill-signal N --cgroup DIR
                               --scratch DIR --report FD --guard FD

The process started this way forks the worker, which runs the target, and becomes
its supervisor (``_supervisor.py``, loaded after the fork so that the worker does not
wait for it: it ties the worker's life to the launcher's and kills whatever the worker
leaves behind). An uncaught exception in the worker is recorded without any
decorator: rank, host, time, exception type, message and traceback go as JSON to
``$TANDEM_ERROR_FILE`` before the worker exits 1. What the worker prints for it is
decided by ``_tracebacks.py``: the first failing rank's traceback with tandem's frames
folded, one line for the others and for Ctrl-C.
It is run by path, not with ``-m``, so that a worker does not import tandem (and torch)
unless its script does; it therefore imports the standard library only.
"""

import os  # already imported by the interpreter's startup, so never shadowed
import sys

_HERE = os.path.dirname(os.path.realpath(__file__))
if sys.path and sys.path[0] and os.path.realpath(sys.path[0]) == _HERE:
    sys.path.pop(0)  # our directory must not shadow the script's imports

import ctypes  # noqa: E402 - after the path fix above
import importlib.util  # noqa: E402
import json  # noqa: E402
import runpy  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import List, NoReturn, Set, Tuple  # noqa: E402

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(option, value, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _fork(parent: int, kill_signal: int, blocked: Set[int], guard: int = -1) -> Tuple[int, bool]:
    """Start the worker: its pid in the supervisor (this process), 0 in the worker; and
    whether the kernel tells the supervisor of the launcher's death with ``kill_signal``.

    ``blocked`` signals stay blocked in the supervisor until it has its handlers, so
    none is lost or handled by the wrong process in between. ``guard``: the job reaper's
    pipe, which the supervisor holds until it exits and the worker closes at once.
    """
    told = not parent or _prctl(PR_SET_PDEATHSIG, kill_signal)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans below us come to us, not to init
    if parent and os.getppid() != parent:
        os._exit(1)  # the launcher died before we could ask to follow it
    signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    supervisor = os.getpid()
    worker = os.fork()
    if worker == 0:
        if guard >= 0:
            os.close(guard)  # the reaper must not wait for the worker's helpers too
        os.setpgid(0, 0)  # a process group of its own, killed as a whole
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != supervisor:
            os._exit(1)  # the supervisor is already gone
        signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
        return 0, False
    try:
        os.setpgid(worker, worker)  # as the worker does: whoever runs first
    except OSError:
        pass  # the worker did it and already runs its program
    return worker, told


def _load(name: str) -> ModuleType:
    """``<name>.py`` beside this file, without importing the tandem package."""
    spec = importlib.util.spec_from_file_location(f"tandem.run.{name}",
                                                  os.path.join(_HERE, f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record_error(exc: BaseException, path: str, shown: bool, tracebacks: ModuleType,
                 when: float) -> None:
    """Write the JSON error record for ``exc`` to ``path`` unless one is already there.

    ``traceback`` is what a person reads (tandem's frames folded unless TANDEM_DEBUG=1),
    ``traceback_full`` has every frame; ``shown``: the worker printed its traceback.
    ``tracebacks`` is ``_tracebacks.py``, loaded; ``when`` the time to record.
    """
    if not path or os.path.exists(path):
        return  # the script recorded its own error
    record = {
        "rank": int(os.environ.get("RANK", "-1")),
        "local_rank": int(os.environ.get("LOCAL_RANK", "-1")),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": when,
        "exc_type": tracebacks.type_name(exc),
        "message": str(exc),
        "traceback": tracebacks.full(exc, fold=not tracebacks.debugging(os.environ)),
        "traceback_full": tracebacks.full(exc, fold=False),
        "shown": shown,
        "blames": _blamed(exc),
    }
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except OSError as err:
        sys.stderr.write(f"tandemrun worker: cannot write error file {path}: {err}\n")


def _blamed(exc: BaseException) -> List[int]:
    """The ranks a timeout in ``exc``'s chain names as the ones never heard from
    (``CollectiveTimeoutError.missing``): the launcher names them as the root cause."""
    seen: Set[int] = set()
    cur: "BaseException | None" = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        missing = getattr(cur, "missing", None)
        if isinstance(missing, (tuple, list)) and missing \
                and all(isinstance(r, int) for r in missing):
            return sorted(missing)
        cur = cur.__cause__ or cur.__context__
    return []


def _fail(exc: BaseException) -> NoReturn:
    """Record ``exc``, print it once and readably (``_tracebacks.py``), exit as Python would."""
    try:
        tracebacks = _load("_tracebacks")
        tracebacks.add_hint(exc)
        text, whole, when = tracebacks.report(exc)
        record_error(exc, os.environ.get("TANDEM_ERROR_FILE", ""), whole, tracebacks, when)
        sys.stderr.write(text)
        sys.stderr.flush()
    except KeyboardInterrupt:
        pass  # Ctrl-C reached this rank while it reported an earlier error: that is enough
    if isinstance(exc, KeyboardInterrupt):
        # die of SIGINT, as Python does after an uncaught KeyboardInterrupt (exit
        # handlers still run), without printing a traceback on top of our line
        sys.excepthook = lambda *args: None
        raise exc
    sys.exit(1)


def _run(mode: str, target: str, args: List[str]) -> None:
    if mode == "exec":
        os.execvp(target, [target, *args])
    sys.argv = [target, *args]
    if mode == "module":
        sys.path.insert(0, os.getcwd())
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")


def main(argv: List[str]) -> None:
    # (the launcher passes a real-time --kill-signal; SIGUSR2 serves runs by hand)
    options = {"--parent": "0", "--cgroup": "", "--scratch": "", "--forward": "",
               "--kill-signal": str(int(signal.SIGUSR2)), "--report": "-1", "--guard": "-1"}
    mode = "script"
    while argv and (argv[0] in options or argv[0] in ("-m", "--exec", "--")):
        flag = argv.pop(0)
        if flag in options:
            options[flag] = argv.pop(0)
        elif flag == "-m":
            mode = "module"
        elif flag == "--exec":
            mode = "exec"
        else:
            break
    if not argv:
        sys.exit("usage: _worker.py --parent PID [--forward SIGNUMS] [--kill-signal N] "
                 "[--cgroup DIR] [--scratch DIR] [--report FD] [--guard FD] [-m | --exec] "
                 "TARGET [ARGS...]")
    parent, kill_signal = int(options["--parent"]), int(options["--kill-signal"])
    forward = [int(s) for s in options["--forward"].split(",") if s]
    report = int(options["--report"])
    guard = int(options["--guard"])
    worker, told = _fork(parent, kill_signal, {*forward, kill_signal}, guard)
    if worker:
        _load("_supervisor").Supervisor(
            parent, forward, kill_signal, worker=worker, told=told,
            cgroup=options["--cgroup"], scratch=options["--scratch"],
            report_fd=report).supervise()  # exits with the worker's status
    if report >= 0:
        os.close(report)  # the supervisor's line to the launcher
    if hasattr(sys.stdout, "reconfigure") and not sys.stdout.isatty():
        sys.stdout.reconfigure(line_buffering=True)  # lines reach the console as printed
    try:
        _run(mode, argv[0], argv[1:])
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - recorded, printed, then exit 1
        _fail(exc)


if __name__ == "__main__":
    main(sys.argv[1:])
